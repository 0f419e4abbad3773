"""A compile that survives neuronx-cc's refusals: a fused layer kind refused, compiled per region.

neuronx-cc fails some modules with an internal error and no workaround (NCC_IBIR297 on a large MoE
decode graph, aws-neuron-sdk issue 1362). A fused layer (compiler/layers.py) is the largest module a
trn2 bundle holds, and its regions are the same computation in smaller modules. So when neuronx-cc
refuses a fused layer module with an error code, the compile pass (`compile_pass`):

    says so in one line: the layer kind, the bucket, the code and where its log is kept
    keeps that log under `<out>.failed-logs/` (and in the bundle's logs/)
    drops the kind's fused executables, every bucket of them, also those already compiled: a
        layer kind runs one way at every bucket, so the runtime's wiring of a layer does not
        depend on the step's shape, and the cost the plan shows holds for every step
    traces, lowers, checks and compiles the kind's regions (every method and bucket, as
        `layers = "regions"` would, with the fused compile's in-graph boundary collectives;
        the divided attention's merges and EP dispatch run on the host between them)
    compiles the jobs that were not done, and goes on

The draft step's one module (compiler/draft_layers.py) falls back the same way: its regions' own
executables are in the bundle already, so the module is dropped and the draft runs per region call.

The manifest records each refused kind (`Manifest.fallback`: its buckets, the bucket refused, the
code, the log) and its layers run per region (`Layer.fused` None). `[target] options fallback =
"none"` stops the compile at the refusal instead. Anything else stops it as before, in one line and
with nothing published: a refused region module (the fallback's own, or a region that was never
fused), a failure without an error code (a crash, a timeout), a lowering or check error.
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Sequence

from deepinfer.bundles import layout
from deepinfer.bundles import manifest as mf
from deepinfer.compiler import budget
from deepinfer.compiler.executables import Compiled, Traced, compile_regions, trace_regions
from deepinfer.compiler.jobs import Job
from deepinfer.compiler.plan import Exe, RegionPlan
from deepinfer.compiler.spec import Run, Spec
from deepinfer.compiler.targets.neuronxcc import NeuronRefused
from deepinfer.compiler.targets.trn2 import Trn2Target

REGIONS = "regions"  # Trn2Options.fallback: compile a refused layer kind per region


def compile_pass(spec: Spec, plan: RegionPlan, traced: Traced, run: Run) -> Compiled:
    """Pass: compile every job (executables.compile_regions); a fused layer module neuronx-cc refuses
    with an error code gives way to its kind's regions (unless the target's fallback is "none")."""
    records: dict[str, mf.Fallback] = {}
    done: list[str] = []
    while True:
        try:
            compiled = compile_regions(spec, traced, run)
        except NeuronRefused as refused:
            job = _fallen_back(spec, plan, traced, refused)
            if job is None:
                raise _explained(spec, plan, refused, records) from None
            assert job.exe is not None, "_fallen_back returns a fused layer's job"
            records[job.exe.kind] = _record(traced, job, refused, run, fresh=not records)
            traced, finished = _per_region(spec, plan, traced, job, run)
            done += finished
            continue
        layer_kinds = [k for k in records if k != mf.DRAFT_MODULE]
        if layer_kinds:  # what it costs a decode step (compiler/fallback_cost.py)
            from deepinfer.compiler import fallback_cost  # it plans through the pipeline, which imports this

            for line in fallback_cost.after_compile(spec.config, layer_kinds)[0]:
                run.log(line)
        if mf.DRAFT_MODULE in records:
            run.log("the draft step runs as its regions' executables: an execution a region call, not one a step")
        return dataclasses.replace(compiled, built=tuple(done) + compiled.built, fallback=records)


def _fallen_back(spec: Spec, plan: RegionPlan, traced: Traced, refused: NeuronRefused) -> Job | None:
    """The refused job, where it is a fused layer's and the target falls back; else None."""
    if not spec.fused or not isinstance(spec.target, Trn2Target) or spec.target.fallback != REGIONS:
        return None
    fused = plan.fused_modules()  # the layer kinds, and the draft step's one module
    job = next((j for j in traced.jobs if j.name == refused.region), None)
    if job is None or job.exe is None or plan.divided_rows:  # a divided prompt has no per-region form here
        return None
    return job if job.exe.kind in fused else None


