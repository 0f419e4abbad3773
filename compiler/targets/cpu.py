"""The cpu target: AOTInductor packages (or saved ExportedPrograms) run in-process.

Lowering inlines every deepinfer kernel's pure-torch reference before
Inductor sees the graph, so Inductor fuses it: an opaque custom-op call from
compiled code would go back through Python.
"""

from __future__ import annotations

import platform
from pathlib import Path

import torch

import deepinfer
from deepinfer.kernels import reference_decompositions


class CpuTarget:
    name = "cpu"
    EXECUTABLES = ("aoti", "exported")
    suffix = ".pt2"

    def __init__(self, executable: str = "aoti", options: dict | None = None):
        self.executable = executable
        self.options = dict(options or {})

    def toolchain(self) -> dict[str, str]:
        return {"deepinfer": deepinfer.__version__, "torch": torch.__version__,
                "python": platform.python_version(), "machine": platform.machine()}

    def lower(self, ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
        return ep.run_decompositions(reference_decompositions())

    def compile(self, lowered: Path, out: Path) -> None:
        """`lowered`: a saved ExportedProgram -> the executable at `out`."""
        if self.executable == "exported":
            out.write_bytes(Path(lowered).read_bytes())
            return
        ep = torch.export.load(str(lowered))
        torch._inductor.aoti_compile_and_package(ep, package_path=str(out))
