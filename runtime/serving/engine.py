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

import torch

from deepinfer.errors import DeepinferError, one_line
from deepinfer.regions.prefix import EVERY_STATE, StatePolicy
from deepinfer.regions.stepper import Drafter, Stepper
from deepinfer.runtime.requests import Completion, Request
from deepinfer.runtime.schedule import Scheduler
from deepinfer.runtime.serving.metrics import Metrics, MetricsEvents


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
        self.events.set_capacity(self.capacity_blocks * len(self.scheduler.allocs))
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
            self.events.queued(len(self.scheduler.running), waiting + 1)
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
