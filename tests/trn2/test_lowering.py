"""The trn2 target up to the NEFF: HLO lowering, its XLA:CPU check, --hlo-only, --finish.

The HLO modules and their numerics are real (torch-mlir and jaxlib's XLA:CPU).
neuronx-cc is the stand-in of doubles/neuronx-cc (a TEST DOUBLE): the finish
tests check the orchestration (command lines, logs, manifest, atomicity), and
prove nothing about real NEFFs or Trn2.
"""

from __future__ import annotations

import json
import re
import shutil
import types
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("torch_mlir", reason="the trn2 lowering needs the [trn2] extra (torch-mlir)")
pytest.importorskip("jax", reason="the trn2 lowering needs the [trn2] extra (jax, jaxlib)")

from jax._src.lib import xla_client

from deepinfer.bundles import manifest as mf
from deepinfer.bundles import manifest_io
from deepinfer.bundles.topology import Topology
from deepinfer.compiler.finish import finish_bundle
from deepinfer.compiler.plan import plan_regions
from deepinfer.compiler.targets import hlo, neuronxcc
from deepinfer.compiler.targets.trn2 import MAX_SELECTION_WIDTH, CheckFailed, Trn2Target
from deepinfer.compiler.trace import trace
from deepinfer.regions.config import load_config
from deepinfer.regions.examples import example_inputs
from deepinfer.regions.state import Geometry
from deepinfer.runtime import load

# trn2 fuses each layer's regions into one executable (compiler/layers.py): the tiny model's six
# layers run six layer kinds (its one engram layer is a window layer), the embedding and the head
KINDS = {
    "embed",
    "layer_window",
    "layer_window_engram",
    "layer_source_r2",
    "layer_reuse_r2",
    "layer_source_r1_cand",
    "layer_reindex_r1_cand",
    "head",
}


def manifest(bundle: Path) -> dict:
    return json.loads((bundle / "manifest.json").read_text())


@pytest.fixture
def stand_in(stub, tmp_path) -> Path:
    """The stand-in neuronx-cc (a test double, tests/trn2/conftest.py); returns its argv record."""
    return tmp_path / "record.jsonl"


def copy_bundle(bundle: Path, tmp_path: Path) -> Path:
    out = tmp_path / "bundle"
    shutil.copytree(bundle, out)
    return out


# --- lowering and the XLA:CPU check -----------------------------------------------------------


def test_every_region_kind_is_lowered_and_checked(trn2_hlo_bundle):
    m = manifest(trn2_hlo_bundle)
    assert m["stage"] == "hlo" and m["target"]["name"] == "trn2"
    assert {e["kind"] for e in m["regions"]} == KINDS
    for e in m["regions"]:
        assert e["artifact"].endswith(".hlo.pb")
        assert 0 <= e["check"]["score"] <= 1e-5, e["kind"]  # fp32 graphs: rounding only
    # checked on random weights of the real shapes (all-zero weights made every output zero); the
    # embedding's gather is exact (test_embedding_is_a_gather_of_rows)
    assert all(e["check"]["max_abs"] > 0 for e in m["regions"] if e["kind"] != "embed")
    manifest_io.check_files(trn2_hlo_bundle, manifest_io.read(trn2_hlo_bundle))


def test_weights_and_rank_are_hlo_parameters(trn2_hlo_bundle):
    """One HLO module per kind serves every layer and rank: nothing is baked in."""
    for e in manifest(trn2_hlo_bundle)["regions"]:
        shape = xla_client.XlaComputation((trn2_hlo_bundle / e["artifact"]).read_bytes()).program_shape()
        params = shape.parameter_shapes()
        assert len(params) == len(e["inputs"]), e["kind"]
        for p, spec in zip(params, e["inputs"]):
            assert list(p.dimensions()) == spec["shape"], (e["kind"], spec["name"])
        rank = [i for i, s in enumerate(e["inputs"]) if s["role"] == "rank"]
        assert rank == [0] and params[0].dimensions() == ()
        fp8 = [s for s in e["inputs"] if s["role"] == "weight" and s["dtype"] == "uint8"]
        assert fp8 or e["kind"] in ("embed", "head"), "fp8 weights travel as uint8"


