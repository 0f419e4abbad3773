"""The continuous-batching engine (runtime/serving/engine.py) over a counting model whose outputs are known:
the next token is always the last one plus one (mod the vocabulary), so what each request must
generate, and what each step must hold, follow from the schedule alone."""

from __future__ import annotations

import threading

import pytest
import torch

from deepinfer.regions.stepper import Allocator
from deepinfer.runtime.requests import Request
from deepinfer.runtime.sampling import Sampling, sample
from deepinfer.runtime.serving.engine import Engine, QueueFull, RequestError

V, EOS = 32, 1


class Counting:
    """A Stepper: logits put the largest value on (token + 1) % V at every position; records each step's rows."""

    groups = 1

    def __init__(
        self,
        *,
        max_batch: int = 2,
        chunk: int = 4,
        slots: int = 4,
        blocks: int = 9,
        block_size: int = 4,
        max_blocks: int = 8,
    ):
        self.max_batch, self.chunk = max_batch, chunk
        self.geometry = (slots, blocks, block_size, max_blocks)
        self.steps: list[list[tuple[int, list[int], int]]] = []

    def allocator(self) -> Allocator:
        return Allocator(*self.geometry)

    def run(self, rows_by_group, allocs, histories, images, capture=None, last_only=False, greedy=False):
        (rows,) = rows_by_group
        self.steps.append([(seq, list(ids), start) for seq, ids, start in rows])
        for seq, ids, start in rows:  # the engine reserved the blocks of every position it sends
            assert len(allocs[0].tables[seq]) * allocs[0].block_size >= start + len(ids)
            assert histories[seq][start : start + len(ids)] == ids
        T = max(len(ids) for _, ids, _ in rows)
        logits = torch.zeros(len(rows), T, V)
        for b, (_, ids, _) in enumerate(rows):
            for t, tok in enumerate(ids):
                logits[b, t, (tok + 1) % V] = 10.0
        return [logits]


def request(prompt, max_tokens, log, sampling=Sampling()):
    """A Request whose tokens and finish go to `log` ({"tokens": [...], "finish": (reason, error)})."""
    log.setdefault("tokens", [])
    return Request(
        list(prompt),
        max_tokens,
        lambda t: log["tokens"].append(t) or False,
        lambda reason, error: log.__setitem__("finish", (reason, error)),
        sampling,
    )


def drain(engine: Engine, limit: int = 200) -> None:
    for _ in range(limit):
        if not engine.scheduler.busy:
            return
        engine.step()
    raise AssertionError("the engine did not finish its requests")


def free(engine: Engine) -> tuple[int, int]:
    a = engine.scheduler.allocs[0]
    return len(a.free_slots), len(a.free_blocks)


def test_tokens_finish_reasons_and_eos():
    engine = Engine(Counting(), eos=EOS, max_queue=8)
    idle = free(engine)
    a, b = {}, {}
    engine.submit(request([5, 6, 7], 3, a))
    engine.submit(request([V - 2], 5, b))  # 31, 0, then eos (1)
    drain(engine)
    assert a == {"tokens": [8, 9, 10], "finish": ("length", None)}
    assert b == {"tokens": [V - 1, 0, EOS], "finish": ("stop", None)}
    assert free(engine) == idle  # every slot and block back


def test_requests_join_at_step_boundaries_and_prefill_interleaves_with_decodes():
    stepper = Counting(chunk=4)
    engine = Engine(stepper, eos=EOS, max_queue=8)
    a, b = {}, {}
    engine.submit(request([2] * 3, 4, a))
    engine.step()  # a's prompt in one chunk, first token sampled
    engine.submit(request(list(range(10, 20)), 2, b))
    engine.step()
    engine.step()
    seq_a, seq_b = 0, 1
    assert stepper.steps[0] == [(seq_a, [2, 2, 2], 0)]
    # b joins at the next boundary: its first prompt chunk runs beside a's decode token
    assert stepper.steps[1] == [(seq_a, [3], 3), (seq_b, list(range(10, 14)), 0)]
    assert stepper.steps[2] == [(seq_a, [4], 4), (seq_b, list(range(14, 18)), 4)]
    drain(engine)
    assert a["tokens"] == [3, 4, 5, 6] and b["tokens"] == [20, 21]


def test_batch_limit_and_blocks_make_requests_wait_not_fail():
    # 3 usable blocks of 4 positions: a needs 2 (4 + 4 - 1 positions), b needs 2, c needs 1
    stepper = Counting(max_batch=2, blocks=4)
    engine = Engine(stepper, eos=EOS, max_queue=8)
    logs = [{}, {}, {}]
    engine.submit(request([4] * 4, 4, logs[0]))
    engine.submit(request([8] * 4, 4, logs[1]))
    engine.submit(request([12], 2, logs[2]))
    engine.step()
    assert [seq for seq, _, _ in stepper.steps[0]] == [0]  # b waits for blocks, c behind it (FIFO)
    assert engine.metrics.queue_depth._value.get() == 2
    drain(engine)
    assert [log["finish"] for log in logs] == [("length", None)] * 3
    assert logs[1]["tokens"] == [9, 10, 11, 12]
    assert all(len(rows) <= 2 for rows in stepper.steps)
    assert free(engine) == (3, 3)


def test_cancel_frees_the_slot_and_blocks_at_the_next_step():
    engine = Engine(Counting(), eos=EOS, max_queue=8)
    idle = free(engine)
    log = {}
    r = request([3] * 5, 20, log)
    engine.submit(r)
    engine.step()
    engine.step()
    assert free(engine) != idle
    engine.cancel(r)
    engine.step()
    assert log["finish"] == ("cancelled", None) and len(log["tokens"]) == 1
    assert free(engine) == idle and not engine.scheduler.running
    log = {}
    waiting = request([3], 2, log)  # cancelled before it ran: never admitted
    engine.submit(waiting)
    engine.cancel(waiting)
    engine.step()
    assert log["finish"] == ("cancelled", None) and free(engine) == idle


