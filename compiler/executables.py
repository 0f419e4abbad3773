"""The trace and compile passes: one executable per (kind, method, bucket).

The trace pass takes each executable of the plan in order through these steps, one function each:

    fetch   a cached trace record whose executable the cache holds: neither traced nor compiled
            (fetch and store are the cache's: compiler/cache/fetch_or_build.py)
    lower   the kind's region traced on fake tensors for the bucket, lowered for the target
    emit    the lowered module written for the compile job (static-shape targets: now, since
            what it returns is part of the manifest entry; others: only when it is compiled here)
    check   static-shape targets (trn2): the lowered module run on XLA:CPU against its region
    store   the trace record put in the cache: the executable's key and its manifest entry

The compile pass runs the compile jobs, each at most once among the compiles sharing a cache
(`fetch_or_build.compile_jobs`), and reports which executables it built.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from deepinfer.bundles import layout, manifest_io
from deepinfer.bundles import manifest as mf
from deepinfer.compiler import budget
from deepinfer.compiler.cache import artifact_keys, fetch_or_build
from deepinfer.compiler.cache.keys import Key, graph_digest, kernels_reached
from deepinfer.compiler.jobs import Job
from deepinfer.compiler.kill_points import kill_point
from deepinfer.compiler.plan import Exe, RegionPlan
from deepinfer.compiler.spec import Log, Run, Spec
from deepinfer.compiler.targets import hlo
from deepinfer.compiler.trace import trace
from deepinfer.errors import DeepinferError
from deepinfer.regions.base import Region
from deepinfer.regions.examples import example_inputs
from deepinfer.regions.state import Geometry, InputSpec
from deepinfer.regions.topology import boundary_reduce

LOWERED_DIR = ".lowered"


@dataclass(frozen=True, kw_only=True)
class Graph:
    """One executable's graph, traced and lowered, with its manifest entry as traced."""

    exe: Exe
    region: Region  # its kind's region (meta weights)
    program: torch.export.ExportedProgram  # lowered for the target
    names: list[str]  # its flat inputs' names: weights (rank included), then the method's inputs
    inputs: list[InputSpec]  # the method's inputs, traced as fake tensors of these shapes
    geometry: Geometry  # the pool geometry it was traced with (its example values follow it)
    kernels: list[str]  # the deepinfer kernels the traced graph reaches
    entry: mf.Executable


@dataclass(frozen=True, kw_only=True)
class Traced:
    """What the trace pass made: every manifest entry, and what is left to compile."""

    executables: tuple[mf.Executable, ...]  # every executable, in plan order
    jobs: tuple[Job, ...]  # those to compile
    keys: dict[str, Key] = field(default_factory=dict)  # their executable keys (with a cache)
    lowered: tuple[str, ...] = ()  # HLO-stage bundles: the HLO modules lowered and checked (all of them)


@dataclass(frozen=True, kw_only=True)
class Compiled:
    """What the compile pass made: every manifest entry as built, and which this compile built."""

    executables: tuple[mf.Executable, ...]
    built: tuple[str, ...]  # compiled here (the others came from the cache), in the order they finished
    # layer kinds neuronx-cc refused, compiled per region instead (compiler/fallback.py)
    fallback: dict[str, mf.Fallback] = field(default_factory=dict)


# --- the trace pass, step by step ----------------------------------------------------------------


def _io(specs: Sequence[InputSpec]) -> tuple[mf.TensorSpec, ...]:
    return tuple(
        mf.TensorSpec(name=s.name, shape=tuple(s.shape), dtype=str(s.dtype).removeprefix("torch."), role=s.role)
        for s in specs
    )


def _returns(program: torch.export.ExportedProgram, names: Sequence[str]) -> tuple[mf.TensorSpec, ...]:
    """The program's user outputs as the manifest records them: `names`, shapes (-1: a dynamic size)
    and dtypes (static-shape targets replace them in `emit` with the state they return as well)."""
    values = program.graph.output_node().args[0]
    kinds = [o.kind.name for o in program.graph_signature.output_specs]
    returned = [v.meta["val"] for v, k in zip(values, kinds) if k == "USER_OUTPUT"]
    return tuple(
        mf.TensorSpec(
            name=n,
            shape=tuple(d if isinstance(d, int) else -1 for d in v.shape),
            dtype=str(v.dtype).removeprefix("torch."),
        )
        for n, v in zip(names, returned)
    )


