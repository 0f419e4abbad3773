"""The regions' factory: the region modules each layer of a V4.1 config runs.

A layer is: [engram] -> attention site (one of the attention kinds) -> FFN site
(MoE). The model ends with the head; the token embedding is a region too where
the target keeps it on the device (`make_embed`). Which kind a layer is comes from
`regions.step.plan_layers`, the single place that reads the attention schedule.
"""

from __future__ import annotations

import dataclasses

import torch

from deepinfer.bundles.topology import Topology
from deepinfer.regions.attention import ReindexAttention, ReuseAttention, SourceAttention, WindowAttention, _Attention
from deepinfer.regions.base import Region, WeightSpec, engram_table_specs
from deepinfer.regions.config import TextConfig
from deepinfer.regions.engram import Engram
from deepinfer.regions.head import Embed, Head
from deepinfer.regions.moe import MoE
from deepinfer.regions.step import LayerPlan, plan_layers
from deepinfer.regions.topology import attention_share, head_rows


def make_attention(
    c: TextConfig, p: LayerPlan, dtype: torch.dtype, cache_quant: bool, topo: Topology = Topology()
) -> Region:
    """The layer's attention region, with the share of it one rank of `topo` holds (its heads over the
    token group: regions/topology.attention_share)."""
    a = attention_share(c, topo, p.ratio)
    region: _Attention
    if p.attn == "window":
        region = WindowAttention(c, dtype=dtype, cache_quant=cache_quant, share=a)
    elif p.attn == "source":
        region = SourceAttention(
            c, ratio=p.ratio, candidate_source=p.candidate_source, dtype=dtype, cache_quant=cache_quant, share=a
        )
    elif p.attn == "reindex":
        region = ReindexAttention(
            c, ratio=p.ratio, uses_candidates=p.uses_candidates, dtype=dtype, cache_quant=cache_quant, share=a
        )
    else:
        region = ReuseAttention(c, ratio=p.ratio, dtype=dtype, cache_quant=cache_quant, share=a)
    region.tp, region.cp = topo.tp, topo.cp
    return region


def make_layer_regions(
    c: TextConfig, p: LayerPlan, dtype: torch.dtype, cache_quant: bool, topo: Topology = Topology()
) -> dict[str, Region]:
    """The regions of one layer (shaped for one rank of `topo`): optional `engram`, `attn`, `moe`."""
    regions: dict[str, Region] = {}
    if p.engram_rows:
        regions["engram"] = Engram(c, dtype=dtype, topo=topo)
    regions["attn"] = make_attention(c, p, dtype, cache_quant, topo)
    regions["moe"] = MoE(c, dtype=dtype, topo=topo)
    return regions


def make_head(c: TextConfig, dtype: torch.dtype, topo: Topology = Topology()) -> Head:
    """The head with the vocabulary rows one rank of `topo` holds (all of them by default)."""
    return Head(c, dtype=dtype, rows=head_rows(c, topo), group=topo.group_size)


def make_embed(c: TextConfig, dtype: torch.dtype) -> Embed:
    return Embed(c, dtype=dtype)


def checkpoint_specs(c: TextConfig) -> list[tuple[str, WeightSpec]]:
    """(layer prefix, weight spec with its key under the prefix) of every checkpoint tensor the
    text model reads but the embedding, in layer order: per layer its engram table (host-resident,
    no region's weight) and its regions' weights, then the head's. What the checkpoint
    generators write, in the order they draw it."""
    out = []
    with torch.device("meta"):  # specs only: no region holds real buffers here
        for p in plan_layers(c):
            prefix = f"layers.{p.layer}."
            for slot, region in make_layer_regions(c, p, torch.float32, True).items():
                if slot == "engram":
                    out += [
                        (prefix, dataclasses.replace(s, key=s.key.removeprefix(prefix)))
                        for s in engram_table_specs(c)
                        if s.key.startswith(prefix)
                    ]
                out += [(prefix, s) for s in region.specs]
        out += [("", s) for s in make_head(c, torch.float32).specs]
    return out
