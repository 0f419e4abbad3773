"""deepinfer-compile as a list of named passes, and its API (`compile_bundle`, `cache_key`).

    parse config -> copy tokenizer (and build engram's token map) -> plan regions -> check memory budget
    -> preprocess weights (per rank)
    -> trace (and lower; on trn2: HLO, checked on XLA:CPU) -> check memory budget with scratch
    -> compile -> lay out state -> record cache keys -> write manifest -> publish (atomic rename)

`build` calls the passes in that order, each a plain function that takes what it uses and returns
what it makes, timed under its name. What is built is fixed once parsed (`Spec`); how the compile
runs (staging directory, workers, log, cache) is `Run` (compiler/spec.py). The trace and compile
passes are compiler/executables.py's; the memory checks compiler/budget.py's.

With a cache (`compiler/cache/`), the weights pass fetches each kind's
stacks by key instead of rebuilding them, the trace pass fetches an executable
whose trace record and executable are cached (neither tracing nor compiling
it), and the compile pass compiles only the misses, each at most once among
the compiles that share the cache. The bundle is assembled in a temporary
sibling of the output directory and renamed into place at the end: an
interrupted or failed compile leaves no partial bundle.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import sys
import time
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import deepinfer
from deepinfer.bundles import layout, manifest_io
from deepinfer.bundles import manifest as mf
from deepinfer.bundles.signing import sign_file
from deepinfer.compiler import budget
from deepinfer.compiler.cache import artifact_keys, default_cache, fetch_or_build
from deepinfer.compiler.cache.keys import Key
from deepinfer.compiler.cache.local import Cache
from deepinfer.compiler.config import CompileConfig, config_error
from deepinfer.compiler.executables import trace_regions
from deepinfer.compiler.fallback import compile_pass
from deepinfer.compiler.jobs import keep_failed_logs
from deepinfer.compiler.kill_points import kill_point
from deepinfer.compiler.plan import RegionPlan, plan_regions
from deepinfer.compiler.pools import DRAFT_FEATURES
from deepinfer.compiler.publish import check_output, clean_stale, make_staging, publish, stopped_by_signals
from deepinfer.compiler.spec import Log, Run, Spec, parse
from deepinfer.compiler.stream import OutFile, stream
from deepinfer.compiler.targets import TARGETS
from deepinfer.compiler.tokenizer import bundle_tokenizer, tokenizer_digests
from deepinfer.compiler.weights import Wanted, host_entries, host_files, stack_files
from deepinfer.errors import ConfigError, DeepinferError
from deepinfer.regions.checkpoint import Checkpoint
from deepinfer.schema import Rules, coerce


@dataclass(frozen=True, kw_only=True)
class Weights:
    stacks: dict[str, tuple[mf.WeightStack, ...]]  # rank key -> that rank's stacks
    host: dict[str, mf.HostFile]


@dataclass(frozen=True, kw_only=True)
class State:
    pools: dict[str, mf.Pool]
    bindings: dict[int, dict[str, tuple[str, int]]]  # layer -> state name -> (pool, row)


# --- the pipeline ------------------------------------------------------------------------------


class Timings:
    """Times passes by name (`with timed("trace"): ...`): `seconds` maps pass names to seconds,
    in the order run; a pass that raises is not recorded."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.seconds[name] = time.perf_counter() - start


@dataclass(frozen=True, kw_only=True)
class Built:
    """What the passes built: the bundle's executables, and which of them this compile made itself."""

    executables: int  # in the manifest
    compiled: tuple[str, ...] = ()  # compiled here (the others came from the cache)
    lowered: tuple[str, ...] = ()  # HLO-stage bundles: the HLO modules lowered and checked
    fallback: dict[str, mf.Fallback] = field(default_factory=dict)  # layer kinds compiled per region


