"""Shared fixtures: one tiny checkpoint per test session, tool caches kept in the project."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache"
# AOTInductor writes a large precompiled header under TMPDIR and caches under
# TORCHINDUCTOR_CACHE_DIR: keep both inside the project's ignored .cache/.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(CACHE / "inductor"))
os.environ.setdefault("TMPDIR", str(CACHE / "tmp"))
(CACHE / "tmp").mkdir(parents=True, exist_ok=True)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    """The seed-0, 6-layer tiny checkpoint (generated once per session)."""
    from deepinfer.regions.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("ckpt") / "tiny")


@pytest.fixture(scope="session")
def ref_fp32(tiny_ckpt):
    from deepinfer.regions.reference import ReferenceModel

    return ReferenceModel(tiny_ckpt, dtype="fp32", cache_quant=True, ties="lowest")   # as bundles compute
