"""fp4 e2m1 and MXFP4 (e2m1 codes with one ue8m0 scale per 32 elements of a row).

Nibble layout: bit 3 sign | bits 2..0 index into the magnitudes
    index      0    1    2    3    4    5    6    7
    magnitude  0   0.5  1.0  1.5  2.0  3.0  4.0  6.0
There is no NaN or infinity. Encoding rounds to the nearest magnitude, a tie
going to the even index (0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2.0,
2.5 -> 2.0, 3.5 -> 4.0, 5.0 -> 4.0), saturates above 6, and keeps the sign bit
(so -0.1 encodes to -0, nibble 0x8). NaN encodes to +-0; MXFP4 quantization
marks such a group with scale byte 255 (NaN) instead.

Packed byte (checkpoint `ffn.experts.*.w*.weight`, stored as int8 there):
    bits 3..0 = element 2j (even column), bits 7..4 = element 2j+1.
A [R, C] matrix packs to [R, C/2] bytes; C must be even. Scales are
[R, ceil(C/32)] ue8m0, scale = pow2ceil(amax/6) per row-group, floored at
2^-126 like blockfp8 (an all-zero group decodes to zeros).
"""

from __future__ import annotations

import numpy as np

from . import blocks
from .errors import QuantInputError, expect_dtype
from .ue8m0 import UE8M0_LUT, scale_bytes_for

E2M1_MAX = 6.0
E2M1_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
E2M1_LUT = np.concatenate([E2M1_MAGNITUDES, -E2M1_MAGNITUDES])  # [16] float32, by nibble
E2M1_LUT.setflags(write=False)

# Decision points between consecutive magnitudes and whether a tie rounds up
# (it does when the upper neighbour has the even index).
_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def e2m1_decode(nibbles: np.ndarray) -> np.ndarray:
    """uint8 nibbles 0..15 (any shape) -> float32."""
    nibbles = expect_dtype(nibbles, np.uint8, "e2m1_decode nibbles")
    if nibbles.size and nibbles.max() > 15:
        raise QuantInputError("e2m1_decode nibbles: values must be 0..15 (unpack bytes first)")
    return E2M1_LUT[nibbles]


def e2m1_encode(x: np.ndarray) -> np.ndarray:
    """float32 (any shape) -> uint8 nibbles, nearest magnitude, ties to even index."""
    x = expect_dtype(x, np.float32, "e2m1_encode input")
    a = np.abs(x)
    idx = np.zeros(x.shape, dtype=np.uint8)
    for mid, tie_up in _MIDPOINTS:
        idx += (a >= mid) if tie_up else (a > mid)
    sign = (np.ascontiguousarray(x).view(np.uint32) >> np.uint32(28)) & np.uint32(8)
    return idx | sign.astype(np.uint8).reshape(x.shape)


def pack_nibbles(nibbles: np.ndarray) -> np.ndarray:
    """[R, C] nibbles (C even) -> [R, C/2] bytes, even column in the low nibble."""
    if nibbles.shape[-1] % 2:
        raise QuantInputError(f"fp4 packing: the last dimension must be even, got shape {nibbles.shape}")
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << np.uint8(4))


def unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """[R, C/2] bytes -> [R, C] nibbles."""
    out = np.empty(packed.shape[:-1] + (packed.shape[-1] * 2,), dtype=np.uint8)
    out[..., 0::2] = packed & np.uint8(0x0F)
    out[..., 1::2] = packed >> np.uint8(4)
    return out


def quantize_mxfp4(w: np.ndarray, group: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """float32 [R, C] -> (packed uint8 [R, C/2], scales uint8 [R, ceil(C/group)])."""
    what = "quantize_mxfp4 weight"
    w = blocks.check_matrix(expect_dtype(w, np.float32, what), what)
    g = blocks.check_block(group, "quantize_mxfp4 group")
    if w.shape[1] % 2:
        raise QuantInputError(f"{what}: columns must be even to pack two per byte, got shape {w.shape}")
    with np.errstate(invalid="ignore"):
        amax = blocks.block_max(np.abs(w), 1, g)  # [R, Cg]
    scales = scale_bytes_for(amax, E2M1_MAX)
    inv = np.float32(1.0) / UE8M0_LUT[scales]
    nibbles = e2m1_encode(w * blocks.expand(inv, 1, g, w.shape))
    return pack_nibbles(nibbles), scales


def dequantize_mxfp4(packed: np.ndarray, scales: np.ndarray, group: int = 32) -> np.ndarray:
    """(packed uint8 [R, C/2], scales uint8 [R, ceil(C/group)]) -> float32 [R, C]."""
    what = "dequantize_mxfp4"
    packed = blocks.check_matrix(expect_dtype(packed, np.uint8, f"{what} packed"), f"{what} packed")
    scales = expect_dtype(scales, np.uint8, f"{what} scales")
    g = blocks.check_block(group, f"{what} group")
    shape = (packed.shape[0], packed.shape[1] * 2)
    blocks.check_grid(scales, shape, 1, g, what)
    return E2M1_LUT[unpack_nibbles(packed)] * blocks.expand(UE8M0_LUT[scales], 1, g, shape)
