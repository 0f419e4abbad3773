"""The bounded wait at collectives compiled into NEFFs: a rank that never arrives ends the run.

Loading a NEFF that holds collectives, and each execution of one, wait inside libnrt until every
rank of the world is there; a rank that never comes (dead, frozen, stuck in host code, or at a
different NEFF) leaves the others blocked in a C call that nothing in Python can interrupt. So a
watchdog thread per rank (`ArrivalWatch`) bounds those calls, and ends the process when one outlasts
the collective timeout, after saying in one line which rank is missing.

Why a watchdog and store markers, and not a barrier before each call: a gloo barrier (or a marker
written per call) costs a host round trip for every execution of every rank, one per layer at
release (~40 a step, 64 ranks), while the calls it guards usually finish in microseconds to
milliseconds. Here arming the watch is two attribute writes on the calling thread; the watchdog wakes
once a `tick` and does nothing unless a call has been blocked a whole tick. Only then does it publish
"rank r is in call n (what)" in the store the ranks already share (torch.distributed's), and at the
deadline it reads every rank's marker for call n: ranks without one are missing; ranks at another
NEFF show a different order; if all are there, the call itself never completed. The first rank to
time out writes its message under `abort` (compare-and-set, so every rank reports the same line), and
a rank blocked for a tick or more that finds one there ends at once. Calls are numbered per process in the order they are made,
so every rank must make the same collective calls in the same order (it must anyway: libnrt would
never complete them otherwise).

A process blocked in libnrt cannot raise; the watch reports the error through its `report` callback
(the launcher's channel, or stderr) and ends the process with `os._exit`. The others end the same
way, or, where frozen or dead, are ended by their launcher (`ranks.generate_ranks`, `ranks.Leader`,
torchrun), which already stops every rank once one fails.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable

from deepinfer.errors import DeepinferError

EXIT_STATUS = 3  # a rank ended by the watch (distinct from an exception's 1 and the CLI's 2)
ABORT_KEY = "deepinfer/collectives/abort"
MARKER_KEY = "deepinfer/collectives/call-{call}/rank-{rank}"
TIMEOUT_FIX = (
    "every rank must load and execute the same NEFFs in the same order; a slower rank needs a larger "
    "LoadOptions.collective_timeout_s"
)


class CollectiveTimeout(DeepinferError):
    """A libnrt call that waits for every rank (a NEFF with collectives loaded or executed) did not
    complete within the collective timeout; the message names the ranks that never arrived."""


def _stderr(error: CollectiveTimeout) -> None:
    print(f"error: {type(error).__name__}: {error}", file=sys.stderr, flush=True)


class ArrivalWatch:
    """This rank's watchdog over its collective libnrt calls (see the module docstring).

    `store`: a torch.distributed store every rank shares (set, get, check, compare_set). `report`
    is called once with the error, from the watchdog thread, right before the process ends (default:
    one line on stderr). `tick_s`: how often the watchdog looks
    (default: a tenth of the timeout, at most a second)."""

    def __init__(
        self,
        store,
        rank: int,
        world: int,
        timeout_s: float,
        *,
        report: Callable[[CollectiveTimeout], None] | None = None,
        tick_s: float | None = None,
    ):
        self.store, self.rank, self.world, self.timeout_s = store, rank, world, timeout_s
        self.report = report or _stderr
        self.tick_s = tick_s if tick_s is not None else min(1.0, timeout_s / 10)
        self.calls = 0  # collective calls made by this process
        self._current: tuple[int, str, float] | None = None  # (call, what, when it began) while one runs
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"deepinfer-arrival-rank-{rank}", daemon=True)
        self._thread.start()

    def arrive(self, what: str) -> ArrivalWatch:
        """Arm the watch for one collective call (`with watch.arrive("execute of x.neff"): ...`)."""
        self.calls += 1
        self._current = (self.calls, what, time.monotonic())
        return self

    def __enter__(self) -> ArrivalWatch:
        return self

    def __exit__(self, *exc) -> None:
        self._current = None

    def close(self) -> None:
        """Stop the watchdog (a call still in progress is no longer bounded)."""
        self._stop.set()
        self._thread.join(timeout=5)

    # -- the watchdog thread ---------------------------------------------------------------------

    def _watch(self) -> None:
        published = 0
        while not self._stop.wait(self.tick_s):
            current = self._current
            if current is None:
                continue
            call, what, began = current
            waited = time.monotonic() - began
            if waited < self.tick_s:
                continue  # the common case: a call shorter than a tick is never published
            try:
                if published != call:
                    self.store.set(MARKER_KEY.format(call=call, rank=self.rank), what)
                    published = call
                if self.store.check([ABORT_KEY]):  # another rank timed out first: its line ends this one
                    self._end(self.store.get(ABORT_KEY).decode())
                if waited >= self.timeout_s:
                    self._end(self._diagnose(call, what))
            except Exception as e:  # the store itself is gone (its host rank died): still end, and say so
                self._end(
                    f"rank {self.rank} waited {waited:.0f} s in collective call {call} ({what}) and cannot reach "
                    f"the ranks' store ({type(e).__name__}: {e}); {TIMEOUT_FIX}",
                    shared=False,
                )

    def _diagnose(self, call: int, what: str) -> str:
        """Who is not at collective call `call` (read from the ranks' markers), as one line."""
        at: dict[int, str | None] = {}
        for r in range(self.world):
            key = MARKER_KEY.format(call=call, rank=r)
            at[r] = self.store.get(key).decode() if self.store.check([key]) else None
        missing = [r for r, w in at.items() if w is None]
        if missing:
            return (
                f"{rank_spans(missing)} did not arrive at collective call {call} ({what}) "
                f"within {self.timeout_s:g} s; {TIMEOUT_FIX}"
            )
        if len(set(at.values())) > 1:
            by_what: dict[str | None, list[int]] = {}
            for r, w in at.items():
                by_what.setdefault(w, []).append(r)
            where = ", ".join(f"{w} on {rank_spans(rs)}" for w, rs in by_what.items())
            return (
                f"the ranks are at different NEFFs at collective call {call} ({where}), none completed; {TIMEOUT_FIX}"
            )
        return (
            f"every rank arrived at collective call {call} ({what}) and it did not complete within "
            f"{self.timeout_s:g} s: libnrt or a device is stuck (see the Neuron runtime's log)"
        )

    def _end(self, message: str, *, shared: bool = True) -> None:
        """Report `message` (the first rank's, if one already wrote it) and end this process."""
        if shared:
            with contextlib.suppress(Exception):  # the first message written is every rank's
                message = self.store.compare_set(ABORT_KEY, "", message).decode()
        try:
            self.report(CollectiveTimeout(message))
        finally:
            os._exit(EXIT_STATUS)


def rank_spans(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> "ranks 0-2, 5"; [3] -> "rank 3" (64 ranks stay one short line)."""
    spans: list[list[int]] = []
    for r in ranks:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
    return f"rank{'s' if len(ranks) > 1 else ''} {text}"


_WATCH: ArrivalWatch | None = None


def install(watch: ArrivalWatch | None) -> None:
    """Make `watch` the one this process's collective libnrt calls use (None: unbounded, as a single
    rank needs); the previous one is stopped."""
    global _WATCH
    previous, _WATCH = _WATCH, watch
    if previous is not None:
        previous.close()


def watched(what: str) -> contextlib.AbstractContextManager:
    """Bound one collective libnrt call by the installed watch (nothing when none is installed)."""
    return _WATCH.arrive(what) if _WATCH is not None else contextlib.nullcontext()
