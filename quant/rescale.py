"""Rescale block-quantized fp8 weights to ue8m0 scales of another block size.

Two sources:
  * ue8m0 scales (the V4.1 checkpoint: [32, 32] blocks): every rescale is by a
    power of two, so it stays in the uint8 domain (quant/shift.py);
  * arbitrary float32 scales (DeepSeek-V3 `weight_scale_inv`, [128, 128]
    blocks, value = fp8 * scale): one 256-entry code table per tile, built in
    float32 and applied with one gather per element.

Semantics (the reference the tests hold it to, written in plain float32):
    v      = e4m3fn(code) * src_scale                 (float32 multiply)
    amax   = max |v| over each destination block
    scale  = max(pow2ceil(amax / fmt.max_value), 2^-126)   (ue8m0 byte >= 1)
    code'  = encode_fmt(v / scale)                     (RNE, saturating)
fmt.max_value is 448 for e4m3fn and 240 for the IEEE-like e4m3 (formats.py),
so asking for "e4m3" directly yields what converting afterwards would, but with
a single rounding. For ue8m0 sources the uint8 result equals the float32
reference whenever v is finite in float32 (source scale bytes <= 246); a
destination scale that would overflow ue8m0 is an error.

Geometry: blocks are ints (square) or (rows, cols). Source and destination
blocks need not nest: the matrix is cut into tiles of gcd(src, dst) per axis,
each inside one source and one destination block. Work proceeds in chunks of
whole lcm(src, dst) row slabs, sized to stay in cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from . import blocks
from .errors import QuantInputError, expect_dtype
from .formats import FP8_E4M3, FP8_E4M3FN, encoder, fp8_format
from .fp8 import E4M3FN_LUT
from .shift import apply_shifts, check_no_nan, tile_kmax
from .ue8m0 import UE8M0_LUT, UE8M0_NAN, scale_bytes_for

CHUNK_BYTES = 4 << 20  # input bytes per chunk: a few working arrays of this stay in L3


def block_pair(block, what: str) -> tuple[int, int]:
    if isinstance(block, (tuple, list)) and len(block) == 2:
        return blocks.check_block(block[0], what), blocks.check_block(block[1], what)
    b = blocks.check_block(block, what)
    return b, b


@dataclass(frozen=True)
class Geometry:
    """Block geometry of one rescale of a [R, C] matrix."""

    shape: tuple[int, int]
    src: tuple[int, int]
    dst: tuple[int, int]

    @property
    def tile(self) -> tuple[int, int]:
        return math.gcd(self.src[0], self.dst[0]), math.gcd(self.src[1], self.dst[1])

    @property
    def slab(self) -> tuple[int, int]:
        return math.lcm(self.src[0], self.dst[0]), math.lcm(self.src[1], self.dst[1])

    def chunks(self, chunk_bytes: int = CHUNK_BYTES):
        """Yield (r0, r1, c0, c1): chunks aligned to whole slabs (the last may be partial)."""
        R, C = self.shape
        lr, lc = self.slab
        width = C if lr * C <= chunk_bytes else max(lc, chunk_bytes // lr // lc * lc)
        height = lr * max(1, chunk_bytes // (lr * max(width, 1)))
        for r0 in range(0, R, height):
            for c0 in range(0, C, width):
                yield r0, min(r0 + height, R), c0, min(c0 + width, C)


def _padded(a: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """a if already C-contiguous [rows, cols], else a zero-padded contiguous copy."""
    if a.shape == (rows, cols) and a.flags.c_contiguous:
        return a
    buf = np.zeros((rows, cols), dtype=a.dtype)
    buf[: a.shape[0], : a.shape[1]] = a
    return buf


class _Chunk:
    """One chunk's tiles: codes (padded to whole tiles), k, per-tile kmax and
    the source/destination block index of every tile row and column."""

    def __init__(self, g: Geometry, codes: np.ndarray, r0: int, r1: int, c0: int, c1: int, what: str):
        gr, gc = g.tile
        rows, cols = -(-(r1 - r0) // gr) * gr, -(-(c1 - c0) // gc) * gc
        self.codes = _padded(codes[r0:r1, c0:c1], rows, cols)
        self.k = self.codes & np.uint8(0x7F)
        self.kmax = tile_kmax(self.k, gr, gc)  # [rt, ct]
        check_no_nan(self.kmax, what, (r0, c0), g.tile)
        ti = r0 + np.arange(rows // gr) * gr  # first row of each tile row
        tj = c0 + np.arange(cols // gc) * gc
        self.src_ij = np.ix_(ti // g.src[0], tj // g.src[1])
        self.dst_i, self.dst_j = ti // g.dst[0], tj // g.dst[1]
        self.box = (r0, r1, c0, c1)

    def dst_scales(self, tile_amax: np.ndarray, qmax: float, what: str) -> np.ndarray:
        """Destination scale bytes for the blocks this chunk covers ([nb_r, nb_c])."""
        ui, inv_i = np.unique(self.dst_i, return_inverse=True)
        uj, inv_j = np.unique(self.dst_j, return_inverse=True)
        amax = np.zeros((ui.size, uj.size), np.float32)
        np.maximum.at(amax, (inv_i[:, None], inv_j[None, :]), tile_amax)
        t = scale_bytes_for(amax, qmax)
        if (t == UE8M0_NAN).any():
            raise QuantInputError(
                f"{what}: a destination block scale overflows ue8m0 (source scales too large for float32)"
            )
        self.tile_t = t[inv_i[:, None], inv_j[None, :]]  # [rt, ct]
        return t

    def result_buffer(self, out: np.ndarray) -> np.ndarray:
        """Where apply_* writes: `out` itself when this chunk of it is aligned to
        whole tiles and contiguous, else a scratch array that store() copies back."""
        r0, r1, c0, c1 = self.box
        view = out[r0:r1, c0:c1]
        self.direct = view.shape == self.codes.shape and view.flags.c_contiguous
        return view if self.direct else np.empty_like(self.codes)

    def store(self, out: np.ndarray, result: np.ndarray) -> None:
        r0, r1, c0, c1 = self.box
        if not self.direct:
            out[r0:r1, c0:c1] = result[: r1 - r0, : c1 - c0]


def _out_codes(out: np.ndarray | None, codes: np.ndarray, what: str) -> np.ndarray:
    """The caller's output array (e.g. a writable map of the output file), checked."""
    if out is None:
        return np.empty_like(codes)
    if out.shape != codes.shape or out.dtype != np.uint8 or not out.flags.writeable:
        raise QuantInputError(f"{what}: out must be a writable uint8 array of shape {codes.shape}")
    return out


