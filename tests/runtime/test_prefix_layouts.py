"""Prefix caching at every layout (regions/prefix.py, runtime/prefix_gen.py): a divided pool's blocks
cached and evicted by shard, a slot state kept with every k-th block only, evicted states handed back
to the stepper, and a request sent to the token group whose cache holds its prefix."""

from __future__ import annotations

import torch

from deepinfer.regions.prefix import StatePolicy, block_keys, root_key, state_every
from deepinfer.regions.stepper import Allocator
from deepinfer.runtime.prefix_gen import hit_takes
from deepinfer.runtime.requests import Request
from deepinfer.runtime.serving.engine import Engine

from .test_engine import Counting, V
from .test_prefix_cache import SlotCounting, run_alone


def divided_allocator(blocks: int = 4, every: int = 1) -> Allocator:
    a = Allocator(slots=4, blocks=blocks, block_size=2, max_blocks=8, shards=2)  # 3 usable blocks a shard
    a.use_prefix_cache(every)
    return a


def test_state_every_keeps_at_most_the_budget_per_block():
    assert state_every(5 << 20, 1 << 20) == 5 and state_every(int(5.02 * (1 << 20)), 1 << 20) == 6
    assert state_every(1000, 1 << 20) == 1 and state_every(1 << 20, 1 << 20) == 1
    for state in (1, 999, 5 << 20, 7 << 20):
        assert state / state_every(state, 1 << 20) <= 1 << 20


def test_a_divided_pool_caches_a_block_in_its_shard_and_evicts_there():
    a = divided_allocator()
    keys = block_keys(list(range(8)), 2, root_key())  # 4 blocks: shards 0, 1, 0, 1
    a.admit(0)
    a.reserve(0, 8)
    a.cache_blocks(0, keys, "state after 8")
    cache = a.cache
    assert cache is not None
    assert [cache.block_of[k][0] for k in keys] == [0, 1, 0, 1]
    a.release(0)
    assert [cache.unheld_in(s) for s in (0, 1)] == [2, 2] and a.available(0) == a.available(1) == 3
    shared, state = a.match(keys)
    assert state == "state after 8" and shared == [cache.block_of[k][1] for k in keys]
    # a request from the 4 cached blocks needing 6 takes one new block a shard and holds the 4 unheld
    assert hit_takes(a, shared, 6) == [3, 3] and hit_takes(a, shared, 0) == [0, 0]
    a.admit(1)  # another sequence: shard 0 has 1 free block, then evicts shard 0's cached blocks only
    a.reserve(1, 6)  # blocks 0, 2 of shard 0 (one free, one evicted), block 1 of shard 1 (free)
    assert cache.evicted == 1 and cache.unheld_in(1) == 2
    assert a.match(keys) == ([], None)  # the chain's last block (shard 1) is cached, its third is gone
    assert all(key in cache.block_of for key in (keys[0], keys[1], keys[3]))


def test_a_state_is_kept_every_k_blocks_and_a_hit_starts_at_the_last_kept():
    model = SlotCounting(chunk=6, block_size=4, blocks=17, max_blocks=8, slots=4)
    engine = Engine(model, eos=1, max_queue=4, prefix_cache=True, prefix_states=StatePolicy(every=2))
    prompt = [5 + i % 20 for i in range(14)]
    first = run_alone(engine, prompt, 3)
    # chunks of 6 end at the kept boundary (8) where they reach it, else at a block's end
    assert [(s[0][2], len(s[0][1])) for s in model.steps[:4]] == [(0, 4), (4, 4), (8, 4), (12, 2)]
    cache = engine.scheduler.allocs[0].cache
    assert cache is not None and cache.every == 2
    kept = sorted(len(state) for state in cache.states.values())
    assert kept == [8, 16]  # after block 2 (prompt) and block 4 (prompt and generated); never after 1 or 3
    again = run_alone(engine, prompt[:13] + [9, 9], 3)  # shares 3 blocks; the last kept state is after 2
    assert again.cached_tokens == 8
    whole = run_alone(engine, prompt, 3)
    assert whole.cached_tokens == 8 and whole.generated == first.generated


