"""The compile pipeline's use of the artifact cache: its keys, and fetch-or-build.

Two levels, so that a warm compile neither traces nor compiles:

    trace key       everything that determines a traced graph, known before tracing:
                    region, method, bucket, geometry, model config, signature, target,
                    toolchain, the source of every graph-shaping module
                    -> a trace record: the executable key and the manifest entry
    executable key  the canonical lowered graph, (class, method), bucket, target and its
                    keyed options, toolchain, the source of every kernel the graph
                    reaches and of the lowering, the format version
                    -> the executable

A kernel's source change misses every trace record (retracing is cheap) but
changes only the executable keys of graphs that reach that kernel: only those
recompile. Weights are keyed by the digests of their source tensors, the
recipe and the weight code (`weights_key`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path

from deepinfer.bundles.layout import executable_name
from deepinfer.bundles.safetensors import read_header
from deepinfer.compiler.cache import CacheError
from deepinfer.compiler.jobs import run_job, run_jobs
from deepinfer.compiler.keys import Key, format_part, import_closure, kernel_sources, modules_digest, sha256
from deepinfer.compiler.trace import Signature, weight_specs
from deepinfer.regions.checkpoint import Checkpoint

# What each key's "sources" part covers: the import closure of the code that builds it (derived,
# never listed by hand). Kernel modules are left to the executable key's own "kernels" part, which
# follows each reached kernel's reference and helpers (a kernel change recompiles only the graphs
# that reach it).
WEIGHT_ROOTS = ("deepinfer.compiler.weights", "deepinfer.compiler.shard")
TRACE_ROOTS = ("deepinfer.compiler.trace", "deepinfer.compiler.plan")
BUNDLE_ROOTS = ("deepinfer.compiler.pipeline",)
LOWERING_STOP = tuple(
    m
    for m in import_closure(("deepinfer.kernels",))
    if m.startswith("deepinfer.kernels.") and m != "deepinfer.kernels.registry"
)


def weight_sources() -> tuple[str, ...]:
    return import_closure(WEIGHT_ROOTS)


def graph_sources(lowering_modules: tuple[str, ...]) -> dict[str, str]:
    """Every module whose source can shape a traced graph, by name -> sha256."""
    return modules_digest(import_closure(TRACE_ROOTS + tuple(lowering_modules)))


def lowering_sources(lowering_modules: tuple[str, ...]) -> tuple[str, ...]:
    """The target's lowering code and what it imports, kernel modules aside."""
    return import_closure(tuple(lowering_modules) + ("deepinfer.kernels.registry",), LOWERING_STOP)


def _target_part(spec) -> dict:
    t = spec.target
    return {"name": t.name, "executable": t.executable, "options": t.keyed_options()}


def _model_part(spec) -> dict:
    m = spec.config.model
    return {"config_hash": spec.model.digest(), "dtype": m.dtype, "cache_quant": m.cache_quant}


def _specs(specs) -> list:
    return [[s.name, list(s.shape), str(s.dtype), s.role] for s in specs]


def trace_key(spec, plan, kind: str, method: str, batch: int, tokens: int, context: int | None) -> Key:
    region = plan.kinds[kind].region
    geometry = spec.geometry_at(context)
    sig = Signature(weight_specs(region), region.method_inputs(method, batch, tokens, geometry))
    return Key.of(
        "trace",
        executable_name(kind, method, batch, tokens, context),
        [
            ("format", format_part()),
            ("region", {"class": type(region).__qualname__, "kind": kind, "method": method}),
            ("bucket", {"batch": batch, "tokens": tokens, "context": context}),
            ("geometry", vars(geometry)),
            ("model", _model_part(spec)),
            ("topology", spec.topology.to_dict()),
            ("fp8", region.fp8_format),
            ("signature", {"weights": _specs(sig.weights), "inputs": _specs(sig.inputs)}),
            ("target", _target_part(spec)),
            ("toolchain", spec.target.toolchain()),
            ("sources", graph_sources(spec.target.LOWERING_MODULES)),
        ],
    )


