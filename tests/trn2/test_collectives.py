"""Collectives inside the HLO modules (issue 29, first part): a region's boundary all-reduce written
into its module (hlo.finish_module's `reduce`) and run on N replicas of XLA:CPU, one CPU device a
rank, against the host-collective path: each rank's region run eagerly and its partials summed, as
runtime/ranks.Comm.after does over gloo. A fused layer's collectives (compiler/layers.py) are checked
the same way by the compile itself, in the bundle test below and in tests/trn2/test_layers.py."""

from __future__ import annotations

import json

import pytest
import torch

from deepinfer.bundles.topology import Topology
from deepinfer.compiler.shard import shard
from deepinfer.compiler.targets import hlo
from deepinfer.compiler.targets.trn2 import Trn2Target
from deepinfer.compiler.trace import trace
from deepinfer.compiler.weights import in_format
from deepinfer.regions.checkpoint import Checkpoint, load_region
from deepinfer.regions.config import load_config
from deepinfer.regions.examples import example_inputs
from deepinfer.regions.moe import MoE
from deepinfer.regions.plan import make_attention
from deepinfer.regions.state import Geometry
from deepinfer.regions.step import plan_layers

pytest.importorskip("torch_mlir")
xla_client = pytest.importorskip("jax._src.lib").xla_client

G = Geometry(slots=2, blocks=4, block_size=16, max_blocks=2)


def _module(tmp_path, region, reduce: dict[str, list[list[int]]]):
    """The region traced for a [2, 1] step, lowered and emitted with `reduce` -> (proto, names, inputs)."""
    program, sig = trace(region, 2, 1, G, dynamic=False)
    target = Trn2Target("neff", {})
    names = [s.name for s in sig.all]
    path = tmp_path / f"{region.kind}.hlo.pb"
    target.emit(target.lower(program), names, region.output_names(), path, reduce=reduce)
    return path.read_bytes(), names, example_inputs(sig.inputs, G, seed=3)


def _ranked(full, make, kind: str, c, topo: Topology, rank: int):
    """`make()` for `topo` holding rank `rank`'s shards of `full`'s weights, as the weight recipe stores them."""
    region = make()
    for spec in region.specs:
        getattr(region, spec.name).copy_(
            shard(kind, spec.name, getattr(full, spec.name), c, topo, rank, spec.buffer_shape)
        )
    region.rank.fill_(rank)
    stored = in_format(region.specs, {s.name: getattr(region, s.name) for s in region.specs}, region.fp8_format)
    stored["rank"] = torch.tensor(rank)
    return region.with_weights(stored), stored


def _replicas_equal_host_sum(tmp_path, ranked: list, reduce: dict, state: int) -> None:
    """The module of ranked[0]'s region with `reduce`, run on one replica a rank: every replica's
    reduced stream equals the sum of the ranks' eager partials (the host path); the outputs not
    reduced are each rank's own."""
    proto, names, inputs = _module(tmp_path, ranked[0][0], reduce)
    entry = xla_client.XlaComputation(proto).as_hlo_text()
    assert entry.count(" all-reduce(") == len(reduce) and "channel_id" not in entry
    n = len(names) - len(inputs)
    weights = [[stored[name] for name in names[:n]] for _, stored in ranked]
    regions = [region for region, _ in ranked]
    got = hlo.CpuReplicas(proto, len(regions))([w + [a.clone() for a in inputs] for w in weights])
    with torch.no_grad():
        eager = [r.decode(*[a.clone() for a in inputs]) for r in regions]
    summed = torch.stack([e[0] for e in eager]).sum(0)
    assert summed.abs().max() > 0
    for rank, (out, own) in enumerate(zip(got, eager)):
        torch.testing.assert_close(out[state], summed, rtol=1e-5, atol=1e-5, msg=f"rank {rank}")
        for g, e in zip(out[state + 1 :], own[1:]):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5, msg=f"rank {rank}")


