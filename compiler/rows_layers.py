"""A prompt chunk divided by rows as one execution a layer (trn2's fused path, issue 41): the stages of
regions/rows.py and regions/moe.py's divided methods, with the collectives between them inside one
module, as compiler/layers.py builds a layer's decode.

On the cpu target a divided chunk runs each stage as a region call with the ranks' collectives on the
host between them (`regions.step.rows_steps`): 5 to 8 executions and 3 to 5 host collectives a layer.
Here a fused layer kind has a second method, `manifest.LAYER_ROWS`, built at each prompt bucket of a
bundle compiled with `[prompt] rows = "divided"` (`RegionPlan.fused_executables`). Its module takes a
rank's T / d rows of the chunk's streams (h, pre) and gives them back through the layer (`ops`):

    engram (where the layer has one): kv on every row of the chunk (the rank's input columns of the
        looked-up rows) -> reduce-scatter of the partial keys and value along the rows -> rows_mix on
        the rank's rows
    rows_in on the rank's rows -> all-gather of the packed window latents (and compressor projections)
        along the rows: the chunk's
    a kv source: rows_write (every rank pools the chunk's groups, writes the entries it owns) ->
        all-gather of every rank's pages of the sequence (stacked) -> outputs `ckv_pages`,
        `ikeys_pages`, which the source's reindex and reuse layers take as inputs
    rows_attend on the rank's rows (every head; the selection over the joined context)
    MoE: moe_in on the rank's rows -> all-gather of x and the routing along the rows -> moe_experts on
        every row (the rank's columns of every expert) -> reduce-scatter of the float32 partials along
        the rows -> moe_out on the rank's rows

The groups are the token group's ranks: divided rows need tp = 1 and ep = cp, so a token group is
every rank (compiler/config.py). A row's streams never leave the device: the embedding takes the rank's
rows' tokens (its executable at T / d tokens), and after the last layer the head is one module too
(`manifest.HEAD_ROWS`, `head_ops`): the rank's rows of h and pre all-gathered along the rows, then the
head's `decode` (this rank's vocabulary slice of every row's logits) or `best` (their greedy pairs).

The compile checks each module on XLA:CPU against the same ops run eagerly (`layers.check`);
tests/trn2/test_rows_layers.py runs it against the cpu runtime's stage calls (`rows_steps`).
"""

from __future__ import annotations

from deepinfer.bundles.manifest import (
    BEST,
    DECODE,
    ENGRAM_ROWS_MIX,
    MOE_EXPERTS,
    MOE_IN,
    MOE_OUT,
    OWN_POSITIONS,
    PAGES,
    ROWS_SLOT,
)
from deepinfer.bundles.topology import Topology
from deepinfer.compiler.layers import Op, Run, _groups
from deepinfer.compiler.plan import Exe, LayerKind, RegionPlan
from deepinfer.compiler.targets.hlo import Collective
from deepinfer.regions.rows import ROWS_ATTEND, ROWS_IN, ROWS_WRITE
from deepinfer.regions.state import Geometry, InputSpec
from deepinfer.regions.topology import ENGRAM_KV

ROWS = 1  # the token dim of a stage's [B, T, ...] values: the gathers and scatters run along it


def ops(lk: LayerKind, plan: RegionPlan, topo: Topology) -> list[Op]:
    """What layer kind `lk` runs on a rank's rows of a divided prompt chunk, in order."""
    slots = dict(lk.slots)
    group = _groups(topo.token_groups())
    out: list[Op] = []
    if "engram" in slots:
        out += [
            Run("engram", ENGRAM_KV),
            Collective("reduce_scatter", "kv", "kv", group, dim=ROWS),
            Run("engram", ENGRAM_ROWS_MIX),
        ]
    out += [
        Run(ROWS_SLOT, ROWS_IN, inputs=(("positions", OWN_POSITIONS),)),
        Collective("all_gather", "packed", "packed", group, dim=ROWS),
    ]
    if ROWS_WRITE in plan.kinds[slots[ROWS_SLOT]].region.methods():
        out += [Run(ROWS_SLOT, ROWS_WRITE, outputs=tuple((p, f"{p}_mine") for p in PAGES))]
        out += [Collective("all_gather", f"{p}_mine", p, group, stack=True) for p in PAGES]
    gathered = (("x", "x_all"), ("weights", "weights_all"), ("experts", "experts_all"))
    return out + [
        Run(ROWS_SLOT, ROWS_ATTEND),
        Run("moe", MOE_IN),
        *(Collective("all_gather", mine, every, group, dim=ROWS) for mine, every in gathered),
        Run("moe", MOE_EXPERTS, inputs=gathered),
        Collective("reduce_scatter", "partial", "out", group, dim=ROWS),
        Run("moe", MOE_OUT),
    ]


def outputs(lk: LayerKind, plan: RegionPlan) -> list[str]:
    """The module's outputs: the rank's rows' streams (h, pre), its rows' carries (the selection, the
    candidate pool) where the attention makes them, and a kv source's joined context."""
    twin = plan.kinds[dict(lk.slots)[ROWS_SLOT]].region
    pages = list(PAGES) if ROWS_WRITE in twin.methods() else []
    return ["h", "pre", *twin.method_outputs(ROWS_ATTEND)[2:], *pages]


def head_ops(topo: Topology, method: str) -> list[Op]:
    """The head of a divided chunk: the rank's rows gathered along the rows, then its `method`."""
    group = _groups(topo.token_groups())
    return [
        Collective("all_gather", "h", "h", group, dim=ROWS),
        Collective("all_gather", "pre", "pre", group, dim=ROWS),
        Run("head", method),
    ]


def head_inputs(plan: RegionPlan, exe: Exe, group: int, geometry: Geometry) -> dict[str, InputSpec]:
    """The head module's inputs: the rank's T / `group` rows of the chunk's streams."""
    specs = plan.kinds["head"].region.method_inputs(DECODE, exe.batch, exe.tokens // group, geometry)
    return {s.name: s for s in specs}


def head_outputs(method: str) -> list[str]:
    return [BEST if method == BEST else "logits"]
