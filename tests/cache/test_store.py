"""The cache store: entries written whole, verified on every hit, locks, pruning, the `deepinfer cache` commands."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from deepinfer.cli import main as deepinfer
from deepinfer.compiler.cache.entry import Lock
from deepinfer.compiler.cache.keys import Key
from deepinfer.compiler.cache.local import Cache, default_dir, resolve_dir


def key(n: int, identity: str = "thing") -> Key:
    return Key.of("executable", identity, [("format", 1), ("graph", f"g{n}")])


@pytest.fixture
def cache(tmp_path):
    logged = []
    c = Cache(tmp_path / "cache", log=logged.append)
    c.logged = logged
    return c


def put(cache: Cache, n: int, data: bytes = b"payload", kind="executable") -> Key:
    k = key(n)
    cache.put_bytes(kind, k, data)
    return k


def test_put_then_get(cache, tmp_path):
    k = put(cache, 1, b"abc")
    assert cache.get_bytes("executable", k) == b"abc"
    assert cache.get_file("executable", k, tmp_path / "out" / "x") and (tmp_path / "out" / "x").read_bytes() == b"abc"
    assert cache.get_bytes("executable", key(2)) is None
    meta = json.loads((cache.entry_dir("executable", k.digest) / "meta.json").read_text())
    assert meta["key"] == k.digest and [p["name"] for p in meta["parts"]] == ["format", "graph"]
    assert not list((cache.root / "tmp").iterdir())  # nothing left behind


@pytest.mark.parametrize("damage", ["flip", "truncate", "meta"])
def test_tampered_entry_is_a_reported_miss_and_is_replaced(cache, tmp_path, damage):
    k = put(cache, 1, b"x" * 1000)
    entry = cache.entry_dir("executable", k.digest)
    if damage == "flip":
        data = bytearray((entry / "artifact").read_bytes())
        data[500] ^= 1
        (entry / "artifact").write_bytes(bytes(data))
    elif damage == "truncate":
        (entry / "artifact").write_bytes(b"x" * 10)
    else:
        (entry / "meta.json").write_text("{")
    dest = tmp_path / "dest"
    assert not cache.get_file("executable", k, dest)
    assert not dest.exists()  # never hands out a wrong file
    assert "is corrupt" in cache.logged[-1] and not entry.exists()
    cache.put_bytes("executable", k, b"x" * 1000)  # rebuilt and stored again
    assert cache.get_file("executable", k, dest) and dest.read_bytes() == b"x" * 1000


def test_interrupted_write_is_not_an_entry(cache):
    k = key(1)
    half = cache.root / "tmp" / "executable-partial"
    half.mkdir(parents=True)
    (half / "artifact").write_bytes(b"half")  # meta.json never written
    assert cache.lookup("executable", k) is None and cache.entries() == []
    entry = cache.entry_dir("executable", k.digest)
    entry.mkdir(parents=True)  # a bare directory is no entry either
    (entry / "artifact").write_bytes(b"x")
    assert cache.get_bytes("executable", k) is None and not entry.exists()


def test_verify_removes_corrupt_entries(cache):
    good, bad = put(cache, 1), put(cache, 2)
    (cache.entry_dir("executable", bad.digest) / "artifact").write_bytes(b"other")
    found = cache.verify()
    assert [(e.key, why) for e, why in found] == [(bad.digest, "digest mismatch")]
    assert [e.key for e in cache.entries()] == [good.digest]


def test_prune_by_age_then_size_least_recently_used_first(cache):
    keys = [put(cache, n, b"x" * 100) for n in range(4)]
    now = time.time()
    for age, k in zip((40, 30, 20, 10), keys):  # keys[0] least recently used
        os.utime(cache.entry_dir("executable", k.digest) / "meta.json", (now - age * 86400,) * 2)
    removed = cache.prune(max_age=35 * 86400, now=now)
    assert [e.key for e in removed] == [keys[0].digest]
    cache.get_bytes("executable", keys[1])  # a hit makes it the most recent
    size = sum(cache.size(e) for e in cache.entries())
    removed = cache.prune(max_size=size - 1, now=now)
    assert [e.key for e in removed] == [keys[2].digest]
    assert {e.key for e in cache.entries()} == {keys[1].digest, keys[3].digest}


def test_lock_is_exclusive(cache):
    first = cache.lock("executable", key(1), blocking=False)
    assert first.held
    assert not cache.lock("executable", key(1), blocking=False).held
    assert cache.lock("executable", key(2), blocking=False).held
    first.release()
    with cache.lock("executable", key(1), blocking=False) as again:
        assert again.held
    assert isinstance(again, Lock) and not again.held


def test_cache_dir_precedence(tmp_path, monkeypatch):
    monkeypatch.delenv("DEEPINFER_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_dir() == tmp_path / "xdg" / "deepinfer"
    assert resolve_dir(None, None) == tmp_path / "xdg" / "deepinfer"
    assert resolve_dir(None, tmp_path / "toml") == tmp_path / "toml"
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path / "env"))
    assert resolve_dir(None, tmp_path / "toml") == tmp_path / "env"
    assert resolve_dir(tmp_path / "cli", tmp_path / "toml") == tmp_path / "cli"


def run(*args):
    return CliRunner().invoke(deepinfer, ["cache", *map(str, args)])


def test_cache_commands(cache):
    a, b = put(cache, 1, b"a"), put(cache, 2, b"bb")
    r = run("ls", "--cache-dir", cache.dir)
    assert r.exit_code == 0 and "2 entries" in r.output and a.digest[:16] in r.output
    r = run("explain", a.digest[:12], b.digest, "--cache-dir", cache.dir)
    assert r.exit_code == 0, r.output
    assert "format" in r.output and "same" in r.output and "DIFFERS" in r.output
    assert [line.split()[-1] for line in r.output.splitlines() if line.strip().startswith("graph")] == ["DIFFERS"]
    r = run("explain", "deadbeefdead", b.digest, "--cache-dir", cache.dir)
    assert r.exit_code == 2 and r.output.startswith("error: deadbeefdead: no single entry")
    (cache.entry_dir("executable", b.digest) / "artifact").write_bytes(b"zz")
    r = run("verify", "--cache-dir", cache.dir)
    assert r.exit_code == 1 and "corrupt executable" in r.output and "1 of 2 entries intact" in r.output
    r = run("prune", "--max-size", "0", "--cache-dir", cache.dir)
    assert r.exit_code == 0 and "removed 1 entries; 0 left" in r.output
    assert run("prune", "--max-age", "7x", "--cache-dir", cache.dir).exit_code == 2


@pytest.mark.parametrize("command", [["ls"], ["verify"], ["prune", "--max-age", "1d"]], ids=lambda c: c[0])
def test_a_cache_directory_that_is_not_there_is_refused(tmp_path, command):
    """ls, verify and prune on a mistyped directory refuse in one line naming it and where it came from
    (they reported "0 entries" with exit 0), and create nothing; the real CLI, in its own process."""
    missing = tmp_path / "no-such-cache"
    (tmp_path / "a-file").write_text("x")
    env = os.environ | {"DEEPINFER_CACHE_DIR": str(tmp_path / "a-file")}
    for args, where, what in [
        (["--cache-dir", str(missing)], "--cache-dir", "no such directory"),
        ([], "$DEEPINFER_CACHE_DIR", "not a directory"),
    ]:
        r = subprocess.run(
            [sys.executable, "-m", "deepinfer", "cache", *command, *args],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        assert r.returncode == 2 and r.stdout == "", (r.returncode, r.stdout, r.stderr)
        assert r.stderr.splitlines() == [
            f"error: {missing if args else tmp_path / 'a-file'} ({where}): {what}; "
            "give --cache-dir the directory your compiles use"
        ], r.stderr
    assert not missing.exists()
