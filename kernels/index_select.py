"""The indexer's selection as one op, and its tiled lowering for trn2 (issue 41).

`index_topk` scores a row's visible compressed entries with the indexer (`index_score`) and keeps
its best `k` (`top_indices`: the lowest index first among equal scores); on a kv source that makes
the candidate pool it also chooses the pool's blocks, and on a layer that reads the pool it scores
only the entries in it. Its reference is those ops over the whole row, as the attention regions ran
them before this op.

The whole row's intermediates grow with rows x index heads x context: a prompt chunk's 128 rows a
rank (8 sequences of 8,192 tokens over 64 ranks) scored against 1M entries hold 64 GiB of per-head
scores, twice (the product and its relu), 137 GiB of scratch a rank of 24. The trn2 lowering
(`index_topk_tiled`) scores `TILE` entries at a time and keeps a running top-k (and the pool's
running best blocks) beside them, so its scratch grows with the tile, not the context.

Why it selects what the reference selects, index for index: a tile's entries all come after the
running winners' (tiles go in index order), and the winners are kept in the order the reference's
sort gives them (score descending, index ascending). A stable sort of (winners, tile) puts equal
scores in index order, so every merge keeps what a sort of the whole row would keep of the entries
seen so far. The pool's blocks never straddle tiles (`TILE` is a multiple of the block) and merge
the same way. Each entry's score is the reference's product over the index head dim; a tile changes
only which entries share the product, which a compiler may sum in another order: the layer checks
compare within the dtype's tolerance (compiler/layers.py).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F

from deepinfer.kernels.attention import index_score_ref
from deepinfer.kernels.registry import LOWERINGS, register
from deepinfer.kernels.select import BLOCK, top_indices_blockwise, top_indices_ref

TILE = BLOCK  # entries scored at a time: a tile's top-k never sorts more than k + TILE


def visible_entries(start: int, stop: int, vis_len: Tensor) -> Tensor:
    """Whether entries start..stop are visible to each row (vis_len [B, T]) -> [B, T, stop - start]."""
    return torch.arange(start, stop, device=vis_len.device) < vis_len.unsqueeze(-1)


def block_scores(scores: Tensor, vis_len: Tensor, block: int, first: int = 0) -> Tensor:
    """The candidate pool's block scores of entries `first * block`.. (scores [B, T, n]): each block's
    best entry, the block of a row's latest visible entry +inf (always kept) -> [B, T, ceil(n / block)]."""
    padded = F.pad(scores, (0, -scores.shape[-1] % block), value=float("-inf"))
    best = padded.unflatten(-1, (-1, block)).amax(-1)
    last = torch.div(vis_len - 1, block, rounding_mode="floor").unsqueeze(-1)
    ids = torch.arange(first, first + best.shape[-1], device=scores.device)
    return best.masked_fill(ids == last, float("inf"))


def blocks_mask(values: Tensor, index: Tensor, blocks: int, block: int, width: int) -> Tensor:
    """The chosen blocks (their scores and ids [B, T, N]; a -inf one is not chosen) as entries ->
    bool [B, T, width]."""
    keep = torch.zeros((*values.shape[:-1], blocks), dtype=torch.bool, device=values.device)
    keep = keep.scatter(-1, index, values > float("-inf"))
    return keep.repeat_interleave(block, dim=-1)[..., :width]


def kept_indices(values: Tensor, index: Tensor) -> Tensor:
    """The picks (their scores and entry indices [B, T, K]) in index order, -1 where the score is -inf
    (fewer visible entries than K)."""
    order = index.sort(dim=-1)
    return torch.where(torch.isfinite(values.gather(-1, order.indices)), order.values, -1)