def test_state_outputs_must_alias_their_pool_inputs(trn2_hlo_bundle):
    """Must-alias, as AWS's own producers declare pools: a may-alias lets the compiler write the new
    pool elsewhere, which the runtime (one buffer bound as input and output) would never see."""
    for e in manifest(trn2_hlo_bundle)["regions"]:
        proto = (trn2_hlo_bundle / e["artifact"]).read_bytes()
        text = xla_client.XlaComputation(proto).as_hlo_text().splitlines()[0]
        for out, inp in e["aliases"].items():
            spec = e["inputs"][inp]
            assert spec["role"] == "state" and e["output_specs"][int(out)]["name"] == spec["name"]
            assert e["output_specs"][int(out)]["shape"] == spec["shape"]
            assert f"{{{out}}}: ({inp}, {{}}, must-alias)" in text, text
        assert "may-alias" not in text
        layer = e["kind"].startswith("layer_")  # its attention writes the window ring (and more)
        assert bool(e["aliases"]) == layer and e["mutates"] == []


def _entry(text: str) -> list[str]:
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("ENTRY "))
    return lines[start + 1 :]


def test_neff_tensor_names_are_stamped(trn2_hlo_bundle):
    """Every parameter carries its manifest input name and the root tuple the output names, so the
    runtime binds by name (the regions have 11 to 40 inputs: libnrt's lexical order would put
    input10 before input2)."""
    for e in manifest(trn2_hlo_bundle)["regions"]:
        entry = _entry(xla_client.XlaComputation((trn2_hlo_bundle / e["artifact"]).read_bytes()).as_hlo_text())
        names = {}
        for line in entry:
            m = re.search(r"parameter\((\d+)\).*neff_input_names=\"([^\"]*)\"", line)
            if m:
                names[int(m.group(1))] = m.group(2)
        assert names == {i: s["name"] for i, s in enumerate(e["inputs"])}, e["kind"]
        (root,) = [ln for ln in entry if ln.lstrip().startswith("ROOT ")]
        outputs = re.search(r'neff_output_names="([^"]*)"', root).group(1).split(",")
        assert outputs == [f"out_{s['name']}" for s in e["output_specs"]], e["kind"]
    assert max(len(e["inputs"]) for e in manifest(trn2_hlo_bundle)["regions"]) > 10


def test_embedding_is_a_gather_of_rows(trn2_hlo_bundle, tiny_ckpt):
    """The embedding region reads the step's rows of its table with one gather of [1, D] slices (no
    one-hot product over the vocabulary, no dot at all) and, run on XLA:CPU with ids that include
    the vocabulary's last row and image positions among text ones, equals the host lookup
    (regions.step.Embedding, on the checkpoint's table) exactly."""
    from safetensors.torch import load_file

    from deepinfer.regions.step import Embedding

    c = load_config(tiny_ckpt).text
    V, D, n = c.vocab_size, c.hidden_size, c.hc_mult
    for e in manifest(trn2_hlo_bundle)["regions"]:
        if e["kind"] != "embed":
            continue
        proto = (trn2_hlo_bundle / e["artifact"]).read_bytes()
        entry = _entry(xla_client.XlaComputation(proto).as_hlo_text())
        gathers = [ln for ln in entry if " gather(" in ln]
        assert len(gathers) == 1 and f"slice_sizes={{1,{D}}}" in gathers[0], gathers
        assert not any(re.search(r" (dot|convolution)\(", ln) for ln in entry), "a matmul in the embedding"
        B, T = e["bucket"]["batch"], e["bucket"]["tokens"]
        table = load_file(tiny_ckpt / "model.safetensors")["embed.weight"]
        tokens = torch.tensor([V - 1, 0, 7, 100, V - 2, 3, 9, 250] * 2)[: B * T].view(B, T)
        is_image = (torch.arange(B * T) % 3 == 1).view(B, T)
        image_rows = torch.randn(B, T, D)
        h, pre = hlo.CpuHlo(proto)([torch.tensor(0), table, tokens, is_image, image_rows])
        want_h, want_pre = Embedding(table, n, torch.float32)(tokens, is_image, image_rows)
        assert h.shape == (B, T, n, D) and torch.equal(h, want_h) and torch.equal(pre, want_pre)
        assert torch.equal(h[is_image][:, 0], image_rows[is_image]) and h.abs().sum() > 0


