"""Bundles for the runtime tests: the golden prompts need 73 positions and a batch of 4."""

from __future__ import annotations

from pathlib import Path

import pytest

from ..conftest import _compile_tiny


@pytest.fixture(scope="session")
def run_aoti_bundle(aoti_bundle) -> Path:
    """AOTInductor packages, buckets batch {1, 4} x tokens {1} (prompts fed as 1-token chunks)."""
    return aoti_bundle


@pytest.fixture(scope="session")
def run_exported_bundle(tmp_path_factory, tiny_ckpt) -> Path:
    """Saved ExportedPrograms, buckets batch {1, 4} x tokens {1, 6, 8} (8-token prompt chunks; 6 the
    speculative verify step, a DSpark block of 5 and the anchor) x context {16, 80} (the golden prompts
    cross from one to the other while generating, the longest while prefilling), cache quantization on;
    with the checkpoint's DSpark draft compiled in ([speculative] draft: its regions at batch {1, 4})."""
    return _compile_tiny(
        tmp_path_factory,
        "run-exported",
        tiny_ckpt,
        executable="exported",
        tokens=[1, 6, 8],
        batch=(1, 4),
        max_context=80,
        context=(16, 80),
        num_blocks=21,
        cache_quant=True,
        extra='\n[speculative]\ndraft = "dspark"\n',
    )
