"""Targets: how a traced region becomes an executable, and which runtime backend runs it.

Every target implements `Target`; the pipeline, the budget and the cache keys ask
it, never its name. `TARGETS` is the registry (its keys are model.toml's
`[target] name` choices).
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Protocol

import torch

from deepinfer.compiler.targets.cpu import CpuTarget
from deepinfer.compiler.targets.trn2 import Trn2Target
from deepinfer.compiler.targets.trn2_figures import Figure


class Target(Protocol):
    name: ClassVar[str]
    recipe: ClassVar[str]  # its weight recipe (compiler/weights.RECIPES)
    EXECUTABLES: ClassVar[tuple[str, ...]]  # the executable kinds it builds (the first is the default)
    LOWERING_MODULES: ClassVar[tuple[str, ...]]  # the modules whose source shapes its executables
    LOG_OPTIONS: ClassVar[tuple[str, ...]]  # options that only change logs or checks (never keyed)
    suffix: ClassVar[str]  # the executable's file suffix
    lowered_suffix: ClassVar[str]  # what a compile job reads (and an HLO-stage bundle holds)
    static_shapes: ClassVar[bool]  # pools traced at their compiled sizes, state returned
    state_writes: ClassVar[str]  # how executables write state (recorded in the manifest)
    device_embedding: ClassVar[bool]  # the token embedding is a region (ids in), not a host lookup
    graph_collectives: bool  # the ranks' boundary all-reduces run inside the executables
    fused_layers: bool  # one executable per layer (compiler/layers.py), not per region call
    executable: str
    options: dict
    check: bool  # run the lowered graph against its reference region

    def __init__(self, executable: str = ..., options: dict | None = None) -> None: ...

    @property
    def lnc(self) -> int | None:
        """The logical NeuronCore size (trn2; None elsewhere), recorded with the topology."""

    @staticmethod
    def check_options(options: dict) -> str | None:
        """A message for the first bad [target] option, else None."""

    def keyed_options(self) -> dict: ...

    def toolchain(self) -> dict[str, str]:
        """Versions that change what is built (cache keys, the manifest)."""

    def device_memory(self) -> tuple[int | None, str]:
        """(bytes of device memory per rank, where the number comes from); None: no limit."""

    def step_figures(self) -> dict[str, Figure] | None:
        """One rank's hardware figures for the decode step's cost model (compiler/step_cost.py);
        None: the target has no such model."""

    def lower(self, ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram: ...

    def emit(
        self,
        ep: torch.export.ExportedProgram,
        names: list[str],
        outputs: list[str],
        out: Path,
        reduce: dict[str, list[list[int]]] | None = None,
    ) -> dict:
        """Write what a compile job reads; returns extra manifest fields of the executable. `reduce`
        {output: replica groups}: outputs to sum over rank groups inside the executable (targets
        whose `graph_collectives` is true)."""

    def check_numerics(
        self,
        lowered: Path,
        region,
        method: str,
        inputs: list,
        names: list[str],
        state_outputs: list[str],
        where: str,
        seed: int = 0,
        reduce: dict[str, list[list[int]]] | None = None,
    ) -> dict:
        """Run the lowered module against `region` on the method's `inputs` and seeded random weights."""

    def require_compiler(self) -> None: ...

    def describe(self, executable: Path) -> dict:
        """Facts of a built executable for its manifest entry."""

    def compile(self, lowered: Path, out: Path, *, log: Path | None = None, name: str = "") -> None: ...


TARGETS: dict[str, type[Target]] = {"cpu": CpuTarget, "trn2": Trn2Target}

__all__ = ["TARGETS", "Target"]
