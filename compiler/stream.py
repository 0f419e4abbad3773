"""Streaming a checkpoint into bundle files: every byte read once, each written where it goes.

An output file is planned whole before anything is read (`OutFile`: its tensors, hence its
safetensors header and every tensor's offset) and created at its final size, zero-filled.
Each output tensor lists the pieces that fill it (`Piece`: which rows, columns or
experts of which checkpoint tensor go to which byte offset); what no piece covers stays
zero (padding). Tasks then cover every checkpoint tensor that any piece reads, in row
chunks of at most `chunk_bytes`: a task maps its rows (memory-mapped, quant/'s driver
reading), and writes each piece's part of them at its offset (os.pwrite). A tensor
several outputs need (one rank's rows each, or the same bytes for a shared file) is
read once: one task serves all of its pieces.

Memory: each worker holds one chunk (and one padded row buffer); never a stack or a
whole tensor. Every problem with a source tensor (missing, other dtype or shape,
truncated file) is found while planning, before any output is written, and named by
file and tensor.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field

import numpy as np

from deepinfer.bundles.safetensors import TensorInfo, layout_header, map_rows, pwrite
from deepinfer.quant.stream import worker_context

CHUNK_BYTES = 64 << 20
# the safetensors library's dtype order (its Dtype enum), by which it sorts a file's tensors
DTYPE_ORDER = ("BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "I16", "U16", "F16",
               "BF16", "I32", "U32", "F32", "F64", "I64", "U64")


@dataclass(frozen=True)
class Piece:
    """Rows [r0, r1) x columns [c0, c1) (elements of dim 1; the whole row for tensors of one
    dimension) of source tensor `src`, written as consecutive rows of `row_bytes` each
    starting at byte `offset` of the output tensor (the rest of each row stays zero)."""

    src: TensorInfo
    rows: tuple[int, int]
    cols: tuple[int, int] | None
    offset: int                   # from the start of the output tensor's data
    row_bytes: int                # output bytes per row (at least the piece's width)

    @property
    def width(self) -> int:
        """Bytes of one piece row."""
        if self.cols is None:
            return self.src.row_bytes
        return (self.cols[1] - self.cols[0]) * self.src.np_dtype.itemsize * _inner(self.src)


def _inner(t: TensorInfo) -> int:
    """Elements per column of a tensor's dim 1 (1 for 2-D tensors)."""
    return math.prod(t.shape[2:]) if len(t.shape) > 2 else 1


@dataclass
class OutTensor:
    name: str
    dtype: str                    # safetensors dtype name
    shape: tuple[int, ...]
    pieces: list[Piece] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        from deepinfer.bundles.safetensors import DTYPES

        return math.prod(self.shape) * np.dtype(DTYPES[self.dtype]).itemsize


@dataclass
class OutFile:
    path: str                     # where it is written (its final place in the staging bundle)
    tensors: list[OutTensor] = field(default_factory=list)
    metadata: dict = field(default_factory=dict)

    def layout(self) -> tuple[bytes, dict[str, int], int]:
        """(header bytes, tensor -> absolute data offset, file size). Tensors are laid out as the
        safetensors library orders them (wider dtypes first, then by name), so a file is byte for byte
        what `safetensors.save_file` would write for the same tensors."""
        order = sorted(self.tensors, key=lambda t: (-DTYPE_ORDER.index(t.dtype), t.name))
        header, offsets = layout_header([(t.name, t.dtype, t.shape, t.nbytes) for t in order], self.metadata)
        return header, offsets, len(header) + sum(t.nbytes for t in self.tensors)


@dataclass(frozen=True)
class Write:
    """One piece, placed: output path and the absolute offset of its first row."""

    path: str
    offset: int
    rows: tuple[int, int]
    cols: tuple[int, int] | None
    row_bytes: int
    width: int


@dataclass(frozen=True)
class Task:
    src: TensorInfo
    lo: int
    hi: int
    writes: tuple[Write, ...]

    @property
    def nbytes(self) -> int:
        return (self.hi - self.lo) * self.src.row_bytes


def _rows(t: TensorInfo) -> int:
    return t.shape[0] if t.shape else 1


