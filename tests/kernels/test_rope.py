"""Rotary embedding (kernels/rope.py): frequencies, YaRN ramp, pair rotation of the last channels."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.kernels.rope import apply_rope, rope_angles, rope_frequencies

RELEASED_YARN = {
    "rope_type": "yarn",
    "factor": 16,
    "original_max_position_embeddings": 65536,
    "beta_fast": 32,
    "beta_slow": 1,
}


def _plain_freqs(rope_dim: int, theta: float) -> list[float]:
    return [1.0 / theta ** (2 * i / rope_dim) for i in range(rope_dim // 2)]


def _yarn_freqs(
    rope_dim: int, theta: float, factor: float, original: int, beta_fast: float, beta_slow: float
) -> list[float]:
    """YaRN frequency interpolation: pair i keeps its frequency below `low`, is divided by
    `factor` above `high`, and blends linearly in between. `low`/`high` are the pair indices
    whose wavelength completes beta_fast / beta_slow rotations over `original` positions."""

    def pair_dim(rotations: float) -> float:
        return rope_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(pair_dim(beta_fast)), 0)
    high = min(math.ceil(pair_dim(beta_slow)), rope_dim - 1)
    out = []
    for i, f in enumerate(_plain_freqs(rope_dim, theta)):
        ramp = min(max((i - low) / max(high - low, 1e-3), 0.0), 1.0)
        out.append(f / factor * ramp + f * (1 - ramp))
    return out


def _loop_rope(x: torch.Tensor, angles: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """x [B, T, C] or [B, T, H, C], angles [B, T, P]: rotate pairs of the last 2P channels."""
    out = x.double().clone()
    p = angles.shape[-1]
    first = x.shape[-1] - 2 * p
    heads = x.shape[2] if x.dim() == 4 else None
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            for i in range(p):
                a = float(angles[b, t, i]) * (-1 if inverse else 1)
                c, s = math.cos(a), math.sin(a)
                for h in range(heads) if heads is not None else [None]:
                    v = x[b, t] if h is None else x[b, t, h]
                    re, im = float(v[first + 2 * i]), float(v[first + 2 * i + 1])
                    dst = out[b, t] if h is None else out[b, t, h]
                    dst[first + 2 * i] = re * c - im * s
                    dst[first + 2 * i + 1] = re * s + im * c
    return out


# ---------------------------------------------------------------- frequencies


@pytest.mark.parametrize("rope_dim, theta", [(64, 10000.0), (16, 10000.0), (16, 160000.0), (2, 10.0)])
def test_rope_frequencies_unscaled(rope_dim, theta):
    got = rope_frequencies(rope_dim, theta, None)
    assert got.dtype == torch.float32 and got.shape == (rope_dim // 2,)
    torch.testing.assert_close(
        got.double(), torch.tensor(_plain_freqs(rope_dim, theta), dtype=torch.float64), rtol=2e-6, atol=0
    )


@pytest.mark.parametrize("rope_dim", [64, 16])
def test_rope_frequencies_yarn_released_config(rope_dim):
    theta = 160000.0
    got = rope_frequencies(rope_dim, theta, RELEASED_YARN)
    want = _yarn_freqs(rope_dim, theta, 16, 65536, 32, 1)
    torch.testing.assert_close(got.double(), torch.tensor(want, dtype=torch.float64), rtol=2e-6, atol=0)
    plain = _plain_freqs(rope_dim, theta)
    assert got[0].item() == pytest.approx(plain[0], rel=1e-6)  # high frequency: kept
    assert got[-1].item() == pytest.approx(plain[-1] / 16, rel=1e-6)  # low frequency: / factor


def test_rope_frequencies_yarn_ramp_is_partial():
    # rope_dim 64, theta 160000: low = 15, high = 25, so pairs 16..24 are blended
    got = rope_frequencies(64, 160000.0, RELEASED_YARN)
    plain = torch.tensor(_plain_freqs(64, 160000.0), dtype=torch.float32)
    ratio = (plain / got).double()
    assert torch.allclose(ratio[:16], torch.ones(16, dtype=torch.float64), rtol=1e-6)
    assert torch.allclose(ratio[25:], torch.full((7,), 16.0, dtype=torch.float64), rtol=1e-6)
    assert ((ratio[16:25] > 1.0) & (ratio[16:25] < 16.0)).all()
    assert ratio[20].item() == pytest.approx(1 / ((1 - 0.5) + 0.5 / 16), rel=1e-6)  # ramp (20-15)/10


def test_rope_frequencies_yarn_other_parameters():
    cfg = {"factor": 4, "original_max_position_embeddings": 4096, "beta_fast": 16, "beta_slow": 2}
    got = rope_frequencies(32, 10000.0, cfg)
    want = _yarn_freqs(32, 10000.0, 4, 4096, 16, 2)
    torch.testing.assert_close(got.double(), torch.tensor(want, dtype=torch.float64), rtol=2e-6, atol=0)


def test_rope_angles():
    freqs = rope_frequencies(8, 10000.0, None)
    pos = torch.tensor([[0, 1, 7], [100, 65535, 3]])
    got = rope_angles(pos, freqs)
    assert got.shape == (2, 3, 4) and got.dtype == torch.float32
    for b in range(2):
        for t in range(3):
            for i in range(4):
                assert got[b, t, i].item() == pytest.approx(float(pos[b, t]) * float(freqs[i]), rel=1e-6)


# ---------------------------------------------------------------- apply_rope


@pytest.mark.parametrize("shape", [(2, 3, 24), (2, 3, 4, 24), (1, 5, 16), (1, 2, 3, 16)])
def test_apply_rope_matches_pair_loop(shape):
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=gen)
    angles = torch.rand(shape[0], shape[1], 8, generator=gen) * 20 - 10
    got = apply_rope(x, angles)
    assert got.shape == x.shape and got.dtype == x.dtype
    torch.testing.assert_close(got.double(), _loop_rope(x, angles), rtol=1e-5, atol=1e-5)
    untouched = shape[-1] - 16
    assert torch.equal(got[..., :untouched], x[..., :untouched])


@pytest.mark.parametrize("shape", [(2, 3, 24), (2, 3, 4, 24)])
def test_apply_rope_inverse_matches_loop_and_undoes(shape):
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(shape, generator=gen)
    angles = torch.rand(shape[0], shape[1], 8, generator=gen) * 100
    inv = apply_rope(x, angles, inverse=True)
    torch.testing.assert_close(inv.double(), _loop_rope(x, angles, inverse=True), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(apply_rope(apply_rope(x, angles), angles, inverse=True), x, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(apply_rope(inv, angles), x, rtol=1e-5, atol=1e-5)


def test_apply_rope_adjacent_pairs_not_halves():
    # one pair at a right angle: channels (2i, 2i+1) of the rope part rotate, nothing else moves
    x = torch.zeros(1, 1, 6)
    x[0, 0, 2] = 1.0  # first rope channel (rope part = channels 2..5)
    angles = torch.tensor([[[math.pi / 2, 0.0]]])
    got = apply_rope(x, angles)
    torch.testing.assert_close(got, torch.tensor([[[0.0, 0.0, 0.0, 1.0, 0.0, 0.0]]]), atol=1e-6, rtol=0)


def test_apply_rope_zero_angle_is_identity():
    x = torch.randn(2, 3, 4, 24)
    assert torch.equal(apply_rope(x, torch.zeros(2, 3, 8)), x)


def test_apply_rope_bf16_in_bf16_out():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 3, 4, 24, generator=gen).to(torch.bfloat16)
    angles = torch.rand(2, 3, 8, generator=gen) * 50
    got = apply_rope(x, angles)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got[..., :8], x[..., :8])
    torch.testing.assert_close(got.double(), _loop_rope(x.float(), angles), rtol=1e-2, atol=1e-2)


@settings(max_examples=20, deadline=None)
@given(
    b=st.integers(1, 2),
    t=st.integers(1, 4),
    heads=st.sampled_from([None, 1, 3]),
    pairs=st.integers(1, 6),
    extra=st.integers(0, 5),
    seed=st.integers(0, 2**16),
)
def test_apply_rope_property_norms_preserved(b, t, heads, pairs, extra, seed):
    gen = torch.Generator().manual_seed(seed)
    shape = (b, t, 2 * pairs + extra) if heads is None else (b, t, heads, 2 * pairs + extra)
    x = torch.randn(shape, generator=gen)
    angles = torch.randn(b, t, pairs, generator=gen) * 30
    y = apply_rope(x, angles)
    assert y.shape == x.shape
    assert torch.equal(y[..., :extra], x[..., :extra])
    pair_norm = lambda v: v[..., extra:].unflatten(-1, (pairs, 2)).norm(dim=-1)  # noqa: E731
    torch.testing.assert_close(pair_norm(y), pair_norm(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(apply_rope(y, angles, inverse=True), x, rtol=1e-5, atol=1e-5)
