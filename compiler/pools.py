"""Layer-major KV/state pools of a bundle.

Every state view of the same name and owner kind across layers is one pool
`[layers owning it, slots | blocks, ...]`, so a layer's view is one contiguous
slice `pool[index]`. Reuse and reindex layers bind their kv source's slices.
With a draft, its features pool (`DRAFT_FEATURES`, regions/drafting.py) is one more:
[target layers it reads, slots, sliding_window + dspark_block_size, hidden], bound to no layer.
The per-slot rings (window, the compressor's partial groups) have `slack` rows more
(regions/state.py): with a draft, its block.
"""

from __future__ import annotations

from deepinfer.bundles.manifest import Pool
from deepinfer.regions.config import TextConfig
from deepinfer.regions.dspark import features_ring
from deepinfer.regions.state import PAGED, StateSpec, check_block_size, layer_state
from deepinfer.regions.step import LayerPlan

DRAFT_FEATURES = "dspark_features"


def pool_name(state: str, p: LayerPlan) -> str:
    return state if state == "win" else f"{state}.r{p.ratio}"


def plan_pools(
    c: TextConfig, plans: list[LayerPlan], *, block_size: int, dtype, draft: bool = False, slack: int = 0
) -> tuple[dict[str, Pool], dict[int, dict[str, tuple[str, int]]]]:
    """-> (pools by name, per layer: state name -> (pool, row)); with `draft`, the draft's features pool;
    the per-slot rings `slack` rows beyond their window or ratio (`Geometry.slack`)."""
    check_block_size(c, block_size)
    specs: dict[str, StateSpec] = {}
    layers: dict[str, list[int]] = {}
    owned: dict[int, dict[str, tuple[str, int]]] = {}
    for p in plans:
        owned[p.layer] = {}
        for spec in layer_state(c, p, slots=1, blocks=1, block_size=block_size, dtype=dtype, slack=slack):
            name = pool_name(spec.name, p)
            specs.setdefault(name, spec)
            rows = layers.setdefault(name, [])
            owned[p.layer][spec.name] = (name, len(rows))
            rows.append(p.layer)
    pools = {
        name: Pool(
            state=spec.name,
            dtype=str(spec.dtype).removeprefix("torch."),
            dim="blocks" if spec.name in PAGED else "slots",
            entry_shape=tuple(spec.shape[1:]),
            layers=tuple(layers[name]),
        )
        for name, spec in specs.items()
    }
    if draft:
        pools[DRAFT_FEATURES] = Pool(
            state="features",
            dtype=str(dtype).removeprefix("torch."),
            dim="slots",
            entry_shape=(features_ring(c), c.hidden_size),
            layers=tuple(c.dspark_target_layer_ids),
        )
    bindings = {}
    for p in plans:
        views = {"win": owned[p.layer]["win"]}
        if p.kv_source is not None:
            src = owned[p.kv_source]
            views.update({k: v for k, v in src.items() if k in PAGED})
            if p.attn == "source":
                views.update(owned[p.layer])
        bindings[p.layer] = views
    return pools, bindings
