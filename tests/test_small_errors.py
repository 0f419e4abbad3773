"""Small bad inputs are one line naming the file and key, exit status 2, no traceback (issue 16, class 10)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from deepinfer.cli import main as deepinfer_main
from deepinfer.compiler.cli import main as compile_main

TOMLS = {
    "checkpoint is a file": (b'[model]\ncheckpoint = "afile"\n', "model.checkpoint: ", "afile is a file"),
    "unknown ~user": (b'[model]\ncheckpoint = "~no_such_user_here/ck"\n', "model.checkpoint: ", "cannot resolve"),
    "not UTF-8": (b'[model]\ncheckpoint = "\xff\xfe"\n', "model.toml: ", "not UTF-8"),
    "negative tiny seed": (
        b'[model]\ncheckpoint = "ck"\ntiny = { seed = -1, layers = 6 }\n',
        "model.tiny: ",
        "seed must be at least 0",
    ),
}


def _one_line_error(result, *fragments):
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    for f in fragments:
        assert f in lines[0], lines[0]


@pytest.mark.parametrize("case", TOMLS)
def test_model_toml(tmp_path, monkeypatch, case):
    text, key, message = TOMLS[case]
    (tmp_path / "afile").write_text("x")
    (tmp_path / "model.toml").write_bytes(text)
    monkeypatch.chdir(tmp_path)
    _one_line_error(CliRunner().invoke(compile_main, ["model.toml", "-o", "out"]), "model.toml", key, message)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "model.toml"]


def test_make_tiny(tmp_path):
    (tmp_path / "afile").write_text("x")
    r = CliRunner().invoke(deepinfer_main, ["make-tiny", "--seed", "-1", str(tmp_path / "t")])
    assert r.exit_code == 2 and "-1 is not in the range x>=0" in r.output
    _one_line_error(CliRunner().invoke(deepinfer_main, ["make-tiny", str(tmp_path / "afile")]), "afile", "is a file")
    assert (tmp_path / "afile").read_text() == "x"


@pytest.mark.parametrize("num_blocks", [3_000_000_000, 2**63 - 1])
def test_pools_larger_than_the_host_are_refused_before_any_work(tmp_path, tiny_ckpt, monkeypatch, num_blocks):
    (tmp_path / "model.toml").write_text(
        f'[model]\ncheckpoint = "{tiny_ckpt}"\n[target]\nexecutable = "exported"\n[kv]\nnum_blocks = {num_blocks}\n'
    )
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(compile_main, ["model.toml", "-o", "out", "--no-cache"])
    assert r.exit_code == 2, r.output
    assert "memory.limit_gib: the bundle does not fit (weights and state pools, as planned)" in r.output
    assert "lower [kv] num_blocks" in r.output and "this host's memory" in r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.toml"]


def test_make_tiny_refuses_absurd_layers_before_drawing_anything(tmp_path):
    """`make-tiny --layers 1000000` (about 560 GiB) is one line naming --layers, exit 2, nothing written."""
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "deepinfer.cli", "make-tiny", str(tmp_path / "t"), "--layers", "1000000"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: --layers 1000000: "), r.stderr[-2000:]
    assert "at most 1024 layers" in r.stderr
    assert list(tmp_path.iterdir()) == []


def test_make_tiny_plans_its_size_exactly(tiny_ckpt):
    """The size make-tiny checks against free space is the size it writes (the index's total_size)."""
    import json

    from deepinfer.regions.tiny import planned_bytes

    config = json.loads((tiny_ckpt / "config.json").read_text())
    index = json.loads((tiny_ckpt / "model.safetensors.index.json").read_text())
    assert planned_bytes(config) == index["metadata"]["total_size"]
