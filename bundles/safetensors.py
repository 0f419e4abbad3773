"""The safetensors format, read in one place: headers, the dtype table, memory maps.

Checkpoints (regions/checkpoint.py, the quant/ streaming driver), the compile
cache's tensor digests and a bundle's weight files (the runtime) are all read
through `read_header`, with one dtype table.

File format: 8-byte little-endian header length N, N bytes of JSON
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}},
then the data section; offsets are relative to the data section. Everything a
reader needs to trust is checked up front against the file size, so a truncated
or corrupt file fails with a TensorFileError naming the file and tensor before
any worker touches it (a memory map past EOF would crash with SIGBUS instead).
No torch here except where a tensor is asked for (`load_mmap`, `torch_dtype`):
the quant/ workers are numpy only.
"""

from __future__ import annotations

import json
import math
import mmap
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from deepinfer.errors import TensorFileError
from deepinfer.reader import open_regular, parse_json

# safetensors dtype -> (numpy dtype that carries the bytes: bf16 and fp8 as raw bits, torch dtype name)
TABLE = {
    "BOOL": (np.bool_, "bool"),
    "U8": (np.uint8, "uint8"),
    "I8": (np.int8, "int8"),
    "F8_E4M3": (np.uint8, "float8_e4m3fn"),
    "F8_E5M2": (np.uint8, "float8_e5m2"),
    "F8_E8M0": (np.uint8, "float8_e8m0fnu"),
    "I16": (np.int16, "int16"),
    "U16": (np.uint16, "uint16"),
    "F16": (np.float16, "float16"),
    "BF16": (np.uint16, "bfloat16"),
    "I32": (np.int32, "int32"),
    "U32": (np.uint32, "uint32"),
    "F32": (np.float32, "float32"),
    "I64": (np.int64, "int64"),
    "U64": (np.uint64, "uint64"),
    "F64": (np.float64, "float64"),
}
DTYPES = {name: carrier for name, (carrier, _) in TABLE.items()}
MAX_HEADER = 100 << 20


@dataclass(frozen=True)
class TensorInfo:
    path: str
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the tensor in the file
    nbytes: int

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(DTYPES[self.dtype])

    @property
    def row_bytes(self) -> int:
        return self.nbytes // self.shape[0] if self.shape and self.shape[0] else self.nbytes


def _count(v) -> bool:
    """A dimension or byte offset: an integer in [0, 2**63)."""
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 63


def _entry(path: str, name: str, e, data_start: int, data_len: int | None) -> TensorInfo:
    if not isinstance(e, dict) or not {"dtype", "shape", "data_offsets"} <= e.keys():
        raise TensorFileError(path, name, "header entry lacks dtype/shape/data_offsets")
    dtype, shape, offs = e["dtype"], e["shape"], e["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise TensorFileError(path, name, f"unexpected dtype {dtype!r}", f"known dtypes: {', '.join(DTYPES)}")
    if (
        not isinstance(shape, list)
        or not all(_count(d) for d in shape)
        or not isinstance(offs, list)
        or len(offs) != 2
        or not all(_count(o) for o in offs)
        or not offs[0] <= offs[1]
    ):
        raise TensorFileError(path, name, f"malformed shape {shape!r} or data_offsets {offs!r}")
    nbytes = math.prod(shape) * np.dtype(DTYPES[dtype]).itemsize
    if offs[1] - offs[0] != nbytes:
        raise TensorFileError(
            path, name, f"data_offsets {offs} span {offs[1] - offs[0]} bytes, but {dtype} {shape} needs {nbytes}"
        )
    if data_len is not None and offs[1] > data_len:
        raise TensorFileError(
            path,
            name,
            f"file is truncated: the tensor ends at data byte {offs[1]} but the data section has {data_len} bytes",
        )
    return TensorInfo(path, name, dtype, tuple(shape), data_start + offs[0], nbytes)


def _metadata(path: str, meta) -> dict[str, str]:
    """The header's `__metadata__`: a flat map of strings to strings (the format says so), or none."""
    if meta is None:
        return {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise TensorFileError(path, None, "header's __metadata__ is not a map of strings to strings")
    return meta


def read_header(path: str, *, data: bool = True) -> tuple[dict[str, TensorInfo], dict]:
    """-> ({name: TensorInfo}, metadata). Raises TensorFileError on anything malformed.

    Reads the 8-byte length and the JSON header, never tensor data. With `data` false the data
    section may be absent or short (a headers-only checkpoint, enough to plan a compile): every
    entry is still checked for dtype, shape and offsets, not against the file's size."""
    fd = open_regular(path, error=lambda msg: TensorFileError(path, None, msg.removeprefix(f"{path}: ")))
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise TensorFileError(path, None, f"file is truncated: {size} bytes, no header length")
        n = int.from_bytes(head, "little")
        if n > MAX_HEADER or 8 + n > size:
            raise TensorFileError(
                path, None, f"header length {n} does not fit a {size}-byte file (truncated or not a safetensors file)"
            )
        raw = f.read(n)
    header = parse_json(raw, "header", error=lambda msg: TensorFileError(path, None, msg))
    return _index(path, header, n, size, data)


def _index(path: str, header, n: int, size: int, data: bool) -> tuple[dict[str, TensorInfo], dict]:
    """A parsed header (of length `n`, in a `size`-byte file) -> ({name: TensorInfo}, metadata)."""
    if not isinstance(header, dict):
        raise TensorFileError(path, None, "header is not a JSON object")
    meta = _metadata(path, header.pop("__metadata__", None))
    tensors = {k: _entry(path, k, v, 8 + n, size - 8 - n if data else None) for k, v in header.items()}
    end, last = 8 + n, None
    for t in sorted(tensors.values(), key=lambda t: (t.offset, t.nbytes)):
        if t.offset < end:  # shared bytes: writing one would change another
            raise TensorFileError(path, t.name, f"data overlaps tensor {last!r}")
        end, last = t.offset + t.nbytes, t.name
    return tensors, meta


def map_bytes(path: str, offset: int, nbytes: int) -> np.ndarray:
    """Read-only memory map of bytes [offset, offset + nbytes) of a file as uint8.
    Pre-faulted in one call where the OS allows (MAP_POPULATE) instead of one
    page fault per 4 KiB. The map lives as long as the returned array."""
    if nbytes == 0:
        return np.empty(0, np.uint8)
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), offset + nbytes - start, flags=flags, prot=mmap.PROT_READ, offset=start)
    return np.frombuffer(mm, np.uint8, nbytes, offset - start)


