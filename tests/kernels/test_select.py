"""top_indices: the reference's tie rule, and the blockwise form the trn2 target lowers it to."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.kernels.select import top_indices_blockwise, top_indices_ref


def stable_top(scores: torch.Tensor, k: int) -> torch.Tensor:
    """k largest, lowest index first among ties, from numpy's stable argsort (independent of torch.sort)."""
    return torch.from_numpy(np.ascontiguousarray(np.argsort(-scores.numpy(), axis=-1, kind="stable")[..., :k]))


def tied(shape, levels: int, seed: int, invisible: float = 0.3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(0, levels, shape, generator=g).float()
    return s.masked_fill(torch.rand(shape, generator=g) < invisible, float("-inf"))


@pytest.mark.parametrize(
    "width, k, block",
    [(100, 3, 8), (64, 4, 8), (65, 4, 8), (1000, 2, 4), (5, 5, 16), (40000, 512, 16384), (70001, 2048, 16384)],
)
def test_blockwise_equals_the_reference(width, k, block):
    """One round and several (1000 entries in blocks of 4: five rounds), a width that is not a multiple
    of the block (padding), rows with fewer visible entries than k (-inf ties)."""
    s = tied((2, 3, width), levels=3, seed=width)
    want = stable_top(s, k)
    assert torch.equal(top_indices_ref(s, k), want)
    assert torch.equal(top_indices_blockwise(s, k, block), want)


@settings(max_examples=60, deadline=None)
@given(
    width=st.integers(1, 300),
    k=st.integers(1, 4),
    block=st.sampled_from([8, 16]),
    levels=st.integers(1, 5),
    seed=st.integers(0, 2**16),
)
def test_blockwise_property(width, k, block, levels, seed):
    k = min(k, width)
    s = tied((1, 2, width), levels, seed)
    assert torch.equal(top_indices_blockwise(s, k, block), stable_top(s, k))


def test_blockwise_needs_k_at_most_half_a_block():
    with pytest.raises(ValueError, match="top-9 of 40 entries: blockwise selection needs k <= 8"):
        top_indices_blockwise(torch.zeros(1, 40), 9, 16)
