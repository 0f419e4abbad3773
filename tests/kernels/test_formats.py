"""Weight-format decoders (kernels/formats.py) against torch's dtypes and written-out tables."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.kernels.formats import (
    dequant_fp4,
    dequant_fp8,
    dequant_fp8_rows,
    e2m1_decode,
    e4m3fn_decode,
    ue8m0_decode,
    unpack_fp4,
)

ALL_CODES = torch.arange(256, dtype=torch.int32).to(torch.uint8)
# e2m1 codes 0..15, written out: bit 3 the sign.
E2M1_TABLE = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.float().contiguous().view(torch.int32)


def _assert_same_bits_or_nan(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == torch.float32 and got.shape == want.shape
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(_bits(got)[~nan], _bits(want)[~nan])


def _e4m3_value(code: int) -> float:
    return torch.tensor([code], dtype=torch.uint8).view(torch.float8_e4m3fn).item()


def _random_codes(gen: torch.Generator, shape, finite: bool = True) -> torch.Tensor:
    c = torch.randint(0, 256, shape, generator=gen, dtype=torch.int32)
    if finite:  # e4m3fn NaN codes 0x7f / 0xff -> a finite neighbour
        c = torch.where((c & 127) == 127, c - 1, c)
    return c.to(torch.uint8)


def _random_scales(gen: torch.Generator, shape) -> torch.Tensor:
    return torch.randint(120, 135, shape, generator=gen, dtype=torch.int32).to(torch.uint8)


# ---------------------------------------------------------------- scalar decoders


def test_e4m3fn_decode_all_codes_match_torch():
    want = ALL_CODES.view(torch.float8_e4m3fn).float()
    got = e4m3fn_decode(ALL_CODES)
    _assert_same_bits_or_nan(got, want)
    assert torch.isnan(got).nonzero().flatten().tolist() == [0x7F, 0xFF]
    assert got[0x7E].item() == 448.0 and got[0xFE].item() == -448.0
    assert got[0x01].item() == 2.0**-9  # smallest subnormal
    assert _bits(got[0x80:0x81]).item() == _bits(torch.tensor([-0.0])).item()


def test_e4m3fn_decode_keeps_shape():
    codes = ALL_CODES.reshape(4, 8, 8)
    assert e4m3fn_decode(codes).shape == (4, 8, 8)


def test_ue8m0_decode_all_codes_match_torch():
    want = ALL_CODES.view(torch.float8_e8m0fnu).float()
    got = ue8m0_decode(ALL_CODES)
    _assert_same_bits_or_nan(got, want)
    assert torch.isnan(got).nonzero().flatten().tolist() == [255]
    for b in range(255):
        assert got[b].item() == math.ldexp(1.0, b - 127)


def test_e2m1_decode_all_nibbles_match_table():
    got = e2m1_decode(torch.arange(16))
    want = torch.tensor(E2M1_TABLE)
    _assert_same_bits_or_nan(got, want)  # also checks -0.0 for code 8


def test_e2m1_decode_accepts_uint8_and_int8():
    want = torch.tensor(E2M1_TABLE)
    assert torch.equal(e2m1_decode(torch.arange(16, dtype=torch.int32).to(torch.uint8)), want)
    assert torch.equal(e2m1_decode(torch.arange(16, dtype=torch.int8)), want)


def test_unpack_fp4_low_nibble_first():
    packed = torch.tensor([[0x21, 0xF8, 0x7A]], dtype=torch.uint8)
    got = unpack_fp4(packed)
    assert got.shape == (1, 6)
    assert got.tolist() == [[0.5, 1.0, -0.0, -6.0, -1.0, 6.0]]


def test_unpack_fp4_all_bytes():
    got = unpack_fp4(ALL_CODES.reshape(16, 16))
    assert got.shape == (16, 32)
    flat = got.reshape(256, 2)
    for b in range(256):
        assert flat[b, 0].item() == E2M1_TABLE[b & 15], b
        assert flat[b, 1].item() == E2M1_TABLE[b >> 4], b


# ---------------------------------------------------------------- block dequantizers


def _loop_dequant_fp8(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[N, K] codes, [ceil(N/32), ceil(K/32)] scale bytes -> float32, block by block."""
    n, k = codes.shape
    values = codes.view(torch.float8_e4m3fn).float()
    out = torch.empty(n, k)
    for bi in range(math.ceil(n / 32)):
        for bj in range(math.ceil(k / 32)):
            s = math.ldexp(1.0, int(scales[bi, bj]) - 127)
            rows, cols = slice(32 * bi, 32 * bi + 32), slice(32 * bj, 32 * bj + 32)
            out[rows, cols] = values[rows, cols] * s
    return out


