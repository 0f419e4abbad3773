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
file and tensor; a NaN or infinity in a float tensor (fp8 codes and scales included) is
found as its rows are read, and fails the pass the same way (nothing is published).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field

import numpy as np

from deepinfer.bundles.safetensors import TensorInfo, layout_header, map_rows, pwrite
from deepinfer.errors import CheckpointError
from deepinfer.quant.finite import first_nonfinite
from deepinfer.quant.stream import unordered

CHUNK_BYTES = 64 << 20
# the safetensors library's dtype order (its Dtype enum), by which it sorts a file's tensors
DTYPE_ORDER = (
    "BOOL",
    "F4",
    "F6_E2M3",
    "F6_E3M2",
    "U8",
    "I8",
    "F8_E5M2",
    "F8_E4M3",
    "F8_E8M0",
    "I16",
    "U16",
    "F16",
    "BF16",
    "I32",
    "U32",
    "F32",
    "F64",
    "I64",
    "U64",
)


@dataclass(frozen=True)
class Piece:
    """Rows [r0, r1) x columns [c0, c1) (elements of dim 1; the whole row for tensors of one
    dimension) of source tensor `src`, written as consecutive rows of `row_bytes` each
    starting at byte `offset` of the output tensor (the rest of each row stays zero)."""

    src: TensorInfo | Derived  # a checkpoint tensor, or a part of its fp8 conversion
    rows: tuple[int, int]
    cols: tuple[int, int] | None
    offset: int  # from the start of the output tensor's data
    row_bytes: int  # output bytes per row (at least the piece's width)

    @property
    def width(self) -> int:
        """Bytes of one piece row."""
        if self.cols is None:
            return self.src.row_bytes
        return (self.cols[1] - self.cols[0]) * self.src.np_dtype.itemsize * _inner(self.src)


def _inner(t: TensorInfo | Derived) -> int:
    """Elements per column of a tensor's dim 1 (1 for 2-D tensors)."""
    return math.prod(t.shape[2:]) if len(t.shape) > 2 else 1


