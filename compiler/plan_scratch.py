"""The scratch figures of `deepinfer plan` (compiler/bundle_plan.py): from the compile cache's
trace records where it holds them, else from graphs traced here on fake tensors and lowered.

A kind without records is traced at its largest bucket (most rows per step), which bounds its other
buckets; the MoE also at its smallest batch bucket (at the largest tokens bucket), to show whether its
scratch depends on the rows per step.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass

from deepinfer.compiler import budget
from deepinfer.compiler.budget import human
from deepinfer.compiler.cache import artifact_keys, fetch_or_build
from deepinfer.compiler.executables import lower
from deepinfer.compiler.plan import Exe, RegionPlan
from deepinfer.compiler.spec import Spec

MOE = "moe"


@dataclass(frozen=True)
class GraphScratch:
    """One traced graph's scratch, as `budget.breakdown` reads an executable's."""

    name: str  # the executable's name: `<kind>.<method>.<bucket>`
    scratch_bytes: int

    @property
    def kind(self) -> str:
        return self.name.split(".", 1)[0]


def traced_buckets(executables: list[Exe], kinds=None) -> list[Exe]:
    """The graphs a plan traces: each (kind, method)'s largest bucket (most rows; more tokens, then the
    largest context bucket on a tie), and the MoE's smallest batch bucket at its largest tokens
    bucket; only `kinds` when given. Executables are (kind, method, batch, tokens, context)."""
    out = []
    for kind, method in dict.fromkeys((e[0], e[1]) for e in executables if kinds is None or e[0] in kinds):
        mine = [e for e in executables if (e[0], e[1]) == (kind, method)]
        top = max(mine, key=lambda e: (e[2] * e[3], e[3], e[4] or 0))
        out.append(top)
        if kind == MOE:
            low = min((e for e in mine if e[3] == top[3]), key=lambda e: e[2])
            if low != top:
                out.append(low)
    return out


def trace_scratch(spec: Spec, regions: RegionPlan, executables, log, kinds=None) -> dict[str, int]:
    """executable name -> peak intermediate bytes of its lowered graph (compiler/budget.scratch_bytes)."""
    out = {}
    for exe in traced_buckets(executables, kinds):
        name = exe.name
        start = time.perf_counter()
        graph = lower(spec, regions, exe)
        out[name] = budget.scratch_bytes(graph.program)
        del graph
        gc.collect()
        log(f"traced {name}: scratch {human(out[name])} ({time.perf_counter() - start:.1f} s)")
    return out


def recorded_scratch(spec: Spec, regions: RegionPlan, executables, cache) -> dict[str, int]:
    """executable name -> scratch bytes, from the trace records the compile cache holds for them."""
    out = {}
    for e in executables:
        record = fetch_or_build.trace_record(cache, artifact_keys.trace_key(spec, regions, e))
        n = record["entry"].get("scratch_bytes") if record is not None else None
        if n is not None:
            out[e.name] = n
    return out
