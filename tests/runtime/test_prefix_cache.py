"""Prefix caching (regions/prefix.py): the block-hash, hold-count and LRU bookkeeping of the allocator;
the scheduler over a counting model; and a compiled bundle through the engine, whose greedy outputs
with the cache must equal its outputs without it, token for token (each prompt alone, no cache)."""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer.regions.prefix import block_keys, extend_keys, root_key
from deepinfer.regions.stepper import Allocator, OutOfBlocks
from deepinfer.runtime.requests import Completion, Request
from deepinfer.runtime.serving.engine import Engine

from .test_engine import Counting

# --- keys -------------------------------------------------------------------------------------------


def test_block_keys_chain_their_parents_and_cover_full_blocks_only():
    a = block_keys([5, 6, 7, 8, 9], 2, root_key())
    assert len(a) == 2  # the fifth token fills no block
    assert block_keys([5, 6, 7, 8], 2, root_key()) == a
    b = block_keys([4, 6, 7, 8], 2, root_key())
    assert b[0] != a[0] and b[1] != a[1]  # a block's key depends on every token before it
    assert block_keys([5, 6, 7, 9], 2, root_key())[0] == a[0]
    image = root_key((b"\x01\x00", b"rows"))
    assert block_keys([5, 6], 2, image) != block_keys([5, 6], 2, root_key())
    assert block_keys([5, 6], 2, image) != block_keys([5, 6], 2, root_key((b"\x01\x00", b"other")))


def test_extended_keys_of_prompt_then_generated_tokens_are_the_block_keys_of_both():
    rng = random.Random(5)
    prompt, generated = [rng.randrange(3, 250) for _ in range(11)], [rng.randrange(3, 250) for _ in range(14)]
    for root in (root_key(), root_key((b"\x01", b"rows"))):
        keys = block_keys(prompt, 4, root)  # 2 full blocks, the third ends among the generated tokens
        for n in range(len(generated) + 1):  # one decode step at a time
            extend_keys(keys, prompt + generated[:n], 4, root)
            assert keys == block_keys(prompt + generated[:n], 4, root)
        assert len(keys) == 6
        empty: list[bytes] = []  # a prompt shorter than a block: the chain starts at the root
        extend_keys(empty, prompt[:3] + generated[:5], 4, root)
        assert empty == block_keys(prompt[:3] + generated[:5], 4, root)


# --- the allocator ------------------------------------------------------------------------------------


def cached_allocator(blocks: int = 6, block_size: int = 2) -> Allocator:
    a = Allocator(slots=4, blocks=blocks, block_size=block_size, max_blocks=8)
    a.use_prefix_cache()
    return a


def test_cached_blocks_are_shared_held_and_released_to_the_lru():
    a = cached_allocator()  # 5 usable blocks
    keys = block_keys([1, 2, 3, 4, 5, 6], 2, root_key())
    a.admit(0)
    a.reserve(0, 6)
    a.cache_blocks(0, keys[:2], "state after 4")
    assert a.match(keys) == (a.tables[0][:2], "state after 4")
    a.cache_blocks(0, keys, "state after 6")
    assert a.match(keys) == (a.tables[0], "state after 6")
    assert a.match(keys[:2]) == (a.tables[0][:2], "state after 4")
    assert a.match(block_keys([9, 9], 2, root_key())) == ([], None)
    shared, _ = a.match(keys[:2])
    a.admit(1, shared)
    a.reserve(1, 5)
    assert a.tables[1][:2] == a.tables[0][:2] and a.blocks_in_use() == 4
    assert a.available() == 1  # 5 usable: 3 of seq 0 (2 shared), 1 of seq 1's own
    a.release(0)
    assert a.cache is not None
    assert list(a.cache.unheld[0]) == [a.cache.block_of[keys[2]]]  # seq 1 still holds the first two
    a.release(1)
    assert len(a.cache) == 3 and a.available() == 5


