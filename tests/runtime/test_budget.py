"""The scheduler's token budget per step (runtime/budget.py, `max_step_tokens`): every step within it
(decode rows excepted: they all run), decode rows never waiting behind a long prompt, prompts first
come first served, prefix caching's chunks cut to block edges, and the greedy tokens of the run
without a budget, token for token: on a counting model, on the reference (without cache
quantization, where any chunk width gives the same tokens) and with speculative decoding."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from click.testing import CliRunner

from deepinfer.regions.reference import EagerSteps, ReferenceModel
from deepinfer.regions.speculative import AllAcceptedDraftDouble, OneRejectedDraftDouble
from deepinfer.regions.tokenizer import ByteTokenizer
from deepinfer.runtime.budget import BudgetError, StepTokens, check_budget, plan_step
from deepinfer.runtime.executor import Stats
from deepinfer.runtime.options import RunOptions, ServeOptions
from deepinfer.runtime.report import timing, timing_lines
from deepinfer.runtime.requests import Completion, Request
from deepinfer.runtime.schedule import Events, Running, Scheduler, decode, decode_model
from deepinfer.runtime.serving.engine import Engine

from ..conftest import regenerate
from .test_engine import Counting, V
from .test_prefix_cache import SlotCounting, run_alone

NEVER = V + 1  # an eos the counting model never picks


class Fed(Events):
    """Each step's (prompt tokens, decode tokens, rows, longest row), as the scheduler reports them."""

    def __init__(self):
        self.steps: list[tuple[int, int, int, int]] = []

    def fed(self, prompt: int, decode: int, rows: int, longest: int) -> None:
        self.steps.append((prompt, decode, rows, longest))


def counting_run(prompts, new, budget, *, chunk=4, max_batch=4):
    """`prompts` through a counting model with `budget` -> (their tokens, each step's rows, Fed)."""
    model = Counting(max_batch=max_batch, chunk=chunk, slots=max_batch + 1, blocks=65, max_blocks=16)
    fed = Fed()
    s = Scheduler(model, eos=NEVER, events=fed, max_step_tokens=budget)
    outs = [s.add(Request(list(p), new)) for p in prompts]
    while s.busy:
        s.step()
    assert s.fed.steps == len(fed.steps) == len(model.steps)
    return [o.tokens for o in outs], model.steps, fed


def within(budget: int, step: tuple[int, int, int, int]) -> bool:
    """A step keeps to `budget`: its tokens fit, or it is decode rows only (which all run)."""
    prompt, decode, _, _ = step
    return prompt + decode <= budget or prompt == 0


PROMPTS = [[3 + i % 50 for i in range(n)] for n in (9, 2, 14, 5)]


@pytest.mark.parametrize("budget", [1, 2, 3, 4, 5, 7, 100])
def test_every_step_keeps_to_the_budget_with_the_unbudgeted_tokens(budget):
    want, _, _ = counting_run(PROMPTS, 6, None)
    got, steps, fed = counting_run(PROMPTS, 6, budget)
    assert got == want
    for rows, step in zip(steps, fed.steps):
        assert within(budget, step), (budget, step, rows)
        assert sum(len(ids) for _, ids, _ in rows) == step[0] + step[1]  # what the model was given
        assert step[2:] == (len(rows), max(len(ids) for _, ids, _ in rows))
        assert step[3] <= 4  # never past the chunk
    assert sum(p for p, _, _, _ in fed.steps) == sum(map(len, PROMPTS))
    assert sum(d for _, d, _, _ in fed.steps) == 4 * (6 - 1)  # every generated token but the last is fed


def test_no_budget_is_the_scheduler_as_it_was():
    """Without a budget every prompt feeds its whole chunk beside the decodes: 9, 2, 14 and 5 tokens in
    chunks of 4, all four in the first step."""
    _, steps, fed = counting_run(PROMPTS, 6, None)
    assert [len(ids) for _, ids, _ in steps[0]] == [4, 2, 4, 4]
    assert fed.steps[0] == (14, 0, 4, 4)


