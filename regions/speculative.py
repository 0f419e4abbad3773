"""Drafters for speculative decoding (the scheduler's `drafter`, `runtime/schedule.py`).

A drafter proposes up to `block` tokens after a sequence's committed ones; the
target verifies them in one step of the committed-but-unfed token plus the
drafts (a `block + 1`-token bucket) and keeps the longest prefix its own greedy
choices agree with, then its own next token. What a rejected position wrote is
left in the model's state: its per-slot rings have `block` rows of slack, so
nothing it still reads is overwritten (the scheduler's docstring, `runtime/schedule.py`).

The release's draft is DSpark (`regions/dspark.py`). A randomly initialised
draft accepts almost nothing, so the mechanism is tested with the two test
doubles here, which know the plain run's output: one drafts exactly the
target's greedy continuation (every draft accepted), the other corrupts one
drafted position at random (acceptance stops there, so every offset of the
block is rejected in turn).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from deepinfer.regions.stepper import DraftRequest


class AllAcceptedDraftDouble:
    """Test double: drafts the plain run's own continuation, so the target accepts every draft.

    `plain[i]` is the plain greedy run of the same prompt i (same max_new_tokens); near its end it
    drafts what remains (fewer tokens), and off that run (a sequence that already diverged) nothing."""

    def __init__(self, plain: Sequence, block: int):
        self.plain = [g.tokens for g in plain]  # each run's prompt then generated tokens (`.tokens`)
        self.block = block
        self.capture = None  # it reads nothing of the target

    def draft(self, requests: list[DraftRequest]) -> dict[int, list[int]]:
        out = {}
        for seq, _, tokens, n, _ in requests:
            full = self.plain[seq]
            out[seq] = full[len(tokens) : len(tokens) + n] if full[: len(tokens)] == tokens else []
        return out


class OneRejectedDraftDouble(AllAcceptedDraftDouble):
    """Test double: the plain continuation with one drafted position (chosen at random, seeded) replaced
    by another token, so the target accepts exactly the drafts before it. `offsets` counts, per
    offset of the block, how often the corruption landed there."""

    def __init__(self, plain: Sequence, block: int, vocab_size: int, seed: int = 0):
        super().__init__(plain, block)
        self.vocab_size = vocab_size
        self.rng = np.random.default_rng(seed)
        self.offsets = [0] * block

    def draft(self, requests: list[DraftRequest]) -> dict[int, list[int]]:
        out = super().draft(requests)
        for drafts in out.values():
            if drafts:
                at = int(self.rng.integers(len(drafts)))
                shift = 1 + int(self.rng.integers(self.vocab_size - 1))
                drafts[at] = (drafts[at] + shift) % self.vocab_size
                self.offsets[at] += 1
        return out
