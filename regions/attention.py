"""Attention regions, one class per kind of V4.1 attention layer.

Every kind runs the attention site of a layer in one graph: hyper-connection
mixes of the streams, collapse with the previous site's `pre`, `attn_norm`,
attention, expand. They differ in the state they own and what they select:

| class              | layers             | state views                         | carries        |
|--------------------|--------------------|-------------------------------------|----------------|
| WindowAttention    | ratio 0            | win                                 |                |
| SourceAttention    | kv sources         | win, ckv, ikeys (+ part_kv, part_gate when ratio > 1) | -> topk (+ cand) |
| ReindexAttention   | index sources only | win; the source's ckv and ikeys     | (cand ->) -> topk |
| ReuseAttention     | other compressed   | win; the source's ckv               | topk ->        |

State layouts (one layer's views; the runtime's pools stack them layer-major):
- `win`   [S, R, hd], R = window + slack: ring of the last R latents of each
          sequence slot, the latent of position j at j % R. Slot 0 is scratch.
- `ckv`   [NB, bs / r, hd]: compressed latents, paged: block b of a sequence's
          block table holds its compressed entries t with t * r in block b.
- `ikeys` [NB, bs / r, index_head_dim]: indexer keys, paged like `ckv`.
- `part_kv`, `part_gate` [S, R, hd] float32, R = r + slack: ring of the
          compressor's projections of the last R positions, position j at j % R;
          a group is pooled from it once its last position is fed.
Block 0 of every paged pool is scratch: padding writes land there.

The rings' `slack` (regions/state.py `Geometry.slack`; 0 without a draft) is what speculative
decoding's rollback rests on: a verify step writes at most slack + 1 positions, so what it writes
for drafts the target rejects never overwrites a position the sequence still reads, and a rollback
restores nothing (runtime/schedule.py); the code reads R from the state's shape.

Step inputs: positions [B, T] (absolute, -1 for padding; a row's valid tokens
come first and are consecutive), slots [B], block_table [B, MB] (block ids,
0 where unallocated). Carries: `topk` [B, T, K] selected compressed indices
(ascending, -1 for none), `cand` [B, T, Wc] bool candidate pool.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F

from deepinfer.bundles.manifest import DECODE, blocks_per_rank
from deepinfer.kernels import attention as _attn  # noqa: F401  (registers ops)
from deepinfer.kernels.cachequant import maybe_quant
from deepinfer.kernels.rope import apply_rope, rope_angles, rope_frequencies
from deepinfer.regions import attention_specs as held
from deepinfer.regions import compress, divided
from deepinfer.regions.base import Region, WeightSpec
from deepinfer.regions.config import TextConfig
from deepinfer.regions.paging import gather_pages, gather_rows, ring_update, write_pages
from deepinfer.regions.selection import in_blocks, local_candidate_blocks
from deepinfer.regions.state import Geometry, InputSpec, step_inputs
from deepinfer.regions.topology import AttentionShare

ops = torch.ops.deepinfer


class _Attention(Region):
    """Shared pieces: projections, the window, sparse attention, the output."""

    ratio: int = 0
    tp: int = 1  # > 1: this rank's heads only; the output is a partial sum (see _finish)
    cp: int = 1  # > 1: the paged state divided over cp ranks; the step runs in stages (regions/divided.py)
    selects: bool = False  # scores the index keys (kv and index sources) rather than reusing a selection

    def __init__(
        self,
        c: TextConfig,
        specs: list[WeightSpec],
        *,
        dtype: torch.dtype,
        cache_quant: bool,
        share: AttentionShare | None = None,
    ):
        self.share = held.whole_share(c) if share is None else share  # what this rank holds (regions/topology.py)
        super().__init__(held.attention_specs(c, self.share) + specs, dtype)
        self.c = c
        self.cache_quant = cache_quant
        self.q_heads, self.heads, self.hd = self.share.q_heads, self.share.heads, c.head_dim
        self.window = c.sliding_window
        self.ties = "lowest"  # see kernels/select.py; the eager reference may choose "nemo"

    # -- signature ------------------------------------------------------------------------

    def topk_width(self, g: Geometry) -> int:
        return min(self.c.index_topk, g.compressed_width(self.ratio))

    def candidate_width(self, g: Geometry) -> int:
        """Candidate blocks the pool keeps: its top blocks, at most every block of the sequence."""
        return min(self.c.candidate_topk_blocks, -(-g.compressed_width(self.ratio) // self.c.candidate_block_size))

    def methods(self) -> tuple[str, ...]:
        """`decode`; with the paged state divided over cp ranks, its stages (regions/divided.py)."""
        if not self.share.staged:
            return (DECODE,)
        return ("query",) + (("select",) if self.selects else ()) + ("attend", "output")

    def _streams(self, B: int, T: int) -> list[InputSpec]:
        c = self.c
        return [
            InputSpec("h", (B, T, c.hc_mult, c.hidden_size), self.dtype, "activation"),
            InputSpec("pre", (B, T, c.hc_mult), torch.float32, "activation"),
        ]

    def _paged(self, g: Geometry, *names: str) -> list[InputSpec]:
        """This rank's share of the paged pools (the token group's `g.blocks` divided over cp, checked)."""
        widths = {"ckv": self.hd, "ikeys": self.c.index_head_dim}
        blocks = blocks_per_rank(g.blocks, self.cp)
        return [InputSpec(n, (blocks, g.block_size // self.ratio, widths[n]), self.dtype, "state") for n in names]

    def query_inputs(self, B: int, T: int, g: Geometry) -> list[InputSpec]:
        """The divided attention's first stage: the streams and the positions."""
        return [*self._streams(B, T), InputSpec("positions", (B, T), torch.int64, "step")]

    def query_outputs(self) -> list[str]:
        return ["x", "query", "mix_pre", "post", "comb"]

    def _queried(self, B: int, T: int) -> list[InputSpec]:
        """What the stages after `query` read of it: x and every cp rank's query rows (`_queries`)."""
        return held.queried_specs(self.c, self.share, self.cp, self.selects, self.dtype, B, T)

    def attend_inputs(self, B: int, T: int, g: Geometry) -> list[InputSpec]:
        """The divided attention's attend stage: x, the gathered queries, the step, the window ring,
        this rank's compressed KV and the merged selection."""
        return [
            *self._queried(B, T),
            *step_inputs(B, T, g, paged=True),
            self._win_spec(g),
            *self._paged(g, "ckv"),
            InputSpec("topk", (B, T, self.topk_width(g)), torch.int64, "carry"),
        ]

    def attend_outputs(self) -> list[str]:
        return ["numerator", "top", "total"]

    def output_inputs(self, B: int, T: int, g: Geometry) -> list[InputSpec]:
        """The last stage: the streams, the site's mixes, the positions and the merged attention
        [B, T, H/tp, hd] float32."""
        return held.output_stage_specs(self.c, self.share, self.dtype, B, T)

    def output_outputs(self) -> list[str]:
        return ["h", "pre"]

    def select_outputs(self) -> list[str]:
        return ["values", "index"]

    def input_specs(self, B: int, T: int, g: Geometry) -> list[InputSpec]:
        """The inputs of `decode`, in order, for a [B, T] step over geometry g."""
        c, f32 = self.c, torch.float32
        specs = [
            InputSpec("h", (B, T, c.hc_mult, c.hidden_size), self.dtype, "activation"),
            InputSpec("pre", (B, T, c.hc_mult), f32, "activation"),
            *step_inputs(B, T, g, paged=bool(self.ratio)),
            self._win_spec(g),
        ]
        if self.ratio:
            per_block = g.block_size // self.ratio
            specs += [InputSpec("ckv", (g.blocks, per_block, self.hd), self.dtype, "state")]
            if self.kind.startswith(("attn_source", "attn_reindex")):
                specs.append(InputSpec("ikeys", (g.blocks, per_block, c.index_head_dim), self.dtype, "state"))
        return specs + self._extra_specs(B, T, g)

    def _extra_specs(self, B: int, T: int, g: Geometry) -> list[InputSpec]:
        return []

    def _win_spec(self, g: Geometry) -> InputSpec:
        """The window ring: `window` latents and the geometry's slack rows per slot."""
        return InputSpec("win", (g.slots, self.window + g.slack, self.hd), self.dtype, "state")

    def output_names(self) -> list[str]:
        return ["h", "pre"]

    # -- pieces ---------------------------------------------------------------------------

    def _angles(self, positions: Tensor) -> Tensor:
        c = self.c
        if self.ratio:
            freqs = rope_frequencies(c.qk_rope_head_dim, c.compress_rope_theta, c.rope_scaling)
        else:
            freqs = rope_frequencies(c.qk_rope_head_dim, c.rope_theta, None)
        return rope_angles(positions.clamp_min(0), freqs)

    def _site_input(self, h: Tensor, pre: Tensor):
        mix = ops.hc_mixes(
            h, self.hc_fn, self.hc_base, self.hc_scale, self.c.rms_norm_eps, self.c.hc_eps, self.c.hc_sinkhorn_iters
        )
        x = ops.rmsnorm(ops.hc_collapse(h, pre), self.attn_norm, self.c.rms_norm_eps)  # [B, T, D]
        return x, mix

    def _q_latent(self, x: Tensor) -> Tensor:
        return ops.rmsnorm(ops.blockquant_gemm(x, self.wq_a, self.wq_a_s, self.fp8), self.q_norm, self.c.rms_norm_eps)

    def _project(self, x: Tensor, angles: Tensor):
        q_lat = self._q_latent(x)
        return self._heads_query(q_lat, angles), q_lat, self._kv(x, angles)

    def _heads_query(self, q_lat: Tensor, angles: Tensor) -> Tensor:
        """This rank's heads' queries [B, T, q_heads, hd], rope applied."""
        q = ops.blockquant_gemm(q_lat, self.wq_b, self.wq_b_s, self.fp8).unflatten(-1, (self.q_heads, self.hd))
        return apply_rope(q, angles)

    def _kv(self, x: Tensor, angles: Tensor) -> Tensor:
        """The step's latents [B, T, hd] (the window's keys and values), rope applied."""
        kv = ops.rmsnorm(ops.blockquant_gemm(x, self.wkv, self.wkv_s, self.fp8), self.kv_norm, self.c.rms_norm_eps)
        return maybe_quant(apply_rope(kv, angles), "fp8", self.cache_quant)

    def _window_keys(self, kv: Tensor, positions: Tensor, slots: Tensor, win: Tensor, rows: slice = slice(None)):
        """Keys of the causal window of each query; updates the ring in place.

        The ring `win` [S, R, hd] (R >= window) holds position j at row j % R; keys at positions
        before the step's first come from it, the others from this step's `kv` [B, T, hd].
        Returns keys [B, t, window, hd] and their validity [B, t, window] for the queries at the step's
        `rows` (t of them; every row unless given: a prompt divided by rows, regions/rows.py).
        """
        W, R = self.window, win.shape[1]
        ring = win.index_select(0, slots)  # [B, R, hd]
        buf = torch.cat((ring, kv), dim=1)  # [B, R + T, hd]
        p0 = positions[:, :1]  # [B, 1]
        queries = positions[:, rows]  # [B, t]
        j = queries.unsqueeze(-1) - (W - 1) + torch.arange(W, device=kv.device)  # [B, t, W]
        p0e = p0.unsqueeze(-1)
        idx = torch.where(j >= p0e, R + j - p0e, j.remainder(R)).clamp(0, buf.shape[1] - 1)
        valid = (j >= 0) & (queries >= 0).unsqueeze(-1)
        keys = gather_rows(buf, idx)  # [B, t, W, hd]
        win.index_copy_(0, slots, ring_update(ring, buf, p0, positions.amax(dim=1, keepdim=True)))
        return keys, valid

    def _selected_keys(self, ckv_all: Tensor, topk: Tensor):
        """Compressed latents [B, Wc, hd] at topk [B, T, K] -> [B, T, K, hd], validity."""
        return gather_rows(ckv_all, topk.clamp_min(0)), topk >= 0

    def _attend(self, q: Tensor, keys: Tensor, valid: Tensor, angles: Tensor) -> Tensor:
        """Sparse attention with the sink, de-rotation and the grouped output projection."""
        return self._out_project(ops.sparse_attn(q, keys, valid, self.sink, self.hd**-0.5), angles)

    def _out_project(self, o: Tensor, angles: Tensor) -> Tensor:
        """The attention's result o [B, T, H, hd] de-rotated through the grouped output projection."""
        o = apply_rope(o, angles, inverse=True)
        G = self.share.groups
        o = o.flatten(-2).unflatten(-1, (G, -1))  # [B, T, G, H*hd/G]
        wo_a = self.wo_a.unflatten(0, (G, -1))  # [G, R, H*hd/G]
        wo_a_s = self.wo_a_s.unflatten(0, (G, -1))
        o = ops.blockquant_gemm(o, wo_a, wo_a_s, self.fp8).flatten(-2)  # [B, T, G*R]
        return ops.blockquant_gemm(o, self.wo_b, self.wo_b_s, self.fp8)  # [B, T, D]

    def summed_over(self) -> int:
        """The ranks whose partial streams sum to this layer's: the token group's tp * cp (its heads
        divided over it, the DSpark draft's as the target's; regions/topology.boundary_reduce)."""
        return self.tp * self.cp

    def _finish(self, out: Tensor, h: Tensor, mix) -> tuple[Tensor, Tensor]:
        """The new streams. With several ranks (`summed_over`), `out` covers this rank's heads (or
        output rows): the streams come back as a float32 partial whose residual mix only the group's
        first rank adds; the runtime sums the partials over the group (regions/topology.py)."""
        pre, post, comb = mix
        n = self.summed_over()
        if n == 1:
            return ops.hc_expand(out, h, post, comb), pre
        lead = (self.rank % n == 0).to(torch.float32)
        return ops.hc_expand(out.float(), h.float() * lead, post, comb), pre

    # -- the divided stages (cp > 1, regions/divided.py) -------------------------------------

    def _cp_rank(self) -> Tensor:
        return divided.cp_rank(self.rank, self.tp, self.cp)

    def query(self, h, pre, positions):
        """The site's input, mixes and query latent, once: -> x [B, T, D], this rank's query rows
        [B, T, W] (its H/(tp*cp) heads' queries, rope applied, flattened; on index layers then its
        (Hi*di)/cp rows of the indexer's queries, before rope), the mixes mix_pre, post [B, T, n] and
        comb [B, T, n, n]. The cp ranks all-gather the query rows (`Merge.queries`)."""
        x, (mix_pre, post, comb) = self._site_input(h, pre)
        q_lat = self._q_latent(x)
        query = self._heads_query(q_lat, self._angles(positions)).flatten(-2)
        if self.selects:
            iq = ops.blockquant_gemm(q_lat, self.iwq_b, self.iwq_b_s, self.fp8)  # its rows of the indexer's queries
            query = torch.cat((query, iq, F.linear(x, self.iweights.to(x.dtype))), -1)  # and of its head weights
        return x, query, mix_pre, post, comb

    def _queries(self, queries: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Every cp rank's query rows [cp, B, T, W] -> (the tp share's queries [B, T, H/tp, hd], in cp
        order; the indexer's query rows [B, T, Hi*di] and head weights [B, T, cp * rows], empty where the
        layer does not select)."""
        index_rows = self.iwq_b.shape[0] if self.selects else 0
        return divided.split_queries(queries, self.q_heads, self.hd, index_rows)

    def attend(self, x, queries, positions, slots, block_table, win, ckv, topk):
        """This rank's share of the attention over the tp share's heads: the entries of the merged
        selection `topk` [B, T, K] it holds, and on cp rank 0 the window and the sink (they count once);
        the window ring updated on every rank -> (numerator [B, T, H/tp, hd], max [B, T, H/tp], sum
        [B, T, H/tp]), float32."""
        angles = self._angles(positions)
        q = self._queries(queries)[0]
        keys, valid = self._window_keys(self._kv(x, angles), positions, slots, win)
        c = self._cp_rank()
        lead = c == 0
        per_block = ckv.shape[1]
        t = topk.clamp_min(0)  # [B, T, K] global entry indices
        page = torch.div(t, per_block, rounding_mode="floor").clamp(max=block_table.shape[1] - 1)
        block = block_table.gather(1, page.flatten(1)).view_as(page)  # this rank's block ids
        sel = ckv[block, t.remainder(per_block)]  # [B, T, K, hd]
        mine = (topk >= 0) & divided.owned(t, per_block, self.cp, c)
        keys = torch.cat((keys, sel.to(keys.dtype)), 2)
        valid = torch.cat((valid & lead, mine), 2)
        return ops.sparse_attn_partial(q, keys, valid, self.sink, self.hd**-0.5, lead)

    def output(self, h, mix_pre, post, comb, positions, attention):
        """The merged attention [B, T, H/tp, hd] float32 through this rank's rows of the output
        projection (`_row_split`) -> (the partial streams, float32; pre)."""
        return self._finish(self._row_split(attention, self._angles(positions)), h, (mix_pre, post, comb))

    def _row_split(self, attention: Tensor, angles: Tensor) -> Tensor:
        """The row-split output: this rank's rr rows of its tp share's wo_a (cp rank c: the share's rows
        c * rr ...; zeros past the share) over their groups' de-rotated heads, then those wo_b columns
        -> this rank's partial [B, T, D]; summed over the token group it is the whole output."""
        s, R = self.share, self.c.o_lora_rank
        per_group = self.c.num_attention_heads // self.c.o_groups  # heads a group
        groups = self.heads // per_group  # the tp share's groups
        first = torch.div(self._cp_rank() * s.rows, R, rounding_mode="floor")
        idx = (first + torch.arange(s.groups, device=attention.device)).clamp(max=groups - 1)
        o = attention.unflatten(2, (groups, per_group)).index_select(2, idx).flatten(2, 3)  # [B, T, ng*pg, hd]
        o = apply_rope(o.to(self.dtype), angles, inverse=True).flatten(-2).unflatten(-1, (s.groups, -1))
        wo_a, wo_a_s = self.wo_a.unflatten(0, (s.groups, -1)), self.wo_a_s.unflatten(0, (s.groups, -1))
        o = ops.blockquant_gemm(o, wo_a, wo_a_s, self.fp8).flatten(-2)  # [B, T, rr]
        return ops.blockquant_gemm(o, self.wo_b, self.wo_b_s, self.fp8)  # [B, T, D]

    def _select_local(self, x, queries, angles, positions, block_table, ikeys, cand_blocks=None):
        """This rank's share of the selection: its index keys scored by the indexer's query rows and head
        weights the cp ranks gathered (`queries`, `_queries`) -> (the scores [B, T, Wl] and their global indices [Wl];
        the K best (score, global index) pairs [B, T, K], padded to K)."""
        c = self._cp_rank()
        per_block = ikeys.shape[1]
        local, cols = divided.local_pages(block_table, self.cp, c)
        gidx = divided.local_entries(cols, per_block, block_table.shape[1])  # [Wl]
        _, iq, w = self._queries(queries)
        qi, w = self._index_rows(x, iq, angles, w)
        vis_len = torch.div(positions + 1, self.ratio, rounding_mode="floor").clamp_min(0)  # [B, T]
        visible = gidx < vis_len.unsqueeze(-1)  # [B, T, Wl]
        scores = ops.index_score(qi, gather_pages(ikeys, local), w, visible)
        width = block_table.shape[1] * per_block  # the sequence's compressed entries (Wc)
        if cand_blocks is not None:  # the candidate pool's chosen blocks [B, T, N], global ids (-1: none)
            cb = self.c.candidate_block_size
            chosen = in_blocks(gidx, cand_blocks, cb, -(-width // cb))
            scores = scores.masked_fill(~chosen, float("-inf"))
        K = min(self.c.index_topk, width)
        top = ops.top_indices(scores, min(K, scores.shape[-1]))
        values, index = divided.pad_to(scores.gather(-1, top), gidx[top], K)
        return scores, gidx, values, index

    # -- indexer ---------------------------------------------------------------------------

    def _index_rows(self, x: Tensor, qi: Tensor, angles: Tensor, w: Tensor | None = None):
        """The indexer's query rows [B, T, Hi*di] -> its queries [B, T, Hi, di] (rope applied) and head
        weights [B, T, Hi] (from `w`, the cp ranks' gathered rows, where given; else from x)."""
        c = self.c
        qi = apply_rope(qi.unflatten(-1, (c.index_n_heads, c.index_head_dim)), angles)
        qi = maybe_quant(qi, "mxfp4", self.cache_quant)  # [B, T, Hi, di]
        w = F.linear(x, self.iweights.to(x.dtype)) if w is None else w
        w = w[..., : c.index_n_heads] * (c.index_head_dim**-0.5 * c.index_n_heads**-0.5)
        return qi, w

    def _select(self, x, q_lat, angles, positions, ikeys_all, cand, make_cand: bool):
        """Index scores over the visible compressed entries -> topk (and the candidate pool):
        kernels/index_select.py's one op, whose trn2 lowering scores the context in tiles."""
        c = self.c
        qi, w = self._index_rows(x, ops.blockquant_gemm(q_lat, self.iwq_b, self.iwq_b_s, self.fp8), angles)
        width = ikeys_all.shape[1]
        vis_len = torch.div(positions + 1, self.ratio, rounding_mode="floor").clamp_min(0)  # [B, T]
        if self.ties == "nemo":
            visible = torch.arange(width, device=x.device) < vis_len.unsqueeze(-1)  # [B, T, Wc]
            scores = ops.index_score(qi, ikeys_all, w, visible)
            return held.select_nemo(c, self.ratio, scores, positions, vis_len, visible, cand, make_cand)
        pool = None if make_cand else cand
        topk, made = ops.index_topk(
            qi, ikeys_all, w, vis_len, pool, c.index_topk, c.candidate_topk_blocks, c.candidate_block_size, make_cand
        )
        return topk, (made if make_cand else cand)


class WindowAttention(_Attention):
    """Ratio-0 layers: attention over the causal window only."""

    kind = "attn_window"

    def __init__(self, c: TextConfig, *, dtype: torch.dtype, cache_quant: bool, share: AttentionShare | None = None):
        super().__init__(c, [], dtype=dtype, cache_quant=cache_quant, share=share)

    def decode(self, h: Tensor, pre: Tensor, positions: Tensor, slots: Tensor, win: Tensor):
        """h [B, T, n, D], pre [B, T, n] -> (h [B, T, n, D], pre [B, T, n])."""
        x, mix = self._site_input(h, pre)
        angles = self._angles(positions)
        q, _, kv = self._project(x, angles)
        keys, valid = self._window_keys(kv, positions, slots, win)
        return self._finish(self._attend(q, keys, valid, angles), h, mix)


class SourceAttention(_Attention):
    """kv sources: compress the KV, write index keys, select top-k (and the candidate pool)."""

    kind = "attn_source"

    def __init__(
        self,
        c: TextConfig,
        *,
        ratio: int,
        candidate_source: bool,
        dtype: torch.dtype,
        cache_quant: bool,
        share: AttentionShare | None = None,
    ):
        self.ratio = ratio
        specs = held.source_specs(c, ratio) + held.indexer_query_specs(c, held.query_split(share))
        super().__init__(c, specs, dtype=dtype, cache_quant=cache_quant, share=share)
        self.candidate_source = candidate_source
        self.selects = True
        self.kind = f"attn_source_r{ratio}" + ("_cand" if candidate_source else "")

    def _extra_specs(self, B, T, g):
        r = self.ratio
        if r == 1:
            return []
        return [
            InputSpec("part_kv", (g.slots, r + g.slack, self.hd), torch.float32, "state"),
            InputSpec("part_gate", (g.slots, r + g.slack, self.hd), torch.float32, "state"),
        ]

    def output_names(self) -> list[str]:
        return ["h", "pre", "topk"] + (["cand"] if self.candidate_source else [])

    def _compress(self, x: Tensor, positions: Tensor, slots: Tensor, part_kv, part_gate):
        """Complete groups of this chunk -> latents [B, G, hd] (pre-rope), indices t [B, G], mask
        (regions/compress.py); the partial groups `part_kv`, `part_gate` updated."""
        return compress.pool(self, compress.projections(self, x), positions, slots, part_kv, part_gate, x.dtype)

    def _write_compressed(self, latent, t, complete, block_table, ckv, ikeys):
        c, eps = self.c, self.c.rms_norm_eps
        freqs = rope_frequencies(c.qk_rope_head_dim, c.compress_rope_theta, c.rope_scaling)
        cang = rope_angles(t * self.ratio, freqs)
        ckv_new = maybe_quant(apply_rope(latent, cang), "nvfp4", self.cache_quant)
        ik = ops.rmsnorm(F.linear(latent, self.iwk.to(latent.dtype)), self.ik_norm, eps)
        ik_new = maybe_quant(apply_rope(ik, cang), "mxfp4", self.cache_quant)
        write_pages(ckv, block_table, t, complete, ckv_new.to(ckv.dtype))
        write_pages(ikeys, block_table, t, complete, ik_new.to(ikeys.dtype))

    def select_inputs(self, B: int, T: int, g: Geometry) -> list[InputSpec]:
        """The divided selection: x, the gathered queries, the step, this rank's compressed KV and index
        keys (it writes the entries it holds), the compressor's partial groups (every rank keeps them)."""
        return [*self._queried(B, T), *step_inputs(B, T, g, paged=True), *self._paged(g, "ckv", "ikeys")] + (
            self._extra_specs(B, T, g)
        )

    def select_outputs(self) -> list[str]:
        return ["values", "index"] + (["block_values", "block_index"] if self.candidate_source else [])

    def select(self, x, queries, positions, slots, block_table, ckv, ikeys, part_kv=None, part_gate=None):
        """Compress the chunk (every rank: the partial groups are per slot), write the entries this rank
        holds, score its own index keys -> its K best (score [B, T, K], global index [B, T, K]) and,
        for the candidate source, its best candidate blocks (score, global block id) [B, T, N]."""
        angles = self._angles(positions)
        latent, t, complete = self._compress(x, positions, slots, part_kv, part_gate)
        mine = complete & divided.owned(t, ckv.shape[1], self.cp, self._cp_rank())
        self._write_compressed(latent, t, mine, block_table, ckv, ikeys)
        scores, gidx, values, index = self._select_local(x, queries, angles, positions, block_table, ikeys)
        if not self.candidate_source:
            return values, index
        c = self.c
        vis_len = torch.div(positions + 1, self.ratio, rounding_mode="floor").clamp_min(0)
        width = block_table.shape[1] * ckv.shape[1]
        blocks = local_candidate_blocks(scores, gidx, vis_len, c.candidate_topk_blocks, c.candidate_block_size, width)
        return values, index, *blocks

    def decode(self, h, pre, positions, slots, block_table, win, ckv, ikeys, part_kv=None, part_gate=None):
        """-> (h, pre, topk [B, T, K]) and, for the candidate source, cand [B, T, Wc]."""
        x, mix = self._site_input(h, pre)
        angles = self._angles(positions)
        q, q_lat, kv = self._project(x, angles)
        keys, valid = self._window_keys(kv, positions, slots, win)
        latent, t, complete = self._compress(x, positions, slots, part_kv, part_gate)
        self._write_compressed(latent, t, complete, block_table, ckv, ikeys)
        ckv_all, ik_all = gather_pages(ckv, block_table), gather_pages(ikeys, block_table)
        topk, cand = self._select(x, q_lat, angles, positions, ik_all, None, self.candidate_source)
        sel, sel_valid = self._selected_keys(ckv_all, topk)
        out = self._attend(q, torch.cat((keys, sel.to(keys.dtype)), 2), torch.cat((valid, sel_valid), 2), angles)
        h, pre = self._finish(out, h, mix)
        return (h, pre, topk, cand) if self.candidate_source else (h, pre, topk)


class ReindexAttention(_Attention):
    """Index sources that are not kv sources: own queries over the latest source's keys."""

    kind = "attn_reindex"

    def __init__(
        self,
        c: TextConfig,
        *,
        ratio: int,
        uses_candidates: bool,
        dtype: torch.dtype,
        cache_quant: bool,
        share: AttentionShare | None = None,
    ):
        self.ratio = ratio
        specs = held.indexer_query_specs(c, held.query_split(share))
        super().__init__(c, specs, dtype=dtype, cache_quant=cache_quant, share=share)
        self.uses_candidates = uses_candidates
        self.selects = True
        self.kind = f"attn_reindex_r{ratio}" + ("_cand" if uses_candidates else "")

    def output_names(self) -> list[str]:
        return ["h", "pre", "topk"]

    def _extra_specs(self, B, T, g):
        if not self.uses_candidates:
            return []
        return [InputSpec("cand", (B, T, g.compressed_width(self.ratio)), torch.bool, "carry")]

    def select_inputs(self, B: int, T: int, g: Geometry) -> list[InputSpec]:
        """The divided selection: x, the gathered queries, the step, this rank's index keys (its source's)
        and, where it uses the candidate pool, the pool's chosen blocks (global ids [B, T, N], -1: none)."""
        extra = (
            [InputSpec("cand", (B, T, self.candidate_width(g)), torch.int64, "carry")] if self.uses_candidates else []
        )
        return [*self._queried(B, T), *step_inputs(B, T, g, paged=True), *self._paged(g, "ikeys"), *extra]

    def select(self, x, queries, positions, slots, block_table, ikeys, cand=None):
        """Score this rank's index keys (of its source) -> its K best (score, global index) [B, T, K]."""
        angles = self._angles(positions)
        return self._select_local(x, queries, angles, positions, block_table, ikeys, cand)[2:]

    def decode(self, h, pre, positions, slots, block_table, win, ckv, ikeys, cand=None):
        """-> (h, pre, topk [B, T, K])."""
        x, mix = self._site_input(h, pre)
        angles = self._angles(positions)
        q, q_lat, kv = self._project(x, angles)
        keys, valid = self._window_keys(kv, positions, slots, win)
        ckv_all, ik_all = gather_pages(ckv, block_table), gather_pages(ikeys, block_table)
        topk, _ = self._select(x, q_lat, angles, positions, ik_all, cand, False)
        sel, sel_valid = self._selected_keys(ckv_all, topk)
        out = self._attend(q, torch.cat((keys, sel.to(keys.dtype)), 2), torch.cat((valid, sel_valid), 2), angles)
        h, pre = self._finish(out, h, mix)
        return h, pre, topk


class ReuseAttention(_Attention):
    """Other compressed layers: the previous layer's compressed KV and selection, unchanged."""

    kind = "attn_reuse"

    def __init__(
        self, c: TextConfig, *, ratio: int, dtype: torch.dtype, cache_quant: bool, share: AttentionShare | None = None
    ):
        self.ratio = ratio
        super().__init__(c, [], dtype=dtype, cache_quant=cache_quant, share=share)
        self.kind = f"attn_reuse_r{ratio}"

    def _extra_specs(self, B, T, g):
        return [InputSpec("topk", (B, T, self.topk_width(g)), torch.int64, "carry")]

    def decode(self, h, pre, positions, slots, block_table, win, ckv, topk):
        """-> (h, pre)."""
        x, mix = self._site_input(h, pre)
        angles = self._angles(positions)
        q, _, kv = self._project(x, angles)
        keys, valid = self._window_keys(kv, positions, slots, win)
        sel, sel_valid = self._selected_keys(gather_pages(ckv, block_table), topk)
        out = self._attend(q, torch.cat((keys, sel.to(keys.dtype)), 2), torch.cat((valid, sel_valid), 2), angles)
        return self._finish(out, h, mix)