def build(config: CompileConfig, hlo_only: bool, run: Run, timed: Timings) -> Built:
    """Every pass, in order, into `run.staging`."""
    with timed("parse config"):
        spec = parse(config, hlo_only, run.log)
    with timed("copy tokenizer"):
        tokenizer = copy_tokenizer(spec, run)
    with timed("plan regions"):
        regions = plan(spec, run.log)
    with timed("check memory budget"):
        budget.check_planned(spec, regions, run.log)
    with timed("preprocess weights"):
        weights = preprocess_weights(spec, regions, run)
    with timed("trace"):
        traced = trace_regions(spec, regions, run)
    with timed("check memory budget with scratch"):
        budget.check_traced(spec, regions, traced.executables, run.log)
    with timed("compile"):  # a fused layer kind neuronx-cc refuses: per region (compiler/fallback.py)
        compiled = compile_pass(spec, regions, traced, run)
    with timed("lay out state"):
        state = layout_state(spec, regions)
    with timed("record cache keys"):
        record_cache_keys(run)
    fell = compiled.fallback
    with timed("write manifest"):
        manifest = write_manifest(spec, regions, weights, tokenizer, compiled.executables, state, run, fallback=fell)
    return Built(executables=len(manifest.regions), compiled=compiled.built, lowered=traced.lowered, fallback=fell)


# --- the passes (the trace and compile passes: compiler/executables.py) -------------------------


def copy_tokenizer(spec: Spec, run: Run) -> dict[str, mf.HostFile]:
    """The checkpoint's tokenizer files and engram's token map, checked against the config before
    any weight is read (compiler/tokenizer.py); none for the byte-level tokenizer."""
    return bundle_tokenizer(spec.model, spec.config.model.checkpoint, run.staging, run.log)


def plan(spec: Spec, log: Log) -> RegionPlan:
    p = plan_regions(
        spec.model.text,
        spec.dtype,
        spec.config.model.cache_quant,
        spec.topology,
        spec.recipe.fp8_format,
        device_embedding=spec.device_embedding,
        draft=spec.draft,
        divided_rows=spec.divided_rows,
    )
    kinds = ", ".join(f"{k} x{len(kp.layers)}" for k, kp in p.kinds.items())
    log(f"{len(p.layers)} layers -> {len(p.kinds)} region kinds ({kinds})")
    return p


def weight_files(
    spec: Spec, plan: RegionPlan, ckpt: Checkpoint, staging: Path, wanted: Wanted | None = None
) -> tuple[list[OutFile], dict[str, list[mf.WeightStack]]]:
    """The weight pass's output files under `staging` (planned from the checkpoint's headers: every
    source tensor checked, nothing read) and each rank's manifest entries; `wanted` as `stack_files`'."""
    files, stacks = stack_files(spec, plan, ckpt, staging, wanted)
    files += host_files(spec.model, ckpt, staging, spec.recipe, wanted, device_embedding=spec.device_embedding)
    return files, stacks


DISK_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM)
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
    if e.filename:
        return ConfigError(f"{e.filename}: {e.strerror} while writing the bundle for {out}; nothing was published")
    return ConfigError(f"{out}: {e.strerror} while writing the bundle; nothing was published")


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
    keys = artifact_keys.weight_file_keys(spec, plan, ckpt, run) if run.cache else {}
    with fetch_or_build.held(run, keys) as fetched:

        def wanted(rel: str) -> bool:
            return rel not in fetched

        files, stacks = weight_files(spec, plan, ckpt, run.staging, wanted)
        check_space(run.staging, sum(f.layout()[2] for f in files), run.out)
        report = stream(files, workers=run.jobs, log=run.log)
        for f in files:
            rel = Path(f.path).relative_to(run.staging).as_posix()
            if run.cache is not None and rel in keys:
                run.cache.put_file(keys[rel][0], keys[rel][1], Path(f.path))
                kill_point("weights")
    run.log(
        f"weights: {len(files)} file(s) written, {report['bytes_read'] / 2**30:.2f} GiB read in "
        f"{report['seconds']:.1f} s" + (f", {len(fetched)} from the cache" if fetched else "")
    )
    return Weights(
        stacks={r: tuple(s) for r, s in stacks.items()},
        host=host_entries(spec.model, device_embedding=spec.device_embedding),
    )


