"""The final head (a compiled region) and the token embedding (host-side)."""

from __future__ import annotations

import torch
from torch import Tensor, nn
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

    def decode(self, h: Tensor, pre: Tensor) -> Tensor:
        """h [B, T, n, D], pre [B, T, n] -> logits [B, T, V] float32."""
        x = ops.rmsnorm(ops.hc_collapse(h, pre), self.norm, self.c.rms_norm_eps)
        return F.linear(x.float(), self.head.float())


class Embedding(nn.Module):
    """Token embedding on the host: ids -> n identical streams and the one-hot first `pre`."""

    def __init__(self, weight: Tensor, hc_mult: int, dtype: torch.dtype):
        super().__init__()
        self.weight = weight            # [V, D], kept in checkpoint storage (bf16)
        self.hc_mult = hc_mult
        self.dtype = dtype

    def forward(self, tokens: Tensor, is_image: Tensor | None = None,
                image_rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """tokens [B, T] -> h [B, T, n, D] (contiguous), pre [B, T, n] float32.

        Where is_image [B, T] is set, the row of image_rows [B, T, D] (the vision
        tower's span) replaces the token's embedding.
        """
        e = self.weight[tokens].to(self.dtype)
        if image_rows is not None:
            e = torch.where(is_image.unsqueeze(-1), image_rows.to(self.dtype), e)
        h = e.unsqueeze(2).expand(-1, -1, self.hc_mult, -1).contiguous()
        pre = torch.zeros(*tokens.shape, self.hc_mult, dtype=torch.float32)
        pre[..., 0] = 1
        return h, pre
