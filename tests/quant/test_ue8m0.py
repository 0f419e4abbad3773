"""ue8m0 bytes and pow2ceil against torch's float8_e8m0fnu and frexp."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.quant.ue8m0 import pow2ceil, scale_bytes_for, ue8m0_decode, ue8m0_encode

ALL = np.arange(256, dtype=np.uint8)


def test_decode_all_bytes_match_torch(refs):
    ref = torch.from_numpy(ALL).view(torch.float8_e8m0fnu).float().numpy()
    ours = ue8m0_decode(ALL)
    assert np.isnan(ours[255]) and np.isnan(ref[255])
    assert np.array_equal(refs.f32_bits(ours[:255]), refs.f32_bits(ref[:255]))
    assert ours[127] == 1.0 and ours[0] == np.float32(2.0**-127)


def test_encode_powers_of_two_exact_and_match_torch():
    x = ue8m0_decode(ALL[:255])
    assert np.array_equal(ue8m0_encode(x), ALL[:255])
    ref = torch.from_numpy(x).to(torch.float8_e8m0fnu).view(torch.uint8).numpy()
    assert np.array_equal(ref, ALL[:255])


def _ceil_bytes_frexp(x: np.ndarray) -> np.ndarray:
    """Independent ceiling: x = m * 2^e with m in [0.5, 1)."""
    m, e = np.frexp(x.astype(np.float64))
    e = np.where(m == 0.5, e - 1, e)  # exact power of two
    return np.clip(e + 127, 0, 255).astype(np.uint8)


def test_encode_is_ceiling_on_random_values():
    rng = np.random.default_rng(7)
    bits = rng.integers(0x00000001, 0x7F000000, size=1_000_000, dtype=np.uint32)
    x = bits.view(np.float32)
    assert np.array_equal(ue8m0_encode(x), _ceil_bytes_frexp(x))


def test_encode_specials():
    x = np.float32(
        [0.0, -0.0, 2.0**-127, 2.0**-127 * 1.5, 2.0**-140, 2.0**127, 2.0**127 * 1.5, np.inf, np.nan, -1.0, 3.0]
    )
    assert list(ue8m0_encode(x)) == [0, 0, 0, 1, 0, 254, 255, 255, 255, 255, 129]


@given(bits=st.integers(0, 2**32 - 1))
@settings(max_examples=300, deadline=None)
def test_pow2ceil_matches_torch_rule(bits, refs):
    x = np.array([bits], np.uint32).view(np.float32)
    ours = pow2ceil(x)
    ref = refs.torch_pow2ceil(torch.from_numpy(x.copy())).numpy()
    assert refs.f32_bits(ours)[0] == refs.f32_bits(ref)[0]


def test_pow2ceil_values():
    x = np.float32([1.0, 1.5, 3.0, 0.0, -3.0, 2.0**-149, np.inf, 3.4e38, 0.75])
    want = np.float32([1.0, 2.0, 4.0, 0.0, -4.0, 2.0**-126, np.inf, np.inf, 1.0])
    assert np.array_equal(pow2ceil(x), want)
    assert np.isnan(pow2ceil(np.float32([np.nan])))[0]


def test_pow2ceil_is_least_power_at_or_above_for_normals():
    rng = np.random.default_rng(3)
    x = rng.integers(0x00800000, 0x7F000000, size=200_000, dtype=np.uint32).view(np.float32)
    p = pow2ceil(x).astype(np.float64)
    assert (p >= x).all() and (p / 2 < x).all()


def test_scale_bytes_floor_and_nan():
    amax = np.float32([0.0, 448.0, 449.0, 1e-40, np.nan, 224.0])
    assert list(scale_bytes_for(amax, 448.0)) == [1, 127, 128, 1, 255, 126]


@pytest.mark.parametrize("shape", [(2, 13), (0,), (3, 0, 2)])
def test_shapes(shape):
    assert ue8m0_encode(np.ones(shape, np.float32)).shape == shape
    assert pow2ceil(np.ones(shape, np.float32)).shape == shape
