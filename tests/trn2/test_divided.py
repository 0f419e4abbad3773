"""The trn2 target lowers the divided attention's stages (regions/divided.py) to HLO and checks each on
XLA:CPU against its region (the merges between the stages are the runtime's collectives at region
boundaries here; putting them inside the graph is the collectives' own issue).

Real HLO modules and real XLA:CPU numerics (torch-mlir, jaxlib); nothing of Trn2 or neuronx-cc.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch_mlir", reason="the trn2 lowering needs the [trn2] extra (torch-mlir)")
pytest.importorskip("jax", reason="the trn2 lowering needs the [trn2] extra (jax, jaxlib)")

from deepinfer.compiler.config import load_compile_config
from deepinfer.compiler.executables import check, emit, lower
from deepinfer.compiler.pipeline import plan
from deepinfer.compiler.spec import parse

from ..conftest import write_model_toml

STAGES = {"select", "attend", "output"}


@pytest.mark.slow  # eleven HLO modules lowered and run on XLA:CPU: about 40 s
def test_divided_stages_lower_and_check_on_xla_cpu(tmp_path, tiny_ckpt):
    """At cp = ep = 2 every compressed attention kind's stages (select for the sources and the index
    layer, attend and output for all four) lower to HLO and agree with their regions on XLA:CPU, each
    stage's pools shaped at the rank's share of the blocks."""
    toml = write_model_toml(
        tmp_path,
        tiny_ckpt,
        tiny_layers=6,
        target="trn2",
        executable="neff",
        options="{ lnc = 1, optlevel = 1 }",
        num_blocks=5,
        parallel=(1, 2, 2),
    )
    spec = parse(load_compile_config(toml), True, lambda msg: None)
    regions = plan(spec, lambda msg: None)
    staged = [e for e in spec.executables(regions) if e.method in STAGES]
    assert {(e.kind, e.method) for e in staged} == {
        *((k, m) for k in ("attn_source_r2", "attn_source_r1_cand", "attn_reindex_r1_cand") for m in STAGES),
        ("attn_reuse_r2", "attend"),
        ("attn_reuse_r2", "output"),
    }
    for exe in staged:
        graph = lower(spec, regions, exe)
        paged = [s for s in graph.entry.inputs if s.name in ("ckv", "ikeys")]
        assert all(s.shape[0] == 3 for s in paged), exe.name  # (5 - 1) / 2 usable blocks + scratch
        out = tmp_path / f"{exe.name}.hlo.pb"
        entry = check(spec, graph, emit(spec, graph, out), out, lambda msg: None)
        assert entry.check is not None and 0 <= entry.check["score"] <= 1e-5, (exe.name, entry.check)
        assert entry.check["max_abs"] > 0, exe.name
