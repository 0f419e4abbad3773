"""Cache quantize-dequantize (kernels/cachequant.py) against MODEL.md's formulas, group by group."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.kernels.cachequant import FORMATS, e2m1_round, maybe_quant, pow2ceil, quant_dequant

E2M1_LEVELS = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
GROUP = {"fp8": 32, "nvfp4": 16, "mxfp4": 32}


def _pow2ceil_py(x: float) -> float:
    """Smallest power of two >= x > 0, via frexp (x = m * 2^e, 0.5 <= m < 1)."""
    m, e = math.frexp(x)
    return x if m == 0.5 else math.ldexp(1.0, e)


def _e2m1_nearest(v: float) -> float:
    """Nearest e2m1 level to v in [-6, 6]; on a tie the level with the even index."""
    mag = abs(v)
    dist = [abs(mag - level) for level in E2M1_LEVELS]
    best = min(dist)
    idx = [i for i, d in enumerate(dist) if d == best]
    i = idx[0] if len(idx) == 1 else next(i for i in idx if i % 2 == 0)
    return math.copysign(E2M1_LEVELS[i], v)


def _to_e4m3fn(v: np.ndarray) -> np.ndarray:
    return np.asarray(v, np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)


def _ref_quant_dequant(x: np.ndarray, fmt: str) -> np.ndarray:
    """MODEL.md's cache formats, one channel group at a time, float32 arithmetic."""
    f32 = np.float32
    group = GROUP[fmt]
    rows = x.reshape(-1, x.shape[-1]).astype(f32)
    out = np.empty_like(rows)
    for r in range(rows.shape[0]):
        for start in range(0, rows.shape[1], group):
            g = rows[r, start : start + group]
            amax = f32(np.abs(g).max())
            if fmt == "fp8":
                scale = f32(_pow2ceil_py(float(max(amax, f32(1e-4)) / f32(448))))
                q = _to_e4m3fn(np.clip(g / scale, f32(-448), f32(448)))
            else:
                if fmt == "nvfp4":
                    # saturating at 448, the largest e4m3fn value (see test_..._scale_saturates)
                    scale = _to_e4m3fn(min(max(amax, f32(6 * 2.0**-9)) / f32(6), f32(448)))[()]
                else:
                    scale = f32(_pow2ceil_py(float(max(amax, f32(6 * 2.0**-126)) / f32(6))))
                q = np.array([_e2m1_nearest(float(v)) for v in np.clip(g / scale, f32(-6), f32(6))], f32)
            out[r, start : start + group] = q * scale
    return out.reshape(x.shape)


def _test_input(gen: torch.Generator, shape) -> torch.Tensor:
    """Rows of very different magnitudes (so the scale floors are reached), an all-zero group."""
    x = torch.randn(shape, generator=gen)
    mag = torch.pow(10.0, torch.empty(shape[:-1] + (1,)).uniform_(-9, 3, generator=gen))
    x = x * mag
    x.view(-1, shape[-1])[0, :16] = 0.0
    return x


# ---------------------------------------------------------------- pow2ceil


def test_pow2ceil_exact_powers_of_two_are_fixed_points():
    x = torch.tensor([math.ldexp(1.0, e) for e in range(-126, 128)], dtype=torch.float32)
    assert torch.equal(pow2ceil(x), x)


def test_pow2ceil_matches_frexp_definition():
    gen = np.random.default_rng(0)
    exps = gen.integers(1, 254, size=20000, dtype=np.uint32)
    mant = gen.integers(0, 1 << 23, size=20000, dtype=np.uint32)
    values = list((exps << np.uint32(23) | mant).view(np.float32))
    for e in range(-125, 127):  # one ulp either side of every power of two
        p = np.float32(math.ldexp(1.0, e))
        values += [np.nextafter(p, np.float32(0)), p, np.nextafter(p, np.float32(np.inf))]
    values += [np.float32(v) for v in (1e-4 / 448, 6 * 2.0**-126 / 6, 0.75, 3.0, 448.0, 1e30)]
    x = np.array(values, np.float32)
    got = pow2ceil(torch.from_numpy(x)).numpy()
    want = np.array([_pow2ceil_py(float(v)) for v in x], np.float32)
    assert np.array_equal(got, want)


def test_pow2ceil_keeps_shape():
    x = torch.rand(3, 4, 5) + 0.1
    y = pow2ceil(x)
    assert y.shape == x.shape and y.dtype == torch.float32
    assert (y >= x).all() and (y < 2 * x).all()


# ---------------------------------------------------------------- e2m1_round


def _e2m1_grid() -> np.ndarray:
    grid = list(np.linspace(-6, 6, 4801, dtype=np.float32))  # step 1/400
    mids = [(a + b) / 2 for a, b in zip(E2M1_LEVELS, E2M1_LEVELS[1:])]
    for m in mids + E2M1_LEVELS:
        for s in (1, -1):
            v = np.float32(s * m)
            grid += [v, np.nextafter(v, np.float32(-7)), np.nextafter(v, np.float32(7))]
    return np.clip(np.array(grid, np.float32), -6, 6)


def test_e2m1_round_matches_nearest_level_search():
    x = _e2m1_grid()
    got = e2m1_round(torch.from_numpy(x)).numpy()
    want = np.array([_e2m1_nearest(float(v)) for v in x], np.float32)
    assert np.array_equal(got, want)


@pytest.mark.parametrize(
    "mid, level", [(0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0)]
)
def test_e2m1_round_ties_go_to_even_index(mid, level):
    got = e2m1_round(torch.tensor([mid, -mid]))
    assert got.tolist() == [level, -level]


def test_e2m1_round_levels_are_fixed_points():
    levels = torch.tensor(E2M1_LEVELS + [-v for v in E2M1_LEVELS])
    assert torch.equal(e2m1_round(levels), levels)


