"""The cost model's weight bytes are what the lowered modules read (compiler/step_reads.py).

For every executable of tiny trn2 bundles (one rank; EP dispatch over two ranks), the plan's figure
for one call equals what its HLO module reads of its weight parameters, counted from the module
itself (compiler/targets/hlo_reads.py: whole parameters, and of a gathered or sliced one only what
the gathers take): the model cannot drift from what is compiled.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch_mlir", reason="the trn2 lowering needs the [trn2] extra (torch-mlir)")
pytest.importorskip("jax", reason="the trn2 lowering needs the [trn2] extra (jax, jaxlib)")

from deepinfer.compiler.bundle_plan import plan_bundle
from deepinfer.compiler.config import load_compile_config
from deepinfer.compiler.step_reads import executable_reads
from deepinfer.compiler.targets.hlo_reads import parameter_reads

pytestmark = pytest.mark.slow


def _check(bundle: Path) -> list[str]:
    """Each executable's (kind, plan's bytes, module's bytes); asserts they agree."""
    manifest = json.loads((bundle / "manifest.json").read_text())
    plan = plan_bundle(load_compile_config(bundle.parent / "model.toml"), scratch=False)
    seen = []
    for e in manifest["regions"]:
        weights = {s["name"] for s in e["inputs"] if s["role"] == "weight"}
        reads = parameter_reads((bundle / e["artifact"]).read_bytes())
        module = sum(reads[name] for name in weights)
        rows = e["bucket"]["batch"] * e["bucket"]["tokens"]
        assert executable_reads(plan.regions, plan.spec.topology, e["kind"], rows) == module, e["kind"]
        seen.append(e["kind"])
    return seen


def test_plan_reads_what_the_one_rank_modules_read(trn2_hlo_bundle):
    kinds = _check(trn2_hlo_bundle)
    assert "embed" in kinds and "head" in kinds and sum(k.startswith("layer_") for k in kinds) == 6


def test_plan_reads_what_the_ep_dispatch_modules_read(trn2_ep2_bundle):
    assert len(_check(trn2_ep2_bundle)) >= 6
