"""Token choices per vocabulary slice, the draft's and greedy verification's: only (value, index) pairs cross ranks.

With the head split by vocabulary over a token group (regions/topology.head_rows), each rank holds
its slice of a draft block's logits (the target head's rows and the Markov head's same rows,
`regions.dspark.DraftHead`). Position i's token is the argmax over the whole vocabulary of
base_i + transition(previous), previous being position i - 1's token (the anchor for i = 0): so the
positions run in order, and at each one every rank scores its slice and keeps its best (`pick`:
value, global index, the lowest index among its equal values), the ranks' pairs are all-gathered and
every rank takes the same winner (`merge_picks`: the highest value, the lowest index among equal
values: exactly the one-rank argmax). The winner is the next position's `previous` on every rank.

P tiny collectives (B pairs a rank each) replace one all-gather of the block's logits [B, P, V].
On cpu the loop runs on the host between the `pick` calls (`pick_block`); on trn2 it runs inside the
draft step's one executable, the pairs all-gathered in the graph (compiler/draft_layers.py, with the
glue below).

The target's greedy steps choose the same way (`slice_best` on each rank's slice of a step's logits
[B, T, rows], `merge_best` of a group's pairs, runtime/ranks.Comm.argmax_pairs): where no request of a step
needs the full logits (runtime/schedule.py says which do), one all-gather of B * T pairs replaces the
all-gather of the logits [B, T, V].
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

# pick(position [B], previous [B]) -> this rank's (value [B] float32, global index [B] int64)
Pick = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]
# gather(value [B], index [B]) -> every rank's, rank-major: (values [world, B], indices [world, B])
Gather = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]


def merge_picks(values: Tensor, index: Tensor) -> Tensor:
    """The ranks' picks (values, index [n, ...], each rank's best of its slice) -> the winner's index
    [...] int64: the highest value, the lowest index among equal values (a padding row's index lies
    past the vocabulary, so it loses every tie with a real row)."""
    best = values.amax(0, keepdim=True)
    tied = values == best
    far = torch.iinfo(torch.int64).max
    return torch.where(tied, index.long(), torch.full_like(index, far, dtype=torch.int64)).amin(0)


def pick_block(pick: Pick, anchor: Tensor, positions: int, gather: Gather, groups: int, group: int) -> Tensor:
    """Every token group's block chosen on every rank: anchor [B] (this rank's group's anchor tokens),
    `positions` block positions, `gather` over all `groups` token groups' ranks (rank-major, a group's
    ranks adjacent) -> drafts [groups, B, P] int64. This rank runs `pick` for its own `group`; the
    others' winners come with the same gathers (the leader needs every group's drafts)."""
    B = anchor.shape[0]
    previous, drafts = anchor, []
    for i in range(positions):
        value, index = pick(torch.full((B,), i, dtype=torch.int64), previous)
        values, indices = gather(value, index)  # [world, B]
        winners = merge_picks(values.view(groups, -1, B).transpose(0, 1), indices.view(groups, -1, B).transpose(0, 1))
        drafts.append(winners)  # [groups, B]
        previous = winners[group]
    return torch.stack(drafts, -1)


# --- the same choice inside one executable (trn2's draft step, compiler/draft_layers.py): glue between
# the head's `pick` calls and the pairs' all-gathers


def pack_pick(value: Tensor, index: Tensor) -> Tensor:
    """A rank's pick (value [B] float32, global index [B]) -> one float32 tensor [B, 2] to all-gather
    (an index below 2^24 is exact in float32: every vocabulary is smaller)."""
    return torch.stack((value.float(), index.float()), -1)


def merge_pairs(pairs: Tensor, rank: Tensor, *, groups: int) -> tuple[Tensor, Tensor]:
    """Every rank's packed picks [world, B, 2] (rank-major, a group's ranks adjacent) and this rank ->
    (each group's winners [groups, B] int64, this rank's group's [B]: the next position's `previous`)."""
    world, B = pairs.shape[0], pairs.shape[1]
    values = pairs[..., 0].view(groups, world // groups, B).transpose(0, 1)
    index = pairs[..., 1].long().view(groups, world // groups, B).transpose(0, 1)
    winners = merge_picks(values, index)
    group = (rank // (world // groups)).clamp(0, groups - 1).reshape(1)
    return winners, torch.index_select(winners, 0, group).squeeze(0)


def next_position(position: Tensor) -> Tensor:
    """The block position the next `pick` scores: one on."""
    return position + 1


def stack_drafts(*winners: Tensor) -> Tensor:
    """Each position's winners [groups, B] -> the drafts [groups, B, P]."""
    return torch.stack(winners, -1)


def slice_best_in_graph(logits: Tensor, first: Tensor, vocab: int) -> tuple[Tensor, Tensor]:
    """`slice_best` as one graph for every rank (`first` a tensor: this rank's first global index):
    the rows past the vocabulary at -inf, NaN where a real logit is not finite; a slice wholly past
    the vocabulary gives (-inf, `first`) as `slice_best` does."""
    index = first + torch.arange(logits.shape[-1], device=logits.device)
    real = index < vocab
    x = logits.float().masked_fill(~real, float("-inf"))
    best = x.argmax(-1)  # the lowest index among equal values
    value = x.gather(-1, best.unsqueeze(-1)).squeeze(-1)
    finite = (torch.isfinite(x) | ~real).all(-1)
    return torch.where(finite, value, torch.full_like(value, float("nan"))), first + best


def slice_best(logits: Tensor, first: int, vocab: int) -> tuple[Tensor, Tensor]:
    """A greedy step's choice on one rank's vocabulary slice: logits [..., rows] (the global indices
    `first` .. `first` + rows - 1, the rows past `vocab` padding) -> per row this slice's best (value
    [...] float32, global index [...] int64: the lowest among equal values). The value is NaN where any
    of the slice's real logits is not finite (NaN or infinity), so that the merged row is NaN and the
    scheduler's non-finite check fires as it does on the whole logits; a slice wholly past the
    vocabulary scores -inf at an index past it (it never wins, `merge_picks`).

    On cpu this runs on the host over the head's output; on trn2 with several ranks the head's `best`
    method runs it in the head's NEFF (`slice_best_in_graph`): a pair a row leaves the device instead
    of the slice's logits."""
    real = max(0, min(logits.shape[-1], vocab - first))
    if real == 0:
        shape = logits.shape[:-1]
        return torch.full(shape, float("-inf")), torch.full(shape, first, dtype=torch.int64)
    x = logits[..., :real].float()
    best = x.argmax(-1)  # the lowest index among equal values
    value = x.gather(-1, best.unsqueeze(-1)).squeeze(-1)
    value = torch.where(torch.isfinite(x).all(-1), value, torch.full_like(value, float("nan")))
    return value, first + best


def merge_best(values: Tensor, index: Tensor) -> tuple[Tensor, Tensor]:
    """The slices' bests (values, index [n, ...], `slice_best` of each rank of a token group, in rank
    order) -> the whole vocabulary's (value [...] float32, index [...] int64): the one-rank argmax
    (`merge_picks`) and its value, NaN where any slice's is (its index then means nothing: the
    scheduler refuses the row)."""
    bad = values.isnan().any(0)
    value = torch.where(bad, torch.full_like(values[0], float("nan")), values.amax(0))
    winner = torch.where(bad, torch.zeros_like(index[0]), merge_picks(values.nan_to_num(float("-inf")), index))
    return value, winner
