"""An executable's own call signature, read cheaply from its archive, against the manifest's.

The manifest records each executable's inputs and outputs (names, shapes, dtypes). Before any
program is loaded, the runtime reads what each executable file says it takes and returns, without
unpickling, loading weights or loading code, and refuses a file that disagrees with its entry, in
one line naming the file and the mismatch: an executable swapped for another bucket's (its digests
re-stamped) is caught in seconds, not after every program has loaded.

What each kind of file says about itself:

- an ExportedProgram (`exported`): `models/model.json`, the serialized program, whose graph
  signature lists the user inputs and outputs and whose tensor values give each one's sizes (an
  int, or an expression for a dynamic size: any size matches it) and dtype;
- an AOTInductor package (`aoti`): the generated wrapper's C++ source in the package gives the
  input and output counts (`AOTInductorModelBase(inputs, outputs, ...)`) and, per input, the
  dtype and the static sizes its input check enforces (`check_input_<i>`); per output, the shape and
  dtype of the buffer the wrapper allocates for it (`output_handles[i] = bufN.release()`, followed
  through the wrapper's buffer reuses to its `aoti_torch_empty_strided`, or a view of one), and
  nothing where the output is another kind of value (an input passed through).

NEFFs (trn2) are checked by their header (bundles/neff.py `check_loadable`), which records no
tensor signature.
"""

from __future__ import annotations

import io
import re
import zipfile
from dataclasses import dataclass
from typing import BinaryIO

from deepinfer.bundles.manifest import BundleError, Executable
from deepinfer.reader import parse_json

MAX_MEMBER = 256 << 20  # the largest signature member read (a release attention's model.json is ~2 MB)
MAX_DEPTH = 512  # a serialized program nests its argument trees deeper than a manifest


@dataclass(frozen=True)
class IO:
    """One input or output as the executable's file states it: sizes (None: dynamic, or not stated;
    with `rank` false, the leading sizes only) and dtype (None: not stated)."""

    shape: tuple[int | None, ...] | None
    dtype: str | None
    rank: bool = True  # whether `shape` has one size per dimension


@dataclass(frozen=True)
class Signature:
    inputs: tuple[IO, ...]
    outputs: tuple[IO, ...]


def read_signature(source: bytes | memoryview | BinaryIO, kind: str, where: str) -> Signature | None:
    """The signature an `exported` or `aoti` archive (its bytes, or an open file) states; None for
    other kinds of file. Reads the zip directory and one member, nothing else."""
    reader = {"exported": _exported, "aoti": _aoti}.get(kind)
    if reader is None:
        return None
    try:
        with zipfile.ZipFile(io.BytesIO(source) if isinstance(source, (bytes, memoryview)) else source) as z:
            return reader(z, where)
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        raise BundleError(f"{where}: not a readable .pt2 archive ({e})") from None


def _member(z: zipfile.ZipFile, suffix: str, where: str) -> bytes:
    names = [i for i in z.infolist() if i.filename.endswith(suffix)]
    if len(names) != 1:
        raise BundleError(f"{where}: expected one {suffix} in the archive, found {len(names)}")
    if names[0].file_size > MAX_MEMBER:
        raise BundleError(f"{where}: {names[0].filename} is {names[0].file_size} bytes, over {MAX_MEMBER}")
    return z.read(names[0])


_SCALAR = {
    "FLOAT": "float32",
    "BFLOAT16": "bfloat16",
    "HALF": "float16",
    "LONG": "int64",
    "INT": "int32",
    "BYTE": "uint8",
    "CHAR": "int8",
    "BOOL": "bool",
}


def _dtype_name(code) -> str | None:
    from torch._export.serde.schema import ScalarType  # an enum: nothing is unpickled

    try:
        name = ScalarType(code).name
    except ValueError:
        return None
    return _SCALAR.get(name, name.lower())


def _exported(z: zipfile.ZipFile, where: str) -> Signature:
    def fail(message: str) -> BundleError:
        return BundleError(f"{where}: models/model.json: {message}")

    program = parse_json(
        _member(z, "models/model.json", where), f"{where}: models/model.json", error=fail, max_depth=MAX_DEPTH
    )
    try:
        graph = program["graph_module"]["graph"]
        signature = program["graph_module"]["signature"]
        values = graph["tensor_values"]

        def io_of(spec: dict, kind: str) -> IO | None:
            if kind not in spec:
                return None
            arg = spec[kind]["arg"]
            if "as_tensor" not in arg:
                return IO(None, None)
            meta = values[arg["as_tensor"]["name"]]
            shape = tuple(s.get("as_int") if isinstance(s, dict) else None for s in meta["sizes"])
            return IO(shape, _dtype_name(meta["dtype"]))

        inputs = [io_of(s, "user_input") for s in signature["input_specs"]]
        outputs = [io_of(s, "user_output") for s in signature["output_specs"]]
    except (KeyError, TypeError, AttributeError) as e:
        raise fail(f"no readable graph signature (missing {e})") from None
    return Signature(tuple(i for i in inputs if i is not None), tuple(o for o in outputs if o is not None))


_COUNTS = re.compile(r"AOTInductorModelBase\(\s*(\d+),\s*(\d+),")
_CHECK = re.compile(r"static void check_input_(\d+)\((.*?)\n}\n", re.S)
_DTYPE = re.compile(r"_expected_dtype = aoti_torch_dtype_(\w+)\(\)")
_SIZE = re.compile(r"if \((\d+) != \w+_size\[(\d+)\]\)")