def lower(spec: Spec, plan: RegionPlan, exe: Exe) -> Graph:
    """Trace `exe`'s region on fake tensors for its bucket and lower it for the target. Static-shape
    targets return state as outputs, so their entries mutate no input."""
    target = spec.target
    region = plan.kinds[exe.kind].region
    geometry = spec.geometry_at(exe.context)
    ep, sig = trace(region, exe.batch, exe.tokens, geometry, exe.method, dynamic=not target.static_shapes)
    kernels = kernels_reached(ep)
    lowered = target.lower(ep)
    names = [s.name for s in sig.all]
    user = [s.arg.name for s in lowered.graph_signature.input_specs if s.kind.name == "USER_INPUT"]
    mutated = sorted(names[user.index(n)] for n in lowered.graph_signature.user_inputs_to_mutate.values())
    entry = mf.Executable(
        kind=exe.kind,
        method=exe.method,
        bucket=mf.Shape(batch=exe.batch, tokens=exe.tokens, context=exe.context),
        artifact=layout.executable_path(*exe, target.suffix),
        executable=target.executable,
        inputs=_io(sig.all),
        outputs=tuple(region.method_outputs(exe.method)),
        output_specs=_returns(lowered, region.method_outputs(exe.method)),
        mutates=() if target.static_shapes else tuple(mutated),
        scratch_bytes=budget.scratch_bytes(lowered),
    )
    return Graph(
        exe=exe,
        region=region,
        program=lowered,
        names=names,
        inputs=sig.inputs,
        geometry=geometry,
        kernels=kernels,
        entry=entry,
    )


def emit(spec: Spec, graph: Graph, lowered: Path) -> mf.Executable:
    """Write the lowered module a compile job reads to `lowered`; returns the entry with the fields
    the target adds (trn2: the state it returns and their aliases; with collectives in the graph,
    the outputs it reduces over rank groups, regions.topology.boundary_reduce)."""
    exe = graph.entry
    reduce = boundary_reduce(exe.kind, exe.method, spec.topology) if spec.target.graph_collectives else None
    try:
        extra = spec.target.emit(graph.program, graph.names, list(graph.entry.outputs), lowered, reduce)
    except DeepinferError as e:
        raise type(e)(f"region {graph.entry.name}: {e}") from None
    return dataclasses.replace(graph.entry, **manifest_io.executable_fields(extra))


def check(spec: Spec, graph: Graph, entry: mf.Executable, lowered: Path, log: Log) -> mf.Executable:
    """Static-shape targets: run the emitted module against its reference region (unless the
    target's check is off) on the method's example inputs, made here and only here (real values
    at the compiled shapes); returns the entry with the check's figures."""
    if not spec.target.check:
        log(f"lowered {entry.name}: HLO {lowered.stat().st_size} bytes (check off)")
        return entry
    reduce = {k: [list(g) for g in v] for k, v in (entry.reduced or {}).items()}
    module = lowered
    if reduce and spec.topology.world > hlo.MAX_REPLICAS:  # more replicas than XLA:CPU offers here: the
        # graph is checked without its collectives (tests/trn2/test_collectives.py runs them)
        module = lowered.with_name(f"{lowered.name}.local")
        spec.target.emit(graph.program, graph.names, list(entry.outputs), module)
        reduce = {}
    try:
        result = spec.target.check_numerics(
            module,
            graph.region,
            graph.exe.method,
            example_inputs(graph.inputs, graph.geometry),
            graph.names,
            list(entry.state_outputs or ()),
            f"region {entry.name}",
            reduce=reduce or None,
        )
    finally:
        if module != lowered:
            module.unlink(missing_ok=True)
    log(
        f"lowered {entry.name}: HLO {lowered.stat().st_size} bytes, XLA:CPU vs reference "
        f"max |diff| {result['max_abs']:.2g}, score {result['score']:.2g} (tolerance {result['tolerance']:g})"
    )
    return dataclasses.replace(entry, check=result)


def keep_lowered(spec: Spec, exe: Exe, entry: mf.Executable, lowered: Path, staging: Path) -> mf.Executable:
    """HLO-stage bundles: the lowered module is the bundle's artifact (finished later)."""
    entry = dataclasses.replace(entry, artifact=layout.executable_path(*exe, spec.target.lowered_suffix))
    (staging / layout.REGIONS_DIR).mkdir(exist_ok=True)
    os.replace(lowered, staging / entry.artifact)
    return entry


def _job(spec: Spec, exe: Exe, entry: mf.Executable, lowered: Path, staging: Path) -> Job:
    t = spec.target
    log = staging / layout.log_path(*exe)
    return Job(exe.name, lowered, staging / entry.artifact, t.name, t.executable, t.options, log=log, exe=exe)


# --- the passes ----------------------------------------------------------------------------------


