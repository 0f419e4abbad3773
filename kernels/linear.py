"""Block-quantized GEMM and the clamped SwiGLU of V4.1's experts."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F

from deepinfer.kernels.formats import FP8_GEMM_FORMATS, dequant_fp4, dequant_fp8
from deepinfer.kernels.registry import register

FP8_OF_GEMM_FORMAT = {gemm: fp8 for fp8, gemm in FP8_GEMM_FORMATS.items()}   # "fp8" -> "e4m3fn", ...
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


blockquant_gemm = register(blockquant_gemm_ref)
swiglu = register(swiglu_ref)
