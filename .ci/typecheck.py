"""Type-check the package as it is imported: `deepinfer.compiler` from `compiler/`, and so on.

mypy finds modules by directory, and the package maps top-level folders into the `deepinfer`
namespace (`[tool.setuptools.package-dir]` in pyproject.toml), so this builds a tree of links
that mirrors that mapping (under `.cache/typecheck/`, rebuilt each run) and runs mypy on it with the
`[tool.mypy]` settings of pyproject.toml. Errors are reported with the repository's own paths.

    .venv/bin/python .ci/typecheck.py          # what .ci/run does; exit status is mypy's
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent


def link_tree() -> Path:
    """`.cache/typecheck/deepinfer/...`: a link per mapped folder, as `package-dir` maps them."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    mapping = config["tool"]["setuptools"]["package-dir"]
    tree = ROOT / ".cache" / "typecheck"
    shutil.rmtree(tree, ignore_errors=True)
    package = tree / "deepinfer"
    package.mkdir(parents=True)
    for source in (ROOT / mapping["deepinfer"]).glob("*.py"):
        os.symlink(source, package / source.name)
    for name, folder in mapping.items():
        if name != "deepinfer":
            os.symlink(ROOT / folder, tree / name.replace(".", "/"), target_is_directory=True)
    return tree


def main() -> int:
    tree = link_tree()
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), "-p", "deepinfer"],
        cwd=tree,
        capture_output=True,
        text=True,
    )
    # report the repository's paths, not the link tree's
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    out = proc.stdout
    for name, folder in sorted(config.items(), key=lambda kv: -len(kv[0])):
        out = out.replace(name.replace(".", "/") + "/", folder.rstrip("/") + "/")
    sys.stdout.write(out)
    sys.stderr.write(proc.stderr)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
