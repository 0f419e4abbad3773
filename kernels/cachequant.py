"""Quantize-dequantize of cached activations, as the release stores them.

Each format works on consecutive channel groups of the last dimension, in
float32, and returns the input dtype:

- `fp8`   (window latent, groups of 32): scale = pow2ceil(max(amax, 1e-4) / 448),
          value = e4m3fn(clamp(x / scale, +-448)) * scale;
- `nvfp4` (compressed KV, groups of 16): scale = e4m3fn(max(amax, 6 * 2^-9) / 6),
          value = e2m1(clamp(x / scale, +-6)) * scale;
- `mxfp4` (indexer queries and keys, groups of 32): scale = pow2ceil(max(amax, 6 * 2^-126) / 6),
          e2m1 as above.

e2m1 rounds to the nearest of {0, .5, 1, 1.5, 2, 3, 4, 6}, a tie going to the
level with the even index; in each of the three evenly spaced stretches that is
round-half-to-even of the level index, which `torch.round` computes.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F

FORMATS = {"fp8": 32, "nvfp4": 16, "mxfp4": 32}  # format -> group size


def pow2ceil(x: Tensor) -> Tensor:
    """Positive normal float32 -> the next power of two (exact, on the bits)."""
    bits = x.contiguous().view(torch.int32)
    exponent = (bits >> 23) & 255
    exponent = exponent + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exponent << 23).view(torch.float32)


def e2m1_round(x: Tensor) -> Tensor:
    """Round float32 values in [-6, 6] to the nearest e2m1 level (ties to even index)."""
    m = x.abs()
    level = torch.where(m < 2, torch.round(m * 2) * 0.5, torch.where(m < 4, torch.round(m), torch.round(m * 0.5) * 2))
    return torch.copysign(level, x)


def quant_dequant(x: Tensor, fmt: str) -> Tensor:
    """Apply the release's cache representation `fmt` to x [..., C]."""
    group = FORMATS[fmt]
    channels = x.shape[-1]
    g = F.pad(x.float(), (0, -channels % group)).unflatten(-1, (-1, group))
    amax = g.abs().amax(-1, keepdim=True)
    if fmt == "fp8":
        scale = pow2ceil(amax.clamp_min(1e-4) * (1 / 448))
        q = (g / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    else:
        if fmt == "nvfp4":
            # e4m3fn encoding saturates at 448 (explicit: not every torch cast does)
            scale = (amax.clamp_min(6 * 2.0**-9) / 6).clamp(max=448).to(torch.float8_e4m3fn).float()
        else:
            scale = pow2ceil(amax.clamp_min(6 * 2.0**-126) * (1 / 6))
        q = e2m1_round((g / scale).clamp(-6, 6))
    return (q * scale).flatten(-2)[..., :channels].to(x.dtype)


def maybe_quant(x: Tensor, fmt: str, enabled: bool) -> Tensor:
    return quant_dequant(x, fmt) if enabled else x
