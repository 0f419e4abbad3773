"""Greedy generation: the one loop the reference and the bundle runtime share.

A `Stepper` runs one step for rows of sequences (the reference's eager
regions, or a loaded bundle's executables); `greedy` decides what each step
holds. Sequences are admitted while their token group has a free slot and room
in the batch, prompts run as chunks of at most `chunk` tokens, then one token
per step; a sequence finishes on eos or after `max_new_tokens`. Each sequence
holds one slot and the KV blocks its positions need (`Allocator`); running out
of blocks fails that request only.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from deepinfer.regions.spans import ImageEmbeds, engram_masks, step_images
from deepinfer.regions.step import Batch

Row = tuple[int, list[int], int]  # (sequence, token ids this step, position of the first)


@dataclass
class Generation:
    tokens: list[int]  # prompt then generated
    prompt_len: int
    logits: list[Tensor] = field(default_factory=list)  # one [V] row per processed position
    error: str | None = None  # why the request stopped early

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]


class OutOfBlocks(Exception):
    """A sequence cannot get the blocks it needs: past the bundle's max_context (`context`), or the
    pool is exhausted."""

    def __init__(self, message: str, context: bool = False):
        super().__init__(message)
        self.context = context


class Allocator:
    """Sequence slots and KV blocks of one token group; slot 0 and block 0 are scratch."""

    def __init__(self, slots: int, blocks: int, block_size: int, max_blocks: int):
        self.free_slots = list(range(slots - 1, 0, -1))
        self.free_blocks = list(range(blocks - 1, 0, -1))
        self.block_size, self.max_blocks = block_size, max_blocks
        self.tables: dict[int, list[int]] = {}
        self.slot_of: dict[int, int] = {}

    def admit(self, seq: int) -> bool:
        if not self.free_slots:
            return False
        self.slot_of[seq] = self.free_slots.pop()
        self.tables[seq] = []
        return True

    def reserve(self, seq: int, positions: int) -> None:
        """Make sure sequence `seq` has blocks for its first `positions` positions."""
        need = -(-positions // self.block_size)
        if need > self.max_blocks:
            raise OutOfBlocks(
                f"needs {positions} positions, more than the bundle's max_context ({self.max_context})", context=True
            )
        table = self.tables[seq]
        while len(table) < need:
            if not self.free_blocks:
                raise OutOfBlocks(
                    f"KV pool exhausted: no free block for position {len(table) * self.block_size} "
                    "(raise --num-kv-blocks or run fewer sequences at once)"
                )
            table.append(self.free_blocks.pop())

    @property
    def max_context(self) -> int:
        return self.max_blocks * self.block_size

    def release(self, seq: int) -> None:
        self.free_blocks.extend(reversed(self.tables.pop(seq, [])))
        if seq in self.slot_of:
            self.free_slots.append(self.slot_of.pop(seq))

    def table_row(self, seq: int, width: int) -> list[int]:
        """Sequence `seq`'s block table padded to `width` blocks (at least the blocks it holds: a
        sequence's blocks are the first of its table, so a narrower table is an exact prefix)."""
        t = self.tables[seq]
        assert len(t) <= width, (seq, len(t), width)
        return t + [0] * (width - len(t))


def bucket_at_least(options: list[int], n: int) -> int:
    """The smallest compiled size >= n (options sorted); n must not exceed the largest."""
    return options[bisect.bisect_left(options, n)]


