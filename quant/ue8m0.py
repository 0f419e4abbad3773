"""ue8m0: an exponent-only scale byte (torch float8_e8m0fnu, OCP MX "E8M0").

Byte b (0..254) means 2^(b - 127); byte 255 is NaN. There is no zero, no sign
and no infinity. Byte 0 is 2^-127, a float32 subnormal; byte 127 is 1.0.
On float32 bits, byte b (1..254) is exactly the exponent field: `b << 23`.

`pow2ceil` follows the release's rule on float32 bits: keep the sign, take the
exponent field and add one when the mantissa is non-zero, clear the mantissa.
So every float32 subnormal goes to 2^-126 and 0 stays 0; inf and NaN are kept;
a finite value above 2^127 becomes inf.

`ue8m0_encode` is the exact ceiling into ue8m0: powers of two map to their
byte, anything else to the byte of the next power of two up. Values at or below
2^-127 (0 included) give byte 0, the smallest scale. Negative, NaN, infinite or
too large (> 2^127) inputs give byte 255 (NaN): a scale must be positive.
"""

from __future__ import annotations

import numpy as np

from .errors import expect_dtype

UE8M0_NAN = 255
UE8M0_BIAS = 127
# Smallest scale byte quantizers emit: 2^-126, the smallest *normal* float32
# power of two, so dequantizing never multiplies by a subnormal scale.
MIN_SCALE_BYTE = 1


def _build_decode_lut() -> np.ndarray:
    bits = np.arange(256, dtype=np.uint32) << np.uint32(23)
    bits[0] = 0x00400000  # 2^-127 as a float32 subnormal
    bits[255] = 0x7FC00000  # NaN
    return bits.view(np.float32)


UE8M0_LUT = _build_decode_lut()  # [256] float32
UE8M0_LUT.setflags(write=False)


def ue8m0_decode(b: np.ndarray) -> np.ndarray:
    """uint8 scale bytes (any shape) -> float32 2^(b-127); 255 -> NaN."""
    b = expect_dtype(b, np.uint8, "ue8m0_decode bytes")
    return UE8M0_LUT[b]


def ue8m0_encode(x: np.ndarray) -> np.ndarray:
    """float32 (any shape) -> uint8 ue8m0 byte of the smallest power of two >= x."""
    x = expect_dtype(x, np.float32, "ue8m0_encode input")
    bits = np.ascontiguousarray(x).view(np.uint32)
    exp = (bits >> np.uint32(23)) & np.uint32(0xFF)
    man = bits & np.uint32(0x7FFFFF)
    byte = exp + (man != 0)
    # float32 subnormals: (0, 2^-127] -> 0 (2^-127), (2^-127, 2^-126) -> 1
    sub = exp == 0
    byte[sub] = (man[sub] > 0x400000).astype(np.uint32)
    byte[(bits >> np.uint32(31)).astype(bool) & (bits != 0x80000000)] = UE8M0_NAN
    np.minimum(byte, UE8M0_NAN, out=byte)  # > 2^127 and inf/NaN (exp 255) -> 255
    return byte.astype(np.uint8).reshape(x.shape)


def pow2ceil(x: np.ndarray) -> np.ndarray:
    """float32 -> float32 power-of-two ceiling on the bits (see module doc)."""
    x = expect_dtype(x, np.float32, "pow2ceil input")
    bits = np.ascontiguousarray(x).view(np.uint32)
    exp = bits & np.uint32(0x7F800000)
    special = exp == np.uint32(0x7F800000)  # inf / NaN: unchanged
    bump = ((bits & np.uint32(0x7FFFFF)) != 0) & ~special
    out = (bits & np.uint32(0x80000000)) | (exp + (bump.astype(np.uint32) << np.uint32(23)))
    return np.where(special, bits, out).view(np.float32).reshape(x.shape)


def scale_bytes_for(amax: np.ndarray, qmax: float) -> np.ndarray:
    """Release scale rule: byte of pow2ceil(amax / qmax) in float32, floored at
    MIN_SCALE_BYTE (so an all-zero block gets 2^-126 and decodes to zeros).
    amax: float32 >= 0 of any shape. NaN amax gives byte 255."""
    amax = expect_dtype(amax, np.float32, "block amax")
    scale = pow2ceil(amax / np.float32(qmax))
    byte = ue8m0_encode(scale)
    nan = np.isnan(amax)
    np.maximum(byte, np.uint8(MIN_SCALE_BYTE), out=byte)
    byte[nan] = UE8M0_NAN
    return byte
