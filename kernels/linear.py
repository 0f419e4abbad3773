"""Block-quantized GEMM, the clamped SwiGLU of V4.1's experts, and the routed experts as a group."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F

from deepinfer.kernels.formats import FP8_GEMM_FORMATS, dequant_fp4, dequant_fp8, fp4_pairs
from deepinfer.kernels.registry import register

FP8_OF_GEMM_FORMAT = {gemm: fp8 for fp8, gemm in FP8_GEMM_FORMATS.items()}  # "fp8" -> "e4m3fn", ...
WEIGHT_FORMATS = (*FP8_OF_GEMM_FORMAT, "fp4")


def blockquant_gemm_ref(x: Tensor, codes: Tensor, scales: Tensor, fmt: str) -> Tensor:
    """y = x @ W.T with W decoded from (codes, scales), computed in x's dtype.

    fmt "fp8": codes uint8 e4m3fn [..., N, K], scales ue8m0 [..., ceil(N/32), ceil(K/32)].
    fmt "fp8-e4m3": the same with IEEE-like e4m3 codes (the `e4m3` weight recipe).
    fmt "fp4": codes uint8 [..., N, K/2] (two e2m1 a byte), scales ue8m0 [..., N, ceil(K/32)].
    A 2-D weight is shared by every row of x [..., K] -> [..., N]. A weight with
    leading dims is per row: x [..., K] with codes [..., N, K'] -> [..., N]
    (the MoE's gathered experts, `[tokens, k, N, K']`).
    """
    if fmt == "fp4":
        w = dequant_fp4(codes, scales, x.dtype)
    else:
        w = dequant_fp8(codes, scales, x.dtype, FP8_OF_GEMM_FORMAT[fmt])
    if codes.dim() == 2:
        return F.linear(x, w)
    return torch.matmul(w, x.unsqueeze(-1)).squeeze(-1)


def swiglu_ref(gate: Tensor, up: Tensor, weight: Tensor | None, limit: float) -> Tensor:
    """silu(min(gate, limit)) * clamp(up, +-limit) [* weight], in float32, cast to gate's dtype.

    gate, up: [..., I]; weight (routing weight, optional): broadcastable [..., 1].
    limit <= 0 disables the clamps.
    """
    g, u = gate.float(), up.float()
    if limit > 0:
        g = g.clamp(max=limit)
        u = u.clamp(min=-limit, max=limit)
    y = F.silu(g) * u
    if weight is not None:
        y = y * weight.float()
    return y.to(gate.dtype)


# Routed experts are dequantized in tiles of weight rows, all local experts at once: a tile
# holds at most EXPERT_TILE_BYTES of float32 weights, and a weight is cut into at most
# EXPERT_MAX_TILES tiles, so the lowered graph's size does not grow with the expert count
# (at 384 local experts a tile is 1/8 of the weight, whatever its bytes).
EXPERT_TILE_BYTES = 32 << 20
EXPERT_MAX_TILES = 8


def expert_tiles(experts: int, rows: int, cols: int) -> list[tuple[int, int]]:
    """(start, stop) of the row tiles of an expert stack [experts, rows, cols]: equal but the last."""
    count = min(EXPERT_MAX_TILES, rows, -(-experts * rows * cols * 4 // EXPERT_TILE_BYTES))
    size = -(-rows // count)
    return [(start, min(start + size, rows)) for start in range(0, rows, size)]


def moe_experts_ref(
    x: Tensor,
    weights: Tensor,
    w1: Tensor,
    w1_s: Tensor,
    w3: Tensor,
    w3_s: Tensor,
    w2: Tensor,
    w2_s: Tensor,
    limit: float,
) -> Tensor:
    """sum_e w2_e(swiglu(w1_e(x), w3_e(x)) * weights[:, e]) over the local experts -> [N, D] float32.

    x [N, D]; weights [N, E] float32 (a row's routing weight of expert e, zero where the
    row is not routed to it); w1, w3 fp4 [E, I, D/2] with ue8m0 scales [E, I, D/32]; w2 fp4
    [E, D, I/2], scales [E, D, I/32]. Every expert computes every row, once per call, so its
    weights are decoded once whatever the row count, and in row tiles (`expert_tiles`):
    scratch is bounded by a tile of the local experts' weights plus the activations
    ([N, E, I] of the intermediate). Each expert's output is computed in x's dtype (the
    weighted SwiGLU product cast to it before w2, as `swiglu` does) and summed in float32.
    """
    E, I = w1.shape[0], w1.shape[1]
    D = x.shape[-1]
    weight, pairs = weights.unsqueeze(-1), fp4_pairs(x.device)  # [N, E, 1]
    parts = []
    for start, stop in expert_tiles(E, I, D):
        g = F.linear(x, dequant_fp4(w1[:, start:stop], w1_s[:, start:stop], x.dtype, pairs).flatten(0, 1))
        u = F.linear(x, dequant_fp4(w3[:, start:stop], w3_s[:, start:stop], x.dtype, pairs).flatten(0, 1))
        parts.append(swiglu_ref(g.unflatten(-1, (E, -1)), u.unflatten(-1, (E, -1)), weight, limit))  # [N, E, t]
    a = torch.cat(parts, -1).transpose(0, 1)  # [E, N, I]
    out = []
    for start, stop in expert_tiles(E, D, I):
        w = dequant_fp4(w2[:, start:stop], w2_s[:, start:stop], x.dtype, pairs)  # [E, t, I]
        out.append(torch.bmm(a, w.transpose(1, 2)).float().sum(0))  # [N, t]
    return torch.cat(out, -1)


blockquant_gemm = register(blockquant_gemm_ref)
swiglu = register(swiglu_ref)
moe_experts = register(moe_experts_ref)
