"""Context parallel that divides the context: what each cp rank holds, and how the ranks' shares merge.

A token group's cp ranks (regions/topology.py) hold its sequences' paged state (compressed KV and
index keys) block-wise: logical block j of a sequence (its positions j * block_size ...) lives on
cp rank j % cp, in that rank's own pool, at the block id the sequence's block table gives for j
(the allocator, `regions.stepper.Allocator`, draws block j from that rank's share). A compressed
entry t is written only by its owner. The per-slot state (window rings, the compressor's partial
groups) stays whole on every rank: every rank compresses, only the owner writes.

A compressed attention layer then runs in stages (`regions/attention.py`: `query`, `select`,
`attend`, `output`), merged between them:

- query: the site's mixes, x and the query latent once; each rank's query rows (its H/(tp*cp)
  heads' queries, on index layers its 1/cp of the indexer's query rows) are all-gathered over the
  cp group (`split_queries` reads them: the tp share's heads, every indexer row).
- select: each rank scores its own entries and keeps its K best as (score, global index) pairs,
  padded to K; `merge_topk` picks the K best of all ranks' pairs in the order cp = 1 uses (score
  descending, the lowest index first among equal scores): each rank's share of the true top-K is
  among its own K best, so the merge is cp = 1's selection exactly. The candidate pool (blocks of
  `candidate_block_size` entries, which never straddle a KV block) merges the same way
  (`merge_blocks`).
- attend: each rank attends over the selected entries it holds, and cp rank 0 over the window
  and the sink too (they count once), returning the unnormalized numerator and the softmax's max
  and sum (`kernels.attention.sparse_attn_partial`); `merge_attention` combines them by
  log-sum-exp into the attention over everything, within float32 rounding of cp = 1.
- output: the merged attention through the rank's rows of its tp share's output projection (the
  row-split output: regions/topology.attention_share); the partial streams are summed over the
  token group at the region boundary.

These functions are the merges' definition: the runtime computes the same with collectives over
the cp group (`runtime.ranks.Comm`), the tests with them directly.
"""

from __future__ import annotations

import torch
from torch import Tensor

# the global index of a local entry no sequence holds (a block-table column past the table): larger
# than every real entry's, so it sorts after them all at equal scores
NO_ENTRY = 1 << 62


def cp_rank(rank: Tensor, tp: int, cp: int) -> Tensor:
    """This rank's place among its token group's cp ranks (0-d int64): rank = group * tp * cp + c * tp + t."""
    return torch.div(torch.remainder(rank, tp * cp), tp, rounding_mode="floor")


