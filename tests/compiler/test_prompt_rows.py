"""compiler/prompt_rows.py: a prompt chunk divided by rows, costed per rank at the release (EP = CP =
64), against the model's own arithmetic (prompt_cost.useful_flops, counted by hand in
test_prompt_cost) and the release's unsharded weights (a plan at one rank)."""

from __future__ import annotations

import dataclasses

import pytest

from deepinfer.compiler import prompt_cost, prompt_rows, step_cost
from deepinfer.compiler.bundle_plan import plan_bundle
from deepinfer.compiler.config import load_compile_config
from deepinfer.compiler.step_reads import read_bytes

from .test_prompt_cost import RELEASE, REPLICATED, WORLD

L, T = 65536, 8192  # a 64K prompt in 8 chunks: a rank's 128 rows a chunk, whole compressed groups


@pytest.fixture(scope="module")
def plan():
    return plan_bundle(load_compile_config(REPLICATED), scratch=False)


@pytest.fixture(scope="module")
def rows_plan():
    """The release as it is (`[prompt] rows = "divided"`): its attention kinds' rows twins built."""
    return plan_bundle(load_compile_config(RELEASE), scratch=False)


@pytest.fixture(scope="module")
def whole():
    """The release planned at one rank: every region with its whole weights."""
    one = load_compile_config(REPLICATED)
    one = dataclasses.replace(one, parallel=dataclasses.replace(one.parallel, tp=1, ep=1, cp=1))
    return plan_bundle(one, scratch=False)


@pytest.fixture(scope="module")
def divided(plan):
    return prompt_cost.prompt_cost(plan, L, T, prompt_rows.divided_chunk_cost)


def test_the_row_parts_are_a_rank_s_share_of_the_prompt(divided):
    """The parts a rank computes on its own rows with whole weights add up over the 64 ranks to the
    model's arithmetic for the prompt, exactly; the attention of every head of its rows over the
    window and K selected entries to within the static K (a row early in the context selects fewer
    than K; the replicated chunk spends 64 times it)."""
    for part in prompt_rows.ROW_PARTS:
        assert divided.flops_by_part[part] * WORLD == divided.useful_flops_by_part[part], part
    useful = divided.useful_flops_by_part["attention"]
    assert useful <= divided.flops_by_part["attention"] * WORLD <= 1.01 * useful


def test_what_still_takes_every_row_costs_what_the_replicated_chunk_does(plan, divided):
    """The MoE's experts (`moe_experts`), the engram and the head run on the gathered rows
    (regions/step.rows_steps), so they cost a rank what they cost it replicated; the index scores (a rank's
    rows against every key) what the replicated chunk spends on every row against its 1/64 of the keys.
    The MoE site's mixes and router run on a rank's own rows (`moe_in`: `ROW_PARTS`)."""
    replicated = prompt_cost.prompt_cost(plan, L, T)
    assert {"mixes, moe site", "router"} <= set(prompt_rows.ROW_PARTS)
    for part in ("mixes, moe site", "router"):
        assert divided.flops_by_part[part] * WORLD == replicated.flops_by_part[part], part
    for part in ("routed experts", "shared expert", "engram", "head", "index scores"):
        assert divided.flops_by_part[part] == replicated.flops_by_part[part], part
    assert divided.ttft_ms < replicated.ttft_ms / 4


def test_a_divided_chunk_reads_the_whole_attention_weights(plan, whole):
    """A rank's attention twins hold the whole weights: the divided chunk reads the plan's bytes but
    for the attention kinds, whose bytes are the one-rank plan's."""
    attn = {k for k, kp in plan.regions.kinds.items() if kp.slot == "attn"}
    theirs = read_bytes(plan, T)
    assert attn and attn == {k for k, kp in whole.regions.kinds.items() if kp.slot == "attn"}
    whole_attn = sum(read_bytes(whole, T)[k] for k in attn)
    assert whole_attn > 8 * sum(theirs[k] for k in attn)  # what the slices were
    expected = sum(n for k, n in theirs.items() if k not in attn) + whole_attn
    assert prompt_rows.divided_weight_bytes(plan, T) == expected


