"""Executables take the weights and the rank as inputs, and are shared by every layer of a kind.

The AOTInductor bundle is the one that matters for the rank: Inductor
constant-folds registered buffers, so a rank left as a buffer would be baked
into the package. One package of the MoE region is run with rank 0 and rank 1,
and with two layers' weights, each against the eager reference region.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from deepinfer.bundles import manifest_io
from deepinfer.regions.examples import example_inputs
from deepinfer.regions.state import Geometry

# compiled vs eager float32: same ops, possibly reassociated by Inductor
TOL = dict(rtol=1e-4, atol=1e-4)


def geometry(m: dict) -> Geometry:
    kv = m["kv"]
    return Geometry(
        slots=kv["slots"], blocks=kv["num_blocks"], block_size=kv["block_size"], max_blocks=kv["max_blocks"]
    )


def entry(m: dict, kind: str, batch: int, tokens: int) -> dict:
    [e] = [e for e in m["regions"] if e["kind"] == kind and e["bucket"] == {"batch": batch, "tokens": tokens}]
    return e


def stacks(bundle, m: dict, kind: str) -> dict[str, torch.Tensor]:
    [w] = [w for w in m["weights"]["rank-0"] if w["kind"] == kind]
    return load_file(str(bundle / w["path"]))


def flat_inputs(e: dict, stack: dict, index: int, rank: int, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """An executable's flat inputs from its manifest entry: weights (slice `index`), rank, then `inputs`."""
    flat = []
    for spec in e["inputs"]:
        if spec["role"] == "rank":
            flat.append(torch.tensor(rank, dtype=torch.int64))
        elif spec["role"] == "weight":
            flat.append(stack[spec["name"]][index])
    return flat + [t.clone() for t in inputs]


class MoEPackage:
    """The AOTI bundle's MoE executable, its weight stacks and the inputs of its bucket."""

    def __init__(self, bundle):
        self.m = manifest_io.to_json(manifest_io.read(bundle))
        self.bucket = self.m["buckets"]["shapes"][0]
        self.e = entry(self.m, "moe", self.bucket["batch"], self.bucket["tokens"])
        self.runner = torch._inductor.aoti_load_package(str(bundle / self.e["artifact"]))
        self.stack = stacks(bundle, self.m, "moe")

    def index_of(self, layer: int) -> int:
        ref = self.m["layers"][layer]["regions"]["moe"]
        assert ref["kind"] == "moe"
        return ref["index"]

    def inputs(self, region, seed=0) -> list[torch.Tensor]:
        g = geometry(self.m)
        return example_inputs(region.input_specs(self.bucket["batch"], self.bucket["tokens"], g), g, seed=seed)

    def __call__(self, layer: int, rank: int, inputs) -> tuple[torch.Tensor, ...]:
        return tuple(self.runner(*flat_inputs(self.e, self.stack, self.index_of(layer), rank, inputs)))


@pytest.fixture(scope="module")
def moe(aoti_bundle):
    return MoEPackage(aoti_bundle)


def eager(region, inputs, rank: int = 0):
    """The reference region's outputs at `rank` (its rank buffer restored afterwards)."""
    saved = region.rank.clone()
    try:
        region.rank.fill_(rank)
        with torch.inference_mode():
            return tuple(region.decode(*[t.clone() for t in inputs]))
    finally:
        region.rank.copy_(saved)


def assert_outputs_close(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL)


def test_signature_is_weights_rank_then_inputs(moe, ref_fp32):
    region = ref_fp32.layers[0]["moe"]
    names = [(s["name"], s["role"]) for s in moe.e["inputs"]]
    assert names[0] == ("rank", "rank") and moe.e["inputs"][0]["shape"] == []
    n = len(list(region.named_buffers()))
    assert [name for name, _ in names[:n]] == [name for name, _ in region.named_buffers()]
    assert all(role == "weight" for _, role in names[1:n])
    specs = region.input_specs(moe.bucket["batch"], moe.bucket["tokens"], geometry(moe.m))
    assert names[n:] == [(s.name, s.role) for s in specs]
    assert moe.e["executable"] == "aoti" and moe.e["outputs"] == ["h", "pre"]


