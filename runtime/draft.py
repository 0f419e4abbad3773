"""A bundle's compiled draft on a loaded executor: the DSpark drafter, its draft steps and the capture.

A bundle compiled with [speculative] draft carries the draft's regions (bound beside the target's,
`Executor.draft_bound`) and a features pool: the target's steps write each target layer's features
ring (`capture`, the compiled capture region) and the draft's steps read them (`draft_step`). With
several ranks the leader sends each draft step to its followers (`DRAFT_STEP`, `Executor.follow`),
and every rank runs its token group's share and chooses the block's tokens on its vocabulary slice,
joining an all-gather of (value, index) pairs per block position (`choose`): the draft's logits
never cross ranks unless asked for (tests, debugging). A trn2 bundle's fused path runs the draft step
as one executable instead (`module_step`, compiler/draft_layers.py): its collectives and the choice
inside, each rank's host given every group's drafts; its regions' own executables then serve only
the full draft logits.
No checkpoint is read: everything runs the bundle's executables.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from deepinfer.bundles import manifest as mf
from deepinfer.regions.stepper import Capture
from deepinfer.runtime.bundle import require_draft

if TYPE_CHECKING:  # the executor calls this module: only the types here
    from deepinfer.regions.drafting import DraftBatch, DSparkDrafter
    from deepinfer.runtime.executor import Executor, Stats

DRAFT_STEP = "draft"  # what the leader sends its followers for a draft step (`Executor.follow`)
DRAFT_LOGITS = "draft logits all-gather"  # the draft's full logits, gathered only where asked for (`choose`)


def dspark(x: Executor, stats: Stats) -> DSparkDrafter:
    """The bundle's compiled DSpark draft as a `regions.stepper.Drafter` (`regions.drafting.DSparkDrafter`):
    its executables at the batch buckets, its features pool written by the target's steps (`capture`),
    every rank running each draft step and choosing its group's tokens on its vocabulary slice
    (`choose`; `x` is the leader's executor); no checkpoint is read."""
    require_draft(x.bundle)
    from deepinfer.regions.drafting import DSparkDrafter  # the collapse op: only where a draft runs

    comm, step = x.comm, module_step(x, stats)

    def forward(batches: list[DraftBatch]) -> list[Tensor]:
        return [draft_step(x, batches[0], stats)]

    def chosen(batches: list[DraftBatch], logits: bool) -> list[tuple[Tensor, Tensor | None]]:
        assert comm is not None
        comm.step((DRAFT_STEP, batches, logits))
        return choose(x, batches, stats, logits)

    def module(batches: list[DraftBatch]) -> list[Tensor]:
        """Each group's drafts [B, P] from the draft step's one executable on every rank."""
        if comm is None:
            assert step is not None
            return list(step(batches[0]).unbind(0))
        return [drafts for drafts, _ in chosen(batches, False)]

    return DSparkDrafter(
        x.config.text,
        _draft_invoke(x, stats),
        forward if comm is None else None,
        capture(x, stats),
        batch_sizes=list(x.sizes.batch_sizes),
        groups=x.manifest.topology.groups,
        choose=None if comm is None else chosen,
        module=None if step is None else module,
    )


def module_step(x: Executor, stats: Stats) -> Callable[[DraftBatch], Tensor] | None:
    """The draft step as one executable (trn2's fused path, compiler/draft_layers.py), or None where
    the bundle has none: a token group's batch -> every group's drafts [groups, B, P] (the block's
    choice and its all-gathers inside: no logits leave the device)."""
    binding = x.draft_bound.get((0, mf.DRAFT_MODULE))
    if binding is None:
        return None
    kind, weights = binding
    entry = next(e for e in x.manifest.regions if e.kind == kind)
    names = [s.name for s in entry.inputs if s.role not in ("weight", "rank")]
    c, rings = x.config.text, _rings(x)
    assert x.host.embed is not None, "a bundle with a draft embeds on the host (compiler/spec.py)"
    embed = x.host.embed

    def run(batch: DraftBatch) -> Tensor:
        t0 = time.perf_counter()
        B, P = batch.tokens.shape
        h, pre = embed(batch.tokens)
        values = {
            **{f"features{i}": ring for i, ring in enumerate(rings)},
            "context_positions": batch.context_positions(c.sliding_window),
            "slots": batch.slots,
            "h": h,
            "pre": pre,
            "positions": batch.positions,
            "is_image": torch.zeros(B, P, dtype=torch.bool),
            "anchor": batch.tokens[:, 0],
            "position": torch.zeros(B, dtype=torch.int64),  # the block's first; the module steps it on
        }
        exe = x.executables[(kind, mf.DECODE, B, P, None)]
        args = weights + [values[n] for n in names]
        t1 = time.perf_counter()
        (drafts,) = exe(args)
        stats.calls[kind] += 1
        stats.seconds[kind] += time.perf_counter() - t1
        stats.overhead += t1 - t0
        return drafts if drafts.dim() == 3 else drafts.unsqueeze(0)  # one rank: its one group's

    return run


def draft_step(x: Executor, batch: DraftBatch, stats: Stats) -> Tensor:
    """This rank's share of a draft step for its token group -> its logits (vocabulary rows)."""
    from deepinfer.regions.drafting import draft_forward

    assert x.host.embed is not None, "a bundle with a draft embeds on the host (compiler/spec.py)"
    return draft_forward(x.config.text, _draft_invoke(x, stats), x.host.embed, _rings(x), batch)


def choose(x: Executor, batches: list[DraftBatch], stats: Stats, logits: bool) -> list[tuple[Tensor, Tensor | None]]:
    """A draft step on this rank of several (the leader's and every follower's, `Executor.follow`): its
    group's share of the stages to its vocabulary slice of the block's logits, then the block's tokens
    chosen position by position with only (value, index) pairs all-gathered (the head's `pick`,
    regions/picking.py) -> every group's (drafts [B, P], logits [B, P, V] or None). `logits`: the
    full draft logits too (the head's `chain` of its slice, then one all-gather, `DRAFT_LOGITS`),
    for tests and debugging; the scheduler's drafts never ask."""
    from deepinfer.regions.picking import pick_block

    comm, c = x.comm, x.config.text
    assert comm is not None, "a draft step's choice per vocabulary slice runs with several ranks"
    step = None if logits else module_step(x, stats)
    if step is not None:  # trn2's fused path: the whole step and its choice in one execution
        return [(drafts, None) for drafts in step(batches[comm.group]).unbind(0)]
    batch, stage, invoke = batches[comm.group], c.num_nextn_predict_layers - 1, _draft_invoke(x, stats)
    base = draft_step(x, batch, stats)  # [B, P, rows]

    def pick(position: Tensor, previous: Tensor) -> tuple[Tensor, Tensor]:
        value, index = invoke(stage, "head", base, previous, position, method="pick")
        return value, index

    anchor = batch.tokens[:, 0]
    drafts = pick_block(pick, anchor, base.shape[1], comm.picks, comm.topo.groups, comm.group)  # [groups, B, P]
    if not logits:
        return [(d, None) for d in drafts.unbind(0)]
    previous = torch.cat((anchor.unsqueeze(1), drafts[comm.group, :, :-1]), 1)  # [B, P]
    (rows,) = invoke(stage, "head", base, previous, method="chain")
    whole = comm.gather_logits(rows, c.vocab_size, DRAFT_LOGITS)
    return list(zip(drafts.unbind(0), whole))


def capture(x: Executor, stats: Stats) -> Capture:
    """What a step runs for the draft (`regions.stepper.Capture`): the compiled capture, writing
    each target layer's features ring on this rank."""
    d = require_draft(x.bundle)
    return CompiledCapture(tuple(d.target_layers), _draft_invoke(x, stats), tuple(_rings(x)))


@dataclass(frozen=True)
class CompiledCapture:
    """`regions.stepper.Capture` over a bundle's compiled capture: writes a target layer's features
    ring on this rank."""

    layers: tuple[int, ...]
    invoke: Callable
    rings: tuple[Tensor, ...]

    def __call__(self, layer: int, h: Tensor, pre: Tensor, positions: Tensor, slots: Tensor) -> None:
        self.invoke(0, "capture", h, pre, positions, slots, self.rings[self.layers.index(layer)])


def _draft_invoke(x: Executor, stats: Stats):
    """invoke(stage, slot, *inputs, method=...) over the draft's executables, with the collectives
    the target's regions of the same slots have (slot `project`: the target head's `project`)."""
    invoke = x.invoker(0, stats, None, {**x.draft_bound, (-1, "head"): x.bound[(-1, "head")]})

    def draft_invoke(stage: int, slot: str, *inputs, method: str = mf.DECODE):
        if slot == mf.PROJECT:
            return invoke(-1, "head", *inputs, method=mf.PROJECT)
        return invoke(stage, slot, *inputs, method=method)

    return draft_invoke


def _rings(x: Executor) -> list[Tensor]:
    """The features pool's ring of each of the draft's target layers [slots, R, D]."""
    d = require_draft(x.bundle)
    return [x.features[layer] for layer in d.target_layers]
