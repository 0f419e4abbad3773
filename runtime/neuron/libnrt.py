"""ctypes binding to the Neuron runtime C API (libnrt.so, header nrt/nrt.h).

Nothing here runs without libnrt: on a machine without the Neuron SDK,
`open_library()` raises `NeuronRuntimeMissing`. In this repository the binding
is exercised only against a C test double (tests/trn2/doubles/fake_nrt.c),
which checks the calling convention, never Trn2 behaviour or numerics.

Facts relied on (read from the public headers of aws-neuron/aws-neuron-sdk,
src/libnrt/include/nrt/, and the rendered API pages):
  https://github.com/aws-neuron/aws-neuron-sdk/blob/master/src/libnrt/include/nrt/nrt.h
  https://github.com/aws-neuron/aws-neuron-sdk/blob/master/src/libnrt/include/nrt/nrt_experimental.h
  https://github.com/aws-neuron/aws-neuron-sdk/blob/master/src/libnrt/include/nrt/nrt_status.h
  https://github.com/aws-neuron/aws-neuron-sdk/blob/master/src/libnrt/include/nrt/nrt_version.h
  https://awsdocs-neuron.readthedocs-hosted.com/en/latest/neuron-runtime/api/nrt.html
  https://awsdocs-neuron.readthedocs-hosted.com/en/latest/neuron-runtime/api/nrt-env-var-reference.html

  NRT_STATUS nrt_init(nrt_framework_type_t fw, const char *fw_version, const char *fal_version)
      NRT_FRAMEWORK_TYPE_NO_FW = 1; framework-less callers pass "" for both versions.
  void nrt_close(void)
  NRT_STATUS nrt_load(const void *neff, size_t size, int32_t vnc, int32_t vnc_count, nrt_model_t **model)
      vnc = -1: first free core; vnc_count is deprecated, "always use -1".
  NRT_STATUS nrt_unload(nrt_model_t *model)
  NRT_STATUS nrt_get_model_tensor_info(nrt_model_t *model, nrt_tensor_info_array_t **info)   [nrt_experimental.h]
  NRT_STATUS nrt_free_model_tensor_info(nrt_tensor_info_array_t *info)                      [nrt_experimental.h]
  NRT_STATUS nrt_tensor_allocate(nrt_tensor_placement_t p, int vnc, size_t size, const char *name, nrt_tensor_t **t)
      NRT_TENSOR_PLACEMENT_DEVICE = 0, _HOST = 1, _VIRTUAL = 2.
  NRT_STATUS nrt_tensor_allocate_slice(const nrt_tensor_t *src, size_t offset, size_t size, const char *name,
                                       nrt_tensor_t **slice)      -- a view of src's storage, no copy
  void nrt_tensor_free(nrt_tensor_t **t)
  NRT_STATUS nrt_tensor_write(nrt_tensor_t *t, const void *buf, size_t offset, size_t size)
  NRT_STATUS nrt_tensor_read(const nrt_tensor_t *t, void *buf, size_t offset, size_t size)
  size_t nrt_tensor_get_size(const nrt_tensor_t *t)
  NRT_STATUS nrt_allocate_tensor_set(nrt_tensor_set_t **set)           (nrt_tensor_set_t is `void`)
  NRT_STATUS nrt_add_tensor_to_tensor_set(nrt_tensor_set_t *set, const char *name, nrt_tensor_t *t)
  void nrt_destroy_tensor_set(nrt_tensor_set_t **set)
  NRT_STATUS nrt_execute(nrt_model_t *model, const nrt_tensor_set_t *in, nrt_tensor_set_t *out)
  NRT_STATUS nrt_load_collectives(const void *neff, size_t size, int32_t vnc, int32_t vnc_count,
                                  uint32_t ctx_device_id, uint32_t ctx_device_count, nrt_model_t **model)
      for a NEFF that holds collectives; creates the global communicator if none was built.
  NRT_STATUS nrt_build_global_comm(int32_t vnc, uint32_t g_device_id, uint32_t g_device_count)
      the communicator of every collective NEFF the process will run (count: the largest world).
  NRT_STATUS nrt_get_version(nrt_version_t *ver, size_t size)          [nrt_version.h]
      nrt_version_t = {uint64 rt_major, rt_minor, rt_patch, rt_maintenance; char rt_detail[128]; char git_hash[64]}
  nrt_tensor_info_t = {char name[256]; nrt_tensor_usage_t usage; size_t size; nrt_dtype_t dtype;
                       uint32_t *shape; uint32_t ndim}     (usage: INPUT = 0, OUTPUT = 1)
  nrt_tensor_info_array_t = {uint64_t tensor_count; nrt_tensor_info_t tensor_array[]}
  NRT_STATUS is a C enum (int): every value of nrt_status.h in STATUS_NAMES below;
  const char *nrt_get_status_as_str(NRT_STATUS status)   [nrt_status.h; optional here]

Uncertain (not verified on hardware):
  - nrt_dtype_t values changed between releases (sequential 0..11 in an older
    nrt_experimental.h, sparse 0x1..0xF in today's nrt.h), so the raw dtype
    code is reported as-is and never interpreted here.
  - The VNC index given to nrt_load / nrt_tensor_allocate is taken to count
    within the process's visible cores (NEURON_RT_VISIBLE_CORES), so a process
    pinned to one core uses index 0; the headers do not say so explicitly.
  - The order of entries in nrt_tensor_info_array_t is not documented (lexical by
    name, per AWS's own producers); callers bind tensors by name, never by their
    order in that array: the trn2 target names every NEFF tensor (neff_input_names /
    neff_output_names on the HLO module, see neuron.NeuronExecutable).
  - Struct layouts assume LP64 (x86_64 / aarch64 Linux): sizeof(nrt_tensor_info_t) == 296.
  - nrt_build_global_comm's vnc is "Local VNC (within the instance)" in nrt.h; it is given the same
    index as nrt_load (this process's first visible core), which the header does not confirm.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from dataclasses import dataclass
from pathlib import Path

from deepinfer.errors import DeepinferError

ENV_LIBRARY = "DEEPINFER_LIBNRT"
DEFAULT_PATH = "/opt/aws/neuron/lib/libnrt.so.1"

NRT_FRAMEWORK_TYPE_NO_FW = 1
NRT_TENSOR_PLACEMENT_DEVICE = 0
NRT_TENSOR_USAGE_INPUT, NRT_TENSOR_USAGE_OUTPUT = 0, 1
NRT_TENSOR_NAME_MAX = 256

# every NRT_STATUS of nrt_status.h (aws-neuron-sdk, src/libnrt/include/nrt/nrt_status.h)
STATUS_NAMES = {
    0: "NRT_SUCCESS",
    1: "NRT_FAILURE",
    2: "NRT_INVALID",
    3: "NRT_INVALID_HANDLE",
    4: "NRT_RESOURCE",
    5: "NRT_TIMEOUT",
    6: "NRT_HW_ERROR",
    7: "NRT_QUEUE_FULL",
    9: "NRT_LOAD_NOT_ENOUGH_NC",
    10: "NRT_UNSUPPORTED_NEFF_VERSION",
    11: "NRT_FAIL_HOST_MEM_ALLOC",
    13: "NRT_UNINITIALIZED",
    14: "NRT_CLOSED",
    15: "NRT_QUEUE_EMPTY",
    101: "NRT_EXEC_UNIT_DISABLED",
    1002: "NRT_EXEC_BAD_INPUT",
    1003: "NRT_EXEC_COMPLETED_WITH_NUM_ERR",
    1004: "NRT_EXEC_COMPLETED_WITH_ERR",
    1005: "NRT_EXEC_NC_BUSY",
    1006: "NRT_EXEC_OOB",
    1100: "NRT_COLL_PENDING",
    1200: "NRT_EXEC_HW_ERR_COLLECTIVES",
    1201: "NRT_EXEC_HW_ERR_HBM_UE",
    1202: "NRT_EXEC_HW_ERR_NC_UE",
    1203: "NRT_EXEC_HW_ERR_DMA_ABORT",
    1204: "NRT_EXEC_SW_NQ_OVERFLOW",
    1205: "NRT_EXEC_HW_ERR_REPAIRABLE_HBM_UE",
    1206: "NRT_NETWORK_PROXY_FAILURE",
}
NRT_UNSUPPORTED_NEFF_VERSION = 10
NRT_EXEC_COMPLETED_WITH_NUM_ERR = 1003


class NeuronRuntimeMissing(DeepinferError):
    """libnrt cannot be found or lacks a function this binding needs."""


class NeuronCollectivesError(DeepinferError):
    """A NEFF holding collectives cannot be loaded as this process is set up (its rendezvous
    variable, its rank in the world)."""


class NeuronRuntimeError(DeepinferError):
    """A libnrt call returned a status other than NRT_SUCCESS: its name from nrt_status.h, and
    the runtime's own words (nrt_get_status_as_str) where this libnrt has them."""

    def __init__(self, function: str, status: int, detail: str = "", text: str | None = None):
        self.function, self.status = function, status
        name = STATUS_NAMES.get(status, "unknown status")
        said = f", {text}" if text and text != name else ""
        super().__init__(
            f"{function} failed with NRT status {status} ({name}{said})" + (f": {detail}" if detail else "")
        )


