"""Context parallel that divides the context (regions/divided.py): the attention's stages at cp ranks,
merged, compute what one rank's `decode` does, on the tiny model's layers.

Every layer kind that reads compressed state runs a prompt in chunks and then decode steps, at
cp = 1 (`decode` over whole pools) and at cp = 2 and 4 (`query` / `select` / `attend` / `output` per rank,
each rank holding its blocks only, merged by the functions the runtime's collectives compute): the
selections and the candidate pool equal cp = 1's exactly, the streams agree within float32
rounding, every rank's pools hold exactly cp = 1's entries of the blocks it owns, and every
rank's window ring equals cp = 1's.
"""

from __future__ import annotations

import copy

import pytest
import torch

from deepinfer.bundles.topology import Topology
from deepinfer.compiler.shard import shard
from deepinfer.regions import divided
from deepinfer.regions.plan import make_attention
from deepinfer.regions.stepper import Allocator

BLOCK_SIZE, MAX_BLOCKS, SLOTS = 16, 8, 3
PROMPTS = (40, 70)  # two sequences: 3 and 5 blocks of prompt, then decode steps
CHUNK, DECODE_STEPS = 8, 12


def at_rank(region, plan, cp: int, rank: int):
    """The region as cp rank `rank` of a divided token group runs it: built for the layout, holding
    that rank's shards of the whole region's weights (compiler/shard.py)."""
    topo = Topology(cp=cp)
    r = make_attention(region.c, plan, region.dtype, region.cache_quant, topo)
    r.ties = region.ties
    for spec in r.specs:
        getattr(r, spec.name).copy_(
            shard(r.kind, spec.name, getattr(region, spec.name), region.c, topo, rank, spec.buffer_shape)
        )
    r.rank = torch.tensor(rank, dtype=torch.int64)
    return r


class Layers:
    """The tiny model's compressed layers (2 source r2, 3 reuse r2, 4 source r1 + pool, 5 reindex r1)
    and their state, at one rank of `cp` or whole."""

    def __init__(self, model, cp: int, rank: int, blocks: int):
        self.regions = {p.layer: model.layers[p.layer]["attn"] for p in model.plans if p.ratio}
        if cp > 1:
            plans = {p.layer: p for p in model.plans}
            self.regions = {layer: at_rank(r, plans[layer], cp, rank) for layer, r in self.regions.items()}
        held = {p.layer for p in model.plans if p.ratio}
        self.state = {layer: st for layer, st in states(model, blocks).items() if layer in held}


def states(model, blocks: int) -> dict[int, dict[str, torch.Tensor]]:
    """Every attention layer's state views, zero: its ring, and at a kv source its pools and partial
    groups (reindex and reuse layers read their source's pools)."""
    c = model.config.text
    out: dict[int, dict[str, torch.Tensor]] = {}
    for p in model.plans:
        st = {"win": torch.zeros(SLOTS, c.sliding_window, c.head_dim)}
        if p.attn == "source":
            per_block = BLOCK_SIZE // p.ratio
            st["ckv"] = torch.zeros(blocks, per_block, c.head_dim)
            st["ikeys"] = torch.zeros(blocks, per_block, c.index_head_dim)
            if p.ratio > 1:
                st["part_kv"] = torch.zeros(SLOTS, p.ratio, c.head_dim)
                st["part_gate"] = torch.zeros(SLOTS, p.ratio, c.head_dim)
        elif p.attn != "window":
            st.update({k: out[p.kv_source][k] for k in ("ckv", "ikeys")})
        out[p.layer] = st
    return out


def whole_step(layers: Layers, layer: int, h, pre, step, carry: dict):
    """cp = 1: the layer's decode -> (h, pre), the carries updated."""
    region, st = layers.regions[layer], layers.state[layer]
    positions, slots, table = step
    if region.kind.startswith("attn_source"):
        parts = (st["part_kv"], st["part_gate"]) if region.ratio > 1 else ()
        out = region.decode(h, pre, positions, slots, table, st["win"], st["ckv"], st["ikeys"], *parts)
        carry["topk"] = out[2]
        if region.candidate_source:
            carry["cand"] = out[3]
        return out[0], out[1]
    if region.kind.startswith("attn_reindex"):
        extra = (carry["cand"],) if region.uses_candidates else ()
        h, pre, carry["topk"] = region.decode(
            h, pre, positions, slots, table, st["win"], st["ckv"], st["ikeys"], *extra
        )
        return h, pre
    return region.decode(h, pre, positions, slots, table, st["win"], st["ckv"], carry["topk"])


