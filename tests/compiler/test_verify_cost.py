"""The verify step's cost model with the DSpark draft (compiler/verify_cost.py): nothing compiled.

References independent of the code under test: the tiny checkpoint's dimensions (typed in here,
regions/tiny.py's config) for the bytes a draft step's collectives and rings move, and the step
model's own decode figures for the target's part (compiler/step_cost.py, tested on its own).
"""

from __future__ import annotations

import pytest

from deepinfer.compiler import step_cost, verify_cost
from deepinfer.compiler.bundle_plan import plan_bundle
from deepinfer.compiler.config import load_compile_config

from ..conftest import write_model_toml

# the tiny checkpoint's text config (regions/tiny.py)
D, N, V, W, P, TARGET_LAYERS, STAGES = 256, 4, 288, 8, 5, 3, 3
DRAFT = '[speculative]\ndraft = "dspark"\n[host]\nembedding = true\n'


def _plan(tmp_path, tiny_ckpt, parallel=(1, 2, 2), tokens=(1, 6, 8)):
    toml = write_model_toml(
        tmp_path,
        tiny_ckpt,
        target="trn2",
        options="{ lnc = 2 }",
        batch=(1, 2),
        tokens=tokens,
        num_blocks=9,
        parallel=parallel,
        extra=DRAFT,
    )
    return plan_bundle(load_compile_config(toml), scratch=False)


@pytest.fixture(scope="module")
def plan(tmp_path_factory, tiny_ckpt):
    """tp = 1, ep = cp = 2: the vocabulary split over the token group of 2, the MoE's partials summed."""
    return _plan(tmp_path_factory.mktemp("verify"), tiny_ckpt)


def test_a_verify_step_at_the_tiny_dimensions(plan):
    """The target verifies the anchor and 5 drafts in the 6-token bucket; its choice leaves a rank as one
    (value, index) pair a row; the draft's 5 positions each all-gather one pair a row; its 3 stages sum
    their attention's and MoE's partials; its context reads the 3 target layers' rings (W positions of D, fp32)."""
    v = verify_cost.verify_cost(plan, 2, 32)
    assert (v.rows, v.block) == (6, P)
    t, d = v.target, v.draft
    assert "logits all-gather" not in t.collective_bytes
    assert t.collective_bytes["greedy pick all-gather"] == 2 * 6 * 8 and t.collectives_by_name[verify_cost.PICKS] == 1
    assert d.collectives_by_name == {
        "draft pick all-gather": P,
        "draft attention all-reduce": STAGES,  # its heads over the token group
        "draft ep all-reduce": STAGES,
    }
    assert d.collective_bytes["draft attention all-reduce"] == STAGES * 2 * P * N * D * 4
    assert d.collective_bytes["draft pick all-gather"] == P * 2 * 8  # a float32 value and index a row
    assert d.collective_bytes["draft ep all-reduce"] == STAGES * 2 * P * N * D * 4  # float32 partial streams
    assert d.state_bytes == TARGET_LAYERS * 2 * W * D * 4
    assert v.executions == t.executions + d.executions and v.estimated_ms == t.estimated_ms + d.estimated_ms
    assert v.tpot_ms(3.10) == pytest.approx(v.estimated_ms / 3.10)
    assert v.to_dict()["tpot_ms"]["3.10"] == pytest.approx(v.tpot_ms(3.10))


def test_the_target_part_is_the_decode_model_at_its_rows(plan):
    """The target's weights are what the decode step reads at batch x 6 rows; its executions and
    collectives the plan's per_step (the capture adds neither); full logits where a step needs them."""
    v = verify_cost.verify_cost(plan, 1, 32)
    assert v.target.weight_bytes == step_cost.weight_bytes(plan, 6)
    assert v.target.executions == plan.per_step["executions"]
    rows = plan.head["rows_per_rank"]
    full = verify_cost.verify_cost(plan, 1, 32, pairs=False)
    assert full.target.collective_bytes["logits all-gather"] == 6 * rows * 4
    # fused at several ranks the head picks in its graph (`Head.best`): a greedy step's pairs come back, not its slice
    assert full.target.host_device_bytes - v.target.host_device_bytes == 6 * (rows * 4 - 8)
    assert full.estimated_ms >= v.estimated_ms


def test_the_draft_runs_per_region_where_layers_are_not_fused(tmp_path, tiny_ckpt):
    """`layers = "regions"`: a draft step is the context, each stage's attention and MoE, the normalize,
    the target head's projection and a pick a position (the vocabulary split over 2 ranks), with its
    collectives on the host and its streams through the host for each."""
    toml = write_model_toml(
        tmp_path,
        tiny_ckpt,
        target="trn2",
        options='{ lnc = 2, layers = "regions", collectives = "host" }',
        tokens=(1, 6),
        num_blocks=9,
        parallel=(1, 2, 2),
        extra=DRAFT,
    )
    v = verify_cost.verify_cost(plan_bundle(load_compile_config(toml), scratch=False), 1, 32)
    assert not v.fused_draft and v.draft.executions == 3 + STAGES * 2 + P
    assert v.draft.collectives_on_host == P + 2 * STAGES
    inputs = P * (N * D * 4 + 2 * 8) + 2 * 8  # the embedded block, positions, slots and anchors
    assert v.draft.host_device_bytes > inputs + v.draft.executions * 2 * P * N * D * 4
    assert v.target.host_device_bytes > v.target.executions * 2 * 6 * N * (D * 4 + 4)  # its streams, 6 rows


def test_the_verify_bucket_is_the_smallest_holding_the_block(tmp_path, tiny_ckpt):
    assert verify_cost.verify_rows(_plan(tmp_path, tiny_ckpt, tokens=(1, 8, 16))) == 8


def test_plan_text_and_json_carry_the_verify_step(plan, tmp_path, tiny_ckpt):
    d = plan.to_dict()["verify_step"]
    assert d["acceptance"] == [2.70, 3.10, 3.34]
    assert [(b["batch"], b["rows"]) for b in d["buckets"]] == [(1, 6), (2, 6)]
    text = "\n".join(plan.lines())
    assert "verify step with the draft per rank (6 tokens a sequence, a block of 5;" in text
    assert "\n  per output token at 3.10 a step (ms)" in text
    plain = plan_bundle(load_compile_config(write_model_toml(tmp_path, tiny_ckpt, target="trn2")), scratch=False)
    assert plain.to_dict()["verify_step"] is None and "verify step" not in "\n".join(plain.lines())


def test_the_draft_step_is_one_module_where_layers_are_fused(plan):
    """Fused layers (trn2's default): the draft step is one execution holding its collectives, every
    group's drafts back to the host (8 bytes a position a row); per region call it would be 3 + 2 a
    stage + a pick a position, its collectives on the host: the target's figures the same."""
    module, per_region = verify_cost.verify_cost(plan, 1, 32), verify_cost.verify_cost(plan, 1, 32, draft_module=False)
    assert module.fused_draft and module.draft.executions == 1 and module.draft.collectives_on_host == 0
    assert not per_region.fused_draft and per_region.draft.executions == 3 + STAGES * 2 + P
    assert per_region.draft.collectives_on_host == P + 2 * STAGES
    inputs = P * (N * D * 4 + 2 * 8) + 2 * 8  # the embedded block, positions, slots and anchors
    assert module.draft.host_device_bytes == inputs + P * 8  # and the drafts back (one token group)
    assert module.target == per_region.target and module.estimated_ms < per_region.estimated_ms