def _check_inputs(
    codes: np.ndarray, scales: np.ndarray, sdtype: type[np.generic], src, dst, what: str
) -> tuple[np.ndarray, np.ndarray, Geometry]:
    codes = blocks.check_matrix(expect_dtype(codes, np.uint8, f"{what} codes"), f"{what} codes")
    scales = expect_dtype(scales, sdtype, f"{what} scales")
    g = Geometry(codes.shape, block_pair(src, f"{what} src_block"), block_pair(dst, f"{what} dst_block"))
    blocks.check_grid(scales, codes.shape, *g.src, what)
    return codes, scales, g


def rescale_ue8m0(
    codes: np.ndarray,
    scales: np.ndarray,
    src_block=32,
    dst_block=128,
    fmt: str = FP8_E4M3FN,
    chunk_bytes: int = CHUNK_BYTES,
    out: np.ndarray | None = None,
):
    """e4m3fn codes [R, C] with ue8m0 scales on src blocks -> (codes [R, C] in `fmt`,
    ue8m0 scales [ceil(R/dst_r), ceil(C/dst_c)])."""
    what = "rescale_ue8m0"
    codes, scales, g = _check_inputs(codes, scales, np.uint8, src_block, dst_block, what)
    if (scales == UE8M0_NAN).any():
        raise QuantInputError(f"{what} scales: byte 255 (NaN) is not a valid block scale")
    qmax = fp8_format(fmt).max_value
    out = _out_codes(out, codes, what)
    out_s = np.empty(blocks.grid(codes.shape, *g.dst), np.uint8)
    for r0, r1, c0, c1 in g.chunks(chunk_bytes):
        ch = _Chunk(g, codes, r0, r1, c0, c1, what)
        a = scales[ch.src_ij].astype(np.int16)  # [rt, ct] source bytes
        t = ch.dst_scales(E4M3FN_LUT[ch.kmax] * UE8M0_LUT[a], qmax, what)
        out_s[ch.dst_i[0] : ch.dst_i[0] + t.shape[0], ch.dst_j[0] : ch.dst_j[0] + t.shape[1]] = t
        result = ch.result_buffer(out)
        apply_shifts(ch.codes, ch.k, ch.tile_t.astype(np.int16) - a, *g.tile, out=result)
        ch.store(out, result)
    return out, out_s


