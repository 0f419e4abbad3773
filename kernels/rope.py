"""Rotary position embedding as V4.1 applies it.

Adjacent channel pairs (2i, 2i+1) of the *last* `rope_dim` channels rotate by
position * freq_i. Compressed-attention layers use `compress_rope_theta` with
YaRN frequency scaling (frequencies only, no magnitude scaling); window-only
layers use `rope_theta` unscaled. The attention output is de-rotated with the
inverse rotation. Angles are float32; the rotation is computed in float32 and
cast back to the input dtype.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def rope_frequencies(rope_dim: int, theta: float, scaling: dict | None) -> Tensor:
    """float32 [rope_dim // 2] rotation frequencies, YaRN-adjusted when `scaling` is given."""
    freqs = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    original = int(scaling.get("original_max_position_embeddings", 0)) if scaling else 0
    if scaling is not None and original > 0:
        factor = float(scaling.get("factor", 1.0))
        beta_fast = float(scaling.get("beta_fast", 32))
        beta_slow = float(scaling.get("beta_slow", 1))

        def dim_of(beta: float) -> float:
            return rope_dim * math.log(original / (beta * 2 * math.pi)) / (2 * math.log(theta))

        low = max(math.floor(dim_of(beta_fast)), 0)
        high = min(math.ceil(dim_of(beta_slow)), rope_dim - 1)
        ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
        freqs = freqs / factor * ramp + freqs * (1 - ramp)
    return freqs


def rope_angles(positions: Tensor, freqs: Tensor) -> Tensor:
    """positions [...] (integer) -> float32 angles [..., rope_dim // 2]."""
    return positions.to(torch.float32).unsqueeze(-1) * freqs


def apply_rope(x: Tensor, angles: Tensor, inverse: bool = False) -> Tensor:
    """Rotate the last 2 * angles.shape[-1] channels of x.

    x: [B, T, C] or [B, T, H, C]; angles: [B, T, P] float32.
    """
    rot = angles.shape[-1] * 2
    if x.dim() == 4:
        angles = angles.unsqueeze(2)
    cos, sin = torch.cos(angles), torch.sin(angles)
    if inverse:
        sin = -sin
    pairs = x[..., -rot:].float().unflatten(-1, (-1, 2))
    re, im = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((re * cos - im * sin, re * sin + im * cos), dim=-1).flatten(-2)
    return torch.cat((x[..., :-rot], rotated.to(x.dtype)), dim=-1)
