"""A cache that heals (issue 33): a corrupt, truncated or wrong-typed meta.json, a trace record of
the wrong shape and a tensor-digest memo holding `{}` are each a miss, reported once as a one-line
warning and rewritten by the next store; a meta.json linked to /dev/zero is never read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from deepinfer.cli import main as deepinfer
from deepinfer.compiler.cache import artifact_keys, fetch_or_build
from deepinfer.compiler.cache.entry import META
from deepinfer.compiler.cache.keys import Key
from deepinfer.compiler.cache.local import Cache
from deepinfer.regions.checkpoint import Checkpoint

DEEP = "[" * 100_000 + "]" * 100_000
KEY = Key.of("trace", "trace attn decode b1", [("graph", {"g": 1})])
RECORD = json.dumps({"executable_key": "ab" * 32, "entry": {"scratch_bytes": 0}}).encode()


def stored(tmp_path: Path) -> tuple[Cache, Path]:
    cache = Cache(tmp_path / "cache")
    cache.put_bytes("trace", KEY, RECORD)
    return cache, cache.entry_dir("trace", KEY.digest) / META


META_DAMAGE = {
    "{}": lambda m: m.write_text("{}"),
    "truncated": lambda m: m.write_bytes(m.read_bytes()[: len(m.read_bytes()) // 2]),
    "digest of the wrong type": lambda m: m.write_text(json.dumps({**json.loads(m.read_text()), "digest": 5})),
    "size of the wrong type": lambda m: m.write_text(json.dumps({**json.loads(m.read_text()), "size": "big"})),
    "parts of the wrong type": lambda m: m.write_text(json.dumps({**json.loads(m.read_text()), "parts": [1]})),
    "a list": lambda m: m.write_text("[1]"),
    "nested deep": lambda m: m.write_text('{"parts": ' + DEEP + "}"),
    "5000 digits": lambda m: m.write_text('{"size": ' + "9" * 5000 + "}"),
    "not UTF-8": lambda m: m.write_bytes(b'{"key": "\xff"}'),
    "a link to /dev/zero": lambda m: (m.unlink(), m.symlink_to("/dev/zero")),
    "a directory": lambda m: (m.unlink(), m.mkdir()),
}


@pytest.mark.parametrize("damage", META_DAMAGE)
def test_corrupt_meta_is_a_miss_reported_once_and_rewritten(tmp_path, damage):
    _, meta = stored(tmp_path)
    META_DAMAGE[damage](meta)
    logged: list[str] = []
    cache = Cache(tmp_path / "cache", log=logged.append)
    assert cache.get_bytes("trace", KEY) is None  # a miss, not an exception
    assert cache.get_bytes("trace", KEY) is None  # still a miss, not reported again
    assert len(logged) == 1 and logged[0].startswith("warning: cache:") and "is corrupt" in logged[0], logged
    assert "\n" not in logged[0]
    cache.put_bytes("trace", KEY, RECORD)  # the rebuild stores it again
    assert cache.get_bytes("trace", KEY) == RECORD and len(logged) == 1
    assert json.loads(meta.read_text())["key"] == KEY.digest


def test_trace_record_of_the_wrong_shape_is_a_miss_reported_once(tmp_path):
    logged: list[str] = []
    cache = Cache(tmp_path / "cache", log=logged.append)
    cache.put_bytes("trace", KEY, b'{"entry": 5}')
    assert fetch_or_build.trace_record(cache, KEY) is None and fetch_or_build.trace_record(cache, KEY) is None
    assert len(logged) == 1 and "trace record" in logged[0] and logged[0].startswith("warning:")
    cache.put_bytes("trace", KEY, RECORD)
    assert fetch_or_build.trace_record(cache, KEY) == json.loads(RECORD) and len(logged) == 1


def test_cache_cli_with_a_meta_linked_to_dev_zero(tmp_path):
    _, meta = stored(tmp_path)
    META_DAMAGE["a link to /dev/zero"](meta)
    d = str(tmp_path / "cache")
    listed = CliRunner().invoke(deepinfer, ["cache", "ls", "--cache-dir", d])
    assert listed.exit_code == 0 and "1 entries" in listed.output, listed.output
    verified = CliRunner().invoke(deepinfer, ["cache", "verify", "--cache-dir", d])
    assert verified.exit_code == 1 and "corrupt trace" in verified.output, verified.output
    assert not meta.parent.exists()  # verify removed the entry


@pytest.mark.parametrize(
    "text", ['{"parts": ' + DEEP + "}", '{"parts": [1]}', "9" * 5000], ids=["deep", "parts", "int"]
)
def test_cache_explain_of_a_bad_meta_file_is_one_line(tmp_path, text):
    path = tmp_path / "meta.json"
    path.write_text(text)
    r = CliRunner().invoke(deepinfer, ["cache", "explain", str(path), str(path), "--cache-dir", str(tmp_path / "c")])
    assert r.exit_code == 2 and r.output.count("\n") == 1 and str(path) in r.output, r.output


# --- the tensor-digest memo ------------------------------------------------------------------------


MEMO_DAMAGE = {
    "{}": lambda m: m.write_text("{}"),
    "a list": lambda m: m.write_text("[1]"),
    "a digest of the wrong type": lambda m: m.write_text('{"w": 5}'),
    "truncated": lambda m: m.write_bytes(m.read_bytes()[:10]),
    "nested deep": lambda m: m.write_text('{"w": ' + DEEP + "}"),
    "a link to /dev/zero": lambda m: (m.unlink(), m.symlink_to("/dev/zero")),
}


@pytest.mark.parametrize("damage", MEMO_DAMAGE)
def test_corrupt_digest_memo_is_rehashed_reported_once_and_rewritten(tmp_path, damage):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file({"w": torch.arange(8, dtype=torch.float32), "v": torch.ones(2)}, str(ckpt / "model.safetensors"))
    logged: list[str] = []
    memo = artifact_keys.Memo(tmp_path / "memo", logged.append)
    want = artifact_keys.tensor_digests(Checkpoint(ckpt), ["w", "v"], memo)
    (memo_file,) = memo.dir.glob("*.json")
    MEMO_DAMAGE[damage](memo_file)
    for _ in range(2):  # reported once; the second read finds the rewritten memo
        assert artifact_keys.tensor_digests(Checkpoint(ckpt), ["w", "v"], memo) == want
    assert len(logged) == 1 and logged[0].startswith("warning: cache:") and str(memo_file) in logged[0], logged
    assert not memo_file.is_symlink() and json.loads(memo_file.read_text()) == want
    fresh: list[str] = []  # a later compile reads the rewritten memo without a word
    assert artifact_keys.tensor_digests(Checkpoint(ckpt), ["w"], artifact_keys.Memo(memo.dir, fresh.append)) == {
        "w": want["w"]
    }
    assert fresh == []
