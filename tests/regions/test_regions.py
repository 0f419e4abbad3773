"""Each region kind: traceable by torch.export as a pure function of its inputs, weights and rank."""

from __future__ import annotations

import pytest
import torch

from deepinfer.regions.examples import example_inputs
from deepinfer.regions.state import Geometry

GEO = Geometry(slots=4, blocks=9, block_size=4, max_blocks=4)
B, T = 2, 3
# (layer, region) of the tiny model covering every kind
KINDS = [(0, "attn"), (1, "engram"), (2, "attn"), (3, "attn"), (4, "attn"), (5, "attn"), (0, "moe")]


class Method(torch.nn.Module):
    def __init__(self, region):
        super().__init__()
        self.region = region

    def forward(self, *args):
        return self.region.decode(*args)


def region_of(model, layer, name):
    return model.head if name == "head" else model.layers[layer][name]


def inputs_for(region, seed=0):
    return example_inputs(region.input_specs(B, T, GEO), GEO, start=5, seed=seed)


def clone(args):
    return [a.clone() for a in args]


@pytest.fixture(scope="module")
def exported(ref_fp32):
    out = {}
    for layer, name in KINDS + [(None, "head")]:
        region = region_of(ref_fp32, layer, name)
        args = inputs_for(region)
        out[(layer, name)] = (region, args, torch.export.export(Method(region), tuple(clone(args)), strict=False))
    return out


