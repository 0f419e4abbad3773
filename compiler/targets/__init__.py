"""Targets: how a traced region becomes an executable, and which runtime backend runs it.

A target implements: `toolchain()` (versions for cache keys and the manifest),
`lower(ep)` (target-specific decompositions of the traced program), and
`emit(ep, input names, output names, out)` (write what a compile job reads; returns extra manifest
fields), `compile(lowered, out, log=, name=)` (produce the executable file; may
run in a worker process). `EXECUTABLES` lists the executable kinds it can build;
`static_shapes` says whether pools are traced at their compiled sizes.
"""

from deepinfer.compiler.targets.cpu import CpuTarget
from deepinfer.compiler.targets.trn2 import Trn2Target

TARGETS = {"cpu": CpuTarget, "trn2": Trn2Target}

__all__ = ["TARGETS"]
