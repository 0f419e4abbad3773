"""fp8 e4m3fn (OCP "FN": finite + NaN, no infinities) on uint8 codes.

Code layout (one byte): bit 7 sign | bits 6..3 exponent (bias 7) | bits 2..0 mantissa.

  exponent 0       subnormal   m/8 * 2^-6        (0x01 = 2^-9, 0x07 = 7*2^-9)
  exponent 1..15   normal      (1 + m/8) * 2^(e-7)
  0x7F / 0xFF      NaN (the only NaN codes); 0x7E = 448 is the largest finite value
  0x00 / 0x80      +0 / -0

Magnitude order equals code order on the low seven bits (0x00..0x7E), which the
rescale and device-conversion code relies on (a block's amax is the max of
`code & 0x7F`).

`e4m3fn_decode` is a 256-entry float32 lookup table. `e4m3fn_encode` rounds
float32 to the nearest code, ties to even, saturating: finite values and
infinities beyond 448 become +-448 (torch's cast does not saturate; callers that
need saturation get it here). NaN stays NaN (0x7F with the input's sign bit).
"""

from __future__ import annotations

import numpy as np

from .errors import expect_dtype

E4M3FN_MAX = 448.0
E4M3FN_MAX_CODE = 0x7E
E4M3FN_NAN_CODE = 0x7F


def _build_decode_lut() -> np.ndarray:
    codes = np.arange(256, dtype=np.int64)
    exp = (codes >> 3) & 0xF
    man = (codes & 0x7).astype(np.float64)
    mag = np.where(exp == 0, man / 8.0 * 2.0**-6, (1.0 + man / 8.0) * np.exp2(exp - 7.0))
    val = np.where(codes & 0x80, -mag, mag)
    val[(codes & 0x7F) == 0x7F] = np.nan
    return val.astype(np.float32)


E4M3FN_LUT = _build_decode_lut()  # [256] float32
E4M3FN_LUT.setflags(write=False)

# float32 bit patterns used by the encoder
_MIN_NORMAL_BITS = np.uint32(0x3C800000)  # 2^-6, smallest e4m3fn normal
_SUB_MAGIC = np.float32(2.0**14)  # ulp(2^14) == 2^-9 == e4m3fn subnormal step
_SUB_MAGIC_BITS = np.uint32(0x46800000)
_EXP_REBIAS = np.uint32((127 - 7) << 3)  # float32 exponent bias -> e4m3 bias, in code units
_INF_BITS = np.uint32(0x7F800000)


def e4m3fn_decode(codes: np.ndarray) -> np.ndarray:
    """uint8 e4m3fn codes (any shape) -> float32 values of the same shape."""
    codes = expect_dtype(codes, np.uint8, "e4m3fn_decode codes")
    return E4M3FN_LUT[codes]


def e4m3fn_encode(x: np.ndarray) -> np.ndarray:
    """float32 (any shape) -> uint8 e4m3fn codes: round-to-nearest-even,
    saturating to +-448 (infinities too), NaN kept as NaN."""
    x = expect_dtype(x, np.float32, "e4m3fn_encode input")
    bits = np.ascontiguousarray(x).view(np.uint32)
    mag = bits & np.uint32(0x7FFFFFFF)
    sign = ((bits >> np.uint32(24)) & np.uint32(0x80)).astype(np.uint8)

    # Normal range: keep 3 mantissa bits, round the 20 dropped bits to nearest even;
    # a carry into the exponent is the correct rounding up to the next binade.
    odd = (mag >> np.uint32(20)) & np.uint32(1)
    normal = (mag + np.uint32(0x7FFFF) + odd) >> np.uint32(20)
    normal -= _EXP_REBIAS
    np.minimum(normal, np.uint32(E4M3FN_MAX_CODE), out=normal)

    # Subnormal range (|x| < 2^-6): adding 2^14 rounds |x| to a multiple of 2^-9
    # in hardware RNE; the low bits of the sum are the subnormal mantissa (0..8,
    # 8 being the smallest normal code 0x08).
    with np.errstate(over="ignore", invalid="ignore"):
        sub = (np.abs(x) + _SUB_MAGIC).view(np.uint32) - _SUB_MAGIC_BITS

    code = np.where(mag < _MIN_NORMAL_BITS, sub, normal).astype(np.uint8)
    code[mag > _INF_BITS] = E4M3FN_NAN_CODE
    code |= sign
    return code.reshape(x.shape)
