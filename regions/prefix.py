"""Prefix caching: full KV blocks keyed by the hash chain of their tokens, shared between sequences.

A sequence's full block j has the key `H(key of block j - 1, its block_size tokens)` (block 0's
parent is the prompt's root: empty for a text prompt, a digest of its image positions and rows
otherwise, since an image's rows, not its placeholder tokens, make its KV). Engram hashes read
only earlier tokens and every other input of a step is the bundle's, so equal keys mean equal
paged state (compressed KV, index keys) in those blocks.

What a block's key does not cover is the per-slot state at its end: the window ring (whose latents
at a position depend, layer by layer, on every earlier token, so re-running the last window of
tokens cannot rebuild it) and the compressor's partial groups. The cache therefore keeps, with the
block that ends a step, a copy of the sequence's per-slot state right after that step
(`Stepper.save_slot`): a hit restores it into the new sequence's slot and prefills from the block
boundary on. Generated tokens are cached too: a block that a decode step fills (the fed tokens,
prompt then generated, continue the key chain: `extend_keys`) is kept with the state after that
step, so a chat's next turn, whose prompt repeats the previous answer, reuses the answer's blocks
(runtime/prefix_gen.py says which steps keep one). Block boundaries are multiples of every
compression ratio (`check_block_size`), so no partial group straddles one, and a sequence writes
only entries of the blocks its own positions fall in: the shared blocks before its boundary are
never written again.

`BlockCache` is the bookkeeping of one pool (`regions.stepper.Allocator` owns one): which block
holds which key, how many sequences hold each cached block, and, least recently released first,
the cached blocks nobody holds, which are evicted when the pool has no free block left.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

KEY_VERSION = b"deepinfer-prefix-1"

# what a stepper's `save_slot` returns and its `load_slot` takes back: copies of a slot's per-slot state by name
SlotState = dict[str, "Tensor"]


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


@dataclass(eq=False)
class BlockCache:
    """Cached blocks of one pool: key <-> block, holders per block, the unheld ones in LRU order."""

    block_of: dict[bytes, int] = field(default_factory=dict)
    key_of: dict[int, bytes] = field(default_factory=dict)
    holders: dict[int, int] = field(default_factory=dict)  # cached block -> sequences holding it
    unheld: OrderedDict[int, None] = field(default_factory=OrderedDict)  # least recently released first
    states: dict[int, SlotState] = field(default_factory=dict)  # block -> slot state at its end
    evicted: int = 0  # blocks evicted so far

    def __len__(self) -> int:
        return len(self.key_of)

    def match(self, keys: Sequence[bytes]) -> tuple[list[int], SlotState | None]:
        """The cached blocks of the longest prefix of `keys` that ends at a block with a saved slot
        state, and that state -> ([], None) on a miss."""
        blocks: list[int] = []
        best: tuple[list[int], SlotState | None] = ([], None)
        for key in keys:
            b = self.block_of.get(key)
            if b is None:
                break
            blocks.append(b)
            if b in self.states:
                best = (list(blocks), self.states[b])
        return best

    def hold(self, block: int) -> None:
        """One more sequence holds cached `block` (it is not evictable while held)."""
        self.holders[block] += 1
        self.unheld.pop(block, None)

    def drop(self, block: int) -> None:
        """A sequence lets go of cached `block`; unheld, it becomes the most recent eviction candidate."""
        self.holders[block] -= 1
        if not self.holders[block]:
            self.unheld[block] = None

    def add(self, key: bytes, block: int) -> bool:
        """Cache `block` (held by the one sequence that wrote it) under `key` -> False when the key
        is cached already (in another block; this one stays the sequence's own)."""
        if key in self.block_of or block in self.key_of:
            return False
        self.block_of[key], self.key_of[block], self.holders[block] = block, key, 1
        return True

    def evict(self) -> int | None:
        """Forget the least recently released unheld block -> its id (now free), or None."""
        if not self.unheld:
            return None
        block, _ = self.unheld.popitem(last=False)
        del self.block_of[self.key_of.pop(block)], self.holders[block]
        self.states.pop(block, None)
        self.evicted += 1
        return block
