"""deepinfer-compile as a list of named passes.

    parse config -> copy tokenizer (and build engram's token map) -> plan regions -> check memory budget
    -> preprocess weights (per rank)
    -> trace (and lower; on trn2: HLO, checked on XLA:CPU) -> check memory budget with scratch
    -> compile -> lay out state -> write manifest -> publish (atomic rename)

Each pass is a plain function: it takes what it uses and returns what it
makes (`PASSES` names both). What is built is fixed once parsed (`Spec`); how
the compile runs (staging directory, workers, log, cache) is `Run`.

With a cache (`compiler/cached.py`), the weights pass fetches each kind's
stacks by key instead of rebuilding them, the trace pass fetches an executable
whose trace record and executable are cached (neither tracing nor compiling
it), and the compile pass compiles only the misses, each at most once among
the compiles that share the cache. The bundle is assembled in a temporary
sibling of the output directory and renamed into place at the end: an
interrupted or failed compile leaves no partial bundle.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

import deepinfer
from deepinfer.bundles import layout
from deepinfer.bundles import manifest as mf
from deepinfer.bundles.signing import sign_file
from deepinfer.bundles.topology import Topology
from deepinfer.compiler import budget, cached
from deepinfer.compiler.cache import Cache
from deepinfer.compiler.config import CompileConfig, config_error
from deepinfer.compiler.jobs import Job, keep_failed_logs
from deepinfer.compiler.keys import Key, graph_digest, kernels_reached
from deepinfer.compiler.plan import RegionPlan, plan_regions
from deepinfer.compiler.pools import DRAFT_FEATURES, plan_pools
from deepinfer.compiler.publish import check_output, clean_stale, make_staging, publish
from deepinfer.compiler.stream import stream
from deepinfer.compiler.targets import TARGETS, Target
from deepinfer.compiler.tokenizer import bundle_tokenizer, tokenizer_digests
from deepinfer.compiler.trace import trace
from deepinfer.compiler.weights import RECIPES, Recipe, host_entries, host_files, stack_files
from deepinfer.errors import ConfigError, DeepinferError
from deepinfer.regions import topology
from deepinfer.regions.checkpoint import Checkpoint
from deepinfer.regions.config import V41Config, load_config
from deepinfer.regions.state import Geometry, check_block_size
from deepinfer.regions.step import DTYPES

LOWERED_DIR = ".lowered"


@dataclass(frozen=True)
class Spec:
    """What a compile builds, resolved from model.toml and the checkpoint's config."""

    config: CompileConfig
    model: V41Config
    topology: Topology
    target: Target
    geometry: Geometry
    hlo_only: bool = False

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.config.model.dtype]

    @property
    def draft(self) -> bool:
        """Whether the bundle holds the checkpoint's speculative draft ([speculative] draft)."""
        return self.config.speculative.draft is not None

    @property
    def recipe(self) -> Recipe:
        """The weight recipe: [quant] recipe, or the target's own for "target"."""
        name = self.config.quant.recipe
        return RECIPES[self.target.recipe if name == "target" else name]

    @property
    def device_embedding(self) -> bool:
        """Whether the token embedding is a region (token ids in, its table a device weight):
        [host] embedding = false, or the target's choice where model.toml leaves it unset."""
        host = self.config.host.embedding
        return self.target.device_embedding if host is None else not host

    def executables(self, plan: RegionPlan) -> list[tuple[str, str, int, int, int | None]]:
        """(kind, method, batch, tokens, context) of every executable (MoE on gathered rows under EP
        dispatch; context None for the kinds whose shapes do not depend on it)."""
        gathered = self.topology.groups if self.topology.dispatch else 1
        return plan.executables(self.config.buckets.shapes(), self.config.buckets.context, gathered)

    def geometry_at(self, context: int | None) -> Geometry:
        """The geometry an executable of context bucket `context` is traced with (None: the full one)."""
        return self.geometry if context is None else self.geometry.at_context(context)


@dataclass(frozen=True)
class Run:
    """How a compile runs: never what it builds."""

    staging: Path  # the bundle being assembled
    out: Path  # where it is published
    jobs: int = 1
    log: Callable[[str], None] = print
    cache: Cache | None = None
    require_cache: bool = False
    verbose: bool = False


