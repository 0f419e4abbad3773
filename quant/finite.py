"""Non-finite values in stored floats, found without decoding them.

In every IEEE-style float format here, NaN and infinity are exactly the codes whose magnitude
bits (all but the sign) are at least the all-ones-exponent code, and e4m3fn's only NaN is its
largest magnitude code 0x7F (ue8m0's is 0xFF). So one AND and one max per slice tells whether
a slice holds one: two vector passes over cache-sized slices of data the weight pass reads
anyway. fp4 (e2m1) has no such codes.
"""

from __future__ import annotations

import numpy as np

# safetensors dtype -> (unsigned view, magnitude mask, smallest non-finite magnitude)
NONFINITE_FROM = {
    "F64": (np.uint64, 0x7FFF_FFFF_FFFF_FFFF, 0x7FF0_0000_0000_0000),
    "F32": (np.uint32, 0x7FFF_FFFF, 0x7F80_0000),
    "F16": (np.uint16, 0x7FFF, 0x7C00),
    "BF16": (np.uint16, 0x7FFF, 0x7F80),
    "F8_E4M3": (np.uint8, 0x7F, 0x7F),
    "F8_E5M2": (np.uint8, 0x7F, 0x7C),
    "F8_E8M0": (np.uint8, 0xFF, 0xFF),
}
SLICE_BYTES = 1 << 22


def first_nonfinite(raw: np.ndarray, dtype: str) -> int | None:
    """raw: a C-contiguous array of a tensor's stored bytes (any shape and view) of safetensors
    dtype `dtype` -> the flat index of its first NaN or infinity, or None (also for dtypes
    without such values)."""
    spec = NONFINITE_FROM.get(dtype)
    if spec is None or raw.size == 0:
        return None
    view, mask, bad = spec
    flat = np.ascontiguousarray(raw).reshape(-1).view(np.uint8).view(view)
    step = max(1, SLICE_BYTES // flat.itemsize)
    tmp = np.empty(min(step, flat.size), view)
    for a in range(0, flat.size, step):
        part = flat[a : a + step]
        t = tmp[: part.size]
        np.bitwise_and(part, view(mask), out=t)
        if t.max() >= bad:
            return a + int(np.flatnonzero(t >= bad)[0])
    return None
