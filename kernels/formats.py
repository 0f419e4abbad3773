"""In-graph decoders of the checkpoint's weight formats (pure torch, no bitcasts).

Quantized weights travel through graphs as uint8 codes: a dtype bitcast of a
graph input is one of the things neuronx-cc rejects, so decoding is done with
integer and float arithmetic that every backend lowers.

- e4m3fn (OCP fp8): bit 7 sign, bits 6..3 exponent (bias 7), bits 2..0 mantissa;
  no infinities, 0x7f / 0xff are NaN, max 448. The checkpoint's format.
- e4m3 (IEEE-like, what Neuron's float8_e4m3 reads): the same codes up to exponent
  14 (max 240, code 0x77); exponent 15 is inf (mantissa 0) or NaN. The `e4m3` weight
  recipe writes it (quant/formats.py: a block over 240 is halved, its scale doubled).
- ue8m0: the byte b is the scale 2^(b - 127); 0xff is NaN.
- e2m1 (fp4): bit 3 sign, bits 2..1 exponent, bit 0 mantissa; magnitudes
  {0, .5, 1, 1.5, 2, 3, 4, 6}. Two codes a byte, the even element in the low nibble.
"""

from __future__ import annotations

import torch
from torch import Tensor

FP8_BLOCK = 32  # fp8 weights: one scale per 32x32 block
FP4_GROUP = 32  # fp4 weights: one scale per row and 32 columns


def _e4m3fn_values(c: Tensor) -> Tensor:
    """int32 codes -> float32 values, by arithmetic."""
    exponent = (c >> 3) & 15
    mantissa = (c & 7).to(torch.float32)
    normal = (mantissa + 8) * torch.exp2((exponent - 10).to(torch.float32))
    magnitude = torch.where(exponent == 0, mantissa * 2.0**-9, normal)
    magnitude = torch.where((c & 127) == 127, torch.full_like(magnitude, float("nan")), magnitude)
    return torch.where(c >= 128, -magnitude, magnitude)


def _e4m3_values(c: Tensor) -> Tensor:
    """int32 codes -> float32 IEEE-like e4m3 values: e4m3fn's below exponent 15, inf or NaN there."""
    special = torch.where(
        (c & 7) == 0,
        torch.full(c.shape, float("inf"), device=c.device),
        torch.full(c.shape, float("nan"), device=c.device),
    )
    special = torch.where(c >= 128, -special, special)
    return torch.where((c & 120) == 120, special, _e4m3fn_values(c))


FP8_TABLES = {"e4m3fn": _e4m3fn_values, "e4m3": _e4m3_values}
# the blockquant_gemm format name of fp8 weights stored in each fp8 format
FP8_GEMM_FORMATS = {"e4m3fn": "fp8", "e4m3": "fp8-e4m3"}


def fp8_decode(codes: Tensor, fmt: str = "e4m3fn") -> Tensor:
    """uint8 fp8 codes of format `fmt` ("e4m3fn" or "e4m3") -> float32 values.

    The 256-entry table is computed in the graph (cheap) and indexed: one
    gather per weight element instead of a chain of elementwise ops.
    """
    table = FP8_TABLES[fmt](torch.arange(256, dtype=torch.int32, device=codes.device))
    return table[codes.to(torch.int64)]


def e4m3fn_decode(codes: Tensor) -> Tensor:
    """uint8 e4m3fn codes -> float32 values."""
    return fp8_decode(codes, "e4m3fn")


def ue8m0_decode(codes: Tensor) -> Tensor:
    """uint8 ue8m0 bytes -> float32 powers of two."""
    value = torch.exp2(codes.to(torch.float32) - 127.0)
    return torch.where(codes == 255, torch.full_like(value, float("nan")), value)


def e2m1_decode(nibbles: Tensor) -> Tensor:
    """Integer tensor of 4-bit e2m1 codes -> float32 values."""
    table = _e2m1_values(torch.arange(16, dtype=torch.int32, device=nibbles.device))
    return table[nibbles.to(torch.int64)]


