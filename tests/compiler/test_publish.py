"""--force replaces only what deepinfer made; an output never overlaps the checkpoint; a killed
compile's staging directories are removed by the next compile into the same parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deepinfer.compiler import pipeline, publish
from deepinfer.compiler.config import load_compile_config
from deepinfer.errors import ConfigError

from ..conftest import write_model_toml


@pytest.fixture
def cfg(tmp_path, tiny_ckpt):
    path = tmp_path / "model.toml"
    path.write_text(
        f'[model]\ncheckpoint = "{tiny_ckpt}"\n[target]\nexecutable = "exported"\n'
        "[buckets]\nmax_context = 32\n[kv]\nnum_blocks = 4\n"
    )
    return load_compile_config(path)


@pytest.fixture
def no_passes(monkeypatch):
    """Publishing without compiling: the staging directory is published empty."""
    monkeypatch.setattr(pipeline, "build", lambda *a: pipeline.Built(executables=0))


def compile_into(cfg, out, force=True):
    return pipeline.compile_bundle(cfg, out, force=force, log=lambda msg: None)


def test_force_refuses_a_directory_that_is_not_a_bundle(tmp_path, cfg, no_passes):
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="not a deepinfer bundle .* and not empty"):
        compile_into(cfg, notes)
    assert (notes / "todo.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.toml", "notes"]


def test_force_refuses_a_file(tmp_path, cfg, no_passes):
    target = tmp_path / "out"
    target.write_text("data")
    with pytest.raises(ConfigError, match="is not a directory"):
        compile_into(cfg, target)
    assert target.read_text() == "data"


def test_force_replaces_a_bundle_or_an_empty_directory(tmp_path, cfg, no_passes):
    empty, old = tmp_path / "empty", tmp_path / "old"
    empty.mkdir()
    old.mkdir()
    (old / "manifest.json").write_text('{"format_version": 1, "files": {}}')
    for out in (empty, old):
        compile_into(cfg, out)
        assert out.is_dir() and list(out.iterdir()) == []  # the (empty) new bundle
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "model.toml", "old"]


@pytest.mark.parametrize("where", ["equal", "inside", "holding"])
def test_output_must_not_overlap_the_checkpoint(tmp_path, cfg, tiny_ckpt, no_passes, where):
    out = {"equal": tiny_ckpt, "inside": tiny_ckpt / "bundle", "holding": tiny_ckpt.parent}[where]
    before = sorted(p.name for p in tiny_ckpt.iterdir())
    with pytest.raises(ConfigError, match="checkpoint directory"):
        compile_into(cfg, out)
    assert sorted(p.name for p in tiny_ckpt.iterdir()) == before


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=60)
    return proc.pid


def test_next_compile_removes_what_a_killed_compile_left(tmp_path, cfg, no_passes):
    out, host = tmp_path / "bundle", publish._host()
    dead = _dead_pid()
    stale = [
        tmp_path / f".bundle.tmp-{host}-{dead}-abc",
        tmp_path / f".bundle.old-{host}-{dead}-def",
        tmp_path / f".other.tmp-{host}-{dead}-mno",  # another output's, in the same parent
    ]
    kept = [
        tmp_path / f".bundle.tmp-{host}-{os.getpid()}-ghi",  # a live process's
        tmp_path / f".other.tmp-{host}-{os.getpid()}-pqr",  # a live process's, for another output
        tmp_path / f".bundle.tmp-otherhost-{dead}-jkl",  # another host's
        tmp_path / f".bundle.tmp-{host}-notapid-stu",  # not a compile's name
    ]
    for d in stale + kept:
        (d / "weights").mkdir(parents=True)
    compile_into(cfg, out, force=False)
    assert out.is_dir()
    assert not any(d.exists() for d in stale)
    assert all(d.exists() for d in kept)


def test_a_failed_compile_leaves_only_what_was_there(tmp_path, cfg, monkeypatch):
    def failing(*args):  # the passes
        raise RuntimeError("injected failure")

    monkeypatch.setattr(pipeline, "build", failing)
    with pytest.raises(RuntimeError, match="injected failure"):
        compile_into(cfg, tmp_path / "bundle", force=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.toml"]


def _children(pid: int) -> set[int]:
    """The live (not zombie) processes whose parent is `pid`, from /proc."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.add(int(stat.parent.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _start_compile(model: Path, out: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "deepinfer.compiler.cli", str(model), "-o", str(out), "--no-cache", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for(what, proc: subprocess.Popen, timeout: float):
    """Poll `what()` until it is true (bounded); the compile must still be running."""
    deadline = time.monotonic() + timeout
    while not (found := what()):
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
    return found


def _staging(parent: Path) -> list[Path]:
    return [p for p in parent.iterdir() if p.name.startswith(".bundle.tmp-")]


def test_sigterm_removes_the_staging_directory(tmp_path, tiny_ckpt):
    """A real compile, stopped by SIGTERM once its staging directory exists, removes it and exits 143."""
    model = write_model_toml(tmp_path / "model", tiny_ckpt, executable="exported")
    out = tmp_path / "bundle"
    proc = _start_compile(model, out)
    try:
        _wait_for(lambda: _staging(tmp_path), proc, timeout=120)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert err.count("SIGTERM: stopping the compile") == 1 and "Traceback" not in err, err[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


@pytest.mark.slow  # traces the tiny model's regions before its compile workers start (about a minute)
def test_sigterm_during_the_compile_jobs_stops_the_workers_too(tmp_path, tiny_ckpt):
    """SIGTERM while AOTInductor compiles in two worker processes: the workers end with the compile,
    and nothing is left beside the output."""
    model = write_model_toml(tmp_path / "model", tiny_ckpt, executable="aoti")
    out = tmp_path / "bundle"
    proc = _start_compile(model, out, "--jobs", "2")
    try:
        workers = _wait_for(lambda: _children(proc.pid), proc, timeout=600)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert err.count("SIGTERM: stopping the compile") == 1 and "Traceback" not in err, err[-2000:]
    deadline = time.monotonic() + 30
    while any(_alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(w) for w in workers), workers
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
