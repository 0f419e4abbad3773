"""Sequence slots, KV blocks and bucket choice for the runtime.

Each sequence holds one slot (its window rings and compressor partials) and
the blocks its positions need, taken from one fixed pool; slot 0 and block 0
are scratch. Running out of blocks fails that request only: its slot and
blocks are released and the others go on.
"""

from __future__ import annotations

import bisect


class OutOfBlocks(Exception):
    pass


class Allocator:
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
            raise OutOfBlocks(f"needs {positions} positions, more than the bundle's max_context "
                              f"({self.max_blocks * self.block_size})")
        table = self.tables[seq]
        while len(table) < need:
            if not self.free_blocks:
                raise OutOfBlocks(f"KV pool exhausted: no free block for position {len(table) * self.block_size} "
                                  "(raise --num-kv-blocks or run fewer sequences at once)")
            table.append(self.free_blocks.pop())

    def release(self, seq: int) -> None:
        self.free_blocks.extend(reversed(self.tables.pop(seq, [])))
        if seq in self.slot_of:
            self.free_slots.append(self.slot_of.pop(seq))

    def table_row(self, seq: int) -> list[int]:
        t = self.tables[seq]
        return t + [0] * (self.max_blocks - len(t))


def bucket_at_least(options: list[int], n: int) -> int:
    """The smallest compiled size >= n (options sorted); n must not exceed the largest."""
    return options[bisect.bisect_left(options, n)]
