"""Micro-batches of a divided prompt chunk: one's collectives run while the other computes (issue 41).

A prompt chunk divided by rows over a token group (regions/rows.py) spends as much time in its
collectives as in its arithmetic (compiler/prompt_rows.py): the MoE's dispatch and combine, the rows'
gathers. Split along its positions into m consecutive micro-batches (`split`), the chunk runs as m
`regions.step.rows_steps` generators, which yield each collective they need; `drive` runs them in
turn, starting each yielded collective (`start`: the runtime's collective thread,
`runtime.ranks.Comm.start`) and switching to the next micro-batch, whose computation runs while the
collective is on the wire, before it takes the result back. With two micro-batches A (the earlier
positions) and B, a layer's segments run A1 B1 A2 B2 ...: every segment of A comes before B's same
segment, so B's stages of a layer read the state A's stages of that layer wrote (the compressor's
partial groups in `rows_write`, the window ring in `rows_attend`), exactly as two consecutive chunks
do; state A reads that B wrote sooner is only the paged entries of B's later positions, which A's
causal masks never select. Every rank drives the same generators in the same order, so the
collectives start in one order on every rank.

`join` puts the micro-batches' logits back in the chunk's shape.

trn2 runs the micro-batches inside each layer's one module instead (compiler/rows_layers.py), its glue
below: a rank's rows arrive in micro order (`micro_rows`: its rows of the first micro-batch, then of the
second), are split per micro-batch (`split_rows`) and joined after (`join_rows`); the head puts every
rank's gathered rows back in position order (`position_order`).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from deepinfer.regions.step import Batch

# a collective a micro-batch needs: a `regions.step.Rows` method and its arguments
Collective = tuple[Callable[..., Any], tuple]
Steps = Generator[Collective, Any, Tensor]
Start = Callable[[Callable[..., Any], tuple], "Future[Any]"]


def now(fn: Callable[..., Any], args: tuple) -> Future[Any]:
    """`Start` that runs the collective at once, on this thread (one micro-batch: nothing to overlap)."""
    done: Future[Any] = Future()
    try:
        done.set_result(fn(*args))
    except BaseException as e:  # raised where the generator takes the result back
        done.set_exception(e)
    return done


def drive(steps: list[Steps], start: Start) -> list[Tensor]:
    """Run the generators in turn to their ends; each yielded collective is started with `start` and
    its result sent back on the generator's next turn -> each generator's return value, in order."""
    pending: list[Future[Any] | None] = [None] * len(steps)
    results: list[Tensor | None] = [None] * len(steps)
    live = list(range(len(steps)))
    while live:
        for i in list(live):
            got = pending[i]
            try:
                fn, args = steps[i].send(None if got is None else got.result())
            except StopIteration as stop:
                results[i] = stop.value
                live.remove(i)
                continue
            pending[i] = start(fn, args)
    return [r for r in results if r is not None]


def split(batch: Batch, m: int) -> list[tuple[Batch, slice]]:
    """The step's m consecutive micro-batches of T / m positions each, with their columns of the chunk;
    a micro-batch that is padding in every sequence is left out (it would compute nothing)."""
    T = batch.positions.shape[1]
    assert T % m == 0, f"a chunk of {T} positions does not split into {m} micro-batches"
    out = []
    for j in range(m):
        cols = slice(j * T // m, (j + 1) * T // m)
        if not bool((batch.positions[:, cols] >= 0).any()):
            continue
        heads = None if batch.heads is None else (batch.heads - cols.start).clamp(0, cols.stop - cols.start - 1)
        part = replace(
            batch,
            tokens=batch.tokens[:, cols],
            positions=batch.positions[:, cols],
            hashes=None if batch.hashes is None else batch.hashes[:, cols],
            is_image=batch.is_image[:, cols],
            image_rows=None if batch.image_rows is None else batch.image_rows[:, cols],
            heads=heads,
        )
        out.append((part, cols))
    return out


def join(batch: Batch, parts: list[tuple[Batch, slice]], logits: list[Tensor]) -> Tensor:
    """The chunk's logits from its micro-batches': every row's, the micro-batches' concatenated (padding
    columns of a left-out micro-batch are zero), or each sequence's `batch.heads` row taken from the
    micro-batch holding it."""
    if batch.heads is None:
        B, T = batch.positions.shape
        out = logits[0].new_zeros(B, T, logits[0].shape[-1])
        for (_, cols), got in zip(parts, logits):
            out[:, cols] = got
        return out
    out = logits[0].clone()
    for (_, cols), got in zip(parts, logits):
        mine = (batch.heads >= cols.start) & (batch.heads < cols.stop)
        out[mine] = got[mine]
    return out


def micro_rows(T: int, group: int, rank: int, parts: int) -> Tensor:
    """A rank's rows of a T-row chunk run as `parts` micro-batches over a token group of `group` ranks,
    in micro order: its T / (parts * group) rows of each micro-batch, the micro-batches in turn."""
    n, c = T // (parts * group), rank % group
    return torch.cat([j * (T // parts) + c * n + torch.arange(n) for j in range(parts)])


def split_rows(x: Tensor, parts: int) -> tuple[Tensor, ...]:
    """[B, parts * n, ...] -> each micro-batch's [B, n, ...] (a rank's rows in micro order, or a chunk's)."""
    return tuple(p.clone() for p in x.chunk(parts, 1))


def join_rows(*parts: Tensor) -> Tensor:
    """The micro-batches' [B, n, ...] -> [B, parts * n, ...], in micro order."""
    return torch.cat(parts, 1)


def position_order(x: Tensor, ranks: int, parts: int) -> Tensor:
    """Every rank's rows gathered along the rows, each rank's in micro order [B, ranks * parts * n, ...]
    -> the chunk's rows in position order [B, parts * ranks * n, ...]."""
    B, rest = x.shape[0], x.shape[2:]
    n = x.shape[1] // (ranks * parts)
    return x.reshape(B, ranks, parts, n, *rest).transpose(1, 2).reshape(B, ranks * parts * n, *rest)
