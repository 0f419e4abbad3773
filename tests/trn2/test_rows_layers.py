"""A prompt chunk divided by rows as one execution a layer on trn2 (issue 41, compiler/rows_layers.py).

Real HLO modules on real XLA:CPU, one replica a rank; nothing of Trn2 or neuronx-cc. Two references:
- the compile's own check (`layers.check`): the module against its ops run eagerly per rank with the
  host's collectives;
- independent of the module's op list: the cpu runtime's divided step (`regions.step.rows_steps`,
  what `[prompt] rows = "divided"` runs per region call), each rank in a thread of its own with the
  collectives its `Rows` makes done on the host between them (an exchange with bounded waits), which
  tests/ranks/test_ranks.py ties to one rank's tokens.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch_mlir", reason="the trn2 lowering needs the [trn2] extra (torch-mlir)")
pytest.importorskip("jax", reason="the trn2 lowering needs the [trn2] extra (jax, jaxlib)")

from deepinfer.bundles.manifest import BEST, DECODE, HEAD_ROWS, LAYER_ROWS, ROWS_SLOT
from deepinfer.compiler import layers, rows_layers
from deepinfer.compiler.config import load_compile_config
from deepinfer.compiler.pipeline import plan
from deepinfer.compiler.spec import parse

from ..conftest import write_model_toml

WORLD = 4  # cp = ep = 4: the rows over the four ranks
WAIT_S = 120  # a rank's wait for the others at a collective
DIVIDED = '\n[prompt]\nrows = "divided"\n'


def compiled(tmp_path, ckpt):
    toml = write_model_toml(
        tmp_path,
        ckpt,
        tiny_layers=6,
        target="trn2",
        executable="neff",
        options="{ lnc = 1, optlevel = 1 }",
        tokens=(1, 8),
        num_blocks=9,
        block_size=4,
        cache_quant=False,
        parallel=(1, WORLD, WORLD),
        extra=DIVIDED,
    )
    spec = parse(load_compile_config(toml), True, lambda msg: None)
    return spec, plan(spec, lambda msg: None)


@pytest.fixture(scope="module")
def divided(tmp_path_factory, tiny_ckpt):
    return compiled(tmp_path_factory.mktemp("rows-layers"), tiny_ckpt)


@pytest.mark.slow  # each layer kind's rows module lowered, compiled for 4 XLA:CPU replicas and run
def test_each_layer_kinds_rows_module_matches_its_ops_on_four_replicas(tmp_path, divided):
    """Every layer kind has a `rows` executable at the prompt bucket only (decode at both); its module
    holds the rows' gathers and scatters over the four ranks, in the order the stages need them, and on
    one XLA:CPU replica a rank equals its ops run eagerly with the host's collectives."""
    spec, regions = divided
    kinds = regions.fused_kinds()
    exes = spec.executables(regions)
    memo: layers.Lowered = {}
    for name, lk in kinds.items():
        assert {(e.method, e.tokens) for e in exes if e.kind == name} == {(DECODE, 1), (DECODE, 8), (LAYER_ROWS, 8)}
        exe = next(e for e in exes if e.kind == name and e.method == LAYER_ROWS)
        out = tmp_path / f"{exe.name}.hlo.pb"
        entry, _, _ = layers.trace(spec, regions, lk, exe, out, lambda msg: None, memo)
        twin = regions.kinds[dict(lk.slots)[ROWS_SLOT]].region
        source = "rows_write" in twin.methods()
        want = ["reduce_scatter kv"] if "engram" in dict(lk.slots) else []
        want += ["all_gather packed"]
        want += ["all_gather ckv_pages_mine", "all_gather ikeys_pages_mine"] if source else []
        want += ["all_gather x", "all_gather weights", "all_gather experts", "reduce_scatter partial"]
        assert [f"{c.op} {c.value}" for c in entry.collectives or ()] == want, name
        assert entry.check is not None and entry.check["replicas"] == WORLD
        assert 0 < entry.check["max_abs"] and entry.check["score"] <= 1e-5, (name, entry.check)
        assert entry.outputs == tuple(rows_layers.outputs(lk, regions)), name
        h = next(s for s in entry.inputs if s.name == "h")
        assert h.shape[1] == 8 // WORLD, name  # a rank's rows of the chunk


@pytest.mark.slow  # the head's module at the prompt bucket, its decode and its best, on 4 XLA:CPU replicas
def test_the_heads_module_gathers_the_ranks_rows_then_runs_the_head(tmp_path, divided):
    """After the layers, the head is one module at the prompt bucket: the rank's rows of h and pre
    all-gathered along the rows, then the head's `decode` (this rank's vocabulary slice of every row)
    or `best` (their greedy pairs); on one XLA:CPU replica a rank it equals its ops run eagerly. The
    embedding is built at a rank's share of the prompt bucket's tokens too."""
    spec, regions = divided
    exes = spec.executables(regions)
    assert {(e.method, e.tokens) for e in exes if e.kind == HEAD_ROWS} == {(DECODE, 8), (BEST, 8)}
    assert {e.tokens for e in exes if e.kind == "embed"} == {1, 8, 8 // WORLD}
    lk = regions.fused_modules()[HEAD_ROWS]
    memo: layers.Lowered = {}
    for exe in (e for e in exes if e.kind == HEAD_ROWS):
        entry, _, _ = layers.trace(spec, regions, lk, exe, tmp_path / f"{exe.name}.hlo.pb", lambda msg: None, memo)
        assert [f"{c.op} {c.value}" for c in entry.collectives or ()] == ["all_gather h", "all_gather pre"]
        assert entry.check is not None and entry.check["replicas"] == WORLD
        assert entry.check["score"] <= 1e-5, entry.check
        h = next(s for s in entry.inputs if s.name == "h")
        out = entry.output_specs[0]
        assert h.shape[:2] == (1, 8 // WORLD) and out.shape[:2] == (1, 8), exe  # every row of the chunk out
