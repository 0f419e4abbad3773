"""Multi-rank bundles end to end: processes over gloo generate the one-rank bundle's tokens.

Each topology is compiled once (session fixture `rank_bundle`) and its ranks are
started once (`started_ranks`, runtime/launch.py: one process per rank, as
`generate_ranks` starts them); the leader schedules and samples, followers run
the steps they are sent. Cache quantization is off, so tokens must match the
one-rank bundle exactly and logits to float32 rounding of the reordered sums.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deepinfer.bundles.topology import Topology
from deepinfer.regions.config import load_config
from deepinfer.regions.tokenizer import ByteTokenizer
from deepinfer.runtime import RunOptions, generate, load
from deepinfer.runtime.ranks import Comm, init

from ..conftest import regenerate

PROMPTS = [[0, 72, 101, 108, 108, 111, 44, 32, 119], [0, 5, 9, 11, 13, 40]]
NEW = 4
# a prompt of 132 tokens: 33 KV blocks of 4 positions, at least 8 on each of 4 cp ranks
LONG = [0] + [(7 * i) % 250 + 3 for i in range(131)]
GOLDEN_PROMPTS = [ByteTokenizer().encode(p) for p in regenerate.PROMPTS]
# ep=2 and cp=ep=4 between them cover ep dispatch/combine and four ranks (a separate ep=4 cost a compile
# and a four-process run for neither); cp=ep=4 divides the context (regions/divided.py) over four ranks and
# runs the golden prompts and the long one instead of PROMPTS (cp=ep=2, the same division over two ranks,
# is left to tests/ranks/test_shards.py and tests/regions/test_divided.py: its compile and two-process run
# cost the suite two minutes for no path cp=ep=4 does not take)
# tp=2xcp=2,ep=4: the heads over a token group of tp x cp (issue 40), the EP group that token group; like
# cp=ep=4 it is compiled with the DSpark draft (conftest SPECULATIVE_LAYOUTS: test_speculative_ranks.py runs it)
TOPOLOGIES = {"tp=2": (2, 1, 1), "ep=2": (1, 2, 1), "cp=ep=4": (1, 4, 4), "tp=2xcp=2,ep=4": (2, 4, 2)}
DIVIDED = {"cp query all-gather", "cp selection all-gather", "cp attention max all-gather", "cp attention all-reduce"}


@pytest.fixture(scope="module")
def one_rank(one_rank_loaded):
    return generate(one_rank_loaded, PROMPTS, RunOptions(max_new_tokens=NEW, keep_logits=True))


def manifest(bundle) -> dict:
    return json.loads((bundle / "manifest.json").read_text())


@pytest.fixture(scope="module")
def one_rank_long(one_rank_loaded):
    """The one-rank run of the golden prompts and the long prompt."""
    return generate(one_rank_loaded, [*GOLDEN_PROMPTS, LONG], RunOptions(max_new_tokens=NEW, keep_logits=True))


def _check_weight_cuts(m: dict, tp: int, ep: int, cp: int) -> None:
    """Each rank's weights its own cut where the layout divides a kind; one shared file for the rest."""
    world = m["topology"]["world_size"]
    stacks = [{w["kind"]: w for w in m["weights"][f"rank-{r}"]} for r in range(world)]
    digests = [{k: (w.get("digest"), w.get("shared_digest")) for k, w in s.items()} for s in stacks]
    sharded = {"moe"} if ep > 1 else set()
    if tp * cp > 1:  # the attention's heads (and output rows) over the token group
        sharded |= {k for k in digests[0] if k.startswith("attn")}
    if ep > 1 and "dspark_moe" in digests[0]:  # a draft's experts divide as the target's
        sharded.add("dspark_moe")
    if tp * cp > 1 and "dspark_attn" in digests[0]:  # a draft's heads divide as the target's window attention's
        sharded.add("dspark_attn")
    if tp * cp > 1:  # the head, split by vocabulary over the token group; the engram's wkv by its input columns
        sharded |= {"head", "engram"}
        if "dspark_head" in digests[0]:  # the draft's Markov head: the head's vocabulary rows (regions/picking.py)
            sharded.add("dspark_head")
    for kind in digests[0]:
        assert (len({d[kind] for d in digests}) > 1) == (kind in sharded), kind
        if kind not in sharded and stacks[0][kind]["tensors"]:  # whole on every rank: one shared file, no rank file
            assert all(
                s[kind].get("path") is None and s[kind]["shared"] == stacks[0][kind]["shared"] for s in stacks
            ), kind


