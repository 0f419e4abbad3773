"""Streaming driver: preprocess a safetensors checkpoint tensor by tensor.

    report = process_checkpoint("ckpt/", "out/", StreamRecipe(dst_block=128, fp8_format="e4m3"),
                                workers=8)

Planning (headers, weight/scale pairing, output layout) is in stream_plan.py.
Here tasks run: each maps only its own input rows (mmap), computes, writes
its bytes at their final offset in a temporary output file (os.pwrite), and
returns at most the few scale rows it produced. The parent assembles each fp8
weight's scale grid, packs it in the recipe's layout once all its rows are in,
and moves finished files into place. Peak memory: about
  workers x (2..3 x chunk_bytes)  +  the scale grids of weights in flight,
independent of checkpoint size (bench/quant.py measures it).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass

import numpy as np

from deepinfer.bundles.safetensors import map_bytes, map_rows, pwrite
from deepinfer.errors import TensorFileError

from . import blocks
from .errors import QuantInputError
from .pack import pack_scales
from .rescale import convert_format, rescale_fp32, rescale_ue8m0
from .stream_plan import Plan, StreamRecipe, StreamReport, Task, plan_checkpoint

__all__ = ["StreamRecipe", "StreamReport", "process_checkpoint", "run_task"]


def _convert(task: Task) -> tuple[np.ndarray, np.ndarray]:
    """Rescale rows [lo, hi) of an fp8 weight -> (codes [rows, C], new scale rows)."""
    job, lo, hi = task.job, task.lo, task.hi
    assert job is not None, "an fp8 task carries its job"
    w = map_rows(job.weight, lo, hi)  # [rows, C] uint8, read-only
    s = np.array(map_rows(job.scale, lo // job.src[0], -(-hi // job.src[0])))
    if job.scale.dtype == "F32":
        return rescale_fp32(w, s, job.src, job.dst, task.fmt)
    if job.keep_blocks:
        return convert_format(w, s, job.src, task.fmt)
    return rescale_ue8m0(w, s, job.src, job.dst, task.fmt)


def run_task(task: Task):
    """Run one task (in a worker). Returns None, or (weight name, first scale row, scale rows)."""
    if task.kind == "copy":
        t = task.src
        pwrite(task.dst_path, task.dst_offset + task.lo, map_bytes(t.path, t.offset + task.lo, task.hi - task.lo))
        return None
    job = task.job
    assert job is not None, "an fp8 task carries its job"
    try:
        codes, scales = _convert(task)
    except TensorFileError:
        raise
    except QuantInputError as e:
        raise TensorFileError(
            job.weight.path, job.weight.name, f"in rows {task.lo}..{task.hi} (positions below are relative): {e}"
        ) from None
    # pwrite costs about half of what page faults on a writable shared map cost
    # (measured on ext4 and tmpfs); tasks alternate between files so concurrent
    # writers seldom queue on the same file's inode lock.
    pwrite(task.dst_path, task.dst_offset + task.lo * job.weight.row_bytes, codes)
    return job.weight.name, task.lo // job.dst[0], scales


@dataclass
class _PendingGrid:
    """A weight's scale grid [Mb, Kb] uint8 as its rows arrive."""

    grid: np.ndarray
    rows: int = 0


class _ScaleAssembler:
    """Collects each fp8 weight's scale rows; packs and writes the grid when complete."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self.pending: dict[str, _PendingGrid] = {}  # by weight name

    def add(self, result) -> None:
        if result is None:
            return
        name, row0, rows = result
        job = self.plan.jobs[name]
        grid = blocks.grid(job.weight.shape, *job.dst)
        entry = self.pending.setdefault(name, _PendingGrid(np.zeros(grid, np.uint8)))
        entry.grid[row0 : row0 + rows.shape[0]] = rows
        entry.rows += rows.shape[0]
        if entry.rows == grid[0]:
            path, offset = self.plan.scale_slots[name]
            pwrite(path, offset, pack_scales(entry.grid, job.layout))
            del self.pending[name]

    def finish(self) -> None:
        assert not self.pending, f"incomplete scale grids: {sorted(self.pending)}"


# loaded: fork from a fork server, not from this process. Ray: a compile with --ray holds a driver's
# gRPC threads, and a forked stream worker hung on one of their locks (compiler/farm.py).
THREADED_RUNTIMES = ("jax", "jaxlib", "ray")


def worker_context(name: str | None = None):
    """The multiprocessing context of stream workers. Workers run numpy, mmap and pwrite only,
    so a plain fork is safe unless the parent holds a runtime whose threads keep locks across
    the fork: JAX (the trn2 target's lowering and check) warns that forking it may deadlock.
    Then workers come from a fork server (one clean process they are forked from). Fork is the
    default otherwise: it streamed 1.3-1.6x faster than a fork server on the 2-core machine the
    benchmark ran on (bench/weights.py)."""
    methods = mp.get_all_start_methods()
    if not name:
        risky = any(m in sys.modules for m in THREADED_RUNTIMES)
        name = "fork" if "fork" in methods and not risky else "forkserver" if "forkserver" in methods else "spawn"
    return mp.get_context(name)


def unordered(fn: Callable, tasks: Iterable, workers: int, start_method: str | None = None) -> Iterator:
    """`fn(task)` for every task in `workers` worker processes; the results in the order they finish.

    A concurrent.futures pool, not a multiprocessing.Pool: a Pool replaces a worker that dies, so a
    compile stopped by SIGTERM (compiler/publish.py kills the children it finds, then exits) could
    leave a replacement forked in between running on alone, writing into a removed staging directory
    and printing a BrokenPipeError traceback. This pool starts its workers once and breaks
    (BrokenProcessPool) when one dies. Leaving early (an error, the caller stops iterating) cancels
    the queued tasks and waits only for the running ones."""
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=worker_context(start_method))
    try:
        futures = [pool.submit(fn, task) for task in tasks]
        for future in as_completed(futures):
            yield future.result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _execute(plan: Plan, recipe: StreamRecipe, workers: int, start_method: str | None) -> None:
    scales = _ScaleAssembler(plan)
    if workers <= 1:
        for task in plan.tasks:
            scales.add(run_task(task))
    else:
        for result in unordered(run_task, plan.tasks, workers, start_method):
            scales.add(result)
    scales.finish()


def process_checkpoint(
    src, out_dir: str, recipe: StreamRecipe | None = None, workers: int = 1, start_method: str | None = None
) -> StreamReport:
    """Preprocess `src` (a directory of *.safetensors, one file, or a list of files)
    into `out_dir` (same file names). workers <= 1 runs in this process."""
    recipe = recipe or StreamRecipe()
    os.makedirs(out_dir, exist_ok=True)
    plan = plan_checkpoint(src, out_dir, recipe)
    for fp in plan.files:  # replacing a file that is memory-mapped would corrupt the input
        if os.path.exists(fp.out) and os.path.samefile(fp.out, fp.src):
            raise QuantInputError(f"output {fp.out!r} is the input file; choose another out_dir")
    t0 = time.perf_counter()
    try:
        for fp in plan.files:
            with open(fp.tmp, "wb") as f:
                f.write(fp.header)
                f.truncate(fp.size)
        _execute(plan, recipe, workers, start_method)
        for fp in plan.files:
            os.replace(fp.tmp, fp.out)
    except BaseException:
        for fp in plan.files:
            if os.path.exists(fp.tmp):
                os.remove(fp.tmp)
        raise
    return StreamReport(
        [fp.out for fp in plan.files],
        plan.tensors,
        plan.bytes_in,
        sum(fp.size for fp in plan.files),
        time.perf_counter() - t0,
    )
