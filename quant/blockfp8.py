"""Block-quantized fp8: e4m3fn codes with one ue8m0 scale per square block.

Checkpoint format (MODEL.md "fp8 + scale"): `X.weight` [R, C] e4m3fn codes,
`X.scale` [ceil(R/b), ceil(C/b)] ue8m0 bytes, b = 32; element (i, j) is
`e4m3fn(code[i, j]) * 2^(scale[i // b, j // b] - 127)`.

Quantization follows the release: scale = pow2ceil(amax / 448) per block, in
float32, then codes = e4m3fn_encode(w / scale) (RNE, saturating). An all-zero
block gets scale byte 1 (2^-126, the smallest normal float32 power of two; the
same byte pow2ceil gives any block whose amax/448 is a float32 subnormal), so it
decodes to exact zeros. Blocks holding NaN or infinity get scale byte 255
(NaN) and decode to NaN.
"""

from __future__ import annotations

import numpy as np

from . import blocks
from .errors import expect_dtype
from .fp8 import E4M3FN_MAX, e4m3fn_decode, e4m3fn_encode
from .ue8m0 import UE8M0_LUT, scale_bytes_for


def quantize_fp8_blocks(w: np.ndarray, block: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """float32 [R, C] -> (codes uint8 [R, C], scales uint8 [ceil(R/b), ceil(C/b)])."""
    w = blocks.check_matrix(expect_dtype(w, np.float32, "quantize_fp8_blocks weight"), "quantize_fp8_blocks weight")
    b = blocks.check_block(block, "quantize_fp8_blocks")
    with np.errstate(invalid="ignore"):
        amax = blocks.block_max(np.abs(w), b, b)  # [Rb, Cb]; NaN propagates
    scales = scale_bytes_for(amax, E4M3FN_MAX)  # [Rb, Cb]
    inv = np.float32(1.0) / UE8M0_LUT[scales]  # exact: scales are powers of two
    codes = e4m3fn_encode(w * blocks.expand(inv, b, b, w.shape))
    return codes, scales


def dequantize_fp8_blocks(codes: np.ndarray, scales: np.ndarray, block: int = 32) -> np.ndarray:
    """(codes uint8 [R, C], scales uint8 [Rb, Cb]) -> float32 [R, C]."""
    codes = blocks.check_matrix(
        expect_dtype(codes, np.uint8, "dequantize_fp8_blocks codes"), "dequantize_fp8_blocks codes"
    )
    scales = expect_dtype(scales, np.uint8, "dequantize_fp8_blocks scales")
    b = blocks.check_block(block, "dequantize_fp8_blocks")
    blocks.check_grid(scales, codes.shape, b, b, "dequantize_fp8_blocks")
    return e4m3fn_decode(codes) * blocks.expand(UE8M0_LUT[scales], b, b, codes.shape)


def quantize_fp8_float_scales(w: np.ndarray, block: int = 128) -> tuple[np.ndarray, np.ndarray]:
    """float32 [R, C] -> (codes uint8 [R, C], scale_inv float32 [ceil(R/b), ceil(C/b)]), as
    DeepSeek-V3-style checkpoints store fp8 weights (`X.weight_scale_inv`, element (i, j) =
    e4m3fn(code) * scale_inv[i // b, j // b]): scale_inv = amax / 448 per block in float32 (an
    all-zero block gets 1), codes = e4m3fn_encode(w / scale_inv)."""
    w = blocks.check_matrix(
        expect_dtype(w, np.float32, "quantize_fp8_float_scales weight"), "quantize_fp8_float_scales weight"
    )
    b = blocks.check_block(block, "quantize_fp8_float_scales")
    amax = blocks.block_max(np.abs(w), b, b)
    inv = np.where(amax > 0, amax / np.float32(E4M3FN_MAX), np.float32(1.0)).astype(np.float32)
    codes = e4m3fn_encode(w / blocks.expand(inv, b, b, w.shape))
    return codes, inv
