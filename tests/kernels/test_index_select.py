"""index_topk: the indexer's selection in one op, its reference against a numpy choice, and the tiled
form trn2 lowers it to against the reference, index for index, with its scratch bounded by the tile."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deepinfer.compiler import budget
from deepinfer.kernels import reference_decompositions, target_decompositions
from deepinfer.kernels.attention import index_score_ref
from deepinfer.kernels.index_select import index_topk_ref, index_topk_tiled

POOL_BLOCKS, BLOCK = 3, 4


def case(seed: int, width: int, ties: bool, dtype=torch.float32, B: int = 2, T: int = 3, H: int = 4, d: int = 8):
    """Index queries, keys, head weights and visible lengths; with `ties`, small integers (many equal
    scores, and whole rows of zeros under the relu)."""
    g = torch.Generator().manual_seed(seed)
    qi, keys, w = (
        torch.randn(B, T, H, d, generator=g),
        torch.randn(B, width, d, generator=g),
        torch.randn(B, T, H, generator=g),
    )
    if ties:
        qi, keys = qi.round(), (keys > 0.7).float()
    vis_len = torch.randint(0, width + 3, (B, T), generator=g)
    vis_len[0, 0] = 2  # fewer visible entries than k: picks of -inf
    return qi.to(dtype), keys.to(dtype), w.to(dtype), vis_len


def numpy_choice(qi, keys, w, vis_len, cand, k: int, make_cand: bool):
    """The selection written out on numpy's stable argsort (independent of the kernel's helpers)."""
    width = keys.shape[1]
    visible = torch.arange(width) < vis_len.unsqueeze(-1)
    s = index_score_ref(qi, keys, w, visible).float().numpy()
    made = None
    if make_cand:
        nb = -(-width // BLOCK)
        best = np.full((*s.shape[:2], nb), -np.inf, dtype=np.float32)
        for b in range(nb):
            best[..., b] = s[..., b * BLOCK : (b + 1) * BLOCK].max(-1)
        last = (vis_len.numpy() - 1) // BLOCK
        best[np.arange(nb) == last[..., None]] = np.inf
        top = np.argsort(-best, axis=-1, kind="stable")[..., :POOL_BLOCKS]
        keep = np.zeros(best.shape, dtype=bool)
        np.put_along_axis(keep, top, np.take_along_axis(best, top, -1) > -np.inf, -1)
        made = np.repeat(keep, BLOCK, -1)[..., :width] & visible.numpy()
    elif cand is not None:
        s = np.where(cand.numpy(), s, -np.inf)
    top = np.sort(np.argsort(-s, axis=-1, kind="stable")[..., : min(k, width)], -1)
    return np.where(np.isfinite(np.take_along_axis(s, top, -1)), top, -1), made


MODES = ["every entry", "makes the pool", "reads a pool"]


def mode_args(mode: str, shape, seed: int):
    cand = torch.rand(shape, generator=torch.Generator().manual_seed(seed)) > 0.5 if mode == "reads a pool" else None
    return cand, mode == "makes the pool"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed, width, ties", [(0, 37, False), (1, 130, True), (2, 257, True), (3, 64, False)])
def test_the_reference_is_the_numpy_choice(mode, seed, width, ties):
    qi, keys, w, vis_len = case(seed, width, ties)
    cand, make = mode_args(mode, (2, 3, width), seed)
    topk, made = index_topk_ref(qi, keys, w, vis_len, cand, 5, POOL_BLOCKS, BLOCK, make)
    want, want_made = numpy_choice(qi, keys, w, vis_len, cand, 5, make)
    assert np.array_equal(topk.numpy(), want)
    assert (made.numel() == 0) if want_made is None else np.array_equal(made.numpy(), want_made)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed, width, k, tile", [(4, 300, 5, 16), (5, 257, 40, 32), (6, 100, 3, 64), (7, 64, 9, 64)])
def test_tiles_select_what_the_whole_row_selects(mode, dtype, seed, width, k, tile):
    """More tiles than one, a last tile cut short, k above a tile's width, one tile exactly; many ties."""
    qi, keys, w, vis_len = case(seed, width, ties=seed % 2 == 0, dtype=dtype)
    cand, make = mode_args(mode, (2, 3, width), seed)
    want = index_topk_ref(qi, keys, w, vis_len, cand, k, POOL_BLOCKS, BLOCK, make)
    got = index_topk_tiled(qi, keys, w, vis_len, cand, k, POOL_BLOCKS, BLOCK, make, tile=tile)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_a_tile_that_splits_a_block_is_refused():
    qi, keys, w, vis_len = case(8, 100, False)
    with pytest.raises(ValueError, match="splits candidate blocks"):
        index_topk_tiled(qi, keys, w, vis_len, None, 5, POOL_BLOCKS, BLOCK, True, tile=18)


class Select(torch.nn.Module):
    def forward(self, qi, keys, w, vis_len):
        return torch.ops.deepinfer.index_topk(qi, keys, w, vis_len, None, 64, 8, 8, True)


def test_the_trn2_lowering_holds_a_tile_not_the_row():
    """Exported and lowered as trn2 lowers it: the same choice, and the peak of its intermediates a
    fraction of the reference's (the whole row's per-head scores)."""
    qi, keys, w, vis_len = case(9, 4 * 16384, ties=True, B=1, T=4, H=8, d=16)
    args = (qi, keys, w, vis_len)
    program = torch.export.export(Select(), args)
    ref = program.run_decompositions(reference_decompositions())
    tiled = program.run_decompositions(target_decompositions("trn2"))
    for got, want in zip(tiled.module()(*args), ref.module()(*args)):
        assert torch.equal(got, want)
    assert budget.scratch_bytes(tiled) < budget.scratch_bytes(ref) / 2
