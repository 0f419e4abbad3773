"""Tracing a region method with torch.export, weights and rank lifted into graph inputs.

AOTInductor constant-folds registered buffers into the generated code (a rank
buffer would bake rank 0 into every executable), so the traced module has no
parameters or buffers at all: a shell of the region whose weight tensors,
rank included, arrive as the first inputs of the graph. The region's own code
runs unchanged: the shell's attributes are the input tensors while it traces.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.export import Dim

from deepinfer.bundles.manifest import DECODE
from deepinfer.regions.base import Region
from deepinfer.regions.state import Geometry, InputSpec

# torch 2.13's export pickles tree specs through a deprecated isinstance check and warns
# once per executable; it says nothing about the user's model
warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*", category=FutureWarning)


@dataclass(frozen=True)
class Signature:
    """Flat, ordered inputs of an executable: weights (rank included) then the method's inputs."""

    weights: list[InputSpec]
    inputs: list[InputSpec]

    @property
    def all(self) -> list[InputSpec]:
        return self.weights + self.inputs


def weight_specs(region: Region) -> list[InputSpec]:
    return [
        InputSpec(name, tuple(t.shape), t.dtype, "rank" if name == "rank" else "weight")
        for name, t in region.named_buffers()
    ]


class Lifted(torch.nn.Module):
    """forward(*weights, *inputs) = region.<method>(*inputs) with the weights bound."""

    def __init__(self, region: Region, method: str = DECODE):
        super().__init__()
        shell = copy.copy(region)
        shell._buffers, shell._parameters, shell._modules = {}, {}, {}
        object.__setattr__(self, "shell", shell)  # not a submodule: nothing to lift as state
        self.names = [n for n, _ in region.named_buffers()]
        self.method = method

    def forward(self, *flat):
        n = len(self.names)
        shell = self.shell
        for name, t in zip(self.names, flat[:n]):
            shell.__dict__[name] = t
        try:
            return getattr(shell, self.method)(*flat[n:])
        finally:
            for name in self.names:
                shell.__dict__.pop(name, None)


def dynamic_dims(sig: Signature) -> tuple[dict[int, Dim] | None, ...]:
    """Pool sizes stay dynamic so the runtime may choose its block count and slots."""
    slots, blocks = Dim("slots", min=2), Dim("blocks", min=2)
    out: list[dict[int, Dim] | None] = []
    for spec in sig.all:
        if spec.role == "state":
            out.append({0: blocks if spec.name in ("ckv", "ikeys") else slots})
        else:
            out.append(None)
    return tuple(out)


def fake_inputs(mode: FakeTensorMode, specs: list[InputSpec]) -> list[torch.Tensor]:
    """Fake tensors of the specs' shapes and dtypes: no memory behind them, whatever the context."""
    with mode:
        return [torch.empty(s.shape, dtype=s.dtype) for s in specs]


def trace(
    region: Region, B: int, T: int, geometry: Geometry, method: str = DECODE, *, dynamic: bool = True
) -> tuple[torch.export.ExportedProgram, Signature]:
    """Export `region.<method>` for a [B, T] step -> (ExportedProgram, Signature).

    Nothing real-size is allocated: the region's weights are meta tensors (compiler/plan.py)
    and the graph is traced on fake tensors of the signature's shapes, weights and the
    method's inputs alike (at the 1M context one input alone would be 16 GiB of real data).
    Where a lowered graph is checked numerically, its example values are made there:
    `regions/examples.example_inputs(sig.inputs, geometry)`. The program keeps meta example
    inputs only (its shapes and dtypes), so a saved program holds no sample data. With
    `dynamic`, pool sizes (slots, blocks) stay symbolic; targets that need static shapes
    (trn2) trace with the geometry's own sizes."""
    sig = Signature(weight_specs(region), region.method_inputs(method, B, T, geometry))
    args = fake_inputs(FakeTensorMode(), sig.all)
    ep = torch.export.export(
        Lifted(region, method),
        tuple(args),
        dynamic_shapes={"flat": dynamic_dims(sig)} if dynamic else None,
        strict=False,
    )
    ep.example_inputs = (tuple(torch.empty(s.shape, dtype=s.dtype, device="meta") for s in sig.all), {})
    return ep, sig


def concrete_inputs(ep: torch.export.ExportedProgram) -> None:
    """Give a loaded program example inputs AOTInductor can compile with: uninitialised host
    tensors of the recorded shapes (never touched, so no memory is committed for them)."""
    args, kwargs = ep.example_inputs
    ep.example_inputs = (tuple(torch.empty(a.shape, dtype=a.dtype) for a in args), kwargs)
