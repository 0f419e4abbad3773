"""Greedy steps without logits (issue 42 item 2): where every request of a step is plainly greedy and
none needs the logits, the scheduler asks its stepper for the rows' choices alone (`greedy`), and a
stepper over several ranks gives `Greedy` tokens and values, chosen per vocabulary slice
(regions/picking.py). The double here cuts its logits into two slices as two ranks would, so the
scheduler's commit and verify paths run on the pairs: the tokens must be the logits' run's, a
non-finite logit must stop the sequence as before, and a request that needs the logits (sampling,
logprobs, --dump-logits, a grammar) must get them in every step it is part of."""

from __future__ import annotations

import zlib

import pytest
import torch

from deepinfer.regions.picking import merge_best, slice_best
from deepinfer.regions.speculative import AllAcceptedDraftDouble, OneRejectedDraftDouble
from deepinfer.regions.stepper import Allocator, Greedy
from deepinfer.runtime.requests import Request
from deepinfer.runtime.sampling import Sampling
from deepinfer.runtime.schedule import Scheduler, decode

V, SLICE, EOS = 8, 4, 7  # two slices of four tokens, as two ranks of a token group hold them
PROMPTS = [[1, 2, 3], [4, 5], [6, 1, 2, 3, 4, 5, 6, 1, 2]]


class Sliced:
    """A model double: each position's logits drawn from its sequence's tokens so far (integers in
    [0, 3): ties everywhere), each row's last only with `last_only`, NaN from step `bad` on; with `greedy`, the choices of two vocabulary
    slices merged as `Comm.argmax_pairs` merges the ranks' pairs. `picks` says whether it may give them."""

    groups, max_batch, chunk, slack = 1, 4, 8, 6

    def __init__(self, picks: bool = True, bad: int | None = None):
        self.picks, self.bad, self.flags = picks, bad, []

    def allocator(self):
        return Allocator(slots=8, blocks=64, block_size=4, max_blocks=16)

    def run(self, rows_by_group, allocs, histories, images, capture=None, last_only=False, greedy=False):
        self.flags.append(greedy)
        (rows,) = rows_by_group
        logits = torch.zeros(len(rows), max(len(ids) for _, ids, _ in rows), V)
        for b, (seq, ids, start) in enumerate(rows):
            for t in range(len(ids)):
                gen = torch.Generator().manual_seed(zlib.crc32(bytes(histories[seq][: start + t + 1])))
                logits[b, t] = torch.randint(0, 3, (V,), generator=gen).float()
        if last_only:  # each row's last fed position only, as a bundle's head runs it
            logits = torch.stack([logits[b, len(ids) - 1] for b, (_, ids, _) in enumerate(rows)]).unsqueeze(1)
        if self.bad is not None and len(self.flags) >= self.bad:
            logits[..., 6] = float("nan")  # never the slice's best: found by the slice's own check
        if not (greedy and self.picks):
            return [logits]
        pairs = [slice_best(logits[..., r * SLICE : (r + 1) * SLICE], r * SLICE, V) for r in range(V // SLICE)]
        value, token = merge_best(torch.stack([v for v, _ in pairs]), torch.stack([i for _, i in pairs]))
        return [Greedy(token, value)]


@pytest.fixture(scope="module")
def plain():
    """The run on the whole logits (the stepper never gives choices), every prompt batched."""
    return decode(Sliced(picks=False), PROMPTS, 12, eos=EOS, keep_logits=False)


def test_greedy_choices_give_the_logits_tokens(plain):
    """Batched, and speculative with drafts all accepted or one rejected each block: every step is
    greedy and runs on the pairs alone, and the tokens are the whole logits' run's."""
    for drafter in (None, AllAcceptedDraftDouble(plain, 5), OneRejectedDraftDouble(plain, 5, V, seed=2)):
        stepper = Sliced()
        got = decode(stepper, PROMPTS, 12, eos=EOS, keep_logits=False, drafter=drafter)
        assert [g.tokens for g in got] == [g.tokens for g in plain] and all(g.error is None for g in got)
        assert stepper.flags and all(stepper.flags)
        if drafter is not None:
            assert got.speculation.verify_steps > 0 and got.speculation.accepted > 0


def test_a_nonfinite_logit_stops_a_greedy_sequence():
    """A NaN that is no slice's best, in a step run on the pairs: the sequence stops with the step
    named, as with the whole logits (tests/test_nonfinite.py)."""
    for picks in (True, False):
        [g] = decode(Sliced(picks=picks, bad=3), [[1, 1]], 8, eos=EOS, keep_logits=False)
        assert len(g.generated) == 2, picks
        assert g.error == "non-finite logits (NaN or infinity) at position 3, step 3", picks


class Anything:
    """A grammar double: every token allowed, never complete."""

    grammars = property(lambda self: self)

    def masks(self, constraints):
        return torch.ones(len(constraints), V, dtype=torch.bool)

    def accept(self, token):
        return False

    def error(self):
        return None


NEEDS_LOGITS = {
    "sampling": dict(sampling=Sampling(temperature=0.8, seed=1)),
    "logit bias": dict(sampling=Sampling(logit_bias=((3, 1.0),))),
    "keep_logits": dict(keep_logits=True),
    "logprobs": dict(on_logits=lambda start, rows: None),
    "grammar": dict(constraint=Anything()),
}


@pytest.mark.parametrize("name", list(NEEDS_LOGITS))
def test_a_request_that_needs_logits_gets_them_in_its_steps(name):
    """A plain greedy request beside one that needs the logits: every step holding the latter gets
    the logits; once it ends (after 2 tokens), the greedy one's steps run on the pairs."""
    stepper = Sliced()
    scheduler = Scheduler(stepper, eos=-1)
    greedy = scheduler.add(Request([1, 2, 3], 8))
    needs = scheduler.add(Request([4, 5], 2, **NEEDS_LOGITS[name]))
    while scheduler.busy:
        scheduler.step()
    assert greedy.error is None and needs.error is None and len(needs.generated) == 2
    assert stepper.flags == [False, False] + [True] * 6
    if name == "keep_logits":
        assert len(needs.logits) == len(needs.tokens) - 1  # every fed position's row