@dataclass(frozen=True)
class Fp8Convert:
    """An fp8 weight the bundle stores otherwise than the checkpoint: codes (F8_E4M3, [R, C])
    with block scales (F8_E8M0 on `src_block`, or DeepSeek-V3's F32 `weight_scale_inv` on
    [128, 128]) become codes of `fmt` with ue8m0 scales on `dst_block`, by quant/rescale:
    `rescale_fp32` for float scales, `convert_format` for ue8m0 ones (same blocks). Row chunks
    are whole multiples of both blocks' rows, so a chunk converts on its own."""

    codes: TensorInfo
    scales: TensorInfo
    src_block: tuple[int, int]
    dst_block: tuple[int, int]
    fmt: str

    @property
    def align(self) -> int:
        """Codes rows per chunk step."""
        return math.lcm(self.src_block[0], self.dst_block[0])

    def part(self, which: str) -> Derived:
        return Derived(self, which)

    def convert(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """(codes rows [lo, hi), their scale rows [lo / dst_rows, ...)) as written; `lo` is aligned."""
        from deepinfer.quant.rescale import convert_format, rescale_fp32

        codes = map_rows(self.codes, lo, hi).view(np.uint8)
        sr = self.src_block[0]
        scales = map_rows(self.scales, lo // sr, -(-hi // sr))
        check_finite(self.codes, codes, lo)
        check_finite(self.scales, scales, lo // sr)
        if self.scales.dtype == "F32":
            return rescale_fp32(codes, scales, self.src_block, self.dst_block, self.fmt)
        return convert_format(codes, scales.view(np.uint8), self.src_block, self.fmt)


@dataclass(frozen=True)
class Derived:
    """The codes or the scales part of an `Fp8Convert`, as a piece's source: the shape and rows of
    what is written (uint8), the bytes read counted on the checkpoint tensor they come from."""

    conv: Fp8Convert
    which: str  # "codes" | "scales"
    dtype = "U8"
    np_dtype = np.dtype(np.uint8)

    @property
    def stored(self) -> TensorInfo:
        return self.conv.codes if self.which == "codes" else self.conv.scales

    @property
    def path(self) -> str:
        return self.stored.path

    @property
    def name(self) -> str:
        return self.stored.name

    @property
    def nbytes(self) -> int:
        return self.stored.nbytes

    @property
    def shape(self) -> tuple[int, ...]:
        if self.which == "codes":
            return self.conv.codes.shape
        (r, c), (br, bc) = self.conv.codes.shape, self.conv.dst_block
        return (-(-r // br), -(-c // bc))

    @property
    def row_bytes(self) -> int:
        return self.shape[1]

    @property
    def rows_per_row(self) -> int:
        """Codes rows behind one row of this part."""
        return 1 if self.which == "codes" else self.conv.dst_block[0]


@dataclass
class OutTensor:
    name: str
    dtype: str  # safetensors dtype name
    shape: tuple[int, ...]
    pieces: list[Piece] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        from deepinfer.bundles.safetensors import DTYPES

        return math.prod(self.shape) * np.dtype(DTYPES[self.dtype]).itemsize


@dataclass
class OutFile:
    path: str  # where it is written (its final place in the staging bundle)
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
    """One piece, placed: output path and the absolute offset of its first row. `part`: which
    part of a converted source it takes ("codes" / "scales"; "" for stored bytes); its rows
    count in that part's rows."""

    path: str
    offset: int
    rows: tuple[int, int]
    cols: tuple[int, int] | None
    row_bytes: int
    width: int
    part: str = ""


@dataclass(frozen=True)
class Task:
    """Rows [lo, hi) of one source: a checkpoint tensor, or the codes of an `Fp8Convert` (whose
    scale rows come with them)."""

    src: TensorInfo | Fp8Convert
    lo: int
    hi: int
    writes: tuple[Write, ...]

    @property
    def nbytes(self) -> int:
        """Checkpoint bytes the task reads."""
        if isinstance(self.src, Fp8Convert):
            s, sr = self.src.scales, self.src.src_block[0]
            return (self.hi - self.lo) * self.src.codes.row_bytes + (-(-self.hi // sr) - self.lo // sr) * s.row_bytes
        return (self.hi - self.lo) * self.src.row_bytes


def _rows(t: TensorInfo) -> int:
    return t.shape[0] if t.shape else 1


def _code_rows(p: Piece) -> tuple[int, int]:
    """The piece's rows in rows of its source tensor (codes rows for a converted part)."""
    n = p.src.rows_per_row if isinstance(p.src, Derived) else 1
    return p.rows[0] * n, p.rows[1] * n


def _source_of(p: Piece):
    """What a task reads for the piece: the checkpoint tensor, or the conversion of a derived part."""
    return p.src.conv if isinstance(p.src, Derived) else p.src


def plan_tasks(files: list[OutFile], chunk_bytes: int = CHUNK_BYTES) -> tuple[list[Task], dict[str, tuple]]:
    """Tasks covering every source row some piece reads, grouped by source tensor and row chunk;
    and each file's (header, size)."""
    writes: dict[tuple[str, str], list[tuple[Write, tuple[int, int]]]] = {}
    sources: dict[tuple[str, str], TensorInfo | Fp8Convert] = {}
    layouts = {}
    for f in files:
        header, offsets, size = f.layout()
        layouts[f.path] = (header, size)
        for t in f.tensors:
            for p in t.pieces:
                src = _source_of(p)
                stored = _stored(src)
                key = (stored.path, stored.name)
                if sources.setdefault(key, src) != src:
                    raise ValueError(f"{stored.path}: tensor {stored.name} is planned both converted and as stored")
                part = p.src.which if isinstance(p.src, Derived) else ""
                w = Write(f.path, offsets[t.name] + p.offset, p.rows, p.cols, p.row_bytes, p.width, part)
                writes.setdefault(key, []).append((w, _code_rows(p)))
    tasks = []
    for key in sorted(writes, key=lambda k: (k[0], _stored(sources[k]).offset)):  # file order: sequential reads
        src, ws = sources[key], writes[key]
        stored = _stored(src)
        align = src.align if isinstance(src, Fp8Convert) else 1
        lo = min(r[0] for _, r in ws) // align * align
        hi = max(r[1] for _, r in ws)
        step = max(1, chunk_bytes // max(stored.row_bytes, 1) // align) * align
        for a in range(lo, hi, step):
            b = min(a + step, hi)
            mine = tuple(w for w, r in ws if r[0] < b and a < r[1])
            if mine:
                tasks.append(Task(src, a, b, mine))
    return tasks, layouts


def _stored(src: TensorInfo | Fp8Convert) -> TensorInfo:
    return src.codes if isinstance(src, Fp8Convert) else src


def _task_rows(task: Task) -> dict[str, tuple[int, np.ndarray]]:
    """{part: (index of its first row, uint8 rows [n, row bytes])} of what the task writes from."""
    src = task.src
    if isinstance(src, Fp8Convert):
        codes, scales = src.convert(task.lo, task.hi)
        return {"codes": (task.lo, codes), "scales": (task.lo // src.dst_block[0], scales)}
    if len(src.shape) >= 2:
        data = map_rows(src, task.lo, task.hi).view(np.uint8).reshape(task.hi - task.lo, -1)
    else:  # a vector (or scalar): its elements are its rows
        data = map_rows(src, 0, 0).view(np.uint8).reshape(_rows(src), -1)[task.lo : task.hi]
    check_finite(src, data, task.lo)
    return {"": (task.lo, data)}


def check_finite(t: TensorInfo, rows: np.ndarray, first_row: int) -> None:
    """Refuse a NaN or infinity in rows of checkpoint tensor `t` (read here anyway), naming the
    file, the tensor and the element."""
    i = first_nonfinite(rows, t.dtype)
    if i is not None:
        per_row = max(1, math.prod(t.shape[1:]))
        flat = first_row * per_row + i
        at = np.unravel_index(flat, t.shape) if t.shape else ()
        raise CheckpointError(
            f"{t.path}: tensor {t.name}: non-finite value (NaN or infinity) at "
            f"[{', '.join(map(str, at))}]; the checkpoint is damaged or was saved from a "
            "diverged run"
        )


def run_task(task: Task) -> int:
    """Map the task's rows once (converted where the recipe says); write each piece's part.
    Returns the checkpoint bytes read."""
    parts = _task_rows(task)
    item = 1 if isinstance(task.src, Fp8Convert) else task.src.np_dtype.itemsize * _inner(task.src)
    for w in task.writes:
        base, data = parts[w.part]
        a, b = max(base, w.rows[0]), min(base + len(data), w.rows[1])
        if a >= b:
            continue
        part = data[a - base : b - base]
        if w.cols is not None:
            part = part[:, w.cols[0] * item : w.cols[1] * item]
        offset = w.offset + (a - w.rows[0]) * w.row_bytes
        if w.width == w.row_bytes:
            pwrite(w.path, offset, part)
        else:  # wider output rows: the rest stays zero
            padded = np.zeros((b - a, w.row_bytes), np.uint8)
            padded[:, : w.width] = part
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
            from deepinfer.units import human

            rate = self.done / max(now - self.start, 1e-9)
            eta = (self.total - self.done) / rate if rate > 0 else 0.0
            line = f"{self.what}: {human(self.done)} / {human(self.total)}, {human(int(rate))}/s"
            self.log(line + (f", ETA {eta:.0f} s" if eta >= 1 else ""))


def stream(
    files: list[OutFile],
    *,
    workers: int = 1,
    log=lambda msg: None,
    chunk_bytes: int = CHUNK_BYTES,
    what: str = "weights",
) -> dict:
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
        for n in unordered(run_task, tasks, workers):
            progress.add(n)
    return {
        "bytes_read": progress.done,
        "bytes_written": sum(s for _, s in layouts.values()),
        "seconds": time.perf_counter() - start,
    }