def _loop_dequant_fp8_rows(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    n, k = codes.shape
    out = torch.empty(n, k)
    for r in range(n):
        for c in range(k):
            out[r, c] = _e4m3_value(int(codes[r, c])) * math.ldexp(1.0, int(scales[r, c // 32]) - 127)
    return out


def _loop_dequant_fp4(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    n, half = packed.shape
    out = torch.empty(n, 2 * half)
    for r in range(n):
        for c in range(2 * half):
            byte = int(packed[r, c // 2])
            code = byte & 15 if c % 2 == 0 else byte >> 4
            out[r, c] = E2M1_TABLE[code] * math.ldexp(1.0, int(scales[r, c // 32]) - 127)
    return out


@pytest.mark.parametrize("shape", [(40, 70), (2, 13), (32, 32), (64, 96), (33, 65), (1, 1)])
def test_dequant_fp8_awkward_shapes(shape):
    gen = torch.Generator().manual_seed(sum(shape))
    n, k = shape
    codes = _random_codes(gen, shape)
    scales = _random_scales(gen, (math.ceil(n / 32), math.ceil(k / 32)))
    want = _loop_dequant_fp8(codes, scales)
    got = dequant_fp8(codes, scales, torch.float32)
    assert got.dtype == torch.float32
    assert torch.equal(got, want)
    got_bf16 = dequant_fp8(codes, scales, torch.bfloat16)
    assert got_bf16.dtype == torch.bfloat16
    assert torch.equal(got_bf16, want.to(torch.bfloat16))


@pytest.mark.parametrize("n, k", [(40, 70), (64, 96)])  # partial blocks / whole blocks only
def test_dequant_fp8_leading_dims_are_independent_weights(n, k):
    gen = torch.Generator().manual_seed(1)
    codes = _random_codes(gen, (3, 2, n, k))
    scales = _random_scales(gen, (3, 2, math.ceil(n / 32), math.ceil(k / 32)))
    got = dequant_fp8(codes, scales, torch.float32)
    assert got.shape == (3, 2, n, k)
    for a in range(3):
        for b in range(2):
            assert torch.equal(got[a, b], _loop_dequant_fp8(codes[a, b], scales[a, b]))


def test_dequant_fp8_nan_code_stays_nan():
    codes = torch.tensor([[0x7F, 0x38]], dtype=torch.uint8)  # NaN, 1.0
    got = dequant_fp8(codes, torch.tensor([[128]], dtype=torch.uint8), torch.float32)
    assert torch.isnan(got[0, 0]) and got[0, 1].item() == 2.0


@pytest.mark.parametrize("shape", [(40, 70), (2, 13), (5, 64)])
def test_dequant_fp8_rows_awkward_shapes(shape):
    gen = torch.Generator().manual_seed(7 + sum(shape))
    n, k = shape
    codes = _random_codes(gen, shape)
    scales = _random_scales(gen, (n, math.ceil(k / 32)))
    want = _loop_dequant_fp8_rows(codes, scales)
    assert torch.equal(dequant_fp8_rows(codes, scales, torch.float32), want)
    assert torch.equal(dequant_fp8_rows(codes, scales, torch.bfloat16), want.to(torch.bfloat16))


def test_dequant_fp8_rows_leading_dims():
    gen = torch.Generator().manual_seed(3)
    codes = _random_codes(gen, (2, 3, 45))
    scales = _random_scales(gen, (2, 3, 2))
    got = dequant_fp8_rows(codes, scales, torch.float32)
    for a in range(2):
        assert torch.equal(got[a], _loop_dequant_fp8_rows(codes[a], scales[a]))


@pytest.mark.parametrize("shape", [(40, 70), (2, 14), (3, 64), (1, 2)])
def test_dequant_fp4_awkward_shapes(shape):
    gen = torch.Generator().manual_seed(11 + sum(shape))
    n, k = shape
    packed = _random_codes(gen, (n, k // 2), finite=False)
    scales = _random_scales(gen, (n, math.ceil(k / 32)))
    want = _loop_dequant_fp4(packed, scales)
    got = dequant_fp4(packed, scales, torch.float32)
    assert got.shape == (n, k)
    assert torch.equal(got, want)
    assert torch.equal(dequant_fp4(packed, scales, torch.bfloat16), want.to(torch.bfloat16))


def test_dequant_fp4_leading_dims():
    gen = torch.Generator().manual_seed(5)
    packed = _random_codes(gen, (2, 3, 7, 35), finite=False)
    scales = _random_scales(gen, (2, 3, 7, 3))
    got = dequant_fp4(packed, scales, torch.float32)
    assert got.shape == (2, 3, 7, 70)
    for a in range(2):
        for b in range(3):
            assert torch.equal(got[a, b], _loop_dequant_fp4(packed[a, b], scales[a, b]))


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 70), k=st.integers(1, 100), seed=st.integers(0, 2**16))
def test_dequant_fp8_matches_block_loop_any_shape(n, k, seed):
    gen = torch.Generator().manual_seed(seed)
    codes = _random_codes(gen, (n, k))
    scales = _random_scales(gen, (math.ceil(n / 32), math.ceil(k / 32)))
    assert torch.equal(dequant_fp8(codes, scales, torch.float32), _loop_dequant_fp8(codes, scales))


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 6), half=st.integers(1, 50), seed=st.integers(0, 2**16))
def test_dequant_fp4_is_table_times_group_scale(n, half, seed):
    gen = torch.Generator().manual_seed(seed)
    packed = _random_codes(gen, (n, half), finite=False)
    scales = _random_scales(gen, (n, math.ceil(2 * half / 32)))
    table = torch.tensor(E2M1_TABLE)
    p = packed.to(torch.int64)
    values = torch.stack((table[p & 15], table[p >> 4]), dim=-1).reshape(n, 2 * half)
    col_scale = torch.tensor(np.ldexp(1.0, scales.numpy().astype(np.int64) - 127), dtype=torch.float32)
    want = values * col_scale.repeat_interleave(32, dim=1)[:, : 2 * half]
    assert torch.equal(dequant_fp4(packed, scales, torch.float32), want)
