"""Which region kind each layer of a V4.1 config runs, and the regions' factory.

A layer is: [engram] -> attention site (one of the attention kinds) -> FFN site
(MoE). The model ends with the head. `plan_layers` is the single place that
reads the attention schedule of the config.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.regions.attention import ReindexAttention, ReuseAttention, SourceAttention, WindowAttention
from deepinfer.regions.base import Region
from deepinfer.regions.config import TextConfig
from deepinfer.regions.engram import Engram
from deepinfer.regions.head import Head
from deepinfer.regions.moe import MoE
from deepinfer.regions.topology import Topology, attention_config


@dataclass(frozen=True)
class LayerPlan:
    layer: int
    attn: str                   # window | source | reindex | reuse
    ratio: int
    kv_source: int | None       # the layer whose compressed KV / index keys it reads
    candidate_source: bool
    uses_candidates: bool
    engram_rows: int            # 0 when the layer has no engram


def plan_layers(c: TextConfig) -> list[LayerPlan]:
    plans = []
    for layer in range(c.num_hidden_layers):
        kind = c.layer_kind(layer)
        rows = dict(zip(c.engram_layer_ids, c.engram_num_embeddings)).get(layer, 0)
        plans.append(LayerPlan(
            layer=layer, attn=kind, ratio=c.compress_ratios[layer],
            kv_source=None if kind == "window" else c.kv_source_of(layer),
            candidate_source=layer == c.candidate_source_layer_id,
            uses_candidates=c.uses_candidates(layer) and kind == "reindex",
            engram_rows=rows))
    return plans


def make_attention(c: TextConfig, p: LayerPlan, dtype: torch.dtype, cache_quant: bool,
                   topo: Topology = Topology()) -> Region:
    """The layer's attention region, with the heads one tp rank computes."""
    a = attention_config(c, topo)
    if p.attn == "window":
        region = WindowAttention(a, dtype=dtype, cache_quant=cache_quant)
    elif p.attn == "source":
        region = SourceAttention(a, ratio=p.ratio, candidate_source=p.candidate_source, dtype=dtype,
                                 cache_quant=cache_quant)
    elif p.attn == "reindex":
        region = ReindexAttention(a, ratio=p.ratio, uses_candidates=p.uses_candidates, dtype=dtype,
                                  cache_quant=cache_quant)
    else:
        region = ReuseAttention(a, ratio=p.ratio, dtype=dtype, cache_quant=cache_quant)
    region.tp = topo.tp
    return region


def make_layer_regions(c: TextConfig, p: LayerPlan, dtype: torch.dtype, cache_quant: bool,
                       topo: Topology = Topology()) -> dict[str, Region]:
    """The regions of one layer (shaped for one rank of `topo`): optional `engram`, `attn`, `moe`."""
    regions = {}
    if p.engram_rows:
        regions["engram"] = Engram(c, rows=p.engram_rows, dtype=dtype)
    regions["attn"] = make_attention(c, p, dtype, cache_quant, topo)
    regions["moe"] = MoE(c, dtype=dtype, topo=topo)
    return regions


def make_head(c: TextConfig, dtype: torch.dtype) -> Head:
    return Head(c, dtype=dtype)
