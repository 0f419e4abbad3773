"""The compressor of a kv source (`regions.attention.SourceAttention`), in its two parts:

- `projections`: a row's compressor inputs from the site's x: at ratio 1 the compressed latent
  itself [B, T, hd]; above, the float32 projections kv and gate [B, T, 2, hd] its group pools;
- `pool`: the complete groups of a chunk from the projections of all its rows and the per-slot
  partial groups (`part_kv`, `part_gate`), which it updates.

`projections` is per row, `pool` needs every row of a chunk in order: a prompt divided by rows
(regions/rows.py) computes each rank's rows' projections, all-gathers them, and pools the whole chunk
on every rank, so the partial groups stay the same on every rank whichever rank computed a row.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F

from deepinfer.regions.paging import gather_rows, ring_update

ops = torch.ops.deepinfer


def projections(region, x: Tensor) -> Tensor:
    """x [B, T, D] -> the compressor's per-row inputs: ratio 1, the latent [B, T, hd] (x's dtype);
    above, kv and gate [B, T, 2, hd] float32."""
    if region.ratio == 1:
        return ops.rmsnorm(F.linear(x, region.c_wkv.to(x.dtype)), region.c_norm, region.c.rms_norm_eps)
    return torch.stack((F.linear(x.float(), region.c_wkv), F.linear(x.float(), region.c_wgate)), 2)


def pool(region, proj: Tensor, positions: Tensor, slots: Tensor, part_kv, part_gate, dtype: torch.dtype):
    """A chunk's projections (`projections` of every row, positions [B, T]) -> its complete groups:
    latents [B, G, hd] (pre-rope, `dtype`), entry indices t [B, G] and which are complete [B, G].

    The rings `part_kv`, `part_gate` [S, R, hd] (R >= ratio) hold position j's projections at row j % R:
    the first group's positions before the chunk come from them, and they are updated in place."""
    r = region.ratio
    valid = positions >= 0
    if r == 1:
        return proj, positions.clamp_min(0), valid
    B, T = positions.shape
    R = part_kv.shape[1]
    kv, gate = proj.unbind(2)  # [B, T, hd] f32 each
    p0 = positions[:, :1].clamp_min(0)  # [B, 1]
    off = p0.remainder(r)
    nvalid = valid.sum(dim=1, keepdim=True)  # [B, 1]
    L = r * -(-(T + r - 1) // r)
    i = torch.arange(L, device=proj.device)
    # row i of the chunk's groups is position p0 - off + i: before p0 from the ring, then the chunk
    src = torch.where(i < off, (p0 - off + i).remainder(R), R + i - off).clamp(0, R + T - 1)  # [B, L]
    ring_kv, ring_gate = part_kv.index_select(0, slots), part_gate.index_select(0, slots)  # [B, R, hd]
    buf_kv = torch.cat((ring_kv, kv), dim=1)  # [B, R + T, hd]
    buf_gate = torch.cat((ring_gate, gate), dim=1)
    pooled = ops.compress_pool(
        gather_rows(buf_kv, src).unflatten(1, (-1, r)), gather_rows(buf_gate, src).unflatten(1, (-1, r))
    )  # [B, G, hd]
    latent = ops.rmsnorm(pooled.to(dtype), region.c_norm, region.c.rms_norm_eps)
    g = torch.arange(L // r, device=proj.device)
    t = torch.div(p0 - off, r, rounding_mode="floor") + g  # [B, G]
    complete = (g + 1) * r <= off + nvalid
    last = p0 + nvalid - 1  # [B, 1]; below p0 for a padding row
    part_kv.index_copy_(0, slots, ring_update(ring_kv, buf_kv, p0, last))
    part_gate.index_copy_(0, slots, ring_update(ring_gate, buf_gate, p0, last))
    return latent, t, complete
