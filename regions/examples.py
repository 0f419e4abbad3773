"""Example inputs for a region method: valid values of the right shapes.

The compiler traces on fake tensors of the same specs (compiler/trace.py); these real
values are made only where a lowered graph is checked numerically (the trn2 target's
XLA:CPU check, at the compiled shapes) and in tests, so they must exercise real paths:
valid consecutive positions, distinct slots and blocks per row, engram rows of valid
fp8 codes and scales, top-k indices that are visible.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from deepinfer.regions.state import Geometry, InputSpec

ITEMSIZE = {"F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "BF16": 2, "F32": 4}


PAGED_INPUTS = ("ckv", "ikeys")  # the paged pools a block table indexes


def example_inputs(specs: list[InputSpec], g: Geometry, *, start: int = 0, seed: int = 0) -> list[torch.Tensor]:
    """One tensor per spec. Row b holds positions start+b .. start+b+T-1 (b-th slot, own blocks)."""
    gen = torch.Generator().manual_seed(seed)
    by_name = {s.name: s for s in specs}
    step = next((by_name[n] for n in ("h", "x", "positions") if n in by_name), None)  # [B, T, ...]
    B, T = step.shape[:2] if step is not None else (1, 1)
    positions = start + torch.arange(B).unsqueeze(1) + torch.arange(T)
    pool_blocks = min((s.shape[0] for s in specs if s.name in PAGED_INPUTS), default=g.blocks)
    out = []
    for s in specs:
        if s.name in ("positions", "own_positions"):  # a divided chunk's stages take its rows' or a rank's
            t = (
                positions[:, : s.shape[1]]
                if s.shape[1] <= T
                else start + torch.arange(B).unsqueeze(1) + torch.arange(s.shape[1])
            )
        elif s.name == "slots":
            t = (1 + torch.arange(B)) % g.slots
        elif s.name == "block_table":  # ids of this rank's pools (its share of the blocks where cp divides them)
            t = (1 + torch.arange(B * s.shape[1]).view(B, -1)) % pool_blocks
        elif s.name in ("rows", "rows_s"):  # engram table rows: fp8 codes, ue8m0 scales
            rng = np.random.default_rng(seed)
            values = stored_values(rng, s.name, "F8_E4M3" if s.name == "rows" else "F8_E8M0", math.prod(s.shape))
            if s.name == "rows":  # finite in both fp8 formats: IEEE-like e4m3 (trn2) has no all-ones exponent
                values[(values & 0x78) == 0x78] ^= 0x40
            t = torch.from_numpy(values).reshape(s.shape)
        elif s.high is not None:  # ids over the whole range, its last included
            t = torch.randint(0, s.high, s.shape, generator=gen)
            t.view(-1)[0] = s.high - 1
        elif s.name == "cand" and s.dtype == torch.int64:  # the divided pool's chosen blocks: the first ones
            t = torch.arange(s.shape[-1]).expand(s.shape).clone()
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


def stored_values(rng: np.random.Generator, key: str, ckpt_dtype: str, count: int) -> np.ndarray:
    """`count` random elements of checkpoint tensor `key`, valid in its stored format, as bytes:
    fp8 codes without NaN, ue8m0 scales that keep weights near 1/sqrt(5120) whatever the
    format they scale, bf16/f32 near 0 (norms and scales near 1).

    Uniform fp8 codes have an rms of 100, so their scales are 2^-14 .. 2^-11 (rms 0.018);
    uniform e2m1 pairs (the routed experts, `.experts.` in the key) have an rms of 2.9, so
    theirs are 2^-9 .. 2^-6 (rms 0.016). Scales any larger make each MoE layer amplify a
    perturbation of its input several times over, and at the release's widths the logits of
    a bf16 run then share nothing with the fp32 run's (docs/model.md)."""
    if ckpt_dtype == "F8_E4M3":
        codes = rng.integers(0, 256, count, dtype=np.uint8)
        codes[(codes & 0x7F) == 0x7F] -= 1
        return codes
    if ckpt_dtype == "F8_E8M0":
        return (
            rng.integers(118, 122, count, dtype=np.uint8)
            if ".experts." in key
            else rng.integers(113, 117, count, dtype=np.uint8)
        )
    if ckpt_dtype == "I8":
        return rng.integers(0, 256, count, dtype=np.uint8)
    values = rng.standard_normal(count, dtype=np.float32)
    near_one = key.endswith(("norm.weight", "_scale", "q_weight", "k_weight"))
    values *= 0.1 if near_one else 0.02
    values += 1 if near_one else 0
    if ckpt_dtype == "F32":
        return values.view(np.uint8)
    return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)  # bf16, truncated


def random_weights(region, seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded random weights of a region's real shapes (rank 0): what a numerical check runs on
    when a zero weight would prove little."""
    rng = np.random.default_rng(seed)
    out = {"rank": torch.zeros((), dtype=torch.int64)}
    for spec in region.specs:
        count = math.prod(spec.buffer_shape)
        data = stored_values(rng, spec.key, spec.ckpt_dtype, count)
        out[spec.name] = torch.from_numpy(data.copy()).view(spec.dtype).reshape(spec.buffer_shape)
    return out
