"""How close an executable's outputs must be to its reference region's: one rule for the
compile-time check of lowered graphs (trn2, on XLA:CPU) and for `deepinfer diff`.

Score per output: floating point -> max |got - ref| / max |ref| (equal infinities and NaNs
agree; a NaN where the reference has none, or anything but zeros where the reference is all
zero, is inf); integer (top-k indices, candidate blocks) -> the fraction of entries that
differ. An output agrees when its score is at most the tolerance of the activation dtype:
a few hundred ulps of fp32, a few of bf16.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

TOLERANCE = {"fp32": 1e-4, "bf16": 2e-2}
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16"}


def tolerance(dtype: torch.dtype | str) -> float:
    """The tolerance of an activation dtype (a torch dtype or its name)."""
    return TOLERANCE[DTYPE_NAMES[dtype] if isinstance(dtype, torch.dtype) else dtype]


@dataclass
class OutputDiff:
    name: str  # an output, or "<state> (state)" for a state the call writes
    max_abs: float  # max |exe - ref| (floating point)
    ref_max: float  # max |ref|
    mismatches: int  # entries that differ (integer outputs)
    numel: int
    integer: bool

    @property
    def score(self) -> float:
        if self.integer:
            return self.mismatches / self.numel if self.numel else 0.0
        if math.isnan(self.max_abs):
            return math.inf
        if self.ref_max > 0:
            return self.max_abs / self.ref_max
        return 0.0 if self.max_abs == 0 else math.inf

    def agrees(self, tol: float) -> bool:
        return self.score <= tol  # NaN and inf never agree

    def how(self) -> str:
        """How far off it is, for a message: "in 3 of 64 entries" or "by 0.5 (max |ref| 54)"."""
        if self.integer:
            return f"in {self.mismatches} of {self.numel} entries"
        return f"by {self.max_abs:.3g} (max |ref| {self.ref_max:.3g})"


class ShapeMismatch(ValueError):
    """An executable and its reference region return outputs of different shapes."""


def compare_tensors(name: str, got: torch.Tensor, ref: torch.Tensor) -> OutputDiff:
    if tuple(got.shape) != tuple(ref.shape):
        raise ShapeMismatch(
            f"output {name}: the executable returns shape {tuple(got.shape)}, the reference region {tuple(ref.shape)}"
        )
    if not ref.dtype.is_floating_point:
        bad = int((got.to(ref.dtype) != ref).sum())
        return OutputDiff(name, 0.0, 0.0, bad, ref.numel(), True)
    if not ref.numel():
        return OutputDiff(name, 0.0, 0.0, 0, 0, False)
    g, r = got.double(), ref.double()
    same = (g == r) | (g.isnan() & r.isnan())  # equal infinities and NaNs agree
    diff = torch.where(same, 0.0, (g - r).abs().nan_to_num(nan=math.inf))
    return OutputDiff(name, float(diff.max()), float(r.abs().nan_to_num(nan=0.0).max()), 0, ref.numel(), False)
