"""`deepinfer doctor`, run as the real CLI in subprocesses.

On this machine (no Neuron SDK): every stage SKIPs with what is missing, exit 0. With the TEST
DOUBLES (the libnrt double tests/trn2/doubles/fake_nrt.c and the stand-in neuronx-cc): the double
computes nothing, so the doctor's compares with XLA:CPU pass only where the test hands the double
the answers ($FAKE_NRT_ANSWERS) the doctor kept as its XLA:CPU references on a first run; the
figures written are the double's timings (host memory copies), not Trn2's. Each stage is then made
to FAIL in turn: one FAIL line, exit 1, the other stages as they should be.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import STAND_IN, fnv1a

ROOT = Path(__file__).resolve().parents[2]
STAGES = ("toolchain", "modules", "collectives", "measurements")


def doctor(*args: str, env: dict | None = None, cwd: Path, timeout: float = 1500) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "deepinfer", "doctor", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def bare_env(tmp: Path) -> dict:
    """This machine without any Neuron SDK piece: no libnrt, no neuronx-cc on PATH."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("DEEPINFER_", "FAKE_NRT", "FAKE_NEURONX", "NEURON"))
    }
    env["PATH"] = os.pathsep.join(
        p for p in env.get("PATH", "").split(os.pathsep) if not Path(p, "neuronx-cc").exists()
    )
    env["XDG_CACHE_HOME"] = str(tmp / "xdg")
    env["TMPDIR"] = str(tmp)
    return env


def lines(out: str) -> dict[str, str]:
    """{stage: its line}; every non-empty line must be one stage's."""
    got = {}
    for line in out.strip().splitlines():
        status, rest = line.split(" ", 1)
        stage, _ = rest.split(": ", 1)
        assert status in ("PASS", "FAIL", "SKIP") and stage in STAGES, line
        got[stage] = line
    return got


