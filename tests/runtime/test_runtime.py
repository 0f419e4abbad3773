"""deepinfer-run: bundles reproduce the golden tokens; damaged bundles and exhausted pools are refused cleanly."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from click.testing import CliRunner

from deepinfer.bundles.manifest import BundleError
from deepinfer.errors import TensorFileError
from deepinfer.runtime import RunOptions, Stats, generate, load
from deepinfer.runtime.generation import generate_loaded
from deepinfer.runtime.neuron.libnrt import NeuronRuntimeMissing

from ..conftest import regenerate

GOLDEN = json.loads(regenerate.GOLDEN.read_text())
RUNS = GOLDEN["modes"]["fp32-quant-lowest"]  # what bundles compute: lowest index wins among tied scores
NEW = GOLDEN["max_new_tokens"]
GOLDEN_FOR = {"run_aoti_bundle": "fp32-noquant-lowest", "run_exported_bundle": "fp32-quant-lowest"}


def check_against_golden(gens, mode: str):
    """Each generation against the golden run of `mode`, within the golden's recorded tolerance
    (tests/golden/regenerate.py: a near tie may go the other way on another CPU)."""
    tolerance = GOLDEN["noise"][mode]["tolerance"]
    for g, run in zip(gens, GOLDEN["modes"][mode], strict=True):
        assert g.error is None
        regenerate.check_run(g.tokens, g.logits, run, tolerance)


def run(executor, prompts, n=NEW, *, drafter=None, on_call=None):
    """Greedy generation on a loaded bundle, with a drafter of any kind (the test doubles included) and a
    hook around every region call."""
    return generate_loaded(
        executor, prompts, RunOptions(max_new_tokens=n, keep_logits=True), on_call=on_call, drafter=drafter
    )


@pytest.fixture(scope="module")
def loaded():
    """bundle -> an Executor loaded once for this module's tests (loading an exported bundle's 32
    programs takes ~20 s); each run has its own stats."""
    executors = {}

    def get(bundle):
        if bundle not in executors:
            executors[bundle] = load(bundle)
        return executors[bundle]

    return get


@pytest.fixture(scope="module")
def plain(loaded):
    """(bundle, prompts) -> the bundle's greedy generations of NEW tokens, run once for this module's
    tests (the golden check and the speculative identity read the same runs)."""
    runs = {}

    def get(bundle, prompts):
        key = (bundle, tuple(map(tuple, prompts)))
        if key not in runs:
            runs[key] = generate(loaded(bundle), prompts, RunOptions(max_new_tokens=NEW, keep_logits=True))
        return runs[key]

    return get


def test_speculative_doubles_keep_the_tokens(loaded, plain, run_exported_bundle):
    """Speculative decoding through the bundle's executables (verify steps in its 6-token bucket) gives
    the plain run's tokens with both test doubles, every golden prompt alone and all four batched; the
    bundle's rings have a block of slack (compiled with its draft), so nothing is restored."""
    from deepinfer.regions.speculative import AllAcceptedDraftDouble, OneRejectedDraftDouble

    session = loaded(run_exported_bundle)
    block = 5
    assert block + 1 in session.sizes.token_sizes and session.sizes.slack == block
    prompts = [r["prompt_ids"] for r in RUNS]
    for batch in [[p] for p in prompts] + [prompts]:
        want = plain(run_exported_bundle, batch)
        doubles = (
            AllAcceptedDraftDouble(want, block),
            OneRejectedDraftDouble(want, block, session.config.text.vocab_size, seed=1),
        )
        for drafter in doubles:
            got = run(session, batch, drafter=drafter)
            assert [g.tokens for g in got] == [g.tokens for g in want], type(drafter).__name__
            assert all(g.error is None for g in got)
        if len(batch) == 1:  # prompt chunks of 8, then verify steps of 6 tokens with every draft kept
            assert got.stats.steps > 0
    assert all(doubles[1].offsets), doubles[1].offsets


