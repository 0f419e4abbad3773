"""Runtime backends: load an executable file, call it with a flat list of tensors.

`cpu` runs AOTInductor packages (through the package loader's boxed call,
without the pytree round trip of its Python wrapper) and saved
ExportedPrograms in-process. Trn2 bundles need the Neuron runtime backend.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch

from deepinfer.bundles.manifest import BundleError, Executable, Manifest
from deepinfer.bundles.pt2 import load_exported


class AotiExecutable:
    def __init__(self, path: Path):
        self.loader = torch._inductor.aoti_load_package(str(path)).loader

    def __call__(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        return self.loader.boxed_run(inputs)


class ExportedExecutable:
    def __init__(self, path: Path):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # shapes are checked by the runtime against the manifest; the per-call guard
            # evaluation of module() costs ~0.1 s a call with dynamic pool sizes
            self.module = load_exported(path).module(check_guards=False)

    def __call__(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        out = self.module(*inputs)
        return list(out) if isinstance(out, (tuple, list)) else [out]


LOADERS = {("cpu", "aoti"): AotiExecutable, ("cpu", "exported"): ExportedExecutable}
RUNNABLE = (*LOADERS, ("trn2", "neff"))


class Placement(Protocol):
    """Where a bundle's tensors live and its executables run (host memory, or a NeuronCore).
    `host_values`: whether executables' outputs are host tensors the runtime may index (a prompt
    step's head on each sequence's last fed row, `regions.step.head_rows`); a NeuronCore's stay on
    the device, so its head runs on every row and the host picks the rows of the logits."""

    host_values: bool

    def resident(self, tensor: torch.Tensor, name: str) -> torch.Tensor: ...

    def view(self, stack: torch.Tensor, index: int) -> torch.Tensor: ...

    def load(self, entry: Executable, path: Path) -> Callable[[list], list]: ...

    def close(self) -> None: ...


class HostPlacement:
    """Where a cpu bundle's tensors live: host memory. Weight views are views of the
    memory-mapped stacks; executables write state in place and return only their outputs."""

    host_values = True

    def __init__(self, manifest: Manifest, bundle: Path, rank: int = 0):
        self.loader = LOADERS[(manifest.target.name, manifest.target.executable)]

    def resident(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        return tensor

    def view(self, stack: torch.Tensor, index: int) -> torch.Tensor:
        return stack[index]

    def load(self, entry: Executable, path: Path):
        return self.loader(path)

    def close(self) -> None:
        pass


def _neuron_placement(manifest: Manifest, bundle: Path, rank: int = 0):
    from deepinfer.runtime.neuron.placement import NeuronPlacement  # libnrt only where trn2 bundles run

    return NeuronPlacement(manifest, bundle, rank)


PLACEMENTS = {"cpu": HostPlacement, "trn2": _neuron_placement}


def placement_for(manifest: Manifest, bundle: Path, rank: int = 0) -> Placement:
    """The placement that runs this bundle: host memory, or one NeuronCore per process on trn2."""
    return PLACEMENTS[manifest.target.name](manifest, bundle, rank)


def check_compatible(manifest: Manifest, bundle: Path) -> None:
    """Refuse, with the reason, a bundle this process cannot run."""
    key = (manifest.target.name, manifest.target.executable)
    if key not in RUNNABLE:
        runnable = ", ".join(f"{t}/{e}" for t, e in RUNNABLE)
        raise BundleError(f"{bundle}: built for target {key[0]!r} ({key[1]}); this runtime runs {runnable}")
    if manifest.stage != "executable":
        raise BundleError(
            f"{bundle}: an HLO-stage bundle (no NEFFs yet); finish it on a host with neuronx-cc: "
            f"deepinfer-compile --finish {bundle}"
        )
    built = manifest.toolchain.get("torch")
    if key[0] == "cpu" and built != torch.__version__:
        raise BundleError(
            f"{bundle}: compiled with torch {built}, this process has torch {torch.__version__}; "
            "recompile the bundle with this torch"
        )
