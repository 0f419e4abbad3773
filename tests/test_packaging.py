"""The wheel a user installs holds the whole package: built from the tree, installed into a
fresh virtual environment, its commands compile the tiny model and run it.

The editable install CI uses maps the source folders directly and would hide a
package missing from pyproject.toml (compiler/targets/ once was). The fresh
environment borrows this one's dependencies (torch, ...) through a .pth line,
which adds their folder without running this environment's editable-install
hook, so `deepinfer` can only come from the wheel.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOT_SOURCES = (
    ".git",
    ".venv",
    ".cache",
    "build",
    "*.egg-info",
    "__pycache__",
    ".pytest_cache",
    ".hypothesis",
    "checkpoint",
    "tests",
)

pytestmark = pytest.mark.slow


def run(args, **kwargs) -> subprocess.CompletedProcess:
    out = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=600, **kwargs)
    assert out.returncode == 0, f"{args}: exit {out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
    return out


@pytest.fixture(scope="module")
def fresh(tmp_path_factory) -> Path:
    """A new virtual environment with the wheel of this tree installed; returns its bin folder."""
    root = tmp_path_factory.mktemp("wheel")
    # a copy of the sources: setuptools would reuse a stale build/ of the tree (and pass with it)
    src = shutil.copytree(ROOT, root / "src", ignore=shutil.ignore_patterns(*NOT_SOURCES))
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", root / "dist", src])
    [wheel] = (root / "dist").glob("deepinfer-*.whl")
    venv.create(root / "env", with_pip=True)
    bin_dir = root / "env" / "bin"
    run([bin_dir / "python", "-m", "pip", "install", "--no-deps", "--no-index", "-q", wheel])
    site = run([bin_dir / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    (Path(site) / "borrowed_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return bin_dir


def test_wheel_holds_every_package(fresh, tmp_path):
    code = (
        "import deepinfer, deepinfer.compiler.pipeline, deepinfer.compiler.targets.trn2, deepinfer.runtime; "
        "print(deepinfer.__file__)"
    )
    where = run([fresh / "python", "-c", code], cwd=tmp_path).stdout.strip()
    assert Path(where).is_relative_to(fresh.parent), where  # the wheel's, not the source tree's
    assert "Compile MODEL_TOML" in run([fresh / "deepinfer-compile", "--help"], cwd=tmp_path).stdout


def test_wheel_compiles_and_runs_the_tiny_model(fresh, tmp_path):
    toml = tmp_path / "model.toml"
    toml.write_text(
        '[model]\ncheckpoint = "tiny"\ntiny = { seed = 0, layers = 6 }\ndtype = "fp32"\n'
        '[target]\nname = "cpu"\nexecutable = "exported"\n'
        "[buckets]\nbatch = [1]\ntokens = [1]\nmax_context = 32\n[kv]\nnum_blocks = 4\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run(
        [fresh / "deepinfer-compile", toml, "-o", tmp_path / "bundle", "--no-cache", "--jobs", "2"],
        cwd=tmp_path,
        env=env,
    )
    out = run(
        [fresh / "deepinfer-run", tmp_path / "bundle", "--prompt-ids", "0,72,105", "--max-new-tokens", "2", "--json"],
        cwd=tmp_path,
        env=env,
    )
    assert '"generated_ids": [' in out.stdout