def divided_step(ranks: list[Layers], layer: int, h, pre, step, carry: dict):
    """cp ranks: query on each, gather the query rows, select on each, merge, attend on each, merge,
    output -> (the ranks' partial streams summed, as the attention all-reduce does; pre, every rank's
    the same), the carries updated."""
    positions, slots, table = step
    first = ranks[0].regions[layer]
    queried = [lr.regions[layer].query(h, pre, positions) for lr in ranks]  # x, query, mix_pre, post, comb
    queries = torch.stack([q[1] for q in queried])  # the cp query all-gather
    if first.selects:
        picks = []
        for lr, (x, *_) in zip(ranks, queried):
            region, st = lr.regions[layer], lr.state[layer]
            if region.kind.startswith("attn_source"):
                parts = (st["part_kv"], st["part_gate"]) if region.ratio > 1 else ()
                picks.append(region.select(x, queries, positions, slots, table, st["ckv"], st["ikeys"], *parts))
            else:
                extra = (carry["cand"],) if region.uses_candidates else ()
                picks.append(region.select(x, queries, positions, slots, table, st["ikeys"], *extra))
        carry["topk"] = divided.merge_topk(torch.stack([p[0] for p in picks]), torch.stack([p[1] for p in picks]))
        if getattr(first, "candidate_source", False):
            carry["cand"] = divided.merge_blocks(torch.stack([p[2] for p in picks]), torch.stack([p[3] for p in picks]))
    shares = [
        lr.regions[layer].attend(
            q[0], queries, positions, slots, table, lr.state[layer]["win"], lr.state[layer]["ckv"], carry["topk"]
        )
        for lr, q in zip(ranks, queried)
    ]
    attention = divided.merge_attention(*(torch.stack(x) for x in zip(*shares)))
    outs = [lr.regions[layer].output(h, *q[2:], positions, attention) for lr, q in zip(ranks, queried)]
    for _, pre_r in outs[1:]:
        assert torch.equal(pre_r, outs[0][1])
    assert all(o[0].dtype == torch.float32 for o in outs)  # partials: the row-split output's rows
    return torch.stack([o[0] for o in outs]).sum(0).to(h.dtype), outs[0][1]


def cand_mask(ids: torch.Tensor, positions: torch.Tensor, ratio: int, block: int, width: int) -> torch.Tensor:
    """Chosen candidate block ids [B, T, N] -> cp = 1's pool mask [B, T, Wc] (visible entries of those blocks)."""
    entry = torch.arange(width)
    chosen = (torch.div(entry, block, rounding_mode="floor").view(1, 1, -1, 1) == ids.unsqueeze(-2)).any(-1)
    vis_len = torch.div(positions + 1, ratio, rounding_mode="floor").clamp_min(0)
    return chosen & (entry < vis_len.unsqueeze(-1))


def steps():
    """(positions [2, T], slots [2]) of the prompt chunks, then the decode steps."""
    lengths, done = list(PROMPTS), [0, 0]
    while any(d < n for d, n in zip(done, lengths)):
        rows = []
        for b in range(2):
            n = min(CHUNK, lengths[b] - done[b])
            rows.append(list(range(done[b], done[b] + n)) + [-1] * (CHUNK - n))
            done[b] += n
        yield torch.tensor(rows)
    for _ in range(DECODE_STEPS):
        yield torch.tensor([[done[0]], [done[1]]])
        done = [d + 1 for d in done]


