"""Drafting a DSpark block: the one loop the reference and the bundle runtime share.

`DSparkDrafter` is a `regions.stepper.Drafter` over `invoke(stage, slot, *inputs, method=...)`,
the draft's region calls (slots `capture` and `context` on stage 0, `attn`, `moe`, `head` on the
last, and `project`, the target head's vocabulary projection): the reference drives it with eager
regions (`ReferenceModel.dspark`), the runtime with a bundle's executables on every rank
(`Executor.dspark`), as `regions.step.run_layers` is driven for the target.

What the draft reads of the target is written by the target's own steps (`capture`): at each of
the L `dspark_target_layer_ids`, the collapsed attention input of every position a step feeds goes
to that layer's features ring [slots, R, D] (the `DraftCapture` region; row position % R, with
R = `sliding_window` + `dspark_block_size`). A draft at anchor a (the last committed token, not yet
fed) reads the positions [a - W, a), every one of them fed and committed by then; a rejected draft
position p wrote row p % R, which held position p - R < a - W, so nothing is rolled back.

A draft step is `draft_forward` for each token group (on every rank of that group: the stages'
collectives run between its calls) and the block's tokens: with one rank to a group, the draft
head's `tokens` method runs the Markov chain over the block's positions in one call; with the head
split by vocabulary over a group's ranks, each rank chooses on its slice, position by position, and
only (value, index) pairs cross ranks (regions/picking.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from deepinfer.bundles.manifest import PROJECT
from deepinfer.kernels import hc as _hc  # noqa: F401  (registers the collapse op)
from deepinfer.regions.config import TextConfig
from deepinfer.regions.stepper import DraftRequest, bucket_at_least


def run_draft_stages(
    invoke, stages: int, h: Tensor, pre: Tensor, context: Tensor, context_positions: Tensor, positions: Tensor
) -> tuple[Tensor, Tensor]:
    """The block's streams h [B, P, n, D], pre [B, P, n] through every stage -> the last stage's (what its
    `head` reads). context [B, C, D] at context_positions [B, C] (-1: empty); the block at positions [B, P]."""
    no_image = torch.zeros(positions.shape, dtype=torch.bool)
    for stage in range(stages):
        h, pre = invoke(stage, "attn", h, pre, context, context_positions, positions)
        h, pre = invoke(stage, "moe", h, pre, no_image)
    return h, pre


@dataclass(frozen=True)
class DraftBatch:
    """One token group's draft step, B rows (a padding row: slot 0, anchor 0): each row's slot, the
    position of its anchor and the block's tokens (the anchor's, then the noise token)."""

    slots: Tensor  # [B] int64
    anchors: Tensor  # [B] int64
    tokens: Tensor  # [B, P] int64

    def context_positions(self, window: int) -> Tensor:
        """[B, W]: the positions before each anchor (-1 before the sequence's first)."""
        return (self.anchors.unsqueeze(1) - window + torch.arange(window)).clamp(min=-1)

    @property
    def positions(self) -> Tensor:
        """[B, P]: the block's positions, from the anchor's."""
        return self.anchors.unsqueeze(1) + torch.arange(self.tokens.shape[1])


def draft_batches(
    c: TextConfig, requests: Sequence[DraftRequest], groups: int, batch_sizes: list[int] | None
) -> tuple[list[DraftBatch], list[list[int]]]:
    """The draft step of each token group for `requests` -> (batches, for each group the indices of
    its requests in row order). Every group's batch has the same rows (the ranks' collectives need
    equal shapes): the smallest of `batch_sizes` holding the fullest group (None: exactly that)."""
    places: list[list[int]] = [[] for _ in range(groups)]
    for i, r in enumerate(requests):
        places[r.group].append(i)
    n = max(1, *map(len, places))
    B = n if batch_sizes is None else bucket_at_least(batch_sizes, n)
    batches = []
    for rows in places:
        slots = torch.zeros(B, dtype=torch.int64)
        anchors = torch.zeros(B, dtype=torch.int64)
        tokens = torch.full((B, c.dspark_block_size), c.dspark_noise_token_id, dtype=torch.int64)
        for b, i in enumerate(rows):
            r = requests[i]
            slots[b], anchors[b], tokens[b, 0] = r.slot, len(r.tokens) - 1, r.tokens[-1]
        batches.append(DraftBatch(slots, anchors, tokens))
    return batches, places


def draft_forward(c: TextConfig, invoke, embed, rings: Sequence[Tensor], batch: DraftBatch) -> Tensor:
    """One group's draft step on one rank: the block embedded (`embed`: tokens [B, P] -> h, pre), the
    context gathered from the features rings, every stage, the last stage's `normalize` and the target
    head's `project` -> logits [B, P, V] (this rank's vocabulary rows, with several ranks)."""
    W, stages = c.sliding_window, c.num_nextn_predict_layers
    context_positions = batch.context_positions(W)
    h, pre = embed(batch.tokens)
    (context,) = invoke(0, "context", context_positions, batch.slots, *rings)
    h, pre = run_draft_stages(invoke, stages, h, pre, context, context_positions, batch.positions)
    (normalized,) = invoke(stages - 1, "head", h, pre, method="normalize")
    (base,) = invoke(-1, PROJECT, normalized)
    return base


class EagerCapture:
    """The reference's capture (`regions.stepper.Capture`): the eager `DraftCapture` region writing
    its own features pool [L, slots, R, D], grown to the slots a step uses."""

    def __init__(self, c: TextConfig, region, dtype: torch.dtype, ring: int):
        self.layers = tuple(c.dspark_target_layer_ids)
        self.region = region
        self.features = torch.zeros(len(self.layers), 1, ring, c.hidden_size, dtype=dtype)

    def __call__(self, layer: int, h: Tensor, pre: Tensor, positions: Tensor, slots: Tensor) -> None:
        short = int(slots.max()) + 1 - self.features.shape[1]
        if short > 0:
            more = torch.zeros_like(self.features[:, :1]).expand(-1, short, -1, -1)
            self.features = torch.cat((self.features, more), 1)
        self.region.decode(h, pre, positions, slots, self.features[self.layers.index(layer)])

    def rings(self) -> list[Tensor]:
        return list(self.features.unbind(0))


Forward = Callable[[list[DraftBatch]], list[Tensor]]  # each group's batch -> its logits [B, P, V]
# each group's batch, whether its logits are wanted -> each group's (drafts [B, P], logits [B, P, V] or None)
Choose = Callable[[list[DraftBatch], bool], list[tuple[Tensor, Tensor | None]]]


class DSparkDrafter:
    """The DSpark draft as the scheduler drives it (a `regions.stepper.Drafter`).

    A block drafts greedily: the stages run once over the anchor and `dspark_block_size` - 1 noise
    tokens; position i's token is the argmax of the target head's logits of the last stage's
    normalized state plus the Markov transition bias of position i - 1's token (the anchor for i = 0).
    `forward` runs every group's draft step (`draft_forward`) to its whole logits, and `invoke` the
    head's `tokens` on them; or, with the head split by vocabulary over several ranks, `choose` runs
    the draft step and the choice on every rank, each on its slice (regions/picking.py), the full
    logits gathered only when asked for (`block_logits`; the scheduler's `draft` never asks). `capture`
    is what the target's steps run to write the features (`regions.stepper.Capture`); `module`, where
    given, the draft step as one execution (trn2's fused path) -> each group's drafts, what `draft`
    runs instead of `choose`; `batch_sizes`
    the batch buckets the executables were built for (None: any batch, eager regions); `groups` the
    token groups."""

    def __init__(
        self,
        c: TextConfig,
        invoke,
        forward: Forward | None,
        capture,
        *,
        batch_sizes: list[int] | None = None,
        groups: int = 1,
        choose: Choose | None = None,
        module: Callable[[list[DraftBatch]], list[Tensor]] | None = None,
    ):
        self.c, self.invoke, self.forward, self.capture = c, invoke, forward, capture
        self.batch_sizes, self.groups = batch_sizes, groups
        self.choose = self._whole if choose is None else choose
        self.module = module
        self.block = c.dspark_block_size

    def _whole(self, batches: list[DraftBatch], logits: bool) -> list[tuple[Tensor, Tensor | None]]:
        """`Choose` over the whole logits: `forward`, then the head's `tokens` for each group."""
        stage = self.c.num_nextn_predict_layers - 1
        assert self.forward is not None, "a drafter without `choose` is given `forward`"
        return [
            self.invoke(stage, "head", base, batch.tokens[:, 0], method="tokens")
            for batch, base in zip(batches, self.forward(batches))
        ]

    def block_logits(self, requests: list[DraftRequest]) -> tuple[Tensor, Tensor]:
        """Each request's block drafted -> (drafts [n, P] int64, the logits each was the argmax of
        [n, P, V] float32), one row per request, in order."""
        drafts, logits = self._blocks(requests, True)
        assert logits is not None
        return drafts, logits

    def _blocks(self, requests: list[DraftRequest], keep: bool) -> tuple[Tensor, Tensor | None]:
        batches, places = draft_batches(self.c, requests, self.groups, self.batch_sizes)
        drafts = torch.zeros(len(requests), self.block, dtype=torch.int64)
        logits = torch.zeros(len(requests), self.block, self.c.vocab_size) if keep else None
        if keep or self.module is None:
            chosen = self.choose(batches, keep)
        else:  # the draft step as one execution (trn2): drafts only
            chosen = [(got, None) for got in self.module(batches)]
        for (got, row_logits), rows in zip(chosen, places):
            if rows:
                drafts[rows] = got[: len(rows)]
                if logits is not None:
                    assert row_logits is not None, "asked for, the draft's logits come with its drafts"
                    logits[rows] = row_logits[: len(rows)]
        return drafts, logits

    @torch.inference_mode()
    def draft(self, requests: list[DraftRequest]) -> dict[int, list[int]]:
        drafts, _ = self._blocks(requests, False)
        return {r.seq: drafts[i, : r.n].tolist() for i, r in enumerate(requests)}
