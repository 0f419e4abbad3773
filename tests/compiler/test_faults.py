"""deepinfer-compile survives faults: kill -9 at each point of a compile, and a full disk.

Each compile is a real `deepinfer-compile` process on the tiny checkpoint, at its cheapest (saved
ExportedPrograms, one bucket), into one artifact cache the faults share. A kill comes from the test
hook `DEEPINFER_TEST_KILL_AT` (compiler/kill_points.py); a full disk from RLIMIT_FSIZE, under which
a write past the limit fails with EFBIG (SIGXFSZ ignored) as it would with ENOSPC. After each fault:
nothing at `-o`, and every entry visible in the cache whole (its meta.json names it, its artifact
matches the digest). Then a compile succeeds, reusing what the killed ones completed.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from deepinfer.bundles.manifest_io import sha256_file
from deepinfer.compiler.kill_points import KILL_AT_ENV, POINTS, compile_process

from ..conftest import write_model_toml

pytestmark = pytest.mark.slow  # each compiles the tiny model (about 30 s cold, 5 s warm)


def visible_entries(cache: Path) -> list[str]:
    """Every entry in place in the cache, each checked whole: '<kind>/<key>'."""
    found = []
    for entry in sorted((cache / "v1").glob("*/??/*")):
        kind = entry.parent.parent.name
        if kind in ("tmp", "locks", "files"):
            continue
        meta = json.loads((entry / "meta.json").read_text())
        assert meta["key"] == entry.name and meta["kind"] == kind, entry
        assert sha256_file(entry / "artifact") == meta["digest"], entry
        found.append(f"{kind}/{entry.name}")
    return found


def nothing_at(out: Path) -> bool:
    """No bundle at `out`, and no staging directory beside it but those the next compile removes."""
    return not out.exists() and not out.is_symlink()


@pytest.fixture
def model(tmp_path, tiny_ckpt) -> Path:
    return write_model_toml(tmp_path / "model", tiny_ckpt, executable="exported")


def test_kill_9_anywhere_leaves_no_bundle_and_the_next_compile_reuses_what_was_complete(tmp_path, model):
    """One cache through a compile killed at each point in turn (each killed compile goes further,
    fetching what the last one stored), then a compile that runs to the end: it compiles nothing,
    every entry the killed compiles stored is whole and used, and no staging directory is left."""
    cache, out = tmp_path / "cache", tmp_path / "bundle"
    seen: list[str] = []
    for point in POINTS:
        r = compile_process(model, out, cache, env={KILL_AT_ENV: point})
        assert r.returncode == -signal.SIGKILL, (point, r.stderr[-2000:])
        assert nothing_at(out), point
        entries = visible_entries(cache)
        assert set(seen) <= set(entries), point  # nothing complete was lost
        seen = entries
    assert any(p.name.startswith(".bundle.tmp-") for p in tmp_path.iterdir())  # the killed compiles' staging
    r = compile_process(model, out, cache)
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(r.stdout)
    assert report["compiled"] == []  # the compile killed at publish had built every executable
    assert report["tiers"]["local"] == len(seen) == len(visible_entries(cache))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle", "cache", "model"]


# A per-file limit: 60 kB fails first the cache's memo of tensor digests (69 kB; a cache that cannot
# be written is used read-only), then the first weight file; 1 MB lets the smaller weight files
# through and fails the MoE stack (2.2 MB) in the middle of the weight pass.
@pytest.mark.parametrize("fsize", [60_000, 1_000_000], ids=["cache-memo", "mid-bundle"])
def test_a_full_disk_is_one_line_and_leaves_nothing_half_written(tmp_path, model, fsize):
    cache, out = tmp_path / "cache", tmp_path / "bundle"
    r = compile_process(model, out, cache, fsize=fsize)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "File too large" in last and "nothing was published" in last
    assert nothing_at(out) and sorted(p.name for p in tmp_path.iterdir()) == ["cache", "model"]
    visible_entries(cache)  # whatever the cache holds is whole
    assert not list((cache / "v1" / "files").glob(".*"))  # no half-written memo
