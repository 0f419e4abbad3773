"""A divided prompt chunk's micro-batches (regions/micro.py): the driver's order, its results with the
collectives on another thread, and the split and join of a step's batch. The chunk's tokens with
micro-batches at four ranks are tests/ranks/test_ranks.py's."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import torch

from deepinfer.regions import micro
from deepinfer.regions.step import Batch


def _steps(name: str, log: list[str], n: int):
    """A stand-in for `rows_steps`: computes, needs a collective (doubling its value), n times."""
    value = 1

    def collective(v: int, tag: str) -> int:
        log.append(tag)
        return 2 * v

    for i in range(n):
        log.append(f"{name} computes {i}")
        value = yield collective, (value, f"{name} collective {i}")
    return torch.tensor(value)


def test_the_driver_starts_each_collective_then_computes_the_other_micro_batch():
    log: list[str] = []
    started: list[str] = []

    def start(fn, args):
        started.append(args[1])
        return micro.now(fn, args)

    out = micro.drive([_steps("A", log, 2), _steps("B", log, 3)], start)
    assert [int(t) for t in out] == [4, 8]
    # every segment of A comes before B's same segment; B's collective starts before A's next computation
    assert started == ["A collective 0", "B collective 0", "A collective 1", "B collective 1", "B collective 2"]
    assert log.index("B computes 0") < log.index("A computes 1") < log.index("B computes 1")


def test_collectives_on_another_thread_give_the_same_results():
    wire = ThreadPoolExecutor(1)
    try:
        threaded = micro.drive([_steps("A", [], 3), _steps("B", [], 2)], lambda fn, args: wire.submit(fn, *args))
    finally:
        wire.shutdown()
    direct = micro.drive([_steps("A", [], 3), _steps("B", [], 2)], micro.now)
    assert [int(t) for t in threaded] == [int(t) for t in direct] == [8, 4]


def test_a_failed_collective_raises_in_its_micro_batch():
    def failing(*_):
        raise RuntimeError("the link went down")

    def steps():
        yield failing, ()
        return torch.zeros(1)

    with pytest.raises(RuntimeError, match="the link went down"):
        micro.drive([steps()], micro.now)


def _batch(T: int, real: list[int], heads: list[int] | None) -> Batch:
    B = len(real)
    positions = torch.full((B, T), -1, dtype=torch.int64)
    for b, n in enumerate(real):
        positions[b, :n] = torch.arange(n) + 100
    return Batch(
        tokens=torch.arange(B * T).view(B, T),
        positions=positions,
        slots=torch.arange(1, B + 1),
        block_table=torch.ones(B, 3, dtype=torch.int64),
        hashes=torch.arange(B * T * 2).view(B, T, 1, 2),
        is_image=torch.zeros(B, T, dtype=torch.bool),
        heads=None if heads is None else torch.tensor(heads),
    )


def test_split_takes_consecutive_positions_and_leaves_out_an_all_padding_half():
    batch = _batch(8, [8, 3], [7, 2])
    parts = micro.split(batch, 2)
    assert [cols for _, cols in parts] == [slice(0, 4), slice(4, 8)]
    first, second = parts[0][0], parts[1][0]
    assert torch.equal(first.tokens, batch.tokens[:, :4]) and torch.equal(second.positions, batch.positions[:, 4:])
    assert torch.equal(second.hashes, batch.hashes[:, 4:]) and torch.equal(first.slots, batch.slots)
    assert first.heads.tolist() == [3, 2] and second.heads.tolist() == [3, 0]  # clamped into each half
    short = micro.split(_batch(8, [3, 2], [2, 1]), 2)
    assert [cols for _, cols in short] == [slice(0, 4)]


def test_join_takes_each_sequences_head_row_from_its_micro_batch_and_every_row_in_order():
    batch = _batch(8, [8, 3], [7, 2])
    parts = micro.split(batch, 2)
    heads = micro.join(batch, parts, [torch.full((2, 1, 5), 1.0), torch.full((2, 1, 5), 2.0)])
    assert heads[:, 0, 0].tolist() == [2.0, 1.0]  # sequence 0's last row in the second half, 1's in the first
    every = replace(batch, heads=None)
    rows = micro.join(every, micro.split(every, 2), [torch.full((2, 4, 5), 1.0), torch.full((2, 4, 5), 2.0)])
    assert rows.shape == (2, 8, 5) and rows[:, :4].eq(1).all() and rows[:, 4:].eq(2).all()


# --- the glue of trn2's rows modules (compiler/rows_layers.py) ------------------------------------------


@pytest.mark.parametrize("T,group", [(8, 4), (16, 2), (4096, 64)])
def test_a_ranks_rows_in_micro_order_are_its_rows_of_each_half_and_every_row_once(T, group):
    """`micro_rows`: rank c's rows are its T / (2 * group) rows of each half, the first half's first;
    the ranks' rows together are every row once. Gathered rank by rank, `position_order` puts them
    back in position order; `split_rows` and `join_rows` undo each other."""
    every = [micro.micro_rows(T, group, rank, 2) for rank in range(group)]
    n = T // (2 * group)
    for c, rows in enumerate(every):
        assert rows.tolist() == [*range(c * n, (c + 1) * n), *range(T // 2 + c * n, T // 2 + (c + 1) * n)]
    assert sorted(torch.cat(every).tolist()) == list(range(T))
    x = torch.randn(3, T, 5)
    gathered = torch.cat([x[:, rows] for rows in every], 1)  # an all-gather along the rows
    assert torch.equal(micro.position_order(gathered, group, 2), x)
    mine = x[:, every[1]]
    halves = micro.split_rows(mine, 2)
    assert [h.shape[1] for h in halves] == [n, n]
    assert torch.equal(halves[1], x[:, every[1][n:]]) and torch.equal(micro.join_rows(*halves), mine)
