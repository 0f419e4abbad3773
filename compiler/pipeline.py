"""deepinfer-compile as a list of named passes.

    parse config -> plan regions -> check memory budget -> preprocess weights (per rank)
    -> trace (and lower; on trn2: HLO, checked on XLA:CPU) -> check memory budget with scratch
    -> compile -> lay out state -> write manifest -> publish (atomic rename)

Every pass reads and extends one `Build`. With a cache (`compiler/cached.py`),
the weights pass fetches each kind's stacks by key instead of rebuilding them,
the trace pass fetches an executable whose trace record and executable are
cached (neither tracing nor compiling it), and the compile pass compiles only
the misses, each at most once among the compiles that share the cache. The bundle is assembled in a
temporary sibling of the output directory and renamed into place at the end:
an interrupted or failed compile leaves no partial bundle.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import deepinfer
from deepinfer.bundles import layout, manifest as mf
from deepinfer.bundles.cache import Cache
from deepinfer.bundles.keys import Key, graph_digest, kernels_reached
from deepinfer.compiler import budget, cached
from deepinfer.compiler.config import CompileConfig, config_error
from deepinfer.compiler.jobs import Job, keep_failed_logs
from deepinfer.compiler.plan import RegionPlan, plan_regions
from deepinfer.compiler.pools import plan_pools
from deepinfer.compiler.shard import shard
from deepinfer.compiler.targets import TARGETS
from deepinfer.compiler.trace import trace
from deepinfer.compiler.weights import host_entries, kind_entry, write_host, write_host_vision, write_kind
from deepinfer.errors import ConfigError, DeepinferError
from deepinfer.regions.checkpoint import Checkpoint
from deepinfer.regions.config import V41Config, load_config
from deepinfer.regions import topology
from deepinfer.regions.step import DTYPES
from deepinfer.regions.state import Geometry, check_block_size
from deepinfer.bundles.topology import Topology

LOWERED_DIR = ".lowered"


@dataclass
class Build:
    config: CompileConfig
    out: Path
    staging: Path
    jobs: int = 1
    log: object = print
    cache: Cache | None = None
    require_cache: bool = False
    verbose: bool = False
    hlo_only: bool = False
    model: V41Config | None = None
    plan: RegionPlan | None = None
    target: object = None
    geometry: Geometry | None = None
    weights: dict = field(default_factory=dict)         # "rank-R" -> kind entries
    topology: Topology = Topology()
    host: dict = field(default_factory=dict)
    executables: list[dict] = field(default_factory=list)
    compile_jobs: list[Job] = field(default_factory=list)
    exe_keys: dict[str, Key] = field(default_factory=dict)
    pools: dict = field(default_factory=dict)
    state_bindings: dict = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)


def parse_config(b: Build) -> None:
    m = b.config.model
    if not (m.checkpoint / "config.json").exists() and m.tiny is not None:
        from deepinfer.regions.tiny import make_tiny

        b.log(f"checkpoint {m.checkpoint} absent: generating the tiny checkpoint "
              f"(seed {m.tiny.seed}, {m.tiny.layers} layers)")
        make_tiny(m.checkpoint, seed=m.tiny.seed, layers=m.tiny.layers, exist_ok=True)
    b.model = load_config(m.checkpoint)
    try:
        check_block_size(b.model.text, b.config.kv.block_size)
    except ConfigError as e:
        raise config_error(b.config, "kv", "block_size", str(e)) from None
    p = b.config.parallel
    b.topology = Topology(tp=p.tp, ep=p.ep, cp=p.cp)
    bad = topology.check(b.topology, b.model.text)
    if bad:
        raise config_error(b.config, "parallel", bad[0], bad[1])
    t = b.config.target
    b.target = TARGETS[t.name](t.executable, t.options)
    kv, buckets = b.config.kv, b.config.buckets
    b.geometry = Geometry(slots=max(buckets.batch) + 1, blocks=kv.num_blocks, block_size=kv.block_size,
                          max_blocks=-(-buckets.max_context // kv.block_size))


def plan(b: Build) -> None:
    b.plan = plan_regions(b.model.text, DTYPES[b.config.model.dtype], b.config.model.cache_quant, b.topology)
    kinds = ", ".join(f"{k} x{len(kp.layers)}" for k, kp in b.plan.kinds.items())
    b.log(f"{len(b.plan.layers)} layers -> {len(b.plan.kinds)} region kinds ({kinds})")


def preprocess_weights(b: Build) -> None:
    """Each rank's stacks under weights/rank-R/ (sharded per compiler/shard.py)."""
    ckpt = Checkpoint(b.config.model.checkpoint)
    world = b.topology.world
    for rank in range(world):
        for kind, kp in b.plan.kinds.items():
            cut = functools.partial(shard, kind, c=b.model.text, topo=b.topology, rank=rank)
            key = cached.weights_key(b, ckpt, kind, kp, rank) if b.cache else None
            hit = cached.fetch_or_build(b, "weights", key, layout.weights_path(rank, kind),
                                        lambda: write_kind(ckpt, kind, kp, b.staging, rank=rank, shard=cut))
            b.weights.setdefault(f"rank-{rank}", []).append(kind_entry(kind, kp, rank=rank))
            b.log(f"weights {kind}{f' rank {rank}' if world > 1 else ''}: {len(kp.layers)} layer(s)"
                  f"{' (cached)' if hit else ''}")
    t = b.model.text
    key = cached.host_key(b, ckpt) if b.cache else None
    b.host = host_entries(vision=b.model.vision.num_hidden_layers > 0)
    cached.fetch_or_build(b, "host", key, b.host["embed"]["path"],
                          lambda: write_host(ckpt, b.staging, t.vocab_size, t.hidden_size))
    if "vision" in b.host:                       # the vision tower runs on the host, as checkpointed
        key = cached.vision_key(b, ckpt) if b.cache else None
        cached.fetch_or_build(b, "host", key, b.host["vision"]["path"],
                              lambda: write_host_vision(ckpt, b.staging, b.model))