def test_compiled_draft_keeps_the_tokens_and_drafts_as_the_reference(loaded, plain, run_exported_bundle, tiny_ckpt):
    """The draft compiled into the bundle (its executables and features pool; no checkpoint read) keeps the
    plain run's tokens on the four golden prompts batched. Then, from the features that run left in the
    pool, it drafts a block for each prompt as the eager reference drafter does from the same features:
    the same tokens, logits within the golden's measured floor, up to a position where the reference's
    top-two margin is within that floor (there the argmax may go either way, and later positions are
    conditioned on it, so the comparison stops)."""
    from deepinfer.regions.reference import ReferenceModel
    from deepinfer.regions.stepper import DraftRequest

    session = loaded(run_exported_bundle)
    prompts = [r["prompt_ids"] for r in RUNS]
    want = plain(run_exported_bundle, prompts)
    compiled = session.dspark(Stats())
    slots, draft = {}, compiled.draft

    def recording(requests):
        slots.update({r.seq: r.slot for r in requests})
        return draft(requests)

    compiled.draft = recording
    got = run(session, prompts, drafter=compiled)
    assert [g.tokens for g in got] == [g.tokens for g in want]
    assert got.speculation.verify_steps > 0 and sorted(slots) == [0, 1, 2, 3]

    reference = ReferenceModel(tiny_ckpt, dtype="fp32", cache_quant=True, ties="lowest").dspark()
    reference.capture.features = session.pools[session.manifest.draft.features].clone()
    requests = [DraftRequest(seq, slots[seq], g.tokens, compiled.block) for seq, g in enumerate(got)]
    (want, want_logits), (mine, logits) = reference.block_logits(requests), compiled.block_logits(requests)
    floor = GOLDEN["noise"]["fp32-quant-lowest"]["tolerance"]
    agreed = 0
    for b in range(len(requests)):
        for i in range(compiled.block):
            assert (logits[b, i] - want_logits[b, i]).abs().max() <= floor, (b, i)
            if mine[b, i] != want[b, i]:
                top = want_logits[b, i].topk(2).values
                assert top[0] - top[1] <= floor, (b, i, int(mine[b, i]), int(want[b, i]))
                break
            agreed += 1
    assert agreed >= len(requests)


def reuse_session(monkeypatch, session) -> None:
    """deepinfer-run's load (runtime.loading.load, through ranks.load_here) returns `session`, the
    bundle loaded once for this module (a run's stats are its own)."""
    import deepinfer.runtime.ranks

    monkeypatch.setattr(deepinfer.runtime.ranks, "load", lambda *args, **kwargs: session)


def test_cli_speculative_keeps_the_tokens(run_exported_bundle, loaded, plain, monkeypatch):
    """`deepinfer-run --speculative dspark` on the bundle: the plain run's tokens, and with --timing the
    tokens per target step and the verify step over a plain decode step."""
    from deepinfer.runtime.cli import main

    ids = RUNS[0]["prompt_ids"]
    want = plain(run_exported_bundle, [ids])[0].generated[:8]
    reuse_session(monkeypatch, loaded(run_exported_bundle))
    runner = CliRunner()
    r = runner.invoke(
        main,
        [
            str(run_exported_bundle),
            "--prompt-ids",
            ",".join(map(str, ids)),
            "--max-new-tokens",
            "8",
            "--json",
            "--timing",
            "--speculative",
            "dspark",
        ],
    )
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["outputs"][0]["generated_ids"] == want
    spec = out["timing"]["speculation"]
    assert spec["verify_steps"] > 0 and spec["tokens_per_step"] >= 1
    assert spec["accepted_per_step"] == pytest.approx(spec["accepted"] / spec["verify_steps"])
    assert spec["wasted_per_step"] == pytest.approx((spec["drafted"] - spec["accepted"]) / spec["verify_steps"])
    assert spec["verify_over_decode_step"] is not None and spec["verify_over_decode_step"] > 0
    # the draft head runs its `normalize` and `tokens` methods (regions/drafting.py), never `decode`
    draft_kinds = {"dspark_capture", "dspark_attn", "dspark_moe", "dspark_head.normalize", "dspark_head.tokens"}
    assert draft_kinds | {"head.project"} <= {row["kind"] for row in out["timing"]["regions"]}
    r = runner.invoke(
        main,
        [str(run_exported_bundle), "--prompt", "Hi", "--max-new-tokens", "3", "--timing", "--speculative", "dspark"],
    )
    assert r.exit_code == 0 and "tokens per step" in r.stderr, r.output