def record_cache_keys(run: Run) -> None:
    """With a cache: the entries the bundle was built from, by kind and key (layout.CACHE_KEYS_FILE),
    so that `deepinfer cache push --bundle` and `pull --bundle` copy exactly those."""
    if run.cache is None:
        return
    entries = [{"kind": k, "key": key, "identity": ident} for (k, key), ident in sorted(run.cache.used.items())]
    (run.staging / layout.CACHE_KEYS_FILE).write_text(json.dumps({"entries": entries}, indent=1) + "\n")


def layout_state(spec: Spec, plan: RegionPlan) -> State:
    pools, bindings = budget.spec_pools(spec, plan)
    return State(pools=pools, bindings=bindings)


def write_manifest(
    spec: Spec,
    plan: RegionPlan,
    weights: Weights,
    tokenizer: dict[str, mf.HostFile],
    executables: tuple[mf.Executable, ...],
    state: State,
    run: Run,
    *,
    fallback: dict[str, mf.Fallback] | None = None,
) -> mf.Manifest:
    c = spec.config
    layers = _manifest_layers(spec, plan, state, set(fallback or ()))
    manifest = mf.Manifest(
        format_version=mf.FORMAT_VERSION,
        deepinfer_version=deepinfer.__version__,
        toolchain=spec.target.toolchain(),
        target=mf.Target(name=c.target.name, executable=spec.target.executable, options=c.target.options),
        stage="hlo" if spec.hlo_only else "executable",
        topology=mf.Ranks.of(spec.topology, spec.target.lnc),
        model=_manifest_model(spec, tokenizer),
        buckets=mf.Buckets(
            shapes=tuple(mf.Shape(batch=b, tokens=t) for b, t in c.buckets.shapes()),
            max_context=c.buckets.max_context,
            contexts=c.buckets.contexts,
        ),
        kv=_manifest_kv(spec, state),
        regions=executables,
        head=mf.Binding(kind="head", index=0),
        embed=mf.Binding(kind="embed", index=0) if "embed" in plan.kinds else None,
        layers=layers,
        weights=weights.stacks,
        host={**weights.host, **tokenizer},
        # per rank; refuses the bundle if the executables overflow it
        memory=budget.record(spec, plan, executables, run.staging),
        draft=_draft_entry(spec, plan),
        fallback=fallback or None,
    )
    manifest = manifest_io.stamp(run.staging, manifest)
    manifest_io.write(run.staging, manifest)
    return manifest


def _manifest_layers(spec: Spec, plan: RegionPlan, state: State, per_region: set[str]) -> tuple[mf.Layer, ...]:
    """Each layer's entry; a fused layer names its layer kind, unless that kind is in `per_region`
    (neuronx-cc refused it: compiler/fallback.py)."""
    kinds = plan.fused_kinds().values() if spec.fused else ()
    fused = {layer: lk.name for lk in kinds if lk.name not in per_region for layer in lk.layers}
    return tuple(
        mf.Layer(
            layer=p.layer,
            attn=typing.cast(mf.AttentionKind, _checked(mf.Layer, "attn", p.attn)),
            ratio=p.ratio,
            kv_source=p.kv_source,
            candidate_source=p.candidate_source,
            uses_candidates=p.uses_candidates,
            engram=p.engram_rows > 0,
            regions={
                slot: mf.Binding(kind=kind, index=index) for slot, (kind, index) in plan.bindings[p.layer].items()
            },
            state={name: tuple(ref) for name, ref in state.bindings[p.layer].items()},
            fused=fused.get(p.layer),
        )
        for p in plan.layers
    )


def _manifest_model(spec: Spec, tokenizer: dict[str, mf.HostFile]) -> mf.Model:
    c = spec.config
    return mf.Model(
        config=spec.model.to_dict(),
        config_hash=spec.model.digest(),
        dtype=typing.cast(mf.ModelDtype, _checked(mf.Model, "dtype", c.model.dtype)),
        cache_quant=c.model.cache_quant,
        weight_format="e4m3fn",
        scale_layout="ue8m0-u8-row-major",
        tokenizer="tokenizers" if tokenizer else "byte",
    )


