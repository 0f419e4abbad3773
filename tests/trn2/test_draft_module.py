"""The draft step as one module on trn2 (issue 42, compiler/draft_layers.py), against the draft as the
cpu runtime drives it.

The module runs on real XLA:CPU, one replica a rank. The reference is independent of the module's op
list: the ranks run `regions.drafting.draft_forward` (the runtime's host loop over the draft's region
calls) and `regions.picking.pick_block` (its choice position by position), each rank in a thread of
its own, with the collectives the runtime's `Comm` makes summed on the host between them (an exchange
with bounded waits). Weights are seeded random draws per slot, as the compile's check draws them;
each token group gets its own block, context and rings.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytest.importorskip("torch_mlir", reason="the trn2 lowering needs the [trn2] extra (torch-mlir)")
pytest.importorskip("jax", reason="the trn2 lowering needs the [trn2] extra (jax, jaxlib)")

from deepinfer.bundles.manifest import DECODE, DRAFT_MODULE, PROJECT
from deepinfer.compiler import layers
from deepinfer.compiler.config import load_compile_config
from deepinfer.compiler.pipeline import plan
from deepinfer.compiler.spec import parse
from deepinfer.compiler.targets import hlo
from deepinfer.compiler.weights import in_format
from deepinfer.regions.drafting import DraftBatch, draft_forward
from deepinfer.regions.examples import random_weights
from deepinfer.regions.picking import pick_block

from ..conftest import write_model_toml
from .conftest import Exchange

DRAFT = '\n[host]\nembedding = true\n\n[speculative]\ndraft = "dspark"\n'
WAIT_S = 120  # a rank's wait for the others at a collective
# drawn as the rest, the Markov head's transition is too small to move an argmax (a wrong `previous`
# went unseen); at 30 it alone chose the first position: at 3 a dropped attention or ep all-reduce and a
# wrong group's `previous` each change the drafts
MARKOV_SCALE = 3.0


def compiled(tmp_path, ckpt, parallel):
    toml = write_model_toml(
        tmp_path,
        ckpt,
        target="trn2",
        executable="neff",
        options="{ lnc = 1, optlevel = 1 }",
        tokens=(1, 6),
        num_blocks=5,
        parallel=parallel,
        extra=DRAFT,
    )
    spec = parse(load_compile_config(toml), True, lambda msg: None)
    regions = plan(spec, lambda msg: None)
    lk = regions.fused_modules()[DRAFT_MODULE]
    exe = next(e for e in spec.executables(regions) if e.kind == DRAFT_MODULE)
    built = layers.build(spec, regions, lk, exe)
    proto = tmp_path / "draft.hlo.pb"
    layers.emit(spec, exe, built, proto)
    return spec, regions, lk, built, proto


def weights_by_slot(regions, lk) -> dict[str, dict[str, torch.Tensor]]:
    """Each slot's stored weights: a seeded draw of its own (the stages differ), the Markov head's
    embedding scaled up (`MARKOV_SCALE`) so that each position's choice depends on the token before it."""
    out = {}
    for i, (slot, kind) in enumerate(lk.slots):
        region = regions.kinds[kind].region
        out[slot] = dict(in_format(region.specs, random_weights(region, i), region.fp8_format))
    out["head"]["markov_embed"] = out["head"]["markov_embed"] * MARKOV_SCALE
    return out


def group_inputs(spec, regions, group: int) -> dict[str, torch.Tensor]:
    """A token group's draft step: one sequence at anchor position 11, its block, context and rings."""
    c, g = spec.model.text, spec.geometry
    gen = torch.Generator().manual_seed(100 + group)
    P, R = regions.draft_block, regions.draft_window + regions.draft_block
    tokens = torch.randint(0, c.vocab_size, (1, P), generator=gen)
    batch = DraftBatch(torch.tensor([1 + group % (g.slots - 1)]), torch.tensor([11]), tokens)
    return {
        "batch": batch,
        "h": torch.randn(1, P, c.hc_mult, c.hidden_size, generator=gen).to(spec.dtype),
        "pre": torch.randn(1, P, c.hc_mult, generator=gen),
        **{
            f"features{i}": torch.randn(g.slots, R, c.hidden_size, generator=gen).to(spec.dtype)
            for i in range(len(regions.draft_targets))
        },
    }


def module_drafts(spec, built, proto, weights, inputs) -> list[torch.Tensor]:
    """Each rank's drafts [groups, B, P] from the module on XLA:CPU."""
    topo = spec.topology
    flats = []
    for rank in range(topo.world):
        mine = inputs[topo.group_of(rank)]
        batch = mine["batch"]
        values = {
            **{k: v for k, v in mine.items() if k != "batch"},
            "context_positions": batch.context_positions(spec.model.text.sliding_window),
            "slots": batch.slots,
            "positions": batch.positions,
            "is_image": torch.zeros(batch.tokens.shape, dtype=torch.bool),
            "anchor": batch.tokens[:, 0],
            "position": torch.zeros(1, dtype=torch.int64),
            "rank": torch.tensor(rank),
        }
        flats.append(
            [
                weights[s.name.split(".", 1)[0]][s.name.split(".", 1)[1]] if s.role == "weight" else values[s.name]
                for s in built.params
            ]
        )
    if topo.world == 1:
        (drafts,) = hlo.CpuHlo(proto.read_bytes())(flats[0])
        return [drafts.unsqueeze(0)]
    return [out[0] for out in hlo.CpuReplicas(proto.read_bytes(), topo.world)(flats)]


