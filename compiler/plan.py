"""Region planning: which (kind, method) each layer runs, and the executables to build.

Layers are grouped by region kind (the attention variant, engram, moe; the
head once, and the token embedding once where it runs on the device). Each
kind is traced once per bucket: per (batch, tokens), and per
context bucket too for the kinds whose shapes depend on the context (those
reading a block table: attention with compressed state). Its weights are
stacked over the layers of that kind so layer i's weights are slice `index`
of each stack.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deepinfer.regions.base import Region
from deepinfer.regions.config import TextConfig
from deepinfer.regions.plan import make_embed, make_head, make_layer_regions
from deepinfer.regions.state import reads_context
from deepinfer.regions.step import LayerPlan, plan_layers
from deepinfer.bundles.topology import Topology

METHOD = "decode"


@dataclass
class KindPlan:
    kind: str
    region: Region                                         # a representative instance (meta weights)
    layers: list[int] = field(default_factory=list)        # layers running this kind, in stack order
    slot: str = ""                                         # embed | engram | attn | moe | head
    full_specs: list = field(default_factory=list)         # the unsharded weights (as in the checkpoint)

    @property
    def reads_context(self) -> bool:
        """Built per context bucket: its input shapes depend on the block-table width."""
        return reads_context(self.region)


@dataclass
class RegionPlan:
    layers: list[LayerPlan]
    kinds: dict[str, KindPlan]
    # layer -> {slot: (kind, index in that kind's stacks)}
    bindings: dict[int, dict[str, tuple[str, int]]]

    def executables(self, shapes: list[tuple[int, int]], contexts: tuple[int, ...],
                    gathered: int = 1) -> list[tuple[str, str, int, int, int | None]]:
        """(kind, method, batch, tokens, context) to build: context is one of `contexts` for the
        kinds that read it, None for the others. With EP dispatch over `gathered` token groups
        the MoE runs on the gathered rows: its batch buckets are `gathered` times larger."""
        return [(k, METHOD, b * (gathered if k == "moe" else 1), t, c) for k, kp in self.kinds.items()
                for b, t in shapes for c in (contexts if kp.reads_context else (None,))]


def plan_regions(c: TextConfig, dtype: torch.dtype, cache_quant: bool, topo: Topology = Topology(),
                 fp8_format: str = "e4m3fn", *, device_embedding: bool = False) -> RegionPlan:
    """Regions shaped for one rank of `topo` (one executable set serves every rank), decoding
    fp8 weights stored in `fp8_format` (the weight recipe's). With `device_embedding` the token
    embedding is a region kind of its own (`embed`, first), its table a weight stack held whole
    by every rank; without, the runtime looks the rows up on the host.

    Their weight buffers are on the meta device: shapes and dtypes, no memory (a release
    plan would otherwise allocate a real region of every kind). Whoever runs a region binds
    real tensors to it first (`deepinfer diff`, the trn2 check)."""
    with torch.device("meta"):
        p = _plan_regions(c, dtype, cache_quant, topo, device_embedding)
    for kp in p.kinds.values():
        kp.region.fp8_format = fp8_format
    return p


def _plan_regions(c: TextConfig, dtype: torch.dtype, cache_quant: bool, topo: Topology,
                  device_embedding: bool) -> RegionPlan:
    layers = plan_layers(c)
    kinds: dict[str, KindPlan] = {}
    if device_embedding:
        embed = make_embed(c, dtype)
        kinds[embed.kind] = KindPlan(embed.kind, embed, layers=[-1], slot="embed", full_specs=embed.specs)
    bindings: dict[int, dict[str, tuple[str, int]]] = {}
    for p in layers:
        regions = make_layer_regions(c, p, dtype, cache_quant, topo)
        full = make_layer_regions(c, p, dtype, cache_quant) if topo.world > 1 else regions
        bindings[p.layer] = {}
        for slot, region in regions.items():
            kp = kinds.setdefault(region.kind, KindPlan(region.kind, region, slot=slot,
                                                        full_specs=full[slot].specs))
            bindings[p.layer][slot] = (region.kind, len(kp.layers))
            kp.layers.append(p.layer)
    head = make_head(c, dtype)
    kinds[head.kind] = KindPlan(head.kind, head, layers=[-1], slot="head", full_specs=head.specs)
    return RegionPlan(layers, kinds, bindings)