def trace_regions(spec: Spec, plan: RegionPlan, run: Run, exes: Sequence[Exe] | None = None) -> Traced:
    """Pass: each executable fetched from the cache, or lowered, emitted, checked (static-shape
    targets) and stored in the cache, leaving a compile job (HLO-stage bundles: none). `exes`: those
    executables only (a layer kind's regions, compiler/fallback.py), not the bundle's every one."""
    target = spec.target
    lowered_dir = run.staging / LOWERED_DIR
    lowered_dir.mkdir(exist_ok=True)
    cache = None if spec.hlo_only else run.cache  # an HLO-stage compile lowers every region
    executables: list[mf.Executable] = []
    jobs: list[Job] = []
    keys: dict[str, Key] = {}
    hlo: list[str] = []
    fused = plan.fused_modules() if spec.fused else {}
    pieces: dict = {}  # fused layers' region pieces, lowered once for all the kinds that run them
    every = spec.executables(plan) if exes is None else list(exes)
    for i, exe in enumerate(every, 1):
        start = time.perf_counter()
        key = artifact_keys.trace_key(spec, plan, exe) if cache is not None else None
        dest = run.staging / layout.executable_path(*exe, target.suffix)
        hit = fetch_or_build.fetch(cache, key, exe, dest) if cache is not None and key is not None else None
        if hit is not None:
            executables.append(hit)
            run.log(f"cached {exe.name}")
            continue
        lowered = lowered_dir / f"{exe.name}{target.lowered_suffix}"
        graph: Graph | None = None
        if exe.kind in fused:  # one module for the layer's regions and collectives (static shapes)
            from deepinfer.compiler import layers  # it lowers its pieces with this module's `lower`

            entry, digest, kernels = layers.trace(spec, plan, fused[exe.kind], exe, lowered, run.log, pieces)
        else:
            graph = lower(spec, plan, exe)
            entry = graph.entry
            digest, kernels = "", graph.kernels  # the graph's digest: only for a cache (below)
            if target.static_shapes:  # state comes back as outputs: the module is part of the entry
                entry = check(spec, graph, emit(spec, graph, lowered), lowered, run.log)
        if spec.hlo_only:
            executables.append(keep_lowered(spec, exe, entry, lowered, run.staging))
            hlo.append(exe.name)
            continue
        executables.append(entry)
        if not target.static_shapes:
            run.log(f"traced {exe.name} ({i}/{len(every)}, {time.perf_counter() - start:.1f} s)")
        if cache is not None and key is not None:
            if graph is not None:  # a region's graph digest; a fused layer's is its module's text's
                digest = graph_digest(graph.program)
            executable = fetch_or_build.store(spec, plan, cache, key, exe, digest, kernels, entry)
            kill_point("trace")
            if cache.get_file("executable", executable, dest):  # another graph or compile built it
                run.log(f"cached {exe.name}")
                continue
            fetch_or_build.missed(run, "executable", executable)
            keys[exe.name] = executable
        if not target.static_shapes:
            assert graph is not None, "only static-shape targets fuse layers"
            emit(spec, graph, lowered)
            kill_point("emit")
        jobs.append(_job(spec, exe, entry, lowered, run.staging))
    return Traced(executables=tuple(executables), jobs=tuple(jobs), keys=keys, lowered=tuple(hlo))


def compile_regions(spec: Spec, traced: Traced, run: Run) -> Compiled:
    """Pass: compile every job (with a cache, each at most once among the compiles sharing it), then
    read each executable's facts into its entry. An HLO-stage bundle compiles nothing."""
    target = spec.target
    (run.staging / layout.REGIONS_DIR).mkdir(exist_ok=True)
    if spec.hlo_only:
        run.log(
            f"HLO-stage bundle: {len(traced.executables)} HLO modules; finish it where neuronx-cc is "
            f"installed with: deepinfer-compile --finish {run.out}"
        )
    elif traced.jobs:
        target.require_compiler()

    # a saved program is its executable: its job only copies it in (nothing is compiled)
    verb = "saved" if target.executable == "exported" else "compiled"

    def progress(done: int, total: int, job: Job, seconds: float) -> None:
        run.log(f"[{done}/{total}] {verb} {job.name}" + ("" if verb == "saved" else f" ({seconds:.1f} s)"))

    built = fetch_or_build.compile_jobs(run, traced.jobs, traced.keys, progress)
    shutil.rmtree(run.staging / LOWERED_DIR)
    if spec.hlo_only:
        return Compiled(executables=traced.executables, built=built)
    executables = tuple(
        dataclasses.replace(e, **manifest_io.executable_fields(target.describe(run.staging / e.artifact)))
        for e in traced.executables
    )
    return Compiled(executables=executables, built=built)
