"""Packed layouts of ue8m0 scale bytes, as kernels read them.

Each layout has a string name the bundle manifest records (`SCALE_LAYOUTS`).
S below is a uint8 scale array [..., MN, KB]: MN rows (output channels, or
tokens), KB scale groups along the reduction dimension K; leading dims (e.g.
experts) are batch dims and are packed independently.

LAYOUT_U8 = "ue8m0-u8-row-major"
    The checkpoint form: S itself, C-contiguous, one byte per scale.

LAYOUT_I32_MN_MAJOR = "ue8m0-x4-i32-mn-major-a4"
    Four consecutive K groups per int32 word, words laid out MN-major with MN
    padded to a multiple of 4 words (16 bytes), as grouped fp8 GEMM kernels read
    scales through TMA:
        W = int32 [..., KW, MNp],  KW = ceil(KB / 4),  MNp = ceil(MN / 4) * 4
        byte i (0 = least significant) of W[..., w, m] = S[..., m, 4w + i]
    so in memory, byte 4 * (w * MNp + m) + i holds S[m, 4w + i]. The kernel sees
    it as [MN, KW] with strides (1, MNp). Missing K groups (4w + i >= KB) and
    padding rows (m >= MN) are byte 0.

LAYOUT_I16_PAIRS = "ue8m0-x2-i16-row-major"
    Two consecutive K groups per int16, row-major:
        H = int16 [..., MN, ceil(KB / 2)],  H[..., m, j] = S[m, 2j] + 256 * S[m, 2j + 1]
    taken as two's complement (S[m, 2j + 1] >= 128 gives a negative int16); in
    memory byte 2j of row m is S[m, 2j] (little-endian), the low byte being the
    even group. A missing odd group (KB odd) is byte 0. It is computed with
    float32 arithmetic (exact below 2^24), the formulation that also compiles on
    Neuron; narrowing interleaved int32 slices to int16 crashed neuronx-cc
    (NCC_IBCG902), so neither side does that.
"""

from __future__ import annotations

import numpy as np

from .errors import QuantInputError, expect_dtype

LAYOUT_U8 = "ue8m0-u8-row-major"
LAYOUT_I32_MN_MAJOR = "ue8m0-x4-i32-mn-major-a4"
LAYOUT_I16_PAIRS = "ue8m0-x2-i16-row-major"
MN_ALIGN_WORDS = 4  # 16-byte alignment of each MN-major column of words


def _scales(s: np.ndarray, what: str) -> np.ndarray:
    s = expect_dtype(s, np.uint8, what)
    if s.ndim < 2:
        raise QuantInputError(f"{what}: expected [..., MN, KB] scale bytes, got shape {s.shape}")
    return s


def _pad_last2(s: np.ndarray, rows: int, cols: int) -> np.ndarray:
    pad = [(0, 0)] * (s.ndim - 2) + [(0, rows - s.shape[-2]), (0, cols - s.shape[-1])]
    return np.pad(s, pad) if any(p[1] for p in pad) else s


def pack_i32_mn_major(s: np.ndarray) -> np.ndarray:
    """uint8 [..., MN, KB] -> int32 [..., ceil(KB/4), ceil(MN/4)*4] (see module doc)."""
    s = _scales(s, "pack_i32_mn_major scales")
    mn, kb = s.shape[-2:]
    mnp, kw = -(-mn // MN_ALIGN_WORDS) * MN_ALIGN_WORDS, -(-kb // 4)
    p = np.ascontiguousarray(_pad_last2(s, mnp, 4 * kw))  # [..., MNp, 4*KW]
    words = p.view("<u4")  # [..., MNp, KW], byte i -> bits 8i..
    return np.ascontiguousarray(np.swapaxes(words, -1, -2)).astype(np.uint32).view(np.int32)


def unpack_i32_mn_major(w: np.ndarray, mn: int, kb: int) -> np.ndarray:
    """int32 [..., KW, MNp] -> uint8 [..., MN, KB]."""
    w = expect_dtype(w, np.int32, "unpack_i32_mn_major words")
    b = np.ascontiguousarray(np.swapaxes(w, -1, -2)).astype("<u4").view(np.uint8)  # [..., MNp, 4*KW]
    return np.ascontiguousarray(b[..., :mn, :kb])


def pack_i16_pairs(s: np.ndarray) -> np.ndarray:
    """uint8 [..., MN, KB] -> int16 [..., MN, ceil(KB/2)], via float32 arithmetic."""
    s = _scales(s, "pack_i16_pairs scales")
    p = _pad_last2(s, s.shape[-2], -(-s.shape[-1] // 2) * 2)
    lo = p[..., 0::2].astype(np.float32)
    hi = p[..., 1::2].astype(np.float32)
    wrap = np.float32(65536.0) * (hi >= np.float32(128.0))
    value = lo + np.float32(256.0) * hi - wrap  # exact: |value| < 2^16
    return value.astype(np.int16)


def unpack_i16_pairs(h: np.ndarray, kb: int) -> np.ndarray:
    """int16 [..., MN, KH] -> uint8 [..., MN, KB]."""
    h = expect_dtype(h, np.int16, "unpack_i16_pairs words")
    b = np.ascontiguousarray(h).astype("<i2").view(np.uint8)  # [..., MN, 2*KH]
    return np.ascontiguousarray(b[..., :kb])


def expand_rows(s: np.ndarray, block_rows: int, rows: int) -> np.ndarray:
    """Block scales [..., ceil(rows/b), KB] -> per-row scales [..., rows, KB]
    (kernels that take one scale row per output channel)."""
    return np.repeat(s, block_rows, axis=-2)[..., :rows, :]


SCALE_LAYOUTS = {
    LAYOUT_U8: lambda s: np.ascontiguousarray(s),
    LAYOUT_I32_MN_MAJOR: pack_i32_mn_major,
    LAYOUT_I16_PAIRS: pack_i16_pairs,
}


def pack_scales(s: np.ndarray, layout: str) -> np.ndarray:
    try:
        fn = SCALE_LAYOUTS[layout]
    except KeyError:
        raise QuantInputError(f"unknown scale layout {layout!r}; valid: {', '.join(SCALE_LAYOUTS)}") from None
    return fn(_scales(s, f"pack_scales({layout})"))