# ---------------------------------------------------------------- quant_dequant


def test_formats_table_matches_model_md():
    assert FORMATS == GROUP


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "mxfp4"])
@pytest.mark.parametrize("shape", [(6, 70), (2, 3, 64), (1, 13)])
def test_quant_dequant_matches_group_formula_float32(fmt, shape):
    gen = torch.Generator().manual_seed(len(fmt) * 1000 + sum(shape))
    x = _test_input(gen, shape)
    got = quant_dequant(x, fmt)
    assert got.dtype == torch.float32 and got.shape == x.shape
    want = _ref_quant_dequant(x.numpy(), fmt)
    assert np.array_equal(got.numpy(), want)


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_quant_dequant_output_follows_input_dtype(fmt, dtype):
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(4, 70, generator=gen) * 3).to(dtype)
    got = quant_dequant(x, fmt)
    assert got.dtype == dtype and got.shape == x.shape
    want = torch.from_numpy(_ref_quant_dequant(x.float().numpy(), fmt)).to(dtype)
    assert torch.equal(got, want)


def test_quant_dequant_fp8_scale_floor():
    # amax below 1e-4: scale = pow2ceil(1e-4 / 448) = 2^-22, so values snap to e4m3 multiples of it
    x = torch.tensor([[3e-6, -1e-6, 0.0] + [0.0] * 29])
    scale = _pow2ceil_py(float(np.float32(1e-4) / np.float32(448)))
    assert scale == 2.0**-22
    want = _to_e4m3fn(x.numpy() / np.float32(scale)) * np.float32(scale)
    assert np.array_equal(quant_dequant(x, "fp8").numpy(), want)


def test_quant_dequant_nvfp4_scale_is_rounded_to_fp8():
    # amax 6.6 -> scale 1.1, which e4m3fn rounds to 1.125; 6.6 / 1.125 = 5.87 -> 6 -> 6.75
    x = torch.zeros(1, 16)
    x[0, 0] = 6.6
    x[0, 1] = 1.125 * 2.5  # exact tie between 2 and 3: even index -> 2
    got = quant_dequant(x, "nvfp4")
    assert got[0, 0].item() == 6.75
    assert got[0, 1].item() == 2.25


def test_quant_dequant_nvfp4_scale_floor():
    x = torch.zeros(1, 16)
    x[0, 0] = 2.0**-12  # below 6 * 2^-9: scale = 2^-9, value rounds to 0
    x[0, 1] = 2.0**-9 * 1.5
    got = quant_dequant(x, "nvfp4")
    assert got[0, 0].item() == 0.0 and got[0, 1].item() == 2.0**-9 * 1.5


def test_quant_dequant_nvfp4_scale_saturates():
    # amax / 6 above the e4m3fn range: the scale saturates at 448 (not NaN), values at 6 * 448
    x = torch.zeros(1, 16)
    x[0, 0], x[0, 1], x[0, 2] = 3000.0, -1e6, 900.0
    got = quant_dequant(x, "nvfp4")
    assert not got.isnan().any()
    assert got[0, :3].tolist() == [2688.0, -2688.0, 896.0]


def test_quant_dequant_mxfp4_ties_at_exact_scale():
    # amax = 6 * 2^-3 gives scale exactly 2^-3; the other values are e2m1 midpoints times it
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    row = [6.0] + mids + [-m for m in mids]
    x = torch.tensor([row + [0.0] * (32 - len(row))]) * 0.125
    got = quant_dequant(x, "mxfp4")[0, : len(row)] / 0.125
    tie = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert got.tolist() == [6.0] + tie + [-t for t in tie]


def test_quant_dequant_mxfp4_tiny_group_uses_floor():
    x = torch.zeros(1, 32)
    x[0, 0] = 2.5e-39  # below 6 * 2^-126: scale 2^-126, value under a quarter of it -> 0
    x[0, 1] = 2.0**-126
    got = quant_dequant(x, "mxfp4")
    assert got[0, 0].item() == 0.0 and got[0, 1].item() == 2.0**-126


def test_quant_dequant_groups_are_independent():
    x = torch.ones(1, 64) * 0.01
    x[0, 40] = 1000.0  # only the second group's scale changes
    got = quant_dequant(x, "fp8")
    assert torch.equal(got[0, :32], quant_dequant(torch.full((1, 32), 0.01), "fp8")[0])


def test_maybe_quant_switch():
    x = torch.randn(2, 64)
    assert maybe_quant(x, "fp8", False) is x
    assert torch.equal(maybe_quant(x, "mxfp4", True), quant_dequant(x, "mxfp4"))


@settings(max_examples=30, deadline=None)
@given(
    fmt=st.sampled_from(["fp8", "nvfp4", "mxfp4"]),
    lead=st.lists(st.integers(1, 3), min_size=0, max_size=2),
    channels=st.integers(1, 80),
    exp=st.integers(-20, 10),
    seed=st.integers(0, 2**16),
)
def test_quant_dequant_property_any_shape(fmt, lead, channels, exp, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, channels, generator=gen) * 2.0**exp
    got = quant_dequant(x, fmt)
    assert got.shape == x.shape and got.dtype == x.dtype
    assert np.array_equal(got.numpy(), _ref_quant_dequant(x.numpy(), fmt))
    # the error of each element is bounded by its group's quantization step
    rel = {"fp8": 2.0**-4, "nvfp4": 0.5, "mxfp4": 0.5}[fmt]
    floor = {"fp8": 2.0**-22, "nvfp4": 2.0**-9, "mxfp4": 2.0**-126}[fmt]  # smallest scale
    assert ((got - x).abs() <= x.abs() * rel + 2.0**exp + floor).all()
