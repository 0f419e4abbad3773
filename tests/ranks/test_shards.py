"""Ranks without processes: shards and partial outputs sum to the one-rank result.

Each rank's region is built for the topology and given that rank's weight
shards (compiler/shard.py); the partials its `decode` returns, summed over the
ranks in float32 (what the runtime's collectives do), must equal the one-rank
region's output within float32 rounding.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch

from deepinfer.bundles.topology import Topology
from deepinfer.compiler.plan import plan_regions
from deepinfer.compiler.shard import ROUTED, replicated, shard
from deepinfer.regions.checkpoint import Checkpoint, load_region
from deepinfer.regions.config import draft_moe_config, load_config
from deepinfer.regions.dspark import DraftAttention, DraftMoE
from deepinfer.regions.examples import example_inputs
from deepinfer.regions.moe import MoE
from deepinfer.regions.plan import make_attention
from deepinfer.regions.state import Geometry
from deepinfer.regions.step import plan_layers
from deepinfer.regions.topology import (
    check,
    expert_scale_blocks,
    expert_slice,
    expert_slice_width,
    head_rows,
    moe_form,
    shared_slice,
    shared_width,
)


@pytest.fixture(scope="module")
def text(tiny_ckpt):
    return load_config(tiny_ckpt).text


def ranked(full, make, kind: str, c, topo: Topology, rank: int):
    """`make()` built for `topo`, holding rank `rank`'s shards of `full`'s weights."""
    region = make()
    for spec in region.specs:
        part = shard(kind, spec.name, getattr(full, spec.name), c, topo, rank, spec.buffer_shape)
        getattr(region, spec.name).copy_(part)
    region.rank.fill_(rank)
    return region


@pytest.mark.parametrize(
    "tp, ep, cp, key, words",
    [
        (3, 1, 1, "tp", "must divide the attention heads"),
        (1, 2, 4, "ep", "must be 1 or the world size"),
        (2, 4, 1, "ep", "needs ep = tp * cp (one token group)"),
        (1, 4, 2, "ep", "use ep = cp"),
        (1, 16, 1, "ep", "does not divide the model's 8 routed experts"),
        (1, 1, 16, "cp", "16 ranks must divide the attention heads (8)"),
        (1, 8, 8, "cp", "split the indexer's 128 query rows"),
    ],
)
def test_topology_is_checked_against_the_model(text, tp, ep, cp, key, words):
    bad = check(Topology(tp=tp, ep=ep, cp=cp), text)
    assert bad is not None and bad[0] == key and words in bad[1]


@pytest.mark.parametrize("tp, ep, cp", [(2, 4, 2), (2, 1, 2), (1, 4, 4), (2, 8, 4), (1, 2, 2)])
def test_layouts_the_heads_divide_over_are_allowed(text, tp, ep, cp):
    """Expert parallel with tensor parallel attention where the EP group is one token group (ep = tp * cp)."""
    assert check(Topology(tp=tp, ep=ep, cp=cp), text) is None


def test_topology_layout():
    assert Topology(cp=2).to_dict() == {"tp": 1, "ep": 1, "cp": 2, "world_size": 2, "groups": 1}
    assert Topology(ep=4).groups == 4 and Topology(ep=4).dispatch
    assert Topology(cp=4, ep=4).groups == 1 and not Topology(cp=4, ep=4).dispatch


def test_one_rank_layout_for_config_planning_and_manifest():
    """tp/ep/cp are spelled once, by Topology: model.toml's [parallel] is parsed into it, and the
    manifest's Ranks records it: its degree fields are Topology's, its sizes Topology's, for every layout."""
    from deepinfer.bundles.manifest import Ranks
    from deepinfer.compiler.config import SECTIONS

    assert SECTIONS["parallel"] is Topology
    degrees = [f.name for f in dataclasses.fields(Topology)]
    fields = [f.name for f in dataclasses.fields(Ranks)]
    assert degrees == ["tp", "ep", "cp"] and fields[: len(degrees)] == degrees
    assert fields == [*Topology().to_dict(), "dispatch", "lnc"]  # the record: degrees, sizes, LNC
    for tp, ep, cp in itertools.product((1, 2, 4, 8), repeat=3):
        topo = Topology(tp=tp, ep=ep, cp=cp)
        ranks = Ranks.of(topo, lnc=2)
        assert ranks.topology == topo
        assert {k: getattr(ranks, k) for k in topo.to_dict()} == topo.to_dict()
        assert (ranks.world_size, ranks.groups, ranks.dispatch) == (topo.world, topo.groups, topo.dispatch)


