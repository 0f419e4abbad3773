"""Power-of-two rescaling of e4m3fn codes in the uint8 domain.

Multiplying every value of a tile by 2^-s (s = new scale exponent - old) is a
256-entry code-to-code table per shift s. Most codes do not even need the
table: when the value stays normal the shift only moves the exponent field,
so `code - 8*s` (uint8 arithmetic; the sign bit is untouched because the low
seven bits never borrow) is the answer. Only codes whose result is subnormal
or zero (exponent <= s, for s > 0) or that start subnormal (exponent 0, for
s < 0) go through the table, which rounds to nearest even. A chunk is processed
with a handful of whole-array uint8 operations plus a gather over the (few)
exceptional codes.

Callers guarantee no overflow for s < 0 (their new scale covers the block's
amax); the tables saturate at 448 regardless.
"""

from __future__ import annotations

import numpy as np

from .errors import QuantInputError
from .fp8 import E4M3FN_LUT, E4M3FN_NAN_CODE, e4m3fn_encode

MAX_SHIFT = 32  # |s| beyond this behaves like +-32 (every value rounds to zero / cannot occur)


def _build_tables() -> np.ndarray:
    s = np.arange(-MAX_SHIFT, MAX_SHIFT + 1, dtype=np.float32)
    vals = E4M3FN_LUT[None, :] * np.exp2(-s)[:, None]  # exact in float32
    with np.errstate(invalid="ignore"):
        return e4m3fn_encode(vals.astype(np.float32))  # [2*MAX_SHIFT+1, 256]


SHIFT_TABLES = _build_tables()  # row s + MAX_SHIFT: code -> code of value * 2^-s
SHIFT_TABLES.setflags(write=False)


def tile_kmax(k: np.ndarray, gr: int, gc: int) -> np.ndarray:
    """Max magnitude code over [gr, gc] tiles of k = codes & 0x7F.
    k: [rt*gr, ct*gc] uint8 -> [rt, ct] uint8."""
    rows, cols = k.shape
    per_col = k.reshape(rows // gr, gr, cols).max(axis=1)  # [rt, cols]
    return per_col.reshape(rows // gr, cols // gc, gc).max(axis=2)


def check_no_nan(kmax: np.ndarray, what: str, origin: tuple[int, int], tile: tuple[int, int]) -> None:
    """Raise if a tile max is the NaN code (0x7F): checkpoints carry no NaN
    weights, and a NaN would poison the amax of its whole output block."""
    if (kmax == E4M3FN_NAN_CODE).any():
        i, j = np.argwhere(kmax == E4M3FN_NAN_CODE)[0]
        r, c = origin[0] + i * tile[0], origin[1] + j * tile[1]
        raise QuantInputError(
            f"{what}: NaN fp8 code in the tile starting at row {r}, column {c} (fp8 weights must be finite)"
        )


def apply_shifts(codes: np.ndarray, k: np.ndarray, shift: np.ndarray, gr: int, gc: int, out: np.ndarray) -> None:
    """out = codes with every [gr, gc] tile multiplied by 2^-shift[tile].

    codes, k (= codes & 0x7F), out: [rt*gr, ct*gc] uint8, C-contiguous.
    shift: [rt, ct] integer (any sign).
    """
    rt, ct = shift.shape
    rows, cols = codes.shape
    sh = np.clip(shift.astype(np.int16), -MAX_SHIFT, MAX_SHIFT)
    if not sh.any():
        np.copyto(out, codes)
        return
    # per tile: the low-7-bit threshold below which the table is needed
    thr = np.where(sh > 0, np.minimum(8 * sh + 8, 255), np.where(sh < 0, 8, 0)).astype(np.uint8)
    delta = ((-8 * sh) & 0xFF).astype(np.uint8)  # code += delta (mod 256)
    thr_c = np.repeat(thr, gc, axis=1)[:, None, :]  # [rt, 1, cols]
    delta_c = np.repeat(delta, gc, axis=1)[:, None, :]
    c3 = codes.reshape(rt, gr, cols)
    np.add(c3, delta_c, out=out.reshape(rt, gr, cols))
    mask = k.reshape(rt, gr, cols) < thr_c  # [rt, gr, cols]
    if sh.min() >= 0 and sh.max() == 1:
        # halving only (convert_format's case): codes below 16 (exponent 0 or 1) are k * 2^-9, so
        # their half is the code round-half-even(k / 2), sign kept: whole-array uint8 operations
        # instead of a gather at every small code (uniformly random codes have many)
        half = (codes & np.uint8(0x80)) | ((k >> 1) + (k & (k >> 1) & 1))
        keep = mask.reshape(rows, cols).view(np.uint8) * np.uint8(0xFF)  # 0xFF where half applies
        out &= ~keep  # a bitwise blend: several
        out |= half & keep  # times np.copyto(where=)
    elif mask.any():
        flat = np.flatnonzero(mask)
        s_at = sh[flat // (gr * cols), (flat % cols) // gc]
        out.reshape(-1)[flat] = SHIFT_TABLES[s_at + MAX_SHIFT, codes.reshape(-1)[flat]]
