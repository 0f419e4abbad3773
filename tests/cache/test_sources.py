"""What each cache key's sources cover: derived from the import closure, and every module in it counts.

A key that missed a module it depends on would hand out stale artifacts after
that module changed (the sharding code once: tp/ep > 1 bundles reused
unsharded weights). Each test here edits one module's source at a time, as a
developer would, and expects the key to change.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from deepinfer.compiler.cache import artifact_keys as cached
from deepinfer.compiler.cache import keys
from deepinfer.compiler.config import load_compile_config
from deepinfer.compiler.pipeline import cache_key, parse, plan
from deepinfer.compiler.plan import Exe
from deepinfer.regions.checkpoint import Checkpoint

QUIET = lambda msg: None  # noqa: E731


@pytest.fixture(scope="module")
def planned(small_toml):
    spec = parse(load_compile_config(small_toml), False, QUIET)
    return spec, plan(spec, QUIET)


def edited(monkeypatch, module: str) -> None:
    """From now on, `module`'s source reads as if a developer had changed it."""
    original = keys._file_text

    def text(m):
        data = original(m)
        return data + b"\n# edited\n" if m.__name__ == module else data

    monkeypatch.setattr(keys, "_file_text", text)


KEYS = {
    "weights": (
        lambda spec, p: cached.weights_key(spec, Checkpoint(spec.config.model.checkpoint), "moe", p.kinds["moe"]),
        cached.weight_sources,
    ),
    "trace": (
        lambda spec, p: cached.trace_key(
            spec, p, Exe("attn_source_r2", "decode", 1, 1, spec.config.buckets.max_context)
        ),
        lambda: cached.import_closure(cached.TRACE_ROOTS + spec_lowering()),
    ),
    "executable": (
        lambda spec, p: cached.executable_key(spec, p, Exe("head", "decode", 1, 1, None), "g", ["rmsnorm"]),
        lambda: cached.lowering_sources(spec_lowering()),
    ),
}


def spec_lowering() -> tuple[str, ...]:
    from deepinfer.compiler.targets.cpu import CpuTarget

    return CpuTarget.LOWERING_MODULES


def test_weights_key_sees_the_sharding_code():
    sources = cached.weight_sources()
    for module in (
        "deepinfer.compiler.shard",
        "deepinfer.regions.topology",
        "deepinfer.compiler.weights",
        "deepinfer.regions.checkpoint",
        "deepinfer.bundles.safetensors",
    ):
        assert module in sources, module
    assert "deepinfer.regions.attention" not in sources  # region code shapes graphs, not weight bytes


def test_lowering_leaves_kernels_to_the_kernels_part():
    sources = cached.lowering_sources(spec_lowering())
    assert "deepinfer.compiler.targets.cpu" in sources and "deepinfer.kernels.registry" in sources
    assert not [m for m in sources if m.startswith("deepinfer.kernels.") and m != "deepinfer.kernels.registry"]


@pytest.mark.parametrize("kind", list(KEYS))
def test_editing_any_source_module_changes_the_key(planned, monkeypatch, kind):
    spec, p = planned
    make, sources = KEYS[kind]
    base = make(spec, p).digest
    modules = sources()
    assert len(modules) > 5
    for module in modules:
        with monkeypatch.context() as mp:
            edited(mp, module)
            assert make(spec, p).digest != base, f"editing {module} leaves the {kind} key unchanged"
    assert make(spec, p).digest == base


def test_bundle_key_sees_every_module_the_pipeline_reaches(small_toml, monkeypatch):
    cfg = load_compile_config(small_toml)
    base = cache_key(cfg, log=QUIET).digest
    modules = cached.import_closure(cached.BUNDLE_ROOTS)
    assert {
        "deepinfer.compiler.pipeline",
        "deepinfer.compiler.pools",
        "deepinfer.bundles.manifest",
        "deepinfer.compiler.shard",
    } <= set(modules)
    for module in modules:
        with monkeypatch.context() as mp:
            edited(mp, module)
            assert cache_key(cfg, log=QUIET).digest != base, f"editing {module} leaves the bundle key unchanged"


CLOSURE_SCRIPT = """
import json, sys
roots = sys.argv[1:]
for r in roots:
    __import__(r)
print(json.dumps(sorted(m for m in sys.modules if m == "deepinfer" or m.startswith("deepinfer."))))
"""


@pytest.mark.parametrize("roots", [cached.WEIGHT_ROOTS, cached.TRACE_ROOTS, cached.BUNDLE_ROOTS])
def test_static_closure_covers_what_importing_loads(roots):
    """An independent check of the closure: what the interpreter loads importing the roots is in it."""
    out = subprocess.run(
        [sys.executable, "-c", CLOSURE_SCRIPT, *roots], capture_output=True, text=True, check=True, timeout=120
    )
    loaded = set(json.loads(out.stdout.strip().splitlines()[-1]))
    assert loaded <= set(keys.import_closure(tuple(roots))), loaded - set(keys.import_closure(tuple(roots)))
