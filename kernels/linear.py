"""Block-quantized GEMM, the clamped SwiGLU of V4.1's experts, and the routed experts: grouped (every
expert's slice over all rows, `moe_experts`), gathered (each row's chosen experts' slices, `moe_gathered`)
or tiled (the rows grouped by expert in tiles, each tile one expert's slice, `moe_tiled`)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor
from torch.nn import functional as F

from deepinfer.kernels.formats import FP8_GEMM_FORMATS, dequant_fp4, dequant_fp8, fp4_pairs, ue8m0_decode, unpack_fp4
from deepinfer.kernels.registry import register

FP8_OF_GEMM_FORMAT = {gemm: fp8 for fp8, gemm in FP8_GEMM_FORMATS.items()}  # "fp8" -> "e4m3fn", ...
WEIGHT_FORMATS = (*FP8_OF_GEMM_FORMAT, "fp4")


def blockquant_gemm_ref(x: Tensor, codes: Tensor, scales: Tensor, fmt: str) -> Tensor:
    """y = x @ W.T with W decoded from (codes, scales), computed in x's dtype.

    fmt "fp8": codes uint8 e4m3fn [..., N, K], scales ue8m0 [..., ceil(N/32), ceil(K/32)].
    fmt "fp8-e4m3": the same with IEEE-like e4m3 codes (the `e4m3` weight recipe).
    fmt "fp4": codes uint8 [..., N, K/2] (two e2m1 a byte), scales ue8m0 [..., N, ceil(K/32)].
    A 2-D weight is shared by every row of x [..., K] -> [..., N]. A weight with
    leading dims is per row: x [..., K] with codes [..., N, K'] -> [..., N]
    (the MoE's gathered experts, `[tokens, k, N, K']`).
    """
    if fmt == "fp4":
        w = dequant_fp4(codes, scales, x.dtype)
    else:
        w = dequant_fp8(codes, scales, x.dtype, FP8_OF_GEMM_FORMAT[fmt])
    if codes.dim() == 2:
        return F.linear(x, w)
    return torch.matmul(w, x.unsqueeze(-1)).squeeze(-1)


def swiglu_ref(gate: Tensor, up: Tensor, weight: Tensor | None, limit: float) -> Tensor:
    """silu(min(gate, limit)) * clamp(up, +-limit) [* weight], in float32, cast to gate's dtype.

    gate, up: [..., I]; weight (routing weight, optional): broadcastable [..., 1].
    limit <= 0 disables the clamps.
    """
    g, u = gate.float(), up.float()
    if limit > 0:
        g = g.clamp(max=limit)
        u = u.clamp(min=-limit, max=limit)
    y = F.silu(g) * u
    if weight is not None:
        y = y * weight.float()
    return y.to(gate.dtype)


# Routed experts are dequantized in tiles of weight rows, all local experts at once: a tile
# holds at most EXPERT_TILE_BYTES of float32 weights, and a weight is cut into at most
# EXPERT_MAX_TILES tiles, so the lowered graph's size does not grow with the expert count
# (at 384 local experts a tile is 1/8 of the weight, whatever its bytes).
EXPERT_TILE_BYTES = 32 << 20
EXPERT_MAX_TILES = 8


def expert_tiles(experts: int, rows: int, cols: int) -> list[tuple[int, int]]:
    """(start, stop) of the row tiles of an expert stack [experts, rows, cols]: equal but the last."""
    count = min(EXPERT_MAX_TILES, rows, -(-experts * rows * cols * 4 // EXPERT_TILE_BYTES))
    size = -(-rows // count)
    return [(start, min(start + size, rows)) for start in range(0, rows, size)]


def moe_experts_ref(
    x: Tensor,
    weights: Tensor,
    w1: Tensor,
    w1_s: Tensor,
    w3: Tensor,
    w3_s: Tensor,
    w2: Tensor,
    w2_s: Tensor,
    limit: float,
    blocks: Tensor | None = None,
    partial: bool = False,
) -> Tensor:
    """sum_e w2_e(swiglu(w1_e(x), w3_e(x)) * weights[:, e]) over the local experts -> [N, D] float32.

    x [N, D]; weights [N, E] float32 (a row's routing weight of expert e, zero where the
    row is not routed to it); w1, w3 fp4 [E, I, D/2] with ue8m0 scales [E, I, D/32]; w2 fp4
    [E, D, I/2], scales [E, D, I/32]. Every expert computes every row, once per call, so its
    weights are decoded once whatever the row count, and in row tiles (`expert_tiles`):
    scratch is bounded by a tile of the local experts' weights plus the activations
    ([N, E, I] of the intermediate). Each expert's output is computed in x's dtype (the
    weighted SwiGLU product cast to it before w2, as `swiglu` does) and summed in float32.
    `blocks` [I] int64: w2's columns are a slice of the expert's that does not start on a
    32-block (regions/topology.expert_slice): w2_s [E, D, nb] holds the blocks it spans and
    column j uses block blocks[j] of them (`dequant_fp4_columns`); None: w2_s [E, D, I/32].
    `partial`: the stacks are column slices of the experts (ep > 1), whose outputs are no expert's
    output: w2 contracts every expert's columns at once, accumulated in float32 (the product
    still cast to x's dtype first), and scratch holds [N, t] of a tile, not [E, N, t].
    """
    E, I = w1.shape[0], w1.shape[1]
    D = x.shape[-1]
    weight, pairs = weights.unsqueeze(-1), fp4_pairs(x.device)  # [N, E, 1]
    parts = []
    for start, stop in expert_tiles(E, I, D):
        g = F.linear(x, dequant_fp4(w1[:, start:stop], w1_s[:, start:stop], x.dtype, pairs).flatten(0, 1))
        u = F.linear(x, dequant_fp4(w3[:, start:stop], w3_s[:, start:stop], x.dtype, pairs).flatten(0, 1))
        parts.append(swiglu_ref(g.unflatten(-1, (E, -1)), u.unflatten(-1, (E, -1)), weight, limit))  # [N, E, t]
    a = torch.cat(parts, -1)  # [N, E, I] in x's dtype
    out = []
    for start, stop in expert_tiles(E, D, I):
        if partial:  # [N, E * I] @ [E * I, t] in float32
            w = _dequant_w2(w2[:, start:stop], w2_s[:, start:stop], blocks, torch.float32, pairs)  # [E, t, I]
            out.append(a.float().flatten(1) @ w.transpose(0, 1).flatten(1).T)
            continue
        w = _dequant_w2(w2[:, start:stop], w2_s[:, start:stop], blocks, x.dtype, pairs)  # [E, t, I]
        out.append(torch.bmm(a.transpose(0, 1), w.transpose(1, 2)).float().sum(0))  # [N, t]
    return torch.cat(out, -1)


def dequant_fp4_columns(packed: Tensor, scales: Tensor, blocks: Tensor, dtype: torch.dtype, pairs: Tensor) -> Tensor:
    """fp4 weight [..., N, K/2] whose K columns take their ue8m0 scale from `scales` [..., N, nb] by
    column: column j from block blocks[j] ([K] int64) -> dtype [..., N, K]. A column slice of a
    weight that straddles its 32-blocks decodes exactly as the whole weight's columns do."""
    s = ue8m0_decode(scales.index_select(-1, blocks))  # [..., N, K]
    return (unpack_fp4(packed, pairs) * s).to(dtype)


def _dequant_w2(packed: Tensor, scales: Tensor, blocks: Tensor | None, dtype: torch.dtype, pairs: Tensor) -> Tensor:
    if blocks is None:
        return dequant_fp4(packed, scales, dtype, pairs)
    return dequant_fp4_columns(packed, scales, blocks, dtype, pairs)


def _gather_stacks(stacks: tuple[Tensor, ...], ids: Tensor) -> tuple[Tensor, ...]:
    """Each stack's entries `ids` ([G] int64): one gather (`index_select`) of codes and scales each."""
    return tuple(t.index_select(0, ids) for t in stacks)


def _gathered_products(xg: Tensor, weight: Tensor, stacks: tuple[Tensor, ...], limit: float, pairs: Tensor) -> Tensor:
    """The weighted SwiGLU product of G gathered expert slices, each over its own R rows -> [G, I, R]
    in xg's dtype: xg [G, D, R] (the rows as columns), weight [G, 1, R] float32 (each row's routing
    weight of the slice), stacks (w1, w1_s, w3, w3_s) gathered [G, I, ...], decoded in tiles as
    `moe_experts` decodes (`expert_tiles`): scratch bounded by a tile, not the gathered count."""
    w1, w1_s, w3, w3_s = stacks
    G, I = w1.shape[0], w1.shape[1]
    parts = []
    for start, stop in expert_tiles(G, I, xg.shape[1]):
        g = torch.bmm(dequant_fp4(w1[:, start:stop], w1_s[:, start:stop], xg.dtype, pairs), xg)  # [G, t, R]
        u = torch.bmm(dequant_fp4(w3[:, start:stop], w3_s[:, start:stop], xg.dtype, pairs), xg)
        parts.append(swiglu_ref(g, u, weight, limit))
    return torch.cat(parts, 1)


def _w2_tiles(
    w2: Tensor, w2_s: Tensor, blocks: Tensor | None, dtype: torch.dtype, pairs: Tensor
) -> Iterator[tuple[int, int, Tensor]]:
    """(start, stop, w2 decoded [G, t, I]) over the row tiles of gathered w2 [G, D, I/2] (`expert_tiles`)."""
    G, D, I = w2.shape[0], w2.shape[1], 2 * w2.shape[2]
    for start, stop in expert_tiles(G, D, I):
        yield start, stop, _dequant_w2(w2[:, start:stop], w2_s[:, start:stop], blocks, dtype, pairs)


def moe_gathered_ref(
    x: Tensor,
    weights: Tensor,
    experts: Tensor,
    w1: Tensor,
    w1_s: Tensor,
    w3: Tensor,
    w3_s: Tensor,
    w2: Tensor,
    w2_s: Tensor,
    limit: float,
    blocks: Tensor | None = None,
    partial: bool = False,
) -> Tensor:
    """sum_j w2_e(swiglu(w1_e(x), w3_e(x)) * weights[:, j]) over each row's k choices e = experts[:, j]
    -> [N, D] float32: only the chosen experts' weights are read and decoded.

    x [N, D]; weights [N, k] float32; experts [N, k] int64 (indices into the stacks); the stacks
    as `moe_experts` takes them (w1, w3 [E, I, D/2] with scales [E, I, D/32]; w2 [E, D, I/2],
    scales [E, D, I/32], or [E, D, nb] with `blocks`). Each (row, choice) gathers its expert's
    slices from the stacks (`index_select`: an HLO gather of N * k slices, static shapes whatever
    the routing), decodes them, and computes as `moe_experts` does: the weighted SwiGLU product
    cast to x's dtype before w2, each choice's output in x's dtype, the k choices summed in
    float32 (`partial`: w2 contracts the k choices' columns at once in float32, as `moe_experts`
    does with it). The same result as `moe_experts` with dense weights; cheaper where N * k is
    under the expert count (regions/topology.moe_form).
    """
    N, k = experts.shape
    ids, pairs, I = experts.reshape(-1), fp4_pairs(x.device), w1.shape[1]
    xr = x.unsqueeze(1).expand(N, k, x.shape[-1]).reshape(N * k, -1, 1)  # [N * k, D, 1]
    up = _gather_stacks((w1, w1_s, w3, w3_s), ids)  # [N * k, I, ...]
    w2g, w2sg = _gather_stacks((w2, w2_s), ids)  # [N * k, D, ...]
    a = _gathered_products(xr, weights.reshape(N * k, 1, 1), up, limit, pairs).squeeze(-1)  # [N * k, I] x's dtype
    out = []
    for start, stop, w in _w2_tiles(w2g, w2sg, blocks, torch.float32 if partial else x.dtype, pairs):  # [N * k, t, I]
        if partial:  # [N, t, k * I] @ [N, k * I, 1] in float32
            rows_w = w.view(N, k, stop - start, I).transpose(1, 2).flatten(2)
            out.append(torch.bmm(rows_w, a.float().view(N, k * I, 1)).squeeze(-1))  # [N, t]
        else:
            out.append(torch.bmm(w, a.unsqueeze(-1)).squeeze(-1).float().view(N, k, -1).sum(1))  # [N, t]
    return torch.cat(out, -1)


def tiles_bound(assignments: int, experts: int, tile: int) -> int:
    """The most tiles of `tile` rows that `assignments` (row, choice) pairs grouped by expert over
    `experts` experts can need: the static tile count of `moe_tiled`, exact for the worst routing.

    An expert with c >= 1 assignments needs ceil(c / tile) = 1 + floor((c - 1) / tile) tiles; with n
    experts chosen the sum is at most n + floor((A - n) / tile) (the floors of parts sum to at most the
    floor of the sum), which grows with n, so the bound is n = min(E, A): met by every expert but one
    holding one assignment and the last the rest. Between ceil(A / tile) (one expert) and A."""
    n = min(experts, assignments)
    return n + (assignments - n) // tile


RANK_BLOCK = 128  # assignments whose places within their experts `_expert_places` counts pairwise


def _expert_places(ids: Tensor, E: int) -> tuple[Tensor, Tensor]:
    """(each assignment's place among its expert's, in order: [A] int64; each expert's count: [E])
    for ids [A] in [0, E), with no sort and no scan over A (torch-mlir lowers a cumsum to a
    reduce-window as wide as its dim: quadratic): the ids cut in blocks of `RANK_BLOCK`, a place is
    the expert's count in the blocks before (a cumsum over the blocks' counts) plus the earlier
    equal ids of its own block (pairwise)."""
    A = ids.shape[0]
    pad = -A % RANK_BLOCK
    blocks = F.pad(ids, (0, pad), value=E).view(-1, RANK_BLOCK)  # [nb, b]: padding matches no expert
    per_block = (blocks.unsqueeze(-1) == torch.arange(E, device=ids.device)).sum(1)  # [nb, E]
    before = per_block.cumsum(0) - per_block  # [nb, E]: each expert's assignments in earlier blocks
    earlier = torch.ones(RANK_BLOCK, RANK_BLOCK, dtype=torch.bool, device=ids.device).tril(-1)
    within = ((blocks.unsqueeze(-1) == blocks.unsqueeze(-2)) & earlier).sum(-1)  # [nb, b]
    nb = blocks.shape[0]
    base = before.flatten().gather(
        0, (torch.arange(nb, device=ids.device).unsqueeze(-1) * E + blocks.clamp(max=E - 1)).flatten()
    )
    return (base + within.flatten())[:A], per_block.sum(0)


def _tile_slots(experts: Tensor, E: int, tile: int) -> tuple[Tensor, Tensor]:
    """Where each (row, choice) of experts [N, k] goes in the tiled layout, static shapes, no sort:
    (slot [N * k] int64: tile m's row j is slot m * tile + j, an expert's assignments in row order
    from its first tile on; tile_expert [M] int64, unused tiles the last expert's)."""
    ids = experts.reshape(-1)
    place, counts = _expert_places(ids, E)
    tiles = (counts + tile - 1) // tile
    end = tiles.cumsum(0)  # [E]: each expert's tiles end here
    slot = (end - tiles).index_select(0, ids) * tile + place
    m = torch.arange(tiles_bound(ids.shape[0], E, tile), device=ids.device)
    tile_expert = (end.unsqueeze(0) <= m.unsqueeze(-1)).sum(-1).clamp(max=E - 1)  # [M]
    return slot, tile_expert


def moe_tiled_ref(
    x: Tensor,
    weights: Tensor,
    experts: Tensor,
    w1: Tensor,
    w1_s: Tensor,
    w3: Tensor,
    w3_s: Tensor,
    w2: Tensor,
    w2_s: Tensor,
    limit: float,
    tile: int,
    blocks: Tensor | None = None,
    partial: bool = False,
) -> Tensor:
    """`moe_gathered`'s result (x [N, D], weights and experts [N, k], the stacks, `blocks`, `partial` as
    it takes them) -> [N, D] float32, computed in tiles of `tile` rows of one expert each.

    The N * k (row, choice) assignments are grouped by expert, each expert's in row order from the
    start of its ceil(count / tile) tiles (`_tile_slots`: no sort, no scan over the assignments); the static
    tile count M = tiles_bound(N * k, E, tile) covers every routing. Each tile gathers its expert's
    slices (one `index_select` per stack: an HLO gather of M entries), decodes them as
    `moe_gathered` does, and computes its rows as one batched matmul [M, tile, D] x slices; a slot
    no assignment fills is row 0 with routing weight 0, an unused tile the last expert's. The
    weighted SwiGLU product is cast to x's dtype before w2, each tile's output is in x's dtype
    (`partial`: w2 in float32), and the tile rows are added back to their rows in float32
    (`index_add`): the same result as `moe_gathered` (and `moe_experts` on dense weights) up to the
    order of the float32 sums. Rows computed: M * tile against N * k useful
    (regions/topology.moe_tile).
    """
    N, k = experts.shape
    D, pairs = x.shape[-1], fp4_pairs(x.device)
    slot, tile_expert = _tile_slots(experts, w1.shape[0], tile)
    M = tile_expert.shape[0]
    rows = torch.zeros(M * tile, dtype=torch.long, device=x.device)
    rows = rows.scatter(0, slot, torch.arange(N * k, device=x.device) // k)  # [M * tile]
    weight = torch.zeros(M * tile, device=x.device).scatter(0, slot, weights.reshape(-1).float())
    xg = x.index_select(0, rows).view(M, tile, D).transpose(1, 2)  # [M, D, tile]
    up = _gather_stacks((w1, w1_s, w3, w3_s), tile_expert)  # [M, I, ...]
    a = _gathered_products(xg, weight.view(M, 1, tile), up, limit, pairs).transpose(1, 2)  # [M, tile, I]
    a = a.float() if partial else a  # x's dtype
    w2g, w2sg = _gather_stacks((w2, w2_s), tile_expert)  # [M, D, ...], gathered once the rows are done with
    out = []
    for start, stop, w in _w2_tiles(w2g, w2sg, blocks, a.dtype, pairs):  # [M, t, I]
        y = torch.bmm(a, w.transpose(1, 2)).float().view(M * tile, stop - start)  # [M * tile, t]
        out.append(torch.zeros(N, stop - start, device=x.device).index_add(0, rows, y))
    return torch.cat(out, -1)


blockquant_gemm = register(blockquant_gemm_ref)
swiglu = register(swiglu_ref)
moe_experts = register(moe_experts_ref)
moe_gathered = register(moe_gathered_ref)
moe_tiled = register(moe_tiled_ref)