def reference_drafts(spec, regions, lk, weights, inputs) -> list[torch.Tensor]:
    """Each rank's drafts [groups, B, P]: the cpu runtime's host loop, the ranks in threads."""
    topo, c, dtype = spec.topology, spec.model.text, spec.dtype
    exchange = Exchange(topo.world)
    kinds = dict(lk.slots)

    def rank_drafts(rank: int) -> torch.Tensor:
        mine = inputs[topo.group_of(rank)]

        def region(slot: str):
            r = regions.kinds[kinds[slot]].region
            return r.with_weights({**weights[slot], "rank": torch.tensor(rank)})

        def summed(x: torch.Tensor, group) -> torch.Tensor:
            every = exchange.all(rank, x.float())
            return sum(every[r] for r in group)

        def invoke(stage: int, slot: str, *args, method: str = DECODE):
            name = {"attn": f"attn{stage}", "moe": f"moe{stage}"}.get(slot, slot)
            if slot == "moe" and topo.dispatch:  # every rank's rows
                args = tuple(torch.cat(exchange.all(rank, a), 0) for a in args)
            with torch.no_grad():
                out = getattr(region(name), PROJECT if slot == PROJECT else method)(*args)
            out = list(out) if isinstance(out, (tuple, list)) else [out]
            if slot == "attn" and topo.group_size > 1:  # its heads divided over the token group
                group = next(g for g in topo.token_groups() if rank in g)
                out[0] = summed(out[0], group).to(dtype)
            if slot == "moe" and topo.ep > 1:
                total = summed(out[0], range(topo.world))
                if topo.dispatch:
                    B = total.shape[0] // topo.world
                    return [total[rank * B : (rank + 1) * B].to(dtype), out[1][rank * B : (rank + 1) * B]]
                out[0] = total.to(dtype)
            return out

        rings = [mine[f"features{i}"] for i in range(len(regions.draft_targets))]
        batch = mine["batch"]
        base = draft_forward(c, invoke, lambda tokens: (mine["h"], mine["pre"]), rings, batch)
        stage, anchor = len(regions.draft) - 1, batch.tokens[:, 0]
        if topo.world == 1:
            return invoke(stage, "head", base, anchor, method="tokens")[0].unsqueeze(0)

        def pick(position, previous):
            return tuple(invoke(stage, "head", base, previous, position, method="pick"))

        def gather(value, index):
            every = exchange.all(rank, (value, index))
            return torch.stack([v for v, _ in every]), torch.stack([i for _, i in every])

        return pick_block(pick, anchor, base.shape[1], gather, topo.groups, topo.group_of(rank))

    with ThreadPoolExecutor(topo.world) as pool:
        return list(pool.map(rank_drafts, range(topo.world), timeout=WAIT_S * 10))


DISPATCH = ["all_gather h", "all_gather pre", "all_gather is_image", "reduce_scatter h_part"]


@pytest.mark.slow  # a draft module lowered and run on XLA:CPU per layout: about a minute each
@pytest.mark.parametrize(
    "parallel, per_stage",
    [
        ((1, 1, 1), []),
        ((1, 4, 4), ["all_reduce h", "all_reduce h"]),  # the attention's over the token group, the MoE's
        ((2, 4, 2), ["all_reduce h", "all_reduce h"]),
        ((1, 4, 1), DISPATCH),  # four token groups, EP dispatch
    ],
    ids=["one-rank", "cp=ep=4", "tp=2xcp=2,ep=4", "ep=4-dispatch"],
)
def test_the_draft_module_drafts_what_the_host_loop_drafts(tmp_path, tiny_ckpt, parallel, per_stage):
    """Every rank's drafts from the module equal the host loop's, every group's block on every rank;
    its collectives: each stage's, then one all-gather of the packed pairs a block position."""
    spec, regions, lk, built, proto = compiled(tmp_path, tiny_ckpt, parallel)
    topo = spec.topology
    weights = weights_by_slot(regions, lk)
    inputs = [group_inputs(spec, regions, g) for g in range(topo.groups)]
    got = module_drafts(spec, built, proto, weights, inputs)
    want = reference_drafts(spec, regions, lk, weights, inputs)
    assert want[0].shape == (topo.groups, 1, regions.draft_block)
    for rank, (g, w) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(g, w), (rank, g, w)
    picks = ["all_gather pair"] * regions.draft_block if topo.world > 1 else []
    ops = [f"{c.op} {c.src}" for c in built.ops if isinstance(c, hlo.Collective)]
    assert ops == per_stage * len(regions.draft) + picks
