"""Rescale and device-format conversion against plain torch float references."""

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.quant.blockfp8 import quantize_fp8_blocks
from deepinfer.quant.errors import QuantInputError
from deepinfer.quant.formats import E4M3_LUT, e4m3_encode
from deepinfer.quant.rescale import convert_format, rescale_fp32, rescale_ue8m0
from deepinfer.quant.shift import MAX_SHIFT, SHIFT_TABLES

QMAX = {"e4m3fn": 448.0, "e4m3": 240.0}


def pair(b):
    return (b, b) if isinstance(b, int) else b


def torch_rescale(codes, src_scale, src, dst, fmt, refs):
    """The plain float32 recipe: dequantize, amax per destination block, pow2ceil,
    divide, cast (torch for e4m3fn, ml_dtypes for the IEEE-like e4m3)."""
    (sr, sc), (dr, dc) = pair(src), pair(dst)
    v = torch.from_numpy(codes).view(torch.float8_e4m3fn).float()
    v = v * refs.torch_expand(torch.from_numpy(src_scale), sr, sc, v.shape)
    scale = refs.torch_block_scale(refs.torch_block_amax(v, dr, dc), QMAX[fmt])
    q = (v / refs.torch_expand(scale, dr, dc, v.shape)).clamp(-QMAX[fmt], QMAX[fmt])
    if fmt == "e4m3fn":
        out = q.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    else:
        out = q.numpy().astype(ml_dtypes.float8_e4m3).view(np.uint8)
    return out, scale.to(torch.float8_e8m0fnu).view(torch.uint8).numpy()


def _checkpoint_like(rng, shape, block=32, spread=(-14, 2)):
    """Release-style fp8 weights: per-block magnitudes spread over many binades,
    with zero blocks and tiny values so that shifts produce subnormals."""
    w = rng.standard_normal(shape).astype(np.float32)
    w *= np.exp2(rng.integers(*spread, size=shape)).astype(np.float32)
    if shape[0] > 40 and shape[1] > 40:
        w[:32, 32:40] = 0
    return quantize_fp8_blocks(w, block)


@pytest.mark.parametrize("shape", [(2, 13), (64, 64), (130, 300), (256, 96), (33, 129)])
@pytest.mark.parametrize("src,dst", [(32, 128), (32, 32), (128, 32), (32, (1, 128)), (32, 48)])
@pytest.mark.parametrize("fmt", ["e4m3fn", "e4m3"])
def test_ue8m0_matches_reference(shape, src, dst, fmt, refs):
    rng = np.random.default_rng(abs(hash((shape, str(src), str(dst)))) % 2**32)
    codes, scales = _checkpoint_like(rng, shape, pair(src)[0])
    ours = rescale_ue8m0(codes, scales, src, dst, fmt, chunk_bytes=4096)
    ref = torch_rescale(codes, scales.view(ml_dtypes.float8_e8m0fnu).astype(np.float32), src, dst, fmt, refs)
    assert np.array_equal(ours[1], ref[1])
    assert np.array_equal(ours[0], ref[0])