@dataclass(frozen=True)
class Weights:
    stacks: dict[str, tuple[mf.WeightStack, ...]]  # rank key -> that rank's stacks
    host: dict[str, mf.HostFile]


@dataclass(frozen=True)
class Traced:
    executables: tuple[mf.Executable, ...]  # every executable, in plan order
    jobs: tuple[Job, ...]  # those to compile
    keys: dict[str, Key] = field(default_factory=dict)  # their executable keys (with a cache)


@dataclass(frozen=True)
class State:
    pools: dict[str, mf.Pool]
    bindings: dict[int, dict[str, tuple[str, int]]]  # layer -> state name -> (pool, row)


# --- the passes ---------------------------------------------------------------------------------


def parse(config: CompileConfig, hlo_only: bool, log) -> Spec:
    m = config.model
    if not (m.checkpoint / "config.json").exists() and m.tiny is not None:
        from deepinfer.regions.tiny import make_tiny

        log(
            f"checkpoint {m.checkpoint} absent: generating the tiny checkpoint "
            f"(seed {m.tiny.seed}, {m.tiny.layers} layers)"
        )
        make_tiny(m.checkpoint, seed=m.tiny.seed, layers=m.tiny.layers, exist_ok=True)
    model = load_config(m.checkpoint)
    try:
        check_block_size(model.text, config.kv.block_size)
    except ConfigError as e:
        raise config_error(config, "kv", "block_size", str(e)) from None
    if config.speculative.draft is not None and not model.text.has_draft:
        raise config_error(
            config,
            "speculative",
            "draft",
            f"the checkpoint {m.checkpoint} has no DSpark draft (its config.json's "
            "text_config.num_nextn_predict_layers is 0: no mtp.* tensors); drop the key or "
            "use a checkpoint with a draft",
        )
    topo = config.parallel
    bad = topology.check(topo, model.text)
    if bad:
        raise config_error(config, "parallel", bad[0], bad[1])
    t = config.target
    kv, buckets = config.kv, config.buckets
    geometry = Geometry(
        slots=max(buckets.batch) + 1,
        blocks=kv.num_blocks,
        block_size=kv.block_size,
        max_blocks=-(-buckets.max_context // kv.block_size),
    )
    spec = Spec(config, model, topo, TARGETS[t.name](t.executable, t.options), geometry, hlo_only)
    if spec.draft and spec.device_embedding:
        raise config_error(
            config,
            "speculative",
            "draft",
            f"the draft embeds its block with the host's embedding table, and target {t.name} "
            "makes the embedding a device region; add [host] embedding = true to keep it on the host",
        )
    return spec


def copy_tokenizer(spec: Spec, run: Run) -> dict[str, mf.HostFile]:
    """The checkpoint's tokenizer files and engram's token map, checked against the config before
    any weight is read (compiler/tokenizer.py); none for the byte-level tokenizer."""
    return bundle_tokenizer(spec.model, spec.config.model.checkpoint, run.staging, run.log)


def plan(spec: Spec, log) -> RegionPlan:
    p = plan_regions(
        spec.model.text,
        spec.dtype,
        spec.config.model.cache_quant,
        spec.topology,
        spec.recipe.fp8_format,
        device_embedding=spec.device_embedding,
        draft=spec.draft,
    )
    kinds = ", ".join(f"{k} x{len(kp.layers)}" for k, kp in p.kinds.items())
    log(f"{len(p.layers)} layers -> {len(p.kinds)} region kinds ({kinds})")
    return p


def weight_files(spec: Spec, plan: RegionPlan, ckpt: Checkpoint, staging: Path, wanted=None):
    """The weight pass's output files under `staging` (planned from the checkpoint's headers: every
    source tensor checked, nothing read) and each rank's manifest entries; `wanted` as `stack_files`'."""
    files, stacks = stack_files(spec, plan, ckpt, staging, wanted)
    files += host_files(spec.model, ckpt, staging, spec.recipe, wanted, device_embedding=spec.device_embedding)
    return files, stacks


DISK_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)
SPACE_MARGIN = 1 << 30  # executables, logs and the manifest besides the weights


def check_space(staging: Path, need: int, out: Path) -> None:
    """Refuse, before writing them, weights the output's file system has no room for."""
    free = shutil.disk_usage(staging).free
    if need + SPACE_MARGIN > free:
        raise ConfigError(
            f"{out.parent}: {free / 2**30:.2f} GiB free, the bundle needs about "
            f"{(need + SPACE_MARGIN) / 2**30:.2f} GiB ({need / 2**30:.2f} GiB of weights); "
            "free space or choose another -o"
        )


