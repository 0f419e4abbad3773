"""A compile that survives neuronx-cc's refusals (compiler/fallback.py), against TEST DOUBLES.

The stand-in neuronx-cc (doubles/neuronx-cc, a TEST DOUBLE: its NEFFs hold no code) fails the modules
whose output name matches FAKE_NEURONX_CC_FAIL_MATCH with the error line neuronx-cc prints for
NCC_IBIR297 (the internal error of aws-neuron-sdk issue 1362 on an MLA + 256-expert decode graph).
The compiles run `deepinfer-compile` itself, the bundles `deepinfer-run` on the libnrt TEST DOUBLE
(doubles/fake_nrt.c), which zero-fills what it does not copy: tokens and execution counts are
plumbing, not Trn2 numerics.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer.bundles import layout, manifest_io
from deepinfer.bundles.manifest import BundleError
from deepinfer.compiler.jobs import keep_failed_logs
from deepinfer.compiler.targets.neuronxcc import NeuronRefused
from deepinfer.compiler.targets.trn2 import Trn2Target

from ..conftest import write_model_toml
from .conftest import STAND_IN, finished_copy

BIN = Path(sys.executable).parent
CODE = "NCC_IBIR297"
REFUSED = "layer_source_r2"  # the tiny model's layer 2: attn_source_r2 and the MoE
FUSED_PER_STEP = 8  # the embedding, six layers, the head


def compile_cli(toml: Path, out: Path, fail: str | None) -> subprocess.CompletedProcess:
    """`deepinfer-compile` with the stand-in neuronx-cc failing the modules `fail` matches."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKE_NEURONX_CC_")}
    env.update(DEEPINFER_NEURONX_CC=str(STAND_IN), FAKE_NEURONX_CC_PYTHON=sys.executable)
    if fail is not None:
        env.update(FAKE_NEURONX_CC_FAIL=CODE, FAKE_NEURONX_CC_FAIL_MATCH=fail)
    # no cache: each compile meets the stand-in refusal afresh (refusals are not cached)
    argv = [str(BIN / "deepinfer-compile"), str(toml), "-o", str(out), "--jobs", "2", "--no-cache"]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1200)


def run_cli(bundle: Path, libnrt: Path, log: Path) -> dict:
    """`deepinfer-run --json --timing` of one prompt on the libnrt double."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FAKE_NRT_", "NEURON_"))}
    env.update(DEEPINFER_LIBNRT=str(libnrt), FAKE_NRT_LOG=str(log))
    argv = [str(BIN / "deepinfer-run"), str(bundle), "--prompt-ids", "1,5,9", "--max-new-tokens", "2"]
    done = subprocess.run([*argv, "--json", "--timing"], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def toml_of(root: Path, ckpt: Path, options: str = "lnc = 1, optlevel = 1, check = false") -> Path:
    """The tiny model for trn2 (the XLA:CPU check off: tests/trn2/test_lowering.py runs it)."""
    return write_model_toml(root, ckpt, tiny_layers=6, target="trn2", executable="neff", options=f"{{ {options} }}")


def error_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("error:") or "Traceback" in ln]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory, tiny_ckpt, trn2_hlo_bundle) -> dict:
    """The tiny model for trn2 compiled with the stand-in refusing layer kind layer_source_r2's module
    ("fell"), and the suite's tiny HLO-stage bundle finished by it with nothing refused ("fused")."""
    root = tmp_path_factory.mktemp("fallback")
    toml = toml_of(root, tiny_ckpt)
    fell = compile_cli(toml, root / "fell", rf"^{REFUSED}\.")
    finished_copy(trn2_hlo_bundle, root / "fused")
    return {"root": root, "toml": toml, "fell": fell}