def test_an_evicted_state_is_handed_back_to_the_stepper():
    model = SlotCounting(chunk=4, block_size=4, blocks=5, max_blocks=4, slots=4)  # 4 usable blocks
    engine = Engine(model, eos=1, max_queue=4, prefix_cache=True)
    run_alone(engine, [7] * 9, 2)  # 2 prompt blocks cached, each with its state
    assert model.forgotten == []
    run_alone(engine, [8] * 13, 2)  # needs 4 blocks: evicts the first prompt's two
    assert sorted(map(len, model.forgotten)) == [4, 8]


def test_past_max_states_the_least_recently_used_state_is_dropped_and_its_blocks_stay():
    model = SlotCounting(chunk=8, block_size=4, blocks=33, max_blocks=8, slots=4)
    engine = Engine(model, eos=1, max_queue=4, prefix_cache=True, prefix_states=StatePolicy(max_states=2))
    a, b, c = [5] * 9, [6] * 9, [7] * 9  # each keeps one state: after its first chunk, 8 tokens
    run_alone(engine, a, 1)
    run_alone(engine, b, 1)
    cache = engine.scheduler.allocs[0].cache
    assert cache is not None and len(cache.states) == 2
    assert run_alone(engine, a[:8] + [3], 1).cached_tokens == 8  # a's state used: the most recent now
    run_alone(engine, c, 1)  # a third state: b's, the least recently kept or used, is dropped
    assert len(cache.states) == 2 and len(model.forgotten) == 1
    assert all(key in cache.block_of for key in block_keys(b, 4, root_key()))  # b's blocks stay cached
    assert run_alone(engine, a[:8] + [4], 1).cached_tokens == 8
    assert run_alone(engine, b[:8] + [3], 1).cached_tokens == 0


class TwoGroups(Counting):
    """`Counting` over two token groups, each with its own pool and slots; a slot's state is the
    positions its group's slot was fed (checked as `SlotCounting` checks it)."""

    groups = 2

    def __init__(self, **kw):
        super().__init__(**kw)
        self.fed: dict[tuple[int, int], list[int]] = {}  # (group, slot) -> positions fed so far
        self.rows: list[tuple[int, int, int]] = []  # (group, sequence, first position) of every row run

    def run(self, rows_by_group, allocs, histories, images, capture=None, last_only=False, greedy=False):
        out = []
        for g, rows in enumerate(rows_by_group):
            for seq, ids, start in rows:
                fed = self.fed.setdefault((g, allocs[g].slot_of[seq]), [])
                del fed[start:]
                assert fed == list(range(start)), (g, seq, start, fed)
                fed.extend(range(start, start + len(ids)))
                self.rows.append((g, seq, start))
            out.append(Counting.run(self, [rows], [allocs[g]], histories, images)[0] if rows else torch.zeros(0, 1, V))
        return out

    def save_slot(self, group, slot):
        return group, list(self.fed[(group, slot)])

    def load_slot(self, group, slot, state):
        assert state[0] == group, "a state is loaded in the token group that saved it"
        self.fed[(group, slot)] = list(state[1])

    def forget_slot(self, group, state):
        pass


def test_a_request_goes_to_the_token_group_holding_its_prefix():
    model = TwoGroups(chunk=8, block_size=4, blocks=17, max_blocks=8, slots=4)
    engine = Engine(model, eos=1, max_queue=4, prefix_cache=True)
    other, prefix = [9] * 9, [5 + i for i in range(9)]
    first = [engine.submit(Request(p, 2)) for p in (other, prefix)]  # one a group: the least loaded
    while engine.scheduler.busy:
        engine.step()
    assert {g for g, seq, _ in model.rows if seq == 1} == {1} and all(o.cached_tokens == 0 for o in first)
    model.rows.clear()
    again = run_alone(engine, prefix + [3, 3], 2)  # both groups idle: group 0 unless the hit decides
    assert again.cached_tokens == 8 and model.rows[0] == (1, 2, 8)
    assert again.generated == [4, 5]  # Counting's successors of the prompt's last token
