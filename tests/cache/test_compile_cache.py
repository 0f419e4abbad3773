"""deepinfer-compile with the cache: warm compiles build nothing, damage and kills never yield a wrong
bundle, concurrent compiles build each executable once, --require-cache and --print-cache-key."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

import deepinfer.compiler.cache.artifact_keys as cached
import deepinfer.compiler.cache.keys as keys
import deepinfer.compiler.executables as executables
import deepinfer.compiler.pipeline as pipeline
from deepinfer.bundles import manifest_io
from deepinfer.compiler.cache.local import Cache
from deepinfer.compiler.cli import main as compile_cli
from deepinfer.compiler.config import load_compile_config

from .conftest import EXECUTABLES, compile_cached, write_toml

pytestmark = pytest.mark.slow  # every test here compiles the small model, some several times


def manifest(bundle) -> dict:
    return json.loads((bundle / "manifest.json").read_text())


def without_executable_digests(m: dict) -> dict:
    """torch.export.save bytes differ between processes: compare all but the executables' digests."""
    m = json.loads(json.dumps(m))
    for e in m["regions"]:
        e.pop("digest")
    m["files"] = {k: v for k, v in m["files"].items() if not k.startswith("regions/")}
    return m


def test_warm_compile_builds_nothing(filled, cache_copy, small_toml, tmp_path):
    _, cold, _ = filled
    report, cache = compile_cached(small_toml, tmp_path / "warm", cache_copy)
    bundle = report.bundle
    assert report.compiled == () and cache.stats["miss"] == [] and cache.stats["stored"] == []
    kinds = [kind for kind, _ in cache.stats["hit"]]
    assert kinds.count("executable") == kinds.count("trace") == EXECUTABLES
    assert kinds.count("weights") == 8 and kinds.count("host") == 3  # embedding, engram tables, vision
    assert manifest(bundle) == manifest(cold)
    manifest_io.check_files(bundle, manifest_io.read(bundle))


def test_the_api_compiles_through_the_clis_cache_by_default(filled, cache_copy, small_toml, tmp_path, monkeypatch):
    """compile_bundle without `cache` opens the cache deepinfer-compile opens (issue 44 item 6): here
    $DEEPINFER_CACHE_DIR, holding the small model's entries, so a second compile of the same model.toml
    builds nothing and adds no entry; the CLI's opt-out, cache=None, builds everything again."""
    _, cold, _ = filled
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(cache_copy))
    entries = len(Cache(cache_copy).entries())
    report = pipeline.compile_bundle(load_compile_config(small_toml), tmp_path / "api", log=lambda m: None)
    assert report.cache == cache_copy and report.compiled == () and report.executables == EXECUTABLES
    assert report.tiers["local"] > 0 and len(Cache(cache_copy).entries()) == entries
    assert manifest(report.bundle) == manifest(cold)
    off = pipeline.compile_bundle(load_compile_config(small_toml), tmp_path / "off", log=lambda m: None, cache=None)
    assert off.cache is None and len(off.compiled) == EXECUTABLES


