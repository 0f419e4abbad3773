"""Speculative decoding on the reference: output identical to plain greedy with every draft.

The drafts are the two test doubles of `regions/speculative.py` (all accepted; one position
corrupted at random, so acceptance stops at every offset of the block in turn) and the tiny
DSpark draft; each run alone and batched, on the golden prompts. A rejected draft restores
nothing: the per-slot rings have a block of slack (the rings themselves are checked at ratios
beyond the tiny model's), and no token runs through the target twice.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

from deepinfer.regions.attention import SourceAttention
from deepinfer.regions.reference import EagerSteps
from deepinfer.regions.speculative import AllAcceptedDraftDouble, OneRejectedDraftDouble
from deepinfer.regions.tokenizer import ByteTokenizer
from deepinfer.runtime.requests import SpeculationStats
from deepinfer.runtime.schedule import Scheduler, SpeculationError, decode, decode_model

from ..conftest import regenerate

TOK = ByteTokenizer()
PROMPTS = [TOK.encode(p) for p in regenerate.PROMPTS]
NEW = 16
BLOCK = 5


class Counting(EagerSteps):
    """The reference's stepper, recording each step's rows: (sequence, token ids, first position)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rows: list[list[tuple[int, list[int], int]]] = []

    @property
    def steps(self) -> int:
        return len(self.rows)

    def run(self, rows_by_group, *args, **kwargs):
        self.rows.append([(seq, list(ids), start) for seq, ids, start in rows_by_group[0]])
        return super().run(rows_by_group, *args, **kwargs)

    def fed(self, seq: int) -> list[tuple[list[int], int]]:
        """Sequence `seq`'s steps in order: (its token ids, the position of the first)."""
        return [(ids, start) for rows in self.rows for s, ids, start in rows if s == seq]


def speculative(model, prompts, drafter, new=NEW):
    st = Counting(model, prompts, new, max(BLOCK + 1, *map(len, prompts)), slack=BLOCK)  # prompts still one chunk
    return decode(st, prompts, new, eos=model.config.eos_token_id, drafter=drafter), st


def committed(ids: list[int], start: int, tokens: list[int]) -> int:
    """How many of a step's fed tokens are the sequence's own (its committed tokens and accepted drafts,
    the plain run's tokens): the rest were rejected drafts."""
    n = 0
    while n < len(ids) and start + n < len(tokens) and ids[n] == tokens[start + n]:
        n += 1
    return n


