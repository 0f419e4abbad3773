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


@pytest.fixture(scope="session")
def structured_bundle(tmp_path_factory, tiny_ckpt) -> Path:
    """Saved ExportedPrograms for deepinfer-serve's structured output and tool calls: room for a tool's
    schemas in the prompt (max_context 512, blocks for 4 sequences of it), one shape (batch 4, tokens 1),
    so a sequence's tokens do not depend on what else runs in its batch."""
    return _compile_tiny(
        tmp_path_factory,
        "structured",
        tiny_ckpt,
        executable="exported",
        tokens=[1],
        batch=(4,),
        max_context=512,
        num_blocks=129,
        cache_quant=False,
    )
