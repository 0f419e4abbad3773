"""Device fp8 formats and the per-block conversion between them.

Checkpoints ship OCP e4m3fn (max 448, NaN = 0x7F/0xFF, no infinities). Neuron
kernels may read either that or the IEEE-like e4m3 of the NKI docs
(`nki.language.float8_e4m3`, ml_dtypes.float8_e4m3): same bias and the same
codes up to exponent 14, but exponent 15 is reserved:

  code (low 7 bits)  e4m3fn            e4m3 (IEEE-like)
  0x00..0x77         identical values  identical values (0x77 = 240, the e4m3 max)
  0x78..0x7E         256 .. 448        0x78 = inf, 0x79..0x7E = NaN
  0x7F               NaN               NaN

So a block whose magnitudes are all <= 240 is already valid e4m3. A block
holding larger magnitudes is halved (code -> code of value/2, exact except for
subnormal results, which round to nearest even) and its ue8m0 byte gains one.
The decision is per scale block, so blocks that fit keep their subnormal
precision (rescale.convert_format does this in the uint8 domain). The target
names the format its kernels read; the bundle manifest records it
(`FP8_FORMATS` keys).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import expect_dtype
from .fp8 import E4M3FN_LUT, e4m3fn_encode

FP8_E4M3FN = "e4m3fn"
FP8_E4M3 = "e4m3"


@dataclass(frozen=True)
class Fp8Format:
    name: str
    max_value: float  # largest finite magnitude
    max_code: int  # its code (low 7 bits)


FP8_FORMATS = {
    FP8_E4M3FN: Fp8Format(FP8_E4M3FN, 448.0, 0x7E),
    FP8_E4M3: Fp8Format(FP8_E4M3, 240.0, 0x77),
}


def fp8_format(name: str) -> Fp8Format:
    from .errors import QuantInputError

    try:
        return FP8_FORMATS[name]
    except KeyError:
        raise QuantInputError(f"unknown fp8 format {name!r}; valid formats: {', '.join(sorted(FP8_FORMATS))}") from None


def _build_e4m3_lut() -> np.ndarray:
    lut = E4M3FN_LUT.copy()
    lut[0x78], lut[0xF8] = np.inf, -np.inf
    lut[0x79:0x80] = np.nan
    lut[0xF9:0x100] = np.nan
    return lut


E4M3_LUT = _build_e4m3_lut()  # [256] float32, IEEE-like e4m3
E4M3_LUT.setflags(write=False)


def e4m3_decode(codes: np.ndarray) -> np.ndarray:
    """uint8 IEEE-like e4m3 codes -> float32 (0x78 = inf, 0x79..0x7F NaN)."""
    return E4M3_LUT[expect_dtype(codes, np.uint8, "e4m3_decode codes")]


def e4m3_encode(x: np.ndarray) -> np.ndarray:
    """float32 -> IEEE-like e4m3: round-to-nearest-even, saturating to +-240
    (infinities too), NaN -> 0x7F with the input's sign bit."""
    code = e4m3fn_encode(x)
    mag = code & np.uint8(0x7F)
    sat = (mag > 0x77) & (mag != 0x7F)
    code[sat] = (code[sat] & np.uint8(0x80)) | np.uint8(0x77)
    return code


def encoder(name: str):
    """float32 -> uint8 encoder of a format, saturating at its max."""
    return {FP8_E4M3FN: e4m3fn_encode, FP8_E4M3: e4m3_encode}[fp8_format(name).name]
