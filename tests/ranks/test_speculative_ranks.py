"""Speculative decoding over ranks: the DSpark draft divided like the target, every rank in each draft step.

The layouts are ep = 2 (two token groups, EP dispatch: the draft's MoE runs on both groups' gathered
rows), cp = ep = 4 (one token group whose context the four ranks divide; the draft's experts over
all four) and tp = 2 x cp = 2, ep = 4 (the draft's heads over each cp rank's tp group, its experts over
the token group of four). Each is compiled once with the checkpoint's draft (conftest
`SPECULATIVE_LAYOUTS`; tests/ranks/test_ranks.py runs the same bundles without it). The
reference is the plain greedy run of the one-rank bundle: every drafter (the tiny draft itself, the
double whose drafts are all accepted and the one that corrupts a position of each block) must give
its tokens, each golden prompt alone and all of them at once, with nothing fed twice after a
rejection (`verify` steps carry the bonus token and a full block of fresh drafts).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from deepinfer.regions.speculative import AllAcceptedDraftDouble, OneRejectedDraftDouble
from deepinfer.regions.tokenizer import ByteTokenizer
from deepinfer.regions.topology import head_rows
from deepinfer.runtime import RunOptions, generate, open_bundle
from deepinfer.runtime.options import SPECULATIVE
from deepinfer.runtime.ranks import DRAFT_PICKS, GREEDY_PICKS

from ..conftest import SPECULATIVE_LAYOUTS, regenerate

# a group of its own, not `rank_bundle`'s: the rank tests together ran over 20 minutes on one worker
XDIST_GROUP = "ranks-speculative"
PROMPTS = [ByteTokenizer().encode(p) for p in regenerate.PROMPTS]
NEW = 8
BLOCK = 5  # the tiny checkpoint's dspark_block_size
LAYOUTS = {"ep=2": (1, 2, 1), "cp=ep=4": (1, 4, 4), "tp=2xcp=2,ep=4": (2, 4, 2)}
assert set(LAYOUTS.values()) <= set(SPECULATIVE_LAYOUTS)


# what each layout runs: ep = 2 every golden prompt alone and all at once; the four-rank layouts (four
# processes on the test machine's cores) the shortest alone and all at once
SHORT_AND_ALL = [[min(PROMPTS, key=len)], PROMPTS]
BATCHES = {"ep=2": [[p] for p in PROMPTS] + [PROMPTS], "cp=ep=4": SHORT_AND_ALL, "tp=2xcp=2,ep=4": SHORT_AND_ALL}


def full_blocks(new: int) -> int:
    """Verify steps of a sequence whose drafts are all accepted: after its first token each drafts as
    many as fit before the last (block at most) and commits them and its own token."""
    steps, generated = 0, 1
    while generated < new:
        n = min(BLOCK, new - generated - 1)
        steps, generated = steps + (n > 0), generated + n + 1
    return steps


@pytest.fixture(scope="module")
def plain(one_rank_loaded):
    """The one-rank bundle's plain greedy runs: each golden prompt alone, then all of them at once."""
    return {
        tuple(map(tuple, batch)): generate(one_rank_loaded, batch, RunOptions(max_new_tokens=NEW))
        for batch in [[p] for p in PROMPTS] + [PROMPTS]
    }