def _e2m1_values(n: Tensor) -> Tensor:
    """int32 4-bit codes -> float32 values, by arithmetic."""
    exponent = (n >> 1) & 3
    mantissa = (n & 1).to(torch.float32)
    normal = (mantissa + 2) * torch.exp2((exponent - 2).to(torch.float32))
    magnitude = torch.where(exponent == 0, mantissa * 0.5, normal)
    return torch.where((n & 8) != 0, -magnitude, magnitude)


def _expand_blocks(scales: Tensor, rows: int, cols: int, row_block: int, col_block: int) -> Tensor:
    # scales [..., ceil(rows/rb), ceil(cols/cb)] -> [..., rows, cols]
    s = scales.repeat_interleave(row_block, dim=-2)[..., :rows, :]
    return s.repeat_interleave(col_block, dim=-1)[..., :cols]


def dequant_fp8(codes: Tensor, scales: Tensor, dtype: torch.dtype, fmt: str = "e4m3fn") -> Tensor:
    """fp8 weight [..., N, K] (codes of `fmt`) with ue8m0 scales [..., ceil(N/32), ceil(K/32)] -> dtype."""
    rows, cols = codes.shape[-2], codes.shape[-1]
    values, s = fp8_decode(codes, fmt), ue8m0_decode(scales)
    if rows % FP8_BLOCK or cols % FP8_BLOCK:
        return (values * _expand_blocks(s, rows, cols, FP8_BLOCK, FP8_BLOCK)).to(dtype)
    blocks = values.unflatten(-1, (-1, FP8_BLOCK)).unflatten(-3, (-1, FP8_BLOCK))  # [..., Nb, 32, Kb, 32]
    return (blocks * s.unsqueeze(-1).unsqueeze(-3)).flatten(-2).flatten(-3, -2).to(dtype)


def dequant_fp8_rows(codes: Tensor, scales: Tensor, dtype: torch.dtype, fmt: str = "e4m3fn") -> Tensor:
    """fp8 rows [..., K] (codes of `fmt`) with per-row ue8m0 scales [..., ceil(K/32)] -> dtype."""
    cols = codes.shape[-1]
    s = ue8m0_decode(scales).repeat_interleave(FP8_BLOCK, dim=-1)[..., :cols]
    return (fp8_decode(codes, fmt) * s).to(dtype)


def fp4_pairs(device: torch.device) -> Tensor:
    """float32 [256, 2]: the e2m1 values of a byte's low (even) and high (odd) nibble, by arithmetic."""
    values = _e2m1_values(torch.arange(16, dtype=torch.int32, device=device))
    return torch.stack((values.repeat(16), values.repeat_interleave(16)), dim=-1)


def unpack_fp4(packed: Tensor, pairs: Tensor | None = None) -> Tensor:
    """uint8 [..., K/2] (two e2m1 codes a byte) -> float32 [..., K].

    One lookup per byte in the pair table (`fp4_pairs`, built here unless a caller that
    decodes many tiles passes the one it built): no per-nibble integer temporaries."""
    pairs = fp4_pairs(packed.device) if pairs is None else pairs
    values = pairs.index_select(0, packed.reshape(-1).to(torch.int64))  # [numel, 2]
    return values.view(*packed.shape[:-1], 2 * packed.shape[-1])


def dequant_fp4(packed: Tensor, scales: Tensor, dtype: torch.dtype, pairs: Tensor | None = None) -> Tensor:
    """fp4 weight [..., N, K/2] with ue8m0 scales [..., N, ceil(K/32)] -> dtype [..., N, K].
    `pairs`: the byte table of `unpack_fp4`, when the caller decodes many tiles."""
    values = unpack_fp4(packed, pairs)
    cols = values.shape[-1]
    s = ue8m0_decode(scales)
    if cols % FP4_GROUP:
        return (values * s.repeat_interleave(FP4_GROUP, dim=-1)[..., :cols]).to(dtype)
    groups = values.unflatten(-1, (-1, FP4_GROUP))  # [..., N, K/32, 32]
    return (groups * s.unsqueeze(-1)).flatten(-2).to(dtype)
