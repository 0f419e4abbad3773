"""Region planning: every layer kind of the tiny model, bindings into the kinds' stacks."""

from __future__ import annotations

import pytest
import torch

from deepinfer.compiler.plan import METHOD, plan_regions
from deepinfer.regions.config import load_config
from deepinfer.regions.tiny import make_tiny

# kind -> (slot, layers running it in stack order) for the 6-layer tiny model (MODEL.md's tiny layer plan)
TINY_KINDS = {
    "attn_window": ("attn", [0, 1]),
    "engram": ("engram", [1]),
    "attn_source_r2": ("attn", [2]),
    "attn_reuse_r2": ("attn", [3]),
    "attn_source_r1_cand": ("attn", [4]),
    "attn_reindex_r1_cand": ("attn", [5]),
    "moe": ("moe", [0, 1, 2, 3, 4, 5]),
    "head": ("head", [-1]),
}


def plan_of(ckpt):
    return plan_regions(load_config(ckpt).text, torch.float32, True)


def test_every_kind_of_the_tiny_model(tiny_ckpt):
    plan = plan_of(tiny_ckpt)
    assert {k: (kp.slot, kp.layers) for k, kp in plan.kinds.items()} == TINY_KINDS
    for kind, kp in plan.kinds.items():
        assert kp.region.kind == kind


def test_bindings(tiny_ckpt):
    plan = plan_of(tiny_ckpt)
    assert plan.bindings == {
        0: {"attn": ("attn_window", 0), "moe": ("moe", 0)},
        1: {"engram": ("engram", 0), "attn": ("attn_window", 1), "moe": ("moe", 1)},
        2: {"attn": ("attn_source_r2", 0), "moe": ("moe", 2)},
        3: {"attn": ("attn_reuse_r2", 0), "moe": ("moe", 3)},
        4: {"attn": ("attn_source_r1_cand", 0), "moe": ("moe", 4)},
        5: {"attn": ("attn_reindex_r1_cand", 0), "moe": ("moe", 5)},
    }


def check_bindings_consistent(plan):
    """Layer i's (kind, index) is slice `index` of the kind's stacks, and every stack slice is bound once."""
    seen = {k: [] for k in plan.kinds if k != "head"}
    for layer, slots in plan.bindings.items():
        for slot, (kind, index) in slots.items():
            assert plan.kinds[kind].slot == slot
            assert plan.kinds[kind].layers[index] == layer
            seen[kind].append(index)
    for kind, indices in seen.items():
        assert sorted(indices) == list(range(len(plan.kinds[kind].layers))), kind


# the kinds that read a block table (attention over compressed state): built per context bucket
CONTEXT_KINDS = {"attn_source_r2", "attn_reuse_r2", "attn_source_r1_cand", "attn_reindex_r1_cand"}


@pytest.mark.parametrize("contexts", [(64,), (16, 64), (16, 32, 64)])
def test_executables_are_kinds_times_buckets(tiny_ckpt, contexts):
    """Each kind once per (batch, tokens); the kinds whose shapes depend on the context once more per
    context bucket: sum over kinds of the buckets it depends on."""
    plan = plan_of(tiny_ckpt)
    check_bindings_consistent(plan)
    shapes = [(1, 1), (1, 8), (2, 1), (2, 8)]
    exes = plan.executables(shapes, contexts)
    free = len(TINY_KINDS) - len(CONTEXT_KINDS)
    assert len(exes) == len(set(exes)) == (free + len(CONTEXT_KINDS) * len(contexts)) * len(shapes)
    assert {(k, m) for k, m, *_ in exes} == {(k, METHOD) for k in TINY_KINDS}
    assert {k for k, _, _, _, c in exes if c is not None} == CONTEXT_KINDS
    for kind in CONTEXT_KINDS:
        assert sorted((b, t, c) for k, _, b, t, c in exes if k == kind) == sorted(
            (b, t, c) for b, t in shapes for c in contexts
        )
    assert all(c is None for k, _, _, _, c in exes if k not in CONTEXT_KINDS)


