"""One execution per layer on trn2 (issue 29): a layer's regions and the collectives between them in
one HLO module (compiler/layers.py), spliced from pieces by compiler/targets/link.py.

Real HLO modules on real XLA:CPU, one CPU device a replica (a rank); nothing of Trn2 or neuronx-cc.
The references: torch computing what each collective means (the linker), and the layer's ops run
eagerly per rank with the host's collectives (`layers.interpret`: the regions' torch code, the
merges of regions/divided.py, sums over the groups), which tests/regions/test_divided.py ties to
one rank's `decode`.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torch_mlir", reason="the trn2 lowering needs the [trn2] extra (torch-mlir)")
pytest.importorskip("jax", reason="the trn2 lowering needs the [trn2] extra (jax, jaxlib)")

from deepinfer.compiler import layers
from deepinfer.compiler.config import load_compile_config
from deepinfer.compiler.pipeline import plan
from deepinfer.compiler.spec import parse
from deepinfer.compiler.step_reads import executable_reads
from deepinfer.compiler.targets import hlo, link
from deepinfer.compiler.targets.hlo_reads import parameter_reads
from deepinfer.compiler.targets.link import Call, Collective
from deepinfer.compiler.targets.trn2 import Trn2Target

from ..conftest import write_model_toml

xla_client = pytest.importorskip("jax._src.lib").xla_client

PAIR = ((0, 1),)


class _Scale(torch.nn.Module):
    def forward(self, x, i):
        return x * 2, i + 1


class _Combine(torch.nn.Module):
    def forward(self, y, g):
        return y + g.sum(0)


def _piece(module, *args) -> str:
    target = Trn2Target("neff", {})
    return hlo.to_stablehlo(target.lower(torch.export.export(module, args)))


def _pieces() -> dict[str, str]:
    x = torch.zeros(2, 3)
    return {
        "scale": _piece(_Scale(), x, torch.zeros(3, dtype=torch.int64)),
        "combine": _piece(_Combine(), x, torch.zeros(2, 2, 3)),
    }


PARAMS = [
    ("x", link.tensor_type((2, 3), torch.float32)),
    ("i", link.tensor_type((3,), torch.int64)),
    ("m", link.tensor_type((2,), torch.bool)),
]


def test_linked_collectives_compute_what_they_mean_on_two_replicas():
    """Two pieces spliced around every collective the layers use, run on two XLA:CPU replicas: an
    all-reduce (sum and max), an all-gather stacked and along a dim (a bool one moves as bytes), a
    reduce-scatter converted to bfloat16; each equals torch's computation of it."""
    steps = [
        Call("scale", ("x", "i"), ("x2", "i2")),
        Collective("all_reduce", "x2", "total", PAIR),
        Collective("all_reduce", "x2", "top", PAIR, reduce="max"),
        Collective("all_gather", "x2", "stacked", PAIR, stack=True),
        Collective("all_gather", "i2", "ids", PAIR),
        Collective("all_gather", "m", "masks", PAIR),
        Collective("reduce_scatter", "x2", "mine", PAIR, to=torch.bfloat16),
        Call("combine", ("total", "stacked"), ("y",)),
    ]
    results = ["y", "top", "ids", "masks", "mine"]
    text = link.link(PARAMS, _pieces(), steps, results)
    assert "call" not in text  # one flat computation
    module = hlo.finish_module(text, {}, [n for n, _ in PARAMS], results)
    xs = [torch.randn(2, 3, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    ids = [torch.arange(3), torch.arange(3) + 10]
    masks = [torch.tensor([True, False]), torch.tensor([False, True])]
    got = hlo.CpuReplicas(hlo.to_hlo_proto(module), 2)([[xs[r], ids[r], masks[r]] for r in range(2)])
    total = 2 * xs[0] + 2 * xs[1]
    for r, (y, top, gathered, gathered_masks, mine) in enumerate(got):
        torch.testing.assert_close(y, total + total)  # the stacked gather summed over ranks = the sum
        assert torch.equal(top, torch.maximum(2 * xs[0], 2 * xs[1]))
        assert torch.equal(gathered, torch.cat([ids[0] + 1, ids[1] + 1]))
        assert gathered_masks.dtype == torch.bool and torch.equal(gathered_masks, torch.cat(masks))
        assert mine.dtype == torch.bfloat16 and torch.equal(mine, total[r : r + 1].to(torch.bfloat16))


@pytest.mark.parametrize(
    ("steps", "message"),
    [
        ([Collective("all_reduce", "i", "s", PAIR)], "i64 is not a float type"),
        ([Collective("all_reduce", "x", "s", ((0, 1), (1, 2)))], "do not partition the ranks"),
        ([Call("scale", ("i", "i"), ("a", "b"))], "i is tensor<3xi64>, the piece takes tensor<2x3xf32>"),
        ([Call("scale", ("x", "nothing"), ("a", "b"))], "no value named 'nothing'"),
        ([Call("scale", ("x",), ("a", "b"))], "takes 2 parameters, 1 were named"),
    ],
)
def test_the_linker_refuses_in_one_line(steps, message):
    with pytest.raises(hlo.LoweringError) as err:
        link.link(PARAMS, _pieces(), steps, ["x"])
    assert message in str(err.value) and "\n" not in str(err.value)


def _spec(tmp_path, tiny_ckpt, parallel):
    toml = write_model_toml(
        tmp_path,
        tiny_ckpt,
        tiny_layers=6,
        target="trn2",
        executable="neff",
        options="{ lnc = 1, optlevel = 1 }",
        num_blocks=5,
        parallel=parallel,
    )
    spec = parse(load_compile_config(toml), True, lambda msg: None)
    return spec, plan(spec, lambda msg: None)


# (tp, ep, cp) -> {layer kind: the collectives its module holds, in order}. EP dispatch (ep = 2) is
# checked by the compile of a whole bundle at that layout, every layer kind on two replicas
# (tests/conftest.py trn2_ep2_bundle, read by tests/trn2/test_collectives.py)
# The attention's partial streams are summed over the token group ("all_reduce h" after the attention),
# then, with ep = tp * cp, the MoE's (the second "all_reduce h").
SOURCE_R1_CAND = [
    *("all_gather query", "all_gather values", "all_gather index", "all_gather block_values", "all_gather block_index"),
    *("all_reduce top", "all_reduce numerator_s", "all_reduce total_s", "all_reduce h", "all_reduce h"),
]
LAYOUTS = {
    "tp=2": ((2, 1, 1), {"layer_window": ["all_reduce h"], "layer_window_engram": ["all_reduce kv", "all_reduce h"]}),
    "cp=ep=4": (
        (1, 4, 4),
        {
            # the engram's partials, the attention's, the MoE's
            "layer_window_engram": ["all_reduce kv", "all_reduce h", "all_reduce h"],
            "layer_source_r1_cand": SOURCE_R1_CAND,
            "layer_reindex_r1_cand": [
                *("all_gather query", "all_gather values", "all_gather index"),
                *("all_reduce top", "all_reduce numerator_s", "all_reduce total_s", "all_reduce h", "all_reduce h"),
            ],
        },
    ),
    "tp=2xcp=2,ep=4": (
        (2, 4, 2),
        {"layer_window": ["all_reduce h", "all_reduce h"], "layer_source_r1_cand": SOURCE_R1_CAND},
    ),
}


@pytest.mark.slow  # each layer module lowered, compiled for 2 or 4 XLA:CPU replicas and run: about 60 s
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layer_modules_match_the_host_collectives_on_replicas(tmp_path, tiny_ckpt, name):
    """At tp = 2 (the heads' partial streams summed over the tp group) and cp = ep = 4 (the divided
    attention's merges over the cp group, the candidate pool's, the MoE all-reduce), with the engram's
    partial keys and value summed over the token group at both, a layer kind's one module holds its collectives over the rank's groups, recorded in
    its entry, and on one XLA:CPU replica a rank equals its ops run eagerly with the host's
    collectives (the compile's own check, `layers.check`)."""
    parallel, expected = LAYOUTS[name]
    spec, regions = _spec(tmp_path, tiny_ckpt, parallel)
    fused = regions.fused_kinds()
    memo: layers.Lowered = {}
    for kind, collectives in expected.items():
        exe = next(e for e in spec.executables(regions) if e.kind == kind)
        out = tmp_path / f"{exe.name}.hlo.pb"
        entry, _, _ = layers.trace(spec, regions, fused[kind], exe, out, lambda msg: None, memo)
        assert [f"{c.op} {c.value}" for c in entry.collectives or ()] == collectives, kind
        for c in entry.collectives or ():
            assert sorted(r for g in c.groups for r in g) == list(range(spec.topology.world))
        assert entry.check is not None and entry.check["replicas"] == spec.topology.world
        reads = parameter_reads(out.read_bytes())  # what the module reads: the cost model's figure
        module = sum(reads[s.name] for s in entry.inputs if s.role == "weight")
        assert module == executable_reads(regions, spec.topology, kind, exe.batch * exe.tokens), kind
        assert 0 < entry.check["max_abs"] and entry.check["score"] <= 1e-5, (kind, entry.check)
        text = xla_client.XlaComputation(out.read_bytes()).as_hlo_text()
        for op in {c.op for c in entry.collectives or ()}:
            assert f" {op.replace('_', '-')}(" in text, (kind, op)
        assert entry.outputs[:2] == ("h", "pre") and set(entry.state_outputs or ()) <= {s.name for s in entry.inputs}
