"""The model's two ends as compiled regions: the token embedding (targets that keep it on the
device, trn2) and the final head. Targets that embed on the host run `regions.step.Embedding`,
the same computation (`regions.step.embed_tokens`)."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F

from deepinfer.bundles.manifest import BEST
from deepinfer.kernels import hc as _hc  # noqa: F401  (registers ops)
from deepinfer.regions.base import Region, WeightSpec
from deepinfer.regions.config import TextConfig
from deepinfer.regions.picking import pack_pick, slice_best_in_graph
from deepinfer.regions.state import Geometry, InputSpec
from deepinfer.regions.step import embed_tokens

ops = torch.ops.deepinfer


class Embed(Region):
    """Token ids -> the streams the first layer reads: a gather of the step's rows of the
    embedding table (a device weight [V, D], bf16 as checkpointed), image rows where the step
    has image positions. Its inputs are all host step inputs (a few bytes a token and the
    [B, T, D] image rows, which stay unchanged, and so unsent, on text-only steps); its outputs
    stay on the device for the first layer."""

    kind = "embed"

    def __init__(self, c: TextConfig, *, dtype: torch.dtype):
        super().__init__([WeightSpec("embed", "embed.weight", (c.vocab_size, c.hidden_size), "BF16")], dtype)
        self.c = c

    def output_names(self) -> list[str]:
        return ["h", "pre"]

    def input_specs(self, B: int, T: int, g: Geometry) -> list[InputSpec]:
        c = self.c
        return [
            InputSpec("tokens", (B, T), torch.int64, "step", high=c.vocab_size),
            InputSpec("is_image", (B, T), torch.bool, "step"),
            InputSpec("image_rows", (B, T, c.hidden_size), self.dtype, "step"),
        ]

    def decode(self, tokens: Tensor, is_image: Tensor, image_rows: Tensor) -> tuple[Tensor, Tensor]:
        """tokens [B, T] int64, is_image [B, T] bool, image_rows [B, T, D] -> h [B, T, n, D],
        pre [B, T, n] float32."""
        return embed_tokens(self.embed, tokens, self.c.hc_mult, self.dtype, is_image, image_rows)


class Head(Region):
    """Collapse with the last FFN site's `pre`, `norm`, then `head` in float32.

    `rows`: the vocabulary rows this rank holds of `head` (regions/topology.head_rows: the
    vocabulary split over a token group, padded to whole blocks; all of it by default). Its
    logits are this rank's slice of the vocabulary; the runtime gathers a group's slices."""

    kind = "head"

    def __init__(self, c: TextConfig, *, dtype: torch.dtype, rows: int | None = None, group: int = 1):
        rows = c.vocab_size if rows is None else rows
        super().__init__(
            [
                WeightSpec("norm", "norm.weight", (c.hidden_size,), "BF16"),
                WeightSpec("head", "head.weight", (rows, c.hidden_size), "F32"),  # [rows, D]
            ],
            dtype,
        )
        self.c, self.rows, self.group = c, rows, group

    def output_names(self) -> list[str]:
        return ["logits"]

    def input_specs(self, B: int, T: int, g: Geometry) -> list[InputSpec]:
        c = self.c
        return [
            InputSpec("h", (B, T, c.hc_mult, c.hidden_size), self.dtype, "activation"),
            InputSpec("pre", (B, T, c.hc_mult), torch.float32, "activation"),
        ]

    def best_inputs(self, B: int, T: int, g: Geometry) -> list[InputSpec]:
        return self.input_specs(B, T, g)

    def best_outputs(self) -> list[str]:
        return [BEST]

    def best(self, h: Tensor, pre: Tensor) -> Tensor:
        """A greedy step's choice on this rank's vocabulary slice in the graph: h, pre -> [B, T, 2]
        float32, each row's best value and its global index (exact in float32: a vocabulary is below
        2^24), as `regions.picking.slice_best` takes them from `decode`'s logits on the host. The ranks
        all-gather these pairs (runtime/ranks.Comm.best_pairs); the logits never leave the device."""
        first = self.rank % self.group * self.rows
        return pack_pick(*slice_best_in_graph(self.decode(h, pre), first, self.c.vocab_size))

    def project_inputs(self, B: int, T: int, g: Geometry) -> list[InputSpec]:
        return [InputSpec("x", (B, T, self.c.hidden_size), self.dtype, "activation")]

    def decode(self, h: Tensor, pre: Tensor) -> Tensor:
        """h [B, T, n, D], pre [B, T, n] -> this rank's logits [B, T, rows] float32 (all V with one rank)."""
        return self.project(ops.rmsnorm(ops.hc_collapse(h, pre), self.norm, self.c.rms_norm_eps))

    def project(self, x: Tensor) -> Tensor:
        """The vocabulary projection alone: normalized states x [B, T, D] -> logits [B, T, rows] float32.
        The DSpark draft's own last norm feeds it (its logits are the target's frozen head): with the
        head split by vocabulary, this rank's slice of them, gathered as the head's `decode`'s are."""
        return F.linear(x.float(), self.head.float())
