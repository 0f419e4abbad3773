"""compile_bundle does what deepinfer-compile does: the settings and summary it reports, its --json
summary, Inductor's cache directory, and the passes it runs, in order, each timed under its name.

The passes are stubbed here (nothing is traced or compiled): what is checked is the API's own work.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from deepinfer.compiler import budget, pipeline
from deepinfer.compiler.cache.local import Cache
from deepinfer.compiler.cli import main as compile_cli
from deepinfer.compiler.config import load_compile_config

from ..conftest import write_model_toml

PASSES = [
    "parse config",
    "copy tokenizer",
    "plan regions",
    "check memory budget",
    "preprocess weights",
    "trace",
    "check memory budget with scratch",
    "compile",
    "lay out state",
    "record cache keys",
    "write manifest",
]
INDUCTOR = "TORCHINDUCTOR_CACHE_DIR"


@pytest.fixture
def toml(tmp_path, tiny_ckpt):
    return write_model_toml(tmp_path / "m", tiny_ckpt, executable="exported", parallel=(1, 2, 2))


@pytest.fixture
def built(monkeypatch):
    """The passes stubbed: three executables in the bundle, one compiled by this compile."""
    monkeypatch.setattr(pipeline, "build", lambda *a: pipeline.Built(executables=3, compiled=("head.decode.b1t1",)))


def test_compile_bundle_reports_settings_and_summary(toml, tmp_path, built):
    logged = []
    cache = Cache(tmp_path / "cache")
    report = pipeline.compile_bundle(
        load_compile_config(toml), tmp_path / "out", jobs=3, log=logged.append, cache=cache
    )
    ckpt = load_compile_config(toml).model.checkpoint
    assert report.settings == (
        f"compiling {toml} -> {tmp_path / 'out'}\n"
        f"  checkpoint {ckpt} (fp32, cache_quant=true)\n"
        "  target cpu (exported), buckets batch=[1] tokens=[1] max_context=32 context=[32], kv block_size=16 "
        f"num_blocks=4, parallel tp=1 ep=2 cp=2, jobs=3, cache {tmp_path / 'cache'}"
    )
    assert report.summary.startswith(f"wrote {tmp_path / 'out'} in ")
    assert report.summary.endswith(" s (1 of 3 executables compiled, 2 from the cache)")
    assert logged[0] == report.settings and logged[-1] == report.summary
    assert report.to_json() == {
        "bundle": str(tmp_path / "out"),
        "seconds": {},
        "executables": 3,
        "compiled": ["head.decode.b1t1"],
        "lowered": [],
        "cache": str(tmp_path / "cache"),
        "store": None,  # no --cache-url: the local tier alone, nothing from or to a store
        "tiers": {"local": 0, "store": 0, "published": 0},
        "fallback": {},  # no fused layer kind refused by neuronx-cc
    }
    assert (tmp_path / "out").is_dir()


def test_the_api_opens_the_clis_cache_unless_told_not_to(toml, tmp_path, built, monkeypatch):
    """Without `cache`, compile_bundle uses the cache deepinfer-compile uses by default (issue 44 item 6:
    it used none): here $DEEPINFER_CACHE_DIR; cache=None is --no-cache."""
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path / "shared"))
    report = pipeline.compile_bundle(load_compile_config(toml), tmp_path / "a", log=lambda m: None)
    assert report.cache == tmp_path / "shared" and report.settings.endswith(f"cache {tmp_path / 'shared'}")
    r = CliRunner().invoke(compile_cli, [str(toml), "-o", str(tmp_path / "b"), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout.strip().splitlines()[-1])["cache"] == str(report.cache)  # the CLI's: the same
    off = pipeline.compile_bundle(load_compile_config(toml), tmp_path / "c", log=lambda m: None, cache=None)
    assert off.cache is None and off.settings.endswith("cache off")


def test_the_cli_prints_what_the_api_reports(toml, tmp_path, built):
    r = CliRunner().invoke(compile_cli, [str(toml), "-o", str(tmp_path / "out"), "--no-cache", "--json"])
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["executables"] == 3 and summary["compiled"] == ["head.decode.b1t1"] and summary["cache"] is None
    lines = r.stderr.splitlines()
    assert lines[0] == f"compiling {toml} -> {tmp_path / 'out'}"
    assert lines[2].endswith("parallel tp=1 ep=2 cp=2, jobs=1, cache off")
    assert lines[-1].startswith(f"wrote {tmp_path / 'out'} in ") and lines[-1].endswith("2 from the cache)")


def test_inductor_cache_directory_is_set_unless_the_user_set_one(toml, tmp_path, built, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(INDUCTOR, raising=False)
    pipeline.compile_bundle(load_compile_config(toml), tmp_path / "a", log=lambda m: None)
    # the CLI's default, for API callers too
    assert os.environ[INDUCTOR] == str((tmp_path / ".cache" / "inductor").resolve())
    monkeypatch.setenv(INDUCTOR, str(tmp_path / "mine"))
    pipeline.compile_bundle(load_compile_config(toml), tmp_path / "b", log=lambda m: None)
    assert os.environ[INDUCTOR] == str(tmp_path / "mine")  # the user's wins


def test_passes_run_in_order_each_timed_under_its_name(tmp_path, monkeypatch):
    """`build` calls each pass directly, handing each what the earlier ones made."""
    ran, kw = [], []

    def stub(name, made=None):
        def run(*args, **kwargs):
            ran.append((name, args))
            kw.append((name, kwargs))
            return made

        return run

    spec, tokenizer, regions, weights, state = (
        SimpleNamespace(name=n) for n in "spec tokenizer plan weights state".split()
    )
    traced = SimpleNamespace(executables=("e",), lowered=())
    compiled = SimpleNamespace(executables=("e",), built=("e",), fallback={})
    manifest = SimpleNamespace(regions=("e",))
    for attr, made in [
        ("parse", spec),
        ("copy_tokenizer", tokenizer),
        ("plan", regions),
        ("preprocess_weights", weights),
        ("trace_regions", traced),
        ("compile_pass", compiled),
        ("layout_state", state),
        ("write_manifest", manifest),
    ]:
        monkeypatch.setattr(pipeline, attr, stub(attr, made))
    monkeypatch.setattr(budget, "check_planned", stub("check_planned"))
    monkeypatch.setattr(budget, "check_traced", stub("check_traced"))
    run = pipeline.Run(staging=tmp_path, out=tmp_path, log=lambda m: None)
    timed = pipeline.Timings()
    built = pipeline.build("config", False, run, timed)
    assert list(timed.seconds) == PASSES
    assert built == pipeline.Built(executables=1, compiled=("e",), lowered=())
    assert [name for name, _ in ran] == [
        "parse",
        "copy_tokenizer",
        "plan",
        "check_planned",
        "preprocess_weights",
        "trace_regions",
        "check_traced",
        "compile_pass",
        "layout_state",
        "write_manifest",
    ]
    args = dict(ran)
    assert args["parse"] == ("config", False, run.log)
    assert args["check_traced"] == (spec, regions, traced.executables, run.log)
    assert args["write_manifest"] == (spec, regions, weights, tokenizer, compiled.executables, state, run)
    assert args["compile_pass"] == (spec, regions, traced, run)
    assert dict(kw)["write_manifest"] == {"fallback": compiled.fallback}
