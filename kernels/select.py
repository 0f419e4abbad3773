"""Top-k selection with a fixed tie rule, and its blockwise lowering for neuronx-cc.

`top_indices` is the indexer's and the candidate pool's selection: the k largest
scores of each row, the lowest index first among equal scores. Its reference is a
stable descending sort of the whole row. neuronx-cc rewrites a sort (or a
sort-then-slice) into its top-k, which fails on rows wider than 16,384 entries
(aws-neuron-sdk issue 1339); at the release's 1M context a ratio-1 row has
1,048,576 entries. The trn2 lowering (`top_indices_blockwise`) therefore never
sorts more than `BLOCK` entries: the row is cut into blocks of `BLOCK`, each
block's k best are kept with their indices, and the winners are selected again
(in blocks, until at most `BLOCK` remain). Each winner of the row is a winner of
its block under the same order (score descending, index ascending), and the
winners stay in index order among equal scores (block order, then a stable sort
within the block), so the result is the reference's, index for index.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F

from deepinfer.kernels.registry import LOWERINGS, register

BLOCK = 16384  # neuronx-cc's widest top-k (trn2.MAX_SELECTION_WIDTH)


def top_indices_ref(scores: Tensor, k: int) -> Tensor:
    """Indices [..., k] (int64) of the k largest scores along the last dim, in descending order of
    score; among equal scores the lowest index wins.

    `torch.topk` leaves the order of ties unspecified, and on CPU it depends on the row width:
    the same scores padded to another width (a longer forward, another pool size) select
    differently. Entries whose index heads all fall under the relu score exactly 0 and tie
    often, so the rule must be fixed: a stable descending sort makes selection independent of
    width and chunking.
    """
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


def top_indices_blockwise(scores: Tensor, k: int, block: int = BLOCK) -> Tensor:
    """`top_indices_ref`'s result with no sort wider than `block`."""
    values, index = scores, None  # index: the row position of each entry of `values`
    while values.shape[-1] > block:
        if 2 * k > block:
            raise ValueError(f"top-{k} of {values.shape[-1]} entries: blockwise selection needs k <= {block // 2}")
        width = values.shape[-1]
        pad = -width % block
        # padding sorts after every real entry: -inf at a higher position than any real one
        blocks = F.pad(values, (0, pad), value=float("-inf")).unflatten(-1, (-1, block))  # [..., nb, block]
        best = torch.sort(blocks, dim=-1, descending=True, stable=True)
        pos = (best.indices[..., :k] + torch.arange(0, width + pad, block).unsqueeze(-1)).flatten(-2)  # [..., nb*k]
        values = best.values[..., :k].flatten(-2)
        index = pos if index is None else F.pad(index, (0, pad), value=-1).gather(-1, pos)
    top = torch.sort(values, dim=-1, descending=True, stable=True).indices[..., :k]
    return top if index is None else index.gather(-1, top)


top_indices = register(top_indices_ref)
LOWERINGS["trn2"]["top_indices"] = (lambda: True, top_indices_blockwise)