@pytest.mark.slow
def test_a_refused_fused_kind_is_compiled_per_region(compiled):
    root, done = compiled["root"], compiled["fell"]
    assert done.returncode == 0, done.stderr
    said = [ln for ln in done.stderr.splitlines() if ln.startswith("neuronx-cc refused")]
    kept = layout.failed_logs(root / "fell")
    assert said == [
        f"neuronx-cc refused fused layer kind {REFUSED} at bucket batch 1 x tokens 1, context 32 with {CODE}; "
        f'compiling its 1 bucket(s) per region instead ([target] options fallback = "regions"); '
        f"log: {kept / f'{REFUSED}.decode.b1t1c32.log'}"
    ]
    assert not error_lines(done.stderr)
    lines = done.stderr.splitlines()  # what it costs, then the summary naming it
    cost = lines.index(next(ln for ln in lines if ln.startswith("fallback of ")))
    assert lines[cost] == (
        f"fallback of {REFUSED} (layers 2 per region): {FUSED_PER_STEP} -> {FUSED_PER_STEP + 1} device executions "
        "per decode step and rank, 0 -> 0 collectives on the host"
    )
    assert lines[cost + 1].startswith("  batch 1 x context 32: modelled step ")
    assert lines[-1].startswith(f"wrote {root / 'fell'} in ") and lines[-1].endswith(f"; {REFUSED} per region ({CODE})")
    log = kept / f"{REFUSED}.decode.b1t1c32.log"
    assert f"[{CODE}]" in log.read_text() and sorted(p.name for p in kept.iterdir()) == [log.name]
    m = json.loads((root / "fell" / layout.MANIFEST_FILE).read_text())
    bucket = {"batch": 1, "tokens": 1, "context": 32}
    assert m["fallback"] == {REFUSED: {"buckets": [bucket], "bucket": bucket, "code": CODE, "log": log.name}}
    assert [layer.get("fused") for layer in m["layers"]] == [
        "layer_window",
        "layer_window_engram",
        None,
        "layer_reuse_r2",
        "layer_source_r1_cand",
        "layer_reindex_r1_cand",
    ]
    kinds = sorted(e["kind"] for e in m["regions"])
    assert REFUSED not in kinds and {"attn_source_r2", "moe"} <= set(kinds) and len(kinds) == FUSED_PER_STEP + 1
    assert not any(p.name.startswith((REFUSED, ".")) for p in (root / "fell" / layout.REGIONS_DIR).iterdir())
    assert (root / "fell" / "logs" / log.name).is_file()  # the bundle keeps the refused log too
    m["fallback"]["layer_window"] = m["fallback"][REFUSED]  # a manifest that says both is refused
    with pytest.raises(BundleError, match="fallback.layer_window: compiled per region, but layer 0 runs it fused"):
        manifest_io.parse(m, "manifest.json")


@pytest.mark.slow
def test_the_fallback_bundle_runs_on_the_libnrt_double(compiled, fake_nrt_path, tmp_path):
    """Layer 2 runs as its attention and MoE executables, the other layers fused, the same tokens as
    the all-fused bundle (the double zero-fills the logits: plumbing, not numerics)."""
    root = compiled["root"]
    runs = {name: run_cli(root / name, fake_nrt_path, tmp_path / f"{name}.log") for name in ("fell", "fused")}
    assert runs["fell"]["outputs"][0]["generated_ids"] == runs["fused"]["outputs"][0]["generated_ids"]
    assert runs["fell"]["outputs"][0]["error"] is None
    steps = runs["fell"]["timing"]["steps"]
    calls = {r["kind"]: r["calls"] for r in runs["fell"]["timing"]["regions"]}
    assert REFUSED not in calls and calls["attn_source_r2"] == calls["moe"] == steps
    assert REFUSED in {r["kind"] for r in runs["fused"]["timing"]["regions"]}
    executes = {
        name: sum(ln.startswith("nrt_execute") for ln in (tmp_path / f"{name}.log").read_text().splitlines())
        for name in runs
    }
    assert executes == {"fell": (FUSED_PER_STEP + 1) * steps, "fused": FUSED_PER_STEP * steps}


