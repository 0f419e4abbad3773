"""Hyper-connections: n residual streams mixed around every sublayer.

Shapes: h [B, T, n, D] streams; pre, post [B, T, n] and comb [B, T, n, n]
(comb[i, o]: input stream i to output stream o) are float32 coefficients.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F

from deepinfer.kernels.registry import register


def hc_mixes_ref(
    h: Tensor, fn: Tensor, base: Tensor, scale: Tensor, norm_eps: float, hc_eps: float, iters: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Coefficients (pre, post, comb) of one sublayer from the streams h.

    fn [(2+n)*n, n*D], base [(2+n)*n], scale [3] (float32).
    logits = base + (fn @ flat) * rsqrt(mean(flat^2) + norm_eps) * (s0 x n, s1 x n, s2 x n*n);
    pre = sigmoid + hc_eps; post = 2 * sigmoid; comb = Sinkhorn of softmax (iters rounds).
    """
    n = h.shape[-2]
    flat = h.flatten(-2).float()  # [B, T, n*D]
    mix = F.linear(flat, fn.float()) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    scales = torch.cat((scale[0:1].expand(n), scale[1:2].expand(n), scale[2:3].expand(n * n)))
    logits = torch.addcmul(base.float(), mix, scales.float())
    pre = torch.sigmoid(logits[..., :n]) + hc_eps
    post = 2 * torch.sigmoid(logits[..., n : 2 * n])
    comb = logits[..., 2 * n :].unflatten(-1, (n, n)).softmax(-1) + hc_eps
    comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    return pre, post, comb


def hc_collapse_ref(h: Tensor, pre: Tensor) -> Tensor:
    """sum_i pre_i * h_i: [B, T, n, D] -> [B, T, D], float32 math, h's dtype."""
    return (pre.unsqueeze(-1) * h.float()).sum(-2).to(h.dtype)


def hc_expand_ref(out: Tensor, h: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    """h_new[o] = post[o] * out + sum_i comb[i, o] * h[i]; float32 math, out's dtype."""
    update = post.unsqueeze(-1) * out.unsqueeze(-2)  # [B, T, n, D]
    mixed = (comb.unsqueeze(-1) * h.unsqueeze(-2)).sum(-3)  # [B, T, n, D]
    return (update + mixed).to(out.dtype)


hc_mixes = register(hc_mixes_ref)
hc_collapse = register(hc_collapse_ref)
hc_expand = register(hc_expand_ref)
