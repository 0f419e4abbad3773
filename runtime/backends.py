"""Runtime backends: load an executable file, call it with a flat list of tensors.

`cpu` runs AOTInductor packages (through the package loader's boxed call,
without the pytree round trip of its Python wrapper) and saved
ExportedPrograms in-process. Trn2 bundles need the Neuron runtime backend.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from deepinfer.bundles.manifest import BundleError


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
            self.module = torch.export.load(str(path)).module(check_guards=False)

    def __call__(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        out = self.module(*inputs)
        return list(out) if isinstance(out, (tuple, list)) else [out]


LOADERS = {("cpu", "aoti"): AotiExecutable, ("cpu", "exported"): ExportedExecutable}


def check_compatible(manifest: dict, bundle: Path) -> None:
    """Refuse, with the reason, a bundle this process cannot run."""
    target = manifest["target"]
    key = (target.get("name"), target.get("executable"))
    if key not in LOADERS:
        runnable = ", ".join(f"{t}/{e}" for t, e in LOADERS)
        raise BundleError(f"{bundle}: built for target {key[0]!r} ({key[1]}); this runtime runs {runnable}"
                          + (" (trn2 bundles need the Neuron runtime on a Trn2 host)" if key[0] == "trn2" else ""))
    built = manifest["toolchain"].get("torch")
    if built != torch.__version__:
        raise BundleError(f"{bundle}: compiled with torch {built}, this process has torch {torch.__version__}; "
                          "recompile the bundle with this torch")


def load_executable(manifest: dict, path: Path):
    t = manifest["target"]
    return LOADERS[(t["name"], t["executable"])](path)
