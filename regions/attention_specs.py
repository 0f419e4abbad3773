"""The attention regions' weight specs for the share a rank holds (regions/topology.attention_share),
and NeMo's selection order (the eager reference's `ties = "nemo"`).

What each kind of regions/attention.py holds: the projections, the output's wo_a and wo_b and the sink
as its share says (whole at one rank; the draft's tp rank through its own config), the indexer's queries
(wq_b rows divided over the cp ranks where the kind runs in stages) and the kv source's compressor.
"""

from __future__ import annotations

import torch

from deepinfer.regions.base import WeightSpec, fp8_specs
from deepinfer.regions.config import TextConfig
from deepinfer.regions.selection import candidate_blocks, torch_topk
from deepinfer.regions.state import InputSpec
from deepinfer.regions.topology import AttentionShare


def whole_share(c: TextConfig) -> AttentionShare:
    """Every head and output group of `c` (one rank; the draft's tp rank, whose `c` holds its heads)."""
    H, hd, G = c.num_attention_heads, c.head_dim, c.o_groups
    return AttentionShare(H, H, G * c.o_lora_rank, H * hd // G, G, False)


def attention_specs(c: TextConfig, s: AttentionShare) -> list[WeightSpec]:
    n, D, hd = c.hc_mult, c.hidden_size, c.head_dim
    return [
        WeightSpec("hc_fn", "hc_attn_fn", ((2 + n) * n, n * D), "F32"),
        WeightSpec("hc_base", "hc_attn_base", ((2 + n) * n,), "F32"),
        WeightSpec("hc_scale", "hc_attn_scale", (3,), "F32"),
        WeightSpec("attn_norm", "attn_norm.weight", (D,), "BF16"),
        *fp8_specs("wq_a", "attn.wq_a", c.q_lora_rank, D),
        WeightSpec("q_norm", "attn.q_norm.weight", (c.q_lora_rank,), "BF16"),
        *fp8_specs("wq_b", "attn.wq_b", s.q_heads * hd, c.q_lora_rank),
        *fp8_specs("wkv", "attn.wkv", hd, D),
        WeightSpec("kv_norm", "attn.kv_norm.weight", (hd,), "BF16"),
        *fp8_specs("wo_a", "attn.wo_a", s.rows, s.cols),
        *fp8_specs("wo_b", "attn.wo_b", D, s.rows),
        WeightSpec("sink", "attn.attn_sink", (s.heads,), "F32"),
    ]


def indexer_query_specs(c: TextConfig, cp: int) -> list[WeightSpec]:
    """The indexer's query weights; staged (cp > 1), wq_b's rows and weights_proj's rows (its heads'
    weights, `weight_rows`) divided over the cp ranks: both ride the query all-gather."""
    return [
        *fp8_specs("iwq_b", "attn.indexer.wq_b", c.index_n_heads * c.index_head_dim // cp, c.q_lora_rank),
        WeightSpec("iweights", "attn.indexer.weights_proj.weight", (weight_rows(c, cp), c.hidden_size), "BF16"),
    ]


def weight_rows(c: TextConfig, cp: int) -> int:
    """Rows of the indexer's weights_proj (one per index head) a cp rank computes: the heads over the
    cp ranks, rounded up (zero rows past the heads)."""
    return -(-c.index_n_heads // cp)


def source_specs(c: TextConfig, ratio: int) -> list[WeightSpec]:
    hd, D = c.head_dim, c.hidden_size
    specs = [WeightSpec("c_wkv", "attn.compressor.wkv.weight", (hd, D), "F32")]
    if ratio > 1:
        specs.append(WeightSpec("c_wgate", "attn.compressor.wgate.weight", (hd, D), "F32"))
    specs += [
        WeightSpec("c_norm", "attn.compressor.norm.weight", (hd,), "BF16"),
        WeightSpec("iwk", "attn.indexer.wk.weight", (c.index_head_dim, hd), "BF16"),
        WeightSpec("ik_norm", "attn.indexer.k_norm.weight", (c.index_head_dim,), "BF16"),
    ]
    return specs


def query_split(share: AttentionShare | None) -> int:
    """Over how many cp ranks the indexer's query rows divide: staged, the q_heads' split of the tp share."""
    return share.heads // share.q_heads if share is not None and share.staged else 1


def queried_specs(
    c: TextConfig, share: AttentionShare, cp: int, selects: bool, dtype: torch.dtype, B: int, T: int
) -> list[InputSpec]:
    """What the divided stages after `query` read of it: x [B, T, D] and every cp rank's query rows
    [cp, B, T, W]: its q_heads' queries, then (selecting kinds) its 1/cp of the indexer's query rows and
    of its head weights."""
    width = share.q_heads * c.head_dim
    if selects:  # its rows of the indexer's queries, then of its head weights
        width += c.index_n_heads * c.index_head_dim // cp + weight_rows(c, cp)
    return [
        InputSpec("x", (B, T, c.hidden_size), dtype, "activation"),
        InputSpec("queries", (cp, B, T, width), dtype, "activation"),
    ]


def output_stage_specs(c: TextConfig, share: AttentionShare, dtype: torch.dtype, B: int, T: int) -> list[InputSpec]:
    """The divided `output`'s inputs: the streams h, the site's mixes (from `query`), the positions and
    the merged attention of the tp share's heads [B, T, heads, hd] float32."""
    f32, n = torch.float32, c.hc_mult
    return [
        InputSpec("h", (B, T, n, c.hidden_size), dtype, "activation"),
        InputSpec("mix_pre", (B, T, n), f32, "activation"),
        InputSpec("post", (B, T, n), f32, "activation"),
        InputSpec("comb", (B, T, n, n), f32, "activation"),
        InputSpec("positions", (B, T), torch.int64, "step"),
        InputSpec("attention", (B, T, share.heads, c.head_dim), f32, "activation"),
    ]


def select_nemo(c: TextConfig, ratio: int, scores, positions, vis_len, visible, cand, make_cand: bool):
    """Selection as NeMo AutoModel's full-sequence forward makes it (eager only).

    NeMo scores a row of width floor(length / ratio) and calls torch.topk,
    whose choice among equal scores depends on that width. Slicing each
    sequence's row to the width of its forward so far reproduces it exactly.
    """
    B, T, width = scores.shape
    k_out = min(c.index_topk, width)
    topk = torch.full((B, T, k_out), -1, dtype=torch.int64)
    cand_out = torch.zeros_like(scores, dtype=torch.bool) if make_cand else cand
    for b in range(B):
        W = int(positions[b].max() + 1) // ratio
        if W <= 0:
            continue
        s = scores[b, :, :W]
        if make_cand:
            keep = (
                candidate_blocks(s, vis_len[b], c.candidate_topk_blocks, c.candidate_block_size, select=torch_topk)
                & visible[b, :, :W]
            )
            cand_out[b, :, :W] = keep
        elif cand is not None:
            s = s.masked_fill(~cand[b, :, :W], float("-inf"))
        k = min(c.index_topk, W)
        idx = s.topk(k, dim=-1, sorted=False).indices.sort(dim=-1).values
        topk[b, :, :k] = torch.where(torch.isfinite(s.gather(-1, idx)), idx, -1)
    return topk, cand_out