def test_decode_rows_get_a_token_every_step_while_a_long_prompt_prefills():
    """A short prompt decodes; a long one arrives: each step holds the decode row, the long prompt takes
    what is left (budget 3: 2 tokens a step, never more than the budget) until its first token."""
    model = Counting(max_batch=2, chunk=4, slots=3, blocks=33, max_blocks=16)
    fed = Fed()
    s = Scheduler(model, eos=NEVER, events=fed, max_step_tokens=3)
    short = s.add(Request([5, 6], 30))
    s.step()  # its prompt; its first token
    long = s.add(Request([7 + i % 40 for i in range(40)], 4))
    while not long.generated:
        s.step()
    prefill = model.steps[1:]
    assert len(prefill) == 20  # 40 prompt tokens, 2 a step
    for rows in prefill:
        assert [(seq, len(ids)) for seq, ids, _ in rows] == [(0, 1), (1, 2)]
    assert len(short.generated) == 1 + 20 and all(sum(step[:2]) == 3 for step in fed.steps[1:])


def test_prompts_are_first_come_first_served():
    """Budget 3, chunk 4: the first prompt takes 3 tokens a step, the second waits until the first's last
    chunk leaves room; at budget 1 a prompt waits while a decode row takes the step."""
    _, steps, fed = counting_run([[3] * 7, [4] * 5], 3, 3)
    assert [[(seq, len(ids)) for seq, ids, _ in rows] for rows in steps[:5]] == [
        [(0, 3)],
        [(0, 3)],
        [(0, 1), (1, 2)],  # the first's last token, then what is left for the second
        [(0, 1), (1, 2)],
        [(0, 1), (1, 1)],
    ]
    _, steps, fed = counting_run([[3] * 2, [4] * 2], 3, 1)
    assert [[(seq, len(ids)) for seq, ids, _ in rows] for rows in steps] == [[(0, 1)], [(0, 1)], [(0, 1)], [(0, 1)]] + [
        [(1, 1)]
    ] * 4
    assert [step[:2] for step in fed.steps] == [(1, 0), (1, 0), (0, 1), (0, 1), (1, 0), (1, 0), (0, 1), (0, 1)]


def running(seq: int, prompt: int, consumed: int, generated: int = 0) -> Running:
    r = Running(Request([3] * prompt, 8), Completion([3] * (prompt + generated), prompt), None, seq, consumed=consumed)
    return r


def test_decode_and_verify_rows_over_the_budget_all_run_and_prompts_wait():
    """Two verify rows of 1 + 5 drafts at budget 6 run together; the prompts behind them get nothing;
    with room left, the first prompt takes it (cut to the chunk), then the next."""
    rs = [running(0, 4, 4, 1), running(1, 4, 4, 1), running(2, 9, 0), running(3, 9, 2)]
    drafted = {0: [1] * 5, 1: [1] * 5}

    def chunk_of(r: Running, limit: int | None) -> int:
        n = min(4, len(r.out.tokens) - r.consumed)
        return n if limit is None else min(n, limit)

    assert plan_step(rs, drafted, 6, chunk_of) == {0: 1, 1: 1, 2: 0, 3: 0}
    assert plan_step(rs, drafted, 17, chunk_of) == {0: 1, 1: 1, 2: 4, 3: 1}
    assert plan_step(rs, drafted, None, chunk_of) == {0: 1, 1: 1, 2: 4, 3: 4}
    assert plan_step(rs[2:], {}, 1, chunk_of) == {2: 1, 3: 0}  # no decode row: the first prompt progresses


