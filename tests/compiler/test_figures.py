"""Measured figures feed the step model (issue 43 item 2): `deepinfer plan --figures FILE`,
`deepinfer-compile --figures FILE` and the figures file's checks (compiler/targets/trn2_figures.py).

Every CLI here is a real subprocess of the installed console script. The expected changes are
computed in the test from the plan's own counts (its executions, its in-graph collectives and the
link time it reported without the file), not from the model's functions.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer.compiler.targets.trn2_figures import DEVICE_FIGURES, RANK_FIGURES, curve_seconds, load_figures
from deepinfer.errors import ConfigError

from ..conftest import write_model_toml

BIN = Path(sys.executable).parent
RELEASE = Path(__file__).resolve().parents[2] / "examples" / "release" / "model.toml"
LAUNCH = RANK_FIGURES["launch_s"].value  # the assumed 20 us


def figures_doc(**figures: float) -> dict:
    """A figures file in the COMMON43 format measuring `figures` (name -> value)."""
    return {
        "deepinfer_figures": 1,
        "measured_on": {
            "host": "trn2-test-host",
            "instance_type": "trn2.48xlarge",
            "neuronx_cc": None,
            "libnrt": None,
            "lnc": 2,
            "when": "2026-12-06T12:00:00+00:00",
        },
        "figures": {name: {"value": v, "how": f"written by {__name__}"} for name, v in figures.items()},
    }


def write(path: Path, doc: dict | str) -> Path:
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return path


def cli(tool: str, *args: str | Path, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / tool), *map(str, args)], capture_output=True, text=True, timeout=timeout, check=False
    )


def plan_json(toml: Path, *extra: str | Path) -> dict:
    r = cli("deepinfer", "plan", toml, "--json", "--no-scratch", *extra)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.fixture
def tiny_trn2(tmp_path, tiny_ckpt) -> Path:
    """The tiny model for trn2 at LNC 2 (one rank: no collectives), decode buckets 1 and 4 x 32."""
    return write_model_toml(
        tmp_path, tiny_ckpt, target="trn2", options="{ lnc = 2 }", batch=(1, 4), tokens=(1, 8), num_blocks=9
    )


# -- the file's checks ------------------------------------------------------------------------------


def test_a_figures_file_loads(tmp_path):
    doc = figures_doc(launch_s=40e-6, hbm_bytes_per_s=2.5e12)
    doc["collectives"] = {"all_reduce": [[4096, 30e-6], [1024, 20e-6]]}
    m = load_figures(write(tmp_path / "f.json", doc))
    how = f"written by {__name__}"
    assert m.figures == {"launch_s": (40e-6, how), "hbm_bytes_per_s": (2.5e12, how)}
    assert m.collectives == {"all_reduce": ((1024, 20e-6), (4096, 30e-6))}  # sorted by payload
    assert m.measured_on["host"] == "trn2-test-host"


def test_curve_interpolates_between_its_points():
    curve = ((1000, 10e-6), (2000, 20e-6), (4000, 22e-6))
    assert curve_seconds(curve, 1500, 1e-9) == pytest.approx(15e-6)
    assert curve_seconds(curve, 3000, 1e-9) == pytest.approx(21e-6)
    assert curve_seconds(curve, 10, 1e-9) == 10e-6  # below the smallest: the smallest's
    assert curve_seconds(curve, 5000, 1e-9) == pytest.approx(22e-6 + 1000 * 1e-9)  # beyond: the link's


BAD = {
    "not JSON": ("{not json", "not a JSON figures file (Expecting"),
    "NaN value": ('{"deepinfer_figures": 1, "figures": {"launch_s": {"value": NaN, "how": "x"}}}', "NaN is not JSON"),
    "wrong version": (dict(figures_doc(launch_s=1e-5), deepinfer_figures=2), "deepinfer_figures: version 2"),
    "no version": ({"figures": {}}, "deepinfer_figures: missing"),
    "unknown figure": (figures_doc(launch_us=20.0), "figures.launch_us: unknown key"),
    "negative value": (figures_doc(launch_s=-1e-6), "figures.launch_s.value: -1e-06 is not a positive number"),
    "zero value": (figures_doc(hbm_bytes_per_s=0), "figures.hbm_bytes_per_s.value: 0 is not a positive number"),
    "string value": (figures_doc(collective_s="fast"), 'figures.collective_s.value: "fast" is not a positive'),
    "huge value": (figures_doc(launch_s=10**400), "figures.launch_s.value: 1000000"),
    "bad when": (
        {**figures_doc(), "measured_on": {**figures_doc()["measured_on"], "when": "yesterday"}},
        "measured_on.when",
    ),
    "bad curve": ({**figures_doc(), "collectives": {"all_reduce": [[0, 1e-5]]}}, "collectives.all_reduce[0][0]"),
    "unknown curve": ({**figures_doc(), "collectives": {"broadcast": [[8, 1e-5]]}}, "collectives.broadcast"),
    "not an object": ("[1, 2]", "(top level): expected a JSON object"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_figures_file_refused_in_one_line(tmp_path, case):
    doc, expected = BAD[case]
    bad = write(tmp_path / "figures.json", doc)
    with pytest.raises(ConfigError) as e:
        load_figures(bad)
    assert "\n" not in str(e.value) and str(e.value).startswith(f"{bad}: ") and expected in str(e.value)


@pytest.mark.parametrize(
    "case", ["not JSON", "unknown figure", "negative value", "zero value", "NaN value", "wrong version"]
)
def test_bad_figures_file_refused_in_one_line_by_the_plan(tmp_path, tiny_trn2, case):
    """`deepinfer plan --figures BAD` (the documented user-error exit 2): one line naming the file and
    the key, nothing on stdout."""
    doc, expected = BAD[case]
    bad = write(tmp_path / "figures.json", doc)
    r = cli("deepinfer", "plan", tiny_trn2, "--no-scratch", "--figures", bad)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr == f"error: {bad}: " + r.stderr.split(f"{bad}: ", 1)[1] and expected in r.stderr, r.stderr


def test_missing_figures_file_refused_in_one_line(tmp_path, tiny_trn2):
    r = cli("deepinfer", "plan", tiny_trn2, "--no-scratch", "--figures", tmp_path / "absent.json")
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1
    assert str(tmp_path / "absent.json") in r.stderr


# -- the plan with measured figures -----------------------------------------------------------------


def check_launch_doubled(before: dict, after: dict, figures: Path) -> None:
    """The decode step and every prompt chunk take executions x 20 us more; launch_s is measured
    (source: the file and its "how"), every other figure keeps its status and value."""
    executions = after["per_decode_step"]["executions"]
    delta_ms = executions * LAUNCH * 1e3
    for b0, b1 in zip(before["step_cost"]["buckets"], after["step_cost"]["buckets"], strict=True):
        assert b1["executions"] == executions
        assert b1["estimated_ms"] - b0["estimated_ms"] == pytest.approx(delta_ms, rel=1e-9)
        assert b1["latency_ms"] - b0["latency_ms"] == pytest.approx(delta_ms, rel=1e-9)
        assert b1["memory_ms"] == b0["memory_ms"] and b1["compute_ms"] == b0["compute_ms"]
    if before["prompt_cost"] is not None:
        for c0, c1 in zip(before["prompt_cost"]["chunks"], after["prompt_cost"]["chunks"], strict=True):
            assert c1["estimated_ms"] - c0["estimated_ms"] == pytest.approx(c1["executions"] * LAUNCH * 1e3, rel=1e-9)
    f0, f1 = before["step_cost"]["figures"], after["step_cost"]["figures"]
    assert f1["launch_s"]["value"] == 2 * LAUNCH and f1["launch_s"]["status"] == "measured"
    assert f1["launch_s"]["source"].startswith(f"{figures} (trn2-test-host)") and __name__ in f1["launch_s"]["source"]
    assert f1["launch_s"]["unit"] == f0["launch_s"]["unit"]
    for name in set(f0) - {"launch_s"}:
        assert f1[name] == f0[name], name
    assert {f["status"] for f in f0.values()} == {"published", "assumed"}
    assert after["step_cost"]["measured"]["measured_on"]["host"] == "trn2-test-host"
    assert before["step_cost"]["measured"] is None


def test_plan_with_launch_doubled_on_the_tiny_trn2_model(tmp_path, tiny_trn2):
    figures = write(tmp_path / "figures.json", figures_doc(launch_s=2 * LAUNCH))
    before, after = plan_json(tiny_trn2), plan_json(tiny_trn2, "--figures", figures)
    check_launch_doubled(before, after, figures)
    r = cli("deepinfer", "plan", tiny_trn2, "--no-scratch", "--figures", figures)
    assert r.returncode == 0, r.stderr
    assert f"figures measured on trn2-test-host: {figures}" in r.stdout
    assert f"    launch_s               4e-05 s per device execution (measured: {figures} (trn2-test-host):" in r.stdout
    assert "    bf16_flops_per_s" in r.stdout and "(published: AWS Neuron docs" in r.stdout
    assert "    collective_s           2.5e-05 s per in-graph all-reduce or all-gather (assumed:" in r.stdout


@pytest.mark.slow
def test_plan_with_launch_doubled_on_the_release(tmp_path):
    """The release as planned (42 executions a step on trn2)."""
    figures = write(tmp_path / "figures.json", figures_doc(launch_s=2 * LAUNCH))
    before, after = plan_json(RELEASE), plan_json(RELEASE, "--figures", figures)
    assert after["per_decode_step"]["executions"] == 42
    check_launch_doubled(before, after, figures)


def test_a_devices_measured_bandwidth_is_shared_by_its_ranks(tmp_path, tiny_trn2):
    """hbm_bytes_per_s is per device in the file: a rank of LNC 2 gets 2/8 of it, so the memory time
    is the bytes read over a quarter of the measured bandwidth."""
    figures = write(tmp_path / "figures.json", figures_doc(hbm_bytes_per_s=1e12))
    after = plan_json(tiny_trn2, "--figures", figures)
    hbm = after["step_cost"]["figures"]["hbm_bytes_per_s"]
    assert hbm["value"] == 1e12 * 2 / 8 and hbm["status"] == "measured"
    assert DEVICE_FIGURES["hbm_bytes_per_s"].unit in hbm["unit"]
    for b in after["step_cost"]["buckets"]:
        assert b["memory_ms"] == pytest.approx((b["weight_bytes"] + b["state_bytes"]) / (1e12 / 4) * 1e3, rel=1e-12)


@pytest.mark.slow
def test_measured_collective_latency_by_payload_times_the_in_graph_collectives(tmp_path):
    """The release as planned holds every collective but the logits' gather in its executions. With a
    latency curve that is flat at 7 us over every payload, each in-graph call costs 7 us in place of
    collective_s (25 us) plus its bytes over the link: the latency falls by exactly that."""
    flat = [[1, 7e-6], [1 << 40, 7e-6]]
    doc = {**figures_doc(), "collectives": {"all_reduce": flat, "all_gather": flat}}
    figures = write(tmp_path / "figures.json", doc)
    before, after = plan_json(RELEASE), plan_json(RELEASE, "--figures", figures)
    for b0, b1 in zip(before["step_cost"]["buckets"], after["step_cost"]["buckets"], strict=True):
        n = b0["collectives_in_executables"]
        assert n > 0 and b0["collective_link_ms"] > 0
        expected = b0["latency_ms"] - n * RANK_FIGURES["collective_s"].value * 1e3 - b0["collective_link_ms"] + n * 7e-3
        assert b1["latency_ms"] == pytest.approx(expected, rel=1e-9)
        assert b1["collective_link_ms"] == 0 and sum(b1["collectives_by_curve_ms"].values()) == pytest.approx(n * 7e-3)
        assert math.isclose(b1["memory_ms"], b0["memory_ms"])
    assert after["step_cost"]["measured"]["collectives"]["all_reduce"] == flat


def test_figures_need_the_trn2_step_model(tmp_path, tiny_ckpt):
    toml = write_model_toml(tmp_path, tiny_ckpt)  # cpu
    figures = write(tmp_path / "figures.json", figures_doc(launch_s=2 * LAUNCH))
    r = cli("deepinfer", "plan", toml, "--no-scratch", "--figures", figures)
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1
    assert "target.name: cpu" in r.stderr


# -- the compile --------------------------------------------------------------------------------------


def test_figures_are_in_no_cache_key(tmp_path, tiny_trn2):
    """Figures change no executable: the bundle's key (--print-cache-key, every trace, weight and host
    key of compiler/cache/keys.py) is the same without a figures file and with two different ones."""
    one = write(tmp_path / "one.json", figures_doc(launch_s=2 * LAUNCH))
    two = write(tmp_path / "two.json", figures_doc(launch_s=3 * LAUNCH, hbm_bytes_per_s=1e12))
    keys = []
    for extra in ([], ["--figures", one], ["--figures", two]):
        r = cli("deepinfer-compile", tiny_trn2, "--print-cache-key", "--no-cache", *extra)
        assert r.returncode == 0, r.stderr
        keys.append(r.stdout.strip())
    assert len(keys[0]) == 64 and keys[0] == keys[1] == keys[2]


def test_compile_refuses_a_bad_figures_file_before_building(tmp_path, tiny_trn2):
    bad = write(tmp_path / "figures.json", figures_doc(launch_s=0))
    out = tmp_path / "bundle"
    r = cli("deepinfer-compile", tiny_trn2, "-o", out, "--hlo-only", "--no-cache", "--figures", bad)
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1
    assert r.stderr.startswith(f"error: {bad}: figures.launch_s.value: 0 is not a positive number")
    assert not out.exists() and not any(p.name.startswith("bundle") for p in tmp_path.iterdir())


@pytest.mark.slow
def test_compile_models_its_step_with_the_figures(tmp_path, tiny_ckpt):
    """`deepinfer-compile --figures` (an HLO-stage trn2 compile of the tiny model, about 3 min): after
    the summary, the decode step modelled with the measured launch overhead, in the log and in --json's
    "step_cost"; the bundle is the same compile's (its executables)."""
    toml = write_model_toml(
        tmp_path, tiny_ckpt, tiny_layers=6, target="trn2", executable="neff", options="{ lnc = 1, optlevel = 1 }"
    )
    figures = write(tmp_path / "figures.json", figures_doc(launch_s=2 * LAUNCH))
    r = cli(
        "deepinfer-compile",
        toml,
        "-o",
        tmp_path / "bundle",
        "--hlo-only",
        "--json",
        "--jobs",
        "2",
        "--figures",
        figures,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout)
    assert summary["bundle"] == str(tmp_path / "bundle") and summary["executables"] == len(summary["lowered"]) > 0
    cost = summary["step_cost"]
    assert cost["figures"]["launch_s"] == {
        "value": 2 * LAUNCH,
        "unit": RANK_FIGURES["launch_s"].unit,
        "source": f"{figures} (trn2-test-host, LNC 2): written by {__name__}",
        "status": "measured",
    }
    (step,) = cost["buckets"]
    before = plan_json(toml)["step_cost"]["buckets"][0]
    assert step["estimated_ms"] - before["estimated_ms"] == pytest.approx(step["executions"] * LAUNCH * 1e3, rel=1e-9)
    assert f"figures measured on trn2-test-host: {figures}" in r.stderr
