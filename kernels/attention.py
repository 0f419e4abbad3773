"""Attention kernels: sparse attention with a sink, indexer scores, compressor pooling."""

from __future__ import annotations

import torch
from torch import Tensor

from deepinfer.kernels.registry import register


def sparse_attn_ref(q: Tensor, kv: Tensor, valid: Tensor, sink: Tensor, scale: float) -> Tensor:
    """Attention of each query over its own gathered keys, plus a sink.

    q [B, T, H, D]; kv [B, T, K, D] (one latent per key, used as key and value);
    valid [B, T, K] bool; sink [H] float32: a per-head logit with a zero value
    that joins the softmax. Computed in float32, returned in q's dtype.
    """
    kvf = torch.where(valid.unsqueeze(-1), kv.float(), 0.0)
    logits = torch.matmul(q.float(), kvf.transpose(-1, -2)) * scale  # [B, T, H, K]
    logits = logits.masked_fill(~valid.unsqueeze(2), float("-inf"))
    sinks = sink.float().view(1, 1, -1, 1).expand(*logits.shape[:3], 1)
    probs = torch.cat((logits, sinks), dim=-1).softmax(-1)[..., :-1]
    return torch.matmul(probs, kvf).to(q.dtype)  # [B, T, H, D]


def sparse_attn_partial_ref(
    q: Tensor, kv: Tensor, valid: Tensor, sink: Tensor, scale: float, with_sink: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """`sparse_attn` over one rank's share of the keys, unnormalized, with its softmax statistics.

    As `sparse_attn` (the sink joining the softmax where `with_sink`, a 0-d bool: on one rank of the
    keys' ranks, so it counts once) -> (numerator [B, T, H, D], max logit [B, T, H] (-inf where the
    share is empty), sum of exp(logit - max) [B, T, H]), all float32. The ranks' shares merge by
    log-sum-exp (`regions.divided.merge_attention`) into `sparse_attn` over all the keys.
    """
    kvf = torch.where(valid.unsqueeze(-1), kv.float(), 0.0)
    logits = torch.matmul(q.float(), kvf.transpose(-1, -2)) * scale  # [B, T, H, K]
    logits = logits.masked_fill(~valid.unsqueeze(2), float("-inf"))
    sinks = torch.where(with_sink, sink.float(), float("-inf")).view(1, 1, -1, 1).expand(*logits.shape[:3], 1)
    both = torch.cat((logits, sinks), dim=-1)
    top = both.amax(-1)  # [B, T, H]
    probs = torch.exp(both - torch.where(torch.isfinite(top), top, 0.0).unsqueeze(-1))
    return torch.matmul(probs[..., :-1], kvf), top, probs.sum(-1)


def index_score_ref(q: Tensor, k: Tensor, w: Tensor, visible: Tensor) -> Tensor:
    """score[t] = sum_h relu(q_h . k_t) * w_h, -inf where not visible.

    q [B, T, H, d]; k [B, W, d]; w [B, T, H]; visible [B, T, W] bool -> [B, T, W].
    Computed in q's dtype, rounding where the release's reference rounds.
    """
    s = torch.einsum("bthd,bwd->bthw", q, k.to(q.dtype))
    s = (s.relu() * w.to(q.dtype).unsqueeze(-1)).sum(dim=2)
    return s.masked_fill(~visible, float("-inf"))


def compress_pool_ref(kv: Tensor, gate: Tensor) -> Tensor:
    """Per channel, softmax of gate over each group of r tokens, weighted sum of kv.

    kv, gate: [B, G, r, C] -> [B, G, C], float32.
    """
    return (kv.float() * gate.float().softmax(dim=-2)).sum(dim=-2)


sparse_attn = register(sparse_attn_ref)
sparse_attn_partial = register(sparse_attn_partial_ref)
index_score = register(index_score_ref)
compress_pool = register(compress_pool_ref)