@pytest.mark.parametrize("name", list(TOPOLOGIES))
def test_ranks_generate_the_one_rank_tokens(rank_bundle, started_ranks, request, name):
    """Every layout's tokens are the one-rank run's and its logits within 1e-4; one executable set for
    all ranks; each rank's weights its own cut. Where cp divides the context, the golden prompts and a
    prompt of 33 blocks: each cp rank holds 1/cp of the paged pools (the manifest says so and the ranks
    allocate that)."""
    tp, ep, cp = TOPOLOGIES[name]
    bundle = rank_bundle(tp, ep, cp)
    m = manifest(bundle)
    world = m["topology"]["world_size"]
    assert world == max(tp * cp, ep) and sorted(m["weights"]) == [f"rank-{r}" for r in range(world)]
    assert m["kv"]["divided"] == cp
    # one executable set for every rank: each (kind, method, bucket) once, every rank's weights its own files
    ids = {
        (e["kind"], e["method"], e["bucket"]["batch"], e["bucket"]["tokens"], e["bucket"].get("context"))
        for e in m["regions"]
    }
    assert len(ids) == len(m["regions"])
    stages = {e["method"] for e in m["regions"] if e["kind"].startswith("attn_reuse")}
    assert stages == ({"query", "attend", "output"} if cp > 1 else {"decode"})
    _check_weight_cuts(m, tp, ep, cp)
    prompts, want = (
        ([*GOLDEN_PROMPTS, LONG], request.getfixturevalue("one_rank_long"))
        if cp > 1
        else (PROMPTS, request.getfixturevalue("one_rank"))
    )
    run = started_ranks(tp, ep, cp).generate(prompts, RunOptions(max_new_tokens=NEW, keep_logits=True, threads=1))
    assert len(run) == len(want) == len(prompts)
    for got, one in zip(run, want, strict=True):
        assert got.error is None and got.tokens == one.tokens
        torch.testing.assert_close(torch.stack(got.logits), torch.stack(one.logits), rtol=1e-4, atol=1e-4)
    sent = run.sent
    assert sorted(sent) == list(range(world))
    engram = {"engram all-reduce"} if tp * cp > 1 else set()
    if ep == 1:
        assert set(sent[0]) == {"attention all-reduce", "logits all-gather"} | engram
    elif ep == tp * cp:
        assert set(sent[0]) == {"attention all-reduce", "ep all-reduce", "logits all-gather"} | engram | DIVIDED
    else:
        assert set(sent[0]) == {"ep dispatch all-gather", "ep combine reduce-scatter", "logits all-gather"}
    # every rank sends its vocabulary slice of each step's logits (float32): the whole vocabulary with a
    # group of one rank, else its block-padded share
    rows = {1: 288, 2: 160, 4: 96}[tp * cp]  # the tiny vocabulary: 288, 144 -> 160, 72 -> 96
    steps = run.stats.steps
    assert all(sent[r]["logits all-gather"] % (rows * 4) == 0 for r in range(world))
    batch = max(s["batch"] for s in m["buckets"]["shapes"])
    assert steps * rows * 4 <= sent[0]["logits all-gather"] <= steps * batch * 8 * rows * 4  # tokens <= 8
    if tp * cp > 1:  # the engram's float32 partial keys and value [B, T, (n+1)*D], the same on every rank
        engram = [sent[r]["engram all-reduce"] for r in range(world)]
        assert engram[0] > 0 and engram[0] % (5 * 256 * 4) == 0 and len(set(engram)) == 1
    if cp > 1:
        _check_divided_pools(m, run.pools, cp)


def test_a_token_budget_at_cp_ep_4_keeps_the_one_rank_tokens(started_ranks, one_rank_long):
    """--max-step-tokens at a divided layout (issue 41 item 4): a budget of 5 splits the prompts' 8-token
    chunks and mixes decode rows into prompt steps; every step is within it, the executor's real tokens
    are the scheduler's fed ones on the leader, and the tokens are the one-rank run's."""
    prompts = [*GOLDEN_PROMPTS, LONG]
    run = started_ranks(1, 4, 4).generate(prompts, RunOptions(max_new_tokens=NEW, max_step_tokens=5, threads=1))
    assert [r.tokens for r in run] == [r.tokens for r in one_rank_long]
    assert all(r.error is None for r in run)
    stats, steps = run.stats, run.steps
    assert stats is not None and steps is not None
    assert steps.largest <= 5 and stats.tokens == steps.fed and stats.steps == steps.steps
    assert steps.prompt == sum(len(p) for p in prompts) and set(stats.by_tokens) <= {1, 8}


