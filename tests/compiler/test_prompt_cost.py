"""A prompt's cost model (compiler/prompt_cost.py) on the release's plan: nothing compiled.

References independent of the code under test: MODEL.md's released dimensions (typed in here) and
plain loops over the prompt's positions for its useful FLOPs; the decode step's model
(compiler/step_cost.py, tested on its own) for what one chunk runs.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from deepinfer.compiler import prompt_cost, step_cost
from deepinfer.compiler.bundle_plan import plan_bundle
from deepinfer.compiler.config import load_compile_config

from ..conftest import write_model_toml

RELEASE = Path(__file__).resolve().parents[2] / "examples" / "release" / "model.toml"
REPLICATED = RELEASE.parent / "model_replicated.toml"  # every rank every row: the prompt model here
# MODEL.md, the released Flash text_config
D, H, HD, Q, G, R = 5120, 64, 512, 1280, 8, 1024  # hidden, heads, head_dim, q_lora, o_groups, o_lora
E, TOPK_EXPERTS, I, N = 384, 6, 2304, 4  # experts, per token, moe_intermediate, hc_mult
HI, DI, K, WINDOW = 32, 128, 512, 128  # index heads, index head_dim, index_topk, sliding_window
ENGRAM_HEADS, ENGRAM_HD = (4 - 1) * 8, 256  # (max_ngram - 1) x engram_n_heads, engram_head_dim
V, LAYERS, WORLD = 129280, 40, 64
RATIOS = [0, 0] + [2] * 18 + [1] * 20
SOURCES, INDEXED, ENGRAM = {2, 8, 14, 20}, {2, 8, 14, 20, 24, 28, 32, 36}, {1, 14}


@pytest.fixture(scope="module")
def plan():
    return plan_bundle(load_compile_config(REPLICATED), scratch=False)


@pytest.mark.parametrize("ratio", [1, 2, 4])
@pytest.mark.parametrize("L", [1, 2, 3, 7, 64, 1000, 1025])
def test_closed_forms_match_loops(L, ratio):
    assert prompt_cost._visible(L, ratio) == sum((p + 1) // ratio for p in range(L))
    for k in (1, 6, 512):
        assert prompt_cost._selected(L, ratio, k) == sum(min(k, (p + 1) // ratio) for p in range(L))


def by_hand(L: int) -> dict[str, int]:
    """A prompt of L tokens' FLOPs at the released dimensions, position by position (2 a multiply-add)."""
    out = {
        "mixes": LAYERS * L * (2 + N) * N * N * D,  # one site
        "attention projections": LAYERS * L * (Q * D + H * HD * Q + HD * D + G * R * (H * HD // G) + D * G * R),
        "router": LAYERS * L * E * D,
        "routed experts": LAYERS * L * TOPK_EXPERTS * 3 * I * D,
        "shared expert": LAYERS * L * 3 * I * D,
        "engram": len(ENGRAM) * L * (N + 1) * D * ENGRAM_HEADS * ENGRAM_HD,
        "head": V * D,
        "compressor": 0,
        "indexer queries": 0,
        "attention": 0,
        "index scores": 0,
    }
    for layer, r in enumerate(RATIOS):
        if layer in SOURCES:
            out["compressor"] += L * (2 if r > 1 else 1) * HD * D + (L // r) * DI * HD
        if layer in INDEXED:
            out["indexer queries"] += L * (HI * DI * Q + HI * D)
        for p in range(L):
            visible = (p + 1) // r if r else 0
            out["attention"] += (min(p + 1, WINDOW) + min(K, visible)) * H * HD * 2
            if layer in INDEXED:
                out["index scores"] += visible * HI * (DI + 1)
    return {part: 2 * macs for part, macs in out.items()}


@pytest.mark.parametrize("L", [100, 1100])
def test_useful_flops_match_a_count_by_hand(plan, L):
    got = prompt_cost.useful_flops(plan.spec.model.text, L)
    mixes = got.pop("mixes, attention site")
    assert mixes == got.pop("mixes, moe site")
    want = by_hand(L)
    assert {"mixes": mixes, **got} == want


def test_a_chunk_is_the_decode_model_at_its_rows(plan):
    """A chunk of T tokens runs what a decode step of T rows runs: the same FLOPs, weight reads and
    collectives (their bytes at T rows), but the head on its last row only (a decode step of one)."""
    for rows in (128, 2048):
        cost = prompt_cost.chunk_cost(plan, rows, 65536)
        step = step_cost.step_flops(plan, rows, 65536)
        assert cost.flops_by_part == {**step, "head": step_cost.step_flops(plan, 1, 65536)["head"]}
        assert cost.weight_bytes == step_cost.weight_bytes(plan, rows)
        assert cost.collectives == plan.per_step["collectives"] and cost.executions == plan.per_step["executions"]
        assert cost.estimated_ms >= max(cost.memory_ms, cost.compute_ms)


def test_no_rank_does_less_than_its_share(plan):
    """Static shapes compute at least the useful work: every part of a prompt's FLOPs on a rank, times
    the ranks, is at least the model's own (so the TTFT is never under the compute bound)."""
    for L in (8192, 65536):
        p = prompt_cost.prompt_cost(plan, L, 128)
        for part, useful in p.useful_flops_by_part.items():
            assert p.flops_by_part[part] * WORLD >= useful, part
        assert p.ttft_over_compute_bound >= 1
        assert p.chunks == L // 128 and p.collectives == p.chunks * plan.per_step["collectives"]
        assert p.ttft_ms == pytest.approx(p.chunks * prompt_cost.chunk_cost(plan, 128, 65536).estimated_ms)


def test_every_rank_computes_every_row_of_a_chunk_today(plan):
    """Prompt chunks run replicated over the token group: the parts computed with whole weights (the
    mixes, the router) cost one rank what they cost the whole prompt, while the divided ones (the
    rank's heads' query rows) cost it 1/64 of it."""
    p = prompt_cost.prompt_cost(plan, 65536, 128)
    for part in ("mixes, attention site", "mixes, moe site", "router"):
        assert p.flops_by_part[part] == p.useful_flops_by_part[part], part
    c = plan.spec.model.text
    wq_b = 2 * 65536 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * c.q_lora_rank
    assert p.flops_by_part["attention projections"] < p.useful_flops_by_part["attention projections"] - wq_b * 63 // 64


def test_plan_text_and_json_carry_the_prompt_cost(plan):
    """The release run replicated builds prompt buckets of 128 and 512 tokens and models its prompts in
    the larger."""
    d = plan.to_dict()["prompt_cost"]
    assert [(c["rows"], c["context"]) for c in d["chunks"]] == [(128, 65536), (512, 65536)]
    assert [(p["tokens"], p["chunk"], p["chunks"]) for p in d["prompts"]] == [(8192, 512, 16), (65536, 512, 128)]
    for p in d["prompts"]:
        assert p["flops"] == sum(p["flops_by_part"].values()) and p["ttft_ms"] > p["compute_bound_ms"] > 0
    sweep = d["chunk_sweep"]
    assert sweep["tokens"] == 65536 and [r["chunk"] for r in sweep["sizes"]] == list(prompt_cost.SWEEP)
    assert [r["built"] for r in sweep["sizes"]] == [True, False, True, False, False, False, False]
    assert sweep["sizes"][2]["ttft_ms"] == d["prompts"][1]["ttft_ms"]
    # the cost model's choice: 128-token chunks are bound by their weight reads, 512-token ones by compute
    assert sweep["sizes"][0]["bound_chunks"] == {"memory": 512} and sweep["sizes"][2]["bound_chunks"] == {
        "compute": 128
    }
    assert sweep["sizes"][2]["ttft_ms"] < sweep["sizes"][0]["ttft_ms"]
    text = "\n".join(plan.lines())
    assert "prompt at batch 1 per rank, chunks of 512 tokens" in text
    assert "a 65,536-token prompt by chunk size (* built" in text
    for label in ("time to first token (ms)", "compute bound, all ranks (ms)", "TTFT / compute bound", "index scores"):
        assert label in text, label


def test_cpu_plan_has_no_prompt_cost(tmp_path, tiny_ckpt):
    cpu = plan_bundle(load_compile_config(write_model_toml(tmp_path, tiny_ckpt)), scratch=False)
    assert cpu.to_dict()["prompt_cost"] is None and prompt_cost.lines(cpu) == []
