"""Per-rank weight shards: which part of a checkpoint tensor rank r holds (regions/topology.py).

    moe, dspark_moe,  routed experts (every one; the target's, or the draft's own for the
    ep > 1            draft's `dspark_moe`) -> each expert's intermediate [start, stop) of
                      `expert_slice`: w1, w3 rows (codes and per-row scales), w2 byte columns
                      [start/2, stop/2) and the scale blocks they span, zero-padded to the
                      slice width and `expert_scale_blocks`; zeros for ranks without a slice
                      shared expert -> its intermediate columns [start, stop) of `shared_slice`,
                      zero-padded to the slice width; zeros for ranks without a slice
    attn_*,           heads over the token group (regions/topology.attention_share): wq_b rows
    dspark_attn,      of this rank's heads; window kinds (the draft's too) and cp = 1: sink entries
    tp * cp > 1       of its heads, wo_a rows (and, past G ranks, columns) and wo_b columns of its
                      groups; compressed kinds at cp > 1: sink entries of its tp share, whole
                      32-blocks of the share's wo_a rows and those wo_b columns (zeros past it),
                      indexer.wq_b rows over cp
    head, tp * cp > 1 head.weight [V, D] -> its vocabulary rows [start, stop) of `head_slice`,
                      zero-padded to `head_rows`; zeros for ranks past the vocabulary
    dspark_head,      markov_head.head.weight [V, R]: the same vocabulary rows as the head's
    tp * cp > 1
    engram,           wkv [(n+1)*D, hash_heads*hd] -> its input columns [start, stop) of
    tp * cp > 1       `engram_slice` (scales: the 32-blocks), zero-padded to `engram_width`;
                      zeros for ranks past the columns
    everything else   replicated

A cut is declarative (`cut`): the weight pass streams exactly those rows and
columns from the checkpoint to each rank's file, and `shard` applies the same
cut to a whole tensor (the tests' reference). fp8 weights [rows, cols] carry
ue8m0 scales [rows/32, cols/32]: slicing rows or columns of a weight slices the
matching scale blocks (shards are whole blocks, which `topology.check` guarantees).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from deepinfer.bundles.topology import Topology
from deepinfer.regions.config import TextConfig, draft_moe_config
from deepinfer.regions.topology import (
    BLOCK,
    attention_share,
    engram_slice,
    expert_scale_blocks,
    expert_slice,
    expert_slice_width,
    head_index,
    head_rows,
    head_slice,
    shared_slice,
    shared_width,
)

ROUTED = ("w1", "w1_s", "w3", "w3_s", "w2", "w2_s")
SHARED = ("sw1", "sw3", "sw2")
# the kinds whose weights divide as the target's MoE's, with the config each is built with (its expert count)
MOE_KINDS: dict[str, Callable[[TextConfig], TextConfig]] = {"moe": lambda c: c, "dspark_moe": draft_moe_config}
DRAFT_ATTENTION = "dspark_attn"  # divides as the target's window attention (`attn_window`)
# the weights whose rows are the vocabulary, split over a token group as the head's: the target head and
# the draft's Markov head (its transition logits are added to the head's, slice by slice)
VOCABULARY_ROWS = {("head", "head"), ("dspark_head", "markov_head")}


@dataclass(frozen=True)
class Cut:
    """What a rank holds of one (per-layer) checkpoint tensor, in that tensor's own units.

    experts: [e0, e1) of a per-expert stack (one checkpoint tensor per expert); rows: [r0, r1)
    of dim 0; cols: [c0, c1) of dim 1 (of each expert's tensor in a stack); None: all of it.
    zero: the rank holds zeros only.
    The destination may be larger (zero padding): the piece sits at its start.
    """

    experts: tuple[int, int] | None = None
    rows: tuple[int, int] | None = None
    cols: tuple[int, int] | None = None
    zero: bool = False

    @property
    def whole(self) -> bool:
        return self == WHOLE


WHOLE = Cut()
ZERO = Cut(zero=True)


def _span(start: int, stop: int, scale: bool) -> tuple[int, int]:
    return (start // BLOCK, -(-stop // BLOCK)) if scale else (start, stop)


def _shared(name: str, c: TextConfig, topo: Topology, rank: int) -> Cut:
    piece = shared_slice(c, topo, rank)
    if piece is None:
        return ZERO  # this rank adds zeros
    span = _span(*piece, name.endswith("_s"))
    if name.startswith(("sw1", "sw3")):  # [I, D]: intermediate rows
        return Cut(rows=span)
    return Cut(cols=span)  # sw2 [D, I]: intermediate columns


def _routed(name: str, c: TextConfig, topo: Topology, rank: int) -> Cut:
    """Every expert's intermediate slice: w1, w3 [I, D/2] and their scales [I, D/32] by rows; w2
    [D, I/2] by byte columns, its scales [D, I/32] by the 32-blocks the slice spans."""
    piece = expert_slice(c, topo, rank)
    if piece is None:
        return ZERO
    start, stop = piece
    if name.startswith(("w1", "w3")):
        return Cut(rows=piece)
    if name == "w2":
        return Cut(cols=(start // 2, -(-stop // 2)))
    return Cut(cols=_span(start, stop, True))


def _heads(ratio: int, name: str, c: TextConfig, topo: Topology, rank: int) -> Cut:
    """An attention over the token group (regions/topology.attention_share; `ratio` 0 for the window
    kinds, the draft's included, 1 for the compressed ones, whichever ratio): wq_b rows of
    the rank's heads j = t * cp + c; the head-split output (sink of its heads, wo_a rows of its groups,
    or of its one group and its heads' columns, wo_b columns of those groups) or, staged, the
    row-split output (sink of its tp share, rr rows of the share's wo_a, those wo_b columns, zeros
    past the share) and indexer.wq_b rows over the cp ranks."""
    H, hd, G, R = c.num_attention_heads, c.head_dim, c.o_groups, c.o_lora_rank
    share = attention_share(c, topo, ratio)
    j, scale = head_index(topo, rank), name.endswith("_s")
    t, cp = topo.tp_rank(rank), rank % topo.group_size // topo.tp
    if name.startswith("wq_b"):
        width = share.q_heads * hd
        return Cut(rows=_span(j * width, (j + 1) * width, scale))
    if name.startswith("iwq_b") and share.staged:
        width = c.index_n_heads * c.index_head_dim // topo.cp
        return Cut(rows=_span(cp * width, (cp + 1) * width, scale))
    if name == "iweights" and share.staged:  # its index heads' rows of weights_proj (zeros past the heads)
        per = -(-c.index_n_heads // topo.cp)
        return ZERO if cp * per >= c.index_n_heads else Cut(rows=(cp * per, min((cp + 1) * per, c.index_n_heads)))
    if name == "sink":
        first = (t if share.staged else j) * share.heads
        return Cut(rows=(first, first + share.heads))
    if not name.startswith(("wo_a", "wo_b")):
        return WHOLE
    cols: tuple[int, int] | None = None
    if share.staged:
        s0, s1 = t * (G // topo.tp) * R, (t + 1) * (G // topo.tp) * R
        r0 = s0 + cp * share.rows
        if r0 >= s1:
            return ZERO  # past the tp share: zeros
        rows = (r0, min(r0 + share.rows, s1))
    elif G >= topo.group_size:
        rows = (j * share.rows, (j + 1) * share.rows)
    else:  # one group's rows, the columns of the rank's heads inside it
        per_group = H // G
        g = j * share.q_heads // per_group
        rows = (g * R, (g + 1) * R)
        c0 = j * share.q_heads % per_group * hd
        cols = _span(c0, c0 + share.q_heads * hd, scale)
    span = _span(*rows, scale)
    return Cut(rows=span, cols=cols) if name.startswith("wo_a") else Cut(cols=span)


def _head(c: TextConfig, topo: Topology, rank: int) -> Cut:
    piece = head_slice(c, topo, rank)
    return ZERO if piece is None else Cut(rows=piece)  # none: padding only


def _engram(name: str, c: TextConfig, topo: Topology, rank: int) -> Cut:
    piece = engram_slice(c, topo, rank)
    if piece is None:
        return ZERO  # this rank adds zeros
    return Cut(cols=_span(*piece, name.endswith("_s")))


def cut(kind: str, name: str, c: TextConfig, topo: Topology, rank: int) -> Cut:
    """What rank `rank` holds of weight `name` of a region of `kind`."""
    if (kind, name) in VOCABULARY_ROWS and topo.group_size > 1:
        return _head(c, topo, rank)
    if kind in MOE_KINDS and topo.ep > 1:
        m = MOE_KINDS[kind](c)
        if name in ROUTED:
            return _routed(name, m, topo, rank)
        if name.startswith(SHARED):
            return _shared(name, m, topo, rank)
    elif (kind.startswith("attn") or kind == DRAFT_ATTENTION) and topo.group_size > 1:
        return _heads(0 if kind in ("attn_window", DRAFT_ATTENTION) else 1, name, c, topo, rank)
    if kind == "engram" and name.startswith("wkv") and topo.group_size > 1:
        return _engram(name, c, topo, rank)
    return WHOLE


def replicated(kind: str, name: str, c: TextConfig, topo: Topology) -> bool:
    """Whether every rank holds the whole tensor (then a bundle stores it once)."""
    return all(cut(kind, name, c, topo, r).whole for r in range(topo.world))


def shard(
    kind: str, name: str, t: torch.Tensor, c: TextConfig, topo: Topology, rank: int, shape: tuple[int, ...]
) -> torch.Tensor:
    """Rank `rank`'s part of weight `name` of a region of `kind` (full tensor `t`), of `shape`."""
    k = cut(kind, name, c, topo, rank)
    if k.zero:
        return torch.zeros(shape, dtype=t.dtype)
    routed = kind in MOE_KINDS and name in ROUTED
    dim = 1 if routed else 0  # a stack [E, ...]: rows and columns of each expert's tensor
    if k.experts:
        t = t[k.experts[0] : k.experts[1]]
    if k.rows:
        t = t.narrow(dim, k.rows[0], k.rows[1] - k.rows[0])
    if k.cols:
        t = t.narrow(dim + 1, k.cols[0], k.cols[1] - k.cols[0])
    if tuple(t.shape) != tuple(shape):  # zero-padded to a slice width (routed or shared) or the head's rows
        padded = (
            name.startswith(SHARED)
            or routed
            or kind in ("head", "engram", "dspark_head")
            or (kind.startswith("attn") and name.startswith(("wo_", "iweights")))
        )
        if not padded or t.dim() != len(shape) or any(a > b for a, b in zip(t.shape, shape)):
            m = MOE_KINDS.get(kind, lambda c: c)(c)
            raise AssertionError(
                f"{kind}.{name}: shard of rank {rank} has shape {tuple(t.shape)}, the region expects "
                f"{tuple(shape)} (shared width {shared_width(m, topo)}, expert slice {expert_slice_width(m, topo)} "
                f"with {expert_scale_blocks(m, topo)} scale blocks, head rows {head_rows(c, topo)})"
            )
        out = torch.zeros(shape, dtype=t.dtype)
        out[tuple(slice(0, n) for n in t.shape)] = t
        return out
    return t.contiguous()
