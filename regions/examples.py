"""Example inputs for a region method: valid values of the right shapes.

The compiler traces with them and checks lowered graphs numerically on them,
so they must exercise real paths: valid consecutive positions, distinct slots
and blocks per row, in-range engram rows, top-k indices that are visible.
"""

from __future__ import annotations

import torch

from deepinfer.regions.state import Geometry, InputSpec


def example_inputs(specs: list[InputSpec], g: Geometry, *, start: int = 0, seed: int = 0,
                   table_rows: int = 1) -> list[torch.Tensor]:
    """One tensor per spec. Row b holds positions start+b .. start+b+T-1 (b-th slot, own blocks)."""
    gen = torch.Generator().manual_seed(seed)
    by_name = {s.name: s for s in specs}
    B, T = by_name["h"].shape[:2] if "h" in by_name else (1, 1)
    positions = start + torch.arange(B).unsqueeze(1) + torch.arange(T)
    out = []
    for s in specs:
        if s.name == "positions":
            t = positions
        elif s.name == "slots":
            t = (1 + torch.arange(B)) % g.slots
        elif s.name == "block_table":
            t = (1 + torch.arange(B * s.shape[1]).view(B, -1)) % g.blocks
        elif s.name == "hash_ids":
            t = torch.randint(0, table_rows, s.shape, generator=gen)
        elif s.name in ("token_mask", "cand"):
            t = torch.ones(s.shape, dtype=torch.bool)
        elif s.name == "is_image":
            t = torch.zeros(s.shape, dtype=torch.bool)
        elif s.name == "topk":
            t = torch.arange(s.shape[-1]).expand(s.shape).clone()
        elif s.name == "pre":
            t = torch.softmax(torch.randn(s.shape, generator=gen), -1)
        elif s.dtype.is_floating_point:
            t = torch.randn(s.shape, generator=gen).to(s.dtype)
        else:
            t = torch.zeros(s.shape, dtype=s.dtype)
        out.append(t.to(s.dtype).contiguous())
    return out