def run(model, cp: int, *, mutate=None, seed: int = 0):
    """Every step through the four compressed layers, whole and divided -> the entries selected."""
    per_rank = (MAX_BLOCKS * 2) // cp + 1  # room for both sequences' blocks, each rank's share
    whole = Layers(model, 1, 0, 2 * MAX_BLOCKS + 1)
    ranks = [Layers(model, cp, r, per_rank) for r in range(cp)]
    if mutate is not None:
        for lr in [whole, *ranks]:
            lr.regions = {layer: mutate(r) for layer, r in lr.regions.items()}
    a1 = Allocator(SLOTS, 2 * MAX_BLOCKS + 1, BLOCK_SIZE, MAX_BLOCKS)
    an = Allocator(SLOTS, per_rank, BLOCK_SIZE, MAX_BLOCKS, shards=cp)
    for a in (a1, an):
        a.admit(0), a.admit(1)
    slots = torch.tensor([a1.slot_of[0], a1.slot_of[1]])
    c = model.config.text
    gen = torch.Generator().manual_seed(seed)
    carries: tuple[dict, dict] = ({}, {})
    selected = 0
    for positions in steps():
        last = int(positions.max()) + 1
        for a in (a1, an):
            a.reserve(0, last), a.reserve(1, last)
        t1 = torch.tensor([a1.table_row(s, MAX_BLOCKS) for s in (0, 1)])
        tn = torch.tensor([an.table_row(s, MAX_BLOCKS) for s in (0, 1)])
        B, T = positions.shape
        for layer in sorted(whole.regions):
            h = torch.randn(B, T, c.hc_mult, c.hidden_size, generator=gen)
            pre = torch.softmax(torch.randn(B, T, c.hc_mult, generator=gen), -1)
            want = whole_step(whole, layer, h, pre, (positions, slots, t1), carries[0])
            got = divided_step(ranks, layer, h, pre, (positions, slots, tn), carries[1])
            assert torch.equal(carries[1]["topk"], carries[0]["topk"]), (layer, positions[:, 0])
            region = whole.regions[layer]
            if getattr(region, "candidate_source", False):
                width = MAX_BLOCKS * BLOCK_SIZE // region.ratio
                mask = cand_mask(carries[1]["cand"], positions, region.ratio, c.candidate_block_size, width)
                assert torch.equal(mask, carries[0]["cand"]), (layer, positions[:, 0])
            valid = positions >= 0
            for w, g in zip(want, got):
                err = (w - g)[valid].abs().max() / w[valid].abs().max()
                assert err <= 1e-5, (layer, positions[:, 0], float(err))
            selected += int((carries[0]["topk"] >= 0).sum())
    # every rank's pools: cp = 1's entries of the blocks it owns; every rank's window ring: cp = 1's
    for layer, st in whole.state.items():
        for r, lr in enumerate(ranks):
            assert torch.equal(lr.state[layer]["win"], st["win"]), layer
            if "ckv" in st and whole.regions[layer].kind.startswith("attn_source"):
                for s in (0, 1):
                    for j, (b1, bn) in enumerate(zip(a1.tables[s], an.tables[s])):
                        if j % cp == r:
                            assert torch.equal(lr.state[layer]["ckv"][bn], st["ckv"][b1]), (layer, s, j)
                            assert torch.equal(lr.state[layer]["ikeys"][bn], st["ikeys"][b1]), (layer, s, j)
    return selected


@pytest.mark.parametrize("cp", [2, 4])
def test_divided_stages_compute_what_one_rank_does(ref_fp32, cp):
    with torch.inference_mode():
        assert run(ref_fp32, cp) > 0


def test_selection_ties_across_ranks_break_as_one_rank_does(ref_fp32):
    """Index keys all zero: every visible entry scores 0, on every rank; the merged top-k is cp = 1's
    (the lowest indices), entry for entry."""

    def flat_keys(region):
        if "iwk" in region._buffers:
            region = copy.copy(region)
            region._buffers = dict(region._buffers)
            region.iwk = torch.zeros_like(region.iwk)
        return region

    with torch.inference_mode():
        assert run(ref_fp32, 4, mutate=flat_keys) > 0


def test_merges_order_as_one_rank():
    """merge_topk over ranks = top_indices over the concatenated row, ties to the lowest index."""
    from deepinfer.kernels.select import top_indices_ref

    gen = torch.Generator().manual_seed(1)
    scores = torch.randint(0, 3, (2, 3, 24), generator=gen).float()  # many ties
    scores[0, 0, 20:] = float("-inf")
    K, cp = 5, 4
    want_idx = top_indices_ref(scores, K).sort(-1).values
    want = torch.where(torch.isfinite(scores.gather(-1, want_idx)), want_idx, -1)
    gidx = torch.arange(24).view(-1, 6)  # rank r holds entries 6r .. 6r + 5 (blocks of 6)
    values, index = [], []
    for r in range(cp):
        local = scores[..., gidx[r]]
        top = top_indices_ref(local, K)
        values.append(local.gather(-1, top))
        index.append(gidx[r][top])
    assert torch.equal(divided.merge_topk(torch.stack(values), torch.stack(index)), want)