_OUTPUT = re.compile(r"output_handles\[(\d+)\] = (\w+)\.release\(\);")
_ARRAY = re.compile(r"static constexpr int64_t (int_array_\d+)\[\] = \{([^}]*)\};")
_ALLOC = re.compile(
    r"aoti_torch_empty_strided\(\d+, (int_array_\d+), int_array_\d+, cached_torch_dtype_(\w+), [^;]*?&(\w+)_handle\)"
)
_MOVE = re.compile(r"auto (\w+) = std::move\((\w+)\);")
_ASSERTED = re.compile(r"assert_size_stride\((\w+), \{([^}]*)\}")  # an extern op's result: its sizes
_VIEW = re.compile(
    r"auto (\w+) = wrap_with_raii_handle_if_needed\(reinterpret_tensor_wrapper\((\w+), \d+, (int_array_\d+), "
)


def _aoti(z: zipfile.ZipFile, where: str) -> Signature:
    source = _member(z, ".wrapper.cpp", where).decode("utf-8", "replace")
    counts = _COUNTS.search(source)
    if counts is None:
        raise BundleError(f"{where}: the package's wrapper source states no input and output counts")
    inputs = [IO(None, None)] * int(counts.group(1))
    for m in _CHECK.finditer(source):
        i, body = int(m.group(1)), m.group(2)
        if i >= len(inputs):
            continue
        dtype = _DTYPE.search(body)
        sizes = {int(d): int(v) for v, d in _SIZE.findall(body)}
        shape = tuple(sizes.get(d) for d in range(max(sizes) + 1)) if sizes else None
        inputs[i] = IO(shape, dtype.group(1) if dtype else None, rank=False)
    return Signature(tuple(inputs), _aoti_outputs(source, int(counts.group(2))))


def _aoti_outputs(source: str, count: int) -> tuple[IO, ...]:
    """Each output's shape and dtype from the buffer the wrapper returns for it (IO(None, None) where the
    wrapper returns something it did not allocate here, or a name it reuses ambiguously)."""
    arrays: dict[str, tuple[int, ...] | None] = {}
    for name, body in _ARRAY.findall(source):
        arrays[name] = None if name in arrays else _sizes(body)  # a name defined twice: no shape from it
    allocated: dict[str, tuple[str, str | None]] = {}  # buffer -> (its sizes' array, dtype)
    for array, dtype, buf in _ALLOC.findall(source):
        allocated[buf] = (array, dtype)
    for buf, base, array in _VIEW.findall(source):
        allocated[buf] = (array, allocated.get(base, ("", None))[1])
    asserted = {buf: _sizes(body) for buf, body in _ASSERTED.findall(source) if buf.startswith("buf")}
    moved = dict(_MOVE.findall(source))  # new name -> the buffer it reuses
    outputs = [IO(None, None)] * count
    for i, returned in _OUTPUT.findall(source):
        buf = returned
        for _ in range(len(moved) + 1):  # follow the reuses back to an allocation
            if buf in allocated or buf not in moved:
                break
            buf = moved[buf]
        if int(i) >= count:
            continue
        if buf in allocated:
            array, dtype = allocated[buf]
            shape = arrays.get(array)
            outputs[int(i)] = IO(shape, dtype if shape is not None else None)
        elif asserted.get(buf) is not None:  # made by an extern op (a sort): its sizes, not its dtype
            outputs[int(i)] = IO(asserted[buf], None)
    return tuple(outputs)


def _sizes(body: str) -> tuple[int, ...] | None:
    """`1L, 8L, 6L` -> (1, 8, 6); None where a size is symbolic."""
    try:
        return tuple(int(v.strip().rstrip("L")) for v in body.split(",") if v.strip())
    except ValueError:
        return None


def check_signature(entry: Executable, sig: Signature, where: str) -> None:
    """Refuse, in one line naming `where` (the file), an executable whose stated signature differs
    from its manifest entry's: the number of inputs or outputs, an input's or output's dtype or a
    size both state."""

    def refuse(what: str) -> BundleError:
        return BundleError(
            f"{where}: {what}; the executable is not the one the manifest describes "
            "(swapped, or from another compile); recompile the bundle"
        )

    if len(sig.inputs) != len(entry.inputs):
        raise refuse(f"takes {len(sig.inputs)} inputs vs manifest {len(entry.inputs)}")
    for spec, got in zip(entry.inputs, sig.inputs):
        _compare("input", spec.name, spec.shape, spec.dtype, got, refuse)
    if len(sig.outputs) != len(entry.outputs):
        raise refuse(f"returns {len(sig.outputs)} outputs vs manifest {len(entry.outputs)}")
    first = len(entry.state_outputs or ())  # output_specs list the state a target returns first
    for out, got in zip((entry.output_specs or ())[first:], sig.outputs):
        _compare("output", out.name, out.shape, out.dtype, got, refuse)


def _compare(what: str, name: str, shape: tuple[int, ...], dtype: str, got: IO, refuse) -> None:
    if got.dtype is not None and got.dtype != dtype:
        raise refuse(f"{what} {name!r} dtype {got.dtype} vs manifest {dtype}")
    if got.shape is None:
        return
    if len(got.shape) > len(shape) or (got.rank and len(got.shape) != len(shape)):
        raise refuse(f"{what} {name!r} shape {_show(got.shape)} vs manifest {list(shape)}")
    for a, b in zip(got.shape, shape):
        if a is not None and b >= 0 and a != b:
            raise refuse(f"{what} {name!r} shape {_show(got.shape)} vs manifest {list(shape)}")


def _show(shape: tuple[int | None, ...]) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"