def disk_error(e: OSError, out: Path) -> ConfigError:
    """A write into the output's directory that the disk refused, as one line."""
    where = e.filename or out.parent
    return ConfigError(f"{where}: {e.strerror} while writing the bundle for {out}; nothing was published")


def preprocess_weights(spec: Spec, plan: RegionPlan, run: Run) -> Weights:
    """Every rank's stacks and the host files, streamed from the checkpoint (compiler/stream.py):
    each source byte read once, whatever the number of ranks; a file the cache holds is fetched."""
    ckpt = Checkpoint(spec.config.model.checkpoint)
    unused = ckpt.layers_beyond(spec.model.text.num_hidden_layers)
    if unused:
        run.log(
            f"note: {ckpt.dir}: the checkpoint holds layers {unused[0]}..{unused[-1]}, which config.json's "
            f"text_config.num_hidden_layers = {spec.model.text.num_hidden_layers} leaves unused"
        )
    keys = cached.weight_file_keys(spec, plan, ckpt, run) if run.cache else {}
    with cached.held(run, keys) as fetched:

        def wanted(rel: str) -> bool:
            return rel not in fetched

        files, stacks = weight_files(spec, plan, ckpt, run.staging, wanted)
        check_space(run.staging, sum(f.layout()[2] for f in files), run.out)
        report = stream(files, workers=run.jobs, log=run.log)
        for f in files:
            rel = Path(f.path).relative_to(run.staging).as_posix()
            if rel in keys:
                run.cache.put_file(keys[rel][0], keys[rel][1], Path(f.path))
    run.log(
        f"weights: {len(files)} file(s) written, {report['bytes_read'] / 2**30:.2f} GiB read in "
        f"{report['seconds']:.1f} s" + (f", {len(fetched)} from the cache" if fetched else "")
    )
    return Weights(
        {r: tuple(s) for r, s in stacks.items()}, host_entries(spec.model, device_embedding=spec.device_embedding)
    )


def _io(specs) -> tuple[mf.TensorSpec, ...]:
    return tuple(
        mf.TensorSpec(name=s.name, shape=tuple(s.shape), dtype=str(s.dtype).removeprefix("torch."), role=s.role)
        for s in specs
    )


def lowered_graph(
    spec: Spec, plan: RegionPlan, kind: str, method: str, batch: int, tokens: int, context: int | None = None
):
    """One executable's graph: its kind's region traced on fake tensors for the bucket (`context`:
    its context bucket, None for kinds built once), lowered for the target -> (lowered program,
    signature, example inputs, kernels the traced graph reaches)."""
    ep, sig, inputs = trace(
        plan.kinds[kind].region, batch, tokens, spec.geometry_at(context), method, dynamic=not spec.target.static_shapes
    )
    kernels = kernels_reached(ep)
    return spec.target.lower(ep), sig, inputs, kernels


