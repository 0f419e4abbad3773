"""The key of each artifact a compile caches (what each key sees); fetch-or-build is `fetch_or_build.py`.

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
recipe and the weight code (`weights_key`), host files likewise (`host_key`).
The bundle's key (`bundle_key`, for CI caches) sees every option of
`keys.KEYED_OPTIONS`, the one list of what a key sees (`config_part`), and the
keys of everything the bundle holds.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict

from deepinfer.bundles.safetensors import read_header
from deepinfer.compiler.cache.keys import (
    KEYED_OPTIONS,
    Key,
    format_part,
    import_closure,
    kernel_sources,
    modules_digest,
    sha256,
)
from deepinfer.compiler.plan import Exe, KindPlan, LayerKind, RegionPlan
from deepinfer.compiler.spec import Run, Spec
from deepinfer.compiler.trace import Signature, weight_specs
from deepinfer.compiler.weights import host_entries, host_sources, source_names, stack_files
from deepinfer.reader import ReadError, load_json
from deepinfer.regions.base import engram_table_specs
from deepinfer.regions.checkpoint import Checkpoint
from deepinfer.regions.state import Geometry

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


# --- the parts several keys share ---------------------------------------------------------------


class TargetPart(TypedDict):
    name: str
    executable: str
    options: dict  # the keyed ones: log-only options left out


class ModelPart(TypedDict):
    config_hash: str  # the checkpoint's config.json, by contents
    dtype: str
    cache_quant: bool


class BucketPart(TypedDict):
    batch: int
    tokens: int
    context: int | None


def target_part(spec: Spec) -> TargetPart:
    t = spec.target
    return {"name": t.name, "executable": t.executable, "options": t.keyed_options()}


def model_part(spec: Spec) -> ModelPart:
    m = spec.config.model
    return {"config_hash": spec.model.digest(), "dtype": m.dtype, "cache_quant": m.cache_quant}


def geometry_part(g: Geometry) -> dict:
    """The geometry's fields but the rings' slack: it shapes only the ring state inputs, which the
    signature part holds (a region reads the ring's rows from its shape), so a graph that reads no
    ring keeps its key with a draft, and a bundle without one keeps all of its keys."""
    return {k: v for k, v in vars(g).items() if k != "slack"}


def bucket_part(exe: Exe) -> BucketPart:
    return {"batch": exe.batch, "tokens": exe.tokens, "context": exe.context}


def _specs(specs: Sequence) -> list:
    return [[s.name, list(s.shape), str(s.dtype), s.role] for s in specs]


# --- one builder per kind of artifact: trace, executable, weights, host; and the bundle's -------


def trace_key(spec: Spec, plan: RegionPlan, exe: Exe) -> Key:
    fused = plan.fused_modules() if spec.fused else {}
    if exe.kind in fused:
        return _layer_trace_key(spec, plan, exe, fused[exe.kind])
    region = plan.kinds[exe.kind].region
    geometry = spec.geometry_at(exe.context)
    sig = Signature(weight_specs(region), region.method_inputs(exe.method, exe.batch, exe.tokens, geometry))
    return Key.of(
        "trace",
        exe.name,
        [
            ("format", format_part()),
            ("region", {"class": type(region).__qualname__, "kind": exe.kind, "method": exe.method}),
            ("bucket", bucket_part(exe)),
            ("geometry", geometry_part(geometry)),
            ("model", model_part(spec)),
            ("topology", spec.topology.to_dict()),
            ("fp8", region.fp8_format),
            ("signature", {"weights": _specs(sig.weights), "inputs": _specs(sig.inputs)}),
            ("target", target_part(spec)),
            ("toolchain", spec.target.toolchain()),
            ("sources", graph_sources(spec.target.LOWERING_MODULES)),
        ],
    )


def _layer_trace_key(spec: Spec, plan: RegionPlan, exe: Exe, lk: LayerKind) -> Key:
    """A fused layer's trace (compiler/layers.py): its regions' pieces' trace keys, the topology its
    collectives follow, and the modules that wire it (the target's LOWERING_MODULES)."""
    pieces = plan.pieces(lk, exe, spec.topology.groups if spec.topology.dispatch else 1)
    return Key.of(
        "trace",
        exe.name,
        [
            ("format", format_part()),
            ("layer", {"kind": lk.name, "slots": [list(s) for s in lk.slots]}),
            ("bucket", bucket_part(exe)),
            ("pieces", {f"{slot}.{method}": trace_key(spec, plan, p).digest for (slot, method), p in pieces.items()}),
            ("topology", spec.topology.to_dict()),
            ("target", target_part(spec)),
            ("sources", graph_sources(spec.target.LOWERING_MODULES)),
        ],
    )


def executable_key(spec: Spec, plan: RegionPlan, exe: Exe, graph: str, kernels: list[str]) -> Key:
    kind = plan.kinds.get(exe.kind)
    return Key.of(
        "executable",
        exe.name,
        [
            ("format", format_part()),
            ("graph", graph),
            ("region", {"class": type(kind.region).__qualname__ if kind else "layer", "method": exe.method}),
            ("bucket", bucket_part(exe)),
            ("target", target_part(spec)),
            ("toolchain", spec.target.toolchain()),
            ("kernels", kernel_sources(kernels)),
            ("lowering", modules_digest(lowering_sources(spec.target.LOWERING_MODULES))),
        ],
    )


# --- checkpoint tensors, by contents ---


@dataclass
class Memo:
    """Where the cache memoizes checkpoint tensor digests (`<cache>/v1/files/`), and where a memo
    found corrupt is reported (once per memo file; it is then hashed again and rewritten)."""

    dir: Path
    log: Callable[[str], None] = lambda msg: None
    warned: set[Path] = field(default_factory=set)

    def read(self, memo_file: Path, names: Collection[str]) -> dict[str, str] | None:
        """The memo's digests when it holds one for each of `names`; None on a miss (reported
        when the memo is there but corrupt: not JSON, the wrong types, a tensor missing)."""
        if not memo_file.exists() and not memo_file.is_symlink():
            return None
        try:
            data = load_json(memo_file, root=self.dir)
            why = None if _is_memo(data, names) else "it does not hold a sha256 for each tensor of the file"
        except ReadError as e:
            data, why = None, str(e).removeprefix(f"{memo_file}: ")
        if why is None:
            return data
        if memo_file not in self.warned:
            self.warned.add(memo_file)
            self.log(f"warning: cache: tensor digest memo {memo_file} is corrupt ({why}); hashing the file again")
        return None


def _is_memo(data, names: Collection[str]) -> bool:
    return (
        isinstance(data, dict)
        and all(isinstance(v, str) and len(v) == 64 for v in data.values())
        and all(n in data for n in names)
    )


def _file_digests(path: Path, memo: Memo | None, names: Collection[str] = ()) -> dict[str, str]:
    """{tensor name: sha256 of dtype, shape and raw bytes} for one safetensors file,
    memoized by the file's identity and stat: path, device, inode, size, mtime and ctime. A file
    edited in place with its size and mtime restored (`rsync -t --inplace`, `touch -r`) still
    has a new ctime, which no user call can set back, so it is re-hashed. A memo that does not
    hold a digest for each of `names` (corrupt, hand-edited) is a miss, reported and rewritten."""
    st = os.stat(path)
    ident = sha256(
        f"{os.path.realpath(path)}\0{st.st_dev}\0{st.st_ino}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}".encode()
    )
    memo_file = memo.dir / f"{ident}.json" if memo else None
    if memo is not None and memo_file is not None:
        found = memo.read(memo_file, names)
        if found is not None:
            return found
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
    if memo_file is not None:
        tmp = memo_file.with_name(f".{memo_file.name}.{os.getpid()}")
        try:
            memo_file.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(out))
            os.replace(tmp, memo_file)
        except OSError:  # a cache that cannot be written: hash again next time
            with contextlib.suppress(OSError):
                tmp.unlink()
    return out


def tensor_digests(ckpt: Checkpoint, names: list[str], memo: Memo | None) -> dict[str, str]:
    by_file: dict[Path, list[str]] = {}
    for n in names:
        ckpt.info(n)  # a missing tensor is a CheckpointError here
        by_file.setdefault(ckpt.files[n], []).append(n)
    per_file = {p: _file_digests(p, memo, by_file[p]) for p in sorted(by_file)}
    return {n: per_file[ckpt.files[n]][n] for n in names}


def memo_dir(run: Run) -> Memo | None:
    """Where the cache memoizes checkpoint tensor digests (none without a cache)."""
    return Memo(run.cache.root / "files", run.cache.log) if run.cache else None


def weights_key(
    spec: Spec, ckpt: Checkpoint, kind: str, kp: KindPlan, rank: int | None = 0, memo: Memo | None = None
) -> Key:
    """A kind's stacks of one rank's file (`rank`), or of the file every rank shares (`rank` None)."""
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


@dataclass(frozen=True, kw_only=True)
class HostSource:
    """What a host file (`compiler/weights.host_entries`) is built from."""

    tensors: list[str]  # its checkpoint tensors
    layout: object  # their names, shapes and dtypes as stored
    by_recipe: bool  # stored in the recipe's fp8 format (engram's tables), else as checkpointed
    roots: tuple[str, ...]  # the code that writes it (its import closure is the "sources" part)


def host_source(spec: Spec, ckpt: Checkpoint, name: str) -> HostSource:
    """The token embedding ("embed"), the engram tables ("engram") or the vision tower ("vision")."""
    t = spec.model.text
    if name == "embed":
        return HostSource(
            tensors=["embed.weight"],
            layout={"vocab": t.vocab_size, "hidden": t.hidden_size},
            by_recipe=False,
            roots=WEIGHT_ROOTS,
        )
    if name == "engram":
        return HostSource(
            tensors=host_sources(spec.model, ckpt),
            layout=[[s.name, list(s.shape), s.ckpt_dtype] for s in engram_table_specs(t)],
            by_recipe=True,
            roots=WEIGHT_ROOTS,
        )
    assert name == "vision", name
    from deepinfer.regions.vision import vision_specs

    specs = vision_specs(spec.model.vision, t.hidden_size)
    return HostSource(
        tensors=sorted(specs),
        layout={n: [list(shape), dtype] for n, (shape, dtype) in sorted(specs.items())},
        by_recipe=False,
        roots=WEIGHT_ROOTS + ("deepinfer.regions.vision",),
    )


def host_key(spec: Spec, ckpt: Checkpoint, name: str, memo: Memo | None = None) -> Key:
    """A host-resident file: its checkpoint tensors, their layout, the recipe (where it stores them)
    and the code that writes it."""
    src = host_source(spec, ckpt, name)
    return Key.of(
        "host",
        f"host {name}",
        [
            ("format", format_part()),
            ("tensors", tensor_digests(ckpt, src.tensors, memo)),
            ("layout", src.layout),
            ("recipe", spec.recipe.name if src.by_recipe else None),
            ("sources", modules_digest(import_closure(src.roots))),
        ],
    )


def _checkpoint_contents(spec: Spec) -> str:
    return spec.model.digest()


# How the bundle key sees a keyed option whose value in model.toml is not what the compile uses.
# model.checkpoint and model.tiny (which generates it) by the checkpoint's contents, never its path:
# its config.json here, its tensors in the weights and host parts. Every other option of
# KEYED_OPTIONS is keyed by its value as parsed (`option_value`).
KEYED_VALUES: dict[str, Callable[[Spec], object]] = {
    "model.checkpoint": _checkpoint_contents,
    "model.tiny": _checkpoint_contents,
    "target.options": lambda spec: spec.target.keyed_options(),  # log-only options left out
    "quant.recipe": lambda spec: spec.recipe.name,  # "target": the target's recipe
    "host.embedding": lambda spec: not spec.device_embedding,  # unset: the target's choice
}


def option_value(spec: Spec, option: str) -> object:
    """A keyed option's value as parsed: `section.key` of model.toml, or a flag (`--hlo-only`:
    `Spec.hlo_only`). Never a path: a path is keyed by what it points at."""
    if option.startswith("--"):
        value = getattr(spec, option.removeprefix("--").replace("-", "_"))
    else:
        section, key = option.split(".")
        value = getattr(getattr(spec.config, section), key)
    assert not isinstance(value, Path), f"{option}: keyed by its path ({value}); key what it points at"
    return value


def config_part(spec: Spec) -> dict[str, object]:
    """The bundle key's view of model.toml and the flags: every option of KEYED_OPTIONS, in order
    (the one list: an option is keyed by being listed there), as `KEYED_VALUES` or else as parsed."""
    return {o: KEYED_VALUES[o](spec) if o in KEYED_VALUES else option_value(spec, o) for o in KEYED_OPTIONS}


def bundle_key(
    spec: Spec,
    *,
    weights: dict[str, Key],
    host: dict[str, Key],
    traces: dict[str, Key],
    tokenizer: dict[str, str],
) -> Key:
    """One key for the whole bundle (`--print-cache-key`): the keyed options, the toolchain, the keys
    of everything it holds, and the sha256 of each tokenizer file it carries (none for the byte
    tokenizer)."""
    return Key.of(
        "bundle",
        str(spec.config.source.name),
        [
            ("format", format_part()),
            ("config", config_part(spec)),
            ("toolchain", spec.target.toolchain()),
            ("weights", {k: v.digest for k, v in weights.items()}),
            ("host", {k: v.digest for k, v in host.items()}),
            ("traces", {k: v.digest for k, v in traces.items()}),
            ("tokenizer", tokenizer),
            ("sources", modules_digest(import_closure(BUNDLE_ROOTS))),
        ],
    )


def weight_file_keys(spec: Spec, plan: RegionPlan, ckpt: Checkpoint, run: Run) -> dict[str, tuple[str, Key]]:
    """bundle-relative path -> (cache kind, key) of every file the weight pass writes."""
    memo = memo_dir(run)
    _, entries = stack_files(spec, plan, ckpt, Path(), wanted=lambda rel: False)
    out: dict[str, tuple[str, Key]] = {}
    for rank_key, stacks in entries.items():
        rank = int(rank_key.removeprefix("rank-"))
        for w in stacks:
            if w.path is not None:
                out[w.path] = ("weights", weights_key(spec, ckpt, w.kind, plan.kinds[w.kind], rank, memo))
            if w.shared is not None and w.shared not in out:
                out[w.shared] = ("weights", weights_key(spec, ckpt, w.kind, plan.kinds[w.kind], None, memo))
    for name, entry in host_entries(spec.model, device_embedding=spec.device_embedding).items():
        out[entry.path] = ("host", host_key(spec, ckpt, name, memo))
    return out