@pytest.mark.parametrize("batched", [False, True], ids=["alone", "batched"])
def test_doubles_leave_the_output_unchanged_and_feed_no_token_twice(ref_fp32, batched):
    """Plain greedy's output with both doubles. With rejections, no token runs through the target
    twice: each sequence's steps start at strictly increasing positions, each where the previous
    one's committed tokens (its unfed one and the accepted drafts) end, and every token but the last
    is fed once."""
    groups = [PROMPTS] if batched else [[p] for p in PROMPTS]
    for prompts in groups:
        plain = decode_model(ref_fp32, prompts, NEW)
        got, st = speculative(ref_fp32, prompts, AllAcceptedDraftDouble(plain, BLOCK))
        assert [g.tokens for g in got] == [g.tokens for g in plain]
        if not batched:  # one prompt step, then blocks of BLOCK + 1 tokens
            assert st.steps == 1 + -(-(NEW - 1) // (BLOCK + 1)), st.steps
        double = OneRejectedDraftDouble(plain, BLOCK, ref_fp32.config.text.vocab_size, seed=1)
        got, st = speculative(ref_fp32, prompts, double)
        assert [g.tokens for g in got] == [g.tokens for g in plain]
        assert got.speculation.drafted > got.speculation.accepted
        for seq, g in enumerate(got):
            steps = st.fed(seq)
            ends = [start + committed(ids, start, g.tokens) for ids, start in steps]
            assert [start for _, start in steps[1:]] == ends[:-1], (seq, steps)
            assert all(end > start for end, (_, start) in zip(ends, steps))
            assert ends[-1] == len(g.tokens) - 1
        if batched:  # seed 1 lands a rejection at every offset of the block
            assert all(double.offsets), double.offsets


def test_a_drafter_longer_than_the_slack_is_refused(ref_fp32):
    """Rings without room for a block of drafts (a bundle compiled without [speculative] draft) would
    lose state to a rejected draft: such a drafter is refused in one line naming both numbers."""
    st = EagerSteps(ref_fp32, PROMPTS[:1], NEW, None)
    assert st.slack == 0
    with pytest.raises(SpeculationError) as e:
        Scheduler(st, eos=ref_fp32.config.eos_token_id, drafter=AllAcceptedDraftDouble([], BLOCK))
    message = str(e.value)
    assert len(message.splitlines()) == 1 and "up to 5 tokens" in message and "room for 0" in message
    assert "[speculative] draft" in message
    Scheduler(EagerSteps(ref_fp32, PROMPTS[:1], NEW, None, slack=BLOCK), eos=0, drafter=AllAcceptedDraftDouble([], 5))


def test_after_a_rejection_the_next_step_carries_a_full_block(ref_fp32):
    """All drafts accepted but on one verify step (the third), where two of five are: every verify step
    commits block + 1 positions but that one, and the step right after it carries the bonus token and a
    full block of fresh drafts, all kept."""
    prompts, new, forced, a = PROMPTS[:1], 28, 2, 2  # 1 + 6 + 6 + 3 + 6 + 6 tokens generated
    plain = decode_model(ref_fp32, prompts, new)
    assert plain[0].finish_reason == "length"

    class RejectedOnce(AllAcceptedDraftDouble):
        """The plain continuation, with the verify step `forced`'s draft `a` replaced."""

        calls = 0

        def draft(self, requests):
            out = super().draft(requests)
            if self.calls == forced:
                out[0][a] = (out[0][a] + 1) % ref_fp32.config.text.vocab_size
            self.calls += 1
            return out

    got, st = speculative(ref_fp32, prompts, RejectedOnce(plain, BLOCK), new)
    assert got[0].tokens == plain[0].tokens
    verify = st.fed(0)[1:]  # after the prompt's step
    kept = [committed(ids, start, got[0].tokens) for ids, start in verify]
    assert [len(ids) for ids, _ in verify] == [BLOCK + 1] * 5
    assert kept == [BLOCK + 1, BLOCK + 1, 1 + a, BLOCK + 1, BLOCK + 1]
    s = got.speculation
    assert (s.verify_steps, s.drafted, s.accepted) == (5, 5 * BLOCK, 4 * BLOCK + a)
    assert s.accepted_per_step == pytest.approx((4 * BLOCK + a) / 5) and s.wasted_per_step == (BLOCK - a) / 5
    assert "tokens per step" in s.line() and "wasted" in s.line()


def test_slack_leaves_the_computation_unchanged(ref_fp32):
    """Rings with slack hold what rings without it do: the same logits, to the bit, prompts fed in
    chunks of 3 (the compressor's groups straddle steps), a long and a short golden prompt batched."""
    prompts, logits = PROMPTS[1:4:2], []
    for slack in (0, BLOCK):
        st = EagerSteps(ref_fp32, prompts, 4, 3, slack=slack)
        with torch.inference_mode():
            got = decode(st, prompts, 4, eos=ref_fp32.config.eos_token_id)
        logits.append([torch.stack(g.logits) for g in got])
    assert all(torch.equal(x, y) for x, y in zip(*logits))


def ring_steps(total: int, slack: int, seed: int) -> list[tuple[int, int, int]]:
    """A sequence's steps: (first position, positions fed, positions kept): a prompt chunk of 11, then
    verify steps of 1 + slack positions keeping a random prefix of at least one, up to `total`."""
    rng = random.Random(seed)
    steps, p = [(0, 11, 11)], 11
    while p < total:
        keep = rng.randint(1, 1 + slack)
        steps.append((p, 1 + slack, keep))
        p += keep
    return steps


@pytest.mark.parametrize("ratio", [2, 4, 16])
def test_rings_keep_what_a_rejected_step_overwrote(ref_fp32, ratio):
    """The window ring and the compressor's partial groups with `slack` rows beyond the window or
    ratio: verify steps of 1 + slack positions whose rejected positions see other inputs, then the
    next step from the first rejected one, nothing restored. Every kept position's window keys and
    every group completed by kept positions are those of one step over the kept inputs alone (groups
    of 4 and 16, beyond the tiny model's 2, so rejected positions cross into the next group)."""
    torch.manual_seed(ratio)
    source = next(r["attn"] for r in ref_fp32.layers if isinstance(r["attn"], SourceAttention) and r["attn"].ratio > 1)
    region = copy.copy(source)
    region.ratio = ratio  # the compressor's weights do not depend on it
    c, slack, total = ref_fp32.config.text, BLOCK, 120
    W, hd = region.window, region.hd
    slots = torch.tensor([1])
    x, kv = torch.randn(1, total + slack + 1, c.hidden_size), torch.randn(1, total + slack + 1, hd)

    def step(rings, x, kv, positions):
        win, part_kv, part_gate = rings
        keys, valid = region._window_keys(kv, positions, slots, win)
        return keys, valid, *region._compress(x, positions, slots, part_kv, part_gate)

    def rings(rows):
        return torch.zeros(2, W + rows, hd), torch.zeros(2, ratio + rows, hd), torch.zeros(2, ratio + rows, hd)

    with torch.inference_mode():
        every = torch.arange(total).unsqueeze(0)
        want_keys, want_valid, want_latent, want_t, want_complete = step(rings(0), x[:, :total], kv[:, :total], every)
        want = {int(t): want_latent[0, g] for g, t in enumerate(want_t[0]) if want_complete[0, g]}
        state, got = rings(slack), {}
        for start, fed, keep in ring_steps(total, slack, seed=ratio):
            xs, kvs = x[:, start : start + fed].clone(), kv[:, start : start + fed].clone()
            xs[:, keep:], kvs[:, keep:] = torch.randn_like(xs[:, keep:]), torch.randn_like(kvs[:, keep:])
            positions = torch.arange(start, start + fed).unsqueeze(0)
            keys, valid, latent, t, complete = step(state, xs, kvs, positions)
            for i in range(min(keep, total - start)):
                p = start + i
                assert torch.equal(valid[0, i], want_valid[0, p])
                assert torch.equal(keys[0, i][valid[0, i]], want_keys[0, p][want_valid[0, p]]), (start, fed, keep, i)
            for g, tg in enumerate(t[0].tolist()):
                if complete[0, g] and (tg + 1) * ratio <= min(start + keep, total):
                    got[tg] = latent[0, g]
    assert set(got) == {t for t in want if (t + 1) * ratio <= total}
    for t, latent in got.items():
        torch.testing.assert_close(latent, want[t], rtol=1e-5, atol=1e-5)


def test_tiny_dspark_draft_leaves_the_output_unchanged(ref_fp32):
    """The tiny checkpoint's own (random) DSpark draft, alone and batched: it accepts next to nothing,
    and every verify step is still the plain run's."""
    drafter = ref_fp32.dspark()
    total = SpeculationStats()
    for prompts in [[p] for p in PROMPTS] + [PROMPTS]:
        plain = decode_model(ref_fp32, prompts, NEW)
        got, _ = speculative(ref_fp32, prompts, drafter)
        assert [g.tokens for g in got] == [g.tokens for g in plain]
        s = got.speculation
        total.verify_steps, total.drafted, total.accepted = (
            total.verify_steps + s.verify_steps,
            total.drafted + s.drafted,
            total.accepted + s.accepted,
        )
    assert total.verify_steps > 0 and total.drafted > total.accepted


def test_reference_cli_speculative(tiny_ckpt, tmp_path):
    """`deepinfer reference --speculative dspark`: the plain run's tokens and a tokens-per-step line; a
    checkpoint without a draft is refused in one line, non-zero."""
    from click.testing import CliRunner

    from deepinfer.cli import main
    from deepinfer.regions.tiny import make_tiny

    args = ["reference", str(tiny_ckpt), "--prompt", "Hello", "--max-new-tokens", "8", "--dtype", "fp32", "--json"]
    plain = CliRunner().invoke(main, args)
    spec = CliRunner().invoke(main, args + ["--speculative", "dspark"])
    assert plain.exit_code == spec.exit_code == 0, spec.output
    assert spec.stdout == plain.stdout and "tokens per step" in spec.stderr
    nodraft = make_tiny(tmp_path / "nodraft", draft=False)
    r = CliRunner().invoke(main, ["reference", str(nodraft), "--prompt", "Hello", "--speculative", "dspark"])
    assert r.exit_code != 0 and "no DSpark draft" in r.output and len(r.output.strip().splitlines()) == 1