def test_cli_speculative_needs_a_compiled_draft(run_aoti_bundle):
    """A bundle compiled without a draft is refused in one line, non-zero, before anything loads."""
    from deepinfer.runtime.cli import main

    r = CliRunner().invoke(main, [str(run_aoti_bundle), "--prompt", "Hi", "--speculative", "dspark"])
    assert r.exit_code == 2 and r.output.count("\n") == 1 and "compiled without a speculative draft" in r.output


@pytest.mark.parametrize("which", ["run_aoti_bundle", "run_exported_bundle"])
def test_bundle_reproduces_golden_tokens(request, loaded, plain, which):
    """AOTInductor (no cache quantization, 1-token prompt steps) and exported (cache
    quantization, 8-token prompt chunks) bundles, at batch 1 and with all four prompts."""
    bundle = request.getfixturevalue(which)
    runs = GOLDEN["modes"][GOLDEN_FOR[which]]
    assert loaded(bundle).manifest.model.cache_quant == GOLDEN_FOR[which].startswith("fp32-quant")
    prompts = [r["prompt_ids"] for r in runs]
    check_against_golden([plain(bundle, [p])[0] for p in prompts], GOLDEN_FOR[which])  # batch 1
    check_against_golden(plain(bundle, prompts), GOLDEN_FOR[which])  # all four at once


def test_padding_waste_and_timing_are_recorded(run_exported_bundle, loaded):
    session = loaded(run_exported_bundle)
    s = run(session, [RUNS[0]["prompt_ids"], RUNS[2]["prompt_ids"]], 3).stats
    assert s.steps > 0 and s.padded > s.tokens > 0
    table = s.table()
    assert {r["kind"] for r in table} >= {"moe", "head", "attn_window"}
    assert abs(sum(r["share"] for r in table) - 1) < 1e-9


def test_prompt_rows_are_counted_per_execution(run_exported_bundle, loaded):
    """A 20-token prompt in chunks of 8, 8 and 4 tokens (buckets 8, 8 and 6): every execution of a
    step takes its bucket's rows (bench/ranks.py's prompt_rows_per_rank_over_chunk)."""
    session = loaded(run_exported_bundle)
    buckets = session.manifest.buckets
    assert buckets.token_sizes == [1, 6, 8] and buckets.batch_sizes[0] == 1
    s = run(session, [[0] + [5 + i for i in range(19)]], 1).stats
    assert (s.prompt.steps, s.prompt.tokens) == (3, 20)
    per_step = s.prompt.executions // 3
    assert s.prompt.executions == sum(s.calls.values()) == 3 * per_step > 3
    assert s.prompt.rows == per_step * (8 + 8 + 6)
    assert s.prompt.rows_over_chunk == pytest.approx((22 / 3) / (20 / 3))
    assert s.prompt.work == s.prompt.rows  # one rank: no execution is a slice of a group's columns


def test_a_prompt_chunk_runs_the_head_on_its_last_row_only(run_exported_bundle, loaded):
    """Without a request that keeps every row's logits, each step runs the head on one row a sequence
    (its T = 1 bucket): the last fed row, what sampling reads. The tokens are those of the run that
    keeps every row; a prompt step's executions take its bucket's rows, the head one."""
    session = loaded(run_exported_bundle)
    prompt = [[0] + [5 + i for i in range(19)]]
    every = run(session, prompt, 4)
    heads: list[tuple[int, int]] = []

    def on_call(layer, slot, kind, inputs, call):
        if slot == "head":
            heads.append(tuple(inputs[0].shape[:2]))
        return call()

    last = generate_loaded(session, prompt, RunOptions(max_new_tokens=4), on_call=on_call)
    assert last[0].error is None and last[0].tokens == every[0].tokens
    # three prompt steps (buckets 8, 8, 6), the first token from the last; then a decode step a token
    assert heads == [(1, 1)] * (3 + len(last[0].generated) - 1)
    s = last.stats
    per_step = s.prompt.executions // 3
    assert s.prompt.rows == (per_step - 1) * (8 + 8 + 6) + 3