def test_divided_rows_at_cp_ep_4_give_the_one_rank_tokens(rank_bundle, started_ranks, one_rank_long, tiny_ckpt):
    """[prompt] rows = "divided" (issue 41 item 2): each of the four ranks takes a quarter of every prompt
    chunk's rows (an 8-token chunk as two micro-batches of 4, regions/micro.py) through every layer (the attention as its `rows` twin's stages, the MoE dispatched over
    the ranks' rows), on the golden prompts and a prompt of 17 chunks; the tokens are the one-rank run's
    and the logits within 1e-4. The executor's row count is exactly the plan's: the attention's stages and
    the MoE's site and expand (`moe_in`, `moe_out`) and the engram's `rows_mix` a quarter of the chunk; a
    kv source's pooling (`rows_write`), the engram's `kv`, the MoE's experts (`moe_experts`: every row, a
    quarter of each expert's columns) and the head (every row's logits kept) every row. The MoE's
    dispatch sends a rank's rows' x and routing, its combine every row's D-wide float32 partial, the
    engram's reduce-scatter every row's float32 partial keys and value. Counted by the rows' work
    (`PromptRows.work`: the experts', the engram kv's and the head's rows at a rank's quarter of their
    columns), an execution does at most 0.3 of a chunk's tokens (bench/ranks.py's target)."""
    m = manifest(rank_bundle(1, 4, 4, "divided"))
    twins = {e["kind"] for e in m["regions"] if e["kind"].startswith("rows_")}
    assert twins and all(e["bucket"]["tokens"] in (4, 8) for e in m["regions"] if e["kind"] in twins)
    assert {(e["method"], e["bucket"]["batch"], e["bucket"]["tokens"]) for e in m["regions"] if e["kind"] == "moe"} == {
        ("decode", 1, 1),
        *(("decode", 1, T) for T in (4, 8)),
        *((method, 1, T) for method in ("moe_in", "moe_experts", "moe_out") for T in (4, 8)),
    }
    prompts = [*GOLDEN_PROMPTS, LONG]
    run = started_ranks(1, 4, 4, "divided").generate(
        prompts, RunOptions(max_new_tokens=NEW, keep_logits=True, threads=1)
    )
    for got, one in zip(run, one_rank_long, strict=True):
        assert got.error is None and got.tokens == one.tokens
        torch.testing.assert_close(torch.stack(got.logits), torch.stack(one.logits), rtol=1e-4, atol=1e-4)
    stats = run.stats
    assert stats is not None and stats.prompt.steps >= 17
    assert {"rows all-gather", "rows context all-gather", "ep dispatch all-gather"} <= set(run.sent[0])
    # an 8-token chunk runs as two micro-batches of 4 (regions/micro.py), a shorter one as one 4-token
    # pass: every pass has T = 4 rows and n = 1 a rank, and runs `moe_experts` once a layer
    layers = m["layers"]
    T, n, passes = 4, 1, stats.calls["moe.moe_experts"] // len(layers)
    assert stats.calls["moe.moe_experts"] == passes * len(layers)
    assert stats.prompt.steps < passes < 2 * stats.prompt.steps
    sources = sum(1 for lay in layers if lay["attn"] == "source")
    engrams = sum(1 for lay in layers if lay["engram"])
    # rows_in, rows_attend, moe_in, moe_experts, moe_out a layer; rows_write, the engram's kv and rows_mix, the head
    per_pass = [n, n, n, T, n] * len(layers) + [T] * sources + [T, n] * engrams + [T]
    assert stats.prompt.executions == stats.prompt.steps * len(per_pass)  # a call site once a step
    assert stats.prompt.rows == passes * sum(per_pass)
    assert stats.prompt.rows_over_chunk < 0.5  # 0.45 here (0.627 with the MoE's site and the engram's mix on every row)
    # the rows' work: the experts', the engram kv's and the head's rows at a rank's quarter of their columns
    work = [n, n, n, T / 4, n] * len(layers) + [T] * sources + [T / 4, n] * engrams + [T / 4]
    assert stats.prompt.work == pytest.approx(passes * sum(work))
    assert stats.prompt.share_over_chunk <= 0.3  # 0.296 here: a quarter of the chunk and the pooling's rows
    text = load_config(tiny_ckpt).text
    D, k = text.hidden_size, text.num_experts_per_tok
    for rank, sent in run.sent.items():  # every pass, every layer: a rank's rows out, every row back
        assert sent["ep dispatch all-gather"] == passes * len(layers) * n * (D * 4 + k * (4 + 8)), rank
        assert sent["ep combine reduce-scatter"] == passes * len(layers) * T * D * 4, rank
        kv = (text.hc_mult + 1) * D * 4  # a row's float32 keys and value
        assert sent["engram reduce-scatter"] == passes * engrams * T * kv, rank