def _manifest_kv(spec: Spec, state: State) -> mf.KV:
    c, g = spec.config, spec.geometry
    return mf.KV(
        block_size=c.kv.block_size,
        num_blocks=c.kv.num_blocks,
        slots=g.slots,
        max_blocks=g.max_blocks,
        scratch="block 0 and slot 0",
        pools=state.pools,
        state_writes=spec.target.state_writes,
        static_pools=spec.target.static_shapes,
        divided=spec.topology.cp,
    )


def _checked(part: type, name: str, value: object) -> object:
    """`value` checked against the annotation of field `name` of manifest part `part` (one of its
    literals, where the compiler holds a str), as a reader of the manifest would check it."""
    return coerce(value, typing.get_type_hints(part)[name], (name,), Rules())


def _draft_entry(spec: Spec, plan: RegionPlan) -> mf.Draft | None:
    name = spec.config.speculative.draft
    if not plan.draft or name is None:
        return None
    c = spec.model.text
    return mf.Draft(
        name=name,
        block=plan.draft_block,
        window=plan.draft_window,
        target_layers=tuple(c.dspark_target_layer_ids),
        features=DRAFT_FEATURES,
        stages=tuple(
            {slot: mf.Binding(kind=kind, index=index) for slot, (kind, index) in stage.items()} for stage in plan.draft
        ),
    )


# --- the API -------------------------------------------------------------------------------------


INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
INDUCTOR_CACHE = Path(".cache/inductor")  # under the working directory, unless the user names one


def use_inductor_cache() -> Path:
    """Inductor's cache directory (AOTInductor's compiled kernels and headers): $TORCHINDUCTOR_CACHE_DIR
    when set, else ./.cache/inductor, set for this process and the compile workers it spawns."""
    return Path(os.environ.setdefault(INDUCTOR_CACHE_ENV, str(INDUCTOR_CACHE.resolve())))


def settings(
    config: CompileConfig,
    out: Path,
    *,
    jobs: int,
    cache: Cache | None,
    require_cache: bool,
    hlo_only: bool,
    ray: str | None = None,
) -> str:
    """The resolved settings of a compile, as it reports them before it starts."""
    b, m, t, p = config.buckets, config.model, config.target, config.parallel
    return (
        f"compiling {config.source} -> {out}\n"
        f"  checkpoint {m.checkpoint} ({m.dtype}, cache_quant={str(m.cache_quant).lower()})\n"
        f"  target {t.name} ({t.executable}), buckets batch={list(b.batch)} tokens={list(b.tokens)} "
        f"max_context={b.max_context} context={list(b.contexts)}, kv block_size={config.kv.block_size} "
        f"num_blocks={config.kv.num_blocks}, parallel tp={p.tp} ep={p.ep} cp={p.cp}, "
        f"jobs={jobs}, cache {cache.dir if cache else 'off'}"
        f"{' + ' + cache.remote_url if cache and cache.remote_url else ''}{' (required)' if require_cache else ''}"
        f"{f', on the Ray cluster at {ray}' if ray else ''}"
        f"{', stop at HLO' if hlo_only else ''}"
    )