def _io(specs) -> list[dict]:
    return [{"name": s.name, "shape": list(s.shape), "dtype": str(s.dtype).removeprefix("torch."), "role": s.role}
            for s in specs]


def trace_regions(b: Build) -> None:
    """Trace, lower and emit each executable's graph (a cache hit skips all three); trn2 graphs
    are also run on XLA:CPU against their reference region here."""
    lowered_dir = b.staging / LOWERED_DIR
    lowered_dir.mkdir()
    shapes = b.config.buckets.shapes()
    gathered = b.topology.groups if b.topology.dispatch else 1
    use_cache = b.cache is not None and not b.hlo_only
    for kind, method, batch, tokens in b.plan.executables(shapes, gathered):
        name = f"{kind}.{method}.b{batch}t{tokens}"
        artifact = layout.executable_path(kind, method, batch, tokens, b.target.suffix)
        tkey = cached.trace_key(b, kind, method, batch, tokens) if use_cache else None
        record = cached.trace_record(b, tkey) if use_cache else None
        if record and b.cache.get_file("executable", record["executable_key"], b.staging / artifact):
            b.executables.append(record["entry"])
            b.log(f"cached {name}")
            continue
        region = b.plan.kinds[kind].region
        ep, sig, args = trace(region, batch, tokens, b.geometry, method, dynamic=not b.target.static_shapes)
        kernels = kernels_reached(ep)
        ep = b.target.lower(ep)
        names = [s.name for s in sig.all]
        user = [s.arg.name for s in ep.graph_signature.input_specs if s.kind.name == "USER_INPUT"]
        mutated = sorted(names[user.index(n)] for n in ep.graph_signature.user_inputs_to_mutate.values())
        entry = {"kind": kind, "method": method, "bucket": {"batch": batch, "tokens": tokens},
                 "artifact": artifact, "executable": b.target.executable,
                 "inputs": _io(sig.all), "outputs": region.output_names(), "mutates": mutated,
                 "scratch_bytes": budget.scratch_bytes(ep)}
        lowered = lowered_dir / f"{name}{b.target.lowered_suffix}"
        if b.target.static_shapes:               # state comes back as outputs: emit and check now
            try:
                entry.update(b.target.emit(ep, names, entry["outputs"], lowered), mutates=[])
            except DeepinferError as e:
                raise type(e)(f"region {name}: {e}") from None
            if b.target.check:
                entry["check"] = b.target.check_numerics(lowered, region, method, args, len(sig.weights), names,
                                                         entry["state_outputs"], f"region {name}")
                b.log(f"lowered {name}: HLO {lowered.stat().st_size} bytes, XLA:CPU vs reference "
                      f"max |diff| {entry['check']['max_abs']:.2g}")
            else:
                b.log(f"lowered {name}: HLO {lowered.stat().st_size} bytes (check off)")
        if b.hlo_only:
            entry["artifact"] = layout.executable_path(kind, method, batch, tokens, b.target.lowered_suffix)
            (b.staging / layout.REGIONS_DIR).mkdir(exist_ok=True)
            os.replace(lowered, b.staging / entry["artifact"])
            b.executables.append(entry)
            continue
        b.executables.append(entry)
        if not b.target.static_shapes:
            b.log(f"traced {name}")
        if use_cache:
            ekey = cached.executable_key(b, kind, method, batch, tokens, graph_digest(ep), kernels)
            record = {"executable_key": ekey.digest, "kernels": kernels, "entry": entry}
            b.cache.put_bytes("trace", tkey, json.dumps(record).encode())
            if b.cache.get_file("executable", ekey, b.staging / artifact):
                b.log(f"cached {name}")
                continue
            cached.missed(b, "executable", ekey)
            b.exe_keys[name] = ekey
        if not b.target.static_shapes:
            b.target.emit(ep, names, entry["outputs"], lowered)
        b.compile_jobs.append(Job(name, lowered, b.staging / artifact, b.target.name, b.target.executable,
                                  b.target.options, log=b.staging / layout.log_path(kind, method, batch, tokens)))