def test_prefix_caching_chunks_end_at_block_edges_within_the_budget():
    """Blocks of 4, chunks of 6, budget 3: a chunk cut short of an edge runs as cut (0-3), the next one
    ends at the edge it reaches (3-4: the slot state there is kept), and so on; a later request starts
    from the cached edge and gets the same tokens."""
    model = SlotCounting(chunk=6, block_size=4, blocks=17, max_blocks=8, slots=4)
    engine = Engine(model, eos=1, max_queue=4, prefix_cache=True, max_step_tokens=3)
    prompt = [5 + i % 20 for i in range(14)]
    first = run_alone(engine, prompt, 3)
    chunks = [(s[0][2], len(s[0][1])) for s in model.steps[:8]]
    assert chunks == [(0, 3), (3, 1), (4, 3), (7, 1), (8, 3), (11, 1), (12, 2), (14, 1)]
    model.steps.clear()
    again = run_alone(engine, prompt[:10] + [7, 7, 7], 3)
    assert again.cached_tokens == 8 and model.steps[0][0][1:] == (prompt[8:10] + [7], 8)
    whole = run_alone(engine, prompt, 3)
    assert whole.cached_tokens == 12 and whole.generated == first.generated
    plain = Engine(SlotCounting(chunk=6, block_size=4, blocks=17, max_blocks=8, slots=4), eos=1, max_queue=4)
    assert run_alone(plain, prompt, 3).generated == first.generated
    fed, registry = engine.scheduler.fed, engine.metrics.registry  # /metrics: every step within 3 tokens
    assert registry.get_sample_value("deepinfer_step_tokens_count") == fed.steps and fed.largest == 3
    assert registry.get_sample_value("deepinfer_step_tokens_sum") == fed.fed
    assert registry.get_sample_value("deepinfer_step_tokens_bucket", {"le": "4.0"}) == fed.steps
    assert registry.get_sample_value("deepinfer_step_tokens_bucket", {"le": "2.0"}) < fed.steps


def test_a_budget_under_one_or_a_verify_row_is_refused(ref_exact):
    for bad in (0, -2, True, 2.5):
        with pytest.raises(BudgetError, match="at least 1"):
            check_budget(bad)  # type: ignore[arg-type]  # what a caller might pass
    with pytest.raises(BudgetError, match="at least 1"):
        RunOptions(max_step_tokens=0)
    with pytest.raises(BudgetError, match="at least 1"):
        ServeOptions(max_step_tokens=-1)
    st = EagerSteps(ref_exact, [[5, 6]], 4, None, slack=5)
    with pytest.raises(BudgetError, match="give at least 6") as e:
        Scheduler(st, eos=0, drafter=AllAcceptedDraftDouble([], 5), max_step_tokens=5)
    assert "\n" not in str(e.value)
    Scheduler(st, eos=0, drafter=AllAcceptedDraftDouble([], 5), max_step_tokens=6)


@pytest.mark.parametrize("command", ["run", "serve"])
def test_the_clis_refuse_a_budget_under_one_in_one_line(tmp_path, command):
    from deepinfer.runtime.cli import main as run_main
    from deepinfer.runtime.serving.cli import main as serve_main

    main = run_main if command == "run" else serve_main
    result = CliRunner().invoke(main, [str(tmp_path), "--max-step-tokens", "0"])
    assert result.exit_code == 2, result.output
    assert "Invalid value for '--max-step-tokens': 0 is not in the range x>=1" in result.output
    help_text = CliRunner().invoke(main, ["--help"]).output
    assert "--max-step-tokens" in help_text and "time between tokens" in help_text


def test_the_timing_report_counts_fed_tokens_and_padded_rows():
    stats, steps = Stats(tokens=30, padded=64, steps=4), StepTokens()
    for prompt, dec in [(8, 0), (6, 2), (0, 4), (0, 10)]:
        steps.record(prompt, dec)
    assert (steps.fed, steps.largest) == (30, 10)
    t = timing(stats, 1.0, steps)
    assert (t["fed_tokens"], t["padded_rows"], t["prompt_tokens"], t["decode_tokens"]) == (30, 64, 14, 16)
    assert (
        "fed tokens 30 (14 prompt, 16 decode; at most 10 a step); padded rows 64" in timing_lines(stats, 1.0, steps)[-1]
    )
    assert "prompt_tokens" not in timing(stats, 1.0)


# --- the reference: the same greedy tokens whatever the budget --------------------------------------------

