"""RMSNorm as V4.1 computes it: float32, weight applied before casting back."""

from __future__ import annotations

import torch
from torch import Tensor

from deepinfer.kernels.registry import register


def rmsnorm_ref(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x [..., C] * rsqrt(mean(x^2) + eps) * weight [C], in float32, returned in x's dtype."""
    v = x.float()
    v = v * torch.rsqrt(v.square().mean(-1, keepdim=True) + eps)
    return (weight.float() * v).to(x.dtype)


rmsnorm = register(rmsnorm_ref)