def _table_widths(session):
    """(an on_call hook recording, per call of a kind built per context bucket, its block table's width;
    the widths it records)."""
    widths = []
    context_kinds = {e.kind for e in session.manifest.regions if e.bucket.context is not None}
    signatures = {e.kind: e.inputs for e in session.manifest.regions}

    def on_call(layer, slot, kind, inputs, run):
        if kind in context_kinds:
            widths.append(
                next(x.shape[1] for x, s in zip(inputs, signatures[kind][-len(inputs) :]) if s.name == "block_table")
            )
        return run()

    return on_call, widths


def test_context_buckets_follow_the_longest_sequence(run_exported_bundle, loaded):
    """ "Hello" (6 positions, 16 generated) crosses from the 16-position bucket (1 block) into the
    80-position one (5 blocks) while generating: the golden tokens and logits, and the same as the bundle
    run single-bucket (every step at the largest bucket: a bundle compiled with context = [80] has
    exactly those executables)."""
    session = loaded(run_exported_bundle)
    m = session.manifest
    assert m.buckets.contexts == (16, 80) and session.sizes.context_blocks == (1, 5)
    names = [e.name for e in m.regions]
    assert len(names) == len(set(names)) and "attn_source_r2.decode.b4t8c16" in names
    assert "attn_window.decode.b4t8" in names and not any(
        n.startswith("attn_window") and "c" in n.split(".")[-1] for n in names
    )
    golden = RUNS[0]
    on_call, widths = _table_widths(session)
    [bucketed] = run(session, [golden["prompt_ids"]], on_call=on_call)
    assert widths[0] == 1 and widths[-1] == 5 and widths == sorted(widths)
    largest = dataclasses.replace(session, sizes=dataclasses.replace(session.sizes, context_blocks=(5,)))
    widths.clear()
    [single] = run(largest, [golden["prompt_ids"]], on_call=on_call)
    assert set(widths) == {5}
    tolerance = GOLDEN["noise"]["fp32-quant-lowest"]["tolerance"]
    assert bucketed.error is None
    regenerate.check_run(bucketed.tokens, bucketed.logits, golden, tolerance)
    assert bucketed.tokens == single.tokens
    assert (torch.stack(bucketed.logits) - torch.stack(single.logits)).abs().max() <= tolerance


def copy_bundle(src, tmp_path):
    dst = tmp_path / "bundle"
    shutil.copytree(src, dst)
    return dst


def edit_manifest(bundle, fn):
    path = bundle / "manifest.json"
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data))


def test_altered_weight_file_is_refused(run_exported_bundle, tmp_path):
    b = copy_bundle(run_exported_bundle, tmp_path)
    w = b / "weights" / "rank-0" / "moe.safetensors"
    data = bytearray(w.read_bytes())
    data[-1] ^= 0xFF
    w.write_bytes(bytes(data))
    with pytest.raises(BundleError, match=r"weights/rank-0/moe.safetensors does not match its digest"):
        load(b)


def test_missing_executable_is_refused(run_exported_bundle, tmp_path):
    b = copy_bundle(run_exported_bundle, tmp_path)
    victim = sorted((b / "regions").iterdir())[0]
    victim.unlink()
    with pytest.raises(BundleError, match=f"missing file regions/{victim.name}"):
        load(b)