def compile_regions(b: Build) -> None:
    (b.staging / layout.REGIONS_DIR).mkdir(exist_ok=True)
    if b.hlo_only:
        b.log(f"HLO-stage bundle: {len(b.executables)} HLO modules; finish it where neuronx-cc is installed "
              f"with: deepinfer-compile --finish {b.out}")
    elif b.compile_jobs:
        b.target.require_compiler()

    def progress(done, total, job, seconds):
        b.log(f"[{done}/{total}] compiled {job.name} ({seconds:.1f} s)")

    try:
        cached.compile_jobs(b, b.compile_jobs, progress)
    except DeepinferError as e:
        raise keep_failed_logs(e, b.staging / layout.LOGS_DIR, b.out) from None
    shutil.rmtree(b.staging / LOWERED_DIR)
    if not b.hlo_only:
        for e in b.executables:
            e.update(b.target.describe(b.staging / e["artifact"]))



def layout_state(b: Build) -> None:
    b.pools, b.state_bindings = plan_pools(b.model.text, b.plan.layers, block_size=b.config.kv.block_size,
                                           dtype=DTYPES[b.config.model.dtype])


def write_manifest(b: Build) -> None:
    c = b.config
    layers = []
    for p in b.plan.layers:
        steps = {slot: {"kind": kind, "index": index} for slot, (kind, index) in b.plan.bindings[p.layer].items()}
        layers.append({"layer": p.layer, "attn": p.attn, "ratio": p.ratio, "kv_source": p.kv_source,
                       "candidate_source": p.candidate_source, "uses_candidates": p.uses_candidates,
                       "engram": p.engram_rows > 0, "regions": steps, "state": b.state_bindings[p.layer]})
    manifest = {
        "format_version": mf.FORMAT_VERSION,
        "deepinfer_version": deepinfer.__version__,
        "toolchain": b.target.toolchain(),
        "target": {"name": c.target.name, "executable": c.target.executable, "options": c.target.options},
        "stage": "hlo" if b.hlo_only else "executable",
        "topology": {**b.topology.to_dict(), "dispatch": b.topology.dispatch,
                     **({"lnc": b.target.lnc} if hasattr(b.target, "lnc") else {})},
        "model": {"config": b.model.to_dict(), "config_hash": b.model.digest(), "dtype": c.model.dtype,
                  "cache_quant": c.model.cache_quant, "weight_format": "e4m3fn", "scale_layout": "ue8m0-u8-row-major",
                  "tokenizer": "byte"},
        "buckets": {"shapes": [{"batch": bb, "tokens": t} for bb, t in c.buckets.shapes()],
                    "max_context": c.buckets.max_context},
        "kv": {"block_size": c.kv.block_size, "num_blocks": c.kv.num_blocks, "slots": b.geometry.slots,
               "max_blocks": b.geometry.max_blocks, "scratch": "block 0 and slot 0", "pools": b.pools,
               "state_writes": b.target.state_writes, "static_pools": b.target.static_shapes},
        "regions": b.executables,
        "head": {"kind": "head", "index": 0},
        "layers": layers,
        "weights": b.weights,
        "host": b.host,
        "memory": budget.record(b),           # per rank; refuses the bundle if the executables overflow it
    }
    mf.stamp_digests(b.staging, manifest)
    (b.staging / layout.MANIFEST_FILE).write_text(mf.dumps(manifest))