@pytest.mark.slow
def test_fallback_none_stops_the_compile(tiny_ckpt, tmp_path):
    toml = toml_of(tmp_path, tiny_ckpt, 'lnc = 1, optlevel = 1, check = false, fallback = "none"')
    done = compile_cli(toml, tmp_path / "out", rf"^{REFUSED}\.")
    assert done.returncode == 2
    kept = layout.failed_logs(tmp_path / "out")
    assert error_lines(done.stderr) == [
        f"error: region {REFUSED}.decode.b1t1c32: neuronx-cc failed with {CODE}: stand-in failure requested "
        'through FAKE_NEURONX_CC_FAIL (INTERNAL_ERROR); [target] options fallback = "none" (set "regions" to '
        f"compile a refused layer kind per region) (log: {kept / f'{REFUSED}.decode.b1t1c32.log'})"
    ]
    assert "refused fused layer kind" not in done.stderr
    assert not (tmp_path / "out").exists() and (kept / f"{REFUSED}.decode.b1t1c32.log").is_file()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging left


@pytest.mark.slow
def test_a_refused_region_of_the_fallback_stops_the_compile(tiny_ckpt, tmp_path):
    toml = toml_of(tmp_path, tiny_ckpt)
    done = compile_cli(toml, tmp_path / "out", r"source_r2\.")  # the fused kind and its attention region
    assert done.returncode == 2
    kept = layout.failed_logs(tmp_path / "out")
    assert [ln for ln in done.stderr.splitlines() if "refused fused layer kind" in ln][0].startswith(
        f"neuronx-cc refused fused layer kind {REFUSED} "
    )
    assert error_lines(done.stderr) == [
        f"error: region attn_source_r2.decode.b1t1c32: neuronx-cc failed with {CODE}: stand-in failure requested "
        f"through FAKE_NEURONX_CC_FAIL (INTERNAL_ERROR); it is a region of layer kind {REFUSED}, which neuronx-cc "
        f"refused fused: no form is left (log: {kept / 'attn_source_r2.decode.b1t1c32.log'})"
    ]
    assert not (tmp_path / "out").exists()
    assert {f"{REFUSED}.decode.b1t1c32.log", "attn_source_r2.decode.b1t1c32.log"} <= {p.name for p in kept.iterdir()}


def test_a_refusal_travels_with_its_code_and_region(tmp_path):
    """A compile worker raises it (pickled to the leader), and keeping the logs keeps both."""
    error = NeuronRefused(
        f"region x.decode.b1t1: neuronx-cc failed with {CODE}: boom (log: {tmp_path}/x.log)", CODE, "x"
    )
    back = pickle.loads(pickle.dumps(error))
    assert (type(back), str(back), back.code, back.region) == (NeuronRefused, str(error), CODE, "x")
    (tmp_path / "x.log").write_text("log")
    kept = keep_failed_logs(back, tmp_path, tmp_path / "out")
    assert isinstance(kept, NeuronRefused) and (kept.code, kept.region) == (CODE, "x")
    assert str(layout.failed_logs(tmp_path / "out")) in str(kept)


def test_the_fallback_option(tmp_path):
    assert Trn2Target("neff", {}).fallback == "regions"
    assert Trn2Target("neff", {"fallback": "none"}).fallback == "none"
    assert (
        Trn2Target.check_options({"fallback": "maybe"}) == "option fallback = 'maybe' is not one of 'regions', 'none'"
    )
    # it changes no executable (only whether a refused kind's regions are built): out of cache keys
    assert "fallback" not in Trn2Target("neff", {"fallback": "none", "lnc": 1}).keyed_options()


