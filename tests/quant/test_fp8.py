"""e4m3fn decode/encode against torch's float8_e4m3fn, exhaustively."""

import numpy as np
import pytest

from deepinfer.quant.errors import QuantInputError
from deepinfer.quant.fp8 import E4M3FN_LUT, e4m3fn_decode, e4m3fn_encode

ALL_CODES = np.arange(256, dtype=np.uint8)


def test_decode_all_codes_bit_identical(refs):
    ours = e4m3fn_decode(ALL_CODES)
    ref = refs.torch_e4m3fn_decode(ALL_CODES)
    nan = np.isnan(ref)
    assert list(np.flatnonzero(nan)) == [0x7F, 0xFF]
    assert np.array_equal(np.isnan(ours), nan)
    assert np.array_equal(refs.f32_bits(ours)[~nan], refs.f32_bits(ref)[~nan])


def test_encode_roundtrips_every_code():
    finite = ALL_CODES[(ALL_CODES & 0x7F) != 0x7F]
    assert np.array_equal(e4m3fn_encode(e4m3fn_decode(finite)), finite)
    assert (e4m3fn_encode(e4m3fn_decode(np.array([0x7F, 0xFF], np.uint8))) & 0x7F == 0x7F).all()


def _random_values(rng, n):
    """n float32 values: random bits in the fp8 range, exact ties between
    neighbouring codes, fp8 subnormals, float32 subnormals, overflow, inf, NaN."""
    parts = []
    k = n // 8
    exps = rng.integers(127 - 14, 127 + 10, size=3 * k, dtype=np.uint32)  # ~2^-14 .. 2^9
    man = rng.integers(0, 1 << 23, size=3 * k, dtype=np.uint32)
    sign = rng.integers(0, 2, size=3 * k, dtype=np.uint32) << np.uint32(31)
    parts.append((sign | (exps << np.uint32(23)) | man).view(np.float32))
    lut = E4M3FN_LUT[:0x7F].astype(np.float64)  # 0 .. 448
    mids = ((lut[:-1] + lut[1:]) / 2).astype(np.float32)  # exact ties
    pick = mids[rng.integers(0, mids.size, size=2 * k)]
    parts.append(pick * rng.choice(np.float32([1, -1]), size=2 * k))
    nudge = rng.choice(np.array([-1, 1], dtype=np.int64), size=k)  # 1 ulp off a tie
    parts.append((_bits(pick[:k]).astype(np.int64) + nudge).astype(np.uint32).view(np.float32))
    parts.append(rng.uniform(-(2.0**-6), 2.0**-6, size=k).astype(np.float32))  # fp8 subnormals
    parts.append(rng.uniform(-2000, 2000, size=k).astype(np.float32))  # overflow
    special = np.float32(
        [
            0,
            -0.0,
            np.inf,
            -np.inf,
            np.nan,
            -np.nan,
            448,
            464,
            465,
            1e-45,
            -1e-45,
            2.0**-10,
            2.0**-10 * 1.0000001,
            3e38,
            -3e38,
        ]
    )
    parts.append(np.resize(special, n - sum(p.size for p in parts)))
    return np.concatenate(parts)


def _bits(x):
    return np.ascontiguousarray(x).view(np.uint32)


def test_encode_ten_million_values_match_torch(refs):
    rng = np.random.default_rng(20240531)
    x = _random_values(rng, 10_000_000)
    assert x.size == 10_000_000
    ours = e4m3fn_encode(x)
    nan = np.isnan(x)
    # torch does not saturate: compare on values clamped into range (a no-op within it).
    ref = refs.torch_e4m3fn_encode(np.clip(x, -448, 448))
    assert np.array_equal(ours[~nan], ref[~nan])
    assert (ours[nan] & 0x7F == 0x7F).all()


def test_encode_saturates_and_keeps_sign():
    x = np.float32([448, 464, 480, 1e6, np.inf, -464, -1e30, -np.inf])
    assert list(e4m3fn_encode(x)) == [0x7E] * 5 + [0xFE] * 3


def test_nan_keeps_sign_bit():
    x = np.array([0x7FC00000, 0xFFC00000, 0x7F800001], dtype=np.uint32).view(np.float32)
    assert list(e4m3fn_encode(x)) == [0x7F, 0xFF, 0x7F]


def test_ties_round_to_even():
    # 0x08 (2^-6) and 0x09 (1.125 * 2^-6): the tie goes to the even code 0x08.
    assert e4m3fn_encode(np.float32([1.0625 * 2.0**-6]))[0] == 0x08
    assert e4m3fn_encode(np.float32([1.1875 * 2.0**-6]))[0] == 0x0A
    assert e4m3fn_encode(np.float32([2.0**-10]))[0] == 0x00  # half the smallest subnormal
    assert e4m3fn_encode(np.float32([3 * 2.0**-10]))[0] == 0x02  # 1.5 steps -> 2


def test_shapes_preserved_and_dtype_checked():
    x = np.zeros((2, 13, 3), np.float32)
    assert e4m3fn_encode(x).shape == (2, 13, 3)
    assert e4m3fn_decode(np.zeros((2, 13), np.uint8)).shape == (2, 13)
    assert e4m3fn_encode(x[:, ::2]).shape == (2, 7, 3)  # non-contiguous input
    with pytest.raises(QuantInputError, match="float32"):
        e4m3fn_encode(np.zeros(3, np.float64))
    with pytest.raises(QuantInputError, match="uint8"):
        e4m3fn_decode(np.zeros(3, np.int8))
