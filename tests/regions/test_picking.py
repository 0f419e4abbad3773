"""The draft's token choice per vocabulary slice (regions/picking.py, `DraftHead.pick`).

Each rank holds its slice of the block's logits (the target head's rows, the Markov head's same rows,
cut by `compiler.shard` as a bundle's are); the ranks' (value, index) pairs, merged at every position,
must give exactly the one-rank head's `tokens`: the highest score, the lowest index among equal scores,
never a padding row past the vocabulary. The ranks here are threads of this process, their all-gather
a barrier (bounded) over a shared list.
"""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from deepinfer.bundles.topology import Topology
from deepinfer.compiler.shard import shard
from deepinfer.regions.config import parse_config
from deepinfer.regions.dspark import DraftHead
from deepinfer.regions.picking import merge_best, merge_picks, pick_block, slice_best, slice_best_in_graph
from deepinfer.regions.tiny import tiny_config
from deepinfer.regions.topology import head_rows, head_slice

V, P = 100, 5  # a vocabulary that is no whole number of 32-row blocks
# one group of 3 ranks (the last holds padding only), of 4, and two groups of 2 ranks
LAYOUTS = {"cp=3": Topology(ep=3, cp=3), "cp=4": Topology(ep=4, cp=4), "2 groups of 2": Topology(ep=4, cp=2)}


@pytest.fixture(scope="module")
def c():
    return dataclasses.replace(parse_config(tiny_config()).text, vocab_size=V, dspark_block_size=P)


