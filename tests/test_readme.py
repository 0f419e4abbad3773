"""The README's Python example, run exactly as written (issue 44): saved to a file and run as a script
(no `if __name__ == "__main__":` guard: the compile's worker processes must not run it again), and
piped to `python -` (a main module from standard input, which a worker cannot import). Each runs in a
folder holding a copy of examples/tiny, so it compiles the tiny model there and generates 8 tokens."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 900  # a compile of the tiny model with two workers, on a slow machine


def snippet() -> str:
    """The README's first Python block: the one that compiles and generates."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    code = next(b for b in blocks if "compile_bundle" in b)
    assert "examples/tiny/model_exported.toml" in code and "generate(" in code
    return code


def folder(tmp_path: Path, name: str) -> Path:
    where = tmp_path / name
    shutil.copytree(
        ROOT / "examples" / "tiny", where / "examples" / "tiny", ignore=shutil.ignore_patterns("checkpoint")
    )
    return where


def check(r: subprocess.CompletedProcess) -> None:
    assert r.returncode == 0, r.stderr[-3000:]
    assert "bootstrapping phase" not in r.stderr and "BrokenProcessPool" not in r.stderr
    printed = r.stdout.strip().splitlines()
    assert len(printed) == 1 and printed[0].endswith(" length"), r.stdout  # 8 tokens, then "length"


@pytest.mark.slow
def test_the_readme_example_runs_as_a_script(tmp_path):
    where = folder(tmp_path, "script")
    (where / "example.py").write_text(snippet())
    check(subprocess.run([sys.executable, "example.py"], cwd=where, capture_output=True, text=True, timeout=TIMEOUT_S))
    assert (where / "build" / "tiny-exported" / "manifest.json").is_file()


@pytest.mark.slow
def test_the_readme_example_runs_from_standard_input(tmp_path):
    where = folder(tmp_path, "stdin")
    r = subprocess.run(
        [sys.executable, "-"], input=snippet(), cwd=where, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    check(r)


def test_workers_start_without_the_callers_main(monkeypatch, tmp_path):
    """What a spawned worker is told to import first (multiprocessing's preparation data): the caller's
    main module (here a script's), except while the compile's workers start
    (`compiler.jobs.main_unseen`); restored after."""
    from multiprocessing import spawn

    from deepinfer.compiler.jobs import main_unseen

    main = sys.modules["__main__"]
    monkeypatch.setattr(main, "__file__", str(tmp_path / "script.py"), raising=False)
    monkeypatch.setattr(main, "__spec__", None, raising=False)
    assert spawn.get_preparation_data("w")["init_main_from_path"] == str(tmp_path / "script.py")
    with main_unseen():
        assert not {"init_main_from_path", "init_main_from_name"} & set(spawn.get_preparation_data("w"))
    assert main.__file__ == str(tmp_path / "script.py") and main.__spec__ is None