def plan_cli(toml: Path, *args: str) -> subprocess.CompletedProcess:
    argv = [str(BIN / "deepinfer"), "plan", str(toml), "--no-scratch", "--no-cache", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("parallel", [(1, 1, 1), (1, 2, 1)])
def test_plan_counts_a_fallen_back_kind_per_region(tiny_ckpt, tmp_path, parallel):
    """The plan's step: the kind's layer as its regions' calls (attention, MoE), its collectives out of
    the executables but the boundary all-reduces (EP dispatch's go to the host); each bucket's modelled
    time grows by at least the launches added."""
    from deepinfer.compiler import fallback_cost
    from deepinfer.compiler.bundle_plan import plan_bundle
    from deepinfer.compiler.config import load_compile_config
    from deepinfer.compiler.targets.trn2_figures import RANK_FIGURES

    toml = write_model_toml(
        tmp_path, tiny_ckpt, target="trn2", executable="neff", options="{ lnc = 1 }", parallel=parallel
    )
    plan = plan_bundle(load_compile_config(toml), scratch=False)
    fell = fallback_cost.report(plan, [REFUSED])
    assert fell["layers"] == [2] and fell["executions"] == {"fused": FUSED_PER_STEP, "fallback": FUSED_PER_STEP + 1}
    on_host = 2 if parallel == (1, 2, 1) else 0  # the layer's dispatch all-gather and combine reduce-scatter
    logits = 1 if parallel == (1, 2, 1) else 0
    assert fell["collectives_on_host"] == {"fused": logits, "fallback": logits + on_host}
    launch = RANK_FIGURES["launch_s"].value * 1e3
    assert fell["buckets"] and all(b["fallback_ms"] >= b["fused_ms"] + launch - 1e-9 for b in fell["buckets"])
    import dataclasses

    step = dataclasses.replace(plan, per_region=frozenset([REFUSED])).per_step
    assert step["executions_by_slot"] == {"embed": 1, "layer": 5, "attn": 1, "moe": 1, "head": 1}


def test_plan_fallback_option(tiny_ckpt, tmp_path):
    toml = write_model_toml(tmp_path, tiny_ckpt, target="trn2", executable="neff", options="{ lnc = 1 }")
    done = plan_cli(toml, "--fallback", REFUSED)
    assert done.returncode == 0, done.stderr
    said = done.stdout.splitlines()
    first = said.index(next(ln for ln in said if ln.startswith("fallback of ")))
    assert said[first] == (
        f"fallback of {REFUSED} (layers 2 per region): {FUSED_PER_STEP} -> {FUSED_PER_STEP + 1} device executions "
        "per decode step and rank, 0 -> 0 collectives on the host"
    )
    assert said[first + 1].startswith("  batch 1 x context 32: modelled step ")
    as_json = json.loads(plan_cli(toml, "--fallback", REFUSED, "--json").stdout)
    assert as_json["fallback"]["executions"] == {"fused": FUSED_PER_STEP, "fallback": FUSED_PER_STEP + 1}
    bad = plan_cli(toml, "--fallback", "attn_source_r2")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "error: --fallback attn_source_r2: not a fused layer kind of this compile; its layer kinds: layer_window, "
        "layer_window_engram, layer_source_r2, layer_reuse_r2, layer_source_r1_cand, layer_reindex_r1_cand"
    ]


def test_finish_does_not_fall_back_and_says_so(trn2_hlo_bundle, tmp_path, stub, monkeypatch):
    """An HLO-stage bundle holds no region modules for its fused kinds: finishing one stops at a
    refusal, in one line that says where the fallback happens."""
    from deepinfer.compiler.finish import finish_bundle

    bundle = tmp_path / "bundle"
    shutil.copytree(trn2_hlo_bundle, bundle)
    monkeypatch.setenv("FAKE_NEURONX_CC_FAIL", CODE)
    monkeypatch.setenv("FAKE_NEURONX_CC_FAIL_MATCH", rf"^{REFUSED}\.")
    with pytest.raises(NeuronRefused) as err:
        finish_bundle(bundle, log=lambda msg: None)
    kept = layout.failed_logs(bundle) / f"{REFUSED}.decode.b1t1c32.log"
    assert str(err.value) == (
        f"region {REFUSED}.decode.b1t1c32: neuronx-cc failed with {CODE}: stand-in failure requested through "
        "FAKE_NEURONX_CC_FAIL (INTERNAL_ERROR); --finish does not fall back to the layer's regions: compile from "
        f"model.toml where neuronx-cc is (log: {kept})"
    )
    assert kept.is_file() and json.loads((bundle / layout.MANIFEST_FILE).read_text())["stage"] == "hlo"