def test_manifest_binds_one_embedding(trn2_hlo_bundle):
    """A trn2 bundle binds the embedding region (its table a one-row stack, no host file); a manifest
    with both or neither is refused, naming the key."""
    import copy

    data = manifest(trn2_hlo_bundle)
    assert data["embed"] == {"kind": "embed", "index": 0} and "embed" not in data["host"]
    [w] = [w for w in data["weights"]["rank-0"] if w["kind"] == "embed"]
    assert w["layers"] == [-1] and w["tensors"]["embed"]["shape"] == [1, 288, 256]
    assert not (trn2_hlo_bundle / "host" / "embed.safetensors").exists()
    both, neither = copy.deepcopy(data), copy.deepcopy(data)
    both["host"]["embed"] = {"path": "host/embed.safetensors", "tensor": "embed"}
    neither["embed"] = None
    for bad, message in ((both, "holds the token embedding .*not both"), (neither, "lacks the token embedding")):
        with pytest.raises(mf.BundleError, match=rf"m.json: host: {message}"):
            manifest_io.parse(bad, "m.json")


class _PassThrough(torch.nn.Module):
    def forward(self, x, y):
        return x + 1, y, x


def test_outputs_that_are_parameters_are_copied():
    """neuronx-cc cannot return a raw parameter: such an output goes through an explicit copy."""
    a, b = torch.arange(4.0), torch.arange(3)
    ep = torch.export.export(_PassThrough(), (a, b)).run_decompositions(hlo.hlo_decompositions())
    text = hlo.finish_module(hlo.to_stablehlo(ep), {}, ["x", "y"], ["out_a", "out_y", "out_x"])
    proto = hlo.to_hlo_proto(text)
    entry = _entry(xla_client.XlaComputation(proto).as_hlo_text())
    params = {re.match(r"\s*(\S+) = ", ln).group(1) for ln in entry if " parameter(" in ln}
    (root,) = [ln for ln in entry if ln.lstrip().startswith("ROOT ")]
    operands = re.search(r" tuple\(([^)]*)\)", root).group(1).split(", ")
    assert len(operands) == 3 and not params & set(operands), root
    copies = {re.match(r"\s*(\S+) = ", ln).group(1) for ln in entry if " copy(" in ln}
    assert set(operands[1:]) <= copies
    got = hlo.CpuHlo(proto)([a, b])
    assert torch.equal(got[0], a + 1) and torch.equal(got[1], b) and torch.equal(got[2], a)


def _lower_window(tmp_path, target: Trn2Target, checkpoint: Path) -> dict:
    """Lower and check the window attention region for a (1, 1) step."""
    cfg = load_config(checkpoint)
    region = plan_regions(cfg.text, torch.float32, True).kinds["attn_window"].region
    g = Geometry(slots=2, blocks=4, block_size=16, max_blocks=2)
    ep, sig = trace(region, 1, 1, g, dynamic=False)
    inputs = example_inputs(sig.inputs, g)
    ep = target.lower(ep)
    names = [s.name for s in sig.all]
    info = target.emit(ep, names, region.output_names(), tmp_path / "w.hlo.pb")
    return target.check_numerics(
        tmp_path / "w.hlo.pb", region, "decode", inputs, names, info["state_outputs"], "region attn_window.decode.b1t1"
    )


def test_check_catches_a_wrong_lowering(tmp_path, tiny_ckpt, monkeypatch):
    """torch-mlir lowers `remainder` with C's sign rule; without deepinfer's decomposition the
    window ring is written at the wrong rows, and the XLA:CPU check must say so."""
    target = Trn2Target("neff", {})
    assert _lower_window(tmp_path, target, tiny_ckpt)["max_abs"] <= 1e-6
    table = hlo.hlo_decompositions()
    for op in (torch.ops.aten.remainder.Scalar, torch.ops.aten.remainder.Tensor):
        table.pop(op)
    monkeypatch.setattr(hlo, "hlo_decompositions", lambda: table)
    with pytest.raises(CheckFailed, match=r"region attn_window.decode.b1t1: output win differs"):
        _lower_window(tmp_path, target, tiny_ckpt)