TOK = ByteTokenizer()
GOLDEN = [TOK.encode(p) for p in regenerate.PROMPTS]  # 5, 57, 3 and 7 tokens
CHUNK = 8
NEW = 8


@pytest.fixture(scope="module")
def ref_exact(tiny_ckpt):
    """The reference without cache quantization: any chunk width gives the same tokens (with it, a last
    bit of a chunk's matmul can cross an fp8 rounding boundary: tests/regions/test_reference.py)."""
    return ReferenceModel(tiny_ckpt, dtype="fp32", cache_quant=False, ties="lowest")


@pytest.fixture(scope="module")
def unbudgeted(ref_exact):
    return decode_model(ref_exact, GOLDEN, NEW, chunk=CHUNK)


@pytest.mark.parametrize("budget", [pytest.param(1, marks=pytest.mark.slow), 3, CHUNK, 1000])  # 1: ~100 steps
def test_the_reference_gives_the_unbudgeted_tokens_for_any_budget(ref_exact, unbudgeted, budget):
    got = decode_model(ref_exact, GOLDEN, NEW, chunk=CHUNK, max_step_tokens=budget)
    assert [g.tokens for g in got] == [g.tokens for g in unbudgeted]
    for g, w in zip(got, unbudgeted):
        assert (torch.stack(g.logits) - torch.stack(w.logits)).abs().max() < 1e-3
    steps = got.steps
    assert steps is not None and steps.prompt == sum(map(len, GOLDEN))
    assert steps.largest <= max(budget, len(GOLDEN))  # over the budget only with decode rows alone
    if budget >= 4 * CHUNK:  # never binds: the unbudgeted run's steps
        assert unbudgeted.steps is not None and steps.steps == unbudgeted.steps.steps


@pytest.mark.parametrize("budget", [6, 9])
def test_speculative_decoding_within_a_budget_gives_the_plain_tokens(ref_exact, unbudgeted, budget):
    """Verify rows (the unfed token and 5 drafts) run first, whole; prompts take what is left."""
    for drafter in (
        AllAcceptedDraftDouble(unbudgeted, 5),
        OneRejectedDraftDouble(unbudgeted, 5, ref_exact.config.text.vocab_size, seed=1),
    ):
        fed = Fed()
        st = EagerSteps(ref_exact, GOLDEN, NEW, CHUNK, slack=5)
        s = Scheduler(st, eos=ref_exact.config.eos_token_id, drafter=drafter, events=fed, max_step_tokens=budget)
        with torch.inference_mode():
            outs = [s.add(Request(list(p), NEW)) for p in GOLDEN]
            while s.busy:
                s.step()
        assert [o.tokens for o in outs] == [g.tokens for g in unbudgeted]
        assert s.speculation.verify_steps > 0
        assert all(within(budget, step) for step in fed.steps), fed.steps
        mixed = [step for step in fed.steps if step[0] and step[1] > 1]  # a verify row beside a prompt chunk
        assert all(step[0] + step[1] <= budget for step in mixed) and (mixed or budget == 6)


def test_decode_passes_the_budget_through(ref_exact, unbudgeted):
    st = EagerSteps(ref_exact, GOLDEN[:1], NEW, CHUNK)
    got = decode(st, GOLDEN[:1], NEW, eos=ref_exact.config.eos_token_id, max_step_tokens=2)
    assert got[0].tokens == unbudgeted[0].tokens
    assert got.steps is not None and got.steps.largest == 2 and got.steps.steps == 3 + NEW - 1


# --- a compiled bundle: the steps run at its buckets ------------------------------------------------------


