"""Planning for the streaming driver (stream.py): which tensors are fp8 weights,
which scale belongs to which weight, and what each output file will hold.

fp8 weights are `X.weight` of dtype F8_E4M3; their scale is `X.scale` (F8_E8M0,
[32, 32] blocks or one row per scale row) or DeepSeek-V3's `X.weight_scale_inv`
(F32, [128, 128] blocks). The new scale is always written as `X.scale`, in the
file that held the old one, in the recipe's layout. Everything else is copied.
"""

from __future__ import annotations

import glob
import itertools
import math
import os
from dataclasses import dataclass, field

import numpy as np

from deepinfer.bundles.safetensors import TensorInfo, layout_header, read_header
from deepinfer.errors import TensorFileError

from . import blocks
from .errors import QuantInputError
from .formats import FP8_E4M3FN, fp8_format
from .pack import LAYOUT_I16_PAIRS, LAYOUT_I32_MN_MAJOR, LAYOUT_U8, SCALE_LAYOUTS, pack_scales
from .rescale import block_pair

SCALE_DTYPES = {"F8_E8M0": (32, 32), "F32": (128, 128)}  # scale dtype -> checkpoint block
LAYOUT_DTYPE = {LAYOUT_U8: "F8_E8M0", LAYOUT_I32_MN_MAJOR: "I32", LAYOUT_I16_PAIRS: "I16"}


@dataclass(frozen=True, kw_only=True)
class StreamRecipe:
    """What to do with fp8 weights. dst_block=None keeps each weight's own blocks
    (then only the fp8 format changes); per-row scaled weights (block (1, b),
    e.g. engram.embed) always keep theirs, and take row_scale_layout when given
    (e.g. the int16 pairs their kernel reads) instead of scale_layout."""

    dst_block: int | tuple[int, int] | None = None
    fp8_format: str = FP8_E4M3FN
    scale_layout: str = LAYOUT_U8
    row_scale_layout: str | None = None
    chunk_bytes: int = 64 << 20

    def __post_init__(self):
        fp8_format(self.fp8_format)
        for key in ("scale_layout", "row_scale_layout"):
            value = getattr(self, key)
            if value is not None and value not in SCALE_LAYOUTS:
                raise QuantInputError(f"StreamRecipe.{key} {value!r}; valid: {', '.join(SCALE_LAYOUTS)}")
        if self.dst_block is not None:
            block_pair(self.dst_block, "StreamRecipe.dst_block")
        if not isinstance(self.chunk_bytes, int) or self.chunk_bytes < 1:
            raise QuantInputError(f"StreamRecipe.chunk_bytes must be a positive int, got {self.chunk_bytes!r}")


@dataclass(frozen=True)
class Fp8Job:
    weight: TensorInfo
    scale: TensorInfo
    src: tuple[int, int]
    dst: tuple[int, int]
    out_scale_name: str
    keep_blocks: bool  # True: only convert the fp8 format (convert_format)
    layout: str  # packed layout of the output scale (pack.py)


@dataclass(frozen=True)
class Task:
    kind: str  # "copy" | "fp8"
    src: TensorInfo
    lo: int  # copy: byte range; fp8: row range
    hi: int
    dst_path: str
    dst_offset: int  # absolute offset of the output tensor
    job: Fp8Job | None = None
    fmt: str = FP8_E4M3FN


@dataclass
class StreamReport:
    files: list[str]
    tensors: dict[str, dict] = field(default_factory=dict)  # manifest-ready description
    bytes_in: int = 0
    bytes_out: int = 0
    seconds: float = 0.0


def _checkpoint_files(src) -> list[str]:
    if isinstance(src, (list, tuple)):
        return [str(p) for p in src]
    if os.path.isdir(src):
        files = sorted(glob.glob(os.path.join(src, "*.safetensors")))
        if not files:
            raise TensorFileError(str(src), None, "no *.safetensors files in the directory")
        return files
    return [str(src)]


def block_from_grid(w: TensorInfo, s: TensorInfo, pref: tuple[int, int]) -> tuple[int, int]:
    """The checkpoint block that produced scale grid s.shape for weight w.shape:
    the format's block on each axis, else one scale per row (block 1)."""
    if len(w.shape) != 2 or len(s.shape) != 2:
        raise TensorFileError(
            w.path, w.name, f"fp8 weight {list(w.shape)} and scale {s.name!r} {list(s.shape)} must both be 2-D"
        )
    for br in (pref[0], 1):
        if blocks.grid(w.shape, br, pref[1]) == s.shape:
            return br, pref[1]
    raise TensorFileError(
        s.path,
        s.name,
        f"scale shape {list(s.shape)} does not fit fp8 weight "
        f"{w.name!r} {list(w.shape)} with [{pref[0]}, {pref[1]}] blocks "
        f"(expected {list(blocks.grid(w.shape, *pref))}) or per-row scales",
    )


def scale_names(weight: str) -> tuple[str, str]:
    """The names the scale of fp8 weight `weight` may have: `X.scale` (F8_E8M0, as released)
    or DeepSeek-V3's `X.weight_scale_inv` (F32)."""
    stem = weight[: -len("weight")] if weight.endswith(".weight") else weight + "."
    return stem + "scale", stem + "weight_scale_inv"