def test_divided_rows_sample_from_each_sequences_last_row(rank_bundle, started_ranks, one_rank_long):
    """Divided rows with no request keeping every row's logits: the head (after the rows' gather) takes
    each sequence's last fed row, so every step's greedy pick all-gather (the run is greedy, no logits
    wanted: each rank's (value, index) pair a row, 8 bytes) carries one row a sequence (the T = 1
    bucket's), not the chunk's 4 or 8; the tokens are the one-rank run's."""
    m = manifest(rank_bundle(1, 4, 4, "divided"))
    prompts = [*GOLDEN_PROMPTS, LONG]
    run = started_ranks(1, 4, 4, "divided").generate(prompts, RunOptions(max_new_tokens=NEW, threads=1))
    assert all(r.error is None for r in run) and [r.tokens for r in run] == [r.tokens for r in one_rank_long]
    stats = run.stats
    batch = max(s["batch"] for s in m["buckets"]["shapes"])
    assert stats is not None and stats.prompt.steps >= 17
    assert "logits all-gather" not in run.sent[0]
    sent = run.sent[0]["greedy pick all-gather"]  # every row would send stats.padded rows
    spared = sum(steps * (T - 1) for T, (steps, _) in stats.by_tokens.items())  # a T-token step sends 1 row a sequence
    assert sent <= stats.steps * batch * 8 and sent <= (stats.padded - spared) * 8
    assert stats.prompt.share_over_chunk <= 0.3 < stats.prompt.rows_over_chunk  # 0.290 and 0.447 here