def test_tp_all_reduce_in_the_module_equals_the_host_sum(tmp_path, tiny_ckpt):
    """tp = 2: the window attention's partial streams summed over the tp group in the module (the
    window ring, a state output, comes first and stays each rank's own)."""
    c = load_config(tiny_ckpt).text
    topo = Topology(tp=2)
    plan = next(p for p in plan_layers(c) if p.attn == "window")
    full = make_attention(c, plan, torch.float32, True)
    load_region(Checkpoint(tiny_ckpt), full, f"layers.{plan.layer}.")
    ranked = [
        _ranked(full, lambda: make_attention(c, plan, torch.float32, True, topo), full.kind, c, topo, r)
        for r in range(2)
    ]
    assert topo.tp_groups() == [[0, 1]]
    _replicas_equal_host_sum(tmp_path, ranked, {"h": topo.tp_groups()}, state=1)


def test_groups_partition_the_ranks_and_integers_are_refused(tmp_path, tiny_ckpt):
    c = load_config(tiny_ckpt).text
    region = MoE(c, dtype=torch.float32, topo=Topology(cp=2, ep=2))
    with pytest.raises(hlo.LoweringError, match="do not partition the ranks"):
        _module(tmp_path, region, {"h": [[0, 1], [1, 2]]})
    with pytest.raises(hlo.LoweringError, match="not an output of the region"):
        _module(tmp_path, region, {"logits": [[0, 1]]})
    assert Topology(tp=2, cp=2).tp_groups() == [[0, 1], [2, 3]]
    assert Topology(tp=2, cp=2).cp_groups() == [[0, 2], [1, 3]]
    assert Topology(cp=2, ep=4).cp_groups() == [[0, 1], [2, 3]]


def test_hlo_bundle_fuses_each_layer_with_its_collectives(trn2_ep2_bundle):
    """deepinfer-compile --hlo-only of the tiny model for trn2 at ep = 2 (EP dispatch: two token groups
    of one rank each): one module per layer kind and bucket (compiler/layers.py), every layer bound to
    one (the manifest's `fused`), each holding the dispatch's three all-gathers and the combine's
    reduce-scatter over both ranks, recorded in its entry, and checked on two XLA:CPU replicas against
    its ops run eagerly with host collectives; the embedding and the head hold none."""
    bundle = trn2_ep2_bundle
    m = json.loads((bundle / "manifest.json").read_text())
    fused = {e["kind"] for e in m["regions"] if e["kind"].startswith("layer_")}
    assert {l["fused"] for l in m["layers"]} == fused and len(fused) >= 4
    for e in m["regions"]:
        text = xla_client.XlaComputation((bundle / e["artifact"]).read_bytes()).as_hlo_text()
        counts = [text.count(f" {op}(") for op in ("all-gather", "reduce-scatter", "all-reduce")]
        if e["kind"] in fused:
            assert counts == [3, 1, 0], e["kind"]
            assert [(c["op"], c["value"], c["groups"]) for c in e["collectives"]] == [
                *(("all_gather", v, [[0, 1]]) for v in ("h", "pre", "is_image")),
                ("reduce_scatter", "h_part", [[0, 1]]),
            ]
            assert e["check"]["replicas"] == 2 and 0 < e["check"]["max_abs"] and e["check"]["score"] <= 1e-5
        else:
            assert counts == [0, 0, 0] and e["kind"] in ("embed", "head") and not e.get("collectives")


def test_a_reduced_float32_sum_leaves_in_the_streams_dtype():
    """finish_module sums a float32 output over [[0, 1], [2, 3]] and converts it to bfloat16 (the
    activation dtype the next region reads); an output it does not reduce keeps its dtype."""

    class Partial(torch.nn.Module):
        def forward(self, rank, x):
            return x * (rank + 1).float() / 3, x + 1

    program = torch.export.export(Partial(), (torch.tensor(0), torch.ones(2, 3))).run_decompositions(
        hlo.hlo_decompositions()
    )
    text = hlo.finish_module(
        hlo.to_stablehlo(program), {}, ["rank", "x"], ["h", "other"], {0: [[0, 1], [2, 3]]}, torch.bfloat16
    )
    got = hlo.CpuReplicas(hlo.to_hlo_proto(text), 4)([[torch.tensor(r), torch.ones(2, 3)] for r in range(4)])
    for r, (h, other) in enumerate(got):
        pair = (1, 2) if r < 2 else (3, 4)
        want = sum(torch.full((2, 3), float(k)) / 3 for k in pair).to(torch.bfloat16)
        assert h.dtype == torch.bfloat16 and torch.equal(h, want), r
        assert other.dtype == torch.float32 and torch.equal(other, torch.full((2, 3), 2.0))
