"""The kernel registry: every custom op of deepinfer, its reference, its source.

Each kernel is a `torch.library` custom op in the `deepinfer` namespace, so
tracing keeps it as one node that a target can lower (inline the reference on
the cpu target, an NKI kernel on trn2). The pure-torch reference is also the
fake (meta) implementation: references are written without data-dependent
Python control flow, so they run on FakeTensors unchanged.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch._library.custom_ops import CustomOpDef

NAMESPACE = "deepinfer"


@dataclass(frozen=True)
class Kernel:
    name: str
    op: CustomOpDef  # the custom op (callable; ._opoverload is its OpOverload)
    reference: Callable  # pure-torch implementation
    source: Path  # file holding the reference, for cache keys

    @property
    def overload(self) -> torch._ops.OpOverload:
        return self.op._opoverload


KERNELS: dict[str, Kernel] = {}


def register(reference: Callable) -> CustomOpDef:
    """Turn a pure-torch reference into the custom op `deepinfer::<name>`.

    The op's schema comes from the reference's type annotations. Returns the op.
    """
    name = reference.__name__.removesuffix("_ref")
    op = torch.library.custom_op(f"{NAMESPACE}::{name}", mutates_args=())(reference)
    op.register_fake(reference)
    source = inspect.getsourcefile(reference)
    assert source is not None, f"kernel reference {reference.__qualname__} has no source file"
    KERNELS[name] = Kernel(name, op, reference, Path(source))
    return op


def reference_decompositions() -> dict:
    """OpOverload -> reference, for inlining every kernel before compiling."""
    return {k.overload: k.reference for k in KERNELS.values()}


# Per-target lowerings that replace a kernel's reference decomposition: target -> kernel name ->
# (is_available, lowering). On trn2 an NKI kernel would go here, used only where `nki` imports;
# none is registered yet, so every target inlines the references.
LOWERINGS: dict[str, dict[str, tuple[Callable[[], bool], Callable]]] = {"cpu": {}, "trn2": {}}


def target_decompositions(target: str) -> dict:
    """OpOverload -> the target's lowering where one is registered and available, else the reference."""
    table = reference_decompositions()
    for name, (available, lowering) in LOWERINGS.get(target, {}).items():
        if available():
            table[KERNELS[name].overload] = lowering
    return table