def _check_divided_pools(m: dict, pools: dict, cp: int) -> None:
    """Each rank allocated 1/cp of the token group's usable paged blocks and a scratch block, and every
    per-slot pool whole."""
    assert m["kv"]["divided"] == cp and any(p["dim"] == "blocks" for p in m["kv"]["pools"].values())
    for name, pool in m["kv"]["pools"].items():
        per_row = _row_bytes(pool)
        for rank, held in pools.items():  # what each rank allocated
            if pool["dim"] == "blocks":
                assert (held[name] // per_row - 1) * cp == m["kv"]["num_blocks"] - 1, (rank, name)
            else:
                assert held[name] == per_row * m["kv"]["slots"], (rank, name)


def _row_bytes(pool: dict) -> int:
    """Bytes of one block (or slot) row of a manifest pool over its layers."""
    return (
        len(pool["layers"])
        * math.prod(pool["entry_shape"])
        * torch.empty((), dtype=getattr(torch, pool["dtype"])).element_size()
    )


def test_a_multi_rank_bundle_needs_its_ranks(rank_bundle):
    from deepinfer.bundles.manifest import BundleError

    with pytest.raises(BundleError, match="2-rank bundle; run it with deepinfer-run"):
        load(rank_bundle(2, 1, 1))


def _plain(t: torch.Tensor) -> tuple:
    return str(t.dtype).removeprefix("torch."), tuple(t.shape), t.contiguous().view(torch.uint8).numpy().tobytes()


def _tensor(plain: tuple) -> torch.Tensor:
    dtype, shape, data = plain
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(getattr(torch, dtype)).view(shape)


def _collectives(rank: int, world: int, rendezvous: str, out) -> None:
    init(rank, world, rendezvous, timeout_s=60)
    try:
        comm = Comm(Topology(ep=world), rank, chunk_bytes=64)  # 16 floats a chunk: many chunks
        B, T, n, D = 2, 3, 4, 8
        gen = torch.Generator().manual_seed(rank)
        h = torch.randn(B, T, n, D, generator=gen).to(torch.bfloat16)
        pre = torch.rand(B, T, n, generator=gen)
        img = torch.rand(B, T, generator=gen) > 0.5
        hs, ps, imgs = comm.dispatch(h, pre, img)
        partial = torch.randn(world * B, T, n, D, generator=gen)
        summed = comm._reduce_scatter(partial)
        # as bytes: a tensor would travel as shared memory of a process that exits right after
        out.put((rank, *(_plain(t) for t in (h, pre, img, hs, ps, imgs, partial, summed)), dict(comm.sent)))
    finally:
        dist.destroy_process_group()


def _two_ranks(target, world: int, tmp_path) -> dict[int, list]:
    """Run `target(rank, world, rendezvous, queue)` in `world` spawned processes (bounded waits) -> each
    rank's tensors (as `_plain` sent them) and, last, its `Comm.sent`."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, world, str(tmp_path / "rendezvous"), out)) for r in range(world)]
    for p in procs:
        p.start()
    got = {item[0]: [_tensor(x) for x in item[1:-1]] + [item[-1]] for item in (out.get(timeout=120) for _ in procs)}
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    return got


def test_dispatch_and_combine_collectives(tmp_path):
    """Packed-byte dispatch returns every rank's rows exactly; the chunked reduce-scatter sums."""
    world = 2
    got = _two_ranks(_collectives, world, tmp_path)
    for r in range(world):
        h, pre, img, hs, ps, imgs, partial, summed, sent = got[r]
        for s in range(world):
            assert torch.equal(hs[s * 2 : (s + 1) * 2], got[s][0]) and hs.dtype == torch.bfloat16
            assert torch.equal(ps[s * 2 : (s + 1) * 2], got[s][1]) and torch.equal(imgs[s * 2 : (s + 1) * 2], got[s][2])
        want = sum(got[s][6][r * 2 : (r + 1) * 2] for s in range(world))
        torch.testing.assert_close(summed, want)
        row = h[0, 0].numel() * 2 + pre[0, 0].numel() * 4 + 1  # bytes of one packed row
        assert sent["ep dispatch all-gather"] == 2 * 3 * row
        assert sent["ep combine reduce-scatter"] == partial.numel() * 4


def _divided_collectives(rank: int, world: int, rendezvous: str, out) -> None:
    init(rank, world, rendezvous, timeout_s=60)
    try:
        comm = Comm(Topology(ep=world, cp=world), rank, chunk_bytes=64)  # one token group: a divided chunk's
        B, n, D, k = 2, 3, 8, 2  # a chunk of world x n rows, a rank's n
        gen = torch.Generator().manual_seed(rank)
        x = torch.randn(B, n, D, generator=gen).to(torch.bfloat16)
        weights = torch.rand(B, n, k, generator=gen)
        experts = torch.randint(0, 1 << 40, (B, n, k), generator=gen)  # int64: every byte of them travels
        xs, ws, es = comm.routes(x, weights, experts)
        partial = torch.randn(B, world * n, D, generator=gen)
        summed = comm.combine(partial)
        out.put((rank, *(_plain(t) for t in (x, weights, experts, xs, ws, es, partial, summed)), dict(comm.sent)))
    finally:
        dist.destroy_process_group()


def test_divided_routes_and_combine_collectives(tmp_path):
    """A divided prompt chunk's MoE collectives (regions/step.rows_steps): `routes` gives every rank the
    chunk's rows of x and routing in row order (rank j's rows j * n ...), exactly, from one all-gather of
    packed bytes; `combine` gives each rank its rows of the partials summed over the ranks, at B = 2."""
    world = 2
    got = _two_ranks(_divided_collectives, world, tmp_path)
    n = 3
    for r in range(world):
        x, weights, experts, xs, ws, es, partial, summed, sent = got[r]
        for i, whole in enumerate((xs, ws, es)):
            want = torch.cat([got[s][i] for s in range(world)], 1)
            assert whole.dtype == want.dtype and torch.equal(whole, want)
        want = sum(got[s][6][:, r * n : (r + 1) * n] for s in range(world))
        assert summed.shape == (2, n, 8)
        torch.testing.assert_close(summed, want)
        row = 8 * 2 + 2 * (4 + 8)  # bytes of one packed row: x bf16, k weights f32, k experts int64
        assert sent["ep dispatch all-gather"] == 2 * n * row
        assert sent["ep combine reduce-scatter"] == partial.numel() * 4


def _gather(rank: int, world: int, rendezvous: str, out) -> None:
    init(rank, world, rendezvous, timeout_s=60)
    try:
        got = {}
        for topo in (Topology(cp=world), Topology(ep=world)):  # one token group of two; two groups of one
            vocab = 50 if topo.group_size > 1 else 32
            rows = 32  # the rows a rank holds: 25 of 50 padded to a block; the whole 32 in a group of one
            full = torch.arange(topo.groups * 2 * 3 * vocab, dtype=torch.float32).view(topo.groups, 2, 3, vocab)
            mine = torch.full((2, 3, rows), float("nan"))  # [B, T, rows]: padding rows NaN, dropped
            start = rank % topo.group_size * rows
            piece = full[topo.group_of(rank), :, :, start : start + rows]
            mine[..., : piece.shape[-1]] = piece
            comm = Comm(topo, rank)
            gathered = comm.gather_logits(mine, vocab)
            got[topo.group_size] = ([_plain(g) for g in gathered], _plain(full), dict(comm.sent))
        out.put((rank, got))
    finally:
        dist.destroy_process_group()


def test_logits_gather_joins_each_groups_slices(tmp_path):
    """One all-gather: each token group's vocabulary slices side by side, in rank order, the padding
    rows dropped (NaN here: a kept one would show); every rank sends its slice once."""
    world, ctx = 2, mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_gather, args=(r, world, str(tmp_path / "rendezvous"), out)) for r in range(world)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    for rank in range(world):
        for size, (gathered, plain, sent) in got[rank].items():
            full = _tensor(plain)  # [groups, B, T, V]
            assert len(gathered) == full.shape[0] == world // size
            for g, logits in enumerate(gathered):
                assert torch.equal(_tensor(logits), full[g])
            assert sent == {"logits all-gather": 2 * 3 * 32 * 4}