def whole_head(c, seed: int) -> DraftHead:
    """The one-rank draft head, float32, its Markov weights drawn."""
    head = DraftHead(c, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    head.markov_embed.copy_(torch.randn(head.markov_embed.shape, generator=gen))
    head.markov_head.copy_(torch.randn(head.markov_head.shape, generator=gen))
    return head


def rank_head(whole: DraftHead, c, topo: Topology, rank: int) -> DraftHead:
    """Rank `rank`'s draft head of `topo`, holding its shards of `whole`'s weights (`compiler.shard`)."""
    head = DraftHead(c, dtype=torch.float32, rows=head_rows(c, topo), group=topo.group_size, world=topo.world)
    for spec in head.specs:
        head._buffers[spec.name] = shard("dspark_head", spec.name, whole.w(spec.name), c, topo, rank, spec.buffer_shape)
    head.rank.fill_(rank)
    return head


def base_slice(base: torch.Tensor, c, topo: Topology, rank: int) -> torch.Tensor:
    """Rank `rank`'s rows of the target head's logits [B, P, V] -> [B, P, rows], zeros past the vocabulary
    (what a padded head row projects to)."""
    out = torch.zeros(*base.shape[:2], head_rows(c, topo))
    piece = head_slice(c, topo, rank)
    if piece is not None:
        out[..., : piece[1] - piece[0]] = base[..., piece[0] : piece[1]]
    return out


def run_ranks(whole: DraftHead, c, topo: Topology, bases: list[torch.Tensor], anchors: list[torch.Tensor]):
    """Every rank of `topo` choosing its group's block (group g: bases[g] [B, P, V], anchors[g] [B]) ->
    each rank's drafts [groups, B, P] and its `chain` logits [B, P, rows]."""
    world, B = topo.world, anchors[0].shape[0]
    box: list = [None] * world
    barrier = threading.Barrier(world, timeout=30)

    def rank_main(rank: int):
        group = topo.group_of(rank)
        head, base = rank_head(whole, c, topo, rank), base_slice(bases[group], c, topo, rank)

        def gather(value, index):
            box[rank] = (value, index)
            barrier.wait()
            values, indices = torch.stack([b[0] for b in box]), torch.stack([b[1] for b in box])
            barrier.wait()  # every rank read the box before the next position writes it
            return values, indices

        drafts = pick_block(lambda at, prev: head.pick(base, prev, at), anchors[group], P, gather, topo.groups, group)
        previous = torch.cat((anchors[group].unsqueeze(1), drafts[group, :, :-1]), 1)
        return drafts, head.chain(base, previous)

    with ThreadPoolExecutor(world) as pool:
        out = list(pool.map(rank_main, range(world)))
    assert all(d.shape == (topo.groups, B, P) for d, _ in out)
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_slices_choose_the_one_rank_tokens(c, layout, seed):
    """On random logits and Markov weights, every rank of every layout gets each group's one-rank `tokens`
    exactly, and its `chain` slices side by side are the one-rank logits each draft was the argmax of."""
    topo = LAYOUTS[layout]
    whole, gen = whole_head(c, seed), torch.Generator().manual_seed(100 + seed)
    bases = [torch.randn(3, P, V, generator=gen) * 4 for _ in range(topo.groups)]
    anchors = [torch.randint(0, V, (3,), generator=gen) for _ in range(topo.groups)]
    want = [whole.tokens(b, a) for b, a in zip(bases, anchors)]
    out = run_ranks(whole, c, topo, bases, anchors)
    for rank, (drafts, _) in enumerate(out):
        for g, (tokens, _logits) in enumerate(want):
            assert torch.equal(drafts[g], tokens), (layout, rank, g)
    for g, (_, logits) in enumerate(want):
        ranks = [r for r in range(topo.world) if topo.group_of(r) == g]
        joined = torch.cat([out[r][1] for r in ranks], -1)[..., :V]
        torch.testing.assert_close(joined, logits, rtol=1e-5, atol=1e-5)


def test_ties_across_slices_go_to_the_lowest_index(c):
    """Equal best scores on several ranks' slices: the lowest global index wins, as the one-rank argmax."""
    topo = LAYOUTS["cp=3"]  # rows 64: rank 0 holds [0, 64), rank 1 [64, 100), rank 2 padding only
    whole = whole_head(c, 0)
    whole.markov_head.zero_()  # no transition: the base alone scores
    base = torch.full((2, P, V), -1.0)
    base[0, :, [70, 90]] = 5.0  # both on rank 1: the lower
    base[1, :, [63, 64, 99]] = 5.0  # across ranks 0 and 1: rank 0's 63
    base[1, 2, 12] = 5.0  # and at position 2, a lower one on rank 0
    out = run_ranks(whole, c, topo, [base], [torch.tensor([1, 2])])
    want = torch.tensor([[70] * P, [63, 63, 12, 63, 63]])
    assert all(torch.equal(drafts[0], want) for drafts, _ in out)
    assert torch.equal(whole.tokens(base, torch.tensor([1, 2]))[0], want)


def test_padding_rows_never_win(c):
    """Every real score below the padding rows' zeros (a padded head row projects to 0): the winner is
    still inside the vocabulary, the one-rank argmax."""
    topo = LAYOUTS["cp=3"]  # rank 1 holds 28 padding rows, rank 2 only padding
    whole = whole_head(c, 1)
    gen = torch.Generator().manual_seed(5)
    base = -1000.0 - torch.rand(2, P, V, generator=gen)
    anchors = torch.tensor([0, V - 1])
    out = run_ranks(whole, c, topo, [base], [anchors])
    tokens, _ = whole.tokens(base, anchors)
    for drafts, _ in out:
        assert bool((drafts < V).all()) and torch.equal(drafts[0], tokens)


def test_merge_picks_takes_the_highest_then_the_lowest_index():
    """The merge alone: the highest value; among equal values the lowest index, whichever rank holds it;
    -inf picks (a rank of padding only) lose to any real value."""
    inf = float("-inf")
    values = torch.tensor([[1.0, 2.0, inf, 3.0], [1.0, 5.0, 0.5, 3.0], [0.5, 5.0, inf, 3.0]])
    index = torch.tensor([[9, 1, 200, 40], [3, 70, 80, 39], [150, 65, 290, 41]])
    assert merge_picks(values, index).tolist() == [3, 65, 80, 39]


# --- greedy verification: the target's step logits chosen per slice (`slice_best`, `merge_best`) ---


def greedy_slices(logits: torch.Tensor, c, topo: Topology, pad: float) -> list[torch.Tensor]:
    """Each rank of `topo`'s one token group's slice of step logits [B, T, V] -> [B, T, rows], the
    rows past the vocabulary `pad` (a padded head row; a value that would win if it were read)."""
    rows = head_rows(c, topo)
    out = []
    for rank in range(topo.group_size):
        mine = torch.full((*logits.shape[:-1], rows), pad)
        piece = head_slice(c, topo, rank)
        if piece is not None:
            mine[..., : piece[1] - piece[0]] = logits[..., piece[0] : piece[1]]
        out.append(mine)
    return out


def greedy_merge(logits: torch.Tensor, c, topo: Topology, pad: float = 1e30) -> tuple[torch.Tensor, torch.Tensor]:
    """Step logits [B, T, V] chosen per slice of `topo`'s token group, then merged -> (value, token) [B, T]."""
    rows = head_rows(c, topo)
    picks = [slice_best(s, rank * rows, c.vocab_size) for rank, s in enumerate(greedy_slices(logits, c, topo, pad))]
    return merge_best(torch.stack([v for v, _ in picks]), torch.stack([i for _, i in picks]))


@pytest.mark.parametrize("group", [1, 2, 3, 4])
@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_slices_merge_to_the_whole_argmax(c, group, seed):
    """Random step logits (and integer ones, full of ties) cut into a token group's slices: the merged
    pairs are torch.argmax of the whole row (its lowest index among equal values) and its maximum, the
    padding rows (which would win) never read."""
    topo = Topology(ep=group, cp=group)
    gen = torch.Generator().manual_seed(seed)
    for logits in (torch.randn(3, 6, V, generator=gen), torch.randint(0, 4, (3, 6, V), generator=gen).float()):
        value, token = greedy_merge(logits, c, topo)
        assert torch.equal(token, logits.argmax(-1))
        assert torch.equal(value, logits.amax(-1))


def test_greedy_ties_across_slices_go_to_the_lowest_index(c):
    """Equal maxima in several slices: the lowest global index wins, as the one-rank argmax; a row
    whose every logit is equal picks token 0."""
    topo = Topology(ep=4, cp=4)  # 32 rows a rank: [0, 32), [32, 64), [64, 96), [96, 100)
    logits = torch.zeros(1, 3, V)
    logits[0, 0, [40, 70, 97]] = 5.0  # ranks 1, 2 and 3 tie
    logits[0, 1, [99, 33]] = 2.0  # ranks 3 and 1 tie, the higher rank's index listed first
    value, token = greedy_merge(logits, c, topo)
    assert token.tolist() == [[40, 33, 0]] and value.tolist() == [[5.0, 2.0, 0.0]]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_greedy_nonfinite_anywhere_in_a_row_makes_its_value_nan(c, bad):
    """A non-finite logit anywhere in a row's real vocabulary (not its slice's best: the lowest logit of
    rank 2's slice) makes the merged value NaN for that row alone, so the scheduler's non-finite check
    fires as on the whole logits; non-finite padding rows past the vocabulary are not the row's."""
    topo = Topology(ep=4, cp=4)
    logits = torch.randn(2, 3, V, generator=torch.Generator().manual_seed(3))
    logits[1, 2, 70] = bad
    value, _ = greedy_merge(logits, c, topo, pad=float("nan"))
    assert torch.isnan(value[1, 2]) and bool(torch.isfinite(value.flatten()[:-1]).all())


def test_greedy_slice_past_the_vocabulary_never_wins(c):
    """A rank whose slice is padding only scores -inf at an index past the vocabulary, never NaN: it
    neither wins nor marks the row non-finite."""
    topo = Topology(ep=3, cp=3)  # 64 rows a rank: the third holds padding only
    assert head_slice(c, topo, 2) is None
    value, index = slice_best(torch.full((1, 2, 64), 9.0), 128, V)
    assert value.tolist() == [[float("-inf")] * 2] and bool((index >= V).all())
    logits = torch.full((1, 2, V), -3.0)
    logits[0, 1, 99] = -1.0
    value, token = greedy_merge(logits, c, topo)
    assert token.tolist() == [[0, 99]] and value.tolist() == [[-3.0, -1.0]]


@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("pad", [1e30, float("nan")])
def test_the_heads_graph_picks_as_the_host_does(c, group, pad):
    """`slice_best_in_graph` (the head's `best` on trn2: one graph for every rank, its first index a
    tensor) gives `slice_best`'s pairs on every rank's slice: random logits, ties, a non-finite logit
    in the vocabulary, padding rows that would win (or are NaN), a slice of padding only (group 3)."""
    topo = Topology(ep=group, cp=group)
    rows = head_rows(c, topo)
    gen = torch.Generator().manual_seed(group)
    tied = torch.randint(0, 3, (2, 3, V), generator=gen).float()
    broken = torch.randn(2, 3, V, generator=gen)
    broken[0, 1, 70], broken[1, 2, 5] = float("nan"), float("-inf")
    for logits in (torch.randn(2, 3, V, generator=gen), tied, broken):
        for rank, piece in enumerate(greedy_slices(logits, c, topo, pad)):
            want = slice_best(piece, rank * rows, V)
            got = slice_best_in_graph(piece, torch.tensor(rank * rows), V)
            assert torch.equal(got[1], want[1]), (rank, got[1], want[1])
            assert torch.equal(got[0].isnan(), want[0].isnan()) and torch.equal(
                got[0].nan_to_num(0.0), want[0].nan_to_num(0.0)
            ), rank


def test_the_heads_best_packs_its_slices_pairs(c):
    """`Head.best` on rank 1 of a token group of 4: its `decode` logits' `slice_best`, packed as
    float32 (value, index) [B, T, 2]."""
    from deepinfer.regions.examples import example_inputs, random_weights
    from deepinfer.regions.plan import make_head
    from deepinfer.regions.state import Geometry

    topo = Topology(ep=4, cp=4)
    head = make_head(c, torch.float32, topo)
    head = head.with_weights({**random_weights(head, 0), "rank": torch.tensor(1)})
    g = Geometry(slots=2, blocks=4, block_size=16, max_blocks=2)
    h, pre = example_inputs(head.input_specs(2, 3, g), g, seed=4)
    value, index = slice_best(head.decode(h, pre), head.rows, V)
    packed = head.best(h, pre)
    assert packed.shape == (2, 3, 2) and torch.equal(packed[..., 0], value)
    assert torch.equal(packed[..., 1].long(), index) and bool((index >= head.rows).all())
