"""Engram: an n-gram-hashed memory added to the streams before a layer's attention.

Per stream i: dot = sum(rms(h_i) * q_w_i * rms(key_i) * k_w_i) / sqrt(D),
gate = sigmoid(sign(dot) * sqrt(max(|dot|, 1e-6))), h_i += gate * value, where
(key_0..key_{n-1}, value) = wkv(looked-up rows). The tables (fp8 rows with one
ue8m0 scale per row and 32 channels; 2 x 384M rows at release scale, 189 GiB) stay
on the host: the hashes (`deepinfer.regions.engram_hash`) pick each step's rows
there (`regions.step.EngramRows`) and the region receives those rows, still fp8,
as step inputs and decodes them in-graph. Its weights are only the projection
and the two gate vectors.
"""

from __future__ import annotations

import torch
from torch import Tensor

from deepinfer.kernels.formats import dequant_fp8_rows
from deepinfer.regions.base import Region, WeightSpec, fp8_specs
from deepinfer.regions.config import TextConfig
from deepinfer.regions.state import Geometry, InputSpec

ops = torch.ops.deepinfer


def engram_specs(c: TextConfig) -> list[WeightSpec]:
    n, D, hd = c.hc_mult, c.hidden_size, c.engram_head_dim
    return [
        *fp8_specs("wkv", "engram.wkv", (n + 1) * D, c.engram_hash_heads * hd),
        WeightSpec("q_weight", "engram.q_weight", (n, D), "BF16"),
        WeightSpec("k_weight", "engram.k_weight", (n, D), "BF16"),
    ]


class Engram(Region):
    kind = "engram"

    def __init__(self, c: TextConfig, *, dtype: torch.dtype):
        super().__init__(engram_specs(c), dtype)
        self.c = c

    def output_names(self) -> list[str]:
        return ["h"]

    def input_specs(self, B: int, T: int, g: Geometry) -> list[InputSpec]:
        c = self.c
        hh, hd = c.engram_hash_heads, c.engram_head_dim
        return [
            InputSpec("h", (B, T, c.hc_mult, c.hidden_size), self.dtype, "activation"),
            InputSpec("rows", (B, T, hh, hd), torch.uint8, "step"),
            InputSpec("rows_s", (B, T, hh, -(-hd // 32)), torch.uint8, "step"),
            InputSpec("token_mask", (B, T), torch.bool, "step"),
        ]

    def decode(self, h: Tensor, rows: Tensor, rows_s: Tensor, token_mask: Tensor) -> Tensor:
        """h [B, T, n, D], rows [B, T, hash_heads, hd] fp8 codes of the hashed table rows, rows_s
        [B, T, hash_heads, hd/32] their ue8m0 scales, token_mask [B, T] bool -> h."""
        c = self.c
        n, D, eps = c.hc_mult, c.hidden_size, c.rms_norm_eps
        rows = dequant_fp8_rows(rows, rows_s, h.dtype, self.fp8_format)  # [B, T, hh, hd]
        kv = ops.blockquant_gemm(rows.flatten(-2), self.wkv, self.wkv_s, self.fp8)  # [B, T, (n+1)*D]
        key, value = kv.split((n * D, D), dim=-1)
        key = key.float().unflatten(-1, (n, D))
        hf = h.float()
        weights = self.q_weight.float() * self.k_weight.float()  # [n, D]
        rstd = torch.rsqrt(hf.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)
        dot = (hf * weights * key).sum(-1) * rstd * D**-0.5  # [B, T, n]
        gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
        gate = gate * token_mask.unsqueeze(-1).to(gate.dtype)
        return (hf + gate.unsqueeze(-1) * value.float().unsqueeze(-2)).to(h.dtype)
