"""One step through a V4.1 model, as the reference and the bundle runtime both run it.

Everything the runtime needs from the model family and nothing that builds a
region: the activation dtypes, the layer plan (which attention kind each layer
runs, read from the config's schedule), a step's host inputs (`Batch`), the
host-side token embedding and engram tables, and `run_layers`, the one wiring
of region inputs and outputs through the layers and the head.
"""

from __future__ import annotations

from collections.abc import Container, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor, nn

from deepinfer.bundles.manifest import (
    ENGRAM_ROWS_MIX,
    LAYER_ROWS,
    MOE_EXPERTS,
    MOE_IN,
    MOE_OUT,
    OWN_POSITIONS,
    PAGES,
    ROWS_LAYER_SLOT,
)
from deepinfer.errors import TensorFileError
from deepinfer.regions.config import TextConfig
from deepinfer.regions.topology import ENGRAM_KV, ENGRAM_MIX

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class LayerPlan:
    layer: int
    attn: str  # window | source | reindex | reuse
    ratio: int
    kv_source: int | None  # the layer whose compressed KV / index keys it reads
    candidate_source: bool
    uses_candidates: bool
    engram_rows: int  # 0 when the layer has no engram


def plan_layers(c: TextConfig) -> list[LayerPlan]:
    """Each layer's attention kind, its kv source, candidate role and engram rows (the one
    place that reads the config's attention schedule)."""
    plans = []
    for layer in range(c.num_hidden_layers):
        kind = c.layer_kind(layer)
        rows = dict(zip(c.engram_layer_ids, c.engram_num_embeddings)).get(layer, 0)
        plans.append(
            LayerPlan(
                layer=layer,
                attn=kind,
                ratio=c.compress_ratios[layer],
                kv_source=None if kind == "window" else c.kv_source_of(layer),
                candidate_source=layer == c.candidate_source_layer_id,
                uses_candidates=c.uses_candidates(layer) and kind == "reindex",
                engram_rows=rows,
            )
        )
    return plans


@dataclass
class Batch:
    """One step's inputs: T tokens for each of B sequences (-1 positions are padding)."""

    tokens: Tensor  # [B, T] int64
    positions: Tensor  # [B, T] int64
    slots: Tensor  # [B] int64
    block_table: Tensor  # [B, MB] int64
    hashes: Tensor | None  # [B, T, engram_layers, hash_heads] int64
    is_image: Tensor  # [B, T] bool
    image_rows: Tensor | None = None  # [B, T, D]: the embeddings of image positions (vision tower)
    # [B] int64: the one row of each sequence whose logits the step gives (its last fed row: what a
    # prompt chunk samples from), the head run on those rows only; None: the head on every row
    heads: Tensor | None = None


class Merge(Protocol):
    """How the cp ranks of a token group combine the divided attention's shares (regions/divided.py
    defines each merge; the runtime computes them with collectives over the cp group)."""

    def queries(self, query: Tensor) -> Tensor:
        """This rank's query rows [B, T, W] (`query` stage) -> every cp rank's [cp, B, T, W], in cp order."""
        ...

    def topk(self, values: Tensor, index: Tensor) -> Tensor:
        """This rank's K best (score, global index) [B, T, K] -> the selection over the context."""
        ...

    def blocks(self, values: Tensor, index: Tensor) -> Tensor:
        """This rank's best candidate blocks (score, global id) -> the pool's chosen block ids."""
        ...

    def attention(self, numerator: Tensor, top: Tensor, total: Tensor) -> Tensor:
        """This rank's partial attention -> the attention over every rank's keys [B, T, H, hd] float32."""
        ...


