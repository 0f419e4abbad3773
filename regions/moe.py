"""The FFN site of every layer: hyper-connection mixes, ffn_norm, MoE, expand.

Routing: gate logits in float32, s = sqrt(softplus(logits)); experts = top-k of
s + bias (`bias_vl` for image tokens); weights = s of the selected experts,
normalised to sum one, times routed_scaling_factor. Routed experts are fp4 with
per-32 ue8m0 scales. With ep > 1 a rank holds a slice of every expert: its
`expert_slice_width` intermediate columns (w1, w3 rows; w2 columns with the scale
blocks they span, regions/topology.py), and returns its columns' partial. Two forms,
both static-shaped, nothing dropped or capped, chosen by `topology.moe_form` from the
step's rows: gathered (rows x top-k under the expert count: decode steps) gathers the
rows' chosen experts' slices by their ids (`kernels/linear.moe_gathered`, an HLO
gather of rows x k slices) and reads no other expert; tiled (prompt chunks) groups the
rows x k assignments by expert in tiles of `topology.moe_tile` rows and gathers each
tile's expert slice (`moe_tiled`, an HLO gather of `tiles_bound` slices, each computing
its tile's rows: about twice the useful rows, not the expert count's 64 times as every
slice over every row would). Each expert and the fp8 shared expert is a clamped SwiGLU;
routed outputs accumulate in float32.

A prompt chunk divided by rows over the token group (`[prompt] rows = "divided"`, regions/rows.py)
runs the region as three methods, the runtime's collectives between them (regions/step.rows_steps):
`moe_in` on the rank's own rows (the mixes, ffn_norm, the router: x and its routing), one all-gather
of every rank's (x, weights, experts), `moe_experts` on every row of the chunk (this rank's expert
slices and shared slice: a float32 partial [T, D]), one reduce-scatter of the partials to each rank's
rows, summed, and `moe_out` on the rank's rows (hc_expand with the whole streams as residual).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F

from deepinfer.bundles.topology import Topology
from deepinfer.kernels import hc as _hc  # noqa: F401  (registers ops)
from deepinfer.kernels.linear import tiles_bound
from deepinfer.regions.base import Region, WeightSpec, fp4_specs, fp8_specs
from deepinfer.regions.config import TextConfig
from deepinfer.regions.state import Geometry, InputSpec
from deepinfer.regions.topology import (
    BLOCK,
    expert_scale_blocks,
    expert_slice_width,
    moe_form,
    moe_tile,
    shared_width,
)

ops = torch.ops.deepinfer


def moe_specs(c: TextConfig, topo: Topology = Topology()) -> list[WeightSpec]:
    """The weights one rank holds: its slice of every routed expert (s intermediate columns; w2's
    scales the nb blocks they span) and its shared-expert slice."""
    n, D, E = c.hc_mult, c.hidden_size, c.n_routed_experts
    s, nb, Is = expert_slice_width(c, topo), expert_scale_blocks(c, topo), shared_width(c, topo)
    return [
        WeightSpec("hc_fn", "hc_ffn_fn", ((2 + n) * n, n * D), "F32"),
        WeightSpec("hc_base", "hc_ffn_base", ((2 + n) * n,), "F32"),
        WeightSpec("hc_scale", "hc_ffn_scale", (3,), "F32"),
        WeightSpec("ffn_norm", "ffn_norm.weight", (D,), "BF16"),
        WeightSpec("gate", "ffn.gate.weight", (E, D), "BF16"),
        WeightSpec("gate_bias", "ffn.gate.bias", (E,), "F32"),
        WeightSpec("gate_bias_vl", "ffn.gate.bias_vl", (E,), "F32"),
        *fp4_specs("w1", "ffn.experts.{e}.w1", s, D, E),
        *fp4_specs("w3", "ffn.experts.{e}.w3", s, D, E),
        WeightSpec("w2", "ffn.experts.{e}.w2.weight", (D, s // 2), "I8", E),
        WeightSpec("w2_s", "ffn.experts.{e}.w2.scale", (D, nb), "F8_E8M0", E),
        *fp8_specs("sw1", "ffn.shared_experts.w1", Is, D),
        *fp8_specs("sw3", "ffn.shared_experts.w3", Is, D),
        *fp8_specs("sw2", "ffn.shared_experts.w2", D, Is),
    ]


def route(x: Tensor, gate: Tensor, bias: Tensor, k: int, normalize: bool, scale: float):
    """x [N, D], gate [E, D], bias [N, E] -> (weights [N, k] f32, experts [N, k])."""
    s = torch.sqrt(F.softplus(F.linear(x.float(), gate.float())))  # [N, E]
    experts = (s + bias).topk(k, dim=-1).indices
    weights = s.gather(1, experts)
    if normalize and k > 1:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scale, experts


class MoE(Region):
    """With ep > 1 the region returns this rank's partial (float32): its expert slices' and its
    shared slice's contribution, the residual mix added by rank 0 only; the runtime sums
    the partials over the EP group (regions/topology.py)."""

    kind = "moe"

    def __init__(self, c: TextConfig, *, dtype: torch.dtype, topo: Topology = Topology()):
        super().__init__(moe_specs(c, topo), dtype)
        self.c = c
        self.ep = topo.ep
        self.group = topo.group_size  # a divided prompt chunk's ranks (`moe_in`, `moe_out`: T / group rows)

    def output_names(self) -> list[str]:
        return ["h", "pre"]

    def input_specs(self, B: int, T: int, g: Geometry) -> list[InputSpec]:
        c = self.c
        return [
            InputSpec("h", (B, T, c.hc_mult, c.hidden_size), self.dtype, "activation"),
            InputSpec("pre", (B, T, c.hc_mult), torch.float32, "activation"),
            InputSpec("is_image", (B, T), torch.bool, "step"),
        ]

    def gathered(self, rows: int) -> dict[str, int]:
        """The entries a step of `rows` rows reads of each routed stack (w1, w3, w2 and their scales),
        whatever the routing: rows x k below the crossover (`moe_form`), the tiled form's static tile
        count above it (`tiles_bound`): the cost model's figure."""
        c = self.c
        k, E = c.num_experts_per_tok, c.n_routed_experts
        if moe_form(rows, k, E) == "gathered":
            entries = rows * k
        else:
            entries = tiles_bound(rows * k, E, moe_tile(rows, k, E))
        return {name: entries for name in ("w1", "w1_s", "w3", "w3_s", "w2", "w2_s")}

    def gathered_rows(self, rows: int) -> int:
        """Rows each gathered entry computes: 1 in the gathered form, a tile's in the tiled form."""
        c = self.c
        k, E = c.num_experts_per_tok, c.n_routed_experts
        return 1 if moe_form(rows, k, E) == "gathered" else moe_tile(rows, k, E)

    def routed(self, x: Tensor, weights: Tensor, experts: Tensor) -> Tensor:
        """x [N, D] through its rows' chosen experts (weights, experts [N, k]) -> [N, D] f32: with
        ep > 1 this rank's partial, its intermediate columns r * s ... of every expert
        (r = rank mod ep), the ranks' partials summing to the whole.

        The form is static, from the rows (`moe_form`): gathered, each row's k chosen slices
        read and decoded (`moe_gathered`); tiled, the assignments grouped by expert in tiles of
        `moe_tile` rows, each tile's slice gathered and computed over its rows (`moe_tiled`). Where the
        slice width is not a whole number of 32-blocks, column j of the slice takes w2's scale
        block ((r * s) mod 32 + j) // 32 of the rank's blocks, computed here from the rank buffer.
        With ep > 1 a slice's output is no expert's output: w2 contracts every slice's columns at
        once in float32 (`partial`); at ep = 1 each expert's output is rounded to x's dtype first.
        """
        c = self.c
        k, E = c.num_experts_per_tok, c.n_routed_experts
        blocks, stacks = self.scale_blocks(x.device), self.stacks()
        partial = self.ep > 1  # slices: w2 contracts all of them at once, in float32
        if moe_form(x.shape[0], k, E) == "gathered":
            return ops.moe_gathered(x, weights, experts, *stacks, c.swiglu_limit, blocks, partial)
        tile = moe_tile(x.shape[0], k, E)
        return ops.moe_tiled(x, weights, experts, *stacks, c.swiglu_limit, tile, blocks, partial)

    def stacks(self) -> tuple[Tensor, ...]:
        """The routed stacks as the expert kernels take them: w1, w1_s, w3, w3_s, w2, w2_s."""
        return (self.w1, self.w1_s, self.w3, self.w3_s, self.w2, self.w2_s)

    def scale_blocks(self, device: torch.device) -> Tensor | None:
        """The `blocks` argument of the expert kernels: None where this rank's slice is whole 32-blocks,
        else w2's scale block of each of its columns ([s] int64, from the rank buffer)."""
        s = self.w1.shape[1]
        if s % BLOCK == 0:
            return None
        offset = (self.rank % self.ep) * s % BLOCK
        return (offset + torch.arange(s, device=device)) // BLOCK  # [s]

    def shared(self, x: Tensor) -> Tensor:
        g = ops.blockquant_gemm(x, self.sw1, self.sw1_s, self.fp8)
        u = ops.blockquant_gemm(x, self.sw3, self.sw3_s, self.fp8)
        a = ops.swiglu(g, u, None, self.c.swiglu_limit)
        return ops.blockquant_gemm(a, self.sw2, self.sw2_s, self.fp8)

    def _site(self, h: Tensor, pre: Tensor, is_image: Tensor):
        """The site's mixes, its input x [B, T, D] and the routing of its rows -> (pre_f, post, comb, x,
        weights [B * T, k] f32, experts [B * T, k])."""
        c = self.c
        pre_f, post, comb = ops.hc_mixes(
            h, self.hc_fn, self.hc_base, self.hc_scale, c.rms_norm_eps, c.hc_eps, c.hc_sinkhorn_iters
        )
        x = ops.rmsnorm(ops.hc_collapse(h, pre), self.ffn_norm, c.rms_norm_eps)  # [B, T, D]
        bias = torch.where(is_image.flatten().unsqueeze(-1), self.gate_bias_vl, self.gate_bias)
        k = c.num_experts_per_tok
        weights, experts = route(x.flatten(0, 1), self.gate, bias, k, c.norm_topk_prob, c.routed_scaling_factor)
        return pre_f, post, comb, x, weights, experts

    def _partial(self, xf: Tensor, weights: Tensor, experts: Tensor) -> Tensor:
        """Rows xf [N, D] through this rank's expert slices and shared slice -> its partial [N, D] f32."""
        return self.routed(xf, weights, experts) + self.shared(xf).float()

    def decode(self, h: Tensor, pre: Tensor, is_image: Tensor):
        """h [B, T, n, D], pre [B, T, n] (the attention site's), is_image [B, T] bool -> (h, pre)."""
        pre_f, post, comb, x, weights, experts = self._site(h, pre, is_image)
        xf = x.flatten(0, 1)  # [N, D]
        if self.ep == 1:
            out = (self.routed(xf, weights, experts).to(x.dtype) + self.shared(xf)).view_as(x)
            return ops.hc_expand(out, h, post, comb), pre_f
        out = self._partial(xf, weights, experts).view(x.shape)  # [B, T, D] f32
        lead = (self.rank == 0).to(torch.float32)
        return ops.hc_expand(out, h.float() * lead, post, comb), pre_f

    # -- a prompt chunk divided by rows over the token group (regions/rows.py, regions/step.rows_steps) --
    # `moe_in` and `moe_out` on this rank's T / group rows of a T-row chunk (their executables keyed
    # by the chunk's T, as the rows twin's stages are), `moe_experts` on every row of it.

    def _own(self, B: int, T: int) -> tuple[int, int]:
        return B, T // self.group

    def moe_in_inputs(self, B: int, T: int, g: Geometry) -> list[InputSpec]:
        return self.input_specs(*self._own(B, T), g)

    def moe_in_outputs(self) -> list[str]:
        return ["x", "weights", "experts", "post", "comb", "pre"]

    def moe_in(self, h: Tensor, pre: Tensor, is_image: Tensor):
        """This rank's rows h [B, t, n, D], pre [B, t, n], is_image [B, t] -> the site's input x [B, t, D],
        its routing (weights [B, t, k] f32, experts [B, t, k]), the mixes post, comb and the site's pre."""
        pre_f, post, comb, x, weights, experts = self._site(h, pre, is_image)
        k = self.c.num_experts_per_tok
        return x, weights.view(*x.shape[:2], k), experts.view(*x.shape[:2], k), post, comb, pre_f

    def moe_experts_inputs(self, B: int, T: int, g: Geometry) -> list[InputSpec]:
        c, k = self.c, self.c.num_experts_per_tok
        return [
            InputSpec("x", (B, T, c.hidden_size), self.dtype, "activation"),
            InputSpec("weights", (B, T, k), torch.float32, "activation"),
            InputSpec("experts", (B, T, k), torch.int64, "activation"),
        ]

    def moe_experts_outputs(self) -> list[str]:
        return ["partial"]

    def moe_experts(self, x: Tensor, weights: Tensor, experts: Tensor) -> Tensor:
        """Every row of the chunk (x [B, T, D], its routing [B, T, k]) through this rank's expert slices
        and shared slice -> its partial [B, T, D] float32 (D wide: the streams stay on their rank)."""
        xf = x.flatten(0, 1)
        return self._partial(xf, weights.flatten(0, 1), experts.flatten(0, 1)).view(x.shape)

    def moe_out_inputs(self, B: int, T: int, g: Geometry) -> list[InputSpec]:
        c, f32 = self.c, torch.float32
        B, t = self._own(B, T)
        n, D = c.hc_mult, c.hidden_size
        return [
            InputSpec("out", (B, t, D), f32, "activation"),
            InputSpec("h", (B, t, n, D), self.dtype, "activation"),
            InputSpec("post", (B, t, n), f32, "activation"),
            InputSpec("comb", (B, t, n, n), f32, "activation"),
        ]

    def moe_out_outputs(self) -> list[str]:
        return ["h"]

    def moe_out(self, out: Tensor, h: Tensor, post: Tensor, comb: Tensor) -> Tensor:
        """This rank's rows: out [B, t, D] the partials summed over the ranks (float32), the streams h and
        the site's mixes -> h expanded (float32, then h's dtype, as decode's partials summed are)."""
        return ops.hc_expand(out, h.float(), post, comb).to(h.dtype)
