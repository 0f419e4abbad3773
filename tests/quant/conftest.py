"""Shared helpers for the quant tests: torch references written out plainly.

Tests get this module through the session fixture `refs` (with
--import-mode=importlib a test file cannot import conftest by name).
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch


def f32_bits(x) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(x, dtype=np.float32)).view(np.uint32)


def torch_e4m3fn_encode(x: np.ndarray) -> np.ndarray:
    """torch's float32 -> float8_e4m3fn cast (non-saturating) as uint8 codes."""
    t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    return t.to(torch.float8_e4m3fn).view(torch.uint8).numpy()


def torch_e4m3fn_decode(codes: np.ndarray) -> np.ndarray:
    t = torch.from_numpy(np.ascontiguousarray(codes, dtype=np.uint8))
    return t.view(torch.float8_e4m3fn).float().numpy()


def torch_pow2ceil(x: torch.Tensor) -> torch.Tensor:
    """MODEL.md's rule written in torch: exponent + 1 when the mantissa is non-zero."""
    bits = x.view(torch.int32)
    exp = bits & 0x7F800000
    special = exp == 0x7F800000
    bump = ((bits & 0x7FFFFF) != 0) & ~special
    out = (bits & ~0x7FFFFFFF) | (exp + bump.to(torch.int32) * (1 << 23))
    return torch.where(special, bits, out).view(torch.float32)


def torch_block_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """Release rule in torch: pow2ceil(amax / qmax), floored at 2^-126."""
    return torch.clamp(torch_pow2ceil(amax / qmax), min=2.0**-126)


def pad_blocks(w: torch.Tensor, br: int, bc: int) -> torch.Tensor:
    R, C = w.shape
    return torch.nn.functional.pad(w, (0, -C % bc, 0, -R % br))


def torch_block_amax(w: torch.Tensor, br: int, bc: int) -> torch.Tensor:
    p = pad_blocks(w.abs(), br, bc)
    Rb, Cb = p.shape[0] // br, p.shape[1] // bc
    return p.reshape(Rb, br, Cb, bc).amax(dim=(1, 3))


def torch_expand(s: torch.Tensor, br: int, bc: int, shape) -> torch.Tensor:
    return s.repeat_interleave(br, 0)[: shape[0]].repeat_interleave(bc, 1)[:, : shape[1]]


@pytest.fixture(scope="session")
def refs():
    return sys.modules[__name__]