@pytest.mark.parametrize("layout", [(1, 1, 2), (1, 4, 4)], ids=["cp=2", "cp=ep=4"])
def test_split_head_is_lowered_and_checked(tmp_path, tiny_ckpt, layout):
    """The head at a split shape (its rank's vocabulary rows: 160 or 96 of the tiny model's 288) is
    lowered, checked on XLA:CPU by the target's own check, and run on each rank's cut of the
    checkpoint's head it gives the one-rank logits, side by side, the padding rows' zeros dropped."""
    from deepinfer.bundles.topology import Topology
    from deepinfer.compiler.shard import shard
    from deepinfer.regions.checkpoint import Checkpoint, load_region
    from deepinfer.regions.plan import make_head

    tp, ep, cp = layout
    topo = Topology(tp=tp, ep=ep, cp=cp)
    c = load_config(tiny_ckpt).text
    region = plan_regions(c, torch.float32, True, topo).kinds["head"].region
    rows = region.rows
    assert rows % 32 == 0 and rows < c.vocab_size <= rows * topo.group_size
    g = Geometry(slots=2, blocks=4, block_size=16, max_blocks=2)
    program, sig = trace(region, 2, 1, g, dynamic=False)
    inputs = example_inputs(sig.inputs, g)
    target = Trn2Target("neff", {})
    program = target.lower(program)
    names = [s.name for s in sig.all]
    info = target.emit(program, names, region.output_names(), tmp_path / "head.hlo.pb")
    check = target.check_numerics(
        tmp_path / "head.hlo.pb", region, "decode", inputs, names, info["state_outputs"], "region head.decode.b2t1"
    )
    assert check["score"] <= 1e-5 and check["max_abs"] > 0
    full = make_head(c, torch.float32)
    load_region(Checkpoint(tiny_ckpt), full, "")
    module = hlo.CpuHlo((tmp_path / "head.hlo.pb").read_bytes())
    slices = []
    for r in range(topo.group_size):
        weights = [torch.tensor(r)] + [
            shard("head", s.name, getattr(full, s.name), c, topo, r, s.buffer_shape) for s in region.specs
        ]
        (logits,) = module(weights + [a.clone() for a in inputs])
        assert logits.shape == (2, 1, rows)
        slices.append(logits)
    whole = torch.cat(slices, -1)  # [B, T, group * rows]
    torch.testing.assert_close(whole[..., : c.vocab_size], full.decode(*inputs), rtol=1e-5, atol=1e-5)
    assert not whole[..., c.vocab_size :].any()


@pytest.mark.parametrize("a, b", [(torch.arange(-9, 9), 4), (torch.arange(-9, 9), torch.tensor(-4))])
def test_decompositions_match_torch(a, b):
    class M(torch.nn.Module):
        def forward(self, x):
            return (
                x.remainder(b),
                x >> 1,
                x << 2,
                (x.to(torch.uint8) > 200),
                torch.sort(x.float().abs(), stable=True, descending=True).indices,
            )

    ep = torch.export.export(M(), (a,)).run_decompositions(hlo.hlo_decompositions())
    got = hlo.CpuHlo(
        hlo.to_hlo_proto(hlo.finish_module(hlo.to_stablehlo(ep), {}, ["x"], [f"out{i}" for i in range(5)]))
    )([a])
    for g, r in zip(got, M()(a)):
        assert torch.equal(g, r)


def test_lowering_options_are_keyed_or_log_only():
    t = Trn2Target(
        "neff", {"lnc": 1, "optlevel": 3, "verbose": "info", "timeout_s": 10, "check": False, "frontend": "torch-mlir"}
    )
    assert t.keyed_options() == {"lnc": 1, "optlevel": 3, "frontend": "torch-mlir"}
    assert Trn2Target.check_options({"frontend": "tvm"}).startswith("option frontend = 'tvm'")
    assert "unknown neuronx-cc option 'lcn'" in Trn2Target.check_options({"lcn": 2})


# --- without neuronx-cc, and --finish with the stand-in ----------------------------------------


def test_hlo_only_reports_the_modules_it_lowered(trn2_hlo_compile):
    """`deepinfer-compile --hlo-only` counts the HLO modules it lowered and checked (every one: an
    HLO-stage compile fetches no trace from the cache), not the cache's compile jobs, which it never
    runs (with a cache it once said "0 of 8 lowered")."""
    bundle, output = trn2_hlo_compile
    names = sorted(e["artifact"].removeprefix("regions/").removesuffix(".hlo.pb") for e in manifest(bundle)["regions"])
    assert len(names) == len(KINDS)
    summary = re.findall(r"\((\d+) of (\d+) HLO modules lowered and checked, (\d+) from the cache\)", output)
    assert summary == [(str(len(KINDS)), str(len(KINDS)), "0")], output[-2000:]
    report = json.loads(output.strip().splitlines()[-1])
    assert sorted(report["lowered"]) == names and report["compiled"] == [] and report["executables"] == len(KINDS)


