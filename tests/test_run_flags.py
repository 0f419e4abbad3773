"""Run-time flags are checked before any work, and a sequence that stops early keeps its output
and says why in its own terms (issue 16, class 9)."""

from __future__ import annotations

import json
import subprocess
import sys

import click
import pytest
import torch
from click.testing import CliRunner

from deepinfer.cli import main as deepinfer_main
from deepinfer.cli_common import echo_generations
from deepinfer.regions.stepper import Allocator
from deepinfer.runtime.cli import main as run_main
from deepinfer.runtime.schedule import decode


class FixedStepper:
    """A test double of a model: always predicts token 5; a context of 8 positions (2 blocks of 4);
    room in its (absent) rings for verify steps of 5 drafts."""

    groups, max_batch, slack = 1, 1, 5

    def __init__(self, chunk: int):
        self.chunk = chunk

    def allocator(self):
        return Allocator(slots=2, blocks=10, block_size=4, max_blocks=2)

    def run(self, rows_by_group, allocs, histories, images, capture=None, last_only=False, greedy=False):
        (rows,) = rows_by_group
        T = max(len(ids) for _, ids, _ in rows)
        logits = torch.zeros((len(rows), T, 8))
        logits[..., 5] = 1.0
        return [logits]


@pytest.mark.parametrize("prompt, new", [(3, 10), (6, 10), (1, 3)])
def test_speculation_stops_where_plain_decoding_does(prompt, new):
    """Drafts never reach past max_context or the token budget: with every draft accepted, the same
    tokens and the same error as the plain run (8 positions of context)."""
    from deepinfer.regions.speculative import AllAcceptedDraftDouble

    plain = decode(FixedStepper(chunk=6), [[1] * prompt], max_new_tokens=new, eos=7)
    drafter = AllAcceptedDraftDouble(plain, block=5)
    got = decode(FixedStepper(chunk=6), [[1] * prompt], max_new_tokens=new, eos=7, drafter=drafter)
    [g] = got
    assert (g.tokens, g.error) == (plain[0].tokens, plain[0].error)
    assert got.speculation.drafted > 0 and got.speculation.accepted == got.speculation.drafted


def test_reaching_max_context_keeps_what_was_generated():
    [g] = decode(FixedStepper(chunk=4), [[1] * 6], max_new_tokens=10, eos=7)
    assert g.generated == [5, 5, 5]
    assert g.error == "reached the bundle's max_context (8 positions: a prompt of 6 tokens and 3 generated)"


def test_a_prompt_longer_than_the_context_is_counted_whole():
    [g] = decode(FixedStepper(chunk=3), [[1] * 10], max_new_tokens=4, eos=7)
    assert g.generated == []
    assert g.error == "the prompt has 10 tokens, more than the bundle's max_context (8)"


def test_text_mode_prints_the_output_then_the_reason():
    gens = decode(FixedStepper(chunk=4), [[1] * 6, [1] * 2], max_new_tokens=2, eos=7)
    gens[0] = decode(FixedStepper(chunk=4), [[1] * 6], max_new_tokens=10, eos=7)[0]

    @click.command()
    def show():
        echo_generations(gens, lambda ids: " ".join(map(str, ids)))

    r = CliRunner().invoke(show)
    assert r.exit_code == 1
    assert r.stdout.splitlines() == ["5 5 5", "5 5"]
    assert r.stderr.splitlines() == [
        "error: prompt 0: stopped after 3 generated tokens: reached the bundle's "
        "max_context (8 positions: a prompt of 6 tokens and 3 generated)"
    ]


def _usage_error(cli, args):
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 2, r.output
    return r.output


def test_bad_counts_are_refused_at_parse_time(tmp_path, tiny_ckpt):
    assert "-5 is not in the range x>=1" in _usage_error(
        deepinfer_main, ["reference", str(tiny_ckpt), "--prompt-ids", "0,72", "--max-new-tokens", "-5"]
    )
    for flag, value in (("--threads", "-1"), ("--num-kv-blocks", "0"), ("--num-kv-blocks", "-3")):
        assert "is not in the range" in _usage_error(run_main, [str(tmp_path), "--prompt-ids", "0", flag, value])


def test_a_dump_destination_is_checked_before_generating(tmp_path, tiny_ckpt):
    out = _usage_error(
        deepinfer_main,
        ["reference", str(tiny_ckpt), "--prompt-ids", "0,72", "--dump-logits", str(tmp_path / "missing" / "run.st")],
    )
    assert "missing does not exist" in out
    assert "is a directory" in _usage_error(
        deepinfer_main, ["reference", str(tiny_ckpt), "--prompt-ids", "0,72", "--dump-logits", str(tmp_path)]
    )


def run_cli(bundle, *args: str) -> subprocess.CompletedProcess:
    """The real deepinfer-run, in its own process, on one thread."""
    cmd = [sys.executable, "-m", "deepinfer.runtime.cli", str(bundle), "--threads", "1", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_what_cannot_fit_the_context_is_refused_before_loading(exported_bundle):
    """The bundle's max_context (32) checked before anything is loaded, exit 2 and one line (a
    --max-new-tokens of 10**12 ran to the context and exited 1; a 100k-character prompt was refused
    after the load with exit 1): a prompt plus a given --max-new-tokens beyond it, as vLLM's server
    refuses; a text no tokenization could fit, before tokenizing (the byte tokenizer: 4 x 32
    characters at most); a prompt of more tokens than the context."""
    ids = ",".join(["5"] * 3)
    for args, line in [
        (
            ["--prompt-ids", ids, "--max-new-tokens", str(10**12)],
            "error: --max-new-tokens 1000000000000: prompt 0 (3 tokens) leaves room for 30 (the bundle's "
            "max_context is 32 positions: the prompt and every generated token but the last); lower "
            "--max-new-tokens or shorten the prompt",
        ),
        (
            ["--prompt", "x" * 100_000],
            "error: --prompt 0: the text has 100000 characters; no text over 128 bytes fits the bundle's "
            "max_context of 32 tokens",
        ),
        (
            ["--prompt-ids", "5", "--prompt-ids", ",".join(["5"] * 33)],
            "error: prompt 1 has 33 tokens, more than the bundle's max_context (32)",
        ),
    ]:
        r = run_cli(exported_bundle, *args)
        assert (r.returncode, r.stdout, r.stderr.splitlines()) == (2, "", [line]), (r.returncode, r.stdout, r.stderr)


@pytest.mark.slow
def test_the_whole_context_is_usable_and_the_default_is_cut_to_it(exported_bundle):
    """A given --max-new-tokens that just fits runs whole (prompt + new - 1 = max_context); the default
    (16) is cut to what the longest prompt leaves, with a note, and generates that many, exit 0."""
    r = run_cli(exported_bundle, "--prompt-ids", "5,6,7", "--max-new-tokens", "30", "--json")
    assert r.returncode == 0, r.stderr
    assert [len(o["generated_ids"]) for o in json.loads(r.stdout)["outputs"]] == [30]
    r = run_cli(exported_bundle, "--prompt-ids", ",".join(["5"] * 28), "--prompt-ids", "5", "--json")
    assert r.returncode == 0, r.stderr
    assert r.stderr.splitlines() == [
        "note: generating 5 tokens per prompt, what the bundle's max_context (32) leaves after the longest "
        "prompt (28 tokens); --max-new-tokens defaults to 16"
    ]
    assert [len(o["generated_ids"]) for o in json.loads(r.stdout)["outputs"]] == [5, 5]