def test_bare_machine_skips_every_stage(tmp_path):
    """No SDK here: four lines, every stage SKIP naming what is missing, exit 0, no figures file."""
    proc = doctor("--work", str(tmp_path / "w"), env=bare_env(tmp_path), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = lines(proc.stdout)
    assert list(got) == list(STAGES)
    assert all(line.startswith("SKIP ") for line in got.values()), got
    assert "neuronx-cc not found on PATH" in got["toolchain"] and "libnrt not found" in got["toolchain"]
    for stage in STAGES[1:]:
        assert "neuronx-cc not found on PATH" in got[stage] and "libnrt not found" in got[stage], got[stage]
    assert not (tmp_path / "deepinfer-figures.json").exists()

    proc = doctor("--json", "--work", str(tmp_path / "w"), env=bare_env(tmp_path), cwd=tmp_path)
    assert proc.returncode == 0
    report = json.loads(proc.stdout)
    assert [s["stage"] for s in report["stages"]] == list(STAGES)
    assert {s["status"] for s in report["stages"]} == {"SKIP"} and report["exit"] == 0
    assert report["figures"] is None and len(proc.stderr.strip().splitlines()) == 4


def test_unreadable_bundle_is_one_line_exit_2(tmp_path):
    (tmp_path / "b").mkdir()
    proc = doctor("--bundle", str(tmp_path / "b"), "--work", str(tmp_path / "w"), env=bare_env(tmp_path), cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and str(tmp_path / "b") in proc.stderr, proc.stderr


# --- with the doubles -----------------------------------------------------------------------------


def doubled_env(tmp: Path, fake_nrt_path: Path, answers: Path | None, **extra: str) -> dict:
    """The libnrt double on DEEPINFER_LIBNRT and the stand-in neuronx-cc (both TEST DOUBLES)."""
    env = bare_env(tmp)
    env.update(
        DEEPINFER_LIBNRT=str(fake_nrt_path),
        DEEPINFER_NEURONX_CC=str(STAND_IN),
        FAKE_NEURONX_CC_PYTHON=sys.executable,
        FAKE_NRT_COLLECTIVES_DIR=str(tmp / "meet"),  # the two rank processes wait for each other
    )
    (tmp / "meet").mkdir(exist_ok=True)
    if answers is not None:
        env["FAKE_NRT_ANSWERS"] = str(answers)
    env.update(extra)
    return env


def answers_from(work: Path, dest: Path, stages: tuple[str, ...]) -> Path:
    """The doctor's kept XLA:CPU outputs of `stages` (<stage>/reference/<neff>.<output>) as the
    double's answers: <FNV-1a of the NEFF's bytes>.<output>."""
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    for stage in stages:
        for ref in (work / stage / "reference").iterdir():
            neff_name, output = ref.name.split(".neff.")
            (neff,) = [p for p in (work / stage).rglob(f"{neff_name}.neff") if "reference" not in p.parts]
            shutil.copy(ref, dest / f"{fnv1a(neff.read_bytes())}.{output}")
    return dest


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, fake_nrt_path):
    """One doctor run with the doubles and no answers: the double's zeros differ from XLA:CPU, so
    modules, collectives and measurements FAIL; what it built and kept stays in its work dir."""
    tmp = tmp_path_factory.mktemp("doctor")
    env = doubled_env(tmp, fake_nrt_path, None)
    proc = doctor("--work", str(tmp / "work"), "--runs", "3", "--hbm-mib", "1", env=env, cwd=tmp)
    return tmp, proc


@pytest.mark.slow
def test_the_double_computes_nothing_so_compares_fail(first_run):
    tmp, proc = first_run
    assert proc.returncode == 1, proc.stdout + proc.stderr
    got = lines(proc.stdout)
    assert got["toolchain"].startswith("PASS toolchain: neuronx-cc 2.99.0.0+0000000d, libnrt 2.99.0.0 (fake_nrt")
    assert got["modules"].startswith("FAIL modules: "), got["modules"]
    assert " kinds differ; the first: kind " in got["modules"]
    assert "on the NeuronCore differs from XLA:CPU" in got["modules"]
    assert got["collectives"].startswith("FAIL collectives: all_reduce.1024 (2 ranks) rank 0: output 0 differs")
    assert got["measurements"].startswith("FAIL measurements: measurement probe launch: output 0 differs")
    assert not (tmp / "deepinfer-figures.json").exists()


def _run(tmp: Path, fake_nrt_path: Path, stages: tuple[str, ...], *args: str, **extra: str):
    answers = answers_from(tmp / "work", tmp / "answers", stages)
    env = doubled_env(tmp, fake_nrt_path, answers, **extra)
    return doctor("--work", str(tmp / "work"), "--runs", "3", "--hbm-mib", "1", *args, env=env, cwd=tmp)


@pytest.mark.slow
def test_every_stage_passes_on_the_doubles_with_answers(first_run, fake_nrt_path):
    """With the recorded answers every stage PASSes; the figures file (the double's timings) parses
    in the shared format, every figure a key the step model knows, collectives by payload size."""
    from deepinfer.compiler.targets.trn2_figures import DEVICE_FIGURES, RANK_FIGURES

    tmp, _ = first_run
    bundle = tmp / "work" / "modules" / "neff"  # the doctor's own finished tiny bundle fits this host
    proc = _run(tmp, fake_nrt_path, ("modules", "collectives", "measurements"), "--json", "--bundle", str(bundle))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = lines(proc.stderr)
    assert all(line.startswith("PASS ") for line in got.values()), got
    assert got["modules"].startswith("PASS modules: ") and "kinds compiled by neuronx-cc agree" in got["modules"]
    report = json.loads(proc.stdout)
    assert report["exit"] == 0 and report["figures_file"] == str(tmp / "deepinfer-figures.json")
    figures = json.loads((tmp / "deepinfer-figures.json").read_text())
    assert figures["deepinfer_figures"] == 1 and figures == report["figures"]
    on = figures["measured_on"]
    assert on["neuronx_cc"] == "2.99.0.0+0000000d" and on["libnrt"].startswith("2.99.0.0") and on["lnc"] == 2
    assert set(on) == {"host", "instance_type", "neuronx_cc", "libnrt", "lnc", "when"}
    assert set(figures["figures"]) == {"launch_s", "hbm_bytes_per_s", "host_link_bytes_per_s", "collective_s"}
    assert set(figures["figures"]) <= set(DEVICE_FIGURES) | set(RANK_FIGURES)
    for fig in figures["figures"].values():
        assert isinstance(fig["value"], float) and fig["value"] >= 0 and fig["how"]
    for op in ("all_reduce", "all_gather"):
        sizes = [row[0] for row in figures["collectives"][op]]
        assert sizes == sorted(sizes) and sizes[0] == 1024 and len(sizes) == 4
    assert figures["figures"]["collective_s"]["value"] == figures["collectives"]["all_reduce"][0][1]
    kinds = next(s for s in report["stages"] if s["stage"] == "modules")["details"]["kinds"]
    assert any(k.startswith("layer_") for k in kinds) and "head" in kinds


@pytest.mark.slow
def test_a_failed_toolchain_skips_every_device_stage(first_run, fake_nrt_path):
    tmp, _ = first_run
    proc = _run(tmp, fake_nrt_path, STAGES[1:], FAKE_NRT_FAIL="nrt_init=1")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    got = lines(proc.stdout)
    assert got["toolchain"].startswith("FAIL toolchain: ") and "nrt_init failed" in got["toolchain"], got
    assert all(got[s] == f"SKIP {s}: toolchain failed" for s in STAGES[1:]), got


@pytest.mark.slow
@pytest.mark.parametrize(
    "stage, expect",
    [("modules", "on the NeuronCore differs from XLA:CPU"), ("measurements", "measurement probe launch")],
)
def test_a_device_stage_that_differs_fails_alone(first_run, fake_nrt_path, stage, expect):
    """The double without that stage's answers computes nothing for it: one FAIL line, exit 1, the
    toolchain PASSes and the stages not selected SKIP (collectives: the libnrt refusal test below)."""
    tmp, _ = first_run
    proc = _run(tmp, fake_nrt_path, tuple(s for s in STAGES[1:] if s != stage), "--only", stage)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    got = lines(proc.stdout)
    assert [s for s, line in got.items() if line.startswith("FAIL ")] == [stage], got
    assert expect in got[stage] and got["toolchain"].startswith("PASS "), got


@pytest.mark.slow
def test_only_runs_the_stage_it_names(first_run, fake_nrt_path):
    """`--only measurements`: the toolchain and that stage run (the double answers it: PASS), the
    others SKIP as not selected, and the figures file is written."""
    tmp, _ = first_run
    (tmp / "deepinfer-figures.json").unlink(missing_ok=True)
    proc = _run(tmp, fake_nrt_path, ("measurements",), "--only", "measurements")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = lines(proc.stdout)
    assert got["toolchain"].startswith("PASS ") and got["measurements"].startswith("PASS measurements: "), got
    assert got["modules"] == "SKIP modules: not selected (--only)", got
    assert got["collectives"] == "SKIP collectives: not selected (--only)", got
    assert (tmp / "deepinfer-figures.json").exists()


@pytest.mark.slow
def test_a_rank_refused_by_libnrt_fails_collectives_naming_it(first_run, fake_nrt_path):
    tmp, _ = first_run
    proc = _run(tmp, fake_nrt_path, STAGES[1:], "--only", "collectives", FAKE_NRT_FAIL="nrt_load_collectives=4")
    assert proc.returncode == 1
    got = lines(proc.stdout)
    assert got["collectives"].startswith("FAIL collectives: rank 0: "), got["collectives"]
    assert "nrt_load_collectives failed with NRT status 4 (NRT_RESOURCE" in got["collectives"]
    assert "rank0.log" in got["collectives"] and got["toolchain"].startswith("PASS")


@pytest.mark.slow
def test_bundle_that_does_not_fit_the_host_fails_toolchain_naming_the_field(first_run, fake_nrt_path):
    """The doctor's own finished tiny bundle (lnc 2, neuronx-cc 2.99.0.0+0000000d) fits; with the host
    at lnc 1 and another neuronx-cc version, toolchain FAILs naming each field."""
    tmp, _ = first_run
    bundle = tmp / "work" / "modules" / "neff"  # it fits: test_every_stage_passes_on_the_doubles_with_answers
    proc = _run(
        tmp,
        fake_nrt_path,
        STAGES[1:],
        "--bundle",
        str(bundle),
        NEURON_LOGICAL_NC_CONFIG="1",
        FAKE_NEURONX_CC_VERSION="2.98.1.0+0000000e",
    )
    assert proc.returncode == 1
    line = lines(proc.stdout)["toolchain"]
    assert line.startswith(
        f"FAIL toolchain: bundle {bundle}: toolchain neuronx-cc 2.99.0.0+0000000d, this host has 2.98.1.0+0000000e"
    )
    assert f"bundle {bundle}: topology lnc 2, this host runs lnc 1 (NEURON_LOGICAL_NC_CONFIG)" in line