def test_tampered_entries_are_detected_and_replaced(filled, cache_copy, small_toml, tmp_path):
    _, cold, _ = filled
    cache = Cache(cache_copy)
    damaged = {}
    for kind in ("executable", "weights"):
        entry = sorted(cache.entries((kind,)), key=lambda e: e.meta["identity"])[0]
        data = bytearray(entry.artifact.read_bytes())
        data[len(data) // 2] ^= 1  # one bit, size unchanged
        entry.artifact.write_bytes(bytes(data))
        damaged[kind] = entry.meta["identity"]
    report, cache = compile_cached(small_toml, tmp_path / "b", cache_copy)
    bundle = report.bundle
    assert sorted(k for k, _ in cache.stats["corrupt"]) == ["executable", "weights"]
    assert report.compiled == (damaged["executable"],)
    assert without_executable_digests(manifest(bundle)) == without_executable_digests(manifest(cold))
    manifest_io.check_files(bundle, manifest_io.read(bundle))
    assert Cache(cache_copy).verify() == []  # replaced by good entries


def test_kernel_change_recompiles_only_the_graphs_reaching_it(cache_copy, small_toml, tmp_path, monkeypatch):
    closure, sources = keys.source_closure, cached.graph_sources

    def changed_closure(fn):
        return closure(fn) + (b"# changed" if fn.__name__ == "compress_pool_ref" else b"")

    def changed_sources(target_module):
        return {**sources(target_module), "deepinfer.kernels.attention": "changed"}

    monkeypatch.setattr(keys, "source_closure", changed_closure)
    monkeypatch.setattr(cached, "graph_sources", changed_sources)
    report, cache = compile_cached(small_toml, tmp_path / "b", cache_copy)
    assert report.compiled == ("attn_source_r2.decode.b1t1c32",)  # its one context bucket: max_context
    assert sum(1 for kind, _ in cache.stats["stored"] if kind == "trace") == EXECUTABLES  # all retraced


def cli(*args):
    return CliRunner().invoke(compile_cli, [str(a) for a in args])


def test_require_cache_fails_cleanly_on_a_miss(cache_copy, small_toml, tmp_path, monkeypatch):
    monkeypatch.setattr(executables, "trace", lambda *a, **k: pytest.fail("traced on an empty cache"))
    r = cli(small_toml, "-o", tmp_path / "out", "--cache-dir", tmp_path / "empty", "--require-cache")
    assert r.exit_code == 2
    [line] = [line for line in r.output.splitlines() if line.startswith("error:")]
    assert line == (
        f"error: --require-cache: cache miss for weights weights attn_window: "
        f"the cache at {tmp_path / 'empty'} holds no weights for it"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "empty"]  # no bundle, no staging
    monkeypatch.undo()
    # a changed keyed option: the executable misses, and the message says which key part differs
    other = write_toml(
        tmp_path / "other", load_compile_config(small_toml).model.checkpoint, options='{"cpp.simdlen" = 8}'
    )
    r = cli(other, "-o", tmp_path / "out", "--cache-dir", cache_copy, "--require-cache", "-v")
    assert r.exit_code == 2
    parts = [line.split()[2] for line in r.output.splitlines() if line.startswith("  executable attn_window")]
    assert parts == ["format", "graph", "region", "bucket", "target", "toolchain", "kernels", "lowering"]  # -v
    [line] = [line for line in r.output.splitlines() if line.startswith("error:")]
    assert line.startswith(
        "error: --require-cache: cache miss for executable attn_window.decode.b1t1: "
        "key part(s) target differ from the cached entry"
    )
    assert not (tmp_path / "out").exists()
    r = cli(small_toml, "-o", tmp_path / "out", "--cache-dir", cache_copy, "--require-cache", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output.strip().splitlines()[-1])["compiled"] == []


def test_print_cache_key(small_toml, tmp_path, monkeypatch):
    monkeypatch.setattr(executables, "trace", lambda *a, **k: pytest.fail("traced to print a key"))
    r = cli(small_toml, "-o", tmp_path / "out", "--cache-dir", tmp_path / "c", "--print-cache-key")
    assert r.exit_code == 0, r.output
    printed = [line for line in r.output.splitlines() if len(line) == 64]
    assert printed == [pipeline.cache_key(load_compile_config(small_toml), log=lambda m: None).digest]
    assert not (tmp_path / "out").exists()


# --- several processes ---


def start(toml, out, cache_dir, jobs=1):
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "deepinfer.compiler.cli",
            str(toml),
            "-o",
            str(out),
            "--force",
            "--cache-dir",
            str(cache_dir),
            "--jobs",
            str(jobs),
            "--json",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def test_two_compiles_at_once_build_each_executable_once(small_toml, tmp_path):
    procs = [start(small_toml, tmp_path / f"b{i}", tmp_path / "cache") for i in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    compiled = [json.loads(out.strip().splitlines()[-1])["compiled"] for out, _ in outs]
    both = compiled[0] + compiled[1]
    assert len(both) == len(set(both)) == EXECUTABLES  # each once, between them
    assert manifest(tmp_path / "b0") == manifest(tmp_path / "b1")  # identical bundles
    for i in range(2):
        manifest_io.check_files(tmp_path / f"b{i}", manifest_io.read(tmp_path / f"b{i}"))
    assert Cache(tmp_path / "cache").verify() == []


def test_killed_compiles_never_leave_an_accepted_bad_entry(filled, small_toml, tmp_path):
    _, cold, _ = filled
    cache_dir = tmp_path / "cache"
    for i, delay in enumerate((2.0, 4.5, 7.0, 9.5, 12.0)):
        p = start(small_toml, tmp_path / f"k{i}", cache_dir, jobs=2)
        time.sleep(delay)
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        entries = Cache(cache_dir).entries()
        assert all(e.meta.get("key") == e.key for e in entries)
        assert Cache(cache_dir).verify() == []  # every entry present is whole
    report, cache = compile_cached(small_toml, tmp_path / "final", cache_dir)
    bundle = report.bundle
    assert cache.stats["corrupt"] == []
    manifest_io.check_files(bundle, manifest_io.read(bundle))
    assert without_executable_digests(manifest(bundle)) == without_executable_digests(manifest(cold))
