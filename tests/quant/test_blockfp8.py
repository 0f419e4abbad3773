"""Block fp8 quantization against a plain torch reference of the release rule."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.quant.blockfp8 import dequantize_fp8_blocks, quantize_fp8_blocks
from deepinfer.quant.errors import QuantInputError
from deepinfer.quant.ue8m0 import ue8m0_decode


def torch_quantize(w: np.ndarray, b: int, refs):
    t = torch.from_numpy(w)
    scale = refs.torch_block_scale(refs.torch_block_amax(t, b, b), 448.0)  # [Rb, Cb]
    q = t / refs.torch_expand(scale, b, b, t.shape)
    codes = q.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    sbytes = scale.to(torch.float8_e8m0fnu).view(torch.uint8)  # exact powers of two
    return codes.numpy(), sbytes.numpy()


def torch_dequantize(codes, scales, b, refs):
    v = torch.from_numpy(codes).view(torch.float8_e4m3fn).float()
    s = torch.from_numpy(scales).view(torch.float8_e8m0fnu).float()
    return (v * refs.torch_expand(s, b, b, v.shape)).numpy()


def _weights(rng, shape, zero_block=True):
    w = (rng.standard_normal(shape) * np.exp2(rng.integers(-12, 6, size=shape))).astype(np.float32)
    if zero_block and shape[0] >= 2 and shape[1] >= 2:
        w[: shape[0] // 2, : shape[1] // 2] = 0
    return w


@pytest.mark.parametrize("shape", [(2, 13), (32, 32), (33, 65), (64, 200), (129, 7)])
@pytest.mark.parametrize("block", [32, 128])
def test_matches_torch_reference(shape, block, refs):
    rng = np.random.default_rng(hash((shape, block)) % 2**32)
    w = _weights(rng, shape)
    codes, scales = quantize_fp8_blocks(w, block)
    ref_codes, ref_scales = torch_quantize(w, block, refs)
    assert scales.shape == (-(-shape[0] // block), -(-shape[1] // block))
    assert np.array_equal(scales, ref_scales)
    assert np.array_equal(codes, ref_codes)
    deq = dequantize_fp8_blocks(codes, scales, block)
    assert np.array_equal(refs.f32_bits(deq), refs.f32_bits(torch_dequantize(codes, scales, block, refs)))


def test_zero_block_scale_and_roundtrip():
    w = np.zeros((40, 40), np.float32)
    w[35, 39] = 448.0
    codes, scales = quantize_fp8_blocks(w)
    assert scales.tolist() == [[1, 1], [1, 127]]
    assert np.array_equal(dequantize_fp8_blocks(codes, scales), w)


def test_exactly_representable_weights_roundtrip():
    rng = np.random.default_rng(5)
    codes = rng.integers(0, 0x7F, size=(64, 96), dtype=np.uint8) | np.uint8(0x80) * rng.integers(0, 2, (64, 96)).astype(
        np.uint8
    )
    codes[::32, ::32] = 0x7E  # each block's amax is 448
    scales = rng.integers(100, 140, size=(2, 3), dtype=np.uint8)
    w = dequantize_fp8_blocks(codes, scales)
    c2, s2 = quantize_fp8_blocks(w)
    assert np.array_equal(s2, scales) and np.array_equal(c2, codes)


def test_nan_block():
    w = np.ones((32, 64), np.float32)
    w[0, 0] = np.nan
    codes, scales = quantize_fp8_blocks(w)
    assert scales.tolist() == [[255, 119]]
    assert np.isnan(dequantize_fp8_blocks(codes, scales)[:, :32]).all()


def test_input_errors():
    with pytest.raises(QuantInputError, match="2-D"):
        quantize_fp8_blocks(np.zeros(5, np.float32))
    with pytest.raises(QuantInputError, match="block size"):
        quantize_fp8_blocks(np.zeros((2, 2), np.float32), block=0)
    with pytest.raises(QuantInputError, match=r"expected \(1, 2\)"):
        dequantize_fp8_blocks(np.zeros((2, 40), np.uint8), np.zeros((1, 1), np.uint8))


@given(
    rows=st.integers(1, 150),
    cols=st.integers(1, 150),
    block=st.sampled_from([1, 4, 32, 48, 128]),
    seed=st.integers(0, 2**31),
)
@settings(max_examples=60, deadline=None)
def test_property_shapes_and_blocks(rows, cols, block, seed, refs):
    w = _weights(np.random.default_rng(seed), (rows, cols))
    codes, scales = quantize_fp8_blocks(w, block)
    ref_codes, ref_scales = torch_quantize(w, block, refs)
    assert np.array_equal(codes, ref_codes) and np.array_equal(scales, ref_scales)
    deq = dequantize_fp8_blocks(codes, scales, block)
    # each element is within half an fp8 ulp: 2^-4 relative, or half a subnormal step
    step = refs.torch_expand(torch.from_numpy(ue8m0_decode(scales)), block, block, w.shape).numpy()
    assert np.all(np.abs(deq - w) <= np.abs(w) * 2.0**-4 + step * 2.0**-10)