def test_hlo_stage_bundle_is_refused_at_load(trn2_hlo_bundle):
    with pytest.raises(mf.BundleError, match="HLO-stage bundle.*deepinfer-compile --finish"):
        load(trn2_hlo_bundle)


def test_finish_with_the_stand_in(trn2_hlo_bundle, tmp_path, stand_in):
    bundle = copy_bundle(trn2_hlo_bundle, tmp_path)
    finish_bundle(bundle, jobs=2, log=lambda msg: None)
    m = manifest(bundle)
    manifest_io.check_files(bundle, manifest_io.read(bundle))
    assert m["stage"] == "executable" and m["toolchain"]["neuronx-cc"] == "2.99.0.0+0000000d"
    argvs = [json.loads(line)["argv"] for line in stand_in.read_text().splitlines()]
    compiles = [a for a in argvs if a[:1] == ["compile"]]
    assert len(compiles) == len(m["regions"]) == len(KINDS)
    for argv in compiles:
        joined = " ".join(argv)
        assert "--framework XLA --target trn2 --lnc 1 --model-type transformer -O1" in joined
        assert argv[1].endswith(".hlo.pb")
    for e in m["regions"]:
        assert e["artifact"].endswith(".neff") and e["neff"]["lnc"] == 1
        name = Path(e["artifact"]).name.removesuffix(".neff")
        assert (bundle / "logs" / f"{name}.log").read_text().count("neuronx-cc") >= 1
    assert not list(bundle.rglob("*.hlo.pb"))
    with pytest.raises(mf.BundleError, match="not an HLO-stage bundle"):
        finish_bundle(bundle, log=lambda msg: None)


def test_failed_finish_names_region_and_keeps_bundle(trn2_hlo_bundle, tmp_path, stand_in, monkeypatch):
    bundle = copy_bundle(trn2_hlo_bundle, tmp_path)
    before = manifest(bundle)
    monkeypatch.setenv("FAKE_NEURONX_CC_FAIL", "NCC_IBCG902")
    with pytest.raises(neuronxcc.NeuronCompileError) as err:
        finish_bundle(bundle, log=lambda msg: None)
    message = str(err.value)
    assert "\n" not in message and "NCC_IBCG902" in message and "region " in message
    log = Path(message.rsplit("log: ", 1)[1].rstrip(")"))
    assert log.is_file() and log.parent.name == "bundle.failed-logs"
    assert manifest(bundle) == before
    manifest_io.check_files(bundle, manifest_io.read(bundle))


@pytest.mark.slow
def test_missing_compiler_after_lowering(tmp_path, tiny_ckpt, monkeypatch):
    """Without neuronx-cc: every region is lowered and checked, then one clear error, no bundle left."""
    from deepinfer.compiler.config import load_compile_config
    from deepinfer.compiler.pipeline import compile_bundle

    monkeypatch.setenv(neuronxcc.ENV_COMPILER, str(tmp_path / "no-neuronx-cc"))
    toml = tmp_path / "model.toml"
    toml.write_text(
        f'[model]\ncheckpoint = "{tiny_ckpt}"\n[target]\nname = "trn2"\noptions = {{ check = false }}\n'
        "[buckets]\nmax_context = 32\n[kv]\nnum_blocks = 4\n"
    )
    lines = []
    with pytest.raises(neuronxcc.NeuronCompilerMissing, match="every region was lowered to HLO.*--hlo-only"):
        compile_bundle(load_compile_config(toml), tmp_path / "out", log=lines.append, cache=None)  # lowered here
    assert sum(line.startswith("lowered ") for line in lines) == len(KINDS)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.toml"]


# --- selection wider than neuronx-cc's top-k --------------------------------------------------


class _Select(torch.nn.Module):
    def __init__(self, k: int):
        super().__init__()
        self.k = k

    def forward(self, scores):
        return torch.ops.deepinfer.top_indices(scores, self.k)


