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


def make_attention(c: TextConfig, p: LayerPlan, dtype: torch.dtype, cache_quant: bool) -> Region:
    if p.attn == "window":
        return WindowAttention(c, dtype=dtype, cache_quant=cache_quant)
    if p.attn == "source":
        return SourceAttention(c, ratio=p.ratio, candidate_source=p.candidate_source, dtype=dtype,
                               cache_quant=cache_quant)
    if p.attn == "reindex":
        return ReindexAttention(c, ratio=p.ratio, uses_candidates=p.uses_candidates, dtype=dtype,
                                cache_quant=cache_quant)
    return ReuseAttention(c, ratio=p.ratio, dtype=dtype, cache_quant=cache_quant)


def make_layer_regions(c: TextConfig, p: LayerPlan, dtype: torch.dtype, cache_quant: bool) -> dict[str, Region]:
    """The regions of one layer: optional `engram`, `attn`, `moe`."""
    regions = {}
    if p.engram_rows:
        regions["engram"] = Engram(c, rows=p.engram_rows, dtype=dtype)
    regions["attn"] = make_attention(c, p, dtype, cache_quant)
    regions["moe"] = MoE(c, dtype=dtype)
    return regions


def make_head(c: TextConfig, dtype: torch.dtype) -> Head:
    return Head(c, dtype=dtype)
