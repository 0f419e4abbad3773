"""The final head (a compiled region); the token embedding is host-side (regions/step.py)."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F

from deepinfer.kernels import hc as _hc  # noqa: F401  (registers ops)
from deepinfer.regions.base import Region, WeightSpec
from deepinfer.regions.config import TextConfig
from deepinfer.regions.state import Geometry, InputSpec

ops = torch.ops.deepinfer


class Head(Region):
    """Collapse with the last FFN site's `pre`, `norm`, then `head` in float32."""

    kind = "head"

    def __init__(self, c: TextConfig, *, dtype: torch.dtype):
        super().__init__([WeightSpec("norm", "norm.weight", (c.hidden_size,), "BF16"),
                          WeightSpec("head", "head.weight", (c.vocab_size, c.hidden_size), "F32")], dtype)
        self.c = c

    def output_names(self) -> list[str]:
        return ["logits"]

    def input_specs(self, B: int, T: int, g: Geometry) -> list[InputSpec]:
        c = self.c
        return [InputSpec("h", (B, T, c.hc_mult, c.hidden_size), self.dtype, "activation"),
                InputSpec("pre", (B, T, c.hc_mult), torch.float32, "activation")]

    def project_inputs(self, B: int, T: int, g: Geometry) -> list[InputSpec]:
        return [InputSpec("x", (B, T, self.c.hidden_size), self.dtype, "activation")]

    def decode(self, h: Tensor, pre: Tensor) -> Tensor:
        """h [B, T, n, D], pre [B, T, n] -> logits [B, T, V] float32."""
        return self.project(ops.rmsnorm(ops.hc_collapse(h, pre), self.norm, self.c.rms_norm_eps))

    def project(self, x: Tensor) -> Tensor:
        """The vocabulary projection alone: normalized states x [B, T, D] -> logits [B, T, V] float32.
        The DSpark draft's own last norm feeds it (its logits are the target's frozen head)."""
        return F.linear(x.float(), self.head.float())
