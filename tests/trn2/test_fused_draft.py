"""A bundle with a DSpark draft on trn2's fused path (issue 42 item 1): each layer the draft reads is a
capture twin of its layer kind (`..._capture`, compiler/plan.py `fused_kinds`), whose one module writes
the layer's features ring between its engram and its attention (compiler/layers.py `ops`).

The compile lowers every layer module to HLO and checks it on XLA:CPU against its ops run eagerly
(`layers.check`), the twins' features ring among the state outputs compared. The finished bundle runs
on the libnrt TEST DOUBLE (doubles/fake_nrt.c) with the stand-in neuronx-cc's TEST DOUBLE NEFFs: it
zero-fills what it does not copy, so tokens and execution counts are plumbing, not Trn2 numerics.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer.bundles import layout
from deepinfer.bundles.manifest import DRAFT_MODULE

from ..conftest import CACHE_ENV, write_model_toml
from .conftest import finished_copy

BIN = Path(sys.executable).parent
DRAFT = '\n[host]\nembedding = true\n\n[speculative]\ndraft = "dspark"\n'
# the tiny model's layers by the fused kind each runs: the draft reads layers 3, 4 and 5
KINDS = [
    "layer_window",
    "layer_window_engram",
    "layer_source_r2",
    "layer_reuse_r2_capture",
    "layer_source_r1_cand_capture",
    "layer_reindex_r1_cand_capture",
]


# a draft step per region call: the context, each of the 3 stages' attention and MoE, the head's
# normalize, the target head's project and the greedy choice (`tokens`, one rank)
PER_REGION_DRAFT_EXECUTIONS = 1 + 3 * 2 + 3


def toml_of(root: Path, ckpt: Path, options: str = "lnc = 1, optlevel = 1") -> Path:
    """The tiny model for trn2 with its DSpark draft, a verify bucket of 6 tokens (its block and anchor)."""
    return write_model_toml(
        root,
        ckpt,
        tiny_layers=6,
        target="trn2",
        executable="neff",
        options=f"{{ {options} }}",
        tokens=(1, 6),
        num_blocks=5,
        extra=DRAFT,
    )


@pytest.fixture(scope="module")
def compiled(tmp_path_factory, tiny_ckpt) -> tuple[Path, str]:
    """The HLO-stage bundle (every layer module checked on XLA:CPU) and what the compile printed."""
    from click.testing import CliRunner

    from deepinfer.compiler.cli import main

    root = tmp_path_factory.mktemp("fused-draft")
    argv = [str(toml_of(root, tiny_ckpt)), "-o", str(root / "bundle"), "--jobs", "1", "--hlo-only"]
    result = CliRunner().invoke(main, [*argv, "--cache-dir", os.environ[CACHE_ENV]])
    assert result.exit_code == 0, result.output
    return root / "bundle", result.output


def test_the_plan_fuses_a_bundle_with_a_draft(tiny_ckpt, tmp_path):
    """`deepinfer plan`: every layer one execution (the twins capture inside), no per-region capture,
    attention or MoE executable; the draft's own executables per region at the batch buckets."""
    from deepinfer.compiler.bundle_plan import plan_bundle
    from deepinfer.compiler.config import load_compile_config

    plan = plan_bundle(load_compile_config(toml_of(tmp_path, tiny_ckpt)), scratch=False)
    d = plan.to_dict()
    assert d["executables"]["fused_layers"] == {k: [i] for i, k in enumerate(KINDS)}
    assert plan.per_step["executions_by_slot"] == {"layer": 6, "head": 1}
    kinds = {e.kind for e in plan.built}
    assert {"dspark_capture", "moe", "engram"}.isdisjoint(kinds) and not any(k.startswith("attn_") for k in kinds)
    assert {"dspark_context", "dspark_attn", "dspark_moe", "dspark_head"} <= kinds