@pytest.fixture(scope="module")
def reference_accepted(tiny_ckpt):
    """prompts -> how many drafts the eager reference's DSpark draft (one rank, no cache quantization, as
    the rank bundles) has accepted in its greedy run of them: what the ranks' compiled draft must match.
    The tiny draft's random weights rarely agree with the target (none, or one over the golden prompts),
    so a draft broken at ranks (its tokens are still the target's, verified) shows here."""
    from deepinfer.regions.reference import ReferenceModel
    from deepinfer.runtime.schedule import decode

    model = ReferenceModel(tiny_ckpt, dtype="fp32", cache_quant=False, ties="lowest")
    done: dict[tuple, int] = {}

    def get(prompts: list[list[int]]) -> int:
        key = tuple(map(tuple, prompts))
        if key not in done:
            steps = model.stepper(prompts, NEW, slack=BLOCK)
            done[key] = decode(
                steps, prompts, NEW, eos=model.config.eos_token_id, drafter=model.dspark()
            ).speculation.accepted
        return done[key]

    return get


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_drafts_over_ranks_keep_the_one_rank_tokens(rank_bundle, started_ranks, plain, reference_accepted, name):
    """Through the ranks' leader (its followers one process each; started once, `started_ranks`), every
    drafter gives the one-rank plain tokens, alone and batched; the all-accepted double commits block + 1
    tokens at every verify step, and the corrupting one is rejected at some offset of every block it drafts;
    the bundle's draft accepts as many drafts as the one-rank reference's draft."""
    opened = open_bundle(rank_bundle(*LAYOUTS[name]), verify=False)
    ranks = started_ranks(*LAYOUTS[name])
    vocab = opened.config.text.vocab_size
    chunk = opened.manifest.buckets.token_sizes[-1]  # the leader's prompt chunk (its `sizes.token_sizes`)
    for prompts in BATCHES[name]:
        want = plain[tuple(map(tuple, prompts))]
        drafters = {  # the bundle's own draft (--speculative dspark), or a double sent to the leader
            "dspark": (SPECULATIVE[0], None),
            "all accepted": (None, AllAcceptedDraftDouble(want, BLOCK)),
            "one rejected": (None, OneRejectedDraftDouble(want, BLOCK, vocab, seed=1)),
        }
        for label, (speculative, drafter) in drafters.items():
            # the bundle's draft keeping every target logit: each step's logits all-gather carries its B * T rows
            keep = speculative is not None
            options = RunOptions(max_new_tokens=NEW, threads=1, speculative=speculative, keep_logits=keep)
            got = ranks.generate(prompts, options, drafter=drafter)
            stats = got.stats
            assert [g.tokens for g in got] == [g.tokens for g in want], (label, len(prompts))
            assert all(g.error is None for g in got)
            if keep:
                _check_draft_sends_pairs_only(got, head_rows(opened.config.text, opened.manifest.topology.topology))
            s = got.speculation
            assert s.verify_steps > 0, label
            if label == "dspark":
                assert s.accepted == reference_accepted(prompts), len(prompts)
            if label == "all accepted":  # block + 1 tokens a verify step, the last fewer (NEW runs out)
                assert s.accepted == s.drafted and s.verify_steps == len(prompts) * full_blocks(NEW)
            if label == "one rejected" and len(prompts) == 1:  # nothing fed twice: the target's tokens are
                assert s.accepted < s.drafted  # the prompt, then the bonus token and drafts of each verify
                chunks = -(-len(prompts[0]) // chunk)  # step, and single decode steps
                plain_steps = stats.steps - chunks - s.verify_steps
                assert stats.tokens == len(prompts[0]) + s.verify_steps + s.drafted + plain_steps


def _check_draft_sends_pairs_only(got, rows: int) -> None:
    """The draft's logits never cross ranks: every rank's logits all-gather carries the target steps'
    rows only (B * T of each, float32 over its vocabulary slice), and each draft step sends P pairs of 8
    bytes a batch row (the draft's batch bucket: 1 for one prompt, at most 2) in the draft's pick
    all-gather, one `pick` per block position. `rows`: a rank's vocabulary slice."""
    stats = got.stats
    drafts = stats.calls["dspark_head.normalize"]  # the leader's draft steps
    assert drafts > 0 and stats.calls["dspark_head.pick"] == BLOCK * drafts
    for rank, sent in got.sent.items():
        assert "draft logits all-gather" not in sent and "dspark_head.tokens" not in stats.calls, rank
        assert sent["logits all-gather"] == stats.padded * rows * 4, rank
        picks = sent[DRAFT_PICKS]
        assert BLOCK * 8 * drafts <= picks <= BLOCK * 8 * 2 * drafts and picks % (BLOCK * 8) == 0, rank
        if len(got) == 1:
            assert picks == BLOCK * 8 * drafts, rank


def test_greedy_steps_send_pairs_not_logits(started_ranks, plain):
    """All-greedy runs at cp = ep = 4, no request needing the logits (issue 42 item 2): plain and with
    `--speculative dspark`, alone and batched, the tokens are the one-rank plain run's and no logits
    cross ranks: every rank sends (value, index) pairs only, 8 bytes a head row ("greedy pick
    all-gather"), no "logits all-gather" (the draft's picks as before). A lone sequence's head rows are
    exactly one a step (prompt steps run the head on their last row) and the 8-token bucket's rows of
    each verify step. The runs keeping the logits (the drafters test's) still gather them whole."""
    ranks = started_ranks(*LAYOUTS["cp=ep=4"])
    for prompts in SHORT_AND_ALL:
        want = plain[tuple(map(tuple, prompts))]
        for speculative in (None, SPECULATIVE[0]):
            got = ranks.generate(prompts, RunOptions(max_new_tokens=NEW, threads=1, speculative=speculative))
            assert [g.tokens for g in got] == [g.tokens for g in want] and all(g.error is None for g in got)
            stats, verify = got.stats, got.speculation.verify_steps
            assert (verify > 0) == (speculative is not None)
            for rank, sent in got.sent.items():
                assert "logits all-gather" not in sent and "draft logits all-gather" not in sent, rank
                assert (DRAFT_PICKS in sent) == (speculative is not None), rank
                pairs = sent[GREEDY_PICKS]
                assert pairs % 8 == 0 and stats.steps * 8 <= pairs <= stats.padded * 8, rank
                if len(prompts) == 1:
                    assert pairs == 8 * (stats.steps + 7 * verify), rank


def test_run_and_serve_draft_over_ranks(rank_bundle, plain):
    """`deepinfer-run --speculative dspark` (its ranks started here) and `deepinfer-serve --speculative
    dspark` at ep = 2 give the one-rank plain tokens: the run with every golden prompt batched, the server
    for requests one at a time and all at once."""
    import openai
    from click.testing import CliRunner

    from deepinfer.runtime.cli import main
    from deepinfer.runtime.serving.server_process import ServerProcess

    bundle = rank_bundle(*LAYOUTS["ep=2"])
    batched = plain[tuple(map(tuple, PROMPTS))]
    args = [str(bundle), "--max-new-tokens", str(NEW), "--json", "--timing", "--speculative", "dspark"]
    args += [a for p in PROMPTS for a in ("--prompt-ids", ",".join(map(str, p)))]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert [o["generated_ids"] for o in out["outputs"]] == [w.generated for w in batched]
    assert out["timing"]["speculation"]["verify_steps"] > 0

    server = ServerProcess(bundle, "--model-name", "tiny", "--threads", "1", "--speculative", "dspark")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120, max_retries=0)

        def complete(ids):
            return client.completions.create(model="tiny", prompt=ids, max_tokens=NEW, temperature=0)

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            together = list(pool.map(complete, PROMPTS))
        alone = [complete(p) for p in PROMPTS]
        for got in (alone, together):
            for response, want in zip(got, batched):
                assert response.choices[0].text == ByteTokenizer().decode(want.generated)
    finally:
        assert server.stop() == 0, server.proc.stderr.read()