def local_pages(block_table: Tensor, cp: int, c: Tensor) -> tuple[Tensor, Tensor]:
    """The block-table columns cp rank `c` holds: (its block ids [B, MBl] (0, the scratch block, past
    the table), their logical block indices [MBl] (>= MB past the table)), MBl = ceil(MB / cp)."""
    B, MB = block_table.shape
    cols = c + cp * torch.arange(-(-MB // cp), device=block_table.device)  # [MBl]
    ids = block_table.gather(1, cols.clamp(max=MB - 1).unsqueeze(0).expand(B, -1))
    return torch.where(cols < MB, ids, 0), cols


def local_entries(cols: Tensor, per_block: int, table_width: int) -> Tensor:
    """Global indices [MBl * P] of the entries of the local blocks `cols` (P = per_block entries each),
    NO_ENTRY for columns past the table (`table_width` blocks)."""
    t = (cols.unsqueeze(-1) * per_block + torch.arange(per_block, device=cols.device)).flatten()
    return torch.where(cols.repeat_interleave(per_block) < table_width, t, NO_ENTRY)


def owned(t: Tensor, per_block: int, cp: int, c: Tensor) -> Tensor:
    """Whether cp rank `c` holds compressed entry t (its logical block t // per_block is c mod cp)."""
    return torch.remainder(torch.div(t, per_block, rounding_mode="floor"), cp) == c


def best(values: Tensor, index: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k best (value, index) pairs along the last dim, in cp = 1's order: value descending, the
    lowest index first among equal values. -> (values [..., k], indices [..., k])."""
    by_index = torch.sort(index, dim=-1, stable=True).indices
    values, index = values.gather(-1, by_index), index.gather(-1, by_index)
    top = torch.sort(values, dim=-1, descending=True, stable=True).indices[..., :k]
    return values.gather(-1, top), index.gather(-1, top)


def pad_to(values: Tensor, index: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """A rank's pairs padded to k (a share narrower than k): -inf at NO_ENTRY."""
    short = k - values.shape[-1]
    if short <= 0:
        return values, index
    shape = (*values.shape[:-1], short)
    return (
        torch.cat((values, torch.full(shape, float("-inf"), dtype=values.dtype, device=values.device)), -1),
        torch.cat((index, torch.full(shape, NO_ENTRY, dtype=index.dtype, device=index.device)), -1),
    )


def merge_topk(values: Tensor, index: Tensor) -> Tensor:
    """Every rank's K best (values [cp, B, T, K], global indices [cp, B, T, K]) -> the selection
    over the whole context [B, T, K]: ascending global indices, -1 for no entry, as cp = 1 makes it."""
    K = values.shape[-1]
    v, i = best(torch.cat(values.unbind(0), -1), torch.cat(index.unbind(0), -1), K)
    order = torch.sort(i, dim=-1).indices
    v, i = v.gather(-1, order), i.gather(-1, order)
    return torch.where(torch.isfinite(v), i, -1)


def merge_blocks(values: Tensor, index: Tensor) -> Tensor:
    """The candidate pool's blocks: every rank's best (block score [cp, B, T, N], global block id)
    -> the chosen block ids [B, T, N] (-1 where none: a block of only invisible entries)."""
    N = values.shape[-1]
    v, i = best(torch.cat(values.unbind(0), -1), torch.cat(index.unbind(0), -1), N)
    return torch.where(v > float("-inf"), i, -1)


def merge_attention(numerator: Tensor, top: Tensor, total: Tensor) -> Tensor:
    """Every rank's partial attention (numerator [cp, B, T, H, D], max [cp, B, T, H], sum [cp, B, T, H],
    `kernels.attention.sparse_attn_partial`) -> the attention over all of them [B, T, H, D] float32.
    The collectives compute it in three parts: the maxima's max over the ranks, `attention_scale` on
    each rank, the scaled shares summed over the ranks, `attention_divide`."""
    numerator, total = attention_scale(numerator, top, total, top.amax(0))
    return attention_divide(numerator.sum(0), total.sum(0))


def attention_scale(numerator: Tensor, top: Tensor, total: Tensor, top_max: Tensor) -> tuple[Tensor, Tensor]:
    """A rank's share (numerator [..., H, D], max and sum [..., H]) scaled to the ranks' max `top_max`:
    what the ranks sum. A rank without keys (max -inf) weighs 0."""
    scale = torch.exp(top - top_max)
    return numerator * scale.unsqueeze(-1), total * scale


def attention_divide(numerator: Tensor, total: Tensor) -> Tensor:
    """The summed scaled shares -> the attention [..., H, D]."""
    return numerator / total.unsqueeze(-1)


def split_queries(queries: Tensor, q_heads: int, hd: int, index_rows: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Every cp rank's query rows [cp, B, T, W] (the `query` stage's, all-gathered: its q_heads heads'
    queries, then its `index_rows` rows of the indexer's queries and its rows of the indexer's head
    weights) -> (the tp share's queries [B, T, cp * q_heads, hd], in cp order: rank (t, c) owns heads
    j = t * cp + c; the indexer's query rows [B, T, Hi*di] and head weights [B, T, cp * rows] (zero rows
    past the heads at the end), both empty where the layer does not select)."""
    width = q_heads * hd
    q = queries[..., :width].movedim(0, 2).unflatten(-1, (q_heads, hd)).flatten(2, 3)
    iq = queries[..., width : width + index_rows].movedim(0, 2).flatten(-2)
    return q, iq, queries[..., width + index_rows :].movedim(0, 2).flatten(-2)
