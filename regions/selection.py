"""The indexer's selection helpers: which compressed entries (and candidate blocks) a step attends to.

The attention regions (`regions/attention.py`) score the visible compressed entries with the
indexer and keep the best `index_topk`; with a candidate pool they first keep the best blocks of
entries. These are the pieces of that choice that need no region: the candidate pool over a
sequence's scores, the same over one cp rank's share of them, and the mask of a rank's entries in
the chosen blocks. Shapes: scores [B, T, Wc] (Wl: one cp rank's entries), vis_len [B, T].
"""

from __future__ import annotations

import torch
from torch import Tensor

from deepinfer.kernels import select as _select  # noqa: F401  (registers top_indices)
from deepinfer.kernels.index_select import block_scores, blocks_mask
from deepinfer.regions import divided

ops = torch.ops.deepinfer


def torch_topk(scores: Tensor, k: int) -> Tensor:
    return scores.topk(k, dim=-1).indices


def candidate_blocks(scores: Tensor, vis_len: Tensor, topk_blocks: int, block: int, select=None) -> Tensor:
    """Candidate pool: top blocks by max score, the block of the latest visible entry always kept.

    scores [B, T, Wc] (-inf where invisible); vis_len [B, T] -> bool [B, T, Wc].
    """
    best = block_scores(scores, vis_len, block)
    top = (select or ops.top_indices)(best, min(topk_blocks, best.shape[-1]))
    return blocks_mask(best.gather(-1, top), top, best.shape[-1], block, scores.shape[-1])


def local_candidate_blocks(
    scores: Tensor, gidx: Tensor, vis_len: Tensor, topk_blocks: int, block: int, width: int
) -> tuple[Tensor, Tensor]:
    """`candidate_blocks` over one cp rank's entries (scores [B, T, Wl] at global indices gidx [Wl], in
    blocks of `block` entries that never straddle a KV block; `width` the sequence's compressed width)
    -> its best blocks as (score [B, T, N], global block id [B, T, N]), padded to N = the pool's
    blocks, the block of the latest visible entry scored +inf (always kept)."""
    block_scores = scores.unflatten(-1, (-1, block)).amax(-1)  # [B, T, NBl]
    ids = torch.div(gidx[::block], block, rounding_mode="floor")  # [NBl] global block ids
    last = torch.div(vis_len - 1, block, rounding_mode="floor").unsqueeze(-1)
    block_scores = block_scores.masked_fill(ids == last, float("inf"))
    N = min(topk_blocks, -(-width // block))
    top = ops.top_indices(block_scores, min(N, block_scores.shape[-1]))
    ids = torch.where(gidx[::block] >= divided.NO_ENTRY, divided.NO_ENTRY, ids)
    return divided.pad_to(block_scores.gather(-1, top), ids[top], N)


def in_blocks(gidx: Tensor, chosen: Tensor, block: int, blocks: int) -> Tensor:
    """Whether each entry gidx [Wl] lies in one of the chosen candidate blocks [B, T, N] (global ids of
    the sequence's `blocks` candidate blocks, -1: none) -> [B, T, Wl]."""
    B, T, _ = chosen.shape
    ids = torch.where(chosen >= 0, chosen, blocks)  # none: a column past the sequence's blocks
    mask = torch.zeros((B, T, blocks + 1), dtype=torch.bool, device=chosen.device).scatter(-1, ids, True)
    entry_block = torch.div(gidx, block, rounding_mode="floor").clamp(max=blocks)  # [Wl]; past the table: none
    return mask[..., :blocks].gather(-1, entry_block.clamp(max=blocks - 1).expand(B, T, -1)) & (entry_block < blocks)