class NeuronNumericalError(NeuronRuntimeError):
    """nrt_execute returned NRT_EXEC_COMPLETED_WITH_NUM_ERR: the model ran to the end but produced
    NaN. Treated as a failure, never as a result: the outputs hold NaN and the state pools the call
    wrote in place are suspect, so the step's logits are not sampled and the session must not go on
    (NaN never passes silently; the CPU path stops a sequence whose logits turn non-finite)."""


class NrtTensorInfo(ctypes.Structure):
    _fields_ = [
        ("name", ctypes.c_char * NRT_TENSOR_NAME_MAX),
        ("usage", ctypes.c_int),  # nrt_tensor_usage_t
        ("size", ctypes.c_size_t),  # bytes
        ("dtype", ctypes.c_int),  # nrt_dtype_t (release-dependent codes)
        ("shape", ctypes.POINTER(ctypes.c_uint32)),
        ("ndim", ctypes.c_uint32),
    ]


class NrtTensorInfoArray(ctypes.Structure):
    _fields_ = [("tensor_count", ctypes.c_uint64), ("tensor_array", NrtTensorInfo * 0)]  # C flexible array member


class NrtVersion(ctypes.Structure):
    _fields_ = [
        ("rt_major", ctypes.c_uint64),
        ("rt_minor", ctypes.c_uint64),
        ("rt_patch", ctypes.c_uint64),
        ("rt_maintenance", ctypes.c_uint64),
        ("rt_detail", ctypes.c_char * 128),
        ("git_hash", ctypes.c_char * 64),
    ]