WRITE_SLICE = 1 << 20


def pwrite(path: str, offset: int, data: np.ndarray) -> None:
    """Write an array's bytes at `offset` of an existing file (positioned: no seek, no
    shared file position, so many processes can fill one pre-sized file). Written in calls of
    at most `WRITE_SLICE` bytes: a buffered write holds the file's inode lock for the whole
    call (dirty-page throttling included), so long calls make the other writers of that file
    queue; short ones also copy from a cache-sized span of the source."""
    view = memoryview(np.ascontiguousarray(data)).cast("B")  # type: ignore[arg-type]  # numpy stubs: __buffer__ only on 3.12+
    fd = os.open(path, os.O_WRONLY)
    try:
        while view:
            n = os.pwrite(fd, view[:WRITE_SLICE], offset)
            view, offset = view[n:], offset + n
    finally:
        os.close(fd)


def map_rows(t: TensorInfo, r0: int, r1: int) -> np.ndarray:
    """Read-only memory map of rows [r0, r1) of a tensor (axis 0); 0-d/1-d tensors
    map whole. Dropping the array unmaps it, so resident pages stay bounded."""
    shape = t.shape if len(t.shape) < 2 else (r1 - r0,) + t.shape[1:]
    nbytes = int(np.prod(shape, dtype=np.int64)) * t.np_dtype.itemsize
    if nbytes == 0:
        return np.empty(shape, t.np_dtype)
    off = t.offset + (r0 * t.row_bytes if len(t.shape) >= 2 else 0)
    return map_bytes(t.path, off, nbytes).view(t.np_dtype).reshape(shape)


def layout_header(entries: list[tuple[str, str, tuple[int, ...], int]], metadata: dict) -> tuple[bytes, dict[str, int]]:
    """entries: (name, dtype, shape, nbytes) in file order ->
    (header bytes including the 8-byte length, {name: absolute data offset})."""
    body: dict[str, dict[str, Any]] = {}
    pos = 0
    for name, dtype, shape, nbytes in entries:
        body[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    if metadata:
        body["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    raw = json.dumps(body, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # keep the data section 8-byte aligned
    start = 8 + len(raw)
    offsets = {name: start + body[name]["data_offsets"][0] for name, *_ in entries}
    return len(raw).to_bytes(8, "little") + raw, offsets


def torch_dtype(name: str):
    """The torch dtype of a safetensors dtype name."""
    import torch

    return getattr(torch, TABLE[name][1])


def load_mmap(path) -> dict:
    """{name: torch tensor} viewing a copy-on-write memory map of the file: pages are read on
    first touch, nothing is copied up front, and nothing a caller does writes back to the file."""
    import torch

    tensors, _ = read_header(str(path))
    if not tensors:
        return {}
    start = min(t.offset for t in tensors.values())
    data = np.memmap(path, dtype=np.uint8, mode="c", offset=start)
    out = {}
    for name, t in tensors.items():
        array = data[t.offset - start : t.offset - start + t.nbytes].view(t.np_dtype).reshape(t.shape)
        tensor = torch.from_numpy(array)
        want = torch_dtype(t.dtype)
        out[name] = tensor.view(want) if tensor.dtype != want else tensor
    return out


def load_buffer(data: memoryview, where: str) -> dict:
    """`load_mmap` of a file's bytes already in memory (`where` names the file in errors): a trusted
    bundle's verified copy (bundles/verified.py), so the tensors are views of exactly the bytes whose
    digest was checked, whatever the file holds now."""
    import torch

    size = len(data)
    n = int.from_bytes(data[:8], "little") if size >= 8 else -1
    if n < 0 or n > MAX_HEADER or 8 + n > size:
        raise TensorFileError(where, None, f"header length {n} does not fit a {size}-byte file")
    header = parse_json(bytes(data[8 : 8 + n]), "header", error=lambda msg: TensorFileError(where, None, msg))
    tensors, _ = _index(where, header, n, size, True)
    flat = np.frombuffer(data, np.uint8)
    out = {}
    for name, t in tensors.items():
        array = flat[t.offset : t.offset + t.nbytes].view(t.np_dtype).reshape(t.shape)
        tensor = torch.from_numpy(array)
        want = torch_dtype(t.dtype)
        out[name] = tensor.view(want) if tensor.dtype != want else tensor
    return out