def executable_key(
    spec, plan, kind: str, method: str, batch: int, tokens: int, context: int | None, graph: str, kernels: list[str]
) -> Key:
    region = plan.kinds[kind].region
    return Key.of(
        "executable",
        executable_name(kind, method, batch, tokens, context),
        [
            ("format", format_part()),
            ("graph", graph),
            ("region", {"class": type(region).__qualname__, "method": method}),
            ("bucket", {"batch": batch, "tokens": tokens, "context": context}),
            ("target", _target_part(spec)),
            ("toolchain", spec.target.toolchain()),
            ("kernels", kernel_sources(kernels)),
            ("lowering", modules_digest(lowering_sources(spec.target.LOWERING_MODULES))),
        ],
    )


# --- weights ---


def _file_digests(path: Path, memo: Path | None) -> dict[str, str]:
    """{tensor name: sha256 of dtype, shape and raw bytes} for one safetensors file,
    memoized by the file's identity and stat: path, device, inode, size, mtime and ctime. A file
    edited in place with its size and mtime restored (`rsync -t --inplace`, `touch -r`) still
    has a new ctime, which no user call can set back, so it is re-hashed."""
    st = os.stat(path)
    ident = sha256(
        f"{os.path.realpath(path)}\0{st.st_dev}\0{st.st_ino}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}".encode()
    )
    memo_file = memo / f"{ident}.json" if memo else None
    if memo_file and memo_file.exists():
        try:
            return json.loads(memo_file.read_text())
        except ValueError:
            pass
    tensors, _ = read_header(str(path))
    out = {}
    with open(path, "rb") as f:
        for t in sorted(tensors.values(), key=lambda t: t.offset):
            f.seek(t.offset)
            h = hashlib.sha256(f"{t.dtype}{list(t.shape)}".encode())
            left = t.nbytes
            while left:
                block = f.read(min(left, 1 << 24))
                if not block:
                    break
                h.update(block)
                left -= len(block)
            out[t.name] = h.hexdigest()
    if memo_file:
        tmp = memo_file.with_name(f".{memo_file.name}.{os.getpid()}")
        try:
            memo.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(out))
            os.replace(tmp, memo_file)
        except OSError:  # a cache that cannot be written: hash again next time
            with contextlib.suppress(OSError):
                tmp.unlink()
    return out


def tensor_digests(ckpt: Checkpoint, names: list[str], memo: Path | None) -> dict[str, str]:
    for n in names:
        ckpt.info(n)  # a missing tensor is a CheckpointError here
    per_file = {p: _file_digests(p, memo) for p in sorted({ckpt.files[n] for n in names})}
    return {n: per_file[ckpt.files[n]][n] for n in names}


def memo_dir(run) -> Path | None:
    """Where the cache memoizes checkpoint tensor digests (none without a cache)."""
    return run.cache.root / "files" if run.cache else None


def weights_key(spec, ckpt: Checkpoint, kind: str, kp, rank: int | None = 0, memo: Path | None = None) -> Key:
    """A kind's stacks of one rank's file (`rank`), or of the file every rank shares (`rank` None)."""
    from deepinfer.compiler.weights import source_names

    return Key.of(
        "weights",
        f"weights {kind}" + (" shared" if rank is None else ""),
        [
            ("format", format_part()),
            ("kind", {"kind": kind, "rank": rank, "topology": spec.topology.to_dict()}),
            (
                "layout",
                {
                    "specs": [[s.name, s.key, list(s.shape), s.ckpt_dtype, s.experts] for s in kp.region.specs],
                    "layers": kp.layers,
                },
            ),
            ("tensors", tensor_digests(ckpt, source_names(kp, ckpt), memo)),
            ("recipe", spec.recipe.name),
            ("sources", modules_digest(weight_sources())),
        ],
    )


def host_key(spec, ckpt: Checkpoint, memo: Path | None = None) -> Key:
    t = spec.model.text
    return Key.of(
        "host",
        "host embed",
        [
            ("format", format_part()),
            ("tensors", tensor_digests(ckpt, ["embed.weight"], memo)),
            ("shape", {"vocab": t.vocab_size, "hidden": t.hidden_size}),
            ("sources", modules_digest(weight_sources())),
        ],
    )