def test_eviction_takes_the_least_recently_released_unheld_block_never_a_held_one():
    a = cached_allocator(blocks=5)  # 4 usable
    k1 = block_keys([1, 1, 1, 1], 2, root_key())
    k2 = block_keys([2, 2, 2, 2], 2, root_key())
    for seq, keys in ((0, k1), (1, k2)):
        a.admit(seq)
        a.reserve(seq, 4)
        a.cache_blocks(seq, keys, f"state {seq}")
    a.release(0)  # k1's blocks unheld (its last block first), k2's held by seq 1
    a.admit(2)
    a.reserve(2, 2)  # no free block: evicts k1's last block (released first), never seq 1's
    assert a.cache is not None and a.cache.evicted == 1
    assert a.match(k1) == ([], None)  # its first block is cached still, but without a slot state
    assert k1[0] in a.cache.block_of and k1[1] not in a.cache.block_of
    assert a.match(k2) == (a.tables[1], "state 1")
    a.reserve(2, 4)  # then k1's first block
    assert a.cache.evicted == 2 and a.match(k1) == ([], None)
    with pytest.raises(OutOfBlocks, match="KV pool exhausted"):
        a.reserve(2, 6)  # seq 1's blocks are held: never evicted
    assert a.match(k2) == (a.tables[1], "state 1")


def test_a_key_cached_by_another_sequence_keeps_the_first_block():
    a = cached_allocator()
    keys = block_keys([3, 3, 4, 4], 2, root_key())
    for seq in (0, 1):  # two sequences prefilled the same prompt at once
        a.admit(seq)
        a.reserve(seq, 4)
        a.cache_blocks(seq, keys, f"state {seq}")
    assert a.match(keys) == (a.tables[0], "state 0")
    a.release(1)  # its duplicates were never cached: free again
    assert a.available() == 3 and len(a.cache or ()) == 2


# --- the scheduler over a counting model ----------------------------------------------------------------


class SlotCounting(Counting):
    """`Counting` with slot states: a dict per slot of the positions fed (what a window ring holds)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.fed: dict[int, list[int]] = {}  # slot -> positions fed so far
        self.forgotten: list[list[int]] = []  # states the cache evicted, in order

    def run(self, rows_by_group, allocs, histories, images, capture=None, last_only=False, greedy=False):
        for seq, ids, start in rows_by_group[0]:
            slot = allocs[0].slot_of[seq]
            if start == 0:
                self.fed[slot] = []
            fed = self.fed[slot]
            assert fed == list(range(start)), (seq, start, fed)  # the slot's state is this sequence's
            fed.extend(range(start, start + len(ids)))
        return super().run(rows_by_group, allocs, histories, images, capture, last_only)

    def save_slot(self, group, slot):
        return list(self.fed[slot])

    def load_slot(self, group, slot, state):
        self.fed[slot] = list(state)

    def forget_slot(self, group, state):
        self.forgotten.append(state)


def run_alone(engine: Engine, prompt: list[int], max_tokens: int, limit: int = 200) -> Completion:
    out = engine.submit(Request(prompt, max_tokens))
    for _ in range(limit):
        if not engine.scheduler.busy:
            return out
        engine.step()
    raise AssertionError("the engine did not finish")


def metric(engine: Engine, name: str) -> float:
    value = engine.metrics.registry.get_sample_value(name)
    assert value is not None, name
    return value


def test_scheduler_starts_a_hit_at_the_cached_boundary_and_chunks_end_at_block_boundaries():
    model = SlotCounting(chunk=6, block_size=4, blocks=17, max_blocks=8, slots=4)
    engine = Engine(model, eos=1, max_queue=4, prefix_cache=True)
    prompt = [5 + i % 20 for i in range(14)]
    first = run_alone(engine, prompt, 3)
    # chunks of 6 cut at the blocks' ends: 0-4, 4-8, 8-12 (the state kept at each), then 12-14
    assert [(s[0][2], len(s[0][1])) for s in model.steps[:4]] == [(0, 4), (4, 4), (8, 4), (12, 2)]
    assert first.cached_tokens == 0
    model.steps.clear()
    again = run_alone(engine, prompt[:10] + [7, 7, 7], 3)
    assert again.cached_tokens == 8 and model.steps[0][0][2] == 8  # 8 of the 10 shared: two blocks
    whole = run_alone(engine, prompt, 3)
    assert whole.cached_tokens == 12 and whole.generated == first.generated  # the last token is fed again
    assert metric(engine, "deepinfer_prefix_cache_hit_tokens_total") == 20


def test_generated_blocks_are_cached_and_a_next_turn_starts_past_the_answer():
    """A's 6 prompt and 9 fed generated tokens fill 3 blocks of 4 (its 10th token is never fed); B,
    A's prompt and answer then 2 more, starts from the 3 blocks, in the slot state after A's step
    that filled the third (SlotCounting asserts a slot's state is its sequence's)."""
    model = SlotCounting(chunk=6, block_size=4, blocks=17, max_blocks=8, slots=4)
    engine = Engine(model, eos=1, max_queue=4, prefix_cache=True)
    prompt = [5 + i for i in range(6)]
    first = run_alone(engine, prompt, 10)
    assert first.generated == list(range(11, 21))
    cache = engine.scheduler.allocs[0].cache
    assert cache is not None and len(cache) == 3 and len(cache.states) == 3  # one state a block boundary
    model.steps.clear()
    turn = prompt + first.generated + [3, 3]
    second = run_alone(engine, turn, 4)
    shared = len(prompt) + len(first.generated)  # 16: the last generated token was never fed
    assert second.cached_tokens == (shared - 1) // 4 * 4 == 12 and model.steps[0][0][2] == 12
    assert second.generated == [4, 5, 6, 7]


class RingCounting(SlotCounting):
    """`SlotCounting` with room for a verify step (`slack`): what a rejected draft fed stays in the
    slot's state past the committed end, as a bundle's rings keep it, until a step from there on."""

    slack = 3

    def run(self, rows_by_group, allocs, histories, images, capture=None, last_only=False, greedy=False):
        for seq, _, start in rows_by_group[0]:
            del self.fed.setdefault(allocs[0].slot_of[seq], [])[start:]
        return super().run(rows_by_group, allocs, histories, images, capture, last_only)


class Guessing:
    """A drafter over `Counting`: each token's successor, the last draft wrong on every other call."""

    block, capture = 3, None

    def __init__(self):
        self.calls = 0

    def draft(self, requests):
        self.calls += 1
        out = {}
        for q in requests:
            d = [(q.tokens[-1] + 1 + i) % 32 for i in range(q.n)]
            if self.calls % 2 and d:
                d[-1] = 3  # never Counting's choice here
            out[q.seq] = d
        return out