@pytest.mark.parametrize("key", KINDS + [(None, "head")])
def test_export_lifts_weights_and_rank_and_matches_eager(exported, key):
    region, args, ep = exported[key]
    sig = ep.graph_signature
    buffers = set(sig.inputs_to_buffers.values())
    assert "region.rank" in buffers
    assert {f"region.{s.name}" for s in region.specs} <= buffers  # weights are graph inputs
    assert not ep.constants or all(v.numel() <= 256 for v in ep.constants.values())
    eager_args, traced_args = clone(args), clone(args)
    want = region.decode(*eager_args)
    got = ep.module()(*traced_args)
    want = want if isinstance(want, tuple) else (want,)
    got = got if isinstance(got, tuple) else (got,)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    for e, t in zip(eager_args, traced_args):  # the same state writes
        torch.testing.assert_close(t, e, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("key", KINDS)
def test_kernels_stay_single_nodes(exported, key):
    _, _, ep = exported[key]
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert any(t.startswith("deepinfer.") for t in targets)
    assert "deepinfer.hc_mixes.default" in targets or key[1] == "engram"


def test_state_views_are_mutated_in_place(exported):
    """After functionalization the signature lists exactly the source's state views as mutated inputs."""
    region, _, ep = exported[(2, "attn")]
    functional = ep.run_decompositions({})
    user = [s.arg.name for s in functional.graph_signature.input_specs if s.kind.name == "USER_INPUT"]
    names = dict(zip(user, [s.name for s in region.input_specs(B, T, GEO)]))
    mutated = {names[m] for m in functional.graph_signature.user_inputs_to_mutate.values()}
    assert mutated == {"win", "ckv", "ikeys", "part_kv", "part_gate"}


def test_same_kind_gives_the_same_graph_for_two_layers(ref_fp32):
    """No layer index or per-layer Python state reaches the graph: layers 0 and 1 trace identically."""
    graphs = []
    for layer in (0, 1):
        region = ref_fp32.layers[layer]["attn"]
        ep = torch.export.export(Method(region), tuple(inputs_for(region)), strict=False)
        graphs.append(ep.graph_module.code)
    assert graphs[0] == graphs[1]


def test_rank_buffer_is_an_input_not_a_constant(ref_fp32):
    region = ref_fp32.layers[0]["moe"]
    ep = torch.export.export(Method(region), tuple(inputs_for(region)), strict=False)
    names = [s.arg.name for s in ep.graph_signature.input_specs if s.target == "region.rank"]
    assert names and all(n in {p.name for p in ep.graph.nodes if p.op == "placeholder"} for n in names)


def test_moe_routing_matches_formula(ref_fp32):
    """sqrt(softplus) scores, top-k of score + bias, weights normalised and scaled (MODEL.md)."""
    from deepinfer.regions.moe import route

    c = ref_fp32.config.text
    torch.manual_seed(0)
    x = torch.randn(5, c.hidden_size)
    gate = torch.randn(c.n_routed_experts, c.hidden_size) / 16
    bias = torch.randn(5, c.n_routed_experts) * 0.1
    w, e = route(x, gate, bias, 2, True, 1.5)
    for i in range(5):
        s = [float(torch.nn.functional.softplus(x[i] @ gate[j]).sqrt()) for j in range(c.n_routed_experts)]
        order = sorted(range(len(s)), key=lambda j: -(s[j] + float(bias[i, j])))[:2]
        assert sorted(e[i].tolist()) == sorted(order)
        total = sum(s[j] for j in order)
        for k, j in enumerate(e[i].tolist()):
            assert abs(float(w[i, k]) - s[j] / total * 1.5) < 1e-5


def test_engram_gate_matches_formula(ref_fp32):
    """The rows the host gathers for some hashes, through the region, against the formula on the
    checkpoint's own table rows (read with the safetensors library)."""
    from safetensors.torch import load_file

    region = ref_fp32.layers[1]["engram"]
    h, _, _, mask = inputs_for(region)
    c = ref_fp32.config.text
    [(codes_name, scales_name, table_rows)] = c.engram_tables()
    hashes = torch.randint(0, table_rows, (B, T, c.engram_hash_heads), generator=torch.Generator().manual_seed(1))
    out = region.decode(h, *ref_fp32.engram.rows(0, hashes), mask)
    b, t = 1, 2
    rows = hashes[b, t].numpy()
    ckpt = {}
    for f in ref_fp32.path.glob("*.safetensors"):
        ckpt.update(load_file(f))
    from deepinfer.quant.fp8 import e4m3fn_decode
    from deepinfer.quant.ue8m0 import ue8m0_decode

    codes = ckpt[codes_name].view(torch.uint8).numpy()[rows]
    scales = ue8m0_decode(ckpt[scales_name].view(torch.uint8).numpy()[rows]).repeat(32, axis=-1)
    emb = torch.from_numpy((e4m3fn_decode(codes) * scales).reshape(-1))
    from deepinfer.quant.blockfp8 import dequantize_fp8_blocks

    wkv = torch.from_numpy(dequantize_fp8_blocks(region.wkv.numpy(), region.wkv_s.numpy()))
    kv = wkv @ emb
    n, D = c.hc_mult, c.hidden_size
    value = kv[n * D :]
    for i in range(n):
        key = kv[i * D : (i + 1) * D]
        hi = h[b, t, i]
        rms = lambda v: v / v.pow(2).mean().sqrt()  # noqa: E731
        dot = (rms(hi) * region.q_weight[i].float() * rms(key) * region.k_weight[i].float()).sum() / D**0.5
        gate = torch.sigmoid(torch.sign(dot) * dot.abs().clamp_min(1e-6).sqrt())
        torch.testing.assert_close(out[b, t, i], hi + gate * value, rtol=1e-4, atol=1e-4)


def test_example_inputs_size_the_step_from_a_stage_without_streams():
    """The divided attention's later stages take x, not the streams h: the step's B rows (slots,
    positions, block table) come from x, or from the positions where neither is an input."""
    from deepinfer.regions.state import InputSpec

    g = Geometry(slots=9, blocks=5, block_size=16, max_blocks=2)
    for lead in (InputSpec("x", (8, 1, 4), torch.bfloat16, "activation"), None):
        specs = [InputSpec("positions", (8, 1), torch.int64, "step"), InputSpec("slots", (8,), torch.int64, "step")]
        specs += [InputSpec("block_table", (8, 2), torch.int64, "step")] + ([lead] if lead else [])
        positions, slots, table, *_ = example_inputs(specs, g)
        assert positions.flatten().tolist() == list(range(8)) and slots.tolist() == list(range(1, 9))
        assert table.shape == (8, 2) and len(set(table.flatten().tolist())) > 1