@pytest.mark.parametrize("ep", [2, 4])
@pytest.mark.parametrize("batch, form", [(2, "tiled"), (1, "gathered")])
def test_ep_partials_sum_to_the_one_rank_moe(tiny_ckpt, text, ep, batch, form):
    """Every rank's slice of every expert: the partials sum to the one-rank MoE, in the tiled form
    (2 x 3 rows x top-2 over 8 experts) and the gathered one (3 rows: 6 slices gathered)."""
    full = MoE(text, dtype=torch.float32)
    load_region(Checkpoint(tiny_ckpt), full, "layers.1.")
    topo = Topology(ep=ep) if ep == 2 else Topology(cp=4, ep=4)
    assert moe_form(batch * 3, text.num_experts_per_tok, text.n_routed_experts) == form
    g = Geometry(slots=3, blocks=4, block_size=16, max_blocks=2)
    h, pre, is_image = example_inputs(full.input_specs(batch, 3, g), g, seed=3)
    is_image[0, 1] = True  # the image bias too
    want_h, want_pre = full.decode(h, pre, is_image)
    assert full.w1.shape[:2] == (text.n_routed_experts, text.moe_intermediate_size)
    parts = [
        ranked(full, lambda: MoE(text, dtype=torch.float32, topo=topo), "moe", text, topo, r).decode(h, pre, is_image)
        for r in range(topo.world)
    ]
    got = torch.stack([p[0] for p in parts]).sum(0)
    assert all(p[0].dtype == torch.float32 for p in parts)
    torch.testing.assert_close(got, want_h, rtol=1e-5, atol=1e-5)
    for p in parts:
        assert torch.equal(p[1], want_pre)
    assert not torch.equal(parts[0][0], parts[1][0])  # each rank really holds a share


def _random_fp4(region, names: tuple[str, ...], gen: torch.Generator) -> None:
    """Seeded fp4 codes (any byte) and ue8m0 scales near 1 in `region`'s buffers `names`."""
    for name in names:
        buf = getattr(region, name)
        lo, hi = (122, 130) if name.endswith("_s") else (0, 256)
        buf.copy_(torch.randint(lo, hi, buf.shape, generator=gen, dtype=torch.int32).to(torch.uint8))