def run_layers(
    plans,
    invoke,
    states,
    h,
    pre,
    batch: Batch,
    engram: EngramRows | None,
    capture=None,
    merge: Merge | None = None,
    *,
    divided_engram: bool = False,
) -> Tensor:
    """h, pre through every layer's regions and the head -> logits [B, T, V].

    `invoke(layer, slot, *inputs, method=...)` runs one region call (`slot`: engram, attn,
    moe; the head is layer -1, slot "head"; `method` decode unless named) and returns its outputs;
    `states[layer]` holds the layer's state views by name; `engram` the host
    tables the engram layers' rows come from (None without engram layers). This
    is the one wiring of region inputs, shared by the reference and the bundle
    runtime. `capture` (a `regions.stepper.Capture`) runs at each of its layers on the streams and
    `pre` that layer's attention site reads (after its engram): the DSpark draft's features.
    With `merge` (the paged state divided over cp ranks, regions/divided.py) a compressed layer's
    attention runs as its stages, merged by `merge` between them (`divided_attention`).
    With `divided_engram` (a token group of several ranks: regions/engram.py) an engram runs as `kv`,
    whose partials `invoke` sums over the token group, then `mix`.
    """
    topk = cand = None
    engram_index = 0
    token_mask = (batch.positions >= 0) & ~batch.is_image
    for p in plans:
        if p.engram_rows:
            h = run_engram(p.layer, invoke, h, engram, batch, engram_index, token_mask, divided_engram)
            engram_index += 1
        if capture is not None and p.layer in capture.layers:
            capture(p.layer, h, pre, batch.positions, batch.slots)
        h, pre, topk, cand = layer_regions(p, invoke, states[p.layer], h, pre, batch, topk, cand, merge)
    (logits,) = invoke(-1, "head", *head_rows(h, pre, batch))
    return logits


def head_rows(h: Tensor, pre: Tensor, batch: Batch) -> tuple[Tensor, Tensor]:
    """The streams [B, T, ...] the head takes: every row, or each sequence's `batch.heads` row
    ([B, 1, ...]: the head's T = 1 bucket) when the step wants one row of logits a sequence."""
    if batch.heads is None:
        return h, pre
    b = torch.arange(h.shape[0])
    return h[b, batch.heads].unsqueeze(1), pre[b, batch.heads].unsqueeze(1)


def layer_regions(p: LayerPlan, invoke, st, h, pre, batch: Batch, topk, cand, merge: Merge | None = None):
    """Layer `p`'s attention and MoE (after its engram), a region call each (a divided attention's
    stages each, with `merge`), on the selection `topk` and candidate pool `cand` the layers before
    it made -> (h, pre, topk, cand), the selection and pool as this layer leaves them."""
    common = (batch.positions, batch.slots, batch.block_table)
    if p.attn == "window":
        h, pre = invoke(p.layer, "attn", h, pre, batch.positions, batch.slots, st["win"])
    elif merge is not None:
        h, pre, topk, cand = divided_attention(p, invoke, st, h, pre, batch, topk, cand, merge)
    elif p.attn == "source":
        parts = (st["part_kv"], st["part_gate"]) if p.ratio > 1 else ()
        out = invoke(p.layer, "attn", h, pre, *common, st["win"], st["ckv"], st["ikeys"], *parts)
        h, pre, topk = out[:3]
        cand = out[3] if p.candidate_source else cand
    elif p.attn == "reindex":
        extra = (cand,) if p.uses_candidates else ()
        h, pre, topk = invoke(p.layer, "attn", h, pre, *common, st["win"], st["ckv"], st["ikeys"], *extra)
    else:
        h, pre = invoke(p.layer, "attn", h, pre, *common, st["win"], st["ckv"], topk)
    h, pre = invoke(p.layer, "moe", h, pre, batch.is_image)
    return h, pre, topk, cand


