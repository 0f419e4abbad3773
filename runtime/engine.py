"""Continuous batching over a loaded session: what `deepinfer-serve` drives, one step at a time.

`regions.generate.greedy` runs a fixed list of prompts to completion; an `Engine`
takes requests while it runs. Requests wait in a bounded FIFO queue and join
the running batch at step boundaries, up to the largest batch bucket of each
token group; every step gives each running sequence its next prompt chunk (at
most the largest tokens bucket) or its one decode token, so new prompts
prefill interleaved with the other sequences' decodes (`Session.run` pads the
step to the nearest buckets). Each sequence holds a slot and the KV blocks its
positions need, reserved step by step as it grows and released when it ends;
a request is admitted only when its group's free blocks, less what the running
sequences may still claim, hold its prompt and `max_tokens`, so a running
sequence never runs out of blocks. A request that cannot fit even in an empty
pool is refused at `check` (the server answers 400).

Sampling is per request: greedy (argmax, exactly as `greedy` picks) at
temperature 0, else top-k, then top-p, then a draw from its own seeded
generator. A cancelled request (its client disconnected) leaves the batch at
the next step boundary. Requests talk back through two callbacks run on the
engine's thread: `on_token(id) -> stop?` (stop strings are the caller's) and
`on_finish(reason, error)`.

With a `drafter` (`deepinfer-serve --speculative dspark`: the bundle's compiled draft), greedy
requests decode speculatively, as `regions.generate.greedy` does: a caught-up sequence feeds its
drafts after its unfed token in one verify step, keeps the drafts the target's argmax agrees with
plus the target's own token, and a rejected block's per-slot state is restored from its snapshot
and the accepted tokens fed again (the same tokens as without). Sampled requests decode plainly.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from deepinfer.errors import DeepinferError
from deepinfer.regions.generate import DraftedTokens, Generation, Row, SlotSnapshot, Stepper, draft_for, verify

# seconds: step times of a tiny CPU bundle (~ms) up to a release rank's prefill chunk (~s)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class RequestError(DeepinferError):
    """A request the engine can never run (the server answers 400); `param` names the field, `code`
    is OpenAI's for it (context_length_exceeded) or None."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


class QueueFull(DeepinferError):
    """The waiting queue holds `max_queue` requests already (the server answers 429)."""


