"""The house's size rules and its map: docs/architecture.md names every module, and only those.

A module over 600 lines or a function over 60 is where features pile up unread (issue 39); the
commands parse arguments and call one API, so they stay short. The map in docs/architecture.md is
how a newcomer finds a module: a module added, moved or removed without it fails here.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ["deepinfer", "compiler", "runtime", "regions", "bundles", "kernels", "quant"]
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 60
# functions allowed over MAX_FUNCTION_LINES, at most
MAX_LONG_FUNCTIONS = 8
# the command-line modules: they parse and call
COMMANDS = [
    "deepinfer/cli.py",
    "deepinfer/cache_cli.py",
    "deepinfer/compare_cli.py",
    "deepinfer/doctor_cli.py",
    "deepinfer/plan_cli.py",
    "compiler/cli.py",
    "runtime/cli.py",
    "runtime/serving/cli.py",
]
MAX_COMMAND_LINES = 350
MAP_HEADING = "## Where each module lives"


def modules() -> dict[str, str]:
    """Every module of the package by its repository path, with its source."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            found[path.relative_to(ROOT).as_posix()] = path.read_text(encoding="utf-8")
    return found


def line_count(source: str) -> int:
    return len(source.splitlines())


def long_functions(sources: dict[str, str]) -> list[str]:
    """`path: name (lines)` for every function over MAX_FUNCTION_LINES."""
    found = []
    for path, source in sources.items():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    found.append(f"{path}: {node.name} ({lines})")
    return found


def mapped_modules() -> set[str]:
    """The module paths docs/architecture.md's map names: the first cell of each of its table rows."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    assert MAP_HEADING in text, f"docs/architecture.md has no '{MAP_HEADING}' section"
    section = text.split(MAP_HEADING, 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `([a-z_/0-9]+\.py)` \|", section, re.MULTILINE))


def test_no_module_over_the_limit():
    over = [f"{path} ({line_count(src)})" for path, src in modules().items() if line_count(src) > MAX_MODULE_LINES]
    assert not over, f"modules over {MAX_MODULE_LINES} lines: {over}"


def test_few_long_functions():
    found = long_functions(modules())
    assert len(found) <= MAX_LONG_FUNCTIONS, f"{len(found)} functions over {MAX_FUNCTION_LINES} lines: {found}"


def test_commands_are_thin():
    sources = modules()
    missing = [path for path in COMMANDS if path not in sources]
    assert not missing, f"command modules moved: {missing} (update COMMANDS)"
    thick = [
        f"{path} ({line_count(sources[path])})" for path in COMMANDS if line_count(sources[path]) >= MAX_COMMAND_LINES
    ]
    assert not thick, f"commands of {MAX_COMMAND_LINES} lines or more: {thick}"


def test_the_map_names_every_module_and_only_those():
    actual = {path for path in modules() if not path.endswith("__init__.py")}
    named = mapped_modules()
    assert not actual - named, f"modules docs/architecture.md's map does not name: {sorted(actual - named)}"
    assert not named - actual, f"docs/architecture.md's map names modules that do not exist: {sorted(named - actual)}"


def test_the_size_rules_see_a_long_function(tmp_path):
    # the measure itself: a function of 61 lines is found, one of 60 is not
    body = "\n".join(f"    x{i} = {i}" for i in range(59))
    sources = {"a.py": f"def short():\n{body}\n", "b.py": f"def long():\n{body}\n    y = 0\n"}
    assert long_functions(sources) == ["b.py: long (61)"]
