"""What a layer kind compiled per region costs a decode step (compiler/fallback.py's fallback).

A fused layer is one device execution with its collectives inside (compiler/layers.py). A layer kind
neuronx-cc refused runs per region: a call per region and divided-attention stage, its boundary
all-reduces in its modules, the divided attention's merges and EP dispatch on the host. The plan's
step model (compiler/step_cost.py) prices both: `report` gives, for a set of fallen-back kinds, the
executions per decode step and the modelled step time of every decode bucket with and without the
fallback; `lines` prints it. The compile prints it after a fallback, `deepinfer plan --fallback KIND`
before one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

from deepinfer.compiler import step_cost
from deepinfer.compiler.bundle_plan import BundlePlan, plan_bundle
from deepinfer.compiler.config import CompileConfig
from deepinfer.errors import ConfigError


def check_kinds(plan: BundlePlan, kinds: Collection[str]) -> None:
    """ConfigError naming the first of `kinds` that is not a fused layer kind of the plan."""
    fused = list(plan.regions.fused_kinds()) if plan.spec.fused else []
    for kind in kinds:
        if kind not in fused:
            valid = f"its layer kinds: {', '.join(fused)}" if fused else "it compiles no fused layers (trn2's layers)"
            raise ConfigError(f"--fallback {kind}: not a fused layer kind of this compile; {valid}")


def report(plan: BundlePlan, kinds: Collection[str]) -> dict:
    """Executions per decode step and, where the target models a step (trn2), the estimated step time
    of each decode bucket, fused and with `kinds` per region."""
    fell = dataclasses.replace(plan, per_region=frozenset(kinds))
    out: dict = {
        "kinds": sorted(kinds),
        "layers": sorted(layer for k in kinds for layer in plan.regions.fused_kinds()[k].layers),
        "executions": {"fused": plan.per_step["executions"], "fallback": fell.per_step["executions"]},
        "collectives_on_host": {"fused": _on_host(plan), "fallback": _on_host(fell)},
        "buckets": [],
    }
    if plan.spec.target.step_figures() is None:
        return out
    for batch, context in step_cost.decode_buckets(plan):
        fused, fallback = step_cost.step_cost(plan, batch, context), step_cost.step_cost(fell, batch, context)
        out["buckets"].append(
            {"batch": batch, "context": context, "fused_ms": fused.estimated_ms, "fallback_ms": fallback.estimated_ms}
        )
    return out


def _on_host(plan: BundlePlan) -> int:
    step = plan.per_step
    return step["collectives"] - step["collectives_in_executables"]


def lines(plan: BundlePlan, kinds: Collection[str]) -> list[str]:
    """`report` as text: one line for the executions, one a decode bucket."""
    r = report(plan, kinds)
    e, host = r["executions"], r["collectives_on_host"]
    out = [
        f"fallback of {', '.join(r['kinds'])} (layers {', '.join(map(str, r['layers']))} per region): "
        f"{e['fused']} -> {e['fallback']} device executions per decode step and rank, "
        f"{host['fused']} -> {host['fallback']} collectives on the host"
    ]
    out += [
        f"  batch {b['batch']} x context {b['context']:,}: modelled step {b['fused_ms']:.3f} -> {b['fallback_ms']:.3f} ms "
        f"(+{b['fallback_ms'] - b['fused_ms']:.3f} ms, a lower bound)"
        for b in r["buckets"]
    ]
    return out


def after_compile(config: CompileConfig, kinds: Collection[str]) -> tuple[list[str], dict]:
    """What a compile that fell back reports: the cost of `kinds` per region as `lines` and `report`
    give it, from the compile's plan (planned again: headers only, no scratch traced)."""
    plan = plan_bundle(config, scratch=False)
    return lines(plan, kinds), report(plan, kinds)
