"""Prefix caching: full KV blocks keyed by the hash chain of their tokens, shared between sequences.

A sequence's full block j has the key `H(key of block j - 1, its block_size tokens)` (block 0's
parent is the prompt's root: empty for a text prompt, a digest of its image positions and rows
otherwise, since an image's rows, not its placeholder tokens, make its KV). Engram hashes read
only earlier tokens and every other input of a step is the bundle's, so equal keys mean equal
paged state (compressed KV, index keys) in those blocks.

What a block's key does not cover is the per-slot state at its end: the window ring (whose latents
at a position depend, layer by layer, on every earlier token, so re-running the last window of
tokens cannot rebuild it) and the compressor's partial groups. The cache therefore keeps, with a
block that ends a step, a copy of the sequence's per-slot state right after that step
(`Stepper.save_slot`; over several ranks each rank keeps its own, runtime/slot_store.py): a hit
restores it into the new sequence's slot and prefills from the block boundary on. Only every k-th
block of a chain keeps one (`state_every`: at most a budget of bytes per cached block, amortized),
so a hit reaches the last such boundary within its prefix. Generated tokens are cached too: a block that a decode step fills (the fed tokens,
prompt then generated, continue the key chain: `extend_keys`) is kept with the state after that
step, so a chat's next turn, whose prompt repeats the previous answer, reuses the answer's blocks
(runtime/prefix_gen.py says which steps keep one). Block boundaries are multiples of every
compression ratio (`check_block_size`), so no partial group straddles one, and a sequence writes
only entries of the blocks its own positions fall in: the shared blocks before its boundary are
never written again.

`BlockCache` is the bookkeeping of one pool (`regions.stepper.Allocator` owns one): which block
holds which key, how many sequences hold each cached block, and, least recently released first,
the cached blocks nobody holds, which are evicted when the pool (a divided pool: the shard a block
is taken from) has no free block left.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

KEY_VERSION = b"deepinfer-prefix-1"

# what a stepper's `save_slot` returns and its `load_slot` takes back: on one rank, copies of a slot's
# per-slot state by name (dict[str, Tensor]); over several ranks, a handle each rank keeps its own copy under
SlotState = Any


def _part(h, name: bytes, data: bytes) -> None:
    """One named part of a key, its name and length first, so no two part lists hash alike."""
    h.update(struct.pack("<I", len(name)) + name + struct.pack("<Q", len(data)) + data)


def root_key(image: tuple[bytes, bytes] | None = None) -> bytes:
    """The parent of a prompt's first block: the key format's version and, for a prompt with images,
    its image mask and rows (as bytes)."""
    h = hashlib.blake2b(digest_size=16)
    _part(h, b"version", KEY_VERSION)
    if image is not None:
        _part(h, b"image_mask", image[0])
        _part(h, b"image_rows", image[1])
    return h.digest()


def block_keys(tokens: Sequence[int], block_size: int, root: bytes) -> list[bytes]:
    """The keys of every full block of `tokens` (a block of `block_size` tokens, from position 0)."""
    keys: list[bytes] = []
    extend_keys(keys, tokens, block_size, root)
    return keys


def extend_keys(keys: list[bytes], tokens: Sequence[int], block_size: int, root: bytes) -> None:
    """Append to `keys`, the keys of the first len(keys) full blocks of `tokens`, those of its
    further full blocks: the chain goes on from its last key (from `root` when empty), so a
    sequence's keys grow with its generated tokens as `block_keys` of all its tokens would."""
    parent = keys[-1] if keys else root
    for j in range(len(keys), len(tokens) // block_size):
        h = hashlib.blake2b(digest_size=16)
        _part(h, b"parent", parent)
        _part(h, b"tokens", struct.pack(f"<{block_size}q", *tokens[j * block_size : (j + 1) * block_size]))
        parent = h.digest()
        keys.append(parent)


PREFIX_STATE_BUDGET = 1 << 20  # bytes of kept slot state per cached block, amortized (`state_every`)


def state_every(state_bytes: int, budget_bytes: int) -> int:
    """Blocks per kept slot state: a copy of `state_bytes` (one slot's per-slot state on one rank) kept
    with every k-th cached block keeps at most `budget_bytes` per cached block, amortized. Re-running
    a shorter tail cannot stand in for a kept state (the window ring's receptive field grows by a
    window per layer: module doc), so the cut is the cost of a hit that reaches only the last kept
    boundary before its prefix's end: at most k - 1 blocks prefilled again."""
    return max(1, -(-state_bytes // max(1, budget_bytes)))


Node = tuple[int, int]  # a cached block: (shard, block id in that shard's pool)


class StatePolicy(NamedTuple):
    """Which slot states a prefix cache keeps: one with every `every`-th block of a chain
    (`state_every`), at most `max_states` of them (None: no bound)."""

    every: int = 1
    max_states: int | None = None


EVERY_STATE = StatePolicy()  # a state with every block, unbounded: the default where nothing is said


@dataclass(eq=False)
class BlockCache:
    """Cached blocks of one pool: key <-> block, holders per block, the unheld ones in LRU order.

    A divided pool (`shards` > 1, one per cp rank) caches each block as (shard, block): a sequence's
    block j lives in shard j % shards, so a key, which names its block's place in the chain, always
    maps to the same shard. A slot state is kept with every `every`-th block of a chain only
    (`state_every`), and at most `max_states` of them (None: no bound), the least recently kept or
    used dropped first (its blocks stay cached; a hit then reaches an earlier kept state, or
    misses); `forget` is told of each kept state that is dropped (a bundle's ranks then free their
    copies)."""

    shards: int = 1
    every: int = 1
    forget: Callable[[SlotState], None] | None = None
    max_states: int | None = None
    block_of: dict[bytes, Node] = field(default_factory=dict)
    key_of: dict[Node, bytes] = field(default_factory=dict)
    holders: dict[Node, int] = field(default_factory=dict)  # cached block -> sequences holding it
    unheld: list[OrderedDict[Node, None]] = field(default_factory=list)  # per shard, least recently released first
    states: OrderedDict[Node, SlotState] = field(default_factory=OrderedDict)  # block -> state at its end, LRU first
    evicted: int = 0  # blocks evicted so far

    def __post_init__(self) -> None:
        self.unheld = [OrderedDict() for _ in range(self.shards)]

    def __len__(self) -> int:
        return len(self.key_of)

    def unheld_in(self, shard: int) -> int:
        """Cached blocks of `shard` no sequence holds (evictable)."""
        return len(self.unheld[shard])

    def match(self, keys: Sequence[bytes]) -> tuple[list[int], SlotState | None]:
        """The cached blocks of the longest prefix of `keys` that ends at a block with a saved slot
        state, and that state -> ([], None) on a miss."""
        blocks: list[int] = []
        best: tuple[list[int], SlotState | None] = ([], None)
        for key in keys:
            node = self.block_of.get(key)
            if node is None:
                break
            blocks.append(node[1])
            if node in self.states:
                best = (list(blocks), self.states[node])
                self.states.move_to_end(node)  # recently used: the last a bound drops
        return best

    def keep(self, node: Node, state: SlotState) -> None:
        """Keep `state` with cached `node` (unless it has one), dropping the least recently kept or
        used states beyond `max_states`."""
        if node in self.states:
            return
        self.states[node] = state
        while self.max_states is not None and len(self.states) > self.max_states:
            _, dropped = self.states.popitem(last=False)
            if self.forget is not None:
                self.forget(dropped)

    def hold(self, node: Node) -> None:
        """One more sequence holds cached `node` (it is not evictable while held)."""
        self.holders[node] += 1
        self.unheld[node[0]].pop(node, None)

    def drop(self, node: Node) -> None:
        """A sequence lets go of cached `node`; unheld, it becomes the most recent eviction candidate."""
        self.holders[node] -= 1
        if not self.holders[node]:
            self.unheld[node[0]][node] = None

    def add(self, key: bytes, node: Node) -> bool:
        """Cache `node` (held by the one sequence that wrote it) under `key` -> False when the key
        is cached already (in another block; this one stays the sequence's own)."""
        if key in self.block_of or node in self.key_of:
            return False
        self.block_of[key], self.key_of[node], self.holders[node] = node, key, 1
        return True

    def keeps_state(self, blocks: int) -> bool:
        """Whether the block that ends a chain's first `blocks` blocks is one a slot state is kept with."""
        return blocks % self.every == 0

    def evict(self, shard: int = 0) -> int | None:
        """Forget the least recently released unheld block of `shard` -> its id (now free), or None."""
        if not self.unheld[shard]:
            return None
        node, _ = self.unheld[shard].popitem(last=False)
        del self.block_of[self.key_of.pop(node)], self.holders[node]
        state = self.states.pop(node, None)
        if state is not None and self.forget is not None:
            self.forget(state)
        self.evicted += 1
        return node[1]
