"""A prompt chunk divided by rows over a token group's d ranks (issue 41: the design in docs/ranks.md,
"Dividing a prompt's rows"): what each rank computes, and the gathers between its stages.

Rank j of the group takes rows `rows_of(T, d, j)` of a chunk of T rows and holds the layer's whole
attention weights (every head). The paged pools stay divided by blocks (regions/divided.py: block k of
a sequence on cp rank k % d); the per-slot state (the window ring, the compressor's partial groups)
stays whole on every rank. A layer runs in three stages:

1. `rows_in`, its rows: the site's mixes and input x, the window latent and, at a kv source, the
   compressor's projections (regions/compress.py), packed into one float32 row each; the d ranks
   all-gather the packed rows of the chunk (T x (1 + 2) x hd);
2. `rows_write`, every row, on every rank (a kv source): the chunk's complete groups pooled from the
   gathered projections (so the partial groups are the same on every rank whichever rank computed a
   row), each new entry written by its owner only; then each rank's pages of the sequence
   (`local_context`), all-gathered and put in the sequence's order (`join_pages`): the whole context's
   compressed entries and index keys, which the source's reindex and reuse layers read too;
3. `rows_attend`, its rows: every head's queries, the window over the ring and the chunk's gathered
   latents (the ring updated with every row, on every rank), the selection over the whole context, the
   attention and the output projection: what one rank computes for those rows. The carries (the
   selection, the candidate pool) are of the rank's own rows and stay on it: no merge.

These functions are the stages' definition; `RowsStages` makes them the compiled methods of each
attention kind's twin (`rows_twin`: kind `rows_<kind>`, what `[prompt] rows = "divided"` builds), and
`regions.step.rows_steps` wires them, with the runtime's collectives (`runtime.ranks.Comm`) between them
(`runtime.executor.Executor.own_rows` picks a rank's rows as `rows_of` does). The tests also gather with
`torch.cat` in one process, a stand-in for the collectives. trn2's fused layers do not run them yet.
"""

from __future__ import annotations

import torch
from torch import Tensor

from deepinfer.bundles.manifest import ROWS_PREFIX, blocks_per_rank
from deepinfer.regions import compress, divided
from deepinfer.regions.attention import ReuseAttention, SourceAttention, _Attention
from deepinfer.regions.paging import gather_pages
from deepinfer.regions.state import Geometry, InputSpec

ROWS_IN, ROWS_WRITE, ROWS_ATTEND = "rows_in", "rows_write", "rows_attend"


def rows_of(T: int, d: int, j: int) -> slice:
    """Rank j's rows of a chunk of T rows over d ranks: T / d consecutive rows (T a multiple of d)."""
    if T % d:
        raise ValueError(f"a chunk of {T} rows does not divide over {d} ranks")
    n = T // d
    return slice(j * n, (j + 1) * n)


def rows_in(region, h: Tensor, pre: Tensor, positions: Tensor):
    """Stage 1 on this rank's rows (h [B, t, n, D], pre, positions [B, t]) -> x [B, t, D], the mixes
    (pre, post, comb) and the packed rows [B, t, k * hd] float32 the ranks all-gather: the window latent
    (rope applied), then at a kv source the compressor's projections."""
    x, mix = region._site_input(h, pre)
    parts = [region._kv(x, region._angles(positions)).float()]
    if _compresses(region):
        proj = compress.projections(region, x)
        parts.append(proj.float().flatten(2))
    return x, mix, torch.cat(parts, -1)