def rescale_fp32(
    codes: np.ndarray,
    scale_inv: np.ndarray,
    src_block=128,
    dst_block=128,
    fmt: str = FP8_E4M3FN,
    chunk_bytes: int = CHUNK_BYTES,
    out: np.ndarray | None = None,
):
    """e4m3fn codes [R, C] with float32 scales (value = fp8 * scale) on src blocks ->
    (codes [R, C] in `fmt`, ue8m0 scales [ceil(R/dst_r), ceil(C/dst_c)])."""
    what = "rescale_fp32"
    codes, scale_inv, g = _check_inputs(codes, scale_inv, np.float32, src_block, dst_block, what)
    if not (np.isfinite(scale_inv) & (scale_inv >= 0)).all():
        raise QuantInputError(f"{what} scales: expected finite, non-negative float32 block scales")
    qmax, encode = fp8_format(fmt).max_value, encoder(fmt)
    out = _out_codes(out, codes, what)
    out_s = np.empty(blocks.grid(codes.shape, *g.dst), np.uint8)
    for r0, r1, c0, c1 in g.chunks(chunk_bytes):
        ch = _Chunk(g, codes, r0, r1, c0, c1, what)
        s = scale_inv[ch.src_ij]  # [rt, ct] float32
        t = ch.dst_scales(E4M3FN_LUT[ch.kmax] * s, qmax, what)
        out_s[ch.dst_i[0] : ch.dst_i[0] + t.shape[0], ch.dst_j[0] : ch.dst_j[0] + t.shape[1]] = t
        tables = _fp32_tables(s, ch.tile_t, encode)  # [rt, ct, 256]
        result = ch.result_buffer(out)
        _apply_tables(ch.codes, tables, *g.tile, out=result)
        ch.store(out, result)
    return out, out_s


def _fp32_tables(s: np.ndarray, t: np.ndarray, encode) -> np.ndarray:
    """Code tables per tile: code -> encode(fl32(e4m3fn(code) * s) / 2^(t-127)).
    s: [rt, ct] float32, t: [rt, ct] scale bytes. Built for the 128 positive codes;
    negative codes mirror them (both float32 steps are odd functions)."""
    v = E4M3FN_LUT[None, None, :128] * s[:, :, None]  # [rt, ct, 128]
    pos = encode(v / UE8M0_LUT[t][:, :, None])
    return np.concatenate([pos, pos | np.uint8(0x80)], axis=2)


def convert_format(
    codes: np.ndarray,
    scales: np.ndarray,
    block=32,
    fmt: str = FP8_E4M3,
    chunk_bytes: int = CHUNK_BYTES,
    out: np.ndarray | None = None,
):
    """e4m3fn codes + ue8m0 scales -> the device format `fmt` (formats.py).

    For "e4m3": every block holding a magnitude above 240 is halved (codes via the
    shift tables) and its scale byte gains one; other blocks are unchanged.
    For "e4m3fn": a copy. Returns (codes [R, C], scales [same grid])."""
    what = "convert_format"
    codes, scales, g = _check_inputs(codes, scales, np.uint8, block, block, what)
    limit = fp8_format(fmt).max_code
    out = _out_codes(out, codes, what)
    if fmt == FP8_E4M3FN:
        np.copyto(out, codes)
        return out, scales.copy()
    out_s = scales.copy()
    for r0, r1, c0, c1 in g.chunks(chunk_bytes):
        ch = _Chunk(g, codes, r0, r1, c0, c1, what)
        halve = (ch.kmax > limit).astype(np.int16)  # [rt, ct], tile == block
        a = scales[ch.src_ij]
        if ((a.astype(np.int16) + halve) >= UE8M0_NAN).any():
            raise QuantInputError(f"{what}: a block with scale byte 254 needs halving; its scale would overflow ue8m0")
        out_s[ch.src_ij] = a + halve.astype(np.uint8)
        result = ch.result_buffer(out)
        apply_shifts(ch.codes, ch.k, halve, *g.tile, out=result)
        ch.store(out, result)
    return out, out_s


def _apply_tables(codes: np.ndarray, tables: np.ndarray, gr: int, gc: int, out: np.ndarray) -> None:
    """out[tile] = tables[tile][codes[tile]]; codes/out [rt*gr, ct*gc], tables [rt, ct, 256]."""
    rt, ct, _ = tables.shape
    cols = codes.shape[1]
    # [1, cols] offset of each column's table; uint16 indices gather fastest in numpy
    itype = np.uint16 if ct * 256 <= 1 << 16 else np.intp
    base = (np.arange(cols, dtype=itype) // gc * 256)[None, :]
    for i in range(rt):
        rows = slice(i * gr, (i + 1) * gr)
        idx = codes[rows] + base  # [gr, cols]
        np.take(tables[i].reshape(-1), idx, out=out[rows])