@pytest.fixture(scope="module")
def ep_moe(ref_fp32, tmp_path_factory):
    """An expert-parallel (ep = 2) MoE region holding rank 0's shards of layer 0, and its
    AOTInductor package (batch 1, one token): there the rank selects experts and the residual."""
    from deepinfer.bundles.topology import Topology
    from deepinfer.compiler.shard import shard
    from deepinfer.compiler.targets.cpu import CpuTarget
    from deepinfer.compiler.trace import concrete_inputs, trace
    from deepinfer.regions.moe import MoE

    full, topo = ref_fp32.layers[0]["moe"], Topology(ep=2)
    c = full.c
    region = MoE(c, dtype=torch.float32, topo=topo)
    for spec in region.specs:
        getattr(region, spec.name).copy_(
            shard("moe", spec.name, getattr(full, spec.name), c, topo, 0, spec.buffer_shape)
        )
    g = Geometry(slots=2, blocks=2, block_size=16, max_blocks=1)
    ep, sig = trace(region, 1, 1, g)
    target = CpuTarget("aoti")
    path = tmp_path_factory.mktemp("ep_moe") / "moe.pt2"
    lowered = target.lower(ep)
    concrete_inputs(lowered)  # traced programs keep meta example inputs only
    torch._inductor.aoti_compile_and_package(lowered, package_path=str(path))
    runner = torch._inductor.aoti_load_package(str(path))
    inputs = example_inputs(sig.inputs, g, seed=1)
    weights = [t for name, t in region.named_buffers() if name != "rank"]

    def run(rank: int):
        return tuple(runner(torch.tensor(rank, dtype=torch.int64), *weights, *[t.clone() for t in inputs]))

    return region, inputs, run


def test_rank_is_an_input_not_baked(ep_moe):
    """One package run as rank 0 and rank 1 matches the eager region at each rank: rank 1
    routes to the other half of the experts and leaves the residual to rank 0."""
    region, inputs, run = ep_moe
    assert [n for n, _ in region.named_buffers()][0] == "rank"
    rank0, rank1 = run(0), run(1)
    assert_outputs_close(rank0, eager(region, inputs, rank=0))
    assert_outputs_close(rank1, eager(region, inputs, rank=1))
    # a package with rank 0 baked in would return rank0 for rank 1
    assert (rank1[0] - rank0[0]).abs().max() > 1e-2
    assert region.rank.item() == 0


def test_weights_are_inputs_not_baked(moe, ref_fp32):
    """The same package with layer 0's and layer 3's weights matches each layer's eager region."""
    inputs = moe.inputs(ref_fp32.layers[0]["moe"])  # the same activations for both
    outs = {}
    for layer in (0, 3):
        outs[layer] = moe(layer, 0, inputs)
        assert_outputs_close(outs[layer], eager(ref_fp32.layers[layer]["moe"], inputs))
    assert moe.index_of(0) != moe.index_of(3)
    assert (outs[0][0] - outs[3][0]).abs().max() > 1e-2


# --- one executable per (kind, method, bucket), whatever the layer count (saved ExportedPrograms) ---

# the tiny model's kinds that read a block table: built per context bucket
CONTEXT_KINDS = {"attn_source_r2", "attn_reuse_r2", "attn_source_r1_cand", "attn_reindex_r1_cand"}


def executable_keys(m: dict) -> list[tuple]:
    return [
        (e["kind"], e["method"], e["bucket"]["batch"], e["bucket"]["tokens"], e["bucket"].get("context"))
        for e in m["regions"]
    ]


