"""The scheduler on a thread of its own: what `deepinfer-serve` drives, taking requests while it runs.

An `Engine` runs `runtime.schedule.Scheduler` (the one loop batch generation and speculative
decoding use too) with `reserve_whole`: a request is admitted only when its group's free blocks,
less what the running sequences may still claim, hold its prompt and `max_tokens`, so a running
sequence never runs out of blocks. Requests wait in a bounded FIFO queue (`submit` from any thread;
`QueueFull` beyond it, the server's 429) and join the batch at step boundaries; a request that
cannot fit even in an empty pool is refused at `check` (the server's 400). A cancelled request
(its client disconnected) leaves the batch at the next step boundary; a step that raises fails the
sequences in it, not the server. Requests talk back through their callbacks, run on the engine's
thread: `on_token(id) -> stop?` (stop strings are the caller's) and `on_finish(reason, error)`.
`Metrics` counts what the scheduler reports (`Events`) for /metrics.

The engine cannot die silently: if its thread ever stops on an error, every request it holds ends
with that error as one line, `dead` says why, and the server answers /health with 503 and exits
non-zero. `health(watchdog_s)` also reports an engine that has had work but finished no step for
`watchdog_s`. `end_all` ends every request at the next step boundary (a graceful stop's last act).
A test hook, `$DEEPINFER_TEST_FAULT` (`step=SEED,thread=SEED,slow=SEED,stall=SEED`), makes a step raise,
the thread die, or each step take 0.25 s more (slow), or one step 3 s more (stall) while a request with that sampling seed is held.

With a `drafter` (`deepinfer-serve --speculative dspark`), greedy requests decode speculatively:
the same tokens as without. Sampled requests decode plainly. With `prefix_cache` (the server's
default; `--no-prefix-cache`), full blocks, prompt and generated, are shared between requests
(regions/prefix.py, runtime/prefix_gen.py).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from deepinfer.errors import DeepinferError
from deepinfer.regions.prefix import EVERY_STATE, StatePolicy
from deepinfer.regions.stepper import Drafter, Stepper
from deepinfer.runtime.requests import Completion, Request
from deepinfer.runtime.schedule import Events, Scheduler

if TYPE_CHECKING:  # prometheus_client loads with the first engine (Metrics.new)
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# seconds: step times of a tiny CPU bundle (~ms) up to a release rank's prefill chunk (~s)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
STEP_TOKEN_BUCKETS = tuple(float(1 << i) for i in range(15))  # 1 .. 16384 tokens
STEP_TOKENS_HELP = "Tokens one step fed: prompt chunks, decode and verify rows (--max-step-tokens bounds it)"


class RequestError(DeepinferError):
    """A request the engine can never run (the server answers 400); `param` names the field, `code`
    is OpenAI's for it (context_length_exceeded) or None."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


class EngineStopped(DeepinferError):
    """The engine's thread stopped on an error (the server exits with it)."""


FAULT_ENV = "DEEPINFER_TEST_FAULT"  # the test hook (see the module's docstring)
SLOW_STEP_S = 0.25  # what the hook's `slow` adds to a step
STALL_S = 3.0  # what the hook's `stall` adds to a step


class QueueFull(DeepinferError):
    """The waiting queue holds `max_queue` requests already (the server answers 429)."""