def index_topk_ref(
    qi: Tensor,
    keys: Tensor,
    w: Tensor,
    vis_len: Tensor,
    cand: Tensor | None,
    k: int,
    pool_blocks: int,
    block: int,
    make_cand: bool,
) -> tuple[Tensor, Tensor]:
    """The indexer's selection over a row of compressed entries.

    qi [B, T, Hi, di] the index queries; keys [B, W, di] the index keys; w [B, T, Hi] the head weights;
    vis_len [B, T] each row's visible entries; cand [B, T, W] bool the candidate pool the row reads
    (None: every entry); k the entries kept; with `make_cand`, the pool made: the best `pool_blocks`
    blocks of `block` entries by their best score, the latest visible block always.
    -> (topk [B, T, min(k, W)] int64 in index order, -1 where fewer are visible; the pool made
    [B, T, W] bool, or an empty bool tensor without `make_cand`).
    """
    width = keys.shape[1]
    visible = visible_entries(0, width, vis_len)
    scores = index_score_ref(qi, keys, w, visible)
    made = torch.zeros(0, dtype=torch.bool, device=qi.device)
    if make_cand:
        best = block_scores(scores, vis_len, block)
        top = top_indices_ref(best, min(pool_blocks, best.shape[-1]))
        made = blocks_mask(best.gather(-1, top), top, best.shape[-1], block, width) & visible
    elif cand is not None:
        scores = scores.masked_fill(~cand, float("-inf"))
    top = top_indices_ref(scores, min(k, width))
    return kept_indices(scores.gather(-1, top), top), made


class Running:
    """The best `k` (score, index) pairs of the entries seen so far, in the reference's order."""

    def __init__(self, k: int):
        self.k = k
        self.values: Tensor | None = None
        self.index: Tensor | None = None

    def add(self, values: Tensor, index: Tensor) -> None:
        """Merge the next entries: values [B, T, n] at indices index [n], all after those seen."""
        index = index.expand(values.shape)
        if self.values is not None and self.index is not None:
            values, index = torch.cat((self.values, values), -1), torch.cat((self.index, index), -1)
        top = top_indices_blockwise(values, min(self.k, values.shape[-1]))
        self.values, self.index = values.gather(-1, top), index.gather(-1, top)


def index_topk_tiled(
    qi: Tensor,
    keys: Tensor,
    w: Tensor,
    vis_len: Tensor,
    cand: Tensor | None,
    k: int,
    pool_blocks: int,
    block: int,
    make_cand: bool,
    tile: int = TILE,
) -> tuple[Tensor, Tensor]:
    """`index_topk_ref`'s result, scoring `tile` entries at a time (a multiple of `block`)."""
    width = keys.shape[1]
    if width <= tile:
        return index_topk_ref(qi, keys, w, vis_len, cand, k, pool_blocks, block, make_cand)
    if tile % block:
        raise ValueError(f"a selection tile of {tile} entries splits candidate blocks of {block}")
    blocks = -(-width // block)
    kept, pool = Running(min(k, width)), Running(min(pool_blocks, blocks))
    for start in range(0, width, tile):
        stop = min(start + tile, width)
        cols = torch.arange(start, stop, device=qi.device)
        scores = index_score_ref(qi, keys[:, start:stop], w, visible_entries(start, stop, vis_len))
        if make_cand:
            best = block_scores(scores, vis_len, block, start // block)
            pool.add(best, torch.arange(start // block, start // block + best.shape[-1], device=qi.device))
        elif cand is not None:
            scores = scores.masked_fill(~cand[..., start:stop], float("-inf"))
        kept.add(scores, cols)
    assert kept.values is not None and kept.index is not None
    made = torch.zeros(0, dtype=torch.bool, device=qi.device)
    if make_cand:
        assert pool.values is not None and pool.index is not None
        made = blocks_mask(pool.values, pool.index, blocks, block, width) & visible_entries(0, width, vis_len)
    return kept_indices(kept.values, kept.index), made


index_topk = register(index_topk_ref)
LOWERINGS["trn2"]["index_topk"] = (lambda: True, index_topk_tiled)