def trace_regions(spec: Spec, plan: RegionPlan, run: Run) -> Traced:
    """Trace, lower and emit each executable's graph (a cache hit skips all three); trn2 graphs
    are also run on XLA:CPU against their reference region here."""
    target = spec.target
    lowered_dir = run.staging / LOWERED_DIR
    lowered_dir.mkdir()
    use_cache = run.cache is not None and not spec.hlo_only
    executables, jobs, keys = [], [], {}
    for kind, method, batch, tokens, context in spec.executables(plan):
        name = layout.executable_name(kind, method, batch, tokens, context)
        artifact = layout.executable_path(kind, method, batch, tokens, context, target.suffix)
        tkey = cached.trace_key(spec, plan, kind, method, batch, tokens, context) if use_cache else None
        record = cached.trace_record(run, tkey) if use_cache else None
        if record and run.cache.get_file("executable", record["executable_key"], run.staging / artifact):
            executables.append(mf.parse_executable(record["entry"], f"cached trace record of {name}"))
            run.log(f"cached {name}")
            continue
        region = plan.kinds[kind].region
        ep, sig, inputs, kernels = lowered_graph(spec, plan, kind, method, batch, tokens, context)
        names = [s.name for s in sig.all]
        user = [s.arg.name for s in ep.graph_signature.input_specs if s.kind.name == "USER_INPUT"]
        mutated = sorted(names[user.index(n)] for n in ep.graph_signature.user_inputs_to_mutate.values())
        entry = mf.Executable(
            kind=kind,
            method=method,
            bucket=mf.Shape(batch=batch, tokens=tokens, context=context),
            artifact=artifact,
            executable=target.executable,
            inputs=_io(sig.all),
            outputs=tuple(region.output_names()),
            mutates=tuple(mutated),
            scratch_bytes=budget.scratch_bytes(ep),
        )
        lowered = lowered_dir / f"{name}{target.lowered_suffix}"
        if target.static_shapes:  # state comes back as outputs: emit and check now
            entry = _emit_and_check(spec, entry, ep, names, lowered, region, method, inputs, run)
        if spec.hlo_only:
            entry = dataclasses.replace(
                entry, artifact=layout.executable_path(kind, method, batch, tokens, context, target.lowered_suffix)
            )
            (run.staging / layout.REGIONS_DIR).mkdir(exist_ok=True)
            os.replace(lowered, run.staging / entry.artifact)
            executables.append(entry)
            if run.cache is not None:
                run.cache.stats["lowered"].append(name)
            continue
        executables.append(entry)
        if not target.static_shapes:
            run.log(f"traced {name}")
        if use_cache:
            ekey = cached.executable_key(spec, plan, kind, method, batch, tokens, context, graph_digest(ep), kernels)
            record = {"executable_key": ekey.digest, "kernels": kernels, "entry": mf.to_json(entry)}
            run.cache.put_bytes("trace", tkey, json.dumps(record).encode())
            if run.cache.get_file("executable", ekey, run.staging / artifact):
                run.log(f"cached {name}")
                continue
            cached.missed(run, "executable", ekey)
            keys[name] = ekey
        if not target.static_shapes:
            target.emit(ep, names, list(entry.outputs), lowered)
        jobs.append(
            Job(
                name,
                lowered,
                run.staging / artifact,
                target.name,
                target.executable,
                target.options,
                log=run.staging / layout.log_path(kind, method, batch, tokens, context),
            )
        )
    return Traced(tuple(executables), tuple(jobs), keys)


def _emit_and_check(
    spec: Spec, entry: mf.Executable, ep, names, lowered: Path, region, method, inputs, run: Run
) -> mf.Executable:
    """Static-shape targets: write the lowered module (state returned, aliased) and check it numerically."""
    target = spec.target
    try:
        extra = target.emit(ep, names, list(entry.outputs), lowered)
    except DeepinferError as e:
        raise type(e)(f"region {entry.name}: {e}") from None
    entry = dataclasses.replace(entry, mutates=(), **mf.executable_fields(extra))
    if not target.check:
        run.log(f"lowered {entry.name}: HLO {lowered.stat().st_size} bytes (check off)")
        return entry
    check = target.check_numerics(
        lowered, region, method, inputs, names, list(entry.state_outputs), f"region {entry.name}"
    )
    run.log(
        f"lowered {entry.name}: HLO {lowered.stat().st_size} bytes, XLA:CPU vs reference "
        f"max |diff| {check['max_abs']:.2g}, score {check['score']:.2g} (tolerance {check['tolerance']:g})"
    )
    return dataclasses.replace(entry, check=check)


def compile_regions(spec: Spec, traced: Traced, run: Run) -> tuple[mf.Executable, ...]:
    target = spec.target
    (run.staging / layout.REGIONS_DIR).mkdir(exist_ok=True)
    if spec.hlo_only:
        run.log(
            f"HLO-stage bundle: {len(traced.executables)} HLO modules; finish it where neuronx-cc is "
            f"installed with: deepinfer-compile --finish {run.out}"
        )
    elif traced.jobs:
        target.require_compiler()

    def progress(done, total, job, seconds):
        run.log(f"[{done}/{total}] compiled {job.name} ({seconds:.1f} s)")

    cached.compile_jobs(run, traced, progress)
    shutil.rmtree(run.staging / LOWERED_DIR)
    if spec.hlo_only:
        return traced.executables
    return tuple(
        dataclasses.replace(e, **mf.executable_fields(target.describe(run.staging / e.artifact)))
        for e in traced.executables
    )