def _greedy(rank: int, world: int, rendezvous: str, out) -> None:
    init(rank, world, rendezvous, timeout_s=60)
    try:
        got = {}
        for topo in (Topology(cp=world), Topology(ep=world)):  # one token group of two; two groups of one
            vocab = 50 if topo.group_size > 1 else 32
            rows = 32  # as `_gather`: 25 of 50 padded to a block; the whole 32 in a group of one
            gen = torch.Generator().manual_seed(7)  # the same logits on every rank: [groups, B, T, V]
            full = torch.randint(0, 3, (topo.groups, 2, 3, vocab), generator=gen).float()  # ties everywhere
            full[0, 1, 2, vocab - 1] = float("-inf")  # the last rank's real rows: the row is NaN
            mine = torch.full((2, 3, rows), 1e9)  # padding rows that would win if they were read
            start = rank % topo.group_size * rows
            piece = full[topo.group_of(rank), :, :, start : start + rows]
            mine[..., : piece.shape[-1]] = piece
            comm = Comm(topo, rank)
            chosen = comm.argmax_pairs(mine, vocab)
            got[topo.group_size] = (
                [(_plain(g.tokens), _plain(g.values)) for g in chosen],
                _plain(full),
                dict(comm.sent),
            )
        out.put((rank, got))
    finally:
        dist.destroy_process_group()


def test_greedy_pairs_give_each_groups_argmax(tmp_path):
    """`Comm.argmax_pairs`: one all-gather of each rank's (value, index) pair per row (8 bytes a row); every
    rank gets each token group's one-rank argmax (the lowest index among equal values, the padding rows
    never read) and its value, NaN for the row with an infinite logit (the leader's non-finite check)."""
    world, ctx = 2, mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_greedy, args=(r, world, str(tmp_path / "rendezvous"), out)) for r in range(world)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    for rank in range(world):
        for size, (chosen, plain, sent) in got[rank].items():
            full = _tensor(plain)  # [groups, B, T, V]
            assert len(chosen) == full.shape[0] == world // size
            for g, (tokens, values) in enumerate(chosen):
                bad = ~torch.isfinite(full[g]).all(-1)
                assert torch.equal(_tensor(tokens)[~bad], full[g].argmax(-1)[~bad])
                assert torch.equal(_tensor(values)[~bad], full[g].amax(-1)[~bad])
                assert bool(_tensor(values)[bad].isnan().all()) and bool(bad.any()) == (g == 0)
            assert sent == {"greedy pick all-gather": 2 * 3 * 8}