def test_queue_bound_and_requests_that_can_never_fit():
    engine = Engine(Counting(max_blocks=4), eos=EOS, max_queue=2)
    for _ in range(4):  # 2 for the batch's free rows, 2 for the queue
        engine.submit(request([2], 2, {}))
    with pytest.raises(QueueFull, match="4 requests are waiting already .--max-queue 2, 2 free rows"):
        engine.submit(request([2], 2, {}))
    engine.step()  # 2 admitted: now the queue alone counts
    with pytest.raises(QueueFull, match="2 requests are waiting already .--max-queue 2, 0 free rows"):
        engine.submit(request([2], 2, {}))
    with pytest.raises(RequestError, match="maximum context length is 16 tokens; the request needs 17"):
        engine.check(10, 8)
    engine.check(10, 7)
    with pytest.raises(RequestError, match="max_tokens is -1"):
        engine.check(3, -1)
    engine.check(16, 0)  # the prompt only: its 16 positions
    with pytest.raises(RequestError, match="length is 16 tokens; the prompt has 17") as e:
        engine.check(17, 1)
    assert (e.value.param, e.value.code) == ("prompt", "context_length_exceeded")
    small = Engine(Counting(blocks=3), eos=EOS, max_queue=2)  # 2 usable blocks of 4
    with pytest.raises(RequestError, match="needs 3 KV blocks"):
        small.check(8, 2)
    with pytest.raises(RequestError, match="without room for a sequence"):
        Engine(Counting(slots=1), eos=EOS, max_queue=2).check(1, 1)


def test_run_on_its_own_thread_and_close():
    engine = Engine(Counting(), eos=EOS, max_queue=8)
    done = threading.Event()
    log = {}
    r = Request(
        [5],
        3,
        lambda t: log.setdefault("tokens", []).append(t) or False,
        lambda reason, error: (log.__setitem__("finish", reason), done.set()),
    )
    thread = threading.Thread(target=engine.run)
    thread.start()
    try:
        engine.submit(r)
        assert done.wait(timeout=30)
        assert log == {"tokens": [6, 7, 8], "finish": "length"}
    finally:
        engine.close()
        thread.join(timeout=30)
    assert not thread.is_alive()


def test_a_stop_from_the_caller_ends_the_request():
    engine = Engine(Counting(), eos=EOS, max_queue=8)
    seen = []
    r = Request([5], 10, lambda t: seen.append(t) or t == 7, lambda reason, error: seen.append(reason))
    engine.submit(r)
    drain(engine)
    assert seen == [6, 7, "stop"]


def test_sampling():
    logits = torch.tensor([2.0, 1.5, 1.0, -1.0])
    assert sample(logits, Sampling(), None) == 0
    # top_k 1 and a tiny top_p keep only the argmax, whatever the temperature
    for s in (Sampling(temperature=1.5, top_k=1, seed=3), Sampling(temperature=1.5, top_p=1e-6, seed=3)):
        g = s.generator()
        assert {sample(logits, s, g) for _ in range(50)} == {0}
    # top_p 0.7: softmax is [0.49, 0.30, 0.18, 0.02]; the smallest prefix reaching 0.7 is tokens 0 and 1
    s = Sampling(temperature=1.0, top_p=0.7, seed=0)
    g = s.generator()
    assert {sample(logits, s, g) for _ in range(300)} == {0, 1}
    s = Sampling(temperature=1.0, top_k=3, seed=0)
    g = s.generator()
    assert {sample(logits, s, g) for _ in range(300)} == {0, 1, 2}
    # a seed gives the same draws
    a, b = Sampling(temperature=1.0, seed=7), Sampling(temperature=1.0, seed=7)
    ga, gb = a.generator(), b.generator()
    assert [sample(logits, a, ga) for _ in range(20)] == [sample(logits, b, gb) for _ in range(20)]


def test_a_request_for_no_tokens_runs_its_prompt_and_reports_every_row():
    """max_tokens 0 (prompt scoring): the prompt is fed in chunks, `on_logits` gets each position's row
    (row i of a call predicting position p + i + 1), nothing is generated, the finish reason is length."""
    stepper = Counting(chunk=4)
    engine = Engine(stepper, eos=EOS, max_queue=4)
    rows: list[tuple[int, list[int]]] = []
    log: dict = {}
    r = request(list(range(10, 20)), 0, log)
    r.on_logits = lambda p, x: rows.append((p, x.argmax(-1).tolist()))
    out = engine.submit(r)
    drain(engine)
    assert log == {"tokens": [], "finish": ("length", None)} and out.generated == []
    assert [p for p, _ in rows] == [0, 4, 8] and sum((a for _, a in rows), []) == list(range(11, 21))
    assert free(engine) == (3, 8)


def test_penalties_and_bias_adjust_the_logits_before_the_pick():
    logits = torch.tensor([0.0, 3.0, 2.9, 1.0])
    assert sample(logits, Sampling(), None) == 1
    assert sample(logits, Sampling(logit_bias=((1, -100.0),)), None, [1]) == 2
    # token 1 generated twice: 3.0 - 2 * 0.1 - 0.5 = 2.3 < 2.9
    assert sample(logits, Sampling(presence_penalty=0.5, frequency_penalty=0.1), None, [1, 1]) == 2
    assert sample(logits, Sampling(frequency_penalty=0.01), None, [1]) == 1  # 2.99 > 2.9
    assert sample(logits, Sampling(presence_penalty=-0.5), None, [2]) == 2  # a negative one favours it
