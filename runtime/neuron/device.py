"""The Neuron runtime backend: one NeuronCore per process, device tensors, loaded NEFFs.

Built on the ctypes binding in `libnrt.py`. Resident tensors (weight stacks,
state pools) are allocated once and bound as `DeviceTensor`s; a layer's view
into a layer-major stack is a slice (nrt_tensor_allocate_slice), not a copy.
Host per-step inputs are copied into reusable staging tensors (`HostInputs`,
written only when their bytes change), and outputs that feed the next region
call stay on the device (`DeviceValue`): `NeuronExecutable` has the call API
of the executables in `backends.py`.

Core selection: libnrt reads NEURON_RT_VISIBLE_CORES once, at nrt_init, and
reserves those cores for this process. `NeuronCore(core=k)` pins the process
to physical core k by setting NEURON_RT_VISIBLE_CORES=k when it is unset; the
core is then index 0 among the visible ones, which is the index given to
nrt_load and nrt_tensor_allocate. With `core=None` the environment decides and
the first visible core is used. One process per NeuronCore.

NEFFs that hold collectives (loaded for a rank of a world) wait inside libnrt for every rank: the
process's communicator is built once before the first of them (nrt_build_global_comm), and that,
their loads and their executions are bounded by the rank's arrival watch (`arrival.watched`,
installed by `collectives.prepare`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch

from deepinfer.bundles.neff import output_name
from deepinfer.errors import DeepinferError
from deepinfer.runtime.neuron import arrival
from deepinfer.runtime.neuron.libnrt import Libnrt, NeuronCollectivesError, TensorInfo, open_library

ENV_VISIBLE = "NEURON_RT_VISIBLE_CORES"


class NeuronArgumentError(DeepinferError):
    """A tensor handed to the Neuron backend does not fit what the model or tensor expects."""


class NeuronCore:
    """nrt_init on entry, nrt_close on close (after freeing what this core still holds)."""

    _active: NeuronCore | None = None  # nrt_init is once per process

    def __init__(self, core: int | None = None, *, lib: Libnrt | None = None):
        if NeuronCore._active is not None:
            raise NeuronArgumentError(
                "the Neuron runtime is already initialized in this process "
                f"({NeuronCore._active}); one process per NeuronCore: close it first"
            )
        _pin_visible_core(core)
        self.lib = lib or open_library()
        self.physical = core
        self.vnc = 0  # index among the visible cores
        self.lib.init()
        NeuronCore._active = self
        self.version = self.lib.version()
        self._tensors: list[DeviceTensor] = []  # live, allocation order
        self._models: list[NeuronModel] = []
        self.comm: tuple[int, int] | None = None  # (rank, world) once the collectives' communicator is built

    def __repr__(self) -> str:
        visible = os.environ.get(ENV_VISIBLE, "all")
        return f"NeuronCore({ENV_VISIBLE}={visible}, vnc {self.vnc}, libnrt {self.lib.path})"

    def close(self) -> None:
        """Unload models, free tensors (slices before their parents), then nrt_close."""
        if NeuronCore._active is not self:
            return
        for model in list(self._models):
            model.unload()
        for t in reversed(list(self._tensors)):
            t.free()
        self.lib.close()
        NeuronCore._active = None

    def join_collectives(self, rank: int, world: int, detail: str) -> None:
        """Build this process's collectives communicator as `rank` of `world` (once; every rank
        waits for all the others here, bounded by the arrival watch). `detail`: what needs it."""
        self._check_open()
        if self.comm == (rank, world):
            return
        if self.comm is not None:
            raise NeuronCollectivesError(
                f"{detail}: loaded as rank {rank} of {world}, but this process already joined the "
                f"collectives as rank {self.comm[0]} of {self.comm[1]}; one rank per process"
            )
        with arrival.watched("the collectives' set-up (nrt_build_global_comm)"):
            self.lib.build_global_comm(self.vnc, rank, world, detail=detail)
        self.comm = (rank, world)

    def __enter__(self) -> NeuronCore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if NeuronCore._active is not self:
            raise NeuronArgumentError(f"{self} is closed")


def _pin_visible_core(core: int | None) -> None:
    if core is None:
        return
    visible = os.environ.get(ENV_VISIBLE)
    if visible is None:
        os.environ[ENV_VISIBLE] = str(core)
    elif visible.strip() != str(core):
        raise NeuronArgumentError(
            f"{ENV_VISIBLE}={visible} but NeuronCore {core} was asked for; one process "
            f"per NeuronCore: set {ENV_VISIBLE}={core} or leave it unset"
        )


def _host_bytes(tensor: torch.Tensor, what: str) -> int:
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise NeuronArgumentError(
            f"{what}: expected a contiguous CPU tensor, got device {tensor.device}, "
            f"contiguous={tensor.is_contiguous()}; call .contiguous().cpu() first"
        )
    return tensor.numel() * tensor.element_size()


class DeviceTensor:
    """An nrt_tensor_t* on one NeuronCore: an allocation, or a slice (view) of another DeviceTensor."""

    def __init__(self, core: NeuronCore, handle: int, nbytes: int, name: str, parent: DeviceTensor | None = None):
        self.core, self.nbytes, self.name, self.parent = core, nbytes, name, parent
        self.handle: int | None = handle  # None once freed
        self.slices: list[DeviceTensor] = []
        core._tensors.append(self)
        if parent is not None:
            parent.slices.append(self)

    def __repr__(self) -> str:
        return f"DeviceTensor({self.name!r}, {self.nbytes} bytes" + (", freed)" if self.handle is None else ")")

    @classmethod
    def allocate(cls, core: NeuronCore, nbytes: int, name: str) -> DeviceTensor:
        core._check_open()
        return cls(core, core.lib.allocate(core.vnc, nbytes, name), nbytes, name)

    @classmethod
    def from_torch(cls, core: NeuronCore, tensor: torch.Tensor, name: str) -> DeviceTensor:
        """A new device tensor holding `tensor`'s bytes (any dtype; contiguous, on the CPU)."""
        t = cls.allocate(core, _host_bytes(tensor, name), name)
        try:
            t.write_from(tensor)
        except Exception:
            t.free()
            raise
        return t

    def _live(self) -> int:
        if self.handle is None:
            raise NeuronArgumentError(f"{self!r} was freed")
        return self.handle

    def write_from(self, tensor: torch.Tensor) -> None:
        """Copy `tensor`'s bytes into this device tensor; the sizes must match exactly."""
        n = _host_bytes(tensor, self.name)
        if n != self.nbytes:
            raise NeuronArgumentError(
                f"tensor {self.name!r}: writing {n} bytes ({tuple(tensor.shape)} "
                f"{tensor.dtype}) into {self.nbytes} bytes"
            )
        if n:
            self.core.lib.write(self._live(), tensor.data_ptr(), 0, n, detail=f"tensor {self.name!r}")

    def to_torch(self, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        """Read the whole tensor back as a new CPU tensor of `shape` and `dtype`."""
        out = torch.empty(tuple(shape), dtype=dtype)
        n = out.numel() * out.element_size()
        if n != self.nbytes:
            raise NeuronArgumentError(
                f"tensor {self.name!r}: {tuple(shape)} {dtype} is {n} bytes, the device tensor holds {self.nbytes}"
            )
        if n:
            self.core.lib.read(self._live(), out.data_ptr(), 0, n, detail=f"tensor {self.name!r}")
        return out

    def slice(self, offset: int, nbytes: int, name: str) -> DeviceTensor:
        """A view of bytes [offset, offset + nbytes) sharing this tensor's storage (no copy)."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise NeuronArgumentError(
                f"slice {name!r}: bytes [{offset}, {offset + nbytes}) are outside "
                f"tensor {self.name!r} of {self.nbytes} bytes"
            )
        handle = self.core.lib.allocate_slice(self._live(), offset, nbytes, name)
        return DeviceTensor(self.core, handle, nbytes, name, parent=self)

    def free(self) -> None:
        """nrt_tensor_free; the tensor's slices must be freed first (they point into its storage)."""
        if self.handle is None:
            return
        if any(s.handle is not None for s in self.slices):
            raise NeuronArgumentError(
                f"tensor {self.name!r} still has live slices "
                f"{[s.name for s in self.slices if s.handle is not None]}; free them first"
            )
        self.core.lib.free(self.handle)
        self.handle = None
        self.core._tensors.remove(self)


class NeuronModel:
    """A NEFF loaded on one NeuronCore, with the input and output tensors libnrt reports for it."""

    def __init__(
        self, core: NeuronCore, handle: int, info: list[TensorInfo], path: Path, collectives: tuple[int, int] | None
    ):
        self.core, self.path, self.collectives = core, path, collectives
        self.handle: int | None = handle  # None once unloaded
        self.inputs = [i for i in info if i.usage == "input"]
        self.outputs = [i for i in info if i.usage == "output"]
        core._models.append(self)

    @classmethod
    def load(cls, core: NeuronCore, neff_path: str | Path, collectives: tuple[int, int] | None = None) -> NeuronModel:
        """Load a NEFF; one holding collectives as rank `collectives[0]` of `collectives[1]`."""
        core._check_open()
        path = Path(neff_path)
        neff = path.read_bytes()
        if collectives is None:
            handle = core.lib.load(neff, core.vnc, detail=str(path))
        else:
            core.join_collectives(*collectives, detail=str(path))
            with arrival.watched(f"load of {path.name}"):
                handle = core.lib.load(neff, core.vnc, detail=str(path), collectives=collectives)
        return cls(core, handle, core.lib.tensor_info(handle), path, collectives)

    def unload(self) -> None:
        if self.handle is None:
            return
        self.core.lib.unload(self.handle)
        self.handle = None
        self.core._models.remove(self)

    def execute(self, inputs: Sequence[DeviceTensor], outputs: Sequence[DeviceTensor]) -> None:
        """Run once; `inputs` and `outputs` follow the order of `self.inputs` and `self.outputs`."""
        if self.handle is None:
            raise NeuronArgumentError(f"{self.path}: the model was unloaded")
        handle = self.handle
        self._bind_check("input", self.inputs, inputs)
        self._bind_check("output", self.outputs, outputs)
        lib = self.core.lib
        sets = []
        try:  # tensor sets are rebuilt each call: two small host allocations, no device traffic
            for infos, tensors in ((self.inputs, inputs), (self.outputs, outputs)):
                sets.append(lib.tensor_set())
                for info, t in zip(infos, tensors):
                    lib.add_to_set(sets[-1], info.name, t._live())
            if self.collectives is None:
                lib.execute(handle, sets[0], sets[1], detail=str(self.path))
            else:  # every rank takes part
                with arrival.watched(f"execute of {self.path.name}"):
                    lib.execute(handle, sets[0], sets[1], detail=str(self.path))
        finally:
            for s in sets:
                lib.destroy_set(s)

    def _bind_check(self, usage: str, infos: list[TensorInfo], tensors: Sequence[DeviceTensor]) -> None:
        if len(tensors) != len(infos):
            raise NeuronArgumentError(
                f"{self.path}: {len(tensors)} {usage}s given, the model takes {len(infos)}: {[i.name for i in infos]}"
            )
        for info, t in zip(infos, tensors):
            if t.nbytes != info.size:
                raise NeuronArgumentError(
                    f"{self.path}: {usage} {info.name!r} is bound to {t!r}, the model expects {info.size} bytes"
                )


def _name(entry: str | dict) -> str:
    return entry["name"] if isinstance(entry, dict) else entry


class DeviceValue:
    """An executable's output left on the device: its output buffer, valid until that executable
    runs again (which overwrites the buffer). Passed as another call's input, it is bound as it is,
    with no copy through the host; `to_torch` reads it back."""

    def __init__(self, tensor: DeviceTensor, shape: Sequence[int], dtype: torch.dtype, producer: NeuronExecutable):
        self.tensor, self.shape, self.dtype, self.producer = tensor, torch.Size(shape), dtype, producer
        self.call = producer.calls

    def __repr__(self) -> str:
        return f"DeviceValue({self.tensor.name!r}, {tuple(self.shape)} {self.dtype}, call {self.call})"

    def current(self) -> bool:
        return self.producer.calls == self.call

    def to_torch(self) -> torch.Tensor:
        if not self.current():
            raise NeuronArgumentError(f"{self!r} was overwritten by a later call of {self.producer.model.path}")
        return self.tensor.to_torch(self.dtype, self.shape)


class HostInputs:
    """Device buffers of the host inputs of a placement's executables, shared by all of them: one per
    (name, bytes). Each keeps a host copy of what it holds, so an input equal to it (a step's
    positions, slots, block table, given to every layer's region) is written once, not once a call."""

    def __init__(self, core: NeuronCore):
        self.core = core
        self.buffers: dict[tuple[str, int], tuple[DeviceTensor, torch.Tensor]] = {}

    def stage(self, name: str, x: torch.Tensor) -> DeviceTensor:
        x = x.contiguous()
        key = (name, _host_bytes(x, name))
        if key in self.buffers:
            buf, held = self.buffers[key]
            if held.dtype == x.dtype and torch.equal(held, x):
                return buf
        else:
            buf = DeviceTensor.allocate(self.core, key[1], f"in:{name}")
        buf.write_from(x)
        self.buffers[key] = (buf, x.clone())
        return buf

    def close(self) -> None:
        for buf, _ in self.buffers.values():
            buf.free()
        self.buffers.clear()


class NeuronExecutable:
    """backends.py's call API over a NeuronModel: `exe(inputs) -> outputs`.

    signature: the executable's inputs in call order (manifest entries with "name", or
    names). out_specs: (name, shape, dtype) per output. aliases: {output index: input
    index} for outputs written in place into a state input; those are bound to that
    input's DeviceTensor and returned as it, without a read back. host_outputs: the
    names of the outputs read back to the host (None: all); the others come back as
    `DeviceValue`s, left on the device for the next region call. host_inputs: where
    host tensors given as inputs are staged (shared between executables; by default
    this executable's own).

    Binding is by name: the NEFF's input tensors carry the manifest's input names and its
    outputs `neff.output_name(name)` (the trn2 target stamps them on the HLO module as
    neff_input_names / neff_output_names), whatever order libnrt lists them in.
    """

    def __init__(
        self,
        path: str | Path,
        core: NeuronCore,
        signature: Sequence[str | dict],
        out_specs: Sequence[tuple[str, Sequence[int], torch.dtype]],
        aliases: dict | None = None,
        *,
        host_outputs: Sequence[str] | None = None,
        host_inputs: HostInputs | None = None,
        collectives: tuple[int, int] | None = None,
    ):
        self.model = NeuronModel.load(core, path, collectives)
        self.core, self.names = core, [_name(s) for s in signature]
        self.out_specs = [(n, tuple(s), d) for n, s, d in out_specs]
        self.aliases = {int(o): int(i) for o, i in (aliases or {}).items()}  # JSON keys are strings
        self.host_outputs = {n for n, _, _ in self.out_specs} if host_outputs is None else set(host_outputs)
        self.own_inputs = host_inputs is None
        self.host_inputs = HostInputs(core) if host_inputs is None else host_inputs
        self.out_buffers: dict[int, DeviceTensor] = {}
        self.calls = 0
        try:
            self.in_pos = _positions(self.model, "input", self.model.inputs, self.names)
            self.out_pos = _positions(
                self.model, "output", self.model.outputs, [output_name(n) for n, _, _ in self.out_specs]
            )
            for j in range(len(self.out_specs)):
                if j not in self.aliases:
                    self.out_buffers[j] = self._out_buffer(j)
        except Exception:
            self.close()
            raise

    def close(self) -> None:
        """Free the output buffers (and this executable's own input staging) and unload the model
        (resident inputs and shared staging are the caller's)."""
        for t in self.out_buffers.values():
            t.free()
        self.out_buffers.clear()
        if self.own_inputs:
            self.host_inputs.close()
        self.model.unload()

    def _out_buffer(self, j: int) -> DeviceTensor:
        name, shape, dtype = self.out_specs[j]
        size = self.model.outputs[self.out_pos[j]].size
        want = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if want != size:
            raise NeuronArgumentError(
                f"{self.model.path}: output {name!r} declared {shape} {dtype} ({want} bytes), "
                f"the model writes {size} bytes"
            )
        return DeviceTensor.allocate(self.core, size, f"out:{name}")

    def _stage(self, i: int, x: torch.Tensor | DeviceTensor | DeviceValue) -> DeviceTensor:
        if isinstance(x, DeviceTensor):
            return x  # resident: weights, state pools
        if isinstance(x, DeviceValue):  # another call's output, still on the device
            if not x.current():
                raise NeuronArgumentError(
                    f"input {self.names[i]!r}: {x!r} was overwritten by a later call of {x.producer.model.path}"
                )
            if x.producer is self:
                raise NeuronArgumentError(
                    f"input {self.names[i]!r}: {x!r} is this executable's own output buffer, "
                    "which the call would overwrite while reading it"
                )
            return x.tensor
        return self.host_inputs.stage(self.names[i], x)

    def __call__(self, inputs: list) -> list:
        if len(inputs) != len(self.names):
            raise NeuronArgumentError(f"{self.model.path}: {len(inputs)} inputs given, expected {self.names}")
        bound = [self._stage(i, x) for i, x in enumerate(inputs)]
        outs = []
        for j, (name, _, _) in enumerate(self.out_specs):
            if j in self.aliases:
                if not isinstance(inputs[self.aliases[j]], DeviceTensor):
                    raise NeuronArgumentError(
                        f"output {name!r} aliases input {self.names[self.aliases[j]]!r}, "
                        "which must be a resident DeviceTensor"
                    )
                outs.append(bound[self.aliases[j]])
            else:
                outs.append(self.out_buffers[j])
        self.model.execute(_reorder(bound, self.in_pos), _reorder(outs, self.out_pos))
        self.calls += 1
        return [
            outs[j]
            if j in self.aliases
            else outs[j].to_torch(dtype, shape)
            if name in self.host_outputs
            else DeviceValue(outs[j], shape, dtype, self)
            for j, (name, shape, dtype) in enumerate(self.out_specs)
        ]


def _positions(model: NeuronModel, usage: str, infos: list[TensorInfo], names: list[str]) -> list[int]:
    """For each of our names (call order), the index of its tensor in the model's own list."""
    index = {i.name: k for k, i in enumerate(infos)}
    if len(index) == len(infos) and set(index) == set(names) and len(set(names)) == len(names):
        return [index[n] for n in names]
    unknown = [n for n in names if n not in index]
    missing = [i.name for i in infos if i.name not in names]
    raise NeuronArgumentError(
        f"{model.path}: {usage} names {names} do not match the model's "
        f"{[i.name for i in infos]} (unknown {unknown}, unbound {missing}); the NEFF's tensors "
        "must carry the manifest's names (neff_input_names / neff_output_names): recompile"
    )


def _reorder(tensors: list[DeviceTensor], positions: list[int]) -> list[DeviceTensor]:
    out: list = [None] * len(tensors)
    for t, p in zip(tensors, positions):
        out[p] = t
    return out