def layout_state(spec: Spec, plan: RegionPlan) -> State:
    pools, bindings = plan_pools(
        spec.model.text, plan.layers, block_size=spec.config.kv.block_size, dtype=spec.dtype, draft=bool(plan.draft)
    )
    return State(pools, bindings)


def write_manifest(
    spec: Spec,
    plan: RegionPlan,
    weights: Weights,
    tokenizer: dict[str, mf.HostFile],
    executables: tuple[mf.Executable, ...],
    state: State,
    run: Run,
) -> mf.Manifest:
    c, g = spec.config, spec.geometry
    layers = tuple(
        mf.Layer(
            layer=p.layer,
            attn=p.attn,
            ratio=p.ratio,
            kv_source=p.kv_source,
            candidate_source=p.candidate_source,
            uses_candidates=p.uses_candidates,
            engram=p.engram_rows > 0,
            regions={
                slot: mf.Binding(kind=kind, index=index) for slot, (kind, index) in plan.bindings[p.layer].items()
            },
            state={name: tuple(ref) for name, ref in state.bindings[p.layer].items()},
        )
        for p in plan.layers
    )
    manifest = mf.Manifest(
        format_version=mf.FORMAT_VERSION,
        deepinfer_version=deepinfer.__version__,
        toolchain=spec.target.toolchain(),
        target=mf.Target(name=c.target.name, executable=c.target.executable, options=c.target.options),
        stage="hlo" if spec.hlo_only else "executable",
        topology=mf.Ranks.of(spec.topology, spec.target.lnc),
        model=mf.Model(
            config=spec.model.to_dict(),
            config_hash=spec.model.digest(),
            dtype=c.model.dtype,
            cache_quant=c.model.cache_quant,
            weight_format="e4m3fn",
            scale_layout="ue8m0-u8-row-major",
            tokenizer="tokenizers" if tokenizer else "byte",
        ),
        buckets=mf.Buckets(
            shapes=tuple(mf.Shape(batch=b, tokens=t) for b, t in c.buckets.shapes()),
            max_context=c.buckets.max_context,
            contexts=c.buckets.context,
        ),
        kv=mf.KV(
            block_size=c.kv.block_size,
            num_blocks=c.kv.num_blocks,
            slots=g.slots,
            max_blocks=g.max_blocks,
            scratch="block 0 and slot 0",
            pools=state.pools,
            state_writes=spec.target.state_writes,
            static_pools=spec.target.static_shapes,
        ),
        regions=executables,
        head=mf.Binding(kind="head", index=0),
        embed=mf.Binding(kind="embed", index=0) if "embed" in plan.kinds else None,
        layers=layers,
        weights=weights.stacks,
        host={**weights.host, **tokenizer},
        # per rank; refuses the bundle if the executables overflow it
        memory=budget.record(spec, plan, executables, run.staging),
        draft=_draft_entry(spec, plan),
    )
    manifest = mf.stamp(run.staging, manifest)
    mf.write(run.staging, manifest)
    return manifest


def _draft_entry(spec: Spec, plan: RegionPlan) -> mf.Draft | None:
    if not plan.draft:
        return None
    c = spec.model.text
    return mf.Draft(
        name=spec.config.speculative.draft,
        block=plan.draft_block,
        window=plan.draft_window,
        target_layers=tuple(c.dspark_target_layer_ids),
        features=DRAFT_FEATURES,
        stages=tuple(
            {slot: mf.Binding(kind=kind, index=index) for slot, (kind, index) in stage.items()} for stage in plan.draft
        ),
    )


@dataclass(frozen=True)
class Pass:
    name: str
    run: Callable
    needs: tuple[str, ...]  # the values it takes, by name
    makes: str | None  # the name of what it returns (None: a check)


PASSES = [
    Pass("parse config", parse, ("config", "hlo_only", "log"), "spec"),
    Pass("copy tokenizer", copy_tokenizer, ("spec", "run"), "tokenizer"),
    Pass("plan regions", plan, ("spec", "log"), "plan"),
    Pass("check memory budget", budget.check_planned, ("spec", "plan", "log"), None),
    Pass("preprocess weights", preprocess_weights, ("spec", "plan", "run"), "weights"),
    Pass("trace", trace_regions, ("spec", "plan", "run"), "traced"),
    Pass("check memory budget with scratch", budget.check_traced, ("spec", "plan", "traced", "log"), None),
    Pass("compile", compile_regions, ("spec", "traced", "run"), "executables"),
    Pass("lay out state", layout_state, ("spec", "plan"), "state"),
    Pass(
        "write manifest",
        write_manifest,
        ("spec", "plan", "weights", "tokenizer", "executables", "state", "run"),
        "manifest",
    ),
]