@dataclass(frozen=True)
class Metrics:
    """The engine's Prometheus metrics, in a registry of their own (one per engine: `Metrics.new()`)."""

    registry: CollectorRegistry
    requests: Counter
    queue_depth: Gauge
    running: Gauge
    prompt_tokens: Counter
    generated_tokens: Counter
    kv_blocks: Gauge
    kv_blocks_total: Gauge
    step: Histogram
    ttft: Histogram
    drafted: Counter
    accepted: Counter
    verify_steps: Counter
    itl: Histogram
    prefix_hit_tokens: Counter
    prefix_blocks: Gauge
    prefix_evicted: Counter
    step_tokens: Histogram

    @classmethod
    def new(cls) -> Metrics:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

        disable_created_metrics()  # no `_created` timestamp series beside every counter
        r = CollectorRegistry()
        return cls(
            registry=r,
            requests=Counter(
                "deepinfer_requests",
                "Requests by outcome: the finish reason (stop, length, "
                "cancelled, error) or why it was refused (queue_full, bad_request)",
                ["outcome"],
                registry=r,
            ),
            queue_depth=Gauge("deepinfer_queue_depth", "Requests waiting to join the batch", registry=r),
            running=Gauge("deepinfer_running_sequences", "Sequences in the running batch", registry=r),
            prompt_tokens=Counter("deepinfer_prompt_tokens", "Prompt tokens processed", registry=r),
            generated_tokens=Counter("deepinfer_generated_tokens", "Tokens generated", registry=r),
            kv_blocks=Gauge("deepinfer_kv_blocks_in_use", "KV blocks held by running sequences", registry=r),
            kv_blocks_total=Gauge(
                "deepinfer_kv_blocks",
                "KV blocks sequences can hold (the pool less the scratch block, over every token group)",
                registry=r,
            ),
            step=Histogram("deepinfer_step_seconds", "Time of one batched step", buckets=LATENCY_BUCKETS, registry=r),
            ttft=Histogram(
                "deepinfer_time_to_first_token_seconds",
                "From a request's arrival to its first token",
                buckets=LATENCY_BUCKETS,
                registry=r,
            ),
            drafted=Counter(
                "deepinfer_drafted_tokens", "Tokens drafted for greedy requests (--speculative)", registry=r
            ),
            accepted=Counter("deepinfer_accepted_tokens", "Drafted tokens the target's verify steps kept", registry=r),
            verify_steps=Counter(
                "deepinfer_verify_steps", "Verify steps: one sequence's row of a step that carried drafts", registry=r
            ),
            itl=Histogram(
                "deepinfer_inter_token_latency_seconds",
                "Between two tokens of one request",
                buckets=LATENCY_BUCKETS,
                registry=r,
            ),
            prefix_hit_tokens=Counter(
                "deepinfer_prefix_cache_hit_tokens",
                "Prompt tokens whose KV came from the prefix cache instead of a prefill",
                registry=r,
            ),
            prefix_blocks=Gauge(
                "deepinfer_prefix_cache_blocks", "KV blocks the prefix cache holds (shared or evictable)", registry=r
            ),
            prefix_evicted=Counter(
                "deepinfer_prefix_cache_evicted_blocks",
                "Cached KV blocks evicted (least recently released first) for want of free blocks",
                registry=r,
            ),
            step_tokens=Histogram("deepinfer_step_tokens", STEP_TOKENS_HELP, buckets=STEP_TOKEN_BUCKETS, registry=r),
        )

    def text(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


class MetricsEvents(Events):
    """The scheduler's events counted in `Metrics`: token latencies from each request's arrival."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics
        self.arrived: dict[Request, float] = {}  # a running or waiting request -> when it was submitted
        self.last_token: dict[Request, float] = {}
        self.evicted = 0  # evictions counted so far

    def stepped(self, seconds: float) -> None:
        self.metrics.step.observe(seconds)

    def fed(self, prompt: int, decode: int, rows: int, longest: int) -> None:
        self.metrics.step_tokens.observe(prompt + decode)

    def prompt_tokens(self, n: int) -> None:
        if n:
            self.metrics.prompt_tokens.inc(n)

    def token(self, request: Request, now: float) -> None:
        self.metrics.generated_tokens.inc()
        last = self.last_token.get(request)
        if last is None:
            self.metrics.ttft.observe(now - self.arrived.get(request, now))
        else:
            self.metrics.itl.observe(now - last)
        self.last_token[request] = now

    def drafts(self, drafted: int, accepted: int) -> None:
        self.metrics.drafted.inc(drafted)
        self.metrics.accepted.inc(accepted)
        self.metrics.verify_steps.inc()

    def finished(self, request: Request, reason: str) -> None:
        self.arrived.pop(request, None)
        self.last_token.pop(request, None)
        self.metrics.requests.labels(reason).inc()

    def load(self, running: int, waiting: int, kv_blocks: int) -> None:
        self.metrics.running.set(running)
        self.metrics.queue_depth.set(waiting)
        self.metrics.kv_blocks.set(kv_blocks)

    def prefix_hit(self, tokens: int) -> None:
        self.metrics.prefix_hit_tokens.inc(tokens)

    def prefix_cache(self, blocks: int, evicted: int) -> None:
        self.metrics.prefix_blocks.set(blocks)
        if evicted > self.evicted:
            self.metrics.prefix_evicted.inc(evicted - self.evicted)
            self.evicted = evicted


class Engine:
    """Continuous batching over `stepper` (a loaded bundle's `Steps`: the leader of its ranks); `run`
    drives it on one thread, `submit`, `cancel` and `close` may be called from any thread."""

    def __init__(
        self,
        stepper: Stepper,
        *,
        eos: int,
        max_queue: int,
        metrics: Metrics | None = None,
        drafter: Drafter | None = None,
        prefix_cache: bool = False,
        prefix_states: StatePolicy = EVERY_STATE,
        max_step_tokens: int | None = None,
    ):
        self.max_queue = max_queue
        self.metrics = metrics or Metrics.new()
        self.events = MetricsEvents(self.metrics)
        self._cond = threading.Condition()
        self.scheduler = Scheduler(
            stepper,
            eos=eos,
            reserve_whole=True,
            drafter=drafter,
            events=self.events,
            lock=self._cond,
            prefix_cache=prefix_cache,
            prefix_states=prefix_states,
            max_step_tokens=max_step_tokens,
        )
        a = self.scheduler.allocs[0]
        self.block_size, self.max_context = a.block_size, a.max_context
        self.capacity_blocks = len(a.free_blocks)  # per group: the pool less the scratch block
        self.capacity_slots = len(a.free_slots)  # per group: less the scratch slot
        self.metrics.kv_blocks_total.set(self.capacity_blocks * len(self.scheduler.allocs))
        self._rows = stepper.max_batch * stepper.groups  # the batch's rows over every token group
        self.vitals = Vitals()
        self.faults = Faults(os.environ.get(FAULT_ENV, ""))

    # -- any thread ---------------------------------------------------------------------------

    def positions(self, prompt_len: int, max_tokens: int) -> int:
        """KV positions a request needs: its prompt and every generated token but the last."""
        return prompt_len + max(max_tokens, 1) - 1

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
        if max_tokens < 0:
            raise RequestError(f"max_tokens is {max_tokens}; it must be at least 0 (0: the prompt only)", "max_tokens")
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
        a = self.scheduler.allocs[0]
        if max(a.shard_counts(blocks)) > self.capacity_blocks // a.shards:  # each shard: its own blocks
            raise RequestError(
                f"the request needs {blocks} KV blocks of {self.block_size} positions; the pool "
                f"holds {self.capacity_blocks} (start the server with more --num-kv-blocks)",
                "max_tokens",
                too_long,
            )

    def submit(self, request: Request) -> Completion:
        """Queue `request` (after `check`) -> its output, filled in as it runs; QueueFull when `max_queue`
        requests wait already beyond those the batch's free rows take at the next step boundary."""
        self.check(len(request.prompt), request.max_tokens)
        with self._cond:
            if self.vitals.closing:
                raise QueueFull("the server is shutting down")
            waiting = len(self.scheduler.waiting)
            free = self._rows - len(self.scheduler.running)
            if waiting >= self.max_queue + free:
                raise QueueFull(
                    f"{waiting} requests are waiting already (--max-queue "
                    f"{self.max_queue}, {free} free rows in the batch); retry later"
                )
            self.events.arrived[request] = time.perf_counter()
            if not self.scheduler.busy:  # the watchdog counts from the work's arrival, not the last step
                self.vitals.progress = time.monotonic()
            out = self.scheduler.add(request)
            self.metrics.queue_depth.set(waiting + 1)
            self._cond.notify()
        return out

    def cancel(self, request: Request) -> None:
        """Drop `request` at the next step boundary (its slot and blocks freed); a finished one is left alone."""
        with self._cond:
            request.cancelled = True
            self._cond.notify()

    def close(self) -> None:
        """Make `run` return after the current step; waiting and running requests finish as cancelled."""
        with self._cond:
            self.vitals.closing = True
            self._cond.notify()

    def end_all(self) -> None:
        """End every waiting and running request (as cancelled) at the next step boundary; later ones run."""
        with self._cond:
            self.vitals.ending = True
            self._cond.notify()

    @property
    def busy(self) -> bool:
        """Whether any request waits or runs."""
        with self._cond:
            return self.scheduler.busy

    def health(self, watchdog_s: float | None) -> str | None:
        """None while the engine works, else why not (one line): its thread stopped, or it has had work
        but finished no step for more than `watchdog_s` (None or 0: no watchdog)."""
        if self.vitals.dead is not None:
            return f"the engine stopped: {self.vitals.dead}"
        stalled = time.monotonic() - self.vitals.progress
        if watchdog_s and stalled > watchdog_s and self.busy:
            return f"the engine has had work but finished no step for {stalled:.0f} s (watchdog {watchdog_s:g} s)"
        return None

    # -- the engine's thread ------------------------------------------------------------------

    def run(self) -> None:
        """Step until `close`: sleep while nothing waits or runs. An error that escapes a step boundary
        stops the thread: `dead` says why and every request held ends with it."""
        try:
            self._loop()
        except BaseException as e:  # whatever stops the thread is reported, not lost
            self.vitals.dead = one_line(e)
            with self._cond:
                self.vitals.closing = True  # submit refuses from now on
            try:
                self.scheduler.close("error", f"the engine stopped: {self.vitals.dead}")
            except BaseException:  # the requests' callbacks may fail too; `dead` says why
                pass

    def _loop(self) -> None:
        with torch.inference_mode():
            while True:
                with self._cond:
                    idle = not self.scheduler.busy
                    while not self.vitals.closing and not self.vitals.ending and not self.scheduler.busy:
                        self._cond.wait()
                    if self.vitals.closing:
                        break
                    ending, self.vitals.ending = self.vitals.ending, False
                    if idle:
                        self.vitals.progress = time.monotonic()
                if ending:
                    self.scheduler.close()
                    continue
                if self._fault("thread"):
                    raise RuntimeError(f"test hook {FAULT_ENV}: the engine thread dies")
                self.step()
                self.vitals.progress = time.monotonic()
        self.scheduler.close()

    def step(self) -> None:
        """One step boundary of the scheduler; a step that raises fails its sequences, not the server."""
        try:
            if self._fault("slow"):
                time.sleep(SLOW_STEP_S)
            if self._fault("stall", once=True):
                time.sleep(STALL_S)
            if self._fault("step", running_only=True):
                raise RuntimeError(f"test hook {FAULT_ENV}: a step fails")
            self.scheduler.step()
        except Exception as e:
            self.scheduler.fail_running(f"the step failed: {one_line(e)}")

    def _fault(self, kind: str, running_only: bool = False, once: bool = False) -> bool:
        """Whether the test hook's `kind` applies: a request held (running, or waiting too) has its seed."""
        if not self.faults.seeds:
            return False
        with self._cond:  # submit appends to the waiting queue from other threads
            held = list(self.scheduler.running.values()) + ([] if running_only else list(self.scheduler.waiting))
        return self.faults.applies(kind, {r.request.sampling.seed for r in held}, once)

    @property
    def dead(self) -> str | None:
        """Why the engine's thread stopped on an error (one line), or None."""
        return self.vitals.dead


@dataclass
class Vitals:
    """What the engine's thread and the others tell each other (under the engine's condition)."""

    closing: bool = False  # `run` returns after the current step
    ending: bool = False  # `end_all`: end every request at the next step boundary
    progress: float = field(default_factory=time.monotonic)  # a step finished, or work came to an idle engine
    dead: str | None = None  # why the engine's thread stopped on an error (one line)


class Faults:
    """The test hook of the module's docstring: `kind=seed` pairs, and the one-shot kinds that fired."""

    def __init__(self, spec: str):
        self.seeds: dict[str, int] = {}
        for part in filter(None, spec.split(",")):
            kind, _, seed = part.partition("=")
            self.seeds[kind.strip()] = int(seed)
        self.fired: set[str] = set()

    def applies(self, kind: str, seeds: set, once: bool) -> bool:
        seed = self.seeds.get(kind)
        if seed is None or seed not in seeds or (once and kind in self.fired):
            return False
        self.fired.add(kind)
        return True


def one_line(e: BaseException) -> str:
    """An error as one line: its type and the first line of its message."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__
