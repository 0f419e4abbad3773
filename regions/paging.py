"""Gathers and writes over per-sequence rows and paged pools (static shapes)."""

from __future__ import annotations

import torch
from torch import Tensor


def gather_rows(buf: Tensor, idx: Tensor) -> Tensor:
    """buf [B, N, C], idx [B, *S] (in range) -> [B, *S, C]."""
    B, C = buf.shape[0], buf.shape[-1]
    flat = idx.reshape(B, -1)
    out = torch.gather(buf, 1, flat.unsqueeze(-1).expand(B, flat.shape[1], C))
    return out.reshape(*idx.shape, C)


def gather_pages(pool: Tensor, block_table: Tensor) -> Tensor:
    """pool [NB, P, C], block_table [B, MB] -> a sequence's entries in logical order [B, MB * P, C]."""
    return pool[block_table].flatten(1, 2)


def write_pages(pool: Tensor, block_table: Tensor, t: Tensor, keep: Tensor, values: Tensor) -> None:
    """pool[block of entry t, t % P] = values where keep; other writes go to scratch block 0.

    t [B, G] logical entry indices, keep [B, G] bool, values [B, G, C].
    """
    per_block = pool.shape[1]
    page = torch.div(t, per_block, rounding_mode="floor").clamp(0, block_table.shape[1] - 1)
    block = torch.where(keep, block_table.gather(1, page), 0)
    offset = torch.where(keep, t.remainder(per_block), 0)
    pool.index_put_((block.flatten(), offset.flatten()), values.flatten(0, 1))


def ring_update(ring: Tensor, buf: Tensor, p0: Tensor, last: Tensor) -> Tensor:
    """A per-slot ring after a step: ring [B, R, hd] holds position j at row j % R, buf [B, R + T, hd]
    is the ring then the step's rows (position p0 + i at R + i), the step wrote positions p0 .. last
    ([B, 1] each). Row s takes the latest position j* <= last with j* % R == s where the step wrote
    it (j* >= p0), else keeps what it held -> the ring [B, R, hd]."""
    R = ring.shape[1]
    s = torch.arange(R, device=ring.device)
    jstar = last - (last - s).remainder(R)  # [B, R]
    fresh = (jstar >= p0) & (last >= 0)
    new = gather_rows(buf, (R + jstar - p0).clamp(0, buf.shape[1] - 1))
    return torch.where(fresh.unsqueeze(-1), new, ring)
