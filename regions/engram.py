"""Engram: an n-gram-hashed memory added to the streams before a layer's attention.

Per stream i: dot = sum(rms(h_i) * q_w_i * rms(key_i) * k_w_i) / sqrt(D),
gate = sigmoid(sign(dot) * sqrt(max(|dot|, 1e-6))), h_i += gate * value, where
(key_0..key_{n-1}, value) = wkv(looked-up rows). The tables (fp8 rows with one
ue8m0 scale per row and 32 channels; 2 x 384M rows at release scale, 189 GiB) stay
on the host: the hashes (`deepinfer.regions.engram_hash`) pick each step's rows
there (`regions.step.EngramRows`) and the region receives those rows, still fp8,
as step inputs and decodes them in-graph. Its weights are only the projection
and the two gate vectors.

Over a token group of d > 1 ranks (regions/topology.py) the projection is divided by its input
columns: rank j of the group holds `engram_width` columns of `wkv` from j * width on (whole
32-blocks; zeros past the last column), and the engram runs as two methods with one collective
between them, since the gate is not linear in the keys:

    kv   rows, rows_s -> this rank's columns of the flattened rows (picked in-graph by the rank
         buffer) times its columns of wkv: partial keys and value [B, T, (n+1)*D] float32
    (the "engram all-reduce": the partials summed over the token group)
    mix  h, kv, token_mask -> h: the gate and the update, on every rank, as `decode` does

A prompt chunk divided by rows over the token group (regions/step.rows_steps) runs `kv` on every row
of the chunk (each rank is handed them all), reduce-scatters the partials to each rank's rows (the
"engram reduce-scatter") and runs `rows_mix`, `mix` on the rank's rows only.

Every rank is handed all of a step's rows (B * T * hash_heads * head_dim bytes, 6 KiB a token at
the release) and slices its own in the graph: one input set and one executable for every rank, and
the host's lookup and the fused layers' inputs stay as they are. A group of one rank runs `decode`
with the whole projection.
"""

from __future__ import annotations

import torch
from torch import Tensor

from deepinfer.bundles.manifest import DECODE
from deepinfer.bundles.topology import Topology
from deepinfer.kernels.formats import dequant_fp8_rows
from deepinfer.regions.base import Region, WeightSpec, fp8_specs
from deepinfer.regions.config import TextConfig
from deepinfer.regions.state import Geometry, InputSpec
from deepinfer.regions.topology import ENGRAM_KV, ENGRAM_MIX, engram_width

ops = torch.ops.deepinfer


def engram_specs(c: TextConfig, topo: Topology = Topology()) -> list[WeightSpec]:
    """The engram's weights as one rank of `topo` holds them: its input columns of `wkv`."""
    n, D = c.hc_mult, c.hidden_size
    return [
        *fp8_specs("wkv", "engram.wkv", (n + 1) * D, engram_width(c, topo)),
        WeightSpec("q_weight", "engram.q_weight", (n, D), "BF16"),
        WeightSpec("k_weight", "engram.k_weight", (n, D), "BF16"),
    ]


