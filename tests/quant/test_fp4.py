"""e2m1 / MXFP4 against a written-out e2m1 table and a torch reference."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.quant.errors import QuantInputError
from deepinfer.quant.fp4 import dequantize_mxfp4, e2m1_decode, e2m1_encode, pack_nibbles, quantize_mxfp4, unpack_nibbles

# nibble -> value, written out by hand (bit 3 = sign)
E2M1_TABLE = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
LEVELS = torch.tensor(E2M1_TABLE[:8], dtype=torch.float64)


def torch_e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Nearest level by brute force; a tie goes to the even index; saturate at 6."""
    a = x.abs().double().clamp(max=6.0)
    dist = (a[..., None] - LEVELS).abs()  # [..., 8]
    best = dist.min(dim=-1, keepdim=True).values
    idx = torch.arange(8).expand_as(dist)
    # among tied candidates (at most two, adjacent), prefer the even index
    tied = dist == best
    even = tied & (idx % 2 == 0)
    choice = torch.where(even.any(-1), (even * idx).sum(-1), (tied * idx).sum(-1))
    sign = torch.signbit(x).to(torch.int64) * 8
    return (choice + sign).to(torch.uint8)


def test_decode_table():
    ours = e2m1_decode(np.arange(16, dtype=np.uint8))
    assert np.array_equal(ours, np.float32(E2M1_TABLE))
    assert np.array_equal(np.signbit(ours), np.signbit(np.float32(E2M1_TABLE)))


def test_encode_midpoints_and_saturation():
    x = np.float32([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.2500001, 7.0, 1e9, -0.1, -5.0, np.inf])
    assert list(e2m1_encode(x)) == [0, 2, 2, 4, 4, 6, 6, 1, 7, 7, 8, 14, 7]


def test_encode_random_matches_brute_force():
    rng = np.random.default_rng(11)
    mids = np.float32([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    x = np.concatenate([rng.uniform(-8, 8, 300_000).astype(np.float32), mids, -mids, np.float32(E2M1_TABLE)])
    ref = torch_e2m1_encode(torch.from_numpy(x)).numpy()
    assert np.array_equal(e2m1_encode(x), ref)


def test_pack_layout_low_nibble_even():
    nib = np.array([[1, 2, 3, 15]], np.uint8)
    packed = pack_nibbles(nib)
    assert packed.tolist() == [[0x21, 0xF3]]
    assert np.array_equal(unpack_nibbles(packed), nib)


def torch_quantize_mxfp4(w: np.ndarray, g: int, refs):
    t = torch.from_numpy(w)
    scale = refs.torch_block_scale(refs.torch_block_amax(t, 1, g), 6.0)  # [R, Cg]
    nib = torch_e2m1_encode(t / refs.torch_expand(scale, 1, g, t.shape))
    packed = nib[:, 0::2] | (nib[:, 1::2] << 4)
    return packed.numpy(), scale.to(torch.float8_e8m0fnu).view(torch.uint8).numpy()


@pytest.mark.parametrize("shape", [(2, 14), (3, 64), (5, 100), (1, 2)])
def test_quantize_matches_torch(shape, refs):
    rng = np.random.default_rng(sum(shape))
    w = (rng.standard_normal(shape) * 0.05).astype(np.float32)
    packed, scales = quantize_mxfp4(w)
    ref_packed, ref_scales = torch_quantize_mxfp4(w, 32, refs)
    assert packed.shape == (shape[0], shape[1] // 2) and scales.shape == (shape[0], -(-shape[1] // 32))
    assert np.array_equal(scales, ref_scales) and np.array_equal(packed, ref_packed)
    ref_deq = torch.tensor(E2M1_TABLE)[torch.from_numpy(unpack_nibbles(packed)).long()] * refs.torch_expand(
        torch.from_numpy(scales).view(torch.float8_e8m0fnu).float(), 1, 32, shape
    )
    assert np.array_equal(dequantize_mxfp4(packed, scales), ref_deq.numpy())


def test_representable_roundtrip_and_zero_group():
    rng = np.random.default_rng(2)
    nib = rng.integers(0, 16, size=(4, 64), dtype=np.uint8)
    nib[:, 0] = 7  # amax 6 in every group...
    nib[:, 32] = 15
    nib[3, 32:] = 0  # ...except a zero group
    scales = np.array([[120, 127]] * 3 + [[130, 1]], np.uint8)
    w = dequantize_mxfp4(pack_nibbles(nib), scales)
    packed, s2 = quantize_mxfp4(w)
    assert np.array_equal(s2, scales)
    assert np.array_equal(dequantize_mxfp4(packed, s2), w)


def test_errors():
    with pytest.raises(QuantInputError, match="even"):
        quantize_mxfp4(np.zeros((2, 3), np.float32))
    with pytest.raises(QuantInputError, match="0..15"):
        e2m1_decode(np.array([16], np.uint8))


@given(
    rows=st.integers(1, 40), half=st.integers(1, 90), group=st.sampled_from([16, 32, 64]), seed=st.integers(0, 2**31)
)
@settings(max_examples=50, deadline=None)
def test_property_quantize(rows, half, group, seed, refs):
    w = np.random.default_rng(seed).standard_normal((rows, 2 * half)).astype(np.float32)
    packed, scales = quantize_mxfp4(w, group)
    ref_packed, ref_scales = torch_quantize_mxfp4(w, group, refs)
    assert np.array_equal(packed, ref_packed) and np.array_equal(scales, ref_scales)