def _tied_scores(width: int) -> torch.Tensor:
    """Rows of few distinct values (ties everywhere), one mostly -inf (entries not yet visible)."""
    g = torch.Generator().manual_seed(0)
    s = torch.randint(0, 3, (2, 1, width), generator=g).float()
    s[1, 0, width // 3 :] = float("-inf")
    return s


def _stable_top(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The lowest-index tie rule, from numpy's stable argsort (not the code under test)."""
    order = np.argsort(-scores.numpy(), axis=-1, kind="stable")
    return torch.from_numpy(np.ascontiguousarray(order[..., :k]))


@pytest.mark.parametrize("k", [512, 2048])  # the release's index_topk and candidate_topk_blocks
def test_blockwise_selection_through_the_lowering(tmp_path, k):
    """A row of 40,000 entries (wider than neuronx-cc's 16,384): the trn2 lowering sorts at most
    16,384 at a time and still selects the reference's indices, ties to the lowest index."""
    scores = _tied_scores(40000)
    target = Trn2Target("neff", {})
    ep = target.lower(torch.export.export(_Select(k), (scores,)))
    target.emit(ep, ["scores"], ["idx"], tmp_path / "s.hlo.pb")
    proto = (tmp_path / "s.hlo.pb").read_bytes()
    widths = hlo.selection_widths(proto)
    assert widths and max(w for _, w in widths) <= MAX_SELECTION_WIDTH
    (got,) = hlo.CpuHlo(proto)([scores])
    assert torch.equal(got, _stable_top(scores, k))


def test_wide_sort_is_refused_naming_region_and_op(tmp_path):
    """The same selection lowered without the blockwise form holds a sort over the whole row:
    the target refuses the module (one line naming the region and the op)."""
    from deepinfer.bundles import manifest as mf_types
    from deepinfer.compiler.executables import Graph, emit
    from deepinfer.compiler.plan import Exe
    from deepinfer.kernels import reference_decompositions

    scores = _tied_scores(40000)
    target = Trn2Target("neff", {})
    ep = torch.export.export(_Select(512), (scores,)).run_decompositions(
        {**reference_decompositions(), **hlo.hlo_decompositions()}
    )
    entry = mf_types.Executable(
        kind="select",
        method="decode",
        bucket=mf_types.Shape(batch=2, tokens=1, context=None),
        artifact="x",
        executable="neff",
        inputs=(),
        outputs=("idx",),
    )
    graph = Graph(
        exe=Exe("select", "decode", 2, 1, None),
        region=None,
        program=ep,
        names=["scores"],
        inputs=[],
        geometry=Geometry(slots=2, blocks=2, block_size=16, max_blocks=1),
        kernels=[],
        entry=entry,
    )
    with pytest.raises(hlo.LoweringError) as err:
        emit(types.SimpleNamespace(target=target, topology=Topology()), graph, tmp_path / "s.hlo.pb")
    message = str(err.value)
    assert "\n" not in message and message.startswith("region select.decode.b2t1: ")
    assert "holds a sort over 40000 entries" in message and not (tmp_path / "s.hlo.pb").exists()


@pytest.mark.slow
def test_indexer_region_at_a_long_context(tmp_path, tiny_ckpt):
    """The candidate-source attention (a ratio-1 indexer and the candidate pool) at a context whose
    row of compressed entries is 32,768 wide, decoding its last position (every entry visible, the
    pools random): lowered with no sort wider than neuronx-cc compiles, and equal to the reference
    region on XLA:CPU (its top-k indices and candidate pool exactly)."""
    cfg = load_config(tiny_ckpt)
    region = plan_regions(cfg.text, torch.float32, True).kinds["attn_source_r1_cand"].region
    g = Geometry(slots=2, blocks=2049, block_size=16, max_blocks=2048)
    assert g.compressed_width(1) == 32768 > MAX_SELECTION_WIDTH
    ep, sig = trace(region, 1, 1, g, dynamic=False)
    inputs = example_inputs(sig.inputs, g, start=32767)
    target = Trn2Target("neff", {})
    ep = target.lower(ep)
    names = [s.name for s in sig.all]
    info = target.emit(ep, names, region.output_names(), tmp_path / "r.hlo.pb")
    assert max(w for _, w in hlo.selection_widths((tmp_path / "r.hlo.pb").read_bytes())) <= MAX_SELECTION_WIDTH
    check = target.check_numerics(
        tmp_path / "r.hlo.pb", region, "decode", inputs, names, info["state_outputs"], "region attn_source_r1_cand"
    )
    assert check["score"] <= 1e-5