@pytest.mark.parametrize("layers", [12, 24])
def test_longer_tiny_models_keep_their_bindings_consistent(tmp_path, layers):
    plan = plan_of(make_tiny(tmp_path / f"tiny{layers}", layers=layers))
    check_bindings_consistent(plan)
    assert plan.kinds["moe"].layers == list(range(layers))
    assert sorted(layer for kp in plan.kinds.values() if kp.slot == "attn" for layer in kp.layers) == list(
        range(layers)
    )


@pytest.mark.parametrize("layers", [12, 24])
def test_longer_tiny_models_have_the_same_kinds(tmp_path, layers):
    plan = plan_of(make_tiny(tmp_path / f"tiny{layers}", layers=layers))
    assert {k: kp.slot for k, kp in plan.kinds.items()} == {k: slot for k, (slot, _) in TINY_KINDS.items()}


@pytest.mark.parametrize(
    "target, host, device",
    [("cpu", None, False), ("trn2", None, True), ("trn2", "true", False), ("cpu", "false", True)],
)
def test_where_the_embedding_runs(tiny_ckpt, tmp_path, target, host, device):
    """The target decides (cpu: the host lookup; trn2: the `embed` region, first, its table a weight
    stack every rank holds whole), and model.toml's [host] embedding overrides it; the host file of
    the embedding exists exactly when there is no region."""
    from deepinfer.compiler import pipeline
    from deepinfer.compiler.config import load_compile_config
    from deepinfer.compiler.shard import replicated
    from deepinfer.compiler.weights import host_entries

    from ..conftest import write_model_toml

    extra = "" if host is None else f"\n[host]\nembedding = {host}\n"
    spec = pipeline.parse(
        load_compile_config(write_model_toml(tmp_path, tiny_ckpt, target=target, extra=extra)), False, lambda msg: None
    )
    plan = pipeline.plan(spec, lambda msg: None)
    assert spec.device_embedding == device
    assert ("embed" in plan.kinds) == device and (
        "embed" in host_entries(spec.model, device_embedding=device)
    ) != device
    if device:
        kp = plan.kinds["embed"]
        assert list(plan.kinds)[0] == "embed" and (kp.slot, kp.layers) == ("embed", [-1])
        c = spec.model.text
        assert [(s.name, s.key, s.shape, s.ckpt_dtype) for s in kp.region.specs] == [
            ("embed", "embed.weight", (c.vocab_size, c.hidden_size), "BF16")
        ]
        assert replicated("embed", "embed", c, spec.topology)


def test_embedding_region_is_the_host_lookup(tiny_ckpt):
    """The `embed` region, traced and run as a program, equals the host lookup (regions.step.Embedding)
    on the checkpoint's table, image rows included; its token ids span the vocabulary in the examples."""
    from safetensors.torch import load_file

    from deepinfer.compiler.trace import trace
    from deepinfer.regions.examples import example_inputs
    from deepinfer.regions.state import Geometry
    from deepinfer.regions.step import Embedding

    c = load_config(tiny_ckpt).text
    table = load_file(tiny_ckpt / "model.safetensors")["embed.weight"]
    region = plan_regions(c, torch.float32, True, device_embedding=True).kinds["embed"].region
    g = Geometry(slots=2, blocks=2, block_size=16, max_blocks=1)
    ep, sig = trace(region, 2, 3, g, dynamic=False)
    tokens, is_image, rows = example_inputs(sig.inputs, g, seed=4)
    assert tokens.view(-1)[0] == c.vocab_size - 1 and 0 <= int(tokens.min()) and tokens.unique().numel() > 1
    is_image = torch.tensor([[False, True, False], [True, False, False]])
    h, pre = ep.module()(torch.tensor(0), table, tokens, is_image, rows)
    want = Embedding(table, c.hc_mult, torch.float32)(tokens, is_image, rows)
    assert torch.equal(h, want[0]) and torch.equal(pre, want[1])
    assert h.shape == (2, 3, c.hc_mult, c.hidden_size) and torch.equal(h[0, 1, 2], rows[0, 1])