def test_verify_steps_keep_a_state_only_where_every_draft_was_accepted():
    """A speculative sequence's blocks are all cached, and each state kept is the slot's right at
    its block's end: never one after a verify step that rejected a draft (its state holds the
    rejected positions too). A next turn starts from the last block with a state."""
    model = RingCounting(chunk=6, block_size=4, blocks=17, max_blocks=8, slots=4)
    engine = Engine(model, eos=1, max_queue=4, prefix_cache=True, drafter=Guessing())
    prompt = [5 + i for i in range(6)]
    first = run_alone(engine, prompt, 16)
    assert first.generated == list(range(11, 27))
    s = engine.scheduler.speculation
    assert s.verify_steps > 0 and 0 < s.accepted < s.drafted  # some drafts were rejected
    cache = engine.scheduler.allocs[0].cache
    assert cache is not None
    keys = block_keys(first.tokens[:-1], 4, root_key())  # the last token was never fed
    assert len(keys) == 5 and all(k in cache.block_of for k in keys)
    states = {j: cache.states[cache.block_of[k]] for j, k in enumerate(keys) if cache.block_of[k] in cache.states}
    assert all(state == list(range(4 * (j + 1))) for j, state in states.items()), states
    assert max(states) >= 2  # a generated block's state
    second = run_alone(engine, first.tokens + [3, 3], 2)
    assert second.cached_tokens == 4 * (max(states) + 1)


# --- a compiled bundle through the engine ---------------------------------------------------------------

NEW = 8


def prompts_sharing(rng: random.Random, base: list[int], shared: int, length: int) -> list[int]:
    return base[:shared] + [rng.randrange(3, 250) for _ in range(length - shared)]


@pytest.fixture(scope="module")
def executor(run_exported_bundle):
    """The exported bundle: blocks of 16, prompt chunks of 8, window 8, context 80, 20 usable blocks."""
    from deepinfer.runtime import load

    return load(run_exported_bundle)


