"""The draft's token choice per vocabulary slice: only (value, index) pairs cross ranks.

With the head split by vocabulary over a token group (regions/topology.head_rows), each rank holds
its slice of a draft block's logits (the target head's rows and the Markov head's same rows,
`regions.dspark.DraftHead`). Position i's token is the argmax over the whole vocabulary of
base_i + transition(previous), previous being position i - 1's token (the anchor for i = 0): so the
positions run in order, and at each one every rank scores its slice and keeps its best (`pick`:
value, global index, the lowest index among its equal values), the ranks' pairs are all-gathered and
every rank takes the same winner (`merge_picks`: the highest value, the lowest index among equal
values: exactly the one-rank argmax). The winner is the next position's `previous` on every rank.

P tiny collectives (B pairs a rank each) replace one all-gather of the block's logits [B, P, V].
On cpu the loop runs on the host between the `pick` calls (`pick_block`); on trn2 it belongs inside
one executable with in-graph all-gathers (not built here).
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