@dataclass(frozen=True)
class TensorInfo:
    """One model input or output as nrt_get_model_tensor_info reports it."""

    name: str
    usage: str  # "input" | "output"
    size: int  # bytes
    dtype: int  # raw nrt_dtype_t code (see module docstring)
    shape: tuple[int, ...]


_P = ctypes.c_void_p
_PP = ctypes.POINTER(ctypes.c_void_p)
_STATUS = ctypes.c_int
_SIG = {  # name: (restype, argtypes)
    "nrt_init": (_STATUS, [ctypes.c_int, ctypes.c_char_p, ctypes.c_char_p]),
    "nrt_close": (None, []),
    "nrt_load": (_STATUS, [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int32, ctypes.c_int32, _PP]),
    "nrt_unload": (_STATUS, [_P]),
    "nrt_get_model_tensor_info": (_STATUS, [_P, ctypes.POINTER(ctypes.POINTER(NrtTensorInfoArray))]),
    "nrt_free_model_tensor_info": (_STATUS, [ctypes.POINTER(NrtTensorInfoArray)]),
    "nrt_tensor_allocate": (_STATUS, [ctypes.c_int, ctypes.c_int, ctypes.c_size_t, ctypes.c_char_p, _PP]),
    "nrt_tensor_allocate_slice": (_STATUS, [_P, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_char_p, _PP]),
    "nrt_tensor_free": (None, [_PP]),
    "nrt_tensor_write": (_STATUS, [_P, _P, ctypes.c_size_t, ctypes.c_size_t]),
    "nrt_tensor_read": (_STATUS, [_P, _P, ctypes.c_size_t, ctypes.c_size_t]),
    "nrt_tensor_get_size": (ctypes.c_size_t, [_P]),
    "nrt_allocate_tensor_set": (_STATUS, [_PP]),
    "nrt_add_tensor_to_tensor_set": (_STATUS, [_P, ctypes.c_char_p, _P]),
    "nrt_destroy_tensor_set": (None, [_PP]),
    "nrt_execute": (_STATUS, [_P, _P, _P]),
}
_OPTIONAL = {
    "nrt_get_version": (_STATUS, [ctypes.POINTER(NrtVersion), ctypes.c_size_t]),
    "nrt_get_status_as_str": (ctypes.c_char_p, [_STATUS]),
    # the load a NEFF holding collectives needs (nrt.h says plain nrt_load will not do for those);
    # optional: only bundles with collectives in their NEFFs call it
    "nrt_load_collectives": (
        _STATUS,
        [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int32, ctypes.c_int32, ctypes.c_uint32, ctypes.c_uint32, _PP],
    ),
    "nrt_build_global_comm": (_STATUS, [ctypes.c_int32, ctypes.c_uint32, ctypes.c_uint32]),
}
# the collectives' rendezvous (<ip>:<port>): mandatory for NEFFs with collectives, the same on every rank
ENV_ROOT_COMM = "NEURON_RT_ROOT_COMM_ID"