def test_engram_host_file_is_checked(run_exported_bundle, tmp_path):
    """The host engram tables: one of another shape is refused naming the file and the tensor; a
    manifest that drops them while a layer has engram is refused naming the key."""
    from safetensors.torch import load_file, save_file

    b = copy_bundle(run_exported_bundle, tmp_path)
    host = b / "host/engram.safetensors"
    tables = load_file(str(host))
    tables["layers.1.engram.embed.weight"] = tables["layers.1.engram.embed.weight"][:-1].clone()
    save_file(tables, str(host))
    with pytest.raises(
        TensorFileError,
        match=r"host/engram.safetensors, tensor 'layers.1.engram.embed.weight': "
        r"\[4095, 32\] torch.uint8, expected \[4096, 32\]",
    ):
        load(b, verify=False)
    edit_manifest(b, lambda d: d["host"].pop("engram"))
    with pytest.raises(BundleError, match=r"host: lacks the engram tables \(engram\) its engram layers read"):
        load(b, verify=False)


def test_unknown_format_version_is_refused(run_exported_bundle, tmp_path):
    b = copy_bundle(run_exported_bundle, tmp_path)
    edit_manifest(b, lambda d: d.update(format_version=99))
    with pytest.raises(BundleError, match="format_version 99 is not supported"):
        load(b)


def test_wrong_target_is_refused(run_exported_bundle, tmp_path, monkeypatch):
    b = copy_bundle(run_exported_bundle, tmp_path)
    edit_manifest(b, lambda d: d["target"].update(name="tpu", executable="xla"))
    with pytest.raises(BundleError, match="built for target 'tpu' \\(xla\\); this runtime runs cpu/aoti"):
        load(b)
    edit_manifest(b, lambda d: d["target"].update(name="trn2", executable="neff"))
    monkeypatch.setenv("DEEPINFER_LIBNRT", str(tmp_path / "no-libnrt.so"))
    with pytest.raises(NeuronRuntimeMissing, match="libnrt"):
        load(b)
    edit_manifest(
        b,
        lambda d: d.update(target={"name": "cpu", "executable": "aoti"}, toolchain=dict(d["toolchain"], torch="1.0.0")),
    )
    with pytest.raises(BundleError, match="compiled with torch 1.0.0"):
        load(b)


def test_block_exhaustion_fails_only_the_offending_request(run_exported_bundle):
    """Pool of 4 usable blocks (16 positions each): the 57-token prompt cannot fit, the short ones can."""
    session = load(run_exported_bundle, num_kv_blocks=5)
    long, short = RUNS[1], RUNS[0]
    gens = run(session, [short["prompt_ids"], long["prompt_ids"], RUNS[3]["prompt_ids"]])
    assert gens[1].error is not None and "KV pool exhausted" in gens[1].error
    assert gens[0].error is None and gens[0].generated == short["generated_ids"]
    assert gens[2].error is None and gens[2].generated == RUNS[3]["generated_ids"]


def test_cli_prints_text_json_and_timing(run_exported_bundle, loaded, monkeypatch):
    from deepinfer.runtime.cli import main

    reuse_session(monkeypatch, loaded(run_exported_bundle))
    runner = CliRunner()
    r = runner.invoke(
        main,
        [
            str(run_exported_bundle),
            "--prompt-ids",
            ",".join(map(str, RUNS[0]["prompt_ids"])),
            "--max-new-tokens",
            "4",
            "--json",
            "--timing",
        ],
    )
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["outputs"][0]["generated_ids"] == RUNS[0]["generated_ids"][:4]
    assert out["timing"]["overhead_us_per_call"] > 0 and out["timing"]["regions"]
    r = runner.invoke(main, [str(run_exported_bundle), "--prompt", "Hi", "--max-new-tokens", "2", "--timing"])
    assert r.exit_code == 0 and "region kind" in r.output and "us a region call" in r.output
    r = runner.invoke(main, [str(run_exported_bundle.parent / "nope")])
    assert r.exit_code == 2


def test_cli_refuses_damaged_bundle_in_one_line(run_exported_bundle, tmp_path):
    from deepinfer.runtime.cli import main

    b = copy_bundle(run_exported_bundle, tmp_path)
    edit_manifest(b, lambda d: d.update(format_version=99))
    r = CliRunner().invoke(main, [str(b), "--prompt", "x"])
    assert r.exit_code == 2
    assert r.output.count("\n") == 1 and "format_version 99 is not supported" in r.output
