"""Speculative decoding on the reference: output identical to plain greedy with every draft.

The drafts are the two test doubles of `regions/speculative.py` (all accepted; one position
corrupted at random, so acceptance stops at every offset of the block in turn) and the tiny
DSpark draft; each run alone and batched, on the golden prompts.
"""

from __future__ import annotations

import pytest

from deepinfer.regions.reference import EagerSteps
from deepinfer.regions.speculative import AllAcceptedDraftDouble, OneRejectedDraftDouble
from deepinfer.regions.tokenizer import ByteTokenizer
from deepinfer.runtime.schedule import SpeculationStats, decode, decode_model

from ..conftest import regenerate

TOK = ByteTokenizer()
PROMPTS = [TOK.encode(p) for p in regenerate.PROMPTS]
NEW = 16
BLOCK = 5


class Counting(EagerSteps):
    """The reference's stepper, counting its steps."""

    steps = 0

    def run(self, *args):
        self.steps += 1
        return super().run(*args)


class NoRollback(EagerSteps):
    """The reference's stepper with the rollback disabled: nothing is restored for rejected drafts."""

    def slot_states(self):
        return []


def speculative(model, prompts, drafter, stepper=Counting):
    st = stepper(model, prompts, NEW, max(BLOCK + 1, *map(len, prompts)))  # prompts still one chunk
    return decode(st, prompts, NEW, eos=model.config.eos_token_id, drafter=drafter), st


@pytest.mark.parametrize("batched", [False, True], ids=["alone", "batched"])
def test_doubles_leave_the_output_unchanged(ref_fp32, batched):
    groups = [PROMPTS] if batched else [[p] for p in PROMPTS]
    for prompts in groups:
        plain = decode_model(ref_fp32, prompts, NEW)
        got, st = speculative(ref_fp32, prompts, AllAcceptedDraftDouble(plain, BLOCK))
        assert [g.tokens for g in got] == [g.tokens for g in plain]
        if not batched:  # one prompt step, then blocks of BLOCK + 1 tokens
            assert st.steps == 1 + -(-(NEW - 1) // (BLOCK + 1)), st.steps
        double = OneRejectedDraftDouble(plain, BLOCK, ref_fp32.config.text.vocab_size, seed=1)
        got, _ = speculative(ref_fp32, prompts, double)
        assert [g.tokens for g in got] == [g.tokens for g in plain]
        if batched:  # seed 1 lands a rejection at every offset of the block (16, 2, 2, 3, 2)
            assert all(double.offsets), double.offsets


def test_rollback_is_what_keeps_the_output(ref_fp32):
    """Without restoring the per-slot state, rejected drafts leave their window-ring and partial-group
    writes behind and the output changes: the identity above depends on the rollback."""
    plain = decode_model(ref_fp32, PROMPTS, NEW)
    double = OneRejectedDraftDouble(plain, BLOCK, ref_fp32.config.text.vocab_size, seed=1)
    got, _ = speculative(ref_fp32, PROMPTS, double, stepper=NoRollback)
    assert [g.tokens for g in got] != [g.tokens for g in plain]


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