@pytest.mark.slow  # every layer module lowered and run on XLA:CPU: about 3 minutes
def test_the_capture_twins_are_fused_and_checked(compiled):
    bundle, output = compiled
    m = json.loads((bundle / layout.MANIFEST_FILE).read_text())
    assert [layer["fused"] for layer in m["layers"]] == KINDS
    entries = {e["kind"]: e for e in m["regions"]}
    assert "dspark_capture" not in entries and "moe" not in entries
    assert not any(k.startswith("attn_") for k in entries)
    for kind in KINDS[3:]:
        twins = [e for e in m["regions"] if e["kind"] == kind]
        assert {e["bucket"]["tokens"] for e in twins} == {1, 6}, kind
        for e in twins:  # the ring: a state input, written in place (aliased), checked on XLA:CPU
            assert "features" in e["state_outputs"] and e["check"]["score"] <= 1e-5, (kind, e["check"])
            ring = next(s for s in e["inputs"] if s["name"] == "features")
            assert ring["role"] == "state" and e["aliases"][str(e["state_outputs"].index("features"))] == [
                s["name"] for s in e["inputs"]
            ].index("features")
        assert f"lowered {kind}.decode.b1t6c32: HLO " in output
    for kind in KINDS[:3]:  # the layers the draft does not read have no ring
        assert all("features" not in (e.get("state_outputs") or ()) for e in m["regions"] if e["kind"] == kind)
    # the draft step as one module at the batch bucket: its block's drafts out, checked on XLA:CPU
    (module,) = [e for e in m["regions"] if e["kind"] == DRAFT_MODULE]
    assert module["bucket"] == {"batch": 1, "tokens": 5}
    assert [o["name"] for o in module["output_specs"]] == ["drafts"] and module["check"]["score"] == 0
    assert {"h", "pre", "anchor", "features0", "features2"} <= {s["name"] for s in module["inputs"]}
    assert "lowered draft_step.decode.b1t5: HLO " in output


