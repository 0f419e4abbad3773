"""Bundles for the runtime tests: the golden prompts need 73 positions and a batch of 4."""

from __future__ import annotations

from pathlib import Path

import pytest


def compile_run_bundle(tmp_path_factory, ckpt: Path, executable: str, tokens: list[int]) -> Path:
    from deepinfer.compiler.config import load_compile_config
    from deepinfer.compiler.pipeline import compile_bundle

    root = tmp_path_factory.mktemp(f"run-{executable}")
    toml = root / "model.toml"
    toml.write_text(f"""[model]
checkpoint = "{ckpt}"
dtype = "fp32"
cache_quant = true

[target]
name = "cpu"
executable = "{executable}"

[buckets]
batch = [1, 4]
tokens = {tokens}
max_context = 80

[kv]
block_size = 16
num_blocks = 21
""")
    path, _ = compile_bundle(load_compile_config(toml), root / "bundle", jobs=2, log=lambda msg: None)
    return path


@pytest.fixture(scope="session")
def run_aoti_bundle(aoti_bundle) -> Path:
    """AOTInductor packages, buckets batch {1, 4} x tokens {1} (prompts fed as 1-token chunks)."""
    return aoti_bundle


@pytest.fixture(scope="session")
def run_exported_bundle(tmp_path_factory, tiny_ckpt) -> Path:
    """Saved ExportedPrograms, buckets batch {1, 4} x tokens {1, 8} (8-token prompt chunks)."""
    return compile_run_bundle(tmp_path_factory, tiny_ckpt, "exported", [1, 8])