class Rows(Protocol):
    """How a token group's ranks exchange a prompt chunk divided by rows (regions/rows.py; the runtime's
    collectives over the group, `runtime.ranks.Comm`)."""

    def rows(self, t: Tensor) -> Tensor:
        """This rank's rows [B, n, ...] -> the chunk's [B, n * d, ...], the ranks' rows in order."""
        ...

    def pages(self, *parts: Tensor) -> list[Tensor]:
        """Each of this rank's pages [B, L, C] -> every rank's [d, B, L, C]."""
        ...

    def routes(self, x: Tensor, weights: Tensor, experts: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """This rank's rows' MoE inputs and routing [B, n, ...] -> the chunk's [B, n * d, ...] (the MoE's
        experts are divided over the ranks), one collective."""
        ...

    def combine(self, partial: Tensor) -> Tensor:
        """The MoE's float32 partials [B, n * d, D] over every row -> this rank's rows [B, n, D], summed
        over the ranks."""
        ...

    def scatter(self, partial: Tensor, name: str) -> Tensor:
        """`combine` for other float32 partials [B, n * d, ...], counted as collective `name`."""
        ...


def rows_steps(plans, invoke, states, h, pre, batch: Batch, engram: EngramRows | None, rows: Rows, own: slice):
    """A prompt step whose chunk's rows are divided over a token group (regions/rows.py): h, pre are this
    rank's rows `own` of the chunk; each layer's attention runs as its `rows` twin's stages with the
    gathers between them, the MoE's site and expand on its rows (`moe_in`, `moe_out`) and its experts
    on every row (`moe_experts`: the rows' inputs and routing gathered, the partials reduce-scattered back);
    an engram layer's `kv` on every row (each rank has the chunk's looked-up rows), reduce-scattered to
    its `rows_mix` on the rank's rows; the head on the chunk's rows (gathered) -> logits [B, T, rows] (or
    each sequence's `batch.heads` row), as `run_layers`'. A generator: it yields each collective as
    (a `rows` method, its arguments) and takes back its result (`regions.micro.drive`), so the one
    collective stream can be interleaved with another micro-batch's computation."""
    T = batch.positions.shape[1]
    step = (batch.positions, batch.slots, batch.block_table)
    token_mask = (batch.positions >= 0) & ~batch.is_image
    contexts: dict[int, list[Tensor]] = {}
    carry: dict[str, Tensor] = {}
    engram_index = 0
    drop = last_reads(plans)
    for p in plans:
        st = states[p.layer]
        if p.engram_rows:
            rows_in = looked_up(engram, batch, engram_index)  # the chunk's every row
            (partial,) = invoke(p.layer, "engram", *rows_in, method=ENGRAM_KV, whole=False)
            kv = yield rows.scatter, (partial, "engram reduce-scatter")
            (h,) = invoke(p.layer, "engram", h, kv, token_mask[:, own], method=ENGRAM_ROWS_MIX, chunk=T)
            engram_index += 1
        x, mix_pre, post, comb, packed = invoke(
            p.layer, "rows", h, pre, batch.positions[:, own], method="rows_in", chunk=T
        )
        packed = yield rows.rows, (packed,)
        if p.attn == "source":
            parts = (st["part_kv"], st["part_gate"]) if p.ratio > 1 else ()
            pages = invoke(p.layer, "rows", packed, *step, st["ckv"], st["ikeys"], *parts, method="rows_write")
            contexts[p.layer] = yield rows.pages, tuple(pages)
        extra: tuple = ()
        if p.attn != "window":
            ckv, ikeys = contexts[p.kv_source]
            extra = (ckv, ikeys) if p.attn in ("source", "reindex") else (ckv,)
            if p.uses_candidates:
                extra += (carry["cand"],)
            elif p.attn == "reuse":
                extra += (carry["topk"],)
        out = invoke(
            p.layer, "rows", h, x, mix_pre, post, comb, *step, packed, st["win"], *extra, method="rows_attend", chunk=T
        )
        h, pre = out[0], out[1]
        if p.attn in ("source", "reindex"):
            carry["topk"] = out[2]
        if p.candidate_source:
            carry["cand"] = out[3]
        x, weights, experts, post, comb, pre = invoke(
            p.layer, "moe", h, pre, batch.is_image[:, own], method=MOE_IN, chunk=T
        )
        (partial,) = invoke(p.layer, "moe", *(yield rows.routes, (x, weights, experts)), method=MOE_EXPERTS)
        (h,) = invoke(p.layer, "moe", (yield rows.combine, (partial,)), h, post, comb, method=MOE_OUT, chunk=T)
        contexts.pop(drop.get(p.layer, -1), None)
    whole = yield rows.rows, (h,)
    (logits,) = invoke(-1, "head", *head_rows(whole, (yield rows.rows, (pre,)), batch))
    return logits


def run_rows_fused(plans, invoke_layer, states, h, pre, batch: Batch, engram: EngramRows | None, own: slice | Tensor):
    """A prompt step divided by rows on trn2's fused layers (compiler/rows_layers.py): h, pre are this
    rank's rows `own` of the chunk (in micro order where the modules run micro-batches,
    `regions.micro.micro_rows`); each layer is one execution of its kind's `rows` module
    (`invoke_layer(layer, values, slot=, method=, chunk=)`, the collectives inside) on the values its
    inputs name: the streams, the chunk's and the rank's rows' step inputs, the layer's state, the
    selection its rank's rows carry from the layer before, a kv source's joined context for the layers
    that read it, the chunk's every engram row -> the rank's rows (h, pre) after the last layer."""
    token_mask = (batch.positions >= 0) & ~batch.is_image
    step = {
        "positions": batch.positions,
        OWN_POSITIONS: batch.positions[:, own],
        "slots": batch.slots,
        "block_table": batch.block_table,
        "is_image": batch.is_image[:, own],
        "token_mask": token_mask[:, own],
    }
    T = batch.positions.shape[1]
    contexts: dict[int, dict[str, Tensor]] = {}
    carry: dict[str, Tensor] = {}
    engram_index = 0
    drop = last_reads(plans)
    for p in plans:
        values = {**step, **carry, **states[p.layer], "h": h, "pre": pre}
        if p.attn in ("reindex", "reuse"):  # a source joins its context inside its module
            values.update(contexts[p.kv_source])
        if p.engram_rows:
            values["rows"], values["rows_s"] = looked_up(engram, batch, engram_index)
            engram_index += 1
        out = invoke_layer(p.layer, values, slot=ROWS_LAYER_SLOT, method=LAYER_ROWS, chunk=T)
        h, pre = out["h"], out["pre"]
        carry.update({k: v for k, v in out.items() if k in ("topk", "cand")})
        if p.attn == "source":
            contexts[p.layer] = {k: out[k] for k in PAGES}
        contexts.pop(drop.get(p.layer, -1), None)
    return h, pre


def last_reads(plans) -> dict[int, int]:
    """layer -> the kv source whose gathered context it is the last to read: a divided step drops the
    context after that layer, so that it holds one source's at a time (compiler/budget.py counts it)."""
    last = {p.kv_source: p.layer for p in plans if p.kv_source is not None}
    return {layer: source for source, layer in last.items()}


def looked_up(engram: EngramRows | None, batch: Batch, index: int) -> tuple[Tensor, Tensor]:
    """The step's table rows of the `index`-th engram layer (fp8 codes and their scales), looked up on the
    host from the step's hashes."""
    assert engram is not None and batch.hashes is not None, "an engram layer needs its tables and hashes"
    return engram.rows(index, batch.hashes[:, :, index])


def run_engram(
    layer: int, invoke, h, engram: EngramRows | None, batch: Batch, index: int, token_mask, divided: bool
) -> Tensor:
    """Layer `layer`'s engram (the `index`-th engram layer) on the streams -> h. `divided`: its
    projection divided over the token group, run as `kv` (whose partials `invoke` sums over the
    group) and `mix` (regions/engram.py)."""
    rows, rows_s = looked_up(engram, batch, index)
    if not divided:
        (h,) = invoke(layer, "engram", h, rows, rows_s, token_mask)
        return h
    (kv,) = invoke(layer, "engram", rows, rows_s, method=ENGRAM_KV)
    (h,) = invoke(layer, "engram", h, kv, token_mask, method=ENGRAM_MIX)
    return h


def run_fused(
    plans,
    invoke_layer,
    invoke,
    states,
    h,
    pre,
    batch: Batch,
    engram: EngramRows | None,
    regions: Container[int] = (),
    merge: Merge | None = None,
    *,
    divided_engram: bool = False,
    features: Mapping[int, Tensor] | None = None,
    capture=None,
) -> Tensor:
    """h, pre through every layer and the head -> logits, one call a layer (trn2's fused layers:
    compiler/layers.py; their collectives are inside). `invoke_layer(layer, values)` runs layer
    `layer`'s executable on the values its inputs name (the streams, the step's host inputs, the
    layer's state views, the selection carried from the layer before, its engram rows; a layer the
    draft reads, its features ring `features[layer]`, which its capture twin always writes) and returns
    its outputs by name (h, pre; topk and cand where it makes them); `invoke` runs the head.
    The layers in `regions` run per region through `invoke`, as `run_layers` runs them (with `merge`,
    `divided_engram` and `capture`): a layer kind neuronx-cc refused to compile fused (compiler/fallback.py)."""
    carry: dict[str, Tensor] = {}
    engram_index = 0
    token_mask = (batch.positions >= 0) & ~batch.is_image
    step = {
        "positions": batch.positions,
        "slots": batch.slots,
        "block_table": batch.block_table,
        "is_image": batch.is_image,
        "token_mask": token_mask,
    }
    features = {} if features is None else features
    for p in plans:
        if p.layer in regions:
            if p.engram_rows:
                h = run_engram(p.layer, invoke, h, engram, batch, engram_index, token_mask, divided_engram)
                engram_index += 1
            if capture is not None and p.layer in capture.layers:
                capture(p.layer, h, pre, batch.positions, batch.slots)
            out = layer_regions(p, invoke, states[p.layer], h, pre, batch, carry.get("topk"), carry.get("cand"), merge)
            h, pre = out[0], out[1]
            carry.update({k: v for k, v in zip(("topk", "cand"), out[2:]) if v is not None})
            continue
        values = {**step, **carry, **states[p.layer], "h": h, "pre": pre}
        if p.layer in features:
            values["features"] = features[p.layer]
        if p.engram_rows:
            values["rows"], values["rows_s"] = looked_up(engram, batch, engram_index)
            engram_index += 1
        out = invoke_layer(p.layer, values)
        h, pre = out["h"], out["pre"]
        carry.update({k: v for k, v in out.items() if k in ("topk", "cand")})
    (logits,) = invoke(-1, "head", *head_rows(h, pre, batch))
    return logits


def divided_attention(p: LayerPlan, invoke, st, h, pre, batch: Batch, topk, cand, merge: Merge):
    """A compressed layer's attention over the cp ranks' shares: query and gather the queries, select
    (sources and index layers) and merge the selection (and the candidate pool), attend and merge,
    output (this rank's partial streams, summed over the token group at the boundary) -> (h, pre, topk, cand)."""
    common = (batch.positions, batch.slots, batch.block_table)
    x, query, mix_pre, post, comb = invoke(p.layer, "attn", h, pre, batch.positions, method="query")
    queries = merge.queries(query)
    if p.attn == "source":
        parts = (st["part_kv"], st["part_gate"]) if p.ratio > 1 else ()
        out = invoke(p.layer, "attn", x, queries, *common, st["ckv"], st["ikeys"], *parts, method="select")
        topk = merge.topk(out[0], out[1])
        cand = merge.blocks(out[2], out[3]) if p.candidate_source else cand
    elif p.attn == "reindex":
        extra = (cand,) if p.uses_candidates else ()
        values, index = invoke(p.layer, "attn", x, queries, *common, st["ikeys"], *extra, method="select")
        topk = merge.topk(values, index)
    shares = invoke(p.layer, "attn", x, queries, *common, st["win"], st["ckv"], topk, method="attend")
    attention = merge.attention(*shares)
    h, pre = invoke(p.layer, "attn", h, mix_pre, post, comb, batch.positions, attention, method="output")
    return h, pre, topk, cand


def embed_tokens(
    weight: Tensor,
    tokens: Tensor,
    hc_mult: int,
    dtype: torch.dtype,
    is_image: Tensor | None = None,
    image_rows: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The token embedding: tokens [B, T] -> h [B, T, n, D] (contiguous), pre [B, T, n] float32.

    weight [V, D] (checkpoint storage, bf16) is read by a gather of the step's rows (never a
    one-hot product over the vocabulary); the n streams start identical and the first `pre` is
    one-hot on stream 0. Where is_image [B, T] is set, the row of image_rows [B, T, D] (the vision
    tower's span) replaces the token's embedding. The one implementation: the host lookup
    (`Embedding`) and the device region (`regions.head.Embed`) both run it.
    """
    e = weight[tokens].to(dtype)  # [B, T, D]
    if image_rows is not None:
        assert is_image is not None, "image rows come with their positions"
        e = torch.where(is_image.unsqueeze(-1), image_rows.to(dtype), e)
    h = e.unsqueeze(2).expand(-1, -1, hc_mult, -1).contiguous()
    pre = torch.zeros(*tokens.shape, hc_mult, dtype=torch.float32)
    pre[..., 0] = 1
    return h, pre


class Embedding(nn.Module):
    """Token embedding on the host (cpu bundles, the reference): ids -> n identical streams and the
    one-hot first `pre` (`embed_tokens`)."""

    def __init__(self, weight: Tensor, hc_mult: int, dtype: torch.dtype):
        super().__init__()
        self.weight = weight  # [V, D], kept in checkpoint storage (bf16)
        self.hc_mult = hc_mult
        self.dtype = dtype

    def forward(
        self, tokens: Tensor, is_image: Tensor | None = None, image_rows: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """tokens [B, T] -> h [B, T, n, D], pre [B, T, n] (`embed_tokens`)."""
        return embed_tokens(self.weight, tokens, self.hc_mult, self.dtype, is_image, image_rows)


class EngramRows:
    """The engram tables on the host: a step reads only the rows its hashes name.

    Per engram layer, its table's fp8 codes [rows, hd] and ue8m0 scales [rows, hd/32]
    (uint8; memory-mapped from the bundle's host file, so only touched pages are read).
    `rows` hands a step's rows to the engram region still fp8: B*T*hash_heads rows of
    hd + hd/32 bytes per layer (batch 64 decode at release dims: 1,536 rows, 396 KiB),
    half of what decoding them to bf16 on the host would send (768 KiB); the region
    decodes them in-graph, as it decoded its own table before.
    """

    def __init__(self, tables: list[tuple[Tensor, Tensor]]):
        self.tables = tables

    @classmethod
    def of(cls, c: TextConfig, tensors: dict[str, Tensor], source: str) -> EngramRows:
        """The tables of config `c` from `tensors` (checkpoint names, as `c.engram_tables()` lists
        them), each checked for shape and dtype; `source` names the file in errors."""
        hd, per_row = c.engram_head_dim, -(-c.engram_head_dim // 32)
        tables = []
        for codes, scales, rows in c.engram_tables():
            pair = []
            for name, shape in ((codes, (rows, hd)), (scales, (rows, per_row))):
                t = tensors.get(name)
                if t is None:
                    raise TensorFileError(source, name, "missing engram table")
                if tuple(t.shape) != shape or t.dtype != torch.uint8:
                    raise TensorFileError(
                        source,
                        name,
                        f"{list(t.shape)} {t.dtype}, expected {list(shape)} uint8 (fp8 codes or ue8m0 scales as bytes)",
                    )
                pair.append(t)
            tables.append((pair[0], pair[1]))
        return cls(tables)

    def rows(self, index: int, hashes: Tensor) -> tuple[Tensor, Tensor]:
        """hashes [B, T, hash_heads] int64 (rows of engram layer `index`'s table) -> its codes
        [B, T, hash_heads, hd] and scales [B, T, hash_heads, hd/32], uint8, gathered on the host."""
        codes, scales = self.tables[index]
        return codes[hashes], scales[hashes]