def engram_key(spec, ckpt: Checkpoint, memo: Path | None = None) -> Key:
    """The host-resident engram tables file: its checkpoint tensors, their layout and the recipe
    (fp8 codes are stored in the recipe's format)."""
    from deepinfer.compiler.weights import host_sources
    from deepinfer.regions.base import engram_table_specs

    return Key.of(
        "host",
        "host engram",
        [
            ("format", format_part()),
            ("tensors", tensor_digests(ckpt, host_sources(spec.model, ckpt), memo)),
            ("layout", [[s.name, list(s.shape), s.ckpt_dtype] for s in engram_table_specs(spec.model.text)]),
            ("recipe", spec.recipe.name),
            ("sources", modules_digest(weight_sources())),
        ],
    )


def vision_key(spec, ckpt: Checkpoint, memo: Path | None = None) -> Key:
    """The host-resident vision tower file: its checkpoint tensors and their layout."""
    from deepinfer.regions.vision import vision_specs

    specs = vision_specs(spec.model.vision, spec.model.text.hidden_size)
    return Key.of(
        "host",
        "host vision",
        [
            ("format", format_part()),
            ("tensors", tensor_digests(ckpt, sorted(specs), memo)),
            ("layout", {name: [list(shape), dtype] for name, (shape, dtype) in sorted(specs.items())}),
            ("sources", modules_digest(import_closure(WEIGHT_ROOTS + ("deepinfer.regions.vision",)))),
        ],
    )


def bundle_key(
    spec,
    weights: dict[str, Key],
    host: Key,
    traces: dict[str, Key],
    vision: Key | None = None,
    engram: Key | None = None,
    tokenizer: dict[str, str] | None = None,
) -> Key:
    """`tokenizer`: the sha256 of each tokenizer file the bundle carries (none for the byte tokenizer)."""
    c = spec.config
    return Key.of(
        "bundle",
        str(c.source.name),
        [
            ("format", format_part()),
            (
                "config",
                {
                    "model": _model_part(spec),
                    "target": _target_part(spec),
                    "buckets": {
                        "batch": list(c.buckets.batch),
                        "tokens": list(c.buckets.tokens),
                        "max_context": c.buckets.max_context,
                        "context": list(c.buckets.context),
                    },
                    "kv": {"block_size": c.kv.block_size, "num_blocks": c.kv.num_blocks},
                    "parallel": {"tp": c.parallel.tp, "ep": c.parallel.ep, "cp": c.parallel.cp},
                    "quant": spec.recipe.name,
                    "host": {"embedding": not spec.device_embedding},
                    **({"stage": "hlo"} if spec.hlo_only else {}),
                },
            ),
            ("toolchain", spec.target.toolchain()),
            ("weights", {k: v.digest for k, v in weights.items()}),
            ("host", host.digest),
            ("traces", {k: v.digest for k, v in traces.items()}),
            ("sources", modules_digest(import_closure(BUNDLE_ROOTS))),
        ]
        + ([("vision", vision.digest)] if vision is not None else [])
        + ([("engram", engram.digest)] if engram is not None else [])
        + ([("tokenizer", tokenizer)] if tokenizer else []),
    )


def weight_file_keys(spec, plan, ckpt: Checkpoint, run) -> dict[str, tuple[str, Key]]:
    """bundle-relative path -> (cache kind, key) of every file the weight pass writes."""
    from deepinfer.compiler.weights import host_entries, stack_files

    memo = memo_dir(run)
    _, entries = stack_files(spec, plan, ckpt, Path(), wanted=lambda rel: False)
    out = {}
    for rank_key, stacks in entries.items():
        rank = int(rank_key.removeprefix("rank-"))
        for w in stacks:
            if w.path is not None:
                out[w.path] = ("weights", weights_key(spec, ckpt, w.kind, plan.kinds[w.kind], rank, memo))
            if w.shared is not None and w.shared not in out:
                out[w.shared] = ("weights", weights_key(spec, ckpt, w.kind, plan.kinds[w.kind], None, memo))
    host = host_entries(spec.model, device_embedding=spec.device_embedding)
    if "embed" in host:
        out[host["embed"].path] = ("host", host_key(spec, ckpt, memo))
    if "engram" in host:
        out[host["engram"].path] = ("host", engram_key(spec, ckpt, memo))
    if "vision" in host:
        out[host["vision"].path] = ("host", vision_key(spec, ckpt, memo))
    return out


