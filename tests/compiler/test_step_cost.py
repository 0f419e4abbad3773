"""The decode step's cost model (compiler/step_cost.py) on the release's plan: nothing compiled.

References independent of the code under test: MODEL.md's released dimensions (typed in here) for
the FLOPs of a layer and the host inputs, and the libnrt double's count of a tiny trn2 step's
host<->device bytes (tests/trn2/test_session_contract.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from deepinfer.bundles.topology import Topology
from deepinfer.compiler import step_cost
from deepinfer.compiler.bundle_plan import plan_bundle
from deepinfer.compiler.config import load_compile_config
from deepinfer.errors import ConfigError

from ..conftest import write_model_toml

RELEASE = Path(__file__).resolve().parents[2] / "examples" / "release" / "model.toml"
CONTEXT = 65536  # the release example's max_context
# MODEL.md, the released Flash text_config
D, H, HD, Q, G, R = 5120, 64, 512, 1280, 8, 1024  # hidden, heads, head_dim, q_lora, o_groups, o_lora
E, TOPK_EXPERTS, I, N = 384, 6, 2304, 4  # experts, per token, moe_intermediate, hc_mult
HI, DI, K, WINDOW = 32, 128, 512, 128  # index heads, index head_dim, index_topk, sliding_window
ENGRAM_HEADS, ENGRAM_HD = (4 - 1) * 8, 256  # (max_ngram - 1) x engram_n_heads, engram_head_dim
V, EP, CP = 129280, 64, 64


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    """The release's plan in the per-region form with host collectives (`layers = "regions"`: 132
    executions, 128 collectives on the host); the example itself fuses layers (`fused_plan`)."""
    return plan_bundle(
        load_compile_config(_release_toml(tmp_path_factory, 'options = { lnc = 2, layers = "regions" }')), scratch=False
    )


@pytest.fixture(scope="module")
def fused_plan():
    return plan_bundle(load_compile_config(RELEASE), scratch=False)


def _release_toml(tmp_path_factory, options: str) -> Path:
    """The release example with its [target] options replaced, its checkpoint path absolute."""
    text = RELEASE.read_text().replace("options = { lnc = 2 }", options)
    text = text.replace('checkpoint = "."', f'checkpoint = "{RELEASE.parent.resolve()}"')
    assert options in text and str(RELEASE.parent.resolve()) in text
    toml = tmp_path_factory.mktemp("release") / "model.toml"
    toml.write_text(text)
    return toml


def hand_count(ratio: int, *, source: bool, index: bool, engram: bool) -> int:
    """FLOPs one token costs one rank (EP = CP = 64) in a release layer at the 64K context, by hand:
    2 per multiply-add of each matmul, at the rank's shapes (docs/ranks.md: one query head a rank; a
    window layer its head's columns of its group's wo_a rows and that group's wo_b columns, a compressed
    layer 128 rows of wo_a and those wo_b columns after attending every head over the entries it holds)."""
    macs = Q * D + (H // CP) * HD * Q + HD * D  # wq_a, its head's wq_b rows, wkv
    if ratio:
        heads, rows = H, G * R // CP  # every head attended; 128 output rows
        macs += rows * (H * HD // G) + D * rows  # wo_a rows [128, 4096], wo_b columns [5120, 128]
    else:
        heads = H // CP  # its one head, over the window
        macs += R * (H // CP) * HD + D * R  # its head's columns of its group's wo_a, the group's wo_b
    macs += 2 * (2 + N) * N * (N * D)  # both sites' hyper-connection mixes
    keys = WINDOW
    if ratio:
        entries = CONTEXT // ratio  # the sequence's compressed entries
        keys += K  # the selected entries: every rank's attend gathers K (static), attends its own
        if source:
            macs += (2 if ratio > 1 else 1) * HD * D + DI * HD  # compressor wkv (+ wgate), index key wk
        if index:
            macs += HI * DI // CP * Q + 1 * D  # its rows of the index queries (64) and of weights_proj (1)
            macs += entries // CP * HI * (DI + 1)  # scores over this rank's share of the keys
    macs += keys * heads * HD * 2  # q . k and the weighted sum of the latents
    if engram:
        macs += (N + 1) * D * ENGRAM_HEADS * ENGRAM_HD // CP  # the rank's 96 input columns of wkv
    macs += E * D  # router
    macs += TOPK_EXPERTS * 3 * (I // EP) * D  # the row's 6 chosen experts' 36-column slices, gathered: w1, w3, w2
    shared = 64  # 2304 / 64 ranks = 36 columns, a whole fp8 block of 32 -> 64
    macs += 3 * shared * D
    return 2 * macs


@pytest.mark.parametrize(
    "layer, ratio, source, index, engram",
    [(0, 0, False, False, False), (14, 2, True, True, True), (20, 1, True, True, False), (24, 1, False, True, False)],
    ids=["window", "source-r2-engram", "source-r1-cand", "reindex-r1"],
)
def test_layer_flops_match_a_hand_count(plan, layer, ratio, source, index, engram):
    p = plan.regions.layers[layer]
    parts = step_cost.layer_flops(plan, p, 1, CONTEXT)
    assert sum(parts.values()) == hand_count(ratio, source=source, index=index, engram=engram)
    assert parts["routed experts"] == 2 * 6 * 3 * 36 * 5120  # the row's 6 chosen experts, a rank's 36 columns of each


def test_step_figures_at_batch_1_and_8(plan):
    """Per rank: FLOPs and state grow with the batch (8x), the weight stacks do not but for the rows a
    step gathers (7 more embedding rows, 42 more routed expert slices a layer); the lower bound does not fall."""
    one, eight = step_cost.step_cost(plan, 1, CONTEXT), step_cost.step_cost(plan, 8, CONTEXT)
    assert eight.flops == 8 * one.flops and eight.state_bytes == 8 * one.state_bytes
    s = I // EP  # a rank's 36 columns of every expert; a decode step gathers the chosen ones
    expert_slice = 2 * (s * D // 2 + s * D // 32) + D * s // 2 + D * 2  # w1, w3 rows; w2 columns, 2 scale blocks
    assert eight.weight_bytes - one.weight_bytes == 7 * D * 2 + 40 * (8 - 1) * TOPK_EXPERTS * expert_slice
    assert eight.memory_ms > one.memory_ms and eight.compute_ms == pytest.approx(8 * one.compute_ms)
    assert eight.estimated_ms >= one.estimated_ms
    # memory bound: a rank's 10.4 GB of weights at 0.725 TB/s against 29 GFLOP at 166.75 TFLOP/s (bf16)
    assert one.memory_ms == pytest.approx((one.weight_bytes + one.state_bytes) / 0.725e9)
    assert one.compute_ms == pytest.approx(one.flops / 166.75e9) and one.compute_ms < one.memory_ms
    longer = step_cost.step_cost(plan, 1, 4 * CONTEXT)
    assert longer.state_bytes > one.state_bytes and longer.weight_bytes == one.weight_bytes


def test_host_bytes_follow_per_step(plan):
    """As per_step places the collectives: all on the host (the release today), every execution's
    streams cross; all in the executables, only the step's inputs and the logits slice; the MoE's
    all-reduces in the executables (collectives = "graph"), the rest on the host."""
    step = plan.per_step
    inputs = 8 + 8 + 2 * ENGRAM_HEADS * (ENGRAM_HD + ENGRAM_HD // 32)  # token id, position, 2 engram layers' rows
    logits = 2048 * 4  # the rank's 2,048 rows of the vocabulary, float32
    streams = 2 * N * (D * 2 + 4)  # h bf16 and pre float32, in and out
    today = step_cost.step_cost(plan, 1, CONTEXT)
    assert today.host_device_by_part["inputs"] == inputs and today.host_device_by_part["logits"] == logits
    assert today.host_device_by_part["streams"] == step["executions"] * streams == 170 * streams
    sent = today.collective_bytes
    assert today.host_device_by_part["collectives"] == 2 * (sum(sent.values()) - sent["logits all-gather"])
    assert today.collective_link_bytes == 0 and today.collectives_in_executables == 0

    fused = step_cost.step_cost(plan, 1, CONTEXT, {**step, "executions": 42, "collectives_in_executables": 205})
    assert fused.host_device_by_part == {"inputs": inputs, "logits": logits}
    assert fused.executions == 42 and fused.collectives_in_executables == 205
    assert fused.estimated_ms < today.estimated_ms

    graph = step_cost.step_cost(plan, 1, CONTEXT, {**step, "collectives_in_executables": 40})
    moe = sent["ep all-reduce"]
    assert moe == 40 * N * D * 4  # float32 partial streams after every MoE
    assert graph.host_device_by_part["collectives"] == today.host_device_by_part["collectives"] - 2 * moe
    assert graph.collective_link_bytes == 2 * moe  # a ring all-reduce moves twice its payload


def test_link_bytes_of_a_ring_by_collective():
    """What a ring puts on one rank's links at a group of 4, payloads counted by hand: an all-gather
    brings in the 3 other ranks' parts, a reduce-scatter sends 3 of its 4 quarters (each a partial
    the next rank adds to), an all-reduce is a reduce-scatter then an all-gather of the sums."""
    topo = Topology(ep=4, cp=4)
    payload = 4 * 1024  # the reduce-scatter's: every rank's rows' partials
    assert step_cost.link_bytes("ep combine reduce-scatter", payload, topo) == 3 * 1024
    assert step_cost.link_bytes("ep dispatch all-gather", 1024, topo) == 3 * 1024
    assert (
        step_cost.link_bytes("ep all-reduce", payload, topo) == 2 * payload
    )  # about 2 x 3/4 of it: the model counts 2


def test_the_release_as_planned_runs_a_layer_in_one_execution(fused_plan):
    """The example as it is (trn2 fuses layers, compiler/layers.py): 42 executions a step (issue 29's
    ceiling), every collective but the logits' gather inside them, so only the step's inputs go down
    and the rank's logits slice comes back; the bound within issue 29's 21 ms at batch 1."""
    step = fused_plan.per_step
    assert step["executions"] == 42 and step["collectives_in_executables"] == step["collectives"] - 1
    inputs = 8 + 8 + 2 * ENGRAM_HEADS * (ENGRAM_HD + ENGRAM_HD // 32)
    cost = step_cost.step_cost(fused_plan, 1, CONTEXT)
    assert cost.host_device_by_part == {"inputs": inputs, "logits": 2048 * 4}
    assert cost.estimated_ms <= 21


def test_plan_text_and_json_carry_the_step_cost(plan):
    d = plan.to_dict()["step_cost"]
    assert [(b["batch"], b["context"]) for b in d["buckets"]] == [(1, CONTEXT), (8, CONTEXT)]
    for b in d["buckets"]:
        assert b["flops"] == sum(b["flops_by_part"].values()) > 0 and b["executions"] == 170
        assert b["collectives"] == 206 and b["estimated_ms"] >= max(b["memory_ms"], b["compute_ms"])
        assert b["host_device_bytes"] == sum(b["host_device_by_part"].values())
    assert d["figures"]["bf16_flops_per_s"]["status"] == "published"
    assert d["figures"]["fp8_flops_per_s"]["value"] == 1299e12 / 4
    text = "\n".join(plan.lines())
    assert "decode step per rank, modelled for trn2 at LNC 2" in text
    for label in ("weight bytes read", "state bytes read", "FLOPs", "host<->device bytes", "estimate, a lower bound"):
        assert f"\n  {label}" in text, label
    assert "1 x 65,536" in text and "8 x 65,536" in text
    assert "fp8_flops_per_s        3.2475e+14 FLOP/s a rank" in text


def test_tiny_trn2_host_bytes_are_the_doubles_count(tmp_path, tiny_ckpt):
    """One rank, no collectives: a decode step writes its token id, position and engram rows (148 B)
    and reads back the logits (288 x 4 B), as the libnrt double counted them."""
    toml = write_model_toml(tmp_path, tiny_ckpt, target="trn2", options="{ lnc = 2 }")
    cost = step_cost.step_cost(plan_bundle(load_compile_config(toml), scratch=False), 1, 32)
    assert cost.host_device_by_part == {"inputs": 148, "logits": 288 * 4} and cost.collectives == 0


def test_cpu_plan_has_no_step_cost(tmp_path, tiny_ckpt):
    toml = write_model_toml(tmp_path, tiny_ckpt)
    cpu = plan_bundle(load_compile_config(toml), scratch=False)
    assert cpu.to_dict()["step_cost"] is None
    assert "decode step cost: modelled for trn2 only (target cpu gives no hardware figures)" in cpu.lines()
    with pytest.raises(ConfigError) as e:
        step_cost.step_cost(cpu, 1, 32)
    assert "\n" not in str(e.value) and "target.name: cpu" in str(e.value)
