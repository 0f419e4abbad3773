"""What each rank of a topology holds of a V4.1 model (the degrees: bundles/topology.py).

    world = max(tp * cp, ep) processes, one per NeuronCore (or CPU process)
    rank  = group * (tp * cp) + cp_rank * tp + tp_rank

- Tokens are replicated inside a group of tp * cp ranks: every rank of a group runs
  the same prompt chunks and decode steps (the seed notes' context parallel, with
  prompt chunks replicated). Groups (world / (tp * cp) of them) serve different
  sequences, each with its own KV pools.
- The target's attention heads divide over the token group (tp * cp ranks, `attention_share`):
  rank (t, c) holds the wq_b rows of heads j * H/(tp*cp) ... with j = t * cp + c; window layers
  (and every kind at cp = 1) their output groups (head-split), compressed layers at cp > 1 whole
  32-blocks of their tp share's output rows (row-split, after the cp ranks gathered the share's
  queries). Each rank's output is a partial of the streams; the partials are summed (all-reduce)
  over the token group at the region boundary. KV is a single latent head: every tp rank keeps
  the same pools.
- ep splits every routed expert over all ranks (ep is 1 or world): each rank holds a
  slice of `expert_slice_width` intermediate columns of EVERY expert (w1, w3 rows; w2
  columns and the 32-blocks of w2's scales the slice spans, `expert_scale_blocks`),
  zero-padded past the intermediate size, and computes its columns' partial of the
  rows' chosen experts. A step reads the chosen experts' slices only (gathered) while
  rows x top-k is under the expert count, else the rows grouped by expert in tiles, each tile one
  gathered slice (tiled, `moe_tile` rows a tile): `moe_form`.
  When the EP group is one token group (ep == tp * cp), tokens are already replicated:
  the MoE partials are all-reduced. Otherwise tokens are dispatched with one all-gather
  of packed rows and combined with one fp32 reduce-scatter.
- The shared expert is split into column slices of `shared_width` over the first
  ranks; the others hold zero weights and add zeros through the same graph.
- The engram's projection (`wkv` [(n + 1) * D, hash_heads * head_dim]) is divided over a token
  group by its input columns: each rank holds `engram_width` of them (whole 32-blocks over the
  first ranks, zeros on the others) and multiplies its columns of the step's looked-up rows into
  partial keys and value, summed by one float32 all-reduce over the token group before the gate
  ("engram all-reduce"); a group of one rank holds the whole projection.
- The DSpark draft (`[speculative] draft`, regions/dspark.py) is laid out as the target: its MoE's
  routed experts (the draft's own, `dspark_n_routed_experts`) sliced over the ep ranks and its shared
  expert in the same slices, its attention's heads over the tp ranks (tp-only: its outputs'
  partial sums combined over the tp group); its context projection and heads are whole on every rank.
- The head is split by vocabulary over the ranks of a token group (tp * cp): each holds
  `head_rows` rows of it, vocab / (tp * cp) padded up to a whole block of 32 rows, rank
  `rank % (tp * cp)` of the group the rows from that index times `head_rows` on; the rows
  past the vocabulary are zeros, at the end (the last ranks of a group may hold only
  zeros). A rank's head computes its slice of the logits; the runtime gathers a group's
  slices into the whole vocabulary and drops the padding (runtime/ranks.py). A group of
  one rank (ep dispatch with cp = 1, or one rank in all) holds the whole head, unpadded.

Regions see only shapes (heads per rank, expert slice width, shared slice width) and the
rank buffer; one executable set serves every rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from deepinfer.bundles.topology import Topology
from deepinfer.regions.config import TextConfig, draft_moe_config

BLOCK = 32  # fp8 scale block: shards are whole blocks
# the divided engram's methods (regions/engram.py): `kv`'s partials are summed over the token group, then `mix`
ENGRAM_KV, ENGRAM_MIX = "kv", "mix"


def check(topo: Topology, c: TextConfig, *, draft: bool = False) -> tuple[str, str] | None:
    """(key, message) for the first degree this model cannot use, else None; with `draft`, the
    checkpoint's DSpark draft too (`check_draft`)."""
    if topo.ep > 1 and topo.ep != topo.world:
        return "ep", f"ep = {topo.ep} must be 1 or the world size {topo.world} (tp * cp = {topo.group_size})"
    if topo.ep > 1 and topo.tp > 1 and topo.ep != topo.group_size:
        return "ep", (
            f"expert parallel with tensor parallel attention needs ep = tp * cp (one token group), "
            f"not ep = {topo.ep} with tp * cp = {topo.group_size}; use tp = 1 or ep = tp * cp"
        )
    if topo.ep > 1 and topo.groups > 1 and topo.cp > 1:
        return "ep", (
            f"ep = {topo.ep} over {topo.groups} groups of cp = {topo.cp}: use ep = cp (all-reduce) or cp = 1 (dispatch)"
        )
    if c.n_routed_experts % topo.ep:
        return "ep", f"ep = {topo.ep} does not divide the model's {c.n_routed_experts} routed experts"
    if c.num_attention_heads % topo.tp or c.o_groups % topo.tp:
        return "tp", (
            f"tp = {topo.tp} must divide the attention heads ({c.num_attention_heads}) and output groups ({c.o_groups})"
        )
    rows = c.o_groups // topo.tp * c.o_lora_rank
    if topo.tp > 1 and (rows % BLOCK or c.num_attention_heads // topo.tp * c.head_dim % BLOCK):
        return "tp", f"tp = {topo.tp} would split the attention weights inside a {BLOCK}-wide fp8 scale block"
    bad = check_heads(topo, c)
    if bad is not None:
        return bad
    return check_draft(topo, c) if draft else None


def check_heads(topo: Topology, c: TextConfig) -> tuple[str, str] | None:
    """(key, message) where the target's attention heads cannot divide over the token group (issue 40's
    layout: `attention_share`), else None."""
    H, hd, G, R, d = c.num_attention_heads, c.head_dim, c.o_groups, c.o_lora_rank, topo.group_size
    if d == 1:
        return None
    key = "cp" if topo.cp > 1 else "tp"
    where = f"tp = {topo.tp} x cp = {topo.cp}"
    if H % d:
        return key, f"{where} = {d} ranks must divide the attention heads ({H})"
    if H // d * hd % BLOCK:
        return key, f"{where}: {H // d} heads of {hd} a rank would split wq_b inside a {BLOCK}-wide fp8 scale block"
    if G % d and d % G:
        return key, f"{where} = {d} ranks and the {G} output groups must divide one another"
    if G // d * R % BLOCK:
        return key, f"{where}: {G // d} output groups of {R} rows a rank would split wo_a inside a {BLOCK}-row block"
    if topo.cp == 1 or not any(c.compress_ratios):
        return None
    rr = out_rows(c, topo)
    if rr % R and R % rr:
        return (
            "cp",
            f"cp = {topo.cp}: the row-split output's {rr} wo_a rows a rank and the {R} rows of a group must divide one another",
        )
    if c.index_n_heads * c.index_head_dim // topo.cp % BLOCK or c.index_n_heads * c.index_head_dim % topo.cp:
        return "cp", (
            f"cp = {topo.cp} would split the indexer's {c.index_n_heads * c.index_head_dim} query rows "
            f"inside a {BLOCK}-row fp8 scale block"
        )
    return None


def check_draft(topo: Topology, c: TextConfig) -> tuple[str, str] | None:
    """(key, message) where the DSpark draft cannot be laid out as the target is, else None. Its
    attention has the target's heads and output groups, and its shared expert the target's width:
    the target's checks divide them. Its routed experts are its own. Under EP dispatch (ep over several
    token groups) its MoE runs on every group's gathered rows, as the target's does."""
    d = draft_moe_config(c)
    if d.n_routed_experts % topo.ep:
        return "ep", (
            f"ep = {topo.ep} does not divide the DSpark draft's {d.n_routed_experts} routed experts "
            "(dspark_n_routed_experts); use an ep that divides it, or no [speculative] draft"
        )
    return None


def check_division(topo: Topology, c: TextConfig, block_size: int) -> tuple[str, str] | None:
    """(key of [kv], message) where the paged state cannot divide over the cp ranks (regions/divided.py),
    else None: the candidate pool's blocks must not straddle a KV block (the usable blocks' count is
    checked with the pools: `compiler.spec.check_num_blocks`)."""
    if topo.cp == 1 or c.candidate_source_layer_id < 0:
        return None
    per_block = block_size // c.compress_ratios[c.candidate_source_layer_id]
    if per_block % c.candidate_block_size:
        return "block_size", (
            f"{block_size}: with cp = {topo.cp} a KV block's {per_block} compressed entries must hold whole "
            f"candidate blocks of {c.candidate_block_size} (candidate_block_size)"
        )
    return None


def shared_width(c: TextConfig, topo: Topology) -> int:
    """Columns of the shared expert's intermediate each participating rank computes."""
    if topo.ep == 1:
        return c.moe_intermediate_size
    per_rank = -(-c.moe_intermediate_size // topo.world)
    return -(-per_rank // BLOCK) * BLOCK


def engram_width(c: TextConfig, topo: Topology) -> int:
    """Input columns of the engram's `wkv` (the flattened looked-up rows, hash_heads * head_dim) each
    rank of a token group multiplies: the columns divided over the group, rounded up to a whole block;
    all of them for a group of one."""
    cols = c.engram_hash_heads * c.engram_head_dim
    if topo.group_size == 1:
        return cols
    per_rank = -(-cols // topo.group_size)
    return -(-per_rank // BLOCK) * BLOCK


def engram_slice(c: TextConfig, topo: Topology, rank: int) -> tuple[int, int] | None:
    """[start, stop) of the engram `wkv`'s input columns rank `rank` holds; None: zeros only."""
    cols = c.engram_hash_heads * c.engram_head_dim
    width = engram_width(c, topo)
    start = rank % topo.group_size * width
    if start >= cols:
        return None
    return start, min(start + width, cols)


def expert_slice_width(c: TextConfig, topo: Topology) -> int:
    """Intermediate columns of every routed expert each rank holds: moe_intermediate_size / ep
    rounded up to even (w2's fp4 codes pack two columns a byte); the whole width at ep = 1."""
    if topo.ep == 1:
        return c.moe_intermediate_size
    per_rank = -(-c.moe_intermediate_size // topo.ep)
    return per_rank + per_rank % 2


def expert_slice(c: TextConfig, topo: Topology, rank: int) -> tuple[int, int] | None:
    """[start, stop) of every expert's intermediate rank `rank` holds (zero-padded to the slice
    width past stop); None: it holds zeros only."""
    width = expert_slice_width(c, topo)
    start = rank % topo.ep * width
    if start >= c.moe_intermediate_size:
        return None
    return start, min(start + width, c.moe_intermediate_size)


def expert_scale_blocks(c: TextConfig, topo: Topology) -> int:
    """32-blocks of w2's ue8m0 scale columns each rank holds: the most any rank's slice spans (a
    slice starting at column a spans blocks a // 32 ... (a + width - 1) // 32; release: 36 columns,
    at most 2 blocks). Column j of rank r's slice uses block ((r * width) % 32 + j) // 32 of them."""
    width = expert_slice_width(c, topo)
    return max((r * width % BLOCK + width + BLOCK - 1) // BLOCK for r in range(topo.ep))


def moe_form(rows: int, k: int, experts: int) -> str:
    """How a step's MoE reads the routed experts for `rows` rows (B x T; under EP dispatch the
    gathered groups' rows) with top-`k` routing over `experts` experts: "gathered" (each row's k
    chosen experts' slices, rows x k of them) while rows x k is under the expert count, else
    "tiled" (the rows x k assignments grouped by expert in tiles of `moe_tile` rows, each tile one
    gathered slice: kernels/linear.moe_tiled). The region and the cost model both decide here."""
    return "gathered" if rows * k < experts else "tiled"


MOE_TILE_RANGE = (8, 128)  # rows per tile of the tiled form: matmuls of at least 8 rows, at most 128


def moe_tile(rows: int, k: int, experts: int) -> int:
    """Rows per tile of the tiled form (`moe_form`): the power of two nearest the mean assignments
    per expert (rows x k / experts), within `MOE_TILE_RANGE`. A static shape computes
    M = kernels/linear.tiles_bound(rows x k, experts, tile) tiles, min(E, A) + (A - min(E, A)) // tile
    for A = rows x k: the padding (M x tile rows against A useful) grows with the tile, the gathered
    slices (M) and the matmuls' inefficiency shrink with it; the mean balances the two (each expert's
    assignments fill about one tile). At the release (384 experts, top-6):

        rows   tile   tiles M   rows computed / useful (M x tile / (rows x 6))
         128      8       432   4.50   (grouped: 64.0)
        1024     16       744   1.94
        2048     32       756   1.97
        8192    128       765   1.99
    """
    lo, hi = MOE_TILE_RANGE
    mean = max(1.0, rows * k / experts)
    return max(lo, min(hi, 1 << round(math.log2(mean))))


def head_rows(c: TextConfig, topo: Topology) -> int:
    """Rows of the head (vocabulary entries) each rank of a token group holds: the vocabulary
    divided over the group, rounded up to a whole block; the whole vocabulary for a group of one."""
    if topo.group_size == 1:
        return c.vocab_size
    per_rank = -(-c.vocab_size // topo.group_size)
    return -(-per_rank // BLOCK) * BLOCK


def head_slice(c: TextConfig, topo: Topology, rank: int) -> tuple[int, int] | None:
    """[start, stop) of the vocabulary rank `rank` holds of the head; None: zeros only (padding)."""
    rows = head_rows(c, topo)
    start = rank % topo.group_size * rows
    if start >= c.vocab_size:
        return None
    return start, min(start + rows, c.vocab_size)


def shared_slice(c: TextConfig, topo: Topology, rank: int) -> tuple[int, int] | None:
    """[start, stop) of the shared intermediate rank `rank` holds; None: it adds zeros."""
    width = shared_width(c, topo)
    start = rank * width if topo.ep > 1 else 0
    if start >= c.moe_intermediate_size:
        return None
    return start, min(start + width, c.moe_intermediate_size)


def boundary_reduce(kind: str, method: str, topo: Topology) -> dict[str, list[list[int]]]:
    """The outputs of a (kind, method) summed over rank groups at the region's boundary -> {output:
    replica groups}; what runtime/ranks.Comm.after does on the host: the attention's partial
    streams over each token group (the draft's too), the MoE's over the token group when tokens are replicated in it
    (ep = tp * cp). EP dispatch (token groups of one) moves rows instead; it stays on the host.
    The draft's attention (`dspark_attn`) and MoE (`dspark_moe`) are reduced as the target's. The
    engram's partial keys and value (its `kv` method) are summed over the token group."""
    if kind == "engram" and method == ENGRAM_KV and topo.group_size > 1:
        return {"kv": topo.token_groups()}
    if method not in ("decode", "output"):  # the divided attention's last stage ends the region
        return {}
    if (kind.startswith("attn") or kind == "dspark_attn") and topo.group_size > 1:
        return {"h": topo.token_groups()}
    if kind in ("moe", "dspark_moe") and topo.ep > 1 and not topo.dispatch:
        return {"h": [list(range(topo.world))]}
    return {}


# --- the target's attention divided over the token group (issue 40) ----------------------------------


def head_index(topo: Topology, rank: int) -> int:
    """j = t * cp + c: which 1/(tp * cp) of the heads rank `rank` owns (a tp rank's share of H/tp
    heads split over its cp ranks in cp order)."""
    return topo.tp_rank(rank) * topo.cp + rank % topo.group_size // topo.tp


@dataclass(frozen=True)
class AttentionShare:
    """What one rank holds of a target attention layer.

    head-split (window layers; every kind at cp = 1): q_heads = heads = H / d of wq_b and the sink;
    wo_a [groups * R, q_heads * hd / groups], wo_b [D, groups * R] with groups = max(1, G / d).
    row-split (compressed kinds at cp > 1, in stages): wq_b rows of its H / d heads, the sink of its
    tp share's H / tp heads (it attends over them), `rows` of the share's wo_a rows (all H * hd / G
    columns) and those wo_b columns, from `groups` whole groups (or part of one)."""

    q_heads: int  # heads of its wq_b rows
    heads: int  # heads it attends over; its sink entries
    rows: int  # wo_a rows = wo_b columns
    cols: int  # wo_a columns
    groups: int  # the output groups the grouped projection runs over
    staged: bool  # row-split (the divided stages)


def out_rows(c: TextConfig, topo: Topology) -> int:
    """rr: the row-split output's wo_a rows a rank holds: its tp share's G / tp * R rows over its cp
    ranks in whole 32-blocks (the last ranks may hold zeros past the share)."""
    blocks = -(-(c.o_groups // topo.tp * c.o_lora_rank) // BLOCK)
    return -(-blocks // topo.cp) * BLOCK


def attention_share(c: TextConfig, topo: Topology, ratio: int) -> AttentionShare:
    """The share of a target attention layer (compress ratio `ratio`) one rank of `topo` holds."""
    H, hd, G, R, d = c.num_attention_heads, c.head_dim, c.o_groups, c.o_lora_rank, topo.group_size
    if topo.cp > 1 and ratio:
        rr = out_rows(c, topo)
        return AttentionShare(H // d, H // topo.tp, rr, H * hd // G, max(1, rr // R), True)
    g = max(1, G // d)
    return AttentionShare(H // d, H // d, g * R, H // d * hd // g, g, False)
