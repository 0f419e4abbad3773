"""Compile jobs: one executable per (kind, method, bucket), optionally in worker processes."""

from __future__ import annotations

import shutil
import sys
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import TYPE_CHECKING

from deepinfer.bundles import layout

if TYPE_CHECKING:
    from deepinfer.compiler.plan import Exe

# worker processes load saved programs; torch 2.13 warns about its own tree-spec pickling
# once per program (compiler/trace.py filters the same warning in the main process)
warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*", category=FutureWarning)


@dataclass(frozen=True)
class Job:
    name: str  # e.g. attn_window.decode.b1t1
    lowered: Path  # saved, lowered ExportedProgram
    out: Path  # executable to produce
    target: str
    executable: str
    options: dict
    log: Path | None = None  # the compiler's log, kept in the bundle (targets that write one)
    exe: Exe | None = None  # the region kind, method and bucket it builds (for messages)


def run_job(job: Job, threads: int = 0) -> float:
    """Compile one executable (in this process or a worker); returns seconds. `threads`: the torch
    threads to compile with (a worker takes its leader's: Inductor writes the count into the code)."""
    import torch

    from deepinfer.compiler.targets import TARGETS

    if threads and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    start = time.perf_counter()
    TARGETS[job.target](job.executable, job.options).compile(job.lowered, job.out, log=job.log, name=job.name)
    return time.perf_counter() - start


def run_jobs(jobs: list[Job], n_workers: int, progress) -> dict[str, float]:
    """Run every job; `progress(done, total, job, seconds)` after each. Fails on the first error."""
    seconds: dict[str, float] = {}
    if n_workers <= 1 or len(jobs) <= 1:
        for i, job in enumerate(jobs, 1):
            seconds[job.name] = run_job(job)
            progress(i, len(jobs), job, seconds[job.name])
        return seconds
    # spawned workers inherit the environment (TMPDIR, TORCHINDUCTOR_CACHE_DIR)
    pool = ProcessPoolExecutor(max_workers=n_workers, mp_context=get_context("spawn"))
    try:
        with main_unseen():  # the workers start at the submits
            threads = torch_threads()
            futures = {pool.submit(run_job, job, threads): job for job in jobs}
        for i, future in enumerate(as_completed(futures), 1):
            job = futures[future]
            seconds[job.name] = future.result()
            progress(i, len(jobs), job, seconds[job.name])
    except BaseException:  # a failed job, or the compile stopped (SIGTERM, Ctrl-C): no job runs on
        stop_workers(pool)
        raise
    pool.shutdown()
    return seconds


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def stop_workers(pool: ProcessPoolExecutor) -> None:
    """End a pool's workers now: its queued jobs cancelled and its running ones killed (leaving the
    pool's `with` would wait for every job, queued ones included, to finish first)."""
    workers = list(pool._processes.values())  # the executor's own processes (no public accessor)
    pool.shutdown(wait=False, cancel_futures=True)
    for worker in workers:
        worker.terminate()
    for worker in workers:
        worker.join(timeout=10)
        if worker.is_alive():
            worker.kill()
            worker.join(timeout=10)


@contextmanager
def main_unseen() -> Iterator[None]:
    """While worker processes start: the caller's __main__ as one they cannot import.

    A spawned worker first imports the parent's main module (multiprocessing's spawn), so that
    functions defined there unpickle. The compile's workers run deepinfer's own functions only; and
    importing the caller's main would run a script without an `if __name__ == "__main__":` guard again
    in every worker (a compile inside each, then "An attempt has been made to start a new process
    before the current process has finished its bootstrapping phase"), and fails for code from standard
    input ('<stdin>') or a notebook. So the main module's file and spec are hidden while they start."""
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    saved: dict[str, object] = {k: main.__dict__[k] for k in ("__file__", "__spec__") if k in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__dict__["__spec__"] = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


def keep_failed_logs(error: Exception, logs: Path, out: Path) -> Exception:
    """A failed compile leaves no bundle: its compiler logs move to <out>.failed-logs/, and
    the error (same type) names them there."""
    if not logs.is_dir() or not any(logs.iterdir()):
        return error
    kept = layout.failed_logs(out)
    shutil.rmtree(kept, ignore_errors=True)
    try:
        shutil.copytree(logs, kept)
    except OSError:  # e.g. the disk that failed the compile is full
        shutil.rmtree(kept, ignore_errors=True)
        return error
    message = str(error)
    for path in (logs.resolve(), logs):
        message = message.replace(str(path), str(kept))
    return type(error)(message, *error.args[1:])  # a NeuronRefused's code and region stay
