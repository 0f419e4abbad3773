"""Liveness between the processes of a multi-rank run: no rank waits in a collective for one that is gone.

A collective waits for every rank of the world; a rank that was killed never comes, and gloo or
libnrt may notice only at the collective timeout (ten minutes by default), or never. So the processes
watch each other, outside the collectives:

    launcher -> ranks     every rank process `ranks.py` starts gets the read end of a pipe whose write
                          end only its launcher holds and never writes: end of file means the launcher
                          is gone (killed, crashed), and the rank exits at once with one line
                          (`watch_launcher`). deepinfer-serve's followers learn so that the leader is
                          gone; deepinfer-run's ranks that the command is.
    leader -> followers   deepinfer-serve's process is rank 0 and leads: it waits on its followers'
                          process sentinels (`FollowerWatch`), and a follower that ends while the
                          leader still serves ends the leader, with one line naming that rank and how
                          it ended. A step cannot be run without every rank, so the server stops (exit
                          status `EXIT_STATUS`) for its supervisor to restart it.
    deepinfer-run         the command is not a rank: it polls its ranks' exit codes and results
                          (`collect`) and names the first rank that died; the others, waiting in
                          the rendezvous or a collective that cannot complete, are killed at once
                          (`end`) rather than left to gloo's timeout.

Followers ignore SIGINT and SIGTERM: a Ctrl-C, or a supervisor's SIGTERM, may reach the whole process
group, and the leader stops them itself once it has drained its requests.
"""

from __future__ import annotations

import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait

from deepinfer.runtime.neuron.arrival import EXIT_STATUS

__all__ = [
    "EXIT_STATUS",
    "FollowerWatch",
    "collect",
    "died",
    "end",
    "how_it_ended",
    "ignore_interrupts",
    "say",
    "watch_launcher",
]


def how_it_ended(exitcode: int | None) -> str:
    """A process's exit code in words: "was killed by SIGKILL", "exited with status 1"."""
    if exitcode is None:
        return "is still running"
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with status {exitcode}"


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def watch_launcher(conn: Connection, rank: int, launcher: str) -> None:
    """In a rank process: a daemon thread that ends this process, with one line naming `launcher`,
    when the launcher's end of `conn` closes (it never writes: a message, or an error reading, is
    taken as the same news)."""

    def watch() -> None:
        try:
            conn.recv()
        except (EOFError, OSError):
            pass
        launcher_gone(rank, launcher)

    threading.Thread(target=watch, name=f"deepinfer-rank-{rank}-launcher-watch", daemon=True).start()


def launcher_gone(rank: int, launcher: str) -> None:
    """End this rank's process, with one line saying its launcher is gone."""
    say(f"error: rank {rank}: {launcher} is gone; rank {rank} exits")
    os._exit(EXIT_STATUS)


def closed(conn: Connection, wait_s: float) -> bool:
    """Whether the launcher's end of `conn` is closed (waiting at most `wait_s` for it): a rank whose
    collective failed asks, since a launcher that died also closes the connections between ranks."""
    try:
        return conn.poll(wait_s)
    except (EOFError, OSError):
        return True


def ignore_interrupts() -> None:
    """A follower leaves SIGINT and SIGTERM to its leader, which stops it once its requests are done: a
    Ctrl-C, or a supervisor's SIGTERM to the process group, must not end it before (it still ends when
    the leader does, through its pipe)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


class FollowerWatch:
    """The leader's watch over its followers' processes (`procs`: rank -> multiprocessing Process):
    once one ends before `stop` is called, says which and how in one line, kills the others, runs
    `cleanup`, and ends this process with `EXIT_STATUS`."""

    def __init__(self, procs: dict, *, what: str, cleanup: Callable[[], None] | None = None):
        self.procs, self.what, self.cleanup = procs, what, cleanup
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="deepinfer-follower-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """The leader is stopping its followers itself: their ends are expected from now on."""
        self._stopped.set()

    def _run(self) -> None:
        sentinels = {p.sentinel: rank for rank, p in self.procs.items()}
        while not self._stopped.is_set():
            ended = wait(list(sentinels), timeout=0.5)
            if not ended or self._stopped.is_set():
                continue
            rank = sentinels[ended[0]]
            proc = self.procs[rank]
            proc.join(1.0)
            say(f"error: rank {rank} (pid {proc.pid}) {how_it_ended(proc.exitcode)}; {self.what}")
            for other in self.procs.values():
                if other.is_alive():
                    other.kill()
            if self.cleanup is not None:
                try:
                    self.cleanup()
                except Exception:
                    pass
            os._exit(EXIT_STATUS)


TEST_PIDS_ENV = "DEEPINFER_TEST_RANK_PIDS"  # a test hook: a directory where each loaded rank writes its pid


def loaded(rank: int) -> None:
    """Test hook: with $DEEPINFER_TEST_RANK_PIDS, write this process's pid to rank-<rank>.pid there once
    the rank is loaded (a fault test then knows which process to kill, and when it is running steps)."""
    where = os.environ.get(TEST_PIDS_ENV)
    if where:
        tmp = os.path.join(where, f".rank-{rank}.pid.tmp")
        with open(tmp, "w") as f:
            f.write(f"{os.getpid()}\n")
        os.replace(tmp, os.path.join(where, f"rank-{rank}.pid"))


def collect(procs, results, timeout_s: float) -> list[dict]:
    """Every rank's result, or the first error; a rank that exits without one, or a run past
    `timeout_s`, is an error naming the rank."""
    deadline = time.monotonic() + timeout_s
    items: list[dict] = []
    while len(items) < len(procs):
        try:
            item = results.get(timeout=1.0)
        except queue.Empty:
            reported = {i.get("rank", 0) for i in items}
            dead = died(procs, reported)
            if dead:
                time.sleep(0.5)  # its own report may still be in the queue
                if results.empty():
                    return [dead]
            elif time.monotonic() > deadline:
                return [{"rank": min(set(range(len(procs))) - reported), "error": f"no result in {timeout_s:.0f} s"}]
            continue
        items.append(item)
        if "error" in item:
            # a rank whose peer was killed sees only a closed connection: name the rank that died
            return [died(procs, {i.get("rank", 0) for i in items}, settle_s=DIED_SETTLE_S, killed=True) or item]
    return items


DIED_SETTLE_S = 2.0  # how long a rank's failure waits for a peer's death, which may have caused it, to show


def died(procs, reported: set[int], settle_s: float = 0.0, killed: bool = False) -> dict | None:
    """The first rank that ended without reporting, other than successfully (with `killed`: by a
    signal; a rank that failed itself exits with status 1 once its report is sent), looked for during
    `settle_s`: an error naming it and how it ended; None if there is none."""
    deadline = time.monotonic() + settle_s
    while True:
        for rank, p in enumerate(procs):
            code = p.exitcode
            if rank not in reported and code not in (None, 0) and (code < 0 or not killed):
                return {"rank": rank, "error": f"{how_it_ended(p.exitcode)} without a result"}
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.1)


def end(procs, ok: bool, timeout_s: float = 10.0) -> None:
    """Every rank process of a run ended and reaped. `ok` (every rank reported its result): each is given
    `timeout_s` to exit on its own, then killed. Otherwise (a rank died or failed, or the wait was
    interrupted) the others are killed at once: they wait in the rendezvous or in a collective that
    cannot complete without that rank, which gloo would end only at its timeout (minutes)."""
    if ok:
        for p in procs:
            p.join(timeout=timeout_s)
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=timeout_s)