def run_speculative(bundle: Path, libnrt: Path, log: Path) -> dict:
    """`deepinfer-run --speculative --json --timing` of one prompt on the libnrt double."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FAKE_NRT_", "NEURON_"))}
    env.update(DEEPINFER_LIBNRT=str(libnrt), FAKE_NRT_LOG=str(log))
    argv = [str(BIN / "deepinfer-run"), str(bundle), "--prompt-ids", "1,5,9", "--max-new-tokens", "8"]
    done = subprocess.run(
        [*argv, "--speculative", "dspark", "--json", "--timing"], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.slow
def test_the_fused_draft_bundle_speculates_on_the_libnrt_double(compiled, fake_nrt_path, tmp_path):
    """Every target step one execution a layer (the twins write the rings), the head; each draft step
    one execution (the draft's module): no per-region capture, no attention or MoE call of the target,
    no call of the draft's regions."""
    bundle = finished_copy(compiled[0], tmp_path / "finished")
    out = run_speculative(bundle, fake_nrt_path, tmp_path / "nrt.log")
    assert out["outputs"][0]["error"] is None and len(out["outputs"][0]["generated_ids"]) == 8
    timing = out["timing"]
    steps, calls = timing["steps"], {r["kind"]: r["calls"] for r in timing["regions"]}
    assert timing["speculation"]["verify_steps"] >= 1
    drafts = calls[DRAFT_MODULE]
    assert drafts >= timing["speculation"]["verify_steps"]
    assert all(calls[k] == steps for k in KINDS) and calls["head"] == steps
    assert not any(k.startswith(("attn_", "moe", "dspark_")) for k in calls)
    executes = sum(ln.startswith("nrt_execute") for ln in (tmp_path / "nrt.log").read_text().splitlines())
    assert executes == (len(KINDS) + 1) * steps + drafts


@pytest.mark.slow  # one layer module lowered, compiled for 4 XLA:CPU replicas and run: about a minute
def test_a_capture_twin_at_cp_ep_4_matches_the_host_collectives(tmp_path, tiny_ckpt):
    """At cp = ep = 4 a twin holds its kind's collectives (the capture adds none: every rank writes its
    own ring of the streams it holds whole) and on one XLA:CPU replica a rank equals its ops run eagerly."""
    pytest.importorskip("torch_mlir", reason="the trn2 lowering needs the [trn2] extra (torch-mlir)")
    from deepinfer.compiler import layers
    from deepinfer.compiler.config import load_compile_config
    from deepinfer.compiler.pipeline import plan
    from deepinfer.compiler.spec import parse

    from .test_layers import SOURCE_R1_CAND

    toml = write_model_toml(
        tmp_path,
        tiny_ckpt,
        target="trn2",
        executable="neff",
        options="{ lnc = 1, optlevel = 1 }",
        num_blocks=5,
        parallel=(1, 4, 4),
        extra=DRAFT,
    )
    spec = parse(load_compile_config(toml), True, lambda msg: None)
    regions = plan(spec, lambda msg: None)
    kind = "layer_source_r1_cand_capture"
    lk = regions.fused_kinds()[kind]
    assert lk.layers == (4,) and dict(lk.slots)["capture"] == "dspark_capture"
    exe = next(e for e in spec.executables(regions) if e.kind == kind)
    entry, _, _ = layers.trace(spec, regions, lk, exe, tmp_path / f"{exe.name}.hlo.pb", lambda msg: None)
    assert [f"{c.op} {c.value}" for c in entry.collectives or ()] == SOURCE_R1_CAND
    assert entry.check is not None and entry.check["replicas"] == 4 and entry.check["score"] <= 1e-5
    assert "features" in (entry.state_outputs or ())


@pytest.mark.slow  # a compile (no XLA:CPU check) with the stand-in neuronx-cc, then a run on the double
def test_a_refused_capture_twin_runs_per_region_with_its_capture(tiny_ckpt, tmp_path, fake_nrt_path):
    """neuronx-cc refusing a capture twin (compiler/fallback.py): its layer runs as its regions and the
    draft's capture region (compiled at every bucket for it), the other layers fused."""
    from .test_fallback import compile_cli

    twin = "layer_reuse_r2_capture"
    done = compile_cli(
        toml_of(tmp_path, tiny_ckpt, "lnc = 1, optlevel = 1, check = false"), tmp_path / "fell", rf"^{twin}\."
    )
    assert done.returncode == 0, done.stderr
    m = json.loads((tmp_path / "fell" / layout.MANIFEST_FILE).read_text())
    assert [layer.get("fused") for layer in m["layers"]] == [*KINDS[:3], None, *KINDS[4:]]
    built = {(e["kind"], e["bucket"]["tokens"]) for e in m["regions"]}
    assert {(k, t) for k in ("attn_reuse_r2", "moe", "dspark_capture") for t in (1, 6)} <= built
    out = run_speculative(tmp_path / "fell", fake_nrt_path, tmp_path / "nrt.log")
    assert out["outputs"][0]["error"] is None and len(out["outputs"][0]["generated_ids"]) == 8
    timing = out["timing"]
    steps, calls = timing["steps"], {r["kind"]: r["calls"] for r in timing["regions"]}
    assert calls["dspark_capture"] == calls["attn_reuse_r2"] == calls["moe"] == steps and twin not in calls
    executes = sum(ln.startswith("nrt_execute") for ln in (tmp_path / "nrt.log").read_text().splitlines())
    assert executes == (len(KINDS) + 3) * steps + calls[DRAFT_MODULE]


@pytest.mark.slow  # a compile (no XLA:CPU check) with the stand-in neuronx-cc, then a run on the double
def test_a_refused_draft_module_drafts_per_region(tiny_ckpt, tmp_path, fake_nrt_path):
    """neuronx-cc refusing the draft step's module (compiler/fallback.py): the module is dropped, the
    draft's regions (in the bundle already) run its steps, the layers stay fused."""
    from .test_fallback import CODE, compile_cli

    done = compile_cli(
        toml_of(tmp_path, tiny_ckpt, "lnc = 1, optlevel = 1, check = false"), tmp_path / "fell", rf"^{DRAFT_MODULE}\."
    )
    assert done.returncode == 0, done.stderr
    assert (
        f"neuronx-cc refused fused the draft step's module {DRAFT_MODULE} at bucket batch 1 x tokens 5 with {CODE}"
        in (done.stderr)
    )
    m = json.loads((tmp_path / "fell" / layout.MANIFEST_FILE).read_text())
    assert [layer["fused"] for layer in m["layers"]] == KINDS and list(m["fallback"]) == [DRAFT_MODULE]
    assert DRAFT_MODULE not in {e["kind"] for e in m["regions"]}
    out = run_speculative(tmp_path / "fell", fake_nrt_path, tmp_path / "nrt.log")
    assert out["outputs"][0]["error"] is None and len(out["outputs"][0]["generated_ids"]) == 8
    timing = out["timing"]
    steps, calls = timing["steps"], {r["kind"]: r["calls"] for r in timing["regions"]}
    drafts = calls["dspark_context"]
    assert drafts >= timing["speculation"]["verify_steps"] and DRAFT_MODULE not in calls
    executes = sum(ln.startswith("nrt_execute") for ln in (tmp_path / "nrt.log").read_text().splitlines())
    assert executes == (len(KINDS) + 1) * steps + PER_REGION_DRAFT_EXECUTIONS * drafts


@pytest.mark.slow  # an HLO-stage compile at two ranks (no XLA:CPU check), then a session on the doubles
def test_a_two_rank_session_drafts_with_the_module(tiny_ckpt, tmp_path, session_env):
    """ep = 2 (EP dispatch, two token groups): each draft step is one execution of the draft module on
    each rank, its dispatch collectives and pick all-gathers inside; the ranks' collective calls match
    one for one (runtime/draft.py `module_step`, the followers' `choose`); greedy steps run the head's
    `best` (its pairs, not its logits, leave the device)."""
    from click.testing import CliRunner

    from deepinfer.compiler.cli import main
    from deepinfer.runtime import RunOptions, generate
    from deepinfer.runtime.bundle import open_bundle

    toml = write_model_toml(
        tmp_path,
        tiny_ckpt,
        target="trn2",
        executable="neff",
        options="{ lnc = 1, optlevel = 1, check = false }",
        tokens=(1, 6),
        num_blocks=5,
        parallel=(1, 2, 1),
        extra=DRAFT,
    )
    argv = [str(toml), "-o", str(tmp_path / "hlo"), "--jobs", "1", "--hlo-only"]
    result = CliRunner().invoke(main, [*argv, "--cache-dir", os.environ[CACHE_ENV]])
    assert result.exit_code == 0, result.output
    bundle = finished_copy(tmp_path / "hlo", tmp_path / "finished")
    m = open_bundle(bundle).manifest
    (module,) = [e for e in m.regions if e.kind == DRAFT_MODULE]
    dispatch = ["all_gather"] * 3 + ["reduce_scatter"]
    assert [c.op for c in module.collectives or ()] == dispatch * 3 + ["all_gather"] * 5
    options = RunOptions(max_new_tokens=8, speculative="dspark", collective_timeout_s=60, timeout_s=600)
    done = generate(bundle, [[1, 5, 9]], options)
    assert done[0].error is None and len(done[0].tokens) == 3 + 8
    stats = done.stats
    drafts = stats.calls[DRAFT_MODULE]
    assert drafts >= 1 and not any(k.startswith("dspark_") for k in stats.calls)
    # greedy verify steps: the head picks in its graph (`Head.best`), only pairs cross ranks
    assert stats.calls["head.best"] >= 1 and "logits all-gather" not in done.sent[0]
    executes = {
        r: [ln for ln in session_env.read_text().splitlines() if ln.startswith("nrt_execute") and f" rank={r} " in ln]
        for r in range(2)
    }  # the executions of modules with collectives: every fused layer's and the draft module's
    assert len(executes[0]) == len(executes[1]) == len(m.layers) * stats.steps + drafts
