"""A prompt divided by rows over a token group (regions/rows.py, issue 41 item 2): each of d ranks takes
a quarter (a half) of every prompt chunk's rows through the tiny model's attention layers, with the
whole layer's weights and the paged pools divided by blocks, and gets what one rank's `decode` gives
for those rows.

Every attention layer kind (window; sources at ratios 2 and 1 with the candidate pool; reuse; reindex
with the pool) runs two prompts of 40 and 70 tokens in chunks of 8, the second padded, whole and at
d = 2 and 4; the gathers between the stages are `torch.cat` in this process (a stand-in for the
all-gathers). The streams agree within float32 rounding and the selections exactly; after the prompts
every rank's window rings and partial groups are one rank's, whichever rank computed each row, and
every compressed entry is on its owner only (the other ranks' blocks never written).
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.regions import rows as divided_rows
from deepinfer.regions.state import Geometry
from deepinfer.regions.stepper import Allocator

from .test_divided import BLOCK_SIZE, MAX_BLOCKS, SLOTS, states

PROMPTS = (40, 70)
CHUNK = 8


def chunks():
    """positions [2, CHUNK] of each prompt chunk (-1: padding past a prompt's end)."""
    done = [0, 0]
    while any(d < n for d, n in zip(done, PROMPTS)):
        rows = []
        for b, n in enumerate(PROMPTS):
            k = min(CHUNK, n - done[b])
            rows.append(list(range(done[b], done[b] + k)) + [-1] * (CHUNK - k))
            done[b] += k
        yield torch.tensor(rows)


def whole_layer(region, p, st, h, pre, positions, slots, table, carry):
    """One rank, every row: the layer's decode -> (h, pre); the carries updated."""
    if p.attn == "window":
        return region.decode(h, pre, positions, slots, st["win"])
    common = (positions, slots, table, st["win"], st["ckv"])
    if p.attn == "source":
        parts = (st["part_kv"], st["part_gate"]) if p.ratio > 1 else ()
        out = region.decode(h, pre, *common, st["ikeys"], *parts)
        carry["topk"] = out[2]
        if p.candidate_source:
            carry["cand"] = out[3]
        return out[:2]
    if p.attn == "reindex":
        extra = (carry["cand"],) if p.uses_candidates else ()
        h, pre, carry["topk"] = region.decode(h, pre, *common, st["ikeys"], *extra)
        return h, pre
    return region.decode(h, pre, *common, carry["topk"])


def rows_layer(region, p, ranks, contexts, h, pre, positions, slots, table, carries):
    """d ranks, each its rows: stage 1, the packed rows gathered, stage 2 at a kv source (its pages
    gathered; the index keys joined), stage 3 -> (h, pre) of every row, the ranks' rows in order."""
    d, T = len(ranks), positions.shape[1]
    own = [divided_rows.rows_of(T, d, j) for j in range(d)]
    firsts = [divided_rows.rows_in(region, h[:, r], pre[:, r], positions[:, r]) for r in own]
    kv, proj = divided_rows.unpack(region, torch.cat([f[2] for f in firsts], 1), h.dtype)  # the all-gather
    if p.attn == "source":
        pages = []
        for j, st in enumerate(ranks):
            parts = (st[p.layer]["part_kv"], st[p.layer]["part_gate"]) if p.ratio > 1 else (None, None)
            lay = st[p.layer]
            pages.append(
                divided_rows.rows_write(region, proj, positions, slots, table, lay["ckv"], lay["ikeys"], *parts, d, j)
            )
        per_block = ranks[0][p.layer]["ckv"].shape[1]
        ckv_parts, ikeys_parts = (torch.stack(x) for x in zip(*pages))
        contexts[p.layer] = (ckv_parts, per_block, divided_rows.join_pages(ikeys_parts, table.shape[1], per_block))
    context = None if p.attn == "window" else contexts[p.kv_source]
    outs = [
        divided_rows.rows_attend(
            region, h[:, r], f[0], f[1], positions, r, slots, kv, st[p.layer]["win"], context, carry
        )
        for r, f, st, carry in zip(own, firsts, ranks, carries)
    ]
    return torch.cat([o[0] for o in outs], 1), torch.cat([o[1] for o in outs], 1)


def twin_layer(region, p, ranks, contexts, h, pre, positions, slots, table, carries):
    """As `rows_layer`, through the compiled form's methods (`rows_twin`, each rank's with its rank),
    every input checked against the method's input specs."""
    d, (B, T) = len(ranks), positions.shape
    geometry = Geometry(slots=SLOTS, blocks=2 * MAX_BLOCKS + 1, block_size=BLOCK_SIZE, max_blocks=MAX_BLOCKS)
    twins = []
    for j in range(d):
        twin = divided_rows.rows_twin(region, d)
        twin._buffers["rank"] = torch.tensor(j)
        twins.append(twin)

    def call(twin, method, *args):
        specs = twin.method_inputs(method, B, T, geometry)
        assert [(tuple(a.shape), a.dtype) for a in args] == [(s.shape, s.dtype) for s in specs], method
        out = getattr(twin, method)(*args)
        assert len(out) == len(twin.method_outputs(method)), method
        return out

    n = T // d
    own = [slice(j * n, (j + 1) * n) for j in range(d)]
    firsts = [call(t, "rows_in", h[:, r], pre[:, r], positions[:, r]) for t, r in zip(twins, own)]
    packed = torch.cat([f[4] for f in firsts], 1)
    if p.attn == "source":
        pages = []
        for t, st in zip(twins, ranks):
            lay = st[p.layer]
            parts = (lay["part_kv"], lay["part_gate"]) if p.ratio > 1 else ()
            pages.append(call(t, "rows_write", packed, positions, slots, table, lay["ckv"], lay["ikeys"], *parts))
        contexts[p.layer] = tuple(torch.stack(x) for x in zip(*pages))  # the all-gather
    outs = []
    for t, r, f, st, carry in zip(twins, own, firsts, ranks, carries):
        extra: tuple = ()
        if p.attn != "window":
            ckv, ikeys = contexts[p.kv_source]
            extra = (ckv, ikeys) if t.selects else (ckv,)
            if p.attn == "reindex" and p.uses_candidates:
                extra += (carry["cand"],)
            elif p.attn == "reuse":
                extra += (carry["topk"],)
        out = call(t, "rows_attend", h[:, r], *f[:4], positions, slots, table, packed, st[p.layer]["win"], *extra)
        carry.update(zip(t.rows_attend_outputs()[2:], out[2:]))
        outs.append(out)
    return torch.cat([o[0] for o in outs], 1), torch.cat([o[1] for o in outs], 1)


def run(model, d: int, layer_fn=None) -> int:
    """The prompts through every attention layer, whole and divided by rows over d ranks -> the entries
    selected (checked equal on the way)."""
    per_rank = (MAX_BLOCKS * 2) // d + 1
    whole, ranks = states(model, 2 * MAX_BLOCKS + 1), [states(model, per_rank) for _ in range(d)]
    a1 = Allocator(SLOTS, 2 * MAX_BLOCKS + 1, BLOCK_SIZE, MAX_BLOCKS)
    an = Allocator(SLOTS, per_rank, BLOCK_SIZE, MAX_BLOCKS, shards=d)
    for a in (a1, an):
        a.admit(0), a.admit(1)
    slots = torch.tensor([a1.slot_of[0], a1.slot_of[1]])
    c = model.config.text
    gen = torch.Generator().manual_seed(0)
    selected = 0
    for positions in chunks():
        last = int(positions.max()) + 1
        for a in (a1, an):
            a.reserve(0, last), a.reserve(1, last)
        t1 = torch.tensor([a1.table_row(s, MAX_BLOCKS) for s in (0, 1)])
        tn = torch.tensor([an.table_row(s, MAX_BLOCKS) for s in (0, 1)])
        carry, carries, contexts = {}, [{} for _ in range(d)], {}
        valid = positions >= 0
        for p in model.plans:
            region = model.layers[p.layer]["attn"]
            h = torch.randn(2, CHUNK, c.hc_mult, c.hidden_size, generator=gen)
            pre = torch.softmax(torch.randn(2, CHUNK, c.hc_mult, generator=gen), -1)
            want = whole_layer(region, p, whole[p.layer], h, pre, positions, slots, t1, carry)
            got = (layer_fn or rows_layer)(region, p, ranks, contexts, h, pre, positions, slots, tn, carries)
            for w, g in zip(want, got):
                err = (w - g)[valid].abs().max() / w[valid].abs().max()
                assert err <= 1e-5, (p.layer, int(positions[0, 0]), float(err))
            if p.attn != "window":
                assert torch.equal(torch.cat([k["topk"] for k in carries], 1), carry["topk"]), p.layer
                selected += int((carry["topk"] >= 0).sum())
    _check_state(model, whole, ranks, a1, an)
    return selected


def _check_state(model, whole, ranks, a1, an) -> None:
    """Every rank's rings and partial groups are one rank's; each compressed entry is on its owner,
    the same as one rank's, and no rank's other blocks were written (block 0 is the padding's scratch)."""
    d = len(ranks)
    for p in model.plans:
        for j, st in enumerate(ranks):
            for name in ("win", "part_kv", "part_gate"):
                if name in whole[p.layer]:
                    assert torch.equal(st[p.layer][name], whole[p.layer][name]), (p.layer, name, j)
        if p.attn != "source":
            continue
        for j, st in enumerate(ranks):
            owned = set()
            for s in (0, 1):
                for k, (b1, bn) in enumerate(zip(a1.tables[s], an.tables[s])):
                    if k % d == j:
                        owned.add(bn)
                        for name in ("ckv", "ikeys"):
                            assert torch.equal(st[p.layer][name][bn], whole[p.layer][name][b1]), (p.layer, s, k)
            for name in ("ckv", "ikeys"):
                pool = st[p.layer][name]
                others = [b for b in range(1, pool.shape[0]) if b not in owned]
                assert not pool[others].any(), (p.layer, name, j)  # blocks it holds for no sequence


@pytest.mark.parametrize("d", [2, 4])
def test_each_rank_computes_its_rows_as_one_rank_does(ref_fp32, d):
    with torch.inference_mode():
        assert run(ref_fp32, d) > 0


def test_the_compiled_form_computes_the_same(ref_fp32):
    """The stages as the twin kinds' methods (what a bundle compiles): their inputs as their specs say,
    each rank's rows chosen by its rank, the pages joined in the graph; the same checks at d = 4."""
    with torch.inference_mode():
        assert run(ref_fp32, 4, twin_layer) > 0


def test_join_pages_puts_each_ranks_blocks_in_sequence_order():
    """Block k of a sequence is rank k % cp's local block k // cp; a table of 5 blocks over 2 ranks."""
    cp, per_block, width = 2, 3, 5
    whole = torch.arange(width * per_block, dtype=torch.float32).view(1, -1, 1)  # entry t holds t
    blocks = whole.view(1, width, per_block, 1)
    parts = []
    for c in range(cp):
        mine = list(range(c, width, cp))
        local = blocks[:, mine]
        pad = -(-width // cp) - len(mine)  # past the table: scratch
        local = torch.cat((local, torch.full((1, pad, per_block, 1), -1.0)), 1)
        parts.append(local.flatten(1, 2))
    assert torch.equal(divided_rows.join_pages(torch.stack(parts), width, per_block), whole)
    index = torch.tensor([[[0, 14, 7], [3, 3, 9]]])  # entries [B=1, 2, 3]
    assert torch.equal(divided_rows.pages_at(torch.stack(parts), index, per_block), index.unsqueeze(-1).float())


def test_rows_of_refuses_a_chunk_that_does_not_divide():
    assert divided_rows.rows_of(8, 4, 3) == slice(6, 8)
    with pytest.raises(ValueError, match="does not divide"):
        divided_rows.rows_of(6, 4, 0)
