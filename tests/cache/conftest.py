"""A small exported model (8 executables, no C++ compile) and a cache filled by compiling it once."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from deepinfer.compiler.cache.local import Cache
from deepinfer.compiler.config import load_compile_config
from deepinfer.compiler.pipeline import CompileReport, compile_bundle

from ..conftest import write_model_toml

EXECUTABLES = 8  # 8 region kinds x 1 bucket


def write_toml(directory: Path, ckpt: Path, *, options: str = "{}", num_blocks: int = 5, extra: str = "") -> Path:
    """The small model of the cache tests: saved ExportedPrograms, bucket (1, 1), cache quantization on."""
    return write_model_toml(directory, ckpt, executable="exported", options=options, num_blocks=num_blocks, extra=extra)


def compile_cached(toml: Path, out: Path, cache_dir: Path, **kwargs) -> tuple[CompileReport, Cache]:
    """Compile through a fresh Cache of `cache_dir`: the report (the bundle, what it compiled) and the cache."""
    cache = Cache(cache_dir)
    report = compile_bundle(
        load_compile_config(toml), out, jobs=2, force=True, log=lambda msg: None, cache=cache, **kwargs
    )
    return report, cache


@pytest.fixture(scope="session")
def small_toml(tmp_path_factory, tiny_ckpt) -> Path:
    return write_toml(tmp_path_factory.mktemp("small"), tiny_ckpt)


@pytest.fixture(scope="session")
def filled(tmp_path_factory, small_toml) -> tuple[Path, Path, Cache]:
    """(cache dir, bundle, cache) after one cold compile of the small model."""
    root = tmp_path_factory.mktemp("filled")
    report, cache = compile_cached(small_toml, root / "bundle", root / "cache")
    assert len(report.compiled) == EXECUTABLES
    return root / "cache", report.bundle, cache


@pytest.fixture
def cache_copy(filled, tmp_path) -> Path:
    """A private copy of the filled cache, free to damage."""
    return shutil.copytree(filled[0], tmp_path / "cache")