class Engram(Region):
    kind = "engram"

    def __init__(self, c: TextConfig, *, dtype: torch.dtype, topo: Topology = Topology()):
        super().__init__(engram_specs(c, topo), dtype)
        self.c = c
        self.group = topo.group_size  # > 1: wkv's input columns divided over the token group

    def methods(self) -> tuple[str, ...]:
        """`decode`; over a token group of several ranks, `kv` then `mix` (the all-reduce between them)."""
        return (DECODE,) if self.group == 1 else (ENGRAM_KV, ENGRAM_MIX)

    def output_names(self) -> list[str]:
        return ["h"]

    def _rows(self, B: int, T: int) -> list[InputSpec]:
        hh, hd = self.c.engram_hash_heads, self.c.engram_head_dim
        return [
            InputSpec("rows", (B, T, hh, hd), torch.uint8, "step"),
            InputSpec("rows_s", (B, T, hh, -(-hd // 32)), torch.uint8, "step"),
        ]

    def _mixed(self, B: int, T: int) -> tuple[InputSpec, InputSpec]:
        c = self.c
        return (
            InputSpec("h", (B, T, c.hc_mult, c.hidden_size), self.dtype, "activation"),
            InputSpec("token_mask", (B, T), torch.bool, "step"),
        )

    def input_specs(self, B: int, T: int, g: Geometry) -> list[InputSpec]:
        h, token_mask = self._mixed(B, T)
        return [h, *self._rows(B, T), token_mask]

    def kv_inputs(self, B: int, T: int, g: Geometry) -> list[InputSpec]:
        return self._rows(B, T)

    def kv_outputs(self) -> list[str]:
        return ["kv"]

    def mix_inputs(self, B: int, T: int, g: Geometry) -> list[InputSpec]:
        """The streams, the summed keys and value [B, T, (n+1)*D] float32 and the token mask."""
        c = self.c
        h, token_mask = self._mixed(B, T)
        kv = InputSpec("kv", (B, T, (c.hc_mult + 1) * c.hidden_size), torch.float32, "activation")
        return [h, kv, token_mask]

    def mix_outputs(self) -> list[str]:
        return ["h"]

    def rows_mix_inputs(self, B: int, T: int, g: Geometry) -> list[InputSpec]:
        """`mix`'s inputs at a rank's T / group rows of a T-row prompt chunk divided by rows (keyed by
        the chunk's T, as the rows twin's stages are)."""
        return self.mix_inputs(B, T // self.group, g)

    def rows_mix_outputs(self) -> list[str]:
        return ["h"]

    def rows_mix(self, h: Tensor, kv: Tensor, token_mask: Tensor) -> Tensor:
        """`mix` on a rank's rows of a divided prompt chunk: kv its rows' keys and value, reduce-scattered
        from every row's partials."""
        return self.mix(h, kv, token_mask)

    def decode(self, h: Tensor, rows: Tensor, rows_s: Tensor, token_mask: Tensor) -> Tensor:
        """h [B, T, n, D], rows [B, T, hash_heads, hd] fp8 codes of the hashed table rows, rows_s
        [B, T, hash_heads, hd/32] their ue8m0 scales, token_mask [B, T] bool -> h."""
        rows = dequant_fp8_rows(rows, rows_s, h.dtype, self.fp8_format)  # [B, T, hh, hd]
        kv = ops.blockquant_gemm(rows.flatten(-2), self.wkv, self.wkv_s, self.fp8)  # [B, T, (n+1)*D]
        return self.mix(h, kv, token_mask)

    def kv(self, rows: Tensor, rows_s: Tensor) -> Tensor:
        """This rank's share of the keys and value: its input columns of the flattened rows times its
        columns of wkv -> [B, T, (n+1)*D] float32, a partial sum over the token group's ranks."""
        x = dequant_fp8_rows(rows, rows_s, self.dtype, self.fp8_format).flatten(-2)  # [B, T, hh*hd]
        cols, width = x.shape[-1], self.wkv.shape[-1]
        start = torch.remainder(self.rank, self.group) * width
        index = start + torch.arange(width, device=x.device)  # [width] this rank's columns
        mine = torch.index_select(x, -1, index.clamp(max=cols - 1))  # a gather in HLO
        mine = torch.where(index < cols, mine, torch.zeros((), dtype=mine.dtype))  # none past the rows
        return ops.blockquant_gemm(mine, self.wkv, self.wkv_s, self.fp8).float()

    def mix(self, h: Tensor, kv: Tensor, token_mask: Tensor) -> Tensor:
        """The gate and the update: h [B, T, n, D], the keys and value kv [B, T, (n+1)*D] (the
        summed partials over a token group), token_mask [B, T] -> h."""
        c = self.c
        n, D, eps = c.hc_mult, c.hidden_size, c.rms_norm_eps
        key, value = kv.split((n * D, D), dim=-1)
        key = key.float().unflatten(-1, (n, D))
        hf = h.float()
        weights = self.q_weight.float() * self.k_weight.float()  # [n, D]
        rstd = torch.rsqrt(hf.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)
        dot = (hf * weights * key).sum(-1) * rstd * D**-0.5  # [B, T, n]
        gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
        gate = gate * token_mask.unsqueeze(-1).to(gate.dtype)
        return (hf + gate.unsqueeze(-1) * value.float().unsqueeze(-2)).to(h.dtype)