@pytest.mark.parametrize("name", ["exported_bundle", "exported_bundle_12"])
def test_one_executable_per_kind_and_bucket(request, name):
    bundle = request.getfixturevalue(name)
    m = manifest_io.to_json(manifest_io.read(bundle))
    kinds = [w["kind"] for w in m["weights"]["rank-0"]]
    shapes = [(s["batch"], s["tokens"]) for s in m["buckets"]["shapes"]]
    keys = executable_keys(m)
    contexts = m["buckets"]["contexts"]
    assert sorted(keys, key=str) == sorted(
        (
            (k, "decode", b, t, c)
            for k in kinds
            for b, t in shapes
            for c in (contexts if k in CONTEXT_KINDS else [None])
        ),
        key=str,
    )
    artifacts = sorted(e["artifact"] for e in m["regions"])
    assert artifacts == sorted(p.relative_to(bundle).as_posix() for p in (bundle / "regions").iterdir())
    for e in m["regions"]:
        assert e["digest"] == m["files"][e["artifact"]] == manifest_io.sha256_file(bundle / e["artifact"])
    # every layer binds a kind (not an executable of its own); the kind's stacks hold one slice per layer
    bound: dict[str, list[int]] = {}
    for layer in m["layers"]:
        for ref in layer["regions"].values():
            assert ref["kind"] in kinds
            bound.setdefault(ref["kind"], []).append((ref["index"], layer["layer"]))
    for w in m["weights"]["rank-0"]:
        if w["kind"] == "head":
            continue
        assert [layer for _, layer in sorted(bound[w["kind"]])] == w["layers"]
        assert sorted(i for i, _ in bound[w["kind"]]) == list(range(len(w["layers"])))
        assert {t["shape"][0] for t in w["tensors"].values()} == {len(w["layers"])}
    assert len(bound["moe"]) == len(m["layers"])


def test_signatures_do_not_depend_on_layer_count(exported_bundle, exported_bundle_12):
    """A kind's executable has the same inputs (one layer's weights) in a 6- and a 12-layer model."""
    m6, m12 = (
        manifest_io.to_json(manifest_io.read(exported_bundle)),
        manifest_io.to_json(manifest_io.read(exported_bundle_12)),
    )
    assert (len(m6["layers"]), len(m12["layers"])) == (6, 12)
    assert len(m6["buckets"]["shapes"]) == 2 and m12["buckets"]["shapes"] == [{"batch": 1, "tokens": 1}]
    by_key = dict(zip(executable_keys(m12), m12["regions"]))
    common = [(key, e) for key, e in zip(executable_keys(m6), m6["regions"]) if key in by_key]
    assert {key[0] for key, _ in common} == {w["kind"] for w in m6["weights"]["rank-0"]}
    for key, e in common:
        assert by_key[key]["inputs"] == e["inputs"], key


def test_executable_count_does_not_grow_with_layers(exported_bundle, exported_bundle_12):
    """Executables per bucket: kinds, the same for 6 and 12 layers (the 12-layer bundle has bucket (1, 1))."""
    m6, m12 = (
        manifest_io.to_json(manifest_io.read(exported_bundle)),
        manifest_io.to_json(manifest_io.read(exported_bundle_12)),
    )
    per_bucket = [sorted((k for k in executable_keys(m) if k[2:4] == (1, 1)), key=str) for m in (m6, m12)]
    assert per_bucket[0] == per_bucket[1]
    assert len(m6["regions"]) == len(per_bucket[0]) * len(m6["buckets"]["shapes"])


def test_bundle_weights_are_the_reference_weights(exported_bundle, ref_fp32):
    """Stack slice `index` of a kind's weights is bit-identical to that layer's reference region buffer."""
    m = manifest_io.to_json(manifest_io.read(exported_bundle))
    for w in m["weights"]["rank-0"]:
        stack = stacks(exported_bundle, m, w["kind"])
        for index, layer in enumerate(w["layers"]):
            if layer < 0:
                region = ref_fp32.head
            else:
                slot = {ref["kind"]: s for s, ref in m["layers"][layer]["regions"].items()}[w["kind"]]
                region = ref_fp32.layers[layer][slot]
            for name, t in stack.items():
                assert torch.equal(t[index], getattr(region, name)), (w["kind"], layer, name)