@contextlib.contextmanager
def held(run, keys: dict[str, tuple[str, Key]]):
    """Lock every file's entry (sorted: compiles sharing a cache never deadlock), fetch those the
    cache holds into the staging bundle, yield their paths; the caller builds and stores the rest
    before the locks are released, so a file is built once among concurrent compiles."""
    locks = []
    try:
        fetched = set()
        for kind, key in sorted(keys.values(), key=lambda kk: kk[1].digest):
            locks.append(run.cache.lock(kind, key))
        for rel, (kind, key) in keys.items():  # plan order: the first miss named is the first file
            if run.cache.get_file(kind, key, run.staging / rel):
                fetched.add(rel)
            else:
                missed(run, kind, key)
        yield fetched
    finally:
        for lock in locks:
            lock.release()


# --- fetch or build ---


def missed(run, kind: str, key: Key) -> None:
    """A miss: log the key's parts at debug verbosity; under --require-cache, fail with why."""
    if run.verbose:
        run.log(f"cache miss: {kind} {key.identity} {key.digest[:16]}")
        for line in key.lines():
            run.log(line)
    if not run.require_cache:
        return
    near = run.cache.closest(kind, key.identity)
    if near is None:
        why = f"the cache at {run.cache.dir} holds no {kind} for it"
    else:
        old = {p["name"]: p["hash"] for p in near.meta.get("parts", [])}
        diff = [n for n, h in key.part_hashes.items() if old.get(n) != h]
        why = (
            f"key part(s) {', '.join(diff)} differ from the cached entry {near.key[:16]} "
            f"(deepinfer cache explain {near.key[:16]} {key.digest[:16]})"
        )
    raise CacheError(f"--require-cache: cache miss for {kind} {key.identity}: {why}")


def trace_record(run, key: Key) -> dict | None:
    data = run.cache.get_bytes("trace", key)
    return json.loads(data) if data is not None else None


def compile_jobs(run, traced, progress) -> None:
    """Compile each job's executable once across every compile sharing the cache: the
    jobs whose lock this compile takes run here (in parallel); the others are waited
    for and then fetched (or compiled here if their compile died)."""
    cache = run.cache
    if cache is None:
        run_jobs(list(traced.jobs), run.jobs, progress)
        return
    mine, theirs, locks = [], [], {}
    for job in traced.jobs:
        key = traced.keys[job.name]
        lock = cache.lock("executable", key, blocking=False)
        if not lock.held:
            theirs.append(job)
        elif cache.get_file("executable", key, job.out):  # stored since the trace pass
            lock.release()
            run.log(f"cached {job.name}")
        else:
            locks[job.name] = lock
            mine.append(job)

    def done(i, total, job, seconds):
        cache.put_file("executable", traced.keys[job.name], job.out)
        cache.stats["compiled"].append(job.name)
        locks.pop(job.name).release()
        progress(i, total, job, seconds)

    try:
        run_jobs(mine, run.jobs, done)
    finally:
        for lock in locks.values():
            lock.release()
    for i, job in enumerate(theirs, 1):
        key = traced.keys[job.name]
        run.log(f"waiting for another compile of {job.name}")
        with cache.lock("executable", key, blocking=True):
            if cache.get_file("executable", key, job.out):
                run.log(f"cached {job.name}")
                continue
            seconds = run_job(job)
            cache.put_file("executable", key, job.out)
            cache.stats["compiled"].append(job.name)
            progress(i, len(theirs), job, seconds)
