"""Block geometry shared by the block-scaled formats.

A [R, C] matrix with [br, bc] blocks has a scale grid of [ceil(R/br), ceil(C/bc)];
the last block row/column may be partial (shapes need not divide the block).
"""

from __future__ import annotations

import numpy as np

from .errors import QuantInputError


def check_block(block: int, what: str) -> int:
    if not isinstance(block, (int, np.integer)) or isinstance(block, bool) or block < 1:
        raise QuantInputError(f"{what}: block size must be a positive int, got {block!r}")
    return int(block)


def check_matrix(a: np.ndarray, what: str) -> np.ndarray:
    if a.ndim != 2:
        raise QuantInputError(f"{what}: expected a 2-D [rows, cols] array, got shape {a.shape}")
    return a


def grid(shape: tuple[int, ...], br: int, bc: int) -> tuple[int, int]:
    """Scale-grid shape of a [R, C] matrix: [ceil(R/br), ceil(C/bc)]. `shape` is any 2-D shape
    (a numpy shape, a safetensors header's) as a tuple."""
    return -(-shape[0] // br), -(-shape[1] // bc)


def block_max(a: np.ndarray, br: int, bc: int) -> np.ndarray:
    """Max of a non-negative [R, C] array over [br, bc] blocks -> [Rb, Cb].

    Partial edge blocks are padded with zeros (neutral for a max of magnitudes).
    """
    R, C = a.shape
    Rb, Cb = grid(a.shape, br, bc)
    if R != Rb * br or C != Cb * bc:
        padded = np.zeros((Rb * br, Cb * bc), dtype=a.dtype)
        padded[:R, :C] = a
        a = padded
    return a.reshape(Rb, br, Cb, bc).max(axis=(1, 3))


def expand(s: np.ndarray, br: int, bc: int, shape: tuple[int, int]) -> np.ndarray:
    """Per-block values [Rb, Cb] -> per-element [R, C] (edge blocks cropped)."""
    R, C = shape
    return np.repeat(np.repeat(s, br, axis=0)[:R], bc, axis=1)[:, :C]


def check_grid(scales: np.ndarray, shape: tuple[int, int], br: int, bc: int, what: str) -> None:
    want = grid(shape, br, bc)
    if scales.shape != want:
        raise QuantInputError(
            f"{what}: scales of shape {scales.shape} do not match a {shape} matrix "
            f"with [{br}, {bc}] blocks (expected {want})"
        )