PASSES = [
    ("parse config", parse_config),
    ("plan regions", plan),
    ("check memory budget", budget.check_planned),         # weights + pools, before any is written
    ("preprocess weights", preprocess_weights),
    ("trace", trace_regions),
    ("check memory budget with scratch", budget.check_traced),
    ("compile", compile_regions),
    ("lay out state", layout_state),
    ("write manifest", write_manifest),
]


def publish(staging: Path, out: Path, force: bool) -> None:
    """Rename the finished bundle into place (an existing one is replaced only with force)."""
    if out.exists():
        if not force:
            raise ConfigError(f"{out}: exists; pass --force to replace it")
        trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.replace(out, trash / out.name)
        os.replace(staging, out)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(staging, out)


def compile_bundle(config: CompileConfig, out: Path, *, jobs: int = 1, force: bool = False, log=None,
                   cache: Cache | None = None, require_cache: bool = False, verbose: bool = False,
                   hlo_only: bool = False) -> tuple[Path, dict[str, float]]:
    """Run every pass; returns the bundle path and the seconds each pass took.

    With `cache`, every executable, weight stack and trace is fetched by key or
    built and stored; `cache.stats` counts hits, misses and compiles. With
    `require_cache`, a miss raises CacheError naming the region and why.
    `verbose` logs each missed key's part hashes. `hlo_only` (trn2) stops after lowering and
    checking: the bundle holds HLO modules, finished later by `finish_bundle`.
    """
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    out = Path(out)
    if out.exists() and not force:
        raise ConfigError(f"{out}: exists; pass --force to replace it")
    if require_cache and cache is None:
        raise ConfigError("--require-cache needs a cache (drop --no-cache)")
    if hlo_only and not TARGETS[config.target.name].static_shapes:
        raise config_error(config, "target", "name", f"--hlo-only is for the trn2 target, not {config.target.name!r}")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    b = Build(config, out, staging, jobs=jobs, log=log, cache=cache, require_cache=require_cache, verbose=verbose,
              hlo_only=hlo_only)
    try:
        for name, run in PASSES:
            start = time.perf_counter()
            run(b)
            b.timings[name] = time.perf_counter() - start
        for path in staging.rglob("*"):      # safetensors writes 0600; a bundle is for sharing
            os.chmod(path, 0o755 if path.is_dir() else 0o644)
        os.chmod(staging, 0o755)
        publish(staging, out, force)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out, b.timings


def cache_key(config: CompileConfig, *, cache: Cache | None = None, log=None, verbose: bool = False,
              hlo_only: bool = False) -> Key:
    """One key for the whole bundle (for CI cache systems), from the trace and weight keys:
    nothing is traced or compiled. `cache` only lends its tensor-digest memo."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    b = Build(config, Path(), Path(), log=log, cache=cache, hlo_only=hlo_only)
    parse_config(b)
    plan(b)
    ckpt = Checkpoint(config.model.checkpoint)
    weights = {f"{kind} rank {r}": cached.weights_key(b, ckpt, kind, kp, r) for kind, kp in b.plan.kinds.items()
               for r in range(b.topology.world)}
    gathered = b.topology.groups if b.topology.dispatch else 1
    traces = {f"{k}.{m}.b{bb}t{t}": cached.trace_key(b, k, m, bb, t)
              for k, m, bb, t in b.plan.executables(config.buckets.shapes(), gathered)}
    key = cached.bundle_key(b, weights, cached.host_key(b, ckpt), traces,
                            cached.vision_key(b, ckpt) if b.model.vision.num_hidden_layers > 0 else None)
    if verbose:
        for k in [*weights.values(), *traces.values(), key]:
            log(f"{k.kind} {k.identity} {k.digest[:16]}")
            for line in k.lines():
                log(line)
    return key
