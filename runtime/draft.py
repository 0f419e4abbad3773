"""A bundle's compiled draft on a loaded executor: the DSpark drafter, its draft steps and the capture.

A bundle compiled with [speculative] draft carries the draft's regions (bound beside the target's,
`Executor.draft_bound`) and a features pool: the target's steps write each target layer's features
ring (`capture`, the compiled capture region) and the draft's steps read them (`draft_step`). With
several ranks the leader sends each draft step to its followers (`DRAFT_STEP`, `Executor.follow`),
and every rank runs its token group's share and joins the logits all-gather, as for a target step.
No checkpoint is read: everything runs the bundle's executables.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import Tensor

from deepinfer.bundles import manifest as mf
from deepinfer.regions.stepper import Capture
from deepinfer.runtime.bundle import require_draft

if TYPE_CHECKING:  # the executor calls this module: only the types here
    from deepinfer.regions.drafting import DraftBatch, DSparkDrafter
    from deepinfer.runtime.executor import Executor, Stats

DRAFT_STEP = "draft"  # what the leader sends its followers for a draft step (`Executor.follow`)


def dspark(x: Executor, stats: Stats) -> DSparkDrafter:
    """The bundle's compiled DSpark draft as a `regions.stepper.Drafter` (`regions.drafting.DSparkDrafter`):
    its executables at the batch buckets, its features pool written by the target's steps (`capture`),
    every rank running each draft step (`x` is the leader's executor); no checkpoint is read."""
    require_draft(x.bundle)
    from deepinfer.regions.drafting import DSparkDrafter  # the collapse op: only where a draft runs

    comm, vocab = x.comm, x.config.text.vocab_size

    def forward(batches: list[DraftBatch]) -> list[Tensor]:
        if comm is None:
            return [draft_step(x, batches[0], stats)]
        comm.step((DRAFT_STEP, batches))
        return comm.gather_logits(draft_step(x, batches[comm.group], stats), vocab)

    return DSparkDrafter(
        x.config.text,
        _draft_invoke(x, stats),
        forward,
        capture(x, stats),
        batch_sizes=list(x.sizes.batch_sizes),
        groups=x.manifest.topology.groups,
    )


def draft_step(x: Executor, batch: DraftBatch, stats: Stats) -> Tensor:
    """This rank's share of a draft step for its token group -> its logits (vocabulary rows)."""
    from deepinfer.regions.drafting import draft_forward

    assert x.host.embed is not None, "a bundle with a draft embeds on the host (compiler/spec.py)"
    return draft_forward(x.config.text, _draft_invoke(x, stats), x.host.embed, _rings(x), batch)


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
    pool = x.pools[d.features]
    return [x.placement.view(pool, i) for i in range(len(d.target_layers))]
