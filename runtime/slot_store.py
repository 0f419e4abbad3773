"""A cached prefix's slot state on every rank: prefix caching's save and restore as messages the ranks follow.

On one rank `copy_slot` returns copies of a slot's per-slot pools (the window rings, the compressor's
partial groups, a draft's features ring) by name and `put_slot` copies them back. Over several ranks
every rank's per-slot pools are its own (its heads, its token group's sequences), so the leader sends
each save and load to its followers (`SLOT`, `Executor.follow`), and every rank of that token group
keeps its copy in its own `Executor.slot_states` under one id; the leader's prefix cache keeps only
the id (`SlotRef`). The ids the cache has since evicted (`Steps.forget_slot`) ride on the next such
message, and every rank frees them then: a rank's store holds the states the cache keeps plus at most
those evicted since the last save or load. No tensor crosses ranks: a message is a few integers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

    from deepinfer.runtime.executor import Executor

SLOT = "slot"  # what the leader sends its followers for a slot state's save or load (`Executor.follow`)
SAVE, LOAD = "save", "load"


@dataclass(frozen=True)
class SlotRef:
    """A slot state saved on every rank of a token group, under this id in each one's store."""

    id: int


def copy_slot(x: Executor, slot: int) -> dict[str, Tensor]:
    """A copy of `slot`'s rows of every per-slot pool of this rank, by pool name."""
    return {name: x.pools[name][:, slot].clone() for name, p in x.manifest.kv.pools.items() if p.dim == "slots"}


def slot_bytes(x: Executor) -> int:
    """Bytes of one slot's per-slot state on this rank (what `copy_slot` copies)."""
    return sum(x.pools[name][:, 0].nbytes for name, p in x.manifest.kv.pools.items() if p.dim == "slots")


def put_slot(x: Executor, slot: int, state: dict[str, Tensor]) -> None:
    """Copy what `copy_slot` returned back into `slot`'s rows (of this or another slot)."""
    for name, rows in state.items():
        x.pools[name][:, slot].copy_(rows)


def message(op: str, group: int, slot: int, ref: SlotRef, forgotten: list[int]) -> tuple:
    """What every rank applies (`apply`) for a save or load of `ref` in `group`'s `slot`, with the
    ids to free first."""
    return (SLOT, op, group, slot, ref.id, tuple(forgotten))


def apply(x: Executor, op: str, group: int, slot: int, ref: int, forgotten: tuple[int, ...]) -> None:
    """One rank's part of a slot message: free the `forgotten` copies, then, on the ranks of token
    group `group`, keep a copy of `slot` under `ref` (save) or put the one kept back into `slot` (load)."""
    for i in forgotten:
        x.slot_states.pop(i, None)
    assert x.comm is not None, "slot messages pass between ranks"
    if x.comm.group != group:
        return
    if op == SAVE:
        x.slot_states[ref] = copy_slot(x, slot)
    else:
        put_slot(x, slot, x.slot_states[ref])
