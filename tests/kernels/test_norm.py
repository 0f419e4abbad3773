"""RMSNorm (kernels/norm.py): float32 math, weight applied before casting back."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import deepinfer.kernels  # noqa: F401  (registers the ops)

rmsnorm = torch.ops.deepinfer.rmsnorm


def _formula(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * w, row by row, in float64."""
    rows = x.double().reshape(-1, x.shape[-1])
    out = torch.empty_like(rows)
    for r in range(rows.shape[0]):
        ms = sum(float(v) ** 2 for v in rows[r]) / rows.shape[1]
        out[r] = rows[r] / (ms + eps) ** 0.5 * w.double()
    return out.reshape(x.shape)


@pytest.mark.parametrize("shape", [(4, 64), (2, 3, 48), (1, 1, 1, 7)])
@pytest.mark.parametrize("eps", [1e-20, 1e-6])
def test_rmsnorm_float32_matches_formula(shape, eps):
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=gen) * 3
    w = torch.randn(shape[-1], generator=gen)
    got = rmsnorm(x, w, eps)
    assert got.dtype == torch.float32 and got.shape == x.shape
    torch.testing.assert_close(got.double(), _formula(x, w, eps), rtol=1e-5, atol=1e-6)


def test_rmsnorm_eps_matters_for_small_inputs():
    x = torch.full((1, 8), 1e-4)
    w = torch.ones(8)
    got = rmsnorm(x, w, 1e-6)  # 1e-4 / sqrt(1e-8 + 1e-6)
    torch.testing.assert_close(
        got.double(), torch.full((1, 8), 1e-4 / (1e-8 + 1e-6) ** 0.5, dtype=torch.float64), rtol=1e-5, atol=0
    )
    torch.testing.assert_close(rmsnorm(x, w, 1e-20), torch.ones(1, 8), rtol=1e-5, atol=0)


def test_rmsnorm_bf16_in_bf16_out_computed_in_float32():
    gen = torch.Generator().manual_seed(0)
    # a wide row with one large entry: a bf16 mean of squares would be far off
    x = (torch.randn(16, 2048, generator=gen) * 2).to(torch.bfloat16)
    x[:, 0] = 60.0
    w = (torch.rand(2048, generator=gen) + 0.5).to(torch.bfloat16)
    got = rmsnorm(x, w, 1e-20)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    exact = _formula(x, w, 1e-20)
    rounded = exact.to(torch.bfloat16)
    # one rounding of a float32 result (weight applied before the cast): nearly always the
    # correctly rounded bf16 value, never more than one bf16 step away
    assert (got == rounded).float().mean().item() > 0.99
    torch.testing.assert_close(got.double(), exact, rtol=2**-8, atol=0)
    # the test tells the orders apart: casting before the weight matches far less often
    v = x.double() / (x.double().square().mean(-1, keepdim=True) + 1e-20).sqrt()
    cast_first = v.to(torch.bfloat16) * w
    assert (cast_first == rounded).float().mean().item() < 0.9


@settings(max_examples=20, deadline=None)
@given(lead=st.lists(st.integers(1, 4), min_size=0, max_size=3), c=st.integers(1, 96), seed=st.integers(0, 2**16))
def test_rmsnorm_property_shapes_and_unit_rms(lead, c, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, c, generator=gen) + 0.1
    got = rmsnorm(x, torch.ones(c), 1e-20)
    assert got.shape == x.shape
    rms = got.double().square().mean(-1).sqrt()
    torch.testing.assert_close(rms, torch.ones_like(rms), rtol=1e-5, atol=0)