def _explained(spec: Spec, plan: RegionPlan, refused: NeuronRefused, records: dict[str, mf.Fallback]) -> NeuronRefused:
    """The refusal that stops the compile, saying why no fallback: the option is "none", or the
    module refused is a fallback's own region."""
    name = refused.region.split(".", 1)[0]
    if spec.fused and plan.divided_rows and name in plan.fused_modules():
        return refused.noted(
            "a bundle with divided prompt rows has no per-region form on trn2 (its prompt steps run the layers' "
            'rows modules): set [prompt] rows = "replicated" to compile the fallback'
        )
    if spec.fused and name in plan.fused_modules():
        return refused.noted(
            '[target] options fallback = "none" (set "regions" to compile a refused layer kind per region)'
        )
    owners = [k for k in records if name in {r for _, r in plan.fused_modules()[k].slots}]
    if owners:
        return refused.noted(
            f"it is a region of layer kind {owners[0]}, which neuronx-cc refused fused: no form is left"
        )
    return refused


def _record(traced: Traced, job: Job, refused: NeuronRefused, run: Run, *, fresh: bool) -> mf.Fallback:
    """Keep the refused compile's log under <out>.failed-logs/ (`fresh`: this compile's first, the
    logs an earlier compile left there go), say what happened in one line, and return the manifest's
    record of it."""
    exe = job.exe
    assert exe is not None and job.log is not None, "a compile job of the pipeline names its region and log"
    kept = layout.failed_logs(run.out)
    if fresh:
        shutil.rmtree(kept, ignore_errors=True)
    kept.mkdir(parents=True, exist_ok=True)
    log = job.log.name
    shutil.copyfile(job.log, kept / log)
    buckets = tuple(e.bucket for e in traced.executables if e.kind == exe.kind)
    what = "the draft step's module" if exe.kind == mf.DRAFT_MODULE else "layer kind"
    run.log(
        f"neuronx-cc refused fused {what} {exe.kind} at {_bucket(exe)} with {refused.code}; "
        f'compiling its {len(buckets)} bucket(s) per region instead ([target] options fallback = "regions"); '
        f"log: {kept / log}"
    )
    return mf.Fallback(
        buckets=buckets,
        bucket=mf.Shape(batch=exe.batch, tokens=exe.tokens, context=exe.context),
        code=refused.code,
        log=log,
    )


def _bucket(exe: Exe) -> str:
    context = f", context {exe.context}" if exe.context is not None else ""
    return f"bucket batch {exe.batch} x tokens {exe.tokens}{context}"


def _per_region(spec: Spec, plan: RegionPlan, traced: Traced, refused: Job, run: Run) -> tuple[Traced, list[str]]:
    """`traced` with the refused job's layer kind's executables replaced by its regions' (traced here:
    those the bundle does not hold yet), its compiled files gone, and without the jobs already done;
    and the names of those done (compiled before the refusal stopped the jobs)."""
    assert refused.exe is not None, "a fused layer's job"
    kind = refused.exe.kind
    slots = {k for _, k in plan.fused_modules()[kind].slots}  # the draft's: all built already
    have = {e.name for e in traced.executables}
    exes = [e for e in spec.region_executables(plan) if e.kind in slots and e.name not in have]
    regions = trace_regions(spec, plan, run, exes)
    executables = [e for e in traced.executables if e.kind != kind] + list(regions.executables)
    budget.check_traced(spec, plan, executables, run.log)
    _drop(traced.jobs, refused, run)
    finished = [j.name for j in traced.jobs if j.out.is_file()]
    jobs = [j for j in traced.jobs if not j.out.is_file() and (j.exe is None or j.exe.kind != kind)]
    return (
        Traced(
            executables=tuple(executables),
            jobs=tuple(jobs) + regions.jobs,
            keys={**traced.keys, **regions.keys},
            lowered=traced.lowered,
        ),
        finished,
    )


def _drop(jobs: Sequence[Job], refused: Job, run: Run) -> None:
    """Remove what the refused kind's jobs left in the staging bundle (executables compiled at other
    buckets and their logs; the refused one's log stays) and the job directories of stopped compiles."""
    assert refused.exe is not None, "a fused layer's job"
    for job in jobs:
        if job.exe is not None and job.exe.kind == refused.exe.kind:
            job.out.unlink(missing_ok=True)
            if job.log is not None and job.name != refused.name:
                job.log.unlink(missing_ok=True)
    for stray in (run.staging / layout.REGIONS_DIR).glob(".*"):  # a stopped job's directory
        shutil.rmtree(stray, ignore_errors=True)
