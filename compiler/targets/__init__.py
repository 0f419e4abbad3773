"""Targets: how a traced region becomes an executable, and which runtime backend runs it.

A target implements: `toolchain()` (versions for cache keys and the manifest),
`lower(ep)` (target-specific decompositions of the traced program), and
`compile(lowered, out)` (produce the executable file; may run in a worker
process). `EXECUTABLES` lists the executable kinds it can build.
"""

from deepinfer.compiler.targets.cpu import CpuTarget

TARGETS = {"cpu": CpuTarget}

__all__ = ["TARGETS"]