def test_a_bundle_runs_budgeted_steps_at_its_buckets(run_exported_bundle):
    """The exported bundle (tokens buckets 1, 6, 8; batch 1, 4): at budget 3 no step needs the 8-token
    bucket (a mixed step's rows are padded to 6); every budget gives the unbudgeted tokens, and the
    executor's real positions are the scheduler's fed tokens."""
    from deepinfer.runtime import generate, load

    executor = load(run_exported_bundle)
    with torch.inference_mode():
        plain = generate(executor, GOLDEN, RunOptions(max_new_tokens=NEW))
        for budget in (3, 7, 100):
            got = generate(executor, GOLDEN, RunOptions(max_new_tokens=NEW, max_step_tokens=budget))
            assert [g.tokens for g in got] == [g.tokens for g in plain], budget
            stats, steps = got.stats, got.steps
            assert stats is not None and steps is not None
            assert stats.tokens == steps.fed and steps.largest <= budget and stats.steps == steps.steps
            assert set(stats.by_tokens) <= {1, 6, 8} and (budget > 6 or 8 not in stats.by_tokens)
    assert plain.steps is not None and got.steps is not None and got.steps.steps == plain.steps.steps


def test_deepinfer_run_budget_timing_and_speculative_refusal(run_exported_bundle):
    """--max-step-tokens 3 --timing --json: the fed tokens split into prompt and decode, no step over 3,
    the padded rows; with --speculative (a draft block of 5) a budget of 5 is refused in one line."""
    from deepinfer.runtime.cli import main

    ids = ",".join(map(str, GOLDEN[1]))
    r = CliRunner().invoke(
        main,
        [str(run_exported_bundle), "--prompt-ids", ids, "--max-new-tokens", "4", "--max-step-tokens", "3"]
        + ["--json", "--timing"],
    )
    assert r.exit_code == 0, r.output
    t = json.loads(r.stdout)["timing"]
    assert (t["prompt_tokens"], t["decode_tokens"], t["largest_step_tokens"]) == (57, 3, 3)
    assert t["fed_tokens"] == 60 and t["padded_rows"] >= 60 and t["steps"] == 19 + 3
    r = CliRunner().invoke(
        main, [str(run_exported_bundle), "--prompt", "Hi", "--speculative", "dspark", "--max-step-tokens", "5"]
    )
    assert r.exit_code == 2 and r.output.strip().count("\n") == 0, r.output
    assert "smaller than a speculative verify row" in r.output and "at least 6" in r.output


def test_deepinfer_serve_with_a_budget_gives_deepinfer_runs_tokens(aoti_bundle):
    """deepinfer-serve --max-step-tokens 2 (one token bucket: prompts fed a token a step, two rows at
    most): concurrent greedy completions equal deepinfer-run's, and /metrics counts no step over 2."""
    from deepinfer.runtime.cli import main

    from .test_serve import MODEL, Server

    prompts = ["Hello, world", "abc", "1 + 1 ="]
    r = CliRunner().invoke(
        main, [str(aoti_bundle), "--json", "--max-new-tokens", "6"] + [f"--prompt={p}" for p in prompts]
    )
    assert r.exit_code == 0, r.output
    want = [o["text"] for o in json.loads(r.stdout)["outputs"]]
    s = Server(aoti_bundle, "--max-step-tokens", "2")
    try:
        client = s.client()
        with ThreadPoolExecutor(len(prompts)) as pool:
            out = list(pool.map(lambda p: client.completions.create(model=MODEL, prompt=p, max_tokens=6), prompts))
        assert [o.choices[0].text for o in out] == want
        steps = s.metric("deepinfer_step_tokens_count")
        assert steps > 0 and s.metric('deepinfer_step_tokens_bucket{le="2.0"}') == steps
    finally:
        assert s.stop() == 0, s.proc.stderr.read()


# -- a bundle whose prompt steps take fewer sequences than its decode steps ([buckets] prompt_batch) --


class NarrowPrompts(Counting):
    """The counting model with prompt buckets of `prompt_batch` sequences (the runtime's `Steps` reads it
    from the bundle's shapes): a step holding a row of more than one token and more rows fails, as a
    bundle without that (batch, tokens) executable would."""

    def __init__(self, prompt_batch: int, **kw):
        super().__init__(**kw)
        self.prompt_batch = prompt_batch

    def run(self, rows_by_group, *args, **kw):
        (rows,) = rows_by_group
        assert len(rows) <= self.prompt_batch or all(len(ids) == 1 for _, ids, _ in rows), rows
        return super().run(rows_by_group, *args, **kw)


