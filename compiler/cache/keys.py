"""Cache keys: an ordered list of named parts, hashed unambiguously.

Each part is canonical bytes (JSON with sorted keys, or raw bytes). A key's
digest is sha256 over its kind and, for each part in order, the part's name
and the sha256 of its bytes, each length-prefixed, so no two different part
lists collide by concatenation. The hash of every part is kept (and logged at
debug verbosity, and written beside each cache entry) so that a miss can be
explained part by part (`deepinfer cache explain`).

Never hashed: paths, timestamps, object ids, log levels. Always hashed: the
toolchain versions and the source of every kernel and lowering a graph reaches.

Which compile options a key sees is decided by two explicit lists below:
`KEYED_OPTIONS` change what is built; `UNKEYED_OPTIONS` only change logs,
dumps, where things go or how many workers run. Every `model.toml` key, every
`deepinfer-compile` option and every log-only target option is in exactly one
(tests/cache/test_keys.py checks both lists against the config and the CLI).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import importlib.util
import inspect
import json
import struct
import types
from dataclasses import dataclass
from pathlib import Path

import torch

from deepinfer.bundles.manifest import FORMAT_VERSION

CACHE_VERSION = 1  # layout of the cache entries and of the key parts

# model.toml keys (section.key) and deepinfer-compile options that change what is built.
# model.checkpoint and model.tiny are keyed by the checkpoint's contents (tensor digests
# and config hash), never by path.
KEYED_OPTIONS = (
    "model.checkpoint",
    "model.tiny",
    "model.dtype",
    "model.cache_quant",
    "target.name",
    "target.executable",
    "target.options",
    "buckets.batch",
    "buckets.tokens",
    "buckets.max_context",
    "buckets.context",
    "buckets.prompt_batch",
    "kv.block_size",
    "kv.num_blocks",
    "parallel.tp",
    "parallel.ep",
    "parallel.cp",
    "quant.recipe",
    "host.embedding",
    "--hlo-only",
    "speculative.draft",  # the draft's executables and stacks: their own keys, in the bundle's
    "prompt.rows",
)
# ...and those that only change logs, dumps, locations or parallelism: never in a key.
UNKEYED_OPTIONS = (
    "cache.dir",
    "--output",
    "--jobs",
    "--force",
    "--json",
    "--cache-dir",
    "--no-cache",
    "--print-cache-key",
    "--require-cache",
    # the remote tier is where entries are found, never what they are: machines sharing a store share keys
    "cache.url",
    "cache.endpoint",
    "--cache-url",
    "--cache-endpoint",
    "--verbose",
    "--finish",
    "--ray",  # where the compile jobs run: a farm's executables are the same bytes
    # signing adds signature files beside what is built; trust decides which cache entries are used
    "--sign",
    "--trust",
    # the budget decides whether a compile is refused, not what it builds
    "memory.limit_gib",
    "memory.reserve_gib",
    "--figures",  # measured hardware figures change the modelled step printed after the compile, no executable
)


def canonical(value) -> bytes:
    """bytes as they are; anything else as JSON with sorted keys and no whitespace."""
    if isinstance(value, bytes):
        return value
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str).encode()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _lp(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


@dataclass(frozen=True)
class Key:
    """`kind` (executable, trace, weights, host, bundle), `identity` (what it builds, for
    messages; not hashed) and the ordered parts [(name, canonical bytes)]."""

    kind: str
    identity: str
    parts: tuple[tuple[str, bytes], ...]

    @staticmethod
    def of(kind: str, identity: str, parts: list[tuple[str, object]]) -> Key:
        names = [n for n, _ in parts]
        assert len(set(names)) == len(names), f"duplicate key part in {names}"
        return Key(kind, identity, tuple((n, canonical(v)) for n, v in parts))

    @property
    def part_hashes(self) -> dict[str, str]:
        return {name: sha256(data) for name, data in self.parts}

    @property
    def digest(self) -> str:
        h = hashlib.sha256(_lp(self.kind.encode()))
        for name, part_hash in self.part_hashes.items():
            h.update(_lp(name.encode()) + _lp(part_hash.encode()))
        return h.hexdigest()

    def describe(self) -> list[dict]:
        """[{name, hash, value}]: the value only when short readable JSON (for explain)."""
        out = []
        for name, data in self.parts:
            row = {"name": name, "hash": sha256(data)}
            if len(data) <= 4096:
                try:
                    row["value"] = json.loads(data)
                except (UnicodeDecodeError, json.JSONDecodeError):
                    pass
            out.append(row)
        return out

    def lines(self) -> list[str]:
        """One debug line per part: name and hash."""
        return [f"  {self.kind} {self.identity} {name:<10} {h[:16]}" for name, h in self.part_hashes.items()]


def explain(a: dict, b: dict) -> list[str]:
    """Two entries' meta.json values (`Key.describe`'s parts) compared part by part, for `deepinfer
    cache explain`: a line naming each, one per part (its hash in A and B, same or DIFFERS), and under
    a part that differs and whose values are both JSON objects, each field that changed."""
    out = [
        f"A {a.get('kind')} {a.get('identity')} {a.get('key', '')[:16]}",
        f"B {b.get('kind')} {b.get('identity')} {b.get('key', '')[:16]}",
    ]
    pa = {p["name"]: p for p in a.get("parts", [])}
    pb = {p["name"]: p for p in b.get("parts", [])}
    for name in list(pa) + [n for n in pb if n not in pa]:
        ha, hb = pa.get(name, {}).get("hash", "-"), pb.get(name, {}).get("hash", "-")
        out.append(f"  {name:<10} {ha[:16]:<16} {hb[:16]:<16} {'same' if ha == hb else 'DIFFERS'}")
        va, vb = pa.get(name, {}).get("value"), pb.get(name, {}).get("value")
        if ha != hb and isinstance(va, dict) and isinstance(vb, dict):
            out += [
                f"    {k}: {va.get(k)!r} -> {vb.get(k)!r}" for k in sorted(set(va) | set(vb)) if va.get(k) != vb.get(k)
            ]
    return out


def format_part() -> dict:
    return {"bundle_format": FORMAT_VERSION, "cache": CACHE_VERSION}


# --- sources ---


def _file_text(module: types.ModuleType) -> bytes:
    path = inspect.getsourcefile(module)
    assert path is not None, f"{module.__name__}: no source file"  # deepinfer's modules are source files
    return Path(path).read_bytes()


def modules_digest(names) -> dict[str, str]:
    """{module name: sha256 of its source file}, by module name (never by path)."""
    return {n: sha256(_file_text(importlib.import_module(n))) for n in sorted(names)}


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


@functools.cache
def module_imports(name: str) -> frozenset[str]:
    """The deepinfer modules that module `name` imports anywhere in its file (at module level or
    inside functions; `if TYPE_CHECKING:` blocks, which never run, excepted)."""
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.origin is not None, f"{name}: no source file"
    tree = ast.parse(Path(spec.origin).read_text(), spec.origin)
    package = name if spec.submodule_search_locations else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking(node.test):
            for stmt in node.orelse:
                visit(stmt)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the package, or above it
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = f"{base}.{node.module}" if node.module else base
            else:
                assert node.module is not None  # an absolute `from` import names its module
                module = node.module
            found.add(module)
            found.update(f"{module}.{a.name}" for a in node.names if _is_module(f"{module}.{a.name}"))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return frozenset(m for m in found if m == "deepinfer" or m.startswith("deepinfer."))


def _with_packages(name: str) -> list[str]:
    """A module and the packages above it (importing it runs each package's __init__)."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


@functools.cache
def import_closure(roots: tuple[str, ...], stop: tuple[str, ...] = ()) -> tuple[str, ...]:
    """Every deepinfer module `roots` reach through imports, the packages they live in included;
    modules named in `stop` (or under a package named there) are neither included nor followed."""

    def stopped(m: str) -> bool:
        return any(m == s or m.startswith(s + ".") for s in stop)

    seen: set[str] = set()
    todo = [p for r in roots for p in _with_packages(r)]
    while todo:
        m = todo.pop()
        if m in seen or stopped(m):
            continue
        seen.add(m)
        todo.extend(p for dep in module_imports(m) for p in _with_packages(dep) if p not in seen)
    return tuple(sorted(seen))


def _code_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


SIMPLE = (int, float, str, bytes, bool, tuple, frozenset, type(None))


def source_closure(fn) -> bytes:
    """The source of `fn` and of every deepinfer function, class or module it reaches.

    Globals that are deepinfer functions or classes are followed (their source);
    deepinfer modules contribute their whole file; simple constants their repr;
    any other deepinfer-owned global pulls in the whole file defining `fn`.
    """
    out: list[bytes] = []
    seen: set = set()

    def own(obj: object) -> bool:
        name = getattr(obj, "__module__", None) or getattr(obj, "__name__", "")
        return isinstance(name, str) and name.startswith("deepinfer")

    def visit(f):
        if f in seen:
            return
        seen.add(f)
        out.append(_lp(f"{f.__module__}.{f.__qualname__}".encode()) + _lp(inspect.getsource(f).encode()))
        code = getattr(f, "__code__", None)
        if code is None:  # a class: its source is its methods' source
            return
        for name in sorted(_code_names(code)):
            if name not in f.__globals__:
                continue
            v = f.__globals__[name]
            if isinstance(v, types.ModuleType):
                if v.__name__.startswith("deepinfer") and v not in seen:
                    seen.add(v)
                    out.append(_lp(v.__name__.encode()) + _lp(_file_text(v)))
            elif inspect.isfunction(v) or inspect.isclass(v):
                if own(v):
                    visit(v)
            elif isinstance(v, SIMPLE):
                out.append(_lp(f"{f.__module__}.{name}".encode()) + _lp(repr(v).encode()))
            elif own(v) or isinstance(v, torch.Tensor):
                module = inspect.getmodule(f)
                if module not in seen:
                    seen.add(module)
                    out.append(_lp(module.__name__.encode()) + _lp(_file_text(module)))

    visit(fn)
    return b"".join(out)


def kernel_sources(names: list[str]) -> dict[str, str]:
    """{kernel name: sha256 of its reference's source closure} for the kernels a graph reaches."""
    from deepinfer.kernels import KERNELS

    return {n: sha256(source_closure(KERNELS[n].reference)) for n in sorted(names)}


# --- graphs ---


def _graph_modules(ep: torch.export.ExportedProgram) -> list[tuple[str, torch.fx.GraphModule]]:
    return sorted((name, m) for name, m in ep.graph_module.named_modules() if isinstance(m, torch.fx.GraphModule))


def kernels_reached(ep: torch.export.ExportedProgram) -> list[str]:
    """Names of the deepinfer kernels a traced (not yet lowered) program calls."""
    found = set()
    for _, gm in _graph_modules(ep):
        for node in gm.graph.nodes:
            if node.op == "call_function" and getattr(node.target, "namespace", None) == "deepinfer":
                found.add(node.target._opname if hasattr(node.target, "_opname") else str(node.target))
    return sorted(found)


def _val(v) -> str:
    if isinstance(v, torch.Tensor):
        return f"{v.dtype}{list(v.shape)}{list(v.stride())}"
    if isinstance(v, (list, tuple)):
        return "(" + ",".join(_val(x) for x in v) + ")"
    return repr(v)


def graph_digest(ep: torch.export.ExportedProgram) -> str:
    """sha256 of the canonical program: each graph's code, every node's value metadata,
    the signature, the range constraints and the bytes of any constants.

    Not `torch.export.save` bytes: those differ between processes.
    """
    h = hashlib.sha256()
    for name, gm in _graph_modules(ep):
        h.update(_lp(name.encode()) + _lp(gm.code.encode()))
        meta = "\n".join(f"{n.name}:{_val(n.meta.get('val'))}" for n in gm.graph.nodes)
        h.update(_lp(meta.encode()))
    h.update(_lp(str(ep.graph_signature).encode()))
    ranges = sorted((str(k), str(v)) for k, v in ep.range_constraints.items())
    h.update(_lp(repr(ranges).encode()))
    for name, value in sorted({**ep.state_dict, **ep.constants}.items()):
        t = value.detach().contiguous().cpu()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""  # 0-d: reshape first
        h.update(_lp(f"{name}:{_val(t)}".encode()) + _lp(raw))
    return h.hexdigest()