def _fp8_jobs(index: dict[str, TensorInfo], recipe: StreamRecipe) -> dict[str, Fp8Job]:
    jobs = {}
    for name, w in index.items():
        if w.dtype != "F8_E4M3":
            continue
        cands = scale_names(name)
        scale = next((index[c] for c in cands if c in index), None)
        if scale is None:
            raise TensorFileError(
                w.path, name, "fp8 weight has no scale tensor", f"expected {cands[0]!r} (F8_E8M0) or {cands[1]!r} (F32)"
            )
        if scale.dtype not in SCALE_DTYPES:
            raise TensorFileError(
                scale.path,
                scale.name,
                f"unexpected dtype {scale.dtype} for the scale of fp8 weight {name!r}",
                "expected F8_E8M0 or F32",
            )
        src = block_from_grid(w, scale, SCALE_DTYPES[scale.dtype])
        keep = recipe.dst_block is None or src[0] == 1
        dst = src if keep else block_pair(recipe.dst_block, "StreamRecipe.dst_block")
        layout = recipe.scale_layout
        if src[0] == 1 and recipe.row_scale_layout is not None:  # per-row scales
            layout = recipe.row_scale_layout
        jobs[name] = Fp8Job(w, scale, src, dst, cands[0], keep, layout)
    return jobs


def _out_scale_shape(job: Fp8Job) -> tuple[int, ...]:
    mb, kb = blocks.grid(job.weight.shape, *job.dst)
    return pack_scales(np.zeros((mb, kb), np.uint8), job.layout).shape


def _plan_file(path, tensors, jobs, by_scale, recipe):
    """-> (header entries, [(entry name, source tensor, job or None)]) in file order."""
    entries, items = [], []
    fmt_dtype = "F8_E4M3" if recipe.fp8_format == FP8_E4M3FN else "U8"
    for t in sorted(tensors.values(), key=lambda t: t.offset):
        if t.name in by_scale:
            job = by_scale[t.name]
            shape = _out_scale_shape(job)
            dtype = LAYOUT_DTYPE[job.layout]
            nbytes = int(np.prod(shape)) * {"F8_E8M0": 1, "I32": 4, "I16": 2}[dtype]
            entries.append((job.out_scale_name, dtype, shape, nbytes))
            items.append((job.out_scale_name, t, job))
        elif t.name in jobs:
            entries.append((t.name, fmt_dtype, t.shape, t.nbytes))
            items.append((t.name, t, jobs[t.name]))
        else:
            entries.append((t.name, t.dtype, t.shape, t.nbytes))
            items.append((t.name, t, None))
    return entries, items


@dataclass
class FilePlan:
    src: str
    out: str
    tmp: str
    header: bytes
    size: int  # total output bytes
    offsets: dict[str, int]  # output tensor -> absolute offset


@dataclass
class Plan:
    files: list[FilePlan]
    tasks: list[Task]
    tensors: dict[str, dict]  # manifest-ready description per output tensor
    scale_slots: dict[str, tuple[str, int]]  # fp8 weight -> (output path, scale offset)
    jobs: dict[str, Fp8Job]
    bytes_in: int = 0


def _tasks_for(name, t, job, fp, recipe) -> list[Task]:
    if job is None:
        step = recipe.chunk_bytes
        return [Task("copy", t, b, min(b + step, t.nbytes), fp.tmp, fp.offsets[name]) for b in range(0, t.nbytes, step)]
    if name != job.weight.name:
        return []  # a scale: written when its weight is done
    lr = math.lcm(job.src[0], job.dst[0])
    rows = max(lr, recipe.chunk_bytes // max(job.weight.row_bytes, 1) // lr * lr)
    return [
        Task("fp8", t, r, min(r + rows, t.shape[0]), fp.tmp, fp.offsets[name], job, recipe.fp8_format)
        for r in range(0, t.shape[0], rows)
    ]


def _describe(name, t, job, recipe) -> dict:
    if job is None:
        return {"kind": "copy", "dtype": t.dtype, "shape": list(t.shape)}
    if name == job.out_scale_name:
        return {"kind": "fp8_scale", "weight": job.weight.name, "layout": job.layout, "block": list(job.dst)}
    return {
        "kind": "fp8_block",
        "fp8_format": recipe.fp8_format,
        "block": list(job.dst),
        "scale": job.out_scale_name,
        "scale_layout": job.layout,
        "source_block": list(job.src),
        "source_scale_dtype": job.scale.dtype,
    }


def plan_checkpoint(src, out_dir: str, recipe: StreamRecipe) -> Plan:
    """Read every header, pair weights with scales, lay out every output file."""
    files = _checkpoint_files(src)
    headers = {p: read_header(p) for p in files}
    index: dict[str, TensorInfo] = {}
    for p, (tensors, _) in headers.items():
        for name, t in tensors.items():
            if name in index:
                raise TensorFileError(p, name, f"tensor also present in {index[name].path}")
            index[name] = t
    jobs = _fp8_jobs(index, recipe)
    by_scale = {j.scale.name: j for j in jobs.values()}
    plan = Plan([], [], {}, {}, jobs)
    per_file: list[list[Task]] = []
    for p in files:
        tensors, meta = headers[p]
        entries, items = _plan_file(p, tensors, jobs, by_scale, recipe)
        header, offsets = layout_header(entries, meta)
        out = os.path.join(out_dir, os.path.basename(p))
        fp = FilePlan(p, out, f"{out}.tmp-{os.getpid()}", header, len(header) + sum(e[3] for e in entries), offsets)
        plan.files.append(fp)
        per_file.append([])
        for name, t, job in items:
            per_file[-1] += _tasks_for(name, t, job, fp, recipe)
            plan.tensors[name] = _describe(name, t, job, recipe)
            plan.bytes_in += t.nbytes
            if job is not None and name == job.out_scale_name:
                plan.scale_slots[job.weight.name] = (fp.tmp, offsets[name])
    # round-robin over files: concurrent workers mostly write to different files
    plan.tasks = [t for group in itertools.zip_longest(*per_file) for t in group if t is not None]
    return plan
