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

These functions are the stages' definition: the tests gather with `torch.cat` in one process (a
stand-in for the collectives), and the runtime and trn2's layers are to run them with collectives.
"""

from __future__ import annotations

import torch
from torch import Tensor

from deepinfer.regions import compress, divided
from deepinfer.regions.paging import gather_pages


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


def rows_attend(region, h, x, mix, positions: Tensor, rows: slice, slots, kv: Tensor, win, context, carry: dict):
    """Stage 3 on this rank's rows: h [B, t, n, D], x and the mixes from `rows_in`; positions [B, T] of
    the whole chunk, `rows` this rank's; kv [B, T, hd] the chunk's gathered window latents; `context`
    (ckv, ikeys) the whole context [B, Wc, *] joined (`join_pages`; None for a window layer); `carry`
    this rank's rows' selection and candidate pool (updated) -> (h, pre) of its rows. The ring `win`
    is updated with every row of the chunk."""
    own = positions[:, rows]
    angles = region._angles(own)
    q_lat = region._q_latent(x)
    q = region._heads_query(q_lat, angles)
    keys, valid = region._window_keys(kv, positions, slots, win, rows)
    if context is not None:
        ckv_all, ik_all = context
        if region.selects:
            source = region.kind.startswith("attn_source")
            make = source and region.candidate_source
            cand = carry.get("cand") if getattr(region, "uses_candidates", False) else None
            carry["topk"], made = region._select(x, q_lat, angles, own, ik_all, cand, make)
            if make:
                carry["cand"] = made
        sel, sel_valid = region._selected_keys(ckv_all, carry["topk"])
        keys, valid = torch.cat((keys, sel.to(keys.dtype)), 2), torch.cat((valid, sel_valid), 2)
    return region._finish(region._attend(q, keys, valid, angles), h, mix)


def _compresses(region) -> bool:
    return region.kind.startswith("attn_source")