@pytest.mark.parametrize("inter, world", [(96, 4), (100, 3), (96, 2), (64, 4), (2304, 64)])
def test_expert_slices_give_the_whole_experts(text, inter, world):
    """Any intermediate width over any rank count: each rank's slice of every routed expert (even width,
    zero-padded past the width; w2's scale blocks the slice spans, straddling ones included: 96 over 4
    ranks is 24 columns at offsets 0, 24, 48, 72, 2304 over 64 the release's 36 at every 4th column),
    in both forms: the ranks' partials sum to the one-rank experts'."""
    c = dataclasses.replace(text, moe_intermediate_size=inter, n_routed_experts=12)
    topo = Topology(ep=world)
    width, blocks = expert_slice_width(c, topo), expert_scale_blocks(c, topo)
    assert width % 2 == 0 and width * world >= inter and width * (world - 1) < inter
    assert blocks == (2 if inter in (96, 100, 2304) else 1)
    gen = torch.Generator().manual_seed(5)
    full = MoE(c, dtype=torch.float32)
    _random_fp4(full, ROUTED, gen)
    ranks = [ranked(full, lambda: MoE(c, dtype=torch.float32, topo=topo), "moe", c, topo, r) for r in range(world)]
    assert ranks[0].w1.shape == (12, width, c.hidden_size // 2) and ranks[0].w2_s.shape == (12, c.hidden_size, blocks)
    for rows in (2, 7):  # 4 slices gathered; 14 of 12 experts: tiled
        x = torch.randn(rows, c.hidden_size, generator=gen)
        experts = torch.stack([torch.randperm(12, generator=gen)[:2] for _ in range(rows)])
        weights = torch.rand(rows, 2, generator=gen)
        want = full.routed(x, weights, experts)
        total = sum(region.routed(x, weights, experts) for region in ranks)
        torch.testing.assert_close(total, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("inter, world", [(64, 2), (64, 4), (96, 4), (96, 3)])
def test_shared_expert_slices_give_the_unsliced_result(text, inter, world):
    """Any width over any rank count: slices of whole 32-blocks, zeros on the ranks left over."""
    c = dataclasses.replace(text, moe_intermediate_size=inter, n_routed_experts=world * 2)
    topo = Topology(ep=world)
    gen = torch.Generator().manual_seed(0)
    full = MoE(c, dtype=torch.float32)
    for spec in full.specs:
        if spec.name.startswith("sw"):
            buf = getattr(full, spec.name)
            buf.copy_(
                torch.randint(100, 140, buf.shape, generator=gen, dtype=torch.uint8)
                if spec.name.endswith("_s")
                else torch.randint(0, 0x7F, buf.shape, generator=gen, dtype=torch.uint8)
                | (torch.randint(0, 2, buf.shape, generator=gen, dtype=torch.uint8) << 7)
            )  # no NaN codes
    x = torch.randn(5, c.hidden_size, generator=gen)
    width = shared_width(c, topo)
    assert width % 32 == 0 and width * world >= inter
    holders = [r for r in range(world) if shared_slice(c, topo, r) is not None]
    assert holders == list(range(-(-inter // width)))
    total = sum(
        ranked(full, lambda: MoE(c, dtype=torch.float32, topo=topo), "moe", c, topo, r).shared(x).float()
        for r in range(world)
    )
    torch.testing.assert_close(total, full.shared(x).float(), rtol=1e-5, atol=1e-4)


HEAD_SPLIT = {  # (attention kind, tp, cp): the head-split output (decode) over the token group
    "source-tp=2": ("source", 2, 1),  # d <= G: whole groups
    "window-tp=2xcp=2": ("window", 2, 2),  # d > G: each rank one group's rows, its heads' columns
    "window-cp=4": ("window", 1, 4),
    "window-cp=2": ("window", 1, 2),
}


@pytest.mark.parametrize("name", list(HEAD_SPLIT))
def test_tp_partials_sum_to_the_one_rank_attention(tiny_ckpt, text, name):
    """Heads over the token group (j = t * cp + c): each rank's decode gives a float32 partial of the
    streams; summed over the tp * cp ranks they are the one-rank output. A selecting layer's selection
    is every rank's (its indexer is whole at cp = 1)."""
    attn, tp, cp = HEAD_SPLIT[name]
    plan = next(p for p in plan_layers(text) if p.attn == attn and (p.ratio == 2 or attn == "window"))
    full = make_attention(text, plan, torch.float32, True)
    load_region(Checkpoint(tiny_ckpt), full, f"layers.{plan.layer}.")
    topo = Topology(tp=tp, cp=cp)
    assert check(topo, text) is None
    g = Geometry(slots=3, blocks=6, block_size=16, max_blocks=2)
    args = example_inputs(full.input_specs(2, 3, g), g, seed=5)
    want = full.decode(*[a.clone() for a in args])
    parts = []
    for r in range(topo.world):
        region = ranked(full, lambda: make_attention(text, plan, torch.float32, True, topo), full.kind, text, topo, r)
        assert region.methods() == ("decode",) and region.heads == text.num_attention_heads // (tp * cp)
        parts.append(region.decode(*[a.clone() for a in args]))
    assert all(p[0].dtype == torch.float32 for p in parts)
    torch.testing.assert_close(torch.stack([p[0] for p in parts]).sum(0), want[0].float(), rtol=1e-5, atol=1e-5)
    for p in parts:
        assert torch.equal(p[1], want[1]) and all(torch.equal(a, b) for a, b in zip(p[2:], want[2:]))
    assert not torch.equal(parts[0][0], parts[1][0])  # each rank really holds a share


@pytest.mark.parametrize("tp, cp", [(1, 4), (2, 2), (1, 2)])
def test_row_split_output_sums_to_the_one_rank_output(tiny_ckpt, text, tp, cp):
    """The staged kinds' output: each rank's whole 32-blocks of its tp share's wo_a rows (zeros past the
    share) and those wo_b columns over the merged attention of its tp share's heads; the partial
    streams summed over the token group are the one-rank output projection's."""
    plan = next(p for p in plan_layers(text) if p.attn == "source" and p.ratio == 2)
    full = make_attention(text, plan, torch.float32, True)
    load_region(Checkpoint(tiny_ckpt), full, f"layers.{plan.layer}.")
    topo = Topology(tp=tp, cp=cp)
    assert check(topo, text) is None
    g = Geometry(slots=3, blocks=6, block_size=16, max_blocks=2)
    h, pre, positions = example_inputs(full.input_specs(2, 3, g), g, seed=5)[:3]
    gen = torch.Generator().manual_seed(2)
    H, hd = text.num_attention_heads, text.head_dim
    attention = torch.randn(2, 3, H, hd, generator=gen)
    _, mix = full._site_input(h, pre)
    want = full._finish(full._out_project(attention, full._angles(positions)), h, mix)
    parts, zeros = [], 0
    for r in range(topo.world):
        region = ranked(full, lambda: make_attention(text, plan, torch.float32, True, topo), full.kind, text, topo, r)
        assert region.share.staged and region.methods()[0] == "query" and region.heads == H // tp
        t = r % tp
        zeros += not region.wo_b.any()
        share = attention[:, :, t * H // tp : (t + 1) * H // tp]
        parts.append(region.output(h, *mix, positions, share))
    assert zeros == (0 if cp == 2 and tp == 1 else 2)  # rr = 32: cp ranks past their tp share hold zeros
    torch.testing.assert_close(torch.stack([p[0] for p in parts]).sum(0), want[0].float(), rtol=1e-5, atol=1e-5)
    assert all(torch.equal(p[1], want[1]) for p in parts)


HEAD_SPLITS = [  # (tp, ep, cp), vocabulary -> rows a rank holds
    ((1, 1, 2), 288, 160),  # 144 a rank, padded to 5 blocks
    ((1, 4, 4), 288, 96),  # 72 a rank -> 96: the last rank holds padding only
    ((2, 1, 2), 1000, 256),  # tp and cp together: the token group is tp * cp
    ((1, 1, 3), 1000, 352),  # a group of three: 334 -> 352
    ((1, 2, 1), 1000, 1000),  # ep dispatch, cp = 1: groups of one rank hold the whole head, unpadded
    ((1, 64, 64), 129280, 2048),  # the release: 2,020 -> 2,048, 1,792 rows of padding on rank 63
]


@pytest.mark.parametrize("layout, vocab, rows", HEAD_SPLITS, ids=[f"{t}-V{v}" for t, v, _ in HEAD_SPLITS])
def test_head_rows_are_split_over_the_token_group(text, layout, vocab, rows):
    """Each rank of a token group holds its block-padded rows of the vocabulary in rank order, zeros
    past the vocabulary; a group's shards side by side, the padding dropped, are the whole head."""
    from deepinfer.compiler.shard import WHOLE, ZERO, Cut, cut
    from deepinfer.regions.topology import head_rows, head_slice

    tp, ep, cp = layout
    topo = Topology(tp=tp, ep=ep, cp=cp)
    c = dataclasses.replace(text, vocab_size=vocab, hidden_size=4)
    assert head_rows(c, topo) == rows and (rows % 32 == 0 or topo.group_size == 1)
    full = torch.arange(vocab * 4, dtype=torch.float32).view(vocab, 4) + 1  # no zero row
    for group in range(topo.groups):
        ranks = range(group * topo.group_size, (group + 1) * topo.group_size)
        shards = [shard("head", "head", full, c, topo, r, (rows, 4)) for r in ranks]
        assert all(s.shape == (rows, 4) for s in shards)
        whole = torch.cat(shards)  # [group * rows, D]
        assert torch.equal(whole[:vocab], full) and not whole[vocab:].any()
        for r in ranks:  # streamed by the weight pass: the rows of the vocabulary, or nothing
            piece = head_slice(c, topo, r)
            want = WHOLE if topo.group_size == 1 else ZERO if piece is None else Cut(rows=piece)
            assert cut("head", "head", c, topo, r) == want
        assert cut("head", "norm", c, topo, ranks[0]).whole  # the norm is replicated
    if vocab == 129280:  # the release: 40 MiB of float32 head a rank, not 2.47 GiB
        assert rows * 5120 * 4 == 40 << 20 and head_slice(c, topo, 63) == (63 * 2048, vocab)


@pytest.mark.parametrize("layout", [(1, 1, 2), (1, 4, 4), (2, 1, 2)])
def test_head_slices_are_the_one_rank_logits(tiny_ckpt, text, layout):
    """Each rank's head computes its vocabulary slice of the one-rank logits (its padding rows give
    zeros); the group's slices side by side, the padding dropped, are the one-rank logits."""
    from deepinfer.regions.plan import make_head

    tp, ep, cp = layout
    topo = Topology(tp=tp, ep=ep, cp=cp)
    full = make_head(text, torch.float32)
    load_region(Checkpoint(tiny_ckpt), full, "")
    g = Geometry(slots=3, blocks=4, block_size=16, max_blocks=2)
    h, pre = example_inputs(full.input_specs(2, 3, g), g, seed=7)
    want = full.decode(h, pre)  # [B, T, V]
    parts = [
        ranked(full, lambda: make_head(text, torch.float32, topo), "head", text, topo, r) for r in range(topo.world)
    ]
    assert all(p.head.shape[0] < text.vocab_size for p in parts)
    got = torch.cat([p.decode(h, pre) for p in parts], -1)  # [B, T, world * rows]
    torch.testing.assert_close(got[..., : text.vocab_size], want, rtol=1e-5, atol=1e-5)
    assert not got[..., text.vocab_size :].any()


# --- the DSpark draft, laid out as the target (issue 30) -------------------------------------------

DRAFT_LAYOUTS = {
    "ep=cp=2": Topology(ep=2, cp=2),
    "ep=cp=4": Topology(ep=4, cp=4),
    "tp=2": Topology(tp=2),
    "ep=2": Topology(ep=2),
    "tp=2xcp=2,ep=4": Topology(tp=2, ep=4, cp=2),  # the heads over each cp rank's tp group
}
TP_ROWS = ("wq_b", "wq_b_s", "wo_a", "wo_a_s", "sink")  # split by rows over the tp ranks (MODEL.md's shapes)


def _pieces_joined(parts: list[torch.Tensor], dim: int, length: int) -> torch.Tensor:
    """The ranks' parts joined along `dim`; what lies past `length` must be zero padding."""
    joined = torch.cat(parts, dim)
    assert not joined.narrow(dim, length, joined.shape[dim] - length).any(), "only zeros past the tensor"
    return joined.narrow(dim, 0, length)


def _check_expert_slices(name: str, parts: list, whole: torch.Tensor, c, topo: Topology) -> None:
    """Each rank's part of a routed stack [E, ...] is its intermediate slice of every expert: w1, w3 (and
    their per-row scales) its rows, w2 its byte columns, w2's scales the 32-blocks its columns span;
    zeros past them. The w1, w3, w2 slices joined over the ranks are the whole stack."""
    I = c.moe_intermediate_size
    for r, p in enumerate(parts):
        piece = expert_slice(c, topo, r)
        if piece is None:
            assert not p.any(), (name, r)
            continue
        a, b = piece
        dim, (lo, hi) = (1, piece) if name.startswith(("w1", "w3")) else (2, (a // 2, b // 2))
        if name == "w2_s":
            lo, hi = a // 32, -(-b // 32)
        assert torch.equal(p.narrow(dim, 0, hi - lo), whole.narrow(dim, lo, hi - lo)), (name, r)
        assert not p.narrow(dim, hi - lo, p.shape[dim] - (hi - lo)).any(), (name, r)  # zero padding
    if name != "w2_s":
        dim, length = (1, I) if name.startswith(("w1", "w3")) else (2, I // 2)
        assert torch.equal(_pieces_joined(parts, dim, length), whole), name


@pytest.mark.parametrize("topo", DRAFT_LAYOUTS.values(), ids=DRAFT_LAYOUTS)
def test_draft_regions_hold_the_shards_of_the_target_layout(text, topo):
    """Compile-free (meta weights): the draft planned for one rank of `topo` holds, for every weight,
    exactly the shape of its rank's shard of the whole tensor (`shard` checks it), and those shards
    divide the whole as the target's layers do: a slice of every one of the draft's own routed experts
    on each rank (its intermediate columns, `expert_slice`), the shared expert's intermediate in whole slices with zeros past it,
    the attention's heads and output groups over the token group as the target's window attention's
    (the same shapes), the Markov head's output rows over the token group as
    the target head's vocabulary; context projection and the other heads' weights whole everywhere."""
    plan = plan_regions(text, torch.float32, True, topo, draft=True)
    assert {"dspark_context", "dspark_attn", "dspark_moe", "dspark_head"} <= set(plan.draft_kinds)
    window_specs = plan.kinds["attn_window"].region.specs
    E, I = text.dspark_n_routed_experts, text.moe_intermediate_size
    assert E != text.n_routed_experts  # the tiny draft's 4 experts, not the target's 8
    for kind in plan.draft_kinds:
        kp = plan.kinds[kind]
        assert kp.source == "mtp.{}."
        for s, full in zip(kp.region.specs, kp.full_specs, strict=True):
            assert (s.name, s.key) == (full.name, full.key)
            whole = torch.arange(math.prod(full.buffer_shape), dtype=torch.int64).view(full.buffer_shape) + 1
            parts = [shard(kind, s.name, whole, text, topo, r, s.buffer_shape) for r in range(topo.world)]
            assert all(tuple(p.shape) == s.buffer_shape for p in parts), (kind, s.name)
            divided = not replicated(kind, s.name, text, topo)
            if kind == "dspark_moe" and topo.ep > 1 and s.name in ROUTED:  # every expert, sliced
                assert s.buffer_shape[0] == E and divided
                _check_expert_slices(s.name, parts, whole, draft_moe_config(text), topo)
            elif kind == "dspark_moe" and topo.ep > 1 and s.name.startswith("sw"):
                dim = 1 if s.name.startswith("sw2") else 0  # sw1, sw3 [I, D]: rows; sw2 [D, I]: columns
                length = I if not s.name.endswith("_s") else I // 32
                assert torch.equal(_pieces_joined(parts, dim, length), whole) and divided, s.name
            elif kind == "dspark_attn" and topo.group_size > 1 and s.name.startswith(TP_ROWS + ("wo_b",)):
                window = {w.name: w for w in window_specs}[s.name]  # the target's window attention's share
                assert divided and s.buffer_shape == window.buffer_shape, s.name
                assert len({p.sum().item() for p in parts[: topo.group_size]}) > 1, s.name  # its own heads
            elif kind == "dspark_head" and s.name == "markov_head" and topo.group_size > 1:
                rows = head_rows(text, topo)  # the target head's vocabulary rows, zeros past the vocabulary
                assert s.buffer_shape == (rows, full.buffer_shape[1]) and divided
                assert torch.equal(torch.cat(parts)[: text.vocab_size], whole)
                assert not torch.cat(parts)[text.vocab_size :].any()
            else:  # replicated: stored once, the whole tensor on every rank
                assert not divided and s.buffer_shape == full.buffer_shape, (kind, s.name)
                assert all(torch.equal(p, whole) for p in parts), (kind, s.name)
    heads = plan.kinds["dspark_attn"].region
    assert (heads.heads, heads.tp, heads.cp) == (text.num_attention_heads // topo.group_size, topo.tp, topo.cp)


@pytest.mark.parametrize(
    "topo",
    [Topology(ep=2, cp=2), Topology(ep=4, cp=4), Topology(tp=2, ep=4, cp=2)],
    ids=["ep=cp=2", "ep=cp=4", "tp=2xcp=2,ep=4"],
)
def test_draft_moe_partials_sum_to_the_one_rank_draft_moe(tiny_ckpt, text, topo):
    """The draft's MoE (its own experts, `mtp.1.`) divided over ep = tp * cp ranks (one token group): the
    ranks' float32 partials sum to the one-rank draft MoE (the runtime all-reduces them over the token group)."""
    c = draft_moe_config(text)
    full = DraftMoE(c, dtype=torch.float32)
    load_region(Checkpoint(tiny_ckpt), full, "mtp.1.")
    g = Geometry(slots=3, blocks=4, block_size=16, max_blocks=2)
    h, pre, is_image = example_inputs(full.input_specs(2, text.dspark_block_size, g), g, seed=7)
    want_h, want_pre = full.decode(h, pre, is_image)
    parts = [
        ranked(full, lambda: DraftMoE(c, dtype=torch.float32, topo=topo), "dspark_moe", text, topo, r).decode(
            h, pre, is_image
        )
        for r in range(topo.world)
    ]
    assert all(p[0].dtype == torch.float32 for p in parts)
    torch.testing.assert_close(torch.stack([p[0] for p in parts]).sum(0), want_h, rtol=1e-5, atol=1e-5)
    assert all(torch.equal(p[1], want_pre) for p in parts)
    assert not torch.equal(parts[0][0], parts[1][0])  # each rank really holds a share


@pytest.mark.parametrize(
    "topo",
    [Topology(tp=2), Topology(tp=2, ep=4, cp=2), Topology(ep=4, cp=4)],
    ids=["tp=2", "tp=2xcp=2,ep=4", "ep=cp=4"],
)
def test_draft_attention_partials_sum_to_the_one_rank_draft_attention(tiny_ckpt, text, topo):
    """The draft's attention (`mtp.0.`) with its heads over the token group, as the target's window
    attention's: the group's partials sum to the one-rank output (the runtime all-reduces them over the
    token group); the context is whole on every rank (the draft's own window, not the paged state)."""
    full = DraftAttention(text, dtype=torch.float32, cache_quant=True)
    load_region(Checkpoint(tiny_ckpt), full, "mtp.0.")
    g = Geometry(slots=3, blocks=4, block_size=16, max_blocks=2)
    specs = full.input_specs(2, text.dspark_block_size, g)
    args = example_inputs(specs, g, seed=9)
    names = [s.name for s in specs]
    if "context_positions" in names:  # the window before the anchor, every position valid
        i = names.index("context_positions")
        args[i] = torch.arange(args[i].shape[-1]).expand_as(args[i]).clone()
    want = full.decode(*[a.clone() for a in args])
    parts = []
    for r in range(topo.world):
        make = lambda: DraftAttention(text, dtype=torch.float32, cache_quant=True, topo=topo)  # noqa: E731
        region = ranked(full, make, "dspark_attn", text, topo, r)
        assert region.heads == text.num_attention_heads // topo.group_size
        parts.append(region.decode(*[a.clone() for a in args]))
    for group in topo.token_groups():  # each the residual once (its first rank) and its heads' share
        got = torch.stack([parts[r][0] for r in group]).sum(0)
        torch.testing.assert_close(got, want[0], rtol=1e-5, atol=1e-5)
        assert not torch.equal(parts[group[0]][0], parts[group[1]][0])
    assert all(torch.equal(p[1], want[1]) for p in parts)


@pytest.mark.parametrize("tp, ep, cp, words", [(2, 8, 4, "does not divide the DSpark draft's 4 routed experts")])
def test_topology_is_checked_against_the_draft(text, tp, ep, cp, words):
    """With a draft, a layout the target divides but the draft does not is refused (at ep)."""
    topo = Topology(tp=tp, ep=ep, cp=cp)
    assert check(topo, text) is None
    bad = check(topo, text, draft=True)
    assert bad is not None and bad[0] == "ep" and words in bad[1]
    for ok in DRAFT_LAYOUTS.values():
        assert check(ok, text, draft=True) is None