class _Proc:
    """A stand-in for a rank's process: only its exit code is read."""

    def __init__(self, exitcode):
        self.exitcode = exitcode


def test_a_rank_that_dies_without_a_result_ends_the_run():
    import queue as q

    from deepinfer.runtime.liveness import collect

    results = q.Queue()
    results.put({"rank": 1, "sent": {}})
    items = collect([_Proc(-9), _Proc(0)], results, timeout_s=60)  # rank 0 killed, no result
    assert items == [{"rank": 0, "error": "was killed by SIGKILL without a result"}]


def test_a_run_past_its_deadline_is_an_error_not_a_hang():
    import queue as q
    import time

    from deepinfer.runtime.liveness import collect

    start = time.monotonic()
    items = collect([_Proc(None), _Proc(None)], q.Queue(), timeout_s=0.5)  # alive, silent
    assert items == [{"rank": 0, "error": "no result in 0 s"}] and time.monotonic() - start < 10


def test_serve_leads_the_ranks(rank_bundle, one_rank):
    """deepinfer-serve on a 2-rank bundle (ep = 2: two token groups) starts its follower and gives the
    one-rank bundle's greedy tokens, requests one at a time and both at once."""
    from concurrent.futures import ThreadPoolExecutor

    import openai

    from deepinfer.regions.tokenizer import ByteTokenizer
    from deepinfer.runtime.serving.server_process import ServerProcess

    server = ServerProcess(rank_bundle(1, 2, 1), "--model-name", "tiny", "--threads", "1")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120, max_retries=0)

        def complete(ids):
            return client.completions.create(model="tiny", prompt=ids, max_tokens=NEW)

        with ThreadPoolExecutor(2) as pool:
            together = list(pool.map(complete, PROMPTS))
        for out in ([complete(p) for p in PROMPTS], together):
            for got, want in zip(out, one_rank):
                assert got.choices[0].text == ByteTokenizer().decode(want.generated)
                assert got.usage.completion_tokens == len(want.generated)
    finally:
        assert server.stop() == 0, server.proc.stderr.read()


def test_serve_logprobs_at_cp_ep_4_beside_greedy_requests(rank_bundle, one_rank):
    """deepinfer-serve on the cp = ep = 4 bundle: a request asking for logprobs, sent at once with plain
    greedy ones, gets the one-rank run's tokens and logprobs (the log-softmax of the one-rank logits,
    within 1e-4): a step holding it gathers the full logits, where the greedy requests' steps alone send
    (value, index) pairs (issue 42 item 2); every request gets the one-rank tokens."""
    from concurrent.futures import ThreadPoolExecutor

    import openai

    from deepinfer.regions.tokenizer import ByteTokenizer
    from deepinfer.runtime.serving.server_process import ServerProcess

    server = ServerProcess(rank_bundle(1, 4, 4), "--model-name", "tiny", "--threads", "1")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120, max_retries=0)

        def complete(ids, logprobs=None):
            return client.completions.create(model="tiny", prompt=ids, max_tokens=NEW, temperature=0, logprobs=logprobs)

        with ThreadPoolExecutor(3) as pool:
            asks = [
                pool.submit(complete, PROMPTS[0], 1),
                pool.submit(complete, PROMPTS[1]),
                pool.submit(complete, PROMPTS[0]),
            ]
            got = [a.result() for a in asks]
        for response, want in zip(got, [one_rank[0], one_rank[1], one_rank[0]]):
            assert response.choices[0].text == ByteTokenizer().decode(want.generated)
        one = one_rank[0]
        rows = torch.stack(one.logits).float().log_softmax(-1)  # row p: the position predicting token p + 1
        want = [float(rows[one.prompt_len - 1 + i, t]) for i, t in enumerate(one.generated)]
        logprobs = got[0].choices[0].logprobs
        assert logprobs is not None and logprobs.token_logprobs == pytest.approx(want, abs=1e-4)
        assert got[1].choices[0].logprobs is None
    finally:
        assert server.stop() == 0, server.proc.stderr.read()