_FIX = f"install aws-neuronx-runtime-lib on a Trn2 host or set {ENV_LIBRARY} to the path of libnrt.so"


def find_library() -> str:
    """$DEEPINFER_LIBNRT, else the loader's search for "nrt", else the SDK's default path."""
    explicit = os.environ.get(ENV_LIBRARY)
    if explicit:
        if not Path(explicit).is_file():
            raise NeuronRuntimeMissing(
                f"Neuron runtime library not found: {ENV_LIBRARY}={explicit} is not a file; {_FIX}"
            )
        return explicit
    found = ctypes.util.find_library("nrt")
    if found:
        return found
    if Path(DEFAULT_PATH).is_file():
        return DEFAULT_PATH
    raise NeuronRuntimeMissing(
        f"Neuron runtime library not found (looked for ${ENV_LIBRARY}, find_library('nrt'), {DEFAULT_PATH}); {_FIX}"
    )


def _cstr(name: str | None) -> bytes | None:
    return None if name is None else name.encode()


class Libnrt:
    """The loaded library with every prototype declared; methods raise on any non-success status."""

    def __init__(self, path: str):
        try:
            self.dll = ctypes.CDLL(path)
        except OSError as e:
            raise NeuronRuntimeMissing(f"cannot load Neuron runtime library {path}: {e}; {_FIX}") from None
        self.path = path
        for name, (restype, argtypes) in {**_SIG, **_OPTIONAL}.items():
            try:
                fn = getattr(self.dll, name)
            except AttributeError:
                if name in _OPTIONAL:
                    continue
                raise NeuronRuntimeMissing(f"{path} does not export {name} (libnrt too old?); {_FIX}") from None
            fn.restype, fn.argtypes = restype, argtypes

    def _call(self, name: str, *args, detail: str = "") -> None:
        status = getattr(self.dll, name)(*args)
        if status != 0:
            error = NeuronNumericalError if status == NRT_EXEC_COMPLETED_WITH_NUM_ERR else NeuronRuntimeError
            raise error(name, status, detail, self.status_text(status))

    def status_text(self, status: int) -> str | None:
        """The runtime's description of a status (nrt_get_status_as_str), None where it has none."""
        if not hasattr(self.dll, "nrt_get_status_as_str"):
            return None
        text = self.dll.nrt_get_status_as_str(status)
        return text.decode(errors="replace") if text else None

    # -- runtime ---------------------------------------------------------------------------------

    def init(self) -> None:
        self._call("nrt_init", NRT_FRAMEWORK_TYPE_NO_FW, b"", b"")

    def close(self) -> None:
        self.dll.nrt_close()

    def version(self) -> str | None:
        """ "major.minor.patch.maintenance (detail)", or None when this libnrt has no nrt_get_version."""
        if not hasattr(self.dll, "nrt_get_version"):
            return None
        v = NrtVersion()
        self._call("nrt_get_version", ctypes.byref(v), ctypes.sizeof(v))
        detail = v.rt_detail.decode(errors="replace")
        return f"{v.rt_major}.{v.rt_minor}.{v.rt_patch}.{v.rt_maintenance}" + (f" ({detail})" if detail else "")

    # -- models ----------------------------------------------------------------------------------

    def load(self, neff: bytes, vnc: int, *, detail: str = "", collectives: tuple[int, int] | None = None) -> int:
        """nrt_load; the runtime judges the NEFF's format version (deepinfer does not second-guess
        it): NRT_UNSUPPORTED_NEFF_VERSION names the runtime's version and what to do.

        `collectives` (rank, world): a NEFF holding collectives, loaded with nrt_load_collectives as
        rank of world; NEURON_RT_ROOT_COMM_ID must be set (refused here, in one line, if not)."""
        model = ctypes.c_void_p()
        name = "nrt_load" if collectives is None else "nrt_load_collectives"
        try:
            if collectives is None:
                self._call(name, neff, len(neff), vnc, -1, ctypes.byref(model), detail=detail)
            else:
                rank, world = self._collectives(name, collectives, detail)
                self._call(name, neff, len(neff), vnc, -1, rank, world, ctypes.byref(model), detail=detail)
        except NeuronRuntimeError as e:
            if e.status != NRT_UNSUPPORTED_NEFF_VERSION:
                raise
            raise NeuronRuntimeError(
                name,
                e.status,
                f"{detail}: libnrt {self.version() or '(version unknown)'} "
                "does not load this NEFF's format; compile with the neuronx-cc of the "
                "Neuron SDK release that installed this runtime",
                self.status_text(e.status),
            ) from None
        return _handle(model, name)

    def build_global_comm(self, vnc: int, rank: int, world: int, *, detail: str = "") -> None:
        """nrt_build_global_comm: this process as `rank` of `world` in the communicator of every NEFF
        with collectives it will load (same checks as `load`'s `collectives`)."""
        name = "nrt_build_global_comm"
        self._call(name, vnc, *self._collectives(name, (rank, world), detail), detail=detail)

    def _collectives(self, name: str, collectives: tuple[int, int], detail: str) -> tuple[int, int]:
        """(rank, world) once a collective call `name` can be made: NEURON_RT_ROOT_COMM_ID set, the rank
        inside the world, the function exported; each refused in one line before libnrt is asked."""
        rank, world = collectives
        if not os.environ.get(ENV_ROOT_COMM):
            raise NeuronCollectivesError(
                f"{detail}: holds collectives and {ENV_ROOT_COMM} is not set: set it to one <ip>:<port> "
                "that every rank of the run shares (not the gloo port)"
            )
        if not 0 <= rank < world:
            raise NeuronCollectivesError(f"{detail}: rank {rank} is not one of the world's {world} ranks")
        if not hasattr(self.dll, name):
            raise NeuronRuntimeMissing(f"{self.path} does not export {name} (libnrt too old?); {_FIX}")
        return rank, world

    def unload(self, model: int) -> None:
        self._call("nrt_unload", model)

    def tensor_info(self, model: int) -> list[TensorInfo]:
        """Every input and output of `model`, in the order libnrt lists them."""
        arr = ctypes.POINTER(NrtTensorInfoArray)()
        self._call("nrt_get_model_tensor_info", model, ctypes.byref(arr))
        try:
            base = ctypes.addressof(arr.contents) + NrtTensorInfoArray.tensor_array.offset
            entries = ctypes.cast(base, ctypes.POINTER(NrtTensorInfo))
            return [_info(entries[i]) for i in range(arr.contents.tensor_count)]
        finally:
            self._call("nrt_free_model_tensor_info", arr)

    def execute(self, model: int, inputs: int, outputs: int, *, detail: str = "") -> None:
        self._call("nrt_execute", model, inputs, outputs, detail=detail)

    # -- tensors ---------------------------------------------------------------------------------

    def allocate(self, vnc: int, size: int, name: str | None) -> int:
        t = ctypes.c_void_p()
        self._call(
            "nrt_tensor_allocate",
            NRT_TENSOR_PLACEMENT_DEVICE,
            vnc,
            size,
            _cstr(name),
            ctypes.byref(t),
            detail=f"tensor {name!r}, {size} bytes",
        )
        return _handle(t, "nrt_tensor_allocate")

    def allocate_slice(self, source: int, offset: int, size: int, name: str | None) -> int:
        t = ctypes.c_void_p()
        self._call(
            "nrt_tensor_allocate_slice",
            source,
            offset,
            size,
            _cstr(name),
            ctypes.byref(t),
            detail=f"slice {name!r}, bytes [{offset}, {offset + size})",
        )
        return _handle(t, "nrt_tensor_allocate_slice")

    def free(self, tensor: int) -> None:
        self.dll.nrt_tensor_free(ctypes.byref(ctypes.c_void_p(tensor)))

    def write(self, tensor: int, buf: int, offset: int, size: int, *, detail: str = "") -> None:
        self._call("nrt_tensor_write", tensor, buf, offset, size, detail=detail)

    def read(self, tensor: int, buf: int, offset: int, size: int, *, detail: str = "") -> None:
        self._call("nrt_tensor_read", tensor, buf, offset, size, detail=detail)

    def size(self, tensor: int) -> int:
        return self.dll.nrt_tensor_get_size(tensor)

    # -- tensor sets -----------------------------------------------------------------------------

    def tensor_set(self) -> int:
        s = ctypes.c_void_p()
        self._call("nrt_allocate_tensor_set", ctypes.byref(s))
        return _handle(s, "nrt_allocate_tensor_set")

    def add_to_set(self, tensor_set: int, name: str, tensor: int) -> None:
        self._call("nrt_add_tensor_to_tensor_set", tensor_set, name.encode(), tensor, detail=f"tensor {name!r}")

    def destroy_set(self, tensor_set: int) -> None:
        self.dll.nrt_destroy_tensor_set(ctypes.byref(ctypes.c_void_p(tensor_set)))


def _handle(out: ctypes.c_void_p, fn: str) -> int:
    """The handle a libnrt call wrote on success; a NULL one is the runtime's fault, named."""
    if out.value is None:
        raise NeuronRuntimeError(fn, 0, "returned success and a NULL handle", "")
    return out.value


def _info(e: NrtTensorInfo) -> TensorInfo:
    shape = tuple(e.shape[k] for k in range(e.ndim)) if e.shape else ()
    usage = {NRT_TENSOR_USAGE_INPUT: "input", NRT_TENSOR_USAGE_OUTPUT: "output"}.get(e.usage, f"usage-{e.usage}")
    return TensorInfo(e.name.decode(), usage, e.size, e.dtype, shape)


_LOADED: dict[str, Libnrt] = {}


def open_library() -> Libnrt:
    """The process's libnrt (one `Libnrt` per resolved path)."""
    path = find_library()
    if path not in _LOADED:
        _LOADED[path] = Libnrt(path)
    return _LOADED[path]