# --- publishing and the API ---------------------------------------------------------------------


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def compile_bundle(
    config: CompileConfig,
    out: Path,
    *,
    jobs: int = 1,
    force: bool = False,
    log=None,
    cache: Cache | None = None,
    require_cache: bool = False,
    verbose: bool = False,
    hlo_only: bool = False,
    sign=None,
) -> tuple[Path, dict[str, float]]:
    """Run every pass; returns the bundle path and the seconds each pass took.

    With `cache`, every executable, weight stack and trace is fetched by key or
    built and stored; `cache.stats` counts hits, misses and compiles. With
    `require_cache`, a miss raises CacheError naming the region and why.
    `verbose` logs each missed key's part hashes. `hlo_only` (trn2) stops after lowering and
    checking: the bundle holds HLO modules, finished later by `finish_bundle`. With `sign` (an
    Ed25519 private key, `bundles.signing`), the manifest is signed before the bundle is published.
    """
    log = log or _stderr
    out = Path(out)
    check_output(out, force, config.model.checkpoint)
    if require_cache and cache is None:
        raise ConfigError("--require-cache needs a cache (drop --no-cache)")
    if hlo_only and not TARGETS[config.target.name].static_shapes:
        raise config_error(config, "target", "name", f"--hlo-only is for the trn2 target, not {config.target.name!r}")
    clean_stale(out, log)
    try:
        staging = make_staging(out)
    except OSError as e:
        raise disk_error(e, out) from None
    values = {
        "config": config,
        "hlo_only": hlo_only,
        "log": log,
        "run": Run(staging, out, jobs=jobs, log=log, cache=cache, require_cache=require_cache, verbose=verbose),
    }
    timings: dict[str, float] = {}
    try:
        for p in PASSES:
            start = time.perf_counter()
            made = p.run(*(values[n] for n in p.needs))
            if p.makes:
                values[p.makes] = made
            timings[p.name] = time.perf_counter() - start
        if sign is not None:
            sign_file(staging / layout.MANIFEST_FILE, sign, staging / layout.SIGNATURE_FILE)
        for path in staging.rglob("*"):  # safetensors writes 0600; a bundle is for sharing
            os.chmod(path, 0o755 if path.is_dir() else 0o644)
        os.chmod(staging, 0o755)
        publish(staging, out, force)
    except BaseException as e:
        if isinstance(e, OSError) and e.errno in DISK_ERRORS:
            e = disk_error(e, out)
        if isinstance(e, DeepinferError):
            e = keep_failed_logs(e, staging / layout.LOGS_DIR, out)
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(e, DeepinferError):
            raise e from None
        raise
    return out, timings


def cache_key(
    config: CompileConfig, *, cache: Cache | None = None, log=None, verbose: bool = False, hlo_only: bool = False
) -> Key:
    """One key for the whole bundle (for CI cache systems), from the trace and weight keys:
    nothing is traced or compiled. `cache` only lends its tensor-digest memo."""
    log = log or _stderr
    spec = parse(config, hlo_only, log)
    p = plan(spec, log)
    ckpt = Checkpoint(config.model.checkpoint)
    memo = cache.root / "files" if cache else None
    weights = {
        f"{kind} rank {r}": cached.weights_key(spec, ckpt, kind, kp, r, memo)
        for kind, kp in p.kinds.items()
        for r in range(spec.topology.world)
    }
    traces = {layout.executable_name(*e): cached.trace_key(spec, p, *e) for e in spec.executables(p)}
    key = cached.bundle_key(
        spec,
        weights,
        cached.host_key(spec, ckpt, memo),
        traces,
        cached.vision_key(spec, ckpt, memo) if spec.model.vision.num_hidden_layers > 0 else None,
        cached.engram_key(spec, ckpt, memo) if spec.model.text.engram_layer_ids else None,
        tokenizer_digests(config.model.checkpoint),
    )
    if verbose:
        for k in [*weights.values(), *traces.values(), key]:
            log(f"{k.kind} {k.identity} {k.digest[:16]}")
            for line in k.lines():
                log(line)
    return key