def plan_tasks(files: list[OutFile], chunk_bytes: int = CHUNK_BYTES) -> tuple[list[Task], dict[str, tuple]]:
    """Tasks covering every source row some piece reads, grouped by source tensor and row chunk;
    and each file's (header, size)."""
    writes: dict[tuple[str, str], list[Write]] = {}
    sources: dict[tuple[str, str], TensorInfo] = {}
    layouts = {}
    for f in files:
        header, offsets, size = f.layout()
        layouts[f.path] = (header, size)
        for t in f.tensors:
            for p in t.pieces:
                key = (p.src.path, p.src.name)
                sources[key] = p.src
                writes.setdefault(key, []).append(Write(f.path, offsets[t.name] + p.offset, p.rows, p.cols,
                                                        p.row_bytes, p.width))
    tasks = []
    for key in sorted(writes, key=lambda k: (k[0], sources[k].offset)):      # file order: sequential reads
        src, ws = sources[key], writes[key]
        lo, hi = min(w.rows[0] for w in ws), max(w.rows[1] for w in ws)
        step = max(1, chunk_bytes // max(src.row_bytes, 1))
        for a in range(lo, hi, step):
            b = min(a + step, hi)
            mine = tuple(w for w in ws if w.rows[0] < b and a < w.rows[1])
            if mine:
                tasks.append(Task(src, a, b, mine))
    return tasks, layouts


def run_task(task: Task) -> int:
    """Map the task's rows once; write each piece's part. Returns the bytes read."""
    src = task.src
    if len(src.shape) >= 2:
        data = map_rows(src, task.lo, task.hi).view(np.uint8).reshape(task.hi - task.lo, -1)
    else:                                               # a vector (or scalar): its elements are its rows
        data = map_rows(src, 0, 0).view(np.uint8).reshape(_rows(src), -1)[task.lo:task.hi]
    item = src.np_dtype.itemsize * _inner(src)
    for w in task.writes:
        a, b = max(task.lo, w.rows[0]), min(task.hi, w.rows[1])
        part = data[a - task.lo:b - task.lo]
        if w.cols is not None:
            part = part[:, w.cols[0] * item:w.cols[1] * item]
        offset = w.offset + (a - w.rows[0]) * w.row_bytes
        if w.width == w.row_bytes:
            pwrite(w.path, offset, part)
        else:                                           # wider output rows: the rest stays zero
            padded = np.zeros((b - a, w.row_bytes), np.uint8)
            padded[:, :w.width] = part
            pwrite(w.path, offset, padded)
    return task.nbytes


class Progress:
    """Bytes done of the total, GB/s and ETA on the log, at most every `every` seconds."""

    def __init__(self, total: int, log, what: str = "weights", every: float = 2.0):
        self.total, self.log, self.what, self.every = total, log, what, every
        self.done, self.start = 0, time.perf_counter()
        self.last = self.start

    def add(self, n: int) -> None:
        self.done += n
        now = time.perf_counter()
        if now - self.last >= self.every or self.done >= self.total:
            self.last = now
            rate = self.done / max(now - self.start, 1e-9)
            eta = (self.total - self.done) / rate if rate > 0 else 0.0
            self.log(f"{self.what}: {self.done / 2**30:.2f} / {self.total / 2**30:.2f} GiB, "
                     f"{rate / 1e9:.2f} GB/s, ETA {eta:.0f} s")


def stream(files: list[OutFile], *, workers: int = 1, log=lambda msg: None, chunk_bytes: int = CHUNK_BYTES,
           what: str = "weights") -> dict:
    """Create every file at its size (zeros) and fill it; returns {"bytes_read", "bytes_written", "seconds"}.
    A file is complete only when this returns: callers write into a staging directory that is
    published (or removed) whole."""
    tasks, layouts = plan_tasks(files, chunk_bytes)
    start = time.perf_counter()
    for path, (header, size) in layouts.items():
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "wb") as f:
            f.write(header)
            f.truncate(size)
    progress = Progress(sum(t.nbytes for t in tasks), log, what)
    if workers <= 1 or len(tasks) <= 1:
        for task in tasks:
            progress.add(run_task(task))
    else:
        with worker_context().Pool(workers) as pool:
            for n in pool.imap_unordered(run_task, tasks, chunksize=1):
                progress.add(n)
    return {"bytes_read": progress.done, "bytes_written": sum(s for _, s in layouts.values()),
            "seconds": time.perf_counter() - start}