def test_a_rank_sends_its_rows_and_the_moe_s_partials(plan, whole):
    """Per layer a rank sends its rows' packed float32 row (the width the rows twin of the layer's
    whole attention packs), its rows' MoE input x and routing (k float32 weights, k int64 experts) to
    the MoE's dispatch and every row's D-wide float32 partial to the combine; at an engram layer every
    row's float32 partial keys and value to the engram's reduce-scatter (no rows gathered for it); the
    head's rows once."""
    from deepinfer.regions.rows import rows_twin

    c = plan.spec.model.text
    sent = prompt_rows.divided_collectives(plan, T, L)
    own, layers = T // WORLD, c.num_hidden_layers
    assert sent["ep dispatch all-gather"][0] == sent["ep combine reduce-scatter"][0] == layers
    assert sent["ep combine reduce-scatter"][1] == layers * T * c.hidden_size * step_cost.F32
    act, k = plan.spec.dtype.itemsize, c.num_experts_per_tok
    assert sent["ep dispatch all-gather"][1] == layers * own * (c.hidden_size * act + k * (4 + 8))
    packed = 0
    for p in whole.regions.layers:
        region = whole.regions.kinds[whole.regions.bindings[p.layer]["attn"][0]].region
        packed += own * rows_twin(region, WORLD)._packed_width() * step_cost.F32
    streams = own * c.hc_mult * (c.hidden_size * plan.spec.dtype.itemsize + step_cost.F32)
    engram = sum(p.engram_rows > 0 for p in plan.regions.layers)
    assert sent["rows all-gather"] == (layers + 1, packed + streams)
    kv = T * (c.hc_mult + 1) * c.hidden_size * step_cost.F32
    assert engram and sent["engram reduce-scatter"] == (engram, engram * kv) and "engram all-reduce" not in sent