def engine_of(executor, prefix_cache: bool) -> Engine:
    from deepinfer.runtime.executor import Stats

    steps = executor.steps(Stats())
    return Engine(steps, eos=executor.config.eos_token_id, max_queue=16, prefix_cache=prefix_cache)


def alone_without_cache(executor, prompts: list[list[int]]) -> list[list[int]]:
    engine = engine_of(executor, prefix_cache=False)
    with torch.inference_mode():
        return [run_alone(engine, p, NEW).generated for p in prompts]


@pytest.fixture(scope="module")
def workload(executor):
    """A 45-token prompt, prompts sharing 20 (a prefix ending mid-block: 16 reused) and 36 of its
    tokens (more than the window of 8: 32 reused) and all 45 (32 reused: one token must be fed),
    with each one's greedy tokens run alone without the cache."""
    rng = random.Random(7)
    base = [rng.randrange(3, 250) for _ in range(45)]
    prompts = [base, prompts_sharing(rng, base, 20, 30), prompts_sharing(rng, base, 36, 44), list(base)]
    return prompts, alone_without_cache(executor, prompts)


def test_cache_hits_give_the_tokens_of_uncached_runs(executor, workload):
    prompts, expected = workload
    engine = engine_of(executor, prefix_cache=True)
    with torch.inference_mode():
        outs = [run_alone(engine, p, NEW) for p in prompts]
    assert [o.cached_tokens for o in outs] == [0, 16, 32, 32]
    assert [o.generated for o in outs] == expected
    assert metric(engine, "deepinfer_prefix_cache_hit_tokens_total") == 80
    assert metric(engine, "deepinfer_prefix_cache_blocks") >= 2


def test_concurrent_requests_share_the_cached_blocks(executor, workload):
    prompts, expected = workload
    engine = engine_of(executor, prefix_cache=True)
    with torch.inference_mode():
        run_alone(engine, prompts[0], NEW)  # warms the cache
        outs = [engine.submit(Request(p, NEW)) for p in prompts[1:]]
        engine.step()  # admits all three, each holding the shared first block
        a = engine.scheduler.allocs[0]
        assert a.cache is not None and max(a.cache.holders.values()) == 3
        assert a.blocks_in_use() < sum(len(t) for t in a.tables.values())
        for _ in range(200):
            if not engine.scheduler.busy:
                break
            engine.step()
    assert [o.cached_tokens for o in outs] == [16, 32, 32]
    assert [o.generated for o in outs] == expected[1:]


def test_a_short_pool_evicts_unheld_blocks_and_never_a_held_one(run_exported_bundle, workload):
    from deepinfer.runtime import load

    prompts, expected = workload
    rng = random.Random(11)
    other = [rng.randrange(3, 250) for _ in range(33)]  # 33 + 8 - 1 positions: 3 blocks, 2 cached
    small = [rng.randrange(3, 250) for _ in range(20)]  # 2 blocks
    executor = load(run_exported_bundle, num_kv_blocks=7)  # 6 usable blocks
    other_out, small_out = alone_without_cache(executor, [other, small])
    engine = engine_of(executor, prefix_cache=True)
    a = engine.scheduler.allocs[0]
    with torch.inference_mode():
        # caches 3 of its 4 blocks: its 2 full prompt blocks, and the third (positions 32-47) its decode filled
        run_alone(engine, prompts[0], NEW)
        run_alone(engine, other, NEW)  # and 2 more: 5 cached, none held, 1 free
        held_keys = block_keys(prompts[0], 16, root_key())[:2]
        assert a.cache is not None and len(a.cache) == 5 and a.cache.evicted == 0
        # holds the first prompt's 2 blocks (its 45 tokens reach 2 keys), takes the free one, then evicts
        # the least recently released: the first prompt's third block, then `other`'s, as `late` needs 2
        hit = engine.submit(Request(prompts[3], NEW))
        late = engine.submit(Request(small, NEW))
        for _ in range(200):
            if not engine.scheduler.busy:
                break
            engine.step()
            if hit.finish_reason is None:  # the blocks it holds stay cached while it runs
                assert all(k in a.cache.block_of for k in held_keys)
        assert a.cache.evicted == 3 and all(k in a.cache.block_of for k in held_keys)
        again = run_alone(engine, other, NEW)  # its blocks were evicted: a miss, the same tokens
    assert (hit.cached_tokens, late.cached_tokens, again.cached_tokens) == (32, 0, 0)
    assert [hit.generated, late.generated, again.generated] == [expected[3], small_out, other_out]
    assert metric(engine, "deepinfer_prefix_cache_evicted_blocks_total") >= 3


