"""A trn2 bundle on one NeuronCore: resident weights and pools, layer views as slices.

The session asks its placement for every tensor it keeps: weight stacks and
state pools are written to the device once (`resident`), and a layer's weights
or state are byte slices of them (`view`, nrt_tensor_allocate_slice: no copy).
Each NEFF is loaded once per (kind, bucket), whatever the number of layers;
its header is checked against the manifest first (LNC, version, identity).
State pools come back as aliased outputs: they are bound to the pool slice
itself, and the session sees only the region's own outputs. Those stay on the
device too (`DeviceValue`s passed to the next call as they are), except the
head's logits: per step, the host writes the token ids (to the embedding
region, whose table is a resident weight like any other) and the step's other
host inputs (each once, when it changed) and reads the logits back.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from deepinfer.bundles import neff
from deepinfer.bundles.manifest import DRAFT_MODULE, BundleError, Executable, Manifest, TensorSpec
from deepinfer.runtime.neuron.device import DeviceTensor, HostInputs, NeuronCore, NeuronExecutable

ENV_LNC = "NEURON_LOGICAL_NC_CONFIG"
# the region outputs the host reads (sampling); every other output (the streams h and pre, the
# selected indices, the candidate pool) stays on the device for the next region call
HOST_OUTPUTS = ("logits", "best")  # the head's slice, or its greedy pairs (`Head.best`)
# the draft head's: the block's tokens the scheduler verifies, and (several ranks) each block position's
# (value, index) pair the ranks all-gather (regions/picking.py); its normalized state stays for `project`;
# the draft step's one module's drafts (compiler/draft_layers.py)
DRAFT_HOST_OUTPUTS = ("drafts", "value", "index")


@dataclass
class DeviceStack:
    """A layer-major tensor on the device: rows of `row_bytes` each."""

    tensor: DeviceTensor
    rows: int
    row_bytes: int


def _spec(s: TensorSpec) -> tuple[str, tuple, torch.dtype]:
    return s.name, tuple(s.shape), getattr(torch, s.dtype)


class RegionCall:
    """A loaded NEFF as the session calls it: inputs in manifest order, the region's outputs back
    (the leading state outputs are written into the pools in place and dropped here)."""

    def __init__(self, exe: NeuronExecutable, n_state: int):
        self.exe, self.n_state = exe, n_state

    def __call__(self, inputs: list) -> list:
        return self.exe(inputs)[self.n_state :]


class NeuronPlacement:
    """Session placement for trn2: one NeuronCore per process (rank r uses core r unless
    NEURON_RT_VISIBLE_CORES is set by the launcher)."""

    host_values = False  # outputs stay on the device (`DeviceValue`s) but the logits

    def __init__(self, manifest: Manifest, bundle: Path, rank: int = 0):
        self.manifest, self.bundle = manifest, Path(bundle)
        self.lnc = manifest.topology.lnc or 1
        _set_lnc(self.lnc, self.bundle)
        self.core = NeuronCore(None if "NEURON_RT_VISIBLE_CORES" in os.environ else rank)
        self.rank = rank
        self.host_inputs = HostInputs(self.core)
        self.calls: list[RegionCall] = []
        # the kinds whose draft outputs the host reads: the draft's head, the draft step's one module
        self.draft_hosted = (manifest.draft.stages[-1]["head"].kind, DRAFT_MODULE) if manifest.draft else ()

    def resident(self, tensor: torch.Tensor, name: str) -> DeviceStack:
        t = tensor.contiguous()
        rows = t.shape[0] if t.dim() else 1
        return DeviceStack(DeviceTensor.from_torch(self.core, t, name), rows, t.numel() * t.element_size() // rows)

    def view(self, stack: DeviceStack, index: int) -> DeviceTensor:
        if not 0 <= index < stack.rows:
            raise IndexError(f"row {index} of a {stack.rows}-row device stack")
        return stack.tensor.slice(index * stack.row_bytes, stack.row_bytes, f"{stack.tensor.name}[{index}]")

    def load(self, entry: Executable, path: Path) -> RegionCall:
        header = neff.read_header(path)
        neff.check_loadable(header, lnc=self.lnc, path=path, recorded=entry.neff)
        outputs = [_spec(s) for s in entry.output_specs or ()]
        exe = NeuronExecutable(
            path,
            self.core,
            [s.name for s in entry.inputs],
            outputs,
            entry.aliases or {},
            host_outputs=HOST_OUTPUTS + (DRAFT_HOST_OUTPUTS if entry.kind in self.draft_hosted else ()),
            host_inputs=self.host_inputs,
            # a NEFF that sums over ranks itself is loaded for collectives, as this rank of the world
            collectives=(self.rank, self.manifest.topology.world_size) if entry.holds_collectives else None,
        )
        self.calls.append(RegionCall(exe, len(entry.state_outputs or ())))
        return self.calls[-1]

    def close(self) -> None:
        for call in self.calls:
            call.exe.close()
        self.host_inputs.close()
        self.core.close()


def _set_lnc(lnc: int, bundle: Path) -> None:
    """NEURON_LOGICAL_NC_CONFIG must equal the LNC the NEFFs were compiled for (the runtime's
    setting and neuronx-cc's --lnc must agree): set it when unset, refuse a different one."""
    current = os.environ.get(ENV_LNC)
    if current is not None and current.strip() != str(lnc):
        raise BundleError(
            f"{bundle}: {ENV_LNC}={current} but the bundle's NEFFs were compiled for LNC {lnc}; "
            f"unset it or set {ENV_LNC}={lnc} (or recompile with lnc = {current.strip()})"
        )
    os.environ[ENV_LNC] = str(lnc)
