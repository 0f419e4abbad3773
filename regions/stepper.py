"""The step contract: what the scheduler (`runtime/schedule.py`) and a model it drives agree on.

A `Stepper` runs one step for rows of sequences (the reference's eager regions, or a loaded
bundle's executables); the scheduler decides what each step holds. A step's rows are `Row`s,
grouped by token group; each group has an `Allocator` of sequence slots and KV blocks (slot 0
and block 0 are scratch), and `make_batch` turns a group's rows into the `Batch` (`regions/step.py`)
that `run_layers` wires through the layers. A `Drafter` proposes tokens for speculative decoding
whose `capture` the target's steps run, writing what the draft reads of the target; a stepper's
per-slot rings have room (`slack`) for the drafts of one verify step, so a rejected draft needs
nothing restored (`runtime/schedule.py`).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from deepinfer.regions.prefix import BlockCache, SlotState
from deepinfer.regions.spans import ImageEmbeds, engram_masks, step_images
from deepinfer.regions.step import Batch

Row = tuple[int, list[int], int]  # (sequence, token ids this step, position of the first)


class Capture(Protocol):
    """What a step writes for a drafter at its `layers` (`regions.drafting`): called with the streams
    h [B, T, n, D] and pre [B, T, n] that layer's attention site reads, the step's positions [B, T]
    and slots [B]."""

    @property
    def layers(self) -> tuple[int, ...]: ...

    def __call__(self, layer: int, h: Tensor, pre: Tensor, positions: Tensor, slots: Tensor) -> None: ...


class OutOfBlocks(Exception):
    """A sequence cannot get the blocks it needs: past the bundle's max_context (`context`), or the
    pool is exhausted."""

    def __init__(self, message: str, context: bool = False):
        super().__init__(message)
        self.context = context


class Allocator:
    """Sequence slots and KV blocks of one token group; slot 0 and block 0 are scratch.

    With `shards` > 1 (the paged state divided over cp ranks, regions/divided.py) each shard is one
    cp rank's pool of `blocks` blocks (its own scratch block 0 included): a sequence's logical block
    j comes from shard j % shards, and its table holds that shard's block id."""

    def __init__(self, slots: int, blocks: int, block_size: int, max_blocks: int, shards: int = 1):
        self.free_slots = list(range(slots - 1, 0, -1))
        self.free = [list(range(blocks - 1, 0, -1)) for _ in range(shards)]  # per shard
        self.block_size, self.max_blocks = block_size, max_blocks
        self.tables: dict[int, list[int]] = {}
        self.slot_of: dict[int, int] = {}
        self.cache: BlockCache | None = None  # prefix caching (`use_prefix_cache`)

    def use_prefix_cache(
        self, every: int = 1, forget: Callable[[SlotState], None] | None = None, max_states: int | None = None
    ) -> None:
        """Keep full blocks that `cache_blocks` names after their sequences end, for `match` to share
        (regions/prefix.py), a slot state with every `every`-th (at most `max_states` of them); the
        unheld ones are evicted, least recently released first, when their shard has no free block
        (`forget` is told of each kept state that is dropped)."""
        self.cache = BlockCache(shards=self.shards, every=every, forget=forget, max_states=max_states)

    def available(self, shard: int = 0) -> int:
        """Blocks a reservation in `shard` can still take: the free ones and the cached ones no
        sequence holds."""
        return len(self.free[shard]) + (self.cache.unheld_in(shard) if self.cache is not None else 0)

    def match(self, keys: Sequence[bytes]) -> tuple[list[int], SlotState | None]:
        """The cached blocks a prompt whose full blocks have `keys` can start from, and the slot
        state at their end (`BlockCache.match`); nothing without a cache."""
        return self.cache.match(keys) if self.cache is not None else ([], None)

    def cache_blocks(self, seq: int, keys: Sequence[bytes], state: SlotState | None) -> None:
        """Sequence `seq` has fed its first len(keys) full blocks (of keys `keys`) and its slot holds
        `state` after them: cache those blocks, and keep `state` (None: the cache has one already)
        with the last (with the block already cached under its key when another sequence wrote that
        one first)."""
        cache = self.cache
        assert cache is not None and keys
        for j, (key, block) in enumerate(zip(keys, self.tables[seq])):
            cache.add(key, (j % self.shards, block))
        if state is not None:
            cache.keep(cache.block_of[keys[-1]], state)

    def node(self, seq: int, j: int) -> tuple[int, int]:
        """Sequence `seq`'s block j as the cache names it: (its shard, its id there)."""
        return j % self.shards, self.tables[seq][j]

    def blocks_in_use(self) -> int:
        """Blocks running sequences hold (a shared block once)."""
        return len({(j % self.shards, b) for t in self.tables.values() for j, b in enumerate(t)})

    @property
    def shards(self) -> int:
        return len(self.free)

    @property
    def free_blocks(self) -> list[int]:
        """Every free block (of every shard)."""
        return [b for free in self.free for b in free]

    def shard_counts(self, n: int, start: int = 0) -> list[int]:
        """How many of a sequence's logical blocks start .. n - 1 each shard holds."""
        return [len(range(start + (s - start) % self.shards, n, self.shards)) for s in range(self.shards)]

    def admit(self, seq: int, shared: Sequence[int] = ()) -> bool:
        """Give `seq` a slot; its table starts with `shared`, cached blocks from `match`."""
        if not self.free_slots:
            return False
        self.slot_of[seq] = self.free_slots.pop()
        self.tables[seq] = list(shared)
        for j in range(len(shared)):
            assert self.cache is not None
            self.cache.hold(self.node(seq, j))
        return True

    def _take(self, shard: int) -> int | None:
        """A free block of `shard`, else an evicted cached one, else None."""
        if self.free[shard]:
            return self.free[shard].pop()
        return self.cache.evict(shard) if self.cache is not None else None

    def reserve(self, seq: int, positions: int) -> None:
        """Make sure sequence `seq` has blocks for its first `positions` positions."""
        need = -(-positions // self.block_size)
        if need > self.max_blocks:
            raise OutOfBlocks(
                f"needs {positions} positions, more than the bundle's max_context ({self.max_context})", context=True
            )
        table = self.tables[seq]
        while len(table) < need:
            block = self._take(len(table) % self.shards)
            if block is None:
                raise OutOfBlocks(
                    f"KV pool exhausted: no free block for position {len(table) * self.block_size} "
                    "(raise --num-kv-blocks or run fewer sequences at once)"
                )
            table.append(block)

    @property
    def max_context(self) -> int:
        return self.max_blocks * self.block_size

    def release(self, seq: int) -> None:
        table = self.tables.pop(seq, [])
        for j in reversed(range(len(table))):  # a cached prefix's last blocks become the first evicted
            if self.cache is not None and (j % self.shards, table[j]) in self.cache.key_of:
                self.cache.drop((j % self.shards, table[j]))
            else:
                self.free[j % self.shards].append(table[j])
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
    histories: Mapping[int, Sequence[int]],
    images: Mapping[int, ImageEmbeds | None],
    hasher,
    pad: int,
    dtype: torch.dtype,
    last_only: bool = False,
) -> Batch:
    """A step's host metadata: row i of `rows` at batch row `places[i]` of a [B, T] step (others padding),
    block tables `blocks` wide (the step's context bucket). `last_only`: the step's logits are each
    sequence's last fed row only (`Batch.heads`)."""
    tokens = torch.full((B, T), pad, dtype=torch.int64)
    positions = torch.full((B, T), -1, dtype=torch.int64)
    slots = torch.zeros(B, dtype=torch.int64)
    table = torch.zeros((B, blocks), dtype=torch.int64)
    spans: list[tuple[int, int]] = [(0, 0)] * B
    row_histories: list[Sequence[int]] = [[]] * B
    row_images: list[ImageEmbeds | None] = [None] * B
    for (seq, ids, start), b in zip(rows, places):
        tokens[b, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
        positions[b, : len(ids)] = torch.arange(start, start + len(ids))
        slots[b] = alloc.slot_of[seq]
        table[b] = torch.tensor(alloc.table_row(seq, blocks))
        spans[b], row_histories[b] = (start, len(ids)), histories[seq]
        row_images[b] = images.get(seq)
    with_images = row_images if any(im is not None for im in row_images) else None
    is_image, image_rows = step_images(with_images, spans, T, dtype)
    hashes = None
    if hasher is not None:
        masks = engram_masks(with_images, list(range(B)))
        hashes = torch.from_numpy(hasher.step(row_histories, positions.numpy(), masks))
    heads = None
    if last_only:
        heads = torch.zeros(B, dtype=torch.int64)
        for (_, ids, _), b in zip(rows, places):
            heads[b] = len(ids) - 1
    return Batch(tokens, positions, slots, table, hashes, is_image, image_rows, heads)


@dataclass(frozen=True)
class Greedy:
    """A step's greedy choices where no request needed its logits (`Stepper.run(greedy=True)`, a
    bundle over several ranks: regions/picking.py): each row's token of the whole vocabulary's argmax
    (the lowest index among equal values) and its logit, NaN where any logit of the row is not finite.
    Indexed and sized as the logits would be without their last dim ([B, T], a sequence's [n])."""

    tokens: Tensor  # [B, T] int64
    values: Tensor  # [B, T] float32

    def __getitem__(self, at) -> Greedy:
        return Greedy(self.tokens[at], self.values[at])

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def shape(self) -> torch.Size:
        return self.tokens.shape


class Stepper(Protocol):
    """A model the scheduler drives: the reference (`ReferenceModel.stepper`) or a loaded bundle
    (`runtime.executor.Steps`). One whose steps with a prompt chunk hold fewer sequences than
    `max_batch` says so with a `prompt_batch` attribute (a bundle compiled with `[buckets]
    prompt_batch`; the scheduler's `runtime.budget.fit_prompt_batch`)."""

    @property
    def groups(self) -> int:
        """Token groups: independent sets of sequences, each with its own allocator."""
        ...

    @property
    def max_batch(self) -> int:
        """Sequences of one group in a step."""
        ...

    @property
    def chunk(self) -> int:
        """Prompt tokens of one sequence in a step."""
        ...

    @property
    def slack(self) -> int:
        """Rows its per-slot rings (window rings, the compressor's partial groups) hold beyond the
        window and ratio: the most drafts a verify step may carry (regions/state.py `Geometry.slack`;
        0 for a bundle compiled without a draft)."""
        ...

    def allocator(self) -> Allocator: ...

    def save_slot(self, group: int, slot: int) -> SlotState:
        """A copy of sequence slot `slot`'s per-slot state (window rings, the compressor's partial
        groups) in token group `group`: what prefix caching keeps with a cached block (regions/prefix.py)."""
        ...

    def load_slot(self, group: int, slot: int, state: SlotState) -> None:
        """Put back into `slot` what `save_slot` copied (from this or another slot)."""
        ...

    def forget_slot(self, group: int, state: SlotState) -> None:
        """The prefix cache no longer keeps `state` (evicted): what holds its copies may free them."""
        ...

    def run(
        self,
        rows_by_group: list[list[Row]],
        allocs: list[Allocator],
        histories: Mapping[int, Sequence[int]],
        images: Mapping[int, ImageEmbeds | None],
        capture: Capture | None = None,
        last_only: bool = False,
        greedy: bool = False,
    ) -> list[Tensor | Greedy]:
        """One step -> each group's logits [B, T, V], batch row i for that group's rows[i]; with
        `last_only`, [B, 1, V]: each row's last fed token's only (what sampling needs), the head
        run on those rows alone. With `greedy` (every row's request greedy, none needing the logits)
        a stepper may give each group's `Greedy` choices [B, T] instead: over several ranks only
        (value, index) pairs then cross them (runtime/ranks.Comm.argmax_pairs).

        `histories[seq]`: sequence seq's tokens so far (with this step's drafts), what engram hashes
        read; `images[seq]`: its prompt's image positions and rows, if any; `capture`: the drafter's,
        run at its layers (`run_layers`; a loaded bundle runs its own compiled capture on every rank)."""
        ...


class DraftRequest(NamedTuple):
    """A sequence to draft for: its id, slot and token group, its committed tokens, how many to draft."""

    seq: int
    slot: int
    tokens: list[int]
    n: int
    group: int = 0


class Drafter(Protocol):
    """What proposes tokens for speculative decoding (`regions/drafting.py`, `regions/speculative.py`)."""

    @property
    def block(self) -> int:
        """Tokens it drafts at most per step (the verify step is block + 1 tokens)."""
        ...

    @property
    def capture(self) -> Capture | None:
        """What the target's steps run for it (None: it reads nothing of the target)."""
        ...

    def draft(self, requests: list[DraftRequest]) -> dict[int, list[int]]:
        """Each request -> its drafted tokens."""
        ...