def test_a_next_turn_reuses_the_answers_blocks_and_its_tokens_are_the_uncached_ones(executor):
    """A: a 20-token prompt and 45 greedy tokens (64 fed: blocks 2 and 3 hold only generated ones,
    block 1 both). B: A's prompt and answer, then 5 tokens: its first 64 positions come from the
    cache (the answer's last token was never fed, so its block is not full), its tokens are those
    of B run without the cache."""
    rng = random.Random(13)
    prompt = [rng.randrange(3, 250) for _ in range(20)]
    engine = engine_of(executor, prefix_cache=True)
    with torch.inference_mode():
        first = run_alone(engine, prompt, 45)
        assert first.finish_reason == "length" and len(first.generated) == 45
        shared = prompt + first.generated
        turn = shared + [rng.randrange(3, 250) for _ in range(5)]
        second = run_alone(engine, turn, NEW)
        (expected,) = alone_without_cache(executor, [turn])
    assert first.cached_tokens == 0
    assert second.cached_tokens == (len(shared) - 1) // 16 * 16 == 64
    assert second.generated == expected


# --- deepinfer-serve --------------------------------------------------------------------------------------


def test_the_server_reports_cached_tokens_and_no_prefix_cache_turns_it_off(aoti_bundle):
    """A real server (the openai client): a prompt, one sharing 36 of its 40 tokens, the first again,
    then a chat's two turns: another 40-token prompt answered with 25 tokens (64 positions fed:
    blocks 2 and 3 are the answer's), and a next turn that repeats prompt and answer and adds 3
    tokens. The cached server's texts are the uncached one's; it reports the first prompt's two
    blocks reused, then the opening's four, the answer's two among them.

    The turns are token prompts to /v1/completions, not /v1/chat/completions: the tiny model's
    byte-level tokenizer does not give a random model's answer back (ids outside its 256 bytes
    decode to nothing, invalid UTF-8 to U+FFFD), so a chat's next turn would not repeat the answer's
    tokens. The answer's tokens are those of the same bundle run in-process without the cache; the
    server's answer must be the same, or the next turn would hit the prompt's blocks only."""
    from deepinfer.runtime import load

    from .test_serve import MODEL, Server

    rng = random.Random(3)
    base = [rng.randrange(3, 250) for _ in range(40)]
    near = base[:36] + [rng.randrange(3, 250) for _ in range(4)]
    chat = random.Random(21)  # an opening whose greedy answer runs 25 tokens without an eos
    opening = [chat.randrange(3, 250) for _ in range(40)]
    with torch.inference_mode():
        answer = run_alone(engine_of(load(aoti_bundle), prefix_cache=False), opening, 25)
    assert answer.finish_reason == "length"
    turn = opening + answer.generated + [chat.randrange(3, 250) for _ in range(3)]
    asks = [(base, 6), (near, 6), (base, 6), (opening, 25), (turn, 6)]
    seen = {}
    for flags in ((), ("--no-prefix-cache",)):
        server = Server(aoti_bundle, *flags)
        try:
            client = server.client()
            got = [client.completions.create(model=MODEL, prompt=p, max_tokens=n, temperature=0) for p, n in asks]
            details = [r.usage.prompt_tokens_details if r.usage else None for r in got]
            seen[flags] = (
                [r.choices[0].text for r in got],
                [d.cached_tokens if d is not None else None for d in details],
                server.metric("deepinfer_prefix_cache_hit_tokens_total"),
            )
        finally:
            assert server.stop() == 0, server.proc.stderr.read()
    (texts, cached, hits), (plain_texts, plain_cached, plain_hits) = seen[()], seen[("--no-prefix-cache",)]
    assert cached == [0, 32, 32, 0, (len(opening) + 25 - 1) // 16 * 16] == [0, 32, 32, 0, 64] and hits == 128
    assert plain_cached == [0] * 5 and plain_hits == 0
    assert texts == plain_texts
