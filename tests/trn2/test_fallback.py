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
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer.bundles import layout
from deepinfer.compiler.jobs import keep_failed_logs
from deepinfer.compiler.targets.neuronxcc import NeuronRefused
from deepinfer.compiler.targets.trn2 import Trn2Target

from ..conftest import CACHE_ENV, write_model_toml
from .conftest import STAND_IN

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
    argv = [str(BIN / "deepinfer-compile"), str(toml), "-o", str(out), "--jobs", "2"]
    return subprocess.run(
        [*argv, "--cache-dir", os.environ[CACHE_ENV]], env=env, capture_output=True, text=True, timeout=1200
    )


def run_cli(bundle: Path, libnrt: Path, log: Path) -> dict:
    """`deepinfer-run --json --timing` of one prompt on the libnrt double."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FAKE_NRT_", "NEURON_"))}
    env.update(DEEPINFER_LIBNRT=str(libnrt), FAKE_NRT_LOG=str(log))
    argv = [str(BIN / "deepinfer-run"), str(bundle), "--prompt-ids", "1,5,9", "--max-new-tokens", "2"]
    done = subprocess.run([*argv, "--json", "--timing"], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def toml_of(root: Path, ckpt: Path, options: str = "lnc = 1, optlevel = 1") -> Path:
    return write_model_toml(root, ckpt, tiny_layers=6, target="trn2", executable="neff", options=f"{{ {options} }}")


def error_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("error:") or "Traceback" in ln]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory, tiny_ckpt) -> dict:
    """The tiny model for trn2 compiled twice through the shared cache: with the stand-in refusing
    layer kind layer_source_r2's module, and with nothing refused (all fused)."""
    root = tmp_path_factory.mktemp("fallback")
    toml = toml_of(root, tiny_ckpt)
    fell = compile_cli(toml, root / "fell", rf"^{REFUSED}\.")
    fused = compile_cli(toml, root / "fused", None)
    return {"root": root, "toml": toml, "fell": fell, "fused": fused}


@pytest.mark.slow
def test_a_refused_fused_kind_is_compiled_per_region(compiled):
    root, done = compiled["root"], compiled["fell"]
    assert done.returncode == 0, done.stderr
    said = [ln for ln in done.stderr.splitlines() if CODE in ln]
    kept = layout.failed_logs(root / "fell")
    assert said == [
        f"neuronx-cc refused fused layer kind {REFUSED} at bucket batch 1 x tokens 1, context 32 with {CODE}; "
        f'compiling its 1 bucket(s) per region instead ([target] options fallback = "regions"); '
        f"log: {kept / f'{REFUSED}.decode.b1t1c32.log'}"
    ]
    assert not error_lines(done.stderr)
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


@pytest.mark.slow
def test_the_fallback_bundle_runs_on_the_libnrt_double(compiled, fake_nrt_path, tmp_path):
    """Layer 2 runs as its attention and MoE executables, the other layers fused, the same tokens as
    the all-fused bundle (the double zero-fills the logits: plumbing, not numerics)."""
    assert compiled["fused"].returncode == 0, compiled["fused"].stderr
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
def test_fallback_none_stops_the_compile(compiled, tiny_ckpt, tmp_path):
    toml = toml_of(tmp_path, tiny_ckpt, 'lnc = 1, optlevel = 1, fallback = "none"')
    done = compile_cli(toml, tmp_path / "out", rf"^{REFUSED}\.")
    assert done.returncode == 2
    kept = layout.failed_logs(tmp_path / "out")
    assert error_lines(done.stderr) == [
        f"error: region {REFUSED}.decode.b1t1c32: neuronx-cc failed with {CODE}: stand-in failure requested "
        f"through FAKE_NEURONX_CC_FAIL (INTERNAL_ERROR) (log: {kept / f'{REFUSED}.decode.b1t1c32.log'}); "
        '[target] options fallback = "none" (set "regions" to compile a refused layer kind per region)'
    ]
    assert "refused fused layer kind" not in done.stderr
    assert not (tmp_path / "out").exists() and (kept / f"{REFUSED}.decode.b1t1c32.log").is_file()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging left


@pytest.mark.slow
def test_a_refused_region_of_the_fallback_stops_the_compile(compiled, tiny_ckpt, tmp_path):
    toml = toml_of(tmp_path, tiny_ckpt)
    done = compile_cli(toml, tmp_path / "out", r"source_r2\.")  # the fused kind and its attention region
    assert done.returncode == 2
    kept = layout.failed_logs(tmp_path / "out")
    assert [ln for ln in done.stderr.splitlines() if "refused fused layer kind" in ln][0].startswith(
        f"neuronx-cc refused fused layer kind {REFUSED} "
    )
    assert error_lines(done.stderr) == [
        f"error: region attn_source_r2.decode.b1t1c32: neuronx-cc failed with {CODE}: stand-in failure requested "
        f"through FAKE_NEURONX_CC_FAIL (INTERNAL_ERROR) (log: {kept / 'attn_source_r2.decode.b1t1c32.log'}); "
        f"it is a region of layer kind {REFUSED}, which neuronx-cc refused fused: no form of it is left"
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