@pytest.mark.parametrize("shape", [(2, 13), (128, 128), (300, 260)])
@pytest.mark.parametrize("dst", [128, 32, (1, 128)])
@pytest.mark.parametrize("fmt", ["e4m3fn", "e4m3"])
def test_fp32_matches_reference(shape, dst, fmt, refs):
    rng = np.random.default_rng(sum(shape))
    codes = rng.integers(0, 256, size=shape, dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0
    s = np.exp2(rng.uniform(-20, 4, size=(-(-shape[0] // 128), -(-shape[1] // 128)))).astype(np.float32)
    s.flat[0] = 0.0 if s.size > 1 else s.flat[0]
    ours = rescale_fp32(codes, s, 128, dst, fmt, chunk_bytes=8192)
    ref = torch_rescale(codes, s, 128, dst, fmt, refs)
    assert np.array_equal(ours[1], ref[1]) and np.array_equal(ours[0], ref[0])


def test_chunking_does_not_change_results():
    rng = np.random.default_rng(9)
    codes, scales = _checkpoint_like(rng, (520, 700))
    a = rescale_ue8m0(codes, scales, 32, 128, chunk_bytes=1)
    b = rescale_ue8m0(codes, scales, 32, 128, chunk_bytes=1 << 30)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))


def test_shift_tables_are_exact_power_of_two_scaling():
    codes = np.arange(256, dtype=np.uint8)
    finite = (codes & 0x7F) != 0x7F
    for s in range(-8, 20):
        v = torch.from_numpy(codes).view(torch.float8_e4m3fn).float() * 2.0**-s
        ref = v.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        assert np.array_equal(SHIFT_TABLES[s + MAX_SHIFT][finite], ref[finite]), s


def test_reference_cases_exercise_subnormal_and_negative_shifts():
    rng = np.random.default_rng(1)
    codes, scales = _checkpoint_like(rng, (256, 256))
    out, out_s = rescale_ue8m0(codes, scales, 32, 128)
    assert ((out & 0x7F) < 8).sum() > ((codes & 0x7F) < 8).sum()  # new subnormals/zeros
    c2 = codes.copy()
    c2[:32, :32] &= np.uint8(0x9F)  # block max <= 224 -> scale drops
    out2, s2 = rescale_ue8m0(c2, scales, 32, 32)
    assert s2[0, 0] < scales[0, 0] and np.array_equal(s2[1:], scales[1:])


def test_nan_code_and_nan_scale_rejected():
    codes = np.zeros((64, 64), np.uint8)
    codes[40, 3] = 0x7F
    with pytest.raises(QuantInputError, match="row 32, column 0"):
        rescale_ue8m0(codes, np.full((2, 2), 120, np.uint8))
    with pytest.raises(QuantInputError, match="255"):
        rescale_ue8m0(np.zeros((64, 64), np.uint8), np.full((2, 2), 255, np.uint8))
    with pytest.raises(QuantInputError, match="expected \\(2, 2\\)"):
        rescale_ue8m0(np.zeros((64, 64), np.uint8), np.full((1, 2), 1, np.uint8))
    with pytest.raises(QuantInputError, match="unknown fp8 format"):
        rescale_ue8m0(np.zeros((64, 64), np.uint8), np.full((2, 2), 1, np.uint8), fmt="e5m2")
    with pytest.raises(QuantInputError, match="finite"):
        rescale_fp32(np.zeros((4, 4), np.uint8), np.float32([[np.inf]]))


# --- device format conversion -------------------------------------------------


def test_e4m3_lut_matches_ml_dtypes(refs):
    ref = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3).astype(np.float32)
    nan = np.isnan(ref)
    assert np.array_equal(np.isnan(E4M3_LUT), nan)
    assert np.array_equal(refs.f32_bits(E4M3_LUT)[~nan], refs.f32_bits(ref)[~nan])


def test_e4m3_encode_matches_ml_dtypes():
    rng = np.random.default_rng(4)
    x = np.concatenate(
        [rng.uniform(-250, 250, 200_000), rng.uniform(-1, 1, 100_000) * 2.0**-6, E4M3_LUT[np.isfinite(E4M3_LUT)]]
    ).astype(np.float32)
    ref = np.clip(x, -240, 240).astype(ml_dtypes.float8_e4m3).view(np.uint8)
    assert np.array_equal(e4m3_encode(x), ref)
    assert list(e4m3_encode(np.float32([300, -np.inf, 248]))) == [0x77, 0xF7, 0x77]


@pytest.mark.parametrize("shape", [(2, 13), (64, 96), (100, 33)])
def test_convert_to_e4m3_matches_reference(shape):
    rng = np.random.default_rng(shape[0])
    codes, scales = _checkpoint_like(rng, shape)
    codes[: min(32, shape[0]), :] &= np.uint8(0xB7)  # some blocks with all magnitudes <= 240
    out, out_s = convert_format(codes, scales, 32, "e4m3", chunk_bytes=2048)
    v = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    big = np.zeros(scales.shape, bool)
    for i, j in np.ndindex(scales.shape):
        big[i, j] = np.abs(v[32 * i : 32 * i + 32, 32 * j : 32 * j + 32]).max() > 240
    assert np.array_equal(out_s, scales + big)
    halve = np.repeat(np.repeat(big, 32, 0), 32, 1)[: shape[0], : shape[1]]
    want = np.where(halve, v / 2, v).astype(np.float32).astype(ml_dtypes.float8_e4m3).view(np.uint8)
    assert np.array_equal(out, want)
    # every value is the same number as before (up to subnormal rounding)
    back = out.view(ml_dtypes.float8_e4m3).astype(np.float64) * np.exp2(
        np.repeat(np.repeat(out_s.astype(np.float64) - scales, 32, 0), 32, 1)[: shape[0], : shape[1]]
    )
    assert np.all(np.abs(back - v) <= 2.0**-9)


def test_convert_identity_for_e4m3fn_and_scale_overflow():
    codes = np.full((32, 32), 0x7E, np.uint8)
    out, s = convert_format(codes, np.full((1, 1), 3, np.uint8), 32, "e4m3fn")
    assert np.array_equal(out, codes) and s.tolist() == [[3]]
    with pytest.raises(QuantInputError, match="overflow"):
        convert_format(codes, np.full((1, 1), 254, np.uint8), 32, "e4m3")


@given(
    rows=st.integers(1, 200),
    cols=st.integers(1, 200),
    src=st.sampled_from([16, 32, 128, (32, 16)]),
    dst=st.sampled_from([32, 64, 128, (1, 128), 48]),
    fmt=st.sampled_from(["e4m3fn", "e4m3"]),
    seed=st.integers(0, 2**31),
)
@settings(max_examples=60, deadline=None)
def test_property_ue8m0(rows, cols, src, dst, fmt, seed, refs):
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 0x7F, (rows, cols), dtype=np.uint8) | (rng.integers(0, 2, (rows, cols)) * 0x80).astype(
        np.uint8
    )
    codes[rng.random((rows, cols)) < 0.5] &= np.uint8(0x8F)  # many small magnitudes
    sr, sc = pair(src)
    scales = rng.integers(100, 140, (-(-rows // sr), -(-cols // sc)), dtype=np.uint8)
    ours = rescale_ue8m0(codes, scales, src, dst, fmt, chunk_bytes=3000)
    ref = torch_rescale(codes, scales.view(ml_dtypes.float8_e8m0fnu).astype(np.float32), src, dst, fmt, refs)
    assert np.array_equal(ours[1], ref[1]) and np.array_equal(ours[0], ref[0])