def unpack(region, packed: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
    """The gathered packed rows [B, T, k * hd] -> (the chunk's window latents [B, T, hd] in `dtype`, its
    compressor projections as `compress.projections` gives them, or None)."""
    hd = region.hd
    kv = packed[..., :hd].to(dtype)
    if not _compresses(region):
        return kv, None
    rest = packed[..., hd:]
    proj = rest.to(dtype) if region.ratio == 1 else rest.unflatten(-1, (2, hd))
    return kv, proj


def rows_write(region, proj: Tensor, positions: Tensor, slots, block_table, ckv, ikeys, part_kv, part_gate, cp, c):
    """Stage 2 of a kv source on every rank: the chunk's complete groups from every row's projections
    (positions [B, T] of the whole chunk), the partial groups updated, the entries cp rank `c` of `cp`
    holds written -> this rank's pages of the sequence (`local_context`)."""
    latent, t, complete = compress.pool(region, proj, positions, slots, part_kv, part_gate, ckv.dtype)
    mine = complete & divided.owned(t, ckv.shape[1], cp, c)
    region._write_compressed(latent, t, mine, block_table, ckv, ikeys)
    return local_context(block_table, ckv, ikeys, cp, c)


def local_context(block_table: Tensor, ckv: Tensor, ikeys: Tensor, cp: int, c) -> tuple[Tensor, Tensor]:
    """cp rank `c`'s pages of each sequence: (its compressed entries [B, MBl * P, hd], its index keys
    [B, MBl * P, di]), in its local block order (`divided.local_pages`): what it all-gathers."""
    ids, _ = divided.local_pages(block_table, cp, torch.as_tensor(c))
    return gather_pages(ckv, ids), gather_pages(ikeys, ids)


def join_pages(parts: Tensor, table_width: int, per_block: int) -> Tensor:
    """Every cp rank's pages [cp, B, MBl * P, C] (`local_context`, all-gathered) -> the sequence's
    entries in order [B, MB * P, C], as one rank's `gather_pages` over whole pools gives them: block k
    is rank k % cp's local block k // cp."""
    cp, B, _, C = parts.shape
    blocks = parts.unflatten(2, (-1, per_block)).movedim(0, 2).flatten(1, 2)  # [B, MBl * cp, P, C]
    return blocks[:, :table_width].flatten(1, 2)


def pages_at(parts: Tensor, index: Tensor, per_block: int) -> Tensor:
    """Every cp rank's pages [cp, B, L, C] (`local_context`, all-gathered) at the sequence's entries
    `index` [B, *S] (each within the table) -> [B, *S, C]: what `join_pages` holds there, without
    joining the whole context (its latents are 8 GiB a rank at 8 sequences of 1M entries)."""
    cp, B, L, C = parts.shape
    block = torch.div(index, per_block, rounding_mode="floor")
    local = torch.div(block, cp, rounding_mode="floor") * per_block + index.remainder(per_block)
    batch = torch.arange(B, device=index.device).view(B, *([1] * (index.dim() - 1)))
    flat = ((block.remainder(cp) * B + batch) * L + local).flatten()
    return parts.reshape(cp * B * L, C).index_select(0, flat).reshape(*index.shape, C)


def rows_attend(region, h, x, mix, positions: Tensor, rows: slice, slots, kv: Tensor, win, context, carry: dict):
    """Stage 3 on this rank's rows: h [B, t, n, D], x and the mixes from `rows_in`; positions [B, T] of
    the whole chunk, `rows` this rank's; kv [B, T, hd] the chunk's gathered window latents; `context`
    (ckv_parts, per_block, ikeys) the context: every rank's pages of the latents [d, B, L, hd]
    (`local_context`, gathered: the selected entries are read from them, `pages_at`), their entries
    a block, and the index keys [B, Wc, di] joined (`join_pages`); None for a window layer; `carry`
    this rank's rows' selection and candidate pool (updated) -> (h, pre) of its rows. The ring `win`
    is updated with every row of the chunk."""
    own = positions[:, rows]
    angles = region._angles(own)
    q_lat = region._q_latent(x)
    q = region._heads_query(q_lat, angles)
    keys, valid = region._window_keys(kv, positions, slots, win, rows)
    if context is not None:
        ckv_parts, per_block, ik_all = context
        if region.selects:
            make = isinstance(region, SourceAttention) and region.candidate_source
            cand = carry.get("cand") if getattr(region, "uses_candidates", False) else None
            carry["topk"], made = region._select(x, q_lat, angles, own, ik_all, cand, make)
            if make:
                carry["cand"] = made
        top = carry["topk"]
        sel, sel_valid = pages_at(ckv_parts, top.clamp_min(0), per_block), top >= 0
        keys, valid = torch.cat((keys, sel.to(keys.dtype)), 2), torch.cat((valid, sel_valid), 2)
    return region._finish(region._attend(q, keys, valid, angles), h, mix)


def _compresses(region) -> bool:
    return isinstance(region, SourceAttention)


class RowsStages(_Attention):
    """The compiled form of the stages above: mixed into an attention kind holding its whole weights
    (`rows_twin`), one method a stage. `group` is the token group's ranks d; a step's T rows are the
    chunk's, and a rank's own rows T / d, the rank's place in its group (`rank` mod d) choosing them.
    The paged pools are the rank's share (regions/divided.py); the gathered pages arrive as every
    rank's [d, B, MBl * P, *] and are joined in the graph."""

    group: int = 1

    def methods(self) -> tuple[str, ...]:
        return (ROWS_IN, ROWS_WRITE, ROWS_ATTEND) if _compresses(self) else (ROWS_IN, ROWS_ATTEND)

    def _packed_width(self) -> int:
        if not _compresses(self):
            return self.hd
        return self.hd * (2 if self.ratio == 1 else 3)

    def _own_rows(self, n: int, device) -> Tensor:
        """This rank's n rows of the chunk, as indices."""
        return torch.remainder(self.rank, self.group) * n + torch.arange(n, device=device)

    def _rows_streams(self, B: int, n: int) -> list[InputSpec]:
        c, f32 = self.c, torch.float32
        return [
            InputSpec("h", (B, n, c.hc_mult, c.hidden_size), self.dtype, "activation"),
            InputSpec("pre", (B, n, c.hc_mult), f32, "activation"),
        ]

    def _step(self, B: int, T: int, g: Geometry) -> list[InputSpec]:
        i64 = torch.int64
        return [
            InputSpec("positions", (B, T), i64, "step"),
            InputSpec("slots", (B,), i64, "step"),
            InputSpec("block_table", (B, g.max_blocks), i64, "step"),
        ]

    def _packed(self, B: int, T: int) -> InputSpec:
        return InputSpec("packed", (B, T, self._packed_width()), torch.float32, "activation")

    def rows_in_inputs(self, B: int, T: int, g: Geometry) -> list[InputSpec]:
        n = T // self.group
        return [*self._rows_streams(B, n), InputSpec("positions", (B, n), torch.int64, "step")]

    def rows_in_outputs(self) -> list[str]:
        return ["x", "mix_pre", "post", "comb", "packed"]

    def rows_in(self, h, pre, positions):
        x, (mix_pre, post, comb), packed = rows_in(self, h, pre, positions)
        return x, mix_pre, post, comb, packed

    def rows_write_inputs(self, B: int, T: int, g: Geometry) -> list[InputSpec]:
        per_block = g.block_size // self.ratio
        blocks = blocks_per_rank(g.blocks, self.group)
        specs = [
            self._packed(B, T),
            *self._step(B, T, g),
            InputSpec("ckv", (blocks, per_block, self.hd), self.dtype, "state"),
            InputSpec("ikeys", (blocks, per_block, self.c.index_head_dim), self.dtype, "state"),
        ]
        if self.ratio > 1:
            ring = (g.slots, self.ratio + g.slack, self.hd)
            specs += [
                InputSpec("part_kv", ring, torch.float32, "state"),
                InputSpec("part_gate", ring, torch.float32, "state"),
            ]
        return specs

    def rows_write_outputs(self) -> list[str]:
        return ["ckv_pages", "ikeys_pages"]

    def rows_write(self, packed, positions, slots, block_table, ckv, ikeys, part_kv=None, part_gate=None):
        _, proj = unpack(self, packed, self.dtype)
        c = torch.remainder(self.rank, self.group)
        return rows_write(self, proj, positions, slots, block_table, ckv, ikeys, part_kv, part_gate, self.group, c)

    def rows_attend_inputs(self, B: int, T: int, g: Geometry) -> list[InputSpec]:
        c, f32, n = self.c, torch.float32, T // self.group
        specs = [
            self._rows_streams(B, n)[0],
            InputSpec("x", (B, n, c.hidden_size), self.dtype, "activation"),
            InputSpec("mix_pre", (B, n, c.hc_mult), f32, "activation"),
            InputSpec("post", (B, n, c.hc_mult), f32, "activation"),
            InputSpec("comb", (B, n, c.hc_mult, c.hc_mult), f32, "activation"),
            *self._step(B, T, g),
            self._packed(B, T),
            self._win_spec(g),
        ]
        if not self.ratio:
            return specs
        local = -(-g.max_blocks // self.group) * (g.block_size // self.ratio)
        specs.append(InputSpec("ckv_pages", (self.group, B, local, self.hd), self.dtype, "activation"))
        if self.selects:
            specs.append(InputSpec("ikeys_pages", (self.group, B, local, c.index_head_dim), self.dtype, "activation"))
        if getattr(self, "uses_candidates", False):
            specs.append(InputSpec("cand", (B, n, g.compressed_width(self.ratio)), torch.bool, "carry"))
        if isinstance(self, ReuseAttention):
            specs.append(InputSpec("topk", (B, n, self.topk_width(g)), torch.int64, "carry"))
        return specs

    def rows_attend_outputs(self) -> list[str]:
        out = ["h", "pre"]
        if self.selects:
            out.append("topk")
        if isinstance(self, SourceAttention) and self.candidate_source:
            out.append("cand")
        return out

    def rows_attend(self, h, x, mix_pre, post, comb, positions, slots, block_table, packed, win, *pages):
        rows = self._own_rows(h.shape[1], h.device)
        kv, _ = unpack(self, packed, self.dtype)
        context, carry = None, {}
        if self.ratio:
            width = block_table.shape[1]
            per_block = pages[0].shape[2] // -(-width // self.group)
            ik_all = join_pages(pages[1], width, per_block) if self.selects else None
            context = (pages[0], per_block, ik_all)
            extra = pages[2:] if self.selects else pages[1:]
            if getattr(self, "uses_candidates", False):
                carry["cand"] = extra[0]
            elif isinstance(self, ReuseAttention):
                carry["topk"] = extra[0]
        h, pre = rows_attend(self, h, x, (mix_pre, post, comb), positions, rows, slots, kv, win, context, carry)
        return (h, pre) + tuple(carry[k] for k in self.rows_attend_outputs()[2:])


_TWINS: dict[type, type[RowsStages]] = {}


def rows_twin(region, group: int):
    """`region` (an attention kind holding its whole weights: meta buffers in a plan) as the divided-rows
    twin of a token group of `group` ranks: kind `rows_<its kind>`, the `RowsStages` methods."""
    base = type(region)
    cls = _TWINS.get(base)
    if cls is None:
        cls = _TWINS[base] = type("Rows" + base.__name__, (RowsStages, base), {})
    twin: RowsStages = object.__new__(cls)
    twin.__dict__.update(region.__dict__)
    twin._buffers = dict(region._buffers)
    twin.kind = ROWS_PREFIX + region.kind
    twin.group = group
    return twin