@dataclass(frozen=True, kw_only=True)
class CompileReport:
    """What `compile_bundle` did: the bundle, the settings it resolved, each pass's seconds, and
    which executables it built itself (the others came from the cache)."""

    bundle: Path
    settings: str
    seconds: dict[str, float]  # pass name -> seconds
    executables: int  # in the bundle
    compiled: tuple[str, ...]  # compiled by this compile (none for an HLO-stage bundle)
    lowered: tuple[str, ...]  # HLO-stage bundles: the HLO modules lowered and checked (every one)
    cache: Path | None  # the artifact cache's directory; None: no cache
    hlo_only: bool = False
    store: str | None = None  # the cache's remote tier (s3://...); None: none
    # entries (executables, weights, traces) handed out by the local tier and by the store, and
    # entries published to the store (`Cache.tiers`); empty without a cache
    tiers: dict[str, int] = field(default_factory=dict)
    fallback: dict[str, mf.Fallback] = field(default_factory=dict)  # layer kinds compiled per region

    @property
    def summary(self) -> str:
        """One line: where, how long, how many built and how many fetched."""
        built = self.lowered if self.hlo_only else self.compiled
        what = "HLO modules lowered and checked" if self.hlo_only else "executables compiled"
        n, total = self.executables, sum(self.seconds.values())
        line = f"wrote {self.bundle} in {total:.1f} s ({len(built)} of {n} {what}, {n - len(built)} from the cache)"
        line += "".join(f"; {k} per region ({f.code})" for k, f in self.fallback.items())
        if self.store is None:
            return line
        t = self.tiers
        return (
            f"{line}; cache entries: {t['local']} from the local tier, {t['store']} from {self.store}, "
            f"{t['published']} published"
        )

    def to_json(self) -> dict[str, object]:
        """The `deepinfer-compile --json` summary."""
        return {
            "bundle": str(self.bundle),
            "seconds": self.seconds,
            "executables": self.executables,
            "compiled": list(self.compiled),
            "lowered": list(self.lowered),
            "cache": str(self.cache) if self.cache else None,
            "store": self.store,
            "tiers": self.tiers,
            "fallback": {kind: manifest_io.to_json(f) for kind, f in self.fallback.items()},
        }


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _finish(staging: Path, out: Path, force: bool, sign: object | None) -> None:
    """Sign the manifest (with a key), make the files readable by all, and publish the bundle."""
    if sign is not None:
        sign_file(staging / layout.MANIFEST_FILE, sign, staging / layout.SIGNATURE_FILE)
    for path in staging.rglob("*"):  # safetensors writes 0600; a bundle is for sharing
        os.chmod(path, 0o755 if path.is_dir() else 0o644)
    os.chmod(staging, 0o755)
    kill_point("publish")
    publish(staging, out, force)


def compile_bundle(
    config: CompileConfig,
    out: Path | str,
    *,
    jobs: int = 1,
    force: bool = False,
    log: Log | None = None,
    cache: Cache | typing.Literal["default"] | None = "default",
    require_cache: bool = False,
    verbose: bool = False,
    hlo_only: bool = False,
    sign: object | None = None,
    ray: str | None = None,
) -> CompileReport:
    """Run every pass and publish the bundle; logs the resolved settings first and a summary last,
    and returns both with the seconds each pass took and what was built (`CompileReport`).

    Inductor's cache goes to $TORCHINDUCTOR_CACHE_DIR, else ./.cache/inductor (`use_inductor_cache`).
    Every executable, weight stack and trace is fetched by key from `cache` or built and stored there:
    by default the cache deepinfer-compile uses (`compiler.cache.default_cache`), None for none (as
    --no-cache).
    With `require_cache`, a miss raises CacheError naming the region and why. `verbose` logs each
    missed key's part hashes. `hlo_only` (trn2) stops after lowering and checking: the bundle holds
    HLO modules, finished later by `finish_bundle`. With `sign` (an Ed25519 private key,
    `bundles.signing`), the manifest is signed before the bundle is published. With `ray` ("auto" or
    a cluster's HOST:PORT), the compile jobs run as Ray tasks on that cluster (compiler/farm.py),
    joined before any pass so that a bad address fails at once; the other passes stay here.
    """
    log = log or _stderr
    out = Path(out)
    if isinstance(cache, str):  # "default"
        cache = default_cache(config, log=log, sign=sign)
    resolved = settings(config, out, jobs=jobs, cache=cache, require_cache=require_cache, hlo_only=hlo_only, ray=ray)
    log(resolved)
    use_inductor_cache()
    _refuse_early(config, out, force, cache is not None, require_cache, hlo_only, ray)
    clean_stale(out, log)
    try:
        staging = make_staging(out)
    except OSError as e:
        raise disk_error(e, out) from None
    run = Run(
        staging=staging,
        out=out,
        jobs=jobs,
        log=log,
        cache=cache,
        require_cache=require_cache,
        verbose=verbose,
        ray=ray,
    )
    timed = Timings()
    with stopped_by_signals(log, staging):  # SIGTERM or Ctrl-C: the staging directory and the workers go too
        built = _build_and_publish(config, hlo_only, run, timed, force, sign)
    report = _report(out, resolved, timed, built, cache, hlo_only)
    log(report.summary)
    return report


