"""Per-rank weight shards: a checkpoint tensor -> what rank r holds (regions/topology.py).

    moe, ep > 1       routed experts [E, ...] -> experts r*E/ep ... (r+1)*E/ep - 1
                      shared expert -> its intermediate columns [start, stop) of `shared_slice`,
                      zero-padded to the slice width; zeros for ranks without a slice
    attn_*, tp > 1    wq_b rows and sink entries of this rank's heads; wo_a rows and wo_b
                      columns of this rank's output groups (scales follow in 32-blocks)
    everything else   replicated

fp8 weights [rows, cols] carry ue8m0 scales [rows/32, cols/32]: slicing rows or
columns of a weight slices the matching scale blocks (shards are whole blocks,
which `topology.check` guarantees).
"""

from __future__ import annotations

import torch

from deepinfer.regions.config import TextConfig
from deepinfer.bundles.topology import Topology
from deepinfer.regions.topology import BLOCK, shared_slice, shared_width

ROUTED = ("w1", "w1_s", "w3", "w3_s", "w2", "w2_s")


def _rows(t: torch.Tensor, start: int, stop: int, scale: bool) -> torch.Tensor:
    return t[start // BLOCK: -(-stop // BLOCK)] if scale else t[start:stop]


def _cols(t: torch.Tensor, start: int, stop: int, scale: bool) -> torch.Tensor:
    return t[:, start // BLOCK: -(-stop // BLOCK)] if scale else t[:, start:stop]


def _shared(name: str, t: torch.Tensor, c: TextConfig, topo: Topology, rank: int, shape) -> torch.Tensor:
    out = torch.zeros(shape, dtype=t.dtype)
    piece = shared_slice(c, topo, rank)
    if piece is None:
        return out                                   # this rank adds zeros
    start, stop = piece
    scale = name.endswith("_s")
    if name.startswith(("sw1", "sw3")):             # [I, D]: intermediate rows
        part = _rows(t, start, stop, scale)
        out[: part.shape[0]] = part
    else:                                            # sw2 [D, I]: intermediate columns
        part = _cols(t, start, stop, scale)
        out[:, : part.shape[1]] = part
    return out


def _attention(name: str, t: torch.Tensor, c: TextConfig, topo: Topology, rank: int) -> torch.Tensor:
    r = topo.tp_rank(rank)
    heads = c.num_attention_heads // topo.tp
    rows = c.o_groups // topo.tp * c.o_lora_rank
    scale = name.endswith("_s")
    if name.startswith("wq_b"):
        span = heads * c.head_dim
        return _rows(t, r * span, (r + 1) * span, scale)
    if name == "sink":
        return t[r * heads:(r + 1) * heads]
    if name.startswith("wo_a"):
        return _rows(t, r * rows, (r + 1) * rows, scale)
    if name.startswith("wo_b"):
        return _cols(t, r * rows, (r + 1) * rows, scale)
    return t


def shard(kind: str, name: str, t: torch.Tensor, c: TextConfig, topo: Topology, rank: int,
          shape: tuple[int, ...]) -> torch.Tensor:
    """Rank `rank`'s part of weight `name` of a region of `kind` (full tensor `t`), of `shape`."""
    if kind == "moe" and topo.ep > 1:
        if name in ROUTED:
            n = c.n_routed_experts // topo.ep
            r = rank % topo.ep
            t = t[r * n:(r + 1) * n]
        elif name.startswith(("sw1", "sw3", "sw2")):
            t = _shared(name, t, c, topo, rank, shape)
    elif kind.startswith("attn") and topo.tp > 1:
        t = _attention(name, t, c, topo, rank)
    if tuple(t.shape) != tuple(shape):
        raise AssertionError(f"{kind}.{name}: shard of rank {rank} has shape {tuple(t.shape)}, "
                             f"the region expects {tuple(shape)} (shared width {shared_width(c, topo)})")
    return t.contiguous()