def table_width(rows_by_group: list[list[Row]], block_size: int, widths: list[int]) -> int:
    """A step's block-table width: the smallest of `widths` (sorted; the context buckets' widths in
    blocks) that holds the longest sequence after the step, i.e. its highest written position + 1."""
    longest = max(start + len(ids) for rows in rows_by_group for _, ids, start in rows)
    return bucket_at_least(widths, -(-longest // block_size))


def make_batch(
    rows: list[Row],
    places: list[int],
    B: int,
    T: int,
    *,
    blocks: int,
    alloc: Allocator,
    gens: list[Generation],
    images: list[ImageEmbeds | None] | None,
    hasher,
    pad: int,
    dtype: torch.dtype,
) -> Batch:
    """A step's host metadata: row i of `rows` at batch row `places[i]` of a [B, T] step (others padding),
    block tables `blocks` wide (the step's context bucket)."""
    tokens = torch.full((B, T), pad, dtype=torch.int64)
    positions = torch.full((B, T), -1, dtype=torch.int64)
    slots = torch.zeros(B, dtype=torch.int64)
    table = torch.zeros((B, blocks), dtype=torch.int64)
    spans, histories, row_images = [(0, 0)] * B, [[]] * B, [None] * B
    for (seq, ids, start), b in zip(rows, places):
        tokens[b, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
        positions[b, : len(ids)] = torch.arange(start, start + len(ids))
        slots[b] = alloc.slot_of[seq]
        table[b] = torch.tensor(alloc.table_row(seq, blocks))
        spans[b], histories[b] = (start, len(ids)), gens[seq].tokens
        row_images[b] = images[seq] if images else None
    is_image, image_rows = step_images(row_images if images else None, spans, T, dtype)
    hashes = None
    if hasher is not None:
        masks = engram_masks(row_images if images else None, list(range(B)))
        hashes = torch.from_numpy(hasher.step(histories, positions.numpy(), masks))
    return Batch(tokens, positions, slots, table, hashes, is_image, image_rows)


class Stepper(Protocol):
    """A model `greedy` can drive."""

    groups: int  # token groups: independent sets of sequences, each with its own allocator
    max_batch: int  # sequences of one group in a step
    chunk: int  # prompt tokens of one sequence in a step
    capture: dict | None  # layers whose attention inputs a step keeps for a drafter (run_layers)

    def allocator(self) -> Allocator: ...

    def slot_states(self) -> list[Tensor]:
        """The state views indexed by sequence slot (dim 0): what a rejected draft rolls back."""

    def run(
        self, rows_by_group: list[list[Row]], allocs: list[Allocator], gens: list[Generation], images
    ) -> list[Tensor]:
        """One step -> each group's logits [B, T, V], batch row i for that group's rows[i]."""


class Drafter(Protocol):
    """What proposes tokens for speculative decoding (`regions/speculative.py`)."""

    block: int  # tokens it drafts at most per step (the verify step is block + 1 tokens)
    capture_layers: tuple[int, ...]  # the target layers whose attention inputs `observe` reads
    stats: SpeculationStats

    def draft(self, requests: list[tuple[int, int, list[int], int]]) -> dict[int, list[int]]:
        """(sequence, its slot, its committed tokens, how many to draft) for each request -> its drafted
        tokens."""

    def observe(self, seq: int, slot: int, stepper: Stepper, group: int, row: int, start: int, keep: int) -> None:
        """After a step: positions start .. start + keep - 1 of `seq` (in sequence slot `slot`, batch row
        `row` of `group`) are committed; what the drafter reads of the target for them, it takes from
        `stepper` now (a drafter's per-sequence state may live in pools indexed by slot)."""


@dataclass
class SpeculationStats:
    """What a drafter's verify steps gave, counted per sequence and step."""

    verify_steps: int = 0
    drafted: int = 0
    accepted: int = 0

    def record(self, drafted: int, accepted: int) -> None:
        self.verify_steps += 1
        self.drafted += drafted
        self.accepted += accepted

    @property
    def tokens_per_step(self) -> float:
        """Tokens a verify step commits: the accepted drafts and the target's own next token."""
        return (self.accepted + self.verify_steps) / max(1, self.verify_steps)

    def line(self) -> str:
        return (
            f"{self.verify_steps} verify steps, {self.accepted} of {self.drafted} drafted tokens accepted, "
            f"{self.tokens_per_step:.2f} tokens per step"
        )


@dataclass
class DraftedTokens:
    """A sequence's committed tokens followed by this step's drafts: the history its step reads."""

    tokens: list[int]


def draft_for(
    drafter: Drafter,
    active: list[int],
    gens,
    consumed,
    max_new_tokens: dict[int, int],
    chunk: int,
    max_context: dict[int, int],
    slots: dict[int, int],
) -> dict[int, list[int]]:
    """This step's drafts: for each sequence of `active` that has generated and whose unconsumed tokens
    leave room in a verify step of `drafter.block` + 1 tokens, as many as still fit its token budget
    (`max_new_tokens[seq]`) and context. `gens` and `consumed` are indexed by sequence."""
    requests = []
    for seq in active:
        g = gens[seq]
        u = len(g.tokens) - consumed[seq]
        n = min(drafter.block + 1, chunk) - u
        n = min(n, max_new_tokens[seq] - len(g.generated) - 1, max_context[seq] - len(g.tokens))
        if g.generated and n > 0:
            requests.append((seq, slots[seq], g.tokens, n))
    return drafter.draft(requests) if requests else {}


def verify(logits: Tensor, fed: int, drafts: list[int], caught_up: bool = True) -> tuple[list[int], int]:
    """One sequence's verify step: logits [fed + len(drafts), V] of its fed committed tokens then its
    drafts -> (the target's greedy token after each position, how many drafts it accepts: the longest
    prefix equal to its own choices; none unless the sequence had caught up, all its tokens fed)."""
    choice = logits.argmax(-1).tolist()
    a = 0
    while caught_up and a < len(drafts) and choice[fed - 1 + a] == drafts[a]:
        a += 1
    return choice, a


def reserve(alloc: Allocator, seq: int, positions: int, drafted: dict[int, list[int]]) -> None:
    """Blocks for `positions` and the sequence's drafts; drafts that do not fit are dropped (the step
    then fails, or not, exactly as a plain step would)."""
    try:
        alloc.reserve(seq, positions + len(drafted.get(seq, [])))
    except OutOfBlocks:
        if not drafted.pop(seq, None):
            raise
        alloc.reserve(seq, positions)


class SlotSnapshot:
    """The per-slot state of the sequences a step verifies, as it was before the step.

    Rollback of a partially rejected block: every per-slot state (window rings, the compressor's
    partial groups) goes back to its snapshot and the sequence's accepted tokens are fed again at
    the head of its next step. Paged state (compressed KV, index keys) needs no copy: an entry
    written for a rejected position is invisible to every query until the step that commits its
    group's last position writes it again, before it is read (`t < (p + 1) // ratio`); candidate
    pools and top-k selections are carries recomputed every step.
    """

    def __init__(self, views: list[Tensor], slots: dict[int, int], saved: list[Tensor]):
        self.views, self.slots, self.saved = views, slots, saved

    @classmethod
    def take(cls, stepper: Stepper, slots: dict[int, int]) -> SlotSnapshot:
        views = stepper.slot_states() if slots else []
        index = torch.tensor(list(slots.values()), dtype=torch.int64)
        return cls(views, slots, [v.index_select(0, index) for v in views])

    def restore(self, seqs: list[int]) -> None:
        if not seqs:
            return
        order = list(self.slots)
        rows = torch.tensor([order.index(s) for s in seqs], dtype=torch.int64)
        index = torch.tensor([self.slots[s] for s in seqs], dtype=torch.int64)
        for v, saved in zip(self.views, self.saved):
            v.index_copy_(0, index, saved.index_select(0, rows))


def _stop_reason(e: OutOfBlocks, g: Generation, max_context: int) -> str:
    """Why a sequence stopped, counted in the sequence's own tokens (not the chunk that hit the limit)."""
    if not e.context:
        return str(e)
    if g.prompt_len > max_context:
        return f"the prompt has {g.prompt_len} tokens, more than the bundle's max_context ({max_context})"
    return (
        f"reached the bundle's max_context ({max_context} positions: a prompt of {g.prompt_len} tokens "
        f"and {len(g.generated)} generated)"
    )


def greedy(
    stepper: Stepper,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    eos: int,
    images: list[ImageEmbeds | None] | None = None,
    drafter: Drafter | None = None,
) -> list[Generation]:
    """Greedy generation for token-id prompts; a request that cannot get blocks fails alone
    (its `error` is set). images[i]: prompt i's image positions and their embeddings.

    With a `drafter` (speculative decoding, `regions/speculative.py`), a sequence that has caught
    up feeds its drafted tokens after its unconsumed ones in one verify step; the drafts the
    target's greedy choices agree with are kept, plus the target's own next token, so the output
    is the plain loop's token for token."""
    gens = [Generation(list(p), len(p)) for p in prompts]
    groups = stepper.groups
    allocs = [stepper.allocator() for _ in range(groups)]
    group_of: dict[int, int] = {}
    consumed = [0] * len(gens)
    waiting = [] if max_new_tokens == 0 else list(range(len(gens)))
    active: list[int] = []
    steps = 0
    if drafter is not None and drafter.capture_layers:
        stepper.capture = dict.fromkeys(drafter.capture_layers)
    while waiting or active:
        while waiting:  # admit into the least loaded group with room
            load = [sum(group_of[s] == g for s in active) for g in range(groups)]
            g = min(range(groups), key=lambda i: load[i])
            if load[g] >= stepper.max_batch or not allocs[g].admit(waiting[0]):
                break
            group_of[waiting[0]] = g
            active.append(waiting.pop(0))
        if not active:  # nothing running and nothing can start: no slot at all
            for seq in waiting:
                gens[seq].error = "no sequence slot (the bundle was compiled without room for a sequence)"
            break
        drafted = (
            draft_for(
                drafter,
                active,
                gens,
                consumed,
                dict.fromkeys(active, max_new_tokens),
                stepper.chunk,
                {s: allocs[group_of[s]].max_context for s in active},
                {s: allocs[group_of[s]].slot_of[s] for s in active},
            )
            if drafter
            else {}
        )
        rows_by_group: list[list[Row]] = [[] for _ in range(groups)]
        for seq in list(active):
            n = min(stepper.chunk, len(gens[seq].tokens) - consumed[seq])
            alloc = allocs[group_of[seq]]
            try:
                reserve(alloc, seq, consumed[seq] + n, drafted)
            except OutOfBlocks as e:
                gens[seq].error = _stop_reason(e, gens[seq], alloc.max_context)
                alloc.release(seq)
                active.remove(seq)
                continue
            ids = gens[seq].tokens[consumed[seq] : consumed[seq] + n] + drafted.get(seq, [])
            rows_by_group[group_of[seq]].append((seq, ids, consumed[seq]))
        if not any(rows_by_group):
            continue
        steps += 1
        verifying = {
            seq: allocs[group_of[seq]].slot_of[seq] for rows in rows_by_group for seq, _, _ in rows if drafted.get(seq)
        }
        saved = SlotSnapshot.take(stepper, verifying)
        histories = [DraftedTokens(g.tokens + drafted[s]) if drafted.get(s) else g for s, g in enumerate(gens)]
        rejected = []
        for group, (rows, logits) in enumerate(
            zip(rows_by_group, stepper.run(rows_by_group, allocs, histories, images))
        ):
            for b, (seq, ids, start) in enumerate(rows):
                g = gens[seq]
                drafts = drafted.get(seq, [])
                u = len(ids) - len(drafts)  # committed tokens fed this step
                mine = logits[b, : len(ids)].float()
                caught_up = start + u == len(g.tokens)
                choice, a = verify(mine, u, drafts, caught_up)
                keep = u + a  # rows whose input tokens are now committed
                if drafts:
                    drafter.stats.record(len(drafts), a)
                finite = torch.isfinite(mine[:keep]).all(-1)
                if not bool(finite.all()):  # emitting argmax of NaN (token 0) would hide it
                    at = start + int((~finite).nonzero()[0, 0])
                    g.error = f"non-finite logits (NaN or infinity) at position {at}, step {steps}"
                    allocs[group_of[seq]].release(seq)
                    active.remove(seq)
                    continue
                g.logits.extend(mine[len(g.logits) - start : keep].clone())  # refed positions are recorded once
                if drafter is not None:
                    drafter.observe(seq, allocs[group].slot_of[seq], stepper, group, b, start, keep)
                if a == len(drafts):
                    consumed[seq] = start + len(ids)
                else:  # the block is rolled back and refed next step
                    rejected.append(seq)
                if caught_up:  # the accepted drafts, then the target's own token
                    for nxt in drafts[:a] + [choice[u - 1 + a]]:
                        g.tokens.append(nxt)
                        if nxt == eos or len(g.generated) >= max_new_tokens:
                            allocs[group_of[seq]].release(seq)
                            active.remove(seq)
                            break
        saved.restore(rejected)
    if drafter is not None:
        stepper.capture = None
    return gens