def _report(
    out: Path, resolved: str, timed: Timings, built: Built, cache: Cache | None, hlo_only: bool
) -> CompileReport:
    return CompileReport(
        bundle=out,
        settings=resolved,
        seconds=timed.seconds,
        executables=built.executables,
        compiled=built.compiled,
        lowered=built.lowered,
        cache=cache.dir if cache else None,
        hlo_only=hlo_only,
        store=cache.remote_url if cache else None,
        tiers=cache.tiers() if cache else {},
        fallback=built.fallback,
    )


def _refuse_early(
    config: CompileConfig, out: Path, force: bool, cached: bool, require_cache: bool, hlo_only: bool, ray: str | None
) -> None:
    """What fails before anything is written: the output, the flags' combinations, the Ray cluster."""
    check_output(out, force, config.model.checkpoint)
    if require_cache and not cached:
        raise ConfigError("--require-cache needs a cache (drop --no-cache)")
    if hlo_only and not TARGETS[config.target.name].static_shapes:
        raise config_error(config, "target", "name", f"--hlo-only is for the trn2 target, not {config.target.name!r}")
    if ray is not None:
        from deepinfer.compiler import farm

        farm.connect(ray)


def _build_and_publish(
    config: CompileConfig, hlo_only: bool, run: Run, timed: Timings, force: bool, sign: object | None
) -> Built:
    """Every pass into `run.staging`, then the bundle published; on any failure the staging
    directory is removed (its logs kept beside the output) and the error raised as one line."""
    try:
        built = build(config, hlo_only, run, timed)
        _finish(run.staging, run.out, force, sign)
    except BaseException as e:
        if isinstance(e, OSError) and e.errno in DISK_ERRORS:
            e = disk_error(e, run.out)
        if isinstance(e, DeepinferError):
            e = keep_failed_logs(e, run.staging / layout.LOGS_DIR, run.out)
        shutil.rmtree(run.staging, ignore_errors=True)
        if isinstance(e, DeepinferError):
            raise e from None
        raise
    return built


def cache_key(
    config: CompileConfig,
    *,
    cache: Cache | None = None,
    log: Log | None = None,
    verbose: bool = False,
    hlo_only: bool = False,
) -> Key:
    """One key for the whole bundle (for CI cache systems), from the trace, weight and host keys:
    nothing is traced or compiled. `cache` only lends its tensor-digest memo."""
    log = log or _stderr
    spec = parse(config, hlo_only, log)
    p = plan(spec, log)
    ckpt = Checkpoint(config.model.checkpoint)
    memo = artifact_keys.Memo(cache.root / "files", log) if cache else None
    weights = {
        f"{kind} rank {r}": artifact_keys.weights_key(spec, ckpt, kind, kp, r, memo)
        for kind, kp in p.kinds.items()
        for r in range(spec.topology.world)
    }
    host = {
        name: artifact_keys.host_key(spec, ckpt, name, memo)
        for name in host_entries(spec.model, device_embedding=spec.device_embedding)
    }
    traces = {e.name: artifact_keys.trace_key(spec, p, e) for e in spec.executables(p)}
    key = artifact_keys.bundle_key(
        spec, weights=weights, host=host, traces=traces, tokenizer=tokenizer_digests(config.model.checkpoint)
    )
    if verbose:
        for k in [*weights.values(), *traces.values(), key]:
            log(f"{k.kind} {k.identity} {k.digest[:16]}")
            for line in k.lines():
                log(line)
    return key