@pytest.mark.parametrize("budget", [None, 3])
@pytest.mark.parametrize("prompt_batch", [1, 2])
def test_prompt_steps_hold_the_prompt_batch_and_alternate_with_decode_rows(prompt_batch, budget):
    """Four prompts (9, 2, 14 and 5 tokens, chunks of 4) at up to 4 sequences a step but `prompt_batch` a
    prompt step: every step within it (`NarrowPrompts`), the tokens of the run without it; while a
    prompt prefills beside decoding sequences, no decode row waits two steps running and no prompt
    waits two steps running (the steps alternate)."""
    want, _, _ = counting_run(PROMPTS, 6, budget)
    model = NarrowPrompts(prompt_batch, max_batch=4, chunk=4, slots=5, blocks=65, max_blocks=16)
    s = Scheduler(model, eos=NEVER, max_step_tokens=budget)
    outs = [s.add(Request(list(p), 6)) for p in PROMPTS]
    while s.busy:
        s.step()
    assert [o.tokens for o in outs] == want
    kinds = ["prompt" if any(len(ids) > 1 for _, ids, _ in rows) else "decode" for rows in model.steps]
    assert "prompt" in kinds and "decode" in kinds
    decoding: dict[int, list[int]] = {}  # seq -> the step that ended its prompt and those it decoded in
    for i, rows in enumerate(model.steps):
        for seq, ids, start in rows:
            if start + len(ids) >= len(PROMPTS[seq]):
                decoding.setdefault(seq, []).append(i)
    for seq, steps in decoding.items():
        assert all(b - a <= 2 for a, b in zip(steps, steps[1:])), (seq, steps)  # never two steps waiting
    for i in range(len(kinds) - 1 if budget is None else 0):  # prompts prefill one step in two at least
        assert "prompt" in kinds[i : i + 2] or "prompt" not in kinds[i:], (i, kinds)
    narrow = [k for k, rows in zip(kinds, model.steps) if len(rows) > prompt_batch]
    assert set(narrow) <= {"decode"}  # every step over the prompt batch holds decode rows only


def test_without_a_narrower_prompt_batch_the_plan_is_as_it_was():
    """A stepper without `prompt_batch` (or with its max batch) feeds every row a step, as before."""
    _, steps, _ = counting_run(PROMPTS, 6, None)
    model = NarrowPrompts(4, max_batch=4, chunk=4, slots=5, blocks=65, max_blocks=16)
    s = Scheduler(model, eos=NEVER)
    for p in PROMPTS:
        s.add(Request(list(p), 6))
    while s.busy:
        s.step()
    assert model.steps == steps


@pytest.mark.slow
def test_a_bundle_with_one_sequence_a_prompt_step_gives_the_reference_tokens(tmp_path_factory, tiny_ckpt, unbudgeted):
    """A bundle compiled with `[buckets] prompt_batch = [1]` (batch {1, 4}, tokens {1, 8}) builds its 8-token
    bucket at batch 1 only; the four golden prompts run together (their prompt steps one sequence each,
    alternating with the decode steps of those that have started) and give the reference's tokens."""
    from deepinfer.bundles import manifest_io
    from deepinfer.runtime import generate, load

    from ..conftest import _compile_tiny

    bundle = _compile_tiny(
        tmp_path_factory,
        "prompt-batch",
        tiny_ckpt,
        executable="exported",
        tokens=[1, 8],
        batch=(1, 4),
        max_context=80,
        num_blocks=21,
        cache_quant=False,
        extra_buckets="prompt_batch = [1]\n",
    )
    shapes = {(s.batch, s.tokens) for s in manifest_io.read(bundle).buckets.shapes}
    assert shapes == {(1, 1), (1, 8), (4, 1)}
    executor = load(bundle)
    with torch.inference_mode():
        got = generate(executor, GOLDEN, RunOptions(max_new_tokens=NEW))
    assert [g.tokens for g in got] == [g.tokens for g in unbudgeted]
    assert got.stats is not None and set(got.stats.by_tokens) == {1, 8}