def test_micro_batches_cost_two_half_passes_with_their_links_under_the_compute(plan):
    """A chunk as two micro-batches (regions/micro.py, compiler/rows_layers.py) is two passes of half its
    rows: every count twice a half pass's (the weights read again) but the executions, one a layer and
    the embedding's and head's once a chunk, both passes inside each of trn2's modules. Its estimate is
    no better than the passes' memory or compute and their links, each alone, and no worse than the two
    passes in series, links not overlapped."""
    ctx = prompt_cost.context_bucket(plan, L)
    whole = prompt_rows.micro_chunk_cost(plan, T, ctx)
    half = prompt_rows.divided_chunk_cost(plan, T // prompt_rows.MICRO_BATCHES, ctx)
    assert prompt_rows.MICRO_BATCHES == 2 and whole.rows == T
    for field in ("weight_bytes", "state_bytes", "flops", "collectives", "collective_bytes"):
        assert getattr(whole, field) == 2 * getattr(half, field), field
    assert plan.spec.fused and whole.executions == half.executions == 2 + len(plan.regions.layers)
    busy = 2 * max(half.memory_ms, half.compute_ms)
    assert whole.estimated_ms >= busy and whole.estimated_ms == busy + whole.latency_ms
    assert whole.estimated_ms < 2 * half.estimated_ms  # the links under the other pass's compute
    one_pass = prompt_rows.divided_chunk_cost(plan, T, ctx)
    assert whole.latency_ms < one_pass.latency_ms


def test_a_plan_with_divided_rows_costs_its_prompts_divided(plan, rows_plan):
    """`deepinfer plan` of the release (`[prompt] rows = "divided"`, which trn2 builds:
    compiler/rows_layers.py) costs its prompts as that bundle runs them: each chunk divided by rows, as
    two micro-batches where a rank has whole rows of each (128 rows a chunk of 8,192), else in one pass;
    the release run replicated (model_replicated.toml), every rank every row."""
    rows = rows_plan
    assert rows.spec.divided_rows and not plan.spec.divided_rows
    got = prompt_cost.prompt_cost(rows, L, T)
    assert prompt_rows.built_passes(rows, T) == 2
    assert got == prompt_cost.prompt_cost(rows, L, T, prompt_rows.micro_chunk_cost)
    odd = 3 * WORLD  # three rows a rank: no whole half
    assert prompt_rows.built_passes(rows, odd) == 1
    assert prompt_cost.prompt_cost(rows, L, odd) == prompt_cost.prompt_cost(
        rows, L, odd, prompt_rows.divided_chunk_cost
    )
    assert prompt_cost.prompt_cost(plan, L, T) == prompt_cost.prompt_cost(plan, L, T, prompt_cost.chunk_cost)
    assert got.ttft_ms < prompt_cost.prompt_cost(plan, L, T).ttft_ms / 5


def test_the_rows_twins_leave_the_decode_step_as_it_was(plan, rows_plan):
    """The rows twins run prompt chunks only: the release's decode step reads, runs and sends what the
    release run replicated does, and a divided chunk counts each attention's whole weights once."""
    release = rows_plan
    assert any(kind.startswith("rows_") for kind in release.regions.kinds)
    assert not any(kind.startswith("rows_") for kind in plan.regions.kinds)
    for batch in (1, 8):
        assert read_bytes(release, batch) == read_bytes(plan, batch)
    assert release.per_step == plan.per_step
    assert prompt_rows.divided_weight_bytes(release, T) == prompt_rows.divided_weight_bytes(plan, T)


def test_a_divided_step_holds_one_source_s_gathered_context(rows_plan, plan):
    """Every rank's pages of a kv source's sequence, gathered for its rows (compiler/rows_layers.py),
    are device memory the plan counts: the ratio-1 source's latents and index keys of one sequence
    (`[buckets] prompt_batch = [1]`) of 64K (MODEL.md: head_dim 512, index_head_dim 128, bf16; 1,024
    entries in a rank's 8 local blocks of 128), one source's at a time (`regions.step.last_reads`:
    reuse layers 3-7 read layer 2's, ... 21-39 layer 20's); 16 times that at 1M. At batch 8 a prompt
    step at 1M would hold 10 GiB of them. The release run replicated gathers none."""
    from deepinfer.compiler import budget
    from deepinfer.regions.step import last_reads, plan_layers

    r1 = WORLD * 1024 * (512 + 128) * 2
    assert budget.breakdown(rows_plan.spec, rows_plan.regions).contexts == r1 == 80 << 20
    assert budget.breakdown(plan.spec, plan.regions).contexts == 0
    assert last_reads(plan_layers(rows_plan.spec.model.text)) == {7: 2, 13: 8, 19: 14, 39: 20}
    config = load_compile_config(RELEASE)
    long = dataclasses.replace(config.buckets, max_context=1 << 20)
    at_1m = dataclasses.replace(config, buckets=long, kv=dataclasses.replace(config.kv, num_blocks=65537))
    every = dataclasses.replace(at_1m, buckets=dataclasses.replace(long, prompt_batch=None))
    for c, batch in ((at_1m, 1), (every, 8)):
        p = plan_bundle(c, scratch=False)
        assert budget.breakdown(p.spec, p.regions).contexts == 16 * batch * r1


def test_per_region_layers_launch_each_pass_and_split_where_the_half_bucket_is_built():
    """With trn2's layers run per region (`[target] options layers = "regions"`) the runtime runs a divided
    chunk as two micro-batches only where the half chunk's tokens bucket is built and divides over the
    group (runtime/executor.py): the release's 8,192 (4,096 built), not its 4,096 (no 2,048). Each pass
    is its own region calls, so a micro-batched chunk counts twice a half pass's executions."""
    config = load_compile_config(RELEASE)
    options = {**config.target.options, "layers": "regions"}
    regions = plan_bundle(
        dataclasses.replace(config, target=dataclasses.replace(config.target, options=options)), scratch=False
    )
    assert not regions.spec.fused
    assert prompt_rows.built_passes(regions, T) == 2 and prompt_rows.built_passes(regions, T // 2) == 1
    ctx = prompt_cost.context_bucket(regions, L)
    whole = prompt_rows.micro_chunk_cost(regions, T, ctx)
    half = prompt_rows.divided_chunk_cost(regions, T // 2, ctx)
    assert whole.executions == 2 * half.executions > 2 * (2 + len(regions.regions.layers))