@dataclass(frozen=True)
class Sampling:
    """How a request picks its tokens: temperature 0 is greedy; top_k 0 and top_p 1 keep every token."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def generator(self) -> torch.Generator | None:
        if self.temperature == 0:
            return None
        g = torch.Generator()
        if self.seed is None:
            g.seed()
        else:
            g.manual_seed(self.seed)
        return g


def sample(logits: torch.Tensor, s: Sampling, generator: torch.Generator | None) -> int:
    """The next token from one position's logits [V]."""
    if s.temperature == 0:
        return int(torch.argmax(logits))
    x = logits.float() / s.temperature
    if 0 < s.top_k < x.numel():
        kth = torch.topk(x, s.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if s.top_p < 1.0:
        order = torch.argsort(x, descending=True)
        probs = torch.softmax(x[order], -1)
        before = torch.cumsum(probs, -1) - probs  # mass of the tokens ranked above each
        x[order[before >= s.top_p]] = float("-inf")  # the smallest prefix reaching top_p stays
    return int(torch.multinomial(torch.softmax(x, -1), 1, generator=generator))


@dataclass(eq=False)
class Request:
    """One sequence to generate. `on_token` and `on_finish` run on the engine's thread."""

    prompt: list[int]
    max_tokens: int
    on_token: Callable[[int], bool]
    on_finish: Callable[[str, str | None], None]
    sampling: Sampling = Sampling()
    # set by the engine
    submitted: float = 0.0
    last_token_at: float | None = None
    cancelled: bool = False
    finish_reason: str | None = None
    gen: Generation | None = None
    consumed: int = 0
    generator: torch.Generator | None = None
    seq: int | None = None  # while running
    group: int = 0
    need_blocks: int = 0

    @property
    def generated(self) -> list[int]:
        return [] if self.gen is None else self.gen.generated


class Metrics:
    """The engine's Prometheus metrics, in a registry of their own (one per engine)."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

        disable_created_metrics()  # no `_created` timestamp series beside every counter
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "deepinfer_requests",
            "Requests by outcome: the finish reason (stop, length, "
            "cancelled, error) or why it was refused (queue_full, bad_request)",
            ["outcome"],
            registry=r,
        )
        self.queue_depth = Gauge("deepinfer_queue_depth", "Requests waiting to join the batch", registry=r)
        self.running = Gauge("deepinfer_running_sequences", "Sequences in the running batch", registry=r)
        self.prompt_tokens = Counter("deepinfer_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generated_tokens = Counter("deepinfer_generated_tokens", "Tokens generated", registry=r)
        self.kv_blocks = Gauge("deepinfer_kv_blocks_in_use", "KV blocks held by running sequences", registry=r)
        self.kv_blocks_total = Gauge(
            "deepinfer_kv_blocks",
            "KV blocks sequences can hold (the pool less the scratch block, over every token group)",
            registry=r,
        )
        self.step = Histogram("deepinfer_step_seconds", "Time of one batched step", buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram(
            "deepinfer_time_to_first_token_seconds",
            "From a request's arrival to its first token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.drafted = Counter(
            "deepinfer_drafted_tokens", "Tokens drafted for greedy requests (--speculative)", registry=r
        )
        self.accepted = Counter(
            "deepinfer_accepted_tokens", "Drafted tokens the target's verify steps kept", registry=r
        )
        self.itl = Histogram(
            "deepinfer_inter_token_latency_seconds",
            "Between two tokens of one request",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )

    def text(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


class Engine:
    """Continuous batching over `stepper` (a loaded `Session`: the leader of its ranks); `run` drives it
    on one thread, `submit`, `cancel` and `close` may be called from any thread."""

    def __init__(self, stepper: Stepper, *, eos: int, max_queue: int, metrics: Metrics | None = None, drafter=None):
        self.stepper, self.eos, self.max_queue = stepper, eos, max_queue
        self.drafter = drafter  # a generate.Drafter for greedy requests, or None
        if drafter is not None and drafter.capture_layers:
            stepper.capture = dict.fromkeys(drafter.capture_layers)
        self.metrics = metrics or Metrics()
        self.allocs = [stepper.allocator() for _ in range(stepper.groups)]
        a = self.allocs[0]
        self.block_size, self.max_context = a.block_size, a.max_context
        self.capacity_blocks = len(a.free_blocks)  # per group: the pool less the scratch block
        self.capacity_slots = len(a.free_slots)  # per group: less the scratch slot
        self.metrics.kv_blocks_total.set(self.capacity_blocks * len(self.allocs))
        self.running: dict[int, Request] = {}
        self.gens: dict[int, Generation] = {}  # what Session.run reads (engram histories)
        self._waiting: deque[Request] = deque()
        self._closing = False
        self._rows_free = stepper.max_batch * stepper.groups
        self._cond = threading.Condition()
        self._next_seq = 0

    # -- any thread ---------------------------------------------------------------------------

    def positions(self, prompt_len: int, max_tokens: int) -> int:
        """KV positions a request needs: its prompt and every generated token but the last."""
        return prompt_len + max_tokens - 1

    def check(self, prompt_len: int, max_tokens: int) -> None:
        """Refuse a request that could never run (RequestError), whatever else is running."""
        too_long = "context_length_exceeded"
        if not self.capacity_slots:
            raise RequestError("the bundle was compiled without room for a sequence ([kv] slots)")
        if prompt_len < 1:
            raise RequestError("the prompt is empty", "prompt")
        if prompt_len > self.max_context:
            raise RequestError(
                f"this model's maximum context length is {self.max_context} tokens; the prompt has {prompt_len}",
                "prompt",
                too_long,
            )
        if max_tokens < 1:
            raise RequestError(f"max_tokens is {max_tokens}; it must be at least 1", "max_tokens")
        need = self.positions(prompt_len, max_tokens)
        if need > self.max_context:
            raise RequestError(
                f"this model's maximum context length is {self.max_context} tokens; the request "
                f"needs {need} ({prompt_len} in the prompt, {max_tokens} to generate less the "
                "last); shorten the prompt or lower max_tokens",
                "max_tokens",
                too_long,
            )
        blocks = -(-need // self.block_size)
        if blocks > self.capacity_blocks:
            raise RequestError(
                f"the request needs {blocks} KV blocks of {self.block_size} positions; the pool "
                f"holds {self.capacity_blocks} (start the server with more --num-kv-blocks)",
                "max_tokens",
                too_long,
            )

    def submit(self, request: Request) -> None:
        """Queue `request` (after `check`); QueueFull when `max_queue` requests wait already beyond those
        the batch's free rows take at the next step boundary."""
        self.check(len(request.prompt), request.max_tokens)
        with self._cond:
            if self._closing:
                raise QueueFull("the server is shutting down")
            if len(self._waiting) >= self.max_queue + self._rows_free:
                raise QueueFull(
                    f"{len(self._waiting)} requests are waiting already (--max-queue "
                    f"{self.max_queue}, {self._rows_free} free rows in the batch); retry later"
                )
            request.submitted = time.perf_counter()
            self._waiting.append(request)
            self.metrics.queue_depth.set(len(self._waiting))
            self._cond.notify()

    def cancel(self, request: Request) -> None:
        """Drop `request` at the next step boundary (its slot and blocks freed); a finished one is left alone."""
        with self._cond:
            request.cancelled = True
            self._cond.notify()

    def close(self) -> None:
        """Make `run` return after the current step; waiting and running requests finish as cancelled."""
        with self._cond:
            self._closing = True
            self._cond.notify()

    # -- the engine's thread ------------------------------------------------------------------

    def run(self) -> None:
        """Step until `close`: sleep while nothing waits or runs."""
        with torch.inference_mode():
            while True:
                with self._cond:
                    while not self._closing and not self._waiting and not self.running:
                        self._cond.wait()
                    if self._closing:
                        break
                self.step()
        with self._cond:
            left = list(self._waiting)
            self._waiting.clear()
        for r in left + list(self.running.values()):
            self._finish(r, "cancelled")

    def step(self) -> None:
        """One step boundary: drop cancelled requests, admit waiting ones, run one batched step, sample."""
        self._admit()
        for r in [r for r in self.running.values() if r.cancelled]:
            self._finish(r, "cancelled")
        if not self.running:
            return
        drafted = self._drafts()
        rows_by_group: list[list[Row]] = [[] for _ in self.allocs]
        for seq, r in self.running.items():
            n = min(self.stepper.chunk, len(r.gen.tokens) - r.consumed)
            drafts = drafted.get(seq, [])  # within the request's max_tokens: inside what admission reserved
            self.allocs[r.group].reserve(seq, r.consumed + n + len(drafts))  # admission left room: cannot fail
            rows_by_group[r.group].append((seq, r.gen.tokens[r.consumed : r.consumed + n] + drafts, r.consumed))
        self.metrics.kv_blocks.set(sum(len(t) for a in self.allocs for t in a.tables.values()))
        saved = SlotSnapshot.take(
            self.stepper, {seq: self.allocs[self.running[seq].group].slot_of[seq] for seq in drafted}
        )
        histories = {
            seq: DraftedTokens(g.tokens + drafted[seq]) if seq in drafted else g for seq, g in self.gens.items()
        }
        start = time.perf_counter()
        try:
            out = self.stepper.run(rows_by_group, self.allocs, histories, None)
        except Exception as e:  # a failed step fails its sequences, not the server
            for r in list(self.running.values()):
                self._finish(r, "error", f"the step failed: {type(e).__name__}: {e}")
            return
        now = time.perf_counter()
        self.metrics.step.observe(now - start)
        rejected = []
        for group, (rows, logits) in enumerate(zip(rows_by_group, out)):
            for b, (seq, ids, start_pos) in enumerate(rows):
                r = self.running[seq]
                if seq in drafted:
                    if not self._verify(r, logits[b, : len(ids)], start_pos, drafted[seq], group, b, now):
                        rejected.append(seq)
                    continue
                if self.drafter is not None:  # every committed position's features, for later drafts
                    self.drafter.observe(
                        seq, self.allocs[group].slot_of[seq], self.stepper, group, b, start_pos, len(ids)
                    )
                self._advance(r, logits[b, : len(ids)], start_pos, now)
        saved.restore(rejected)
        self._publish()

    def _drafts(self) -> dict[int, list[int]]:
        """This step's drafts for the running greedy requests (none without a drafter)."""
        if self.drafter is None:
            return {}
        seqs = [seq for seq, r in self.running.items() if r.sampling.temperature == 0]
        running = self.running
        return draft_for(
            self.drafter,
            seqs,
            self.gens,
            {s: running[s].consumed for s in seqs},
            {s: running[s].max_tokens for s in seqs},
            self.stepper.chunk,
            dict.fromkeys(seqs, self.max_context),
            {s: self.allocs[running[s].group].slot_of[s] for s in seqs},
        )

    def _verify(
        self, r: Request, logits: torch.Tensor, start: int, drafts: list[int], group: int, row: int, now: float
    ) -> bool:
        """A verify step's row (logits of the sequence's unfed committed tokens, then of its drafts: drafts
        go to caught-up sequences only): the accepted drafts and the target's own token are emitted ->
        whether every draft was accepted (else the caller restores the slot's state and the accepted
        tokens are fed again next step)."""
        fed = len(logits) - len(drafts)
        choice, a = verify(logits.float(), fed, drafts)
        keep = fed + a
        self.drafter.stats.record(len(drafts), a)
        self.metrics.drafted.inc(len(drafts))
        self.metrics.accepted.inc(a)
        finite = torch.isfinite(logits[:keep]).all(-1)
        if not bool(finite.all()):
            self._finish(
                r, "error", f"non-finite logits (NaN or infinity) at position {start + int((~finite).nonzero()[0, 0])}"
            )
            return True
        self.drafter.observe(r.seq, self.allocs[group].slot_of[r.seq], self.stepper, group, row, start, keep)
        if a == len(drafts):
            r.consumed = start + len(logits)
        for token in drafts[:a] + [choice[fed - 1 + a]]:
            if self._emit(r, token, now):
                break
        return a == len(drafts)

    def _advance(self, r: Request, logits: torch.Tensor, start: int, now: float) -> None:
        finite = torch.isfinite(logits).all(-1)
        if not bool(finite.all()):  # argmax of NaN (token 0) would hide it
            at = start + int((~finite).nonzero()[0, 0])
            self._finish(r, "error", f"non-finite logits (NaN or infinity) at position {at}")
            return
        if r.consumed < r.gen.prompt_len:
            self.metrics.prompt_tokens.inc(min(len(logits), r.gen.prompt_len - r.consumed))
        r.consumed += len(logits)
        if r.consumed < len(r.gen.tokens):  # more of the prompt to go
            return
        self._emit(r, sample(logits[-1], r.sampling, r.generator), now)

    def _emit(self, r: Request, token: int, now: float) -> bool:
        """Append `token` to `r`'s generation and tell its caller -> whether `r` finished."""
        r.gen.tokens.append(token)
        self.metrics.generated_tokens.inc()
        if r.last_token_at is None:
            self.metrics.ttft.observe(now - r.submitted)
        else:
            self.metrics.itl.observe(now - r.last_token_at)
        r.last_token_at = now
        stop = r.on_token(token)
        if token == self.eos or stop:
            self._finish(r, "stop")
        elif len(r.generated) >= r.max_tokens:
            self._finish(r, "length")
        return r.finish_reason is not None

    def _admit(self) -> None:
        """Move waiting requests into the batch, first come first served, while a group has a free row,
        a free slot and blocks for the whole request beyond what its running sequences may still claim."""
        with self._cond:
            waiting = self._waiting
            for r in [r for r in waiting if r.cancelled]:
                waiting.remove(r)
                self._finish(r, "cancelled")
            while waiting:
                r = waiting[0]
                need = -(-self.positions(len(r.prompt), r.max_tokens) // self.block_size)
                g = self._group_for(need)
                if g is None:
                    break
                waiting.popleft()
                seq, self._next_seq = self._next_seq, self._next_seq + 1
                self.allocs[g].admit(seq)
                r.seq, r.group, r.need_blocks = seq, g, need
                r.gen, r.generator = Generation(list(r.prompt), len(r.prompt)), r.sampling.generator()
                self.gens[seq] = r.gen
                self.running[seq] = r
        self._publish()

    def _group_for(self, need: int) -> int | None:
        """The least loaded token group that can take a request needing `need` blocks, or None."""
        load = [0] * len(self.allocs)
        claims = [0] * len(self.allocs)
        for seq, r in self.running.items():
            load[r.group] += 1
            claims[r.group] += r.need_blocks - len(self.allocs[r.group].tables[seq])
        for g in sorted(range(len(self.allocs)), key=lambda i: load[i]):
            a = self.allocs[g]
            if load[g] < self.stepper.max_batch and a.free_slots and len(a.free_blocks) - claims[g] >= need:
                return g
        return None

    def _finish(self, r: Request, reason: str, error: str | None = None) -> None:
        if r.finish_reason is not None:
            return
        r.finish_reason = reason
        if r.seq is not None:
            self.allocs[r.group].release(r.seq)
            del self.running[r.seq], self.gens[r.seq]
            r.seq = None
        self.metrics.requests.labels(reason).inc()
        self._publish()
        r.on_finish(reason, error)

    def _publish(self) -> None:
        self._rows_free = self.stepper.max_batch * len(self.allocs) - len(self.running)
        self.metrics.queue_depth.set(len(self._waiting))
        self.metrics.running.set(len(self.running))
        self.metrics.kv_blocks.set(sum(len(t) for a in self.allocs for t in a.tables.values()))
