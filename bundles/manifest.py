"""The bundle manifest: the one contract between compiler and runtime.

`Manifest` and its parts are frozen dataclasses. The compiler builds one and
`write`s it; the runtime `read`s it, which checks, once and in this order:

1. `format_version` (written first, checked first): an unknown version is
   refused before anything else is looked at;
2. every value's type (bundles written by hand or damaged in transit);
3. ranges and cross-references: every layer's region kind has an executable
   for every bucket and a weight stack on every rank holding its row, every
   state binding names a pool and a row of it, every path stays inside the
   bundle and is covered by a digest, the topology's derived sizes agree.

`check_files` then checks the files themselves (present, digests match).
`dump` writes exactly the keys the dataclasses hold, `format_version` first.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from deepinfer.bundles import layout
from deepinfer.bundles.layout import MANIFEST_FILE, SIGNATURE_FILE, TOKENIZER_FILE, is_inside
from deepinfer.bundles.topology import Topology, partitions
from deepinfer.errors import DeepinferError
from deepinfer.reader import CAP_MANIFEST, parse_json, read_bytes
from deepinfer.schema import Problem, Rules, build, coerce, dump

# 2: shared weight stacks, per-tensor file and format; 3: every executable's output signature
# (output_specs), which loading checks with the inputs' against the executable's own file
FORMAT_VERSION = 3
SUPPORTED_VERSIONS = (3,)
# the compiled methods: every region's step, and the target head's vocabulary projection the draft's logits go
# through (the one other method a bundle holds); compiler, runtime and regions spell them only here
DECODE = "decode"
PROJECT = "project"
ROLES = ("rank", "weight", "activation", "step", "state", "carry")
DTYPE_NAMES = ("float32", "bfloat16", "float16", "int64", "int32", "uint8", "int8", "bool")


class BundleError(DeepinferError):
    """A bundle is damaged, incomplete, or cannot be run here."""


# --- the parts ---------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Target:
    name: str
    executable: str
    options: dict = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Ranks:
    """The recorded topology: a `Topology` (its degrees, field for field) with the sizes they imply
    (`Topology.to_dict`, checked on reading) and the target's LNC. The degrees are spelled once, by
    `Topology`; this is their JSON record (tests/ranks/test_shards.py holds the two to agreeing)."""

    tp: int
    ep: int
    cp: int
    world_size: int
    groups: int
    dispatch: bool
    lnc: int | None = None

    @property
    def topology(self) -> Topology:
        return Topology(tp=self.tp, ep=self.ep, cp=self.cp)

    @classmethod
    def of(cls, topo: Topology, lnc: int | None = None) -> Ranks:
        return cls(
            tp=topo.tp,
            ep=topo.ep,
            cp=topo.cp,
            world_size=topo.world,
            groups=topo.groups,
            dispatch=topo.dispatch,
            lnc=lnc,
        )


@dataclass(frozen=True, kw_only=True)
class Model:
    config: dict  # the normalized config.json (regions/config.py parses it)
    config_hash: str
    dtype: Literal["fp32", "bf16"]
    cache_quant: bool
    weight_format: str
    scale_layout: str
    tokenizer: Literal["byte", "tokenizers"] = "byte"  # "tokenizers": its files are host entries


@dataclass(frozen=True, kw_only=True)
class Shape:
    """A step shape; an executable's bucket adds its context bucket (positions) when its kind's
    shapes depend on the context, and has none (None, absent in the JSON) when they do not."""

    batch: int
    tokens: int
    context: int | None = None


@dataclass(frozen=True, kw_only=True)
class Buckets:
    shapes: tuple[Shape, ...]
    max_context: int
    # the context buckets, ascending, the last max_context; absent in bundles written before
    # context buckets, which have one: max_context
    contexts: tuple[int, ...] = ()

    @property
    def batch_sizes(self) -> list[int]:
        return sorted({s.batch for s in self.shapes})

    @property
    def token_sizes(self) -> list[int]:
        return sorted({s.tokens for s in self.shapes})

    @property
    def context_sizes(self) -> list[int]:
        return list(self.contexts or (self.max_context,))


@dataclass(frozen=True, kw_only=True)
class Pool:
    """One layer-major state pool: [len(layers), blocks | slots, *entry_shape]."""

    state: str
    dtype: str
    dim: Literal["blocks", "slots"]
    entry_shape: tuple[int, ...]
    layers: tuple[int, ...]


def blocks_per_rank(num_blocks: int, cp: int) -> int:
    """The paged pools' blocks one cp rank holds: a token group's `num_blocks` count one scratch block
    and `num_blocks - 1` usable ones, divided evenly over its cp ranks, each with a scratch block of
    its own (regions/divided.py)."""
    return (num_blocks - 1) // cp + 1


@dataclass(frozen=True, kw_only=True)
class KV:
    block_size: int
    num_blocks: int  # a token group's blocks, the scratch block included
    slots: int
    max_blocks: int
    scratch: str
    pools: dict[str, Pool]
    state_writes: str
    static_pools: bool
    # the paged pools (dim "blocks") divided block-wise over this many cp ranks (regions/divided.py):
    # each rank holds (num_blocks - 1) / divided + 1 blocks, its own scratch block included
    divided: int = 1

    @property
    def rank_blocks(self) -> int:
        """The blocks a rank's paged pools hold."""
        return blocks_per_rank(self.num_blocks, self.divided)

    def blocks_for(self, context: int) -> int:
        """The block-table width of a `context`-position bucket."""
        return -(-context // self.block_size)


@dataclass(frozen=True, kw_only=True)
class TensorSpec:
    """One input of an executable (its `role`) or one output (`output_specs`: role empty)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    role: str = ""


@dataclass(frozen=True, kw_only=True)
class InGraph:
    """A collective inside an executable (trn2's fused layers, compiler/layers.py): its op, the value
    it moves and its replica groups."""

    op: Literal["all_reduce", "all_gather", "reduce_scatter"]
    value: str
    groups: tuple[tuple[int, ...], ...]


@dataclass(frozen=True, kw_only=True)
class Executable:
    """One compiled (kind, method, bucket): its file, call signature and what it writes."""

    kind: str
    method: str
    bucket: Shape
    artifact: str
    executable: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[str, ...]
    mutates: tuple[str, ...] = ()
    scratch_bytes: int | None = None
    digest: str | None = None
    # targets whose executables return state (trn2): the written state inputs, in output order
    state_outputs: tuple[str, ...] | None = None
    aliases: dict[int, int] | None = None  # output index -> input index
    output_specs: tuple[TensorSpec, ...] | None = None
    check: dict | None = None  # the lowering's numeric check (trn2)
    neff: dict | None = None  # the NEFF header's facts (trn2)
    # outputs summed over rank groups inside the executable ({output: replica groups}, trn2 with
    # [target] options collectives = "graph"): the runtime does not reduce them again
    reduced: dict[str, tuple[tuple[int, ...], ...]] | None = None
    # the collectives inside a fused layer's executable, in the order it runs them
    collectives: tuple[InGraph, ...] | None = None

    @property
    def holds_collectives(self) -> bool:
        """Whether every rank must load and run it together (libnrt's collective load)."""
        return bool(self.reduced or self.collectives)

    @property
    def name(self) -> str:
        b = self.bucket
        return layout.executable_name(self.kind, self.method, b.batch, b.tokens, b.context)


@dataclass(frozen=True, kw_only=True)
class Binding:
    """Which executable kind a layer's slot runs, and its row in that kind's weight stacks."""

    kind: str
    index: int


@dataclass(frozen=True, kw_only=True)
class Layer:
    layer: int
    attn: Literal["window", "source", "reindex", "reuse"]
    ratio: int
    kv_source: int | None
    candidate_source: bool
    uses_candidates: bool
    engram: bool
    regions: dict[str, Binding]  # slot (engram, attn, moe) -> binding
    state: dict[str, tuple[str | int, ...]]  # state name -> [pool, row]
    # the layer kind whose one executable runs the whole layer (trn2's fused layers; its weight
    # inputs `<slot>.<name>` are the `regions` bindings' rows); None: one executable per region
    fused: str | None = None


@dataclass(frozen=True, kw_only=True)
class Draft:
    """The speculative draft compiled into the bundle (`[speculative] draft`): its stages' region
    bindings (rows of the draft kinds' stacks), the step it runs (`block` positions at each batch
    bucket; its `context` slot reads `window` target positions), the target layers whose attention
    inputs it reads, and the pool holding them (`kv.pools[features]`, one row per target layer).
    Its logits go through the target head's `project` method."""

    name: str
    block: int
    window: int
    target_layers: tuple[int, ...]
    features: str
    stages: tuple[dict[str, Binding], ...]


@dataclass(frozen=True, kw_only=True)
class TensorShape:
    """One stacked weight: its shape and storage dtype, the file holding it, and its value
    format (the names quant/ uses: e4m3fn, ue8m0-u8-row-major, e2m1-x2-u8, bf16, f32)."""

    shape: tuple[int, ...]
    dtype: str
    file: Literal["rank", "shared"] = "rank"
    format: str | None = None


@dataclass(frozen=True, kw_only=True)
class WeightStack:
    """One kind's weights on one rank: each tensor stacked over the kind's layers, in the rank's
    own file (`path`) or in the file every rank shares (`shared`)."""

    kind: str
    path: str | None
    shared: str | None = None
    layers: tuple[int, ...]
    tensors: dict[str, TensorShape]
    digest: str | None = None
    shared_digest: str | None = None

    @property
    def files(self) -> list[str]:
        return [p for p in (self.path, self.shared) if p is not None]


@dataclass(frozen=True, kw_only=True)
class HostFile:
    """A file the host reads: tensors (embed, vision, engram_token_map) or a tokenizer file
    (`tokenizer/<name>`, keyed by its name)."""

    path: str
    tensor: str | None = None  # the one tensor (embed, engram_token_map)
    tensors: str | None = None  # how its tensors are named (vision)
    digest: str | None = None


@dataclass(frozen=True, kw_only=True)
class Manifest:
    format_version: int
    deepinfer_version: str
    toolchain: dict[str, str]
    target: Target
    stage: Literal["executable", "hlo"] = "executable"
    topology: Ranks
    model: Model
    buckets: Buckets
    kv: KV
    regions: tuple[Executable, ...]
    head: Binding
    embed: Binding | None = None  # the token embedding region; None: a host lookup (host.embed)
    layers: tuple[Layer, ...]
    weights: dict[str, tuple[WeightStack, ...]]  # "rank-R" -> that rank's stacks
    host: dict[str, HostFile]
    memory: dict = field(default_factory=dict)  # the budget's breakdown per rank (informational)
    files: dict[str, str] = field(default_factory=dict)
    draft: Draft | None = None

    @property
    def draft_kinds(self) -> set[str]:
        """The kinds the draft's stages run (none without a draft)."""
        return {b.kind for stage in (self.draft.stages if self.draft else ()) for b in stage.values()}

    # -- lookups ---------------------------------------------------------------------------
    def rank_weights(self, rank: int) -> tuple[WeightStack, ...]:
        entries = self.weights.get(layout.rank_key(rank))
        if entries is None:
            raise BundleError(f"no weights for rank {rank} (the bundle has {', '.join(self.weights)})")
        return entries

    def bindings(self) -> list[tuple[int, str, Binding]]:
        """(layer, slot, binding) for every region call of a step, in order; the model's ends are
        layer -1: the embedding (where it is a region) first, the head last."""
        out = [(l.layer, slot, b) for l in self.layers for slot, b in l.regions.items()]
        return ([(-1, "embed", self.embed)] if self.embed is not None else []) + out + [(-1, "head", self.head)]

    def referenced(self) -> list[str]:
        """Every file the manifest points at."""
        return (
            [e.artifact for e in self.regions]
            + [p for ws in self.weights.values() for w in ws for p in w.files]
            + [h.path for h in self.host.values()]
        )

    def with_digests(self, files: dict[str, str]) -> Manifest:
        """This manifest covering `files` (path -> digest), each artifact, stack and host file given its digest."""
        return dataclasses.replace(
            self,
            files=dict(files),
            regions=tuple(dataclasses.replace(e, digest=files[e.artifact]) for e in self.regions),
            weights={
                r: tuple(
                    dataclasses.replace(
                        w,
                        digest=None if w.path is None else files.get(w.path),
                        shared_digest=None if w.shared is None else files.get(w.shared),
                    )
                    for w in ws
                )
                for r, ws in self.weights.items()
            },
            host={k: dataclasses.replace(h, digest=files[h.path]) for k, h in self.host.items()},
        )


# --- reading, checking, writing ------------------------------------------------------------------


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return "sha256:" + h.hexdigest()


def file_digests(bundle: Path) -> dict[str, str]:
    """Every file under `bundle` (the manifest and its signature excepted) by relative path -> sha256."""
    top = {MANIFEST_FILE, SIGNATURE_FILE}
    return {
        p.relative_to(bundle).as_posix(): sha256_file(p)
        for p in sorted(Path(bundle).rglob("*"))
        if p.is_file() and not (p.parent == Path(bundle) and p.name in top)
    }


def stamp(bundle: Path, m: Manifest) -> Manifest:
    """`m` covering every file of `bundle` (each hashed once)."""
    return m.with_digests(file_digests(bundle))


def to_json(part) -> dict:
    """A manifest (or any part of one) as its JSON value."""
    return dump(part)


def parse_executable(data, where: str) -> Executable:
    """One executable entry from its JSON value (a cached trace record holds one)."""
    try:
        return build(Executable, data)
    except Problem as p:
        raise BundleError(f"{where}: {p.dotted()}: {p.message}") from None


def executable_fields(extra: dict) -> dict:
    """Fields a target adds to an executable (as JSON values) -> the typed values `Executable` holds."""
    hints = typing.get_type_hints(Executable)
    return {k: coerce(v, hints[k], (k,), Rules()) for k, v in extra.items()}


def dumps(m: Manifest) -> str:
    """JSON text with `format_version` as the first key."""
    return json.dumps(to_json(m), indent=1) + "\n"


def write(bundle: Path, m: Manifest) -> Path:
    path = Path(bundle) / MANIFEST_FILE
    path.write_text(dumps(m))
    return path


def parse(data, where: str) -> Manifest:
    """A manifest from its JSON value: version first, then types, then cross-references."""
    version = data.get("format_version") if isinstance(data, dict) else None
    if version not in SUPPORTED_VERSIONS or isinstance(version, bool):
        raise BundleError(
            f"{where}: format_version {version!r} is not supported by this deepinfer "
            f"(reads {', '.join(map(str, SUPPORTED_VERSIONS))}); recompile the bundle "
            "or use the deepinfer that wrote it"
        )
    missing = [
        f.name
        for f in dataclasses.fields(Manifest)
        if f.name not in data and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise BundleError(f"{where}: manifest lacks {', '.join(missing)}")
    try:
        m = build(Manifest, data)
        check(m)
    except Problem as p:
        raise BundleError(f"{where}: {p.dotted()}: {p.message}") from None
    return m


def read(bundle: Path, *, trust=None) -> Manifest:
    """Load and check a bundle's manifest (not the files: see `check_files`). With `trust` (an
    Ed25519 public key, `bundles.signing`), the bytes read are first verified against the bundle's
    signature, and those same bytes are parsed."""
    path = Path(bundle) / MANIFEST_FILE
    if not path.exists() and not path.is_symlink():
        raise BundleError(f"{bundle}: not a bundle (no {MANIFEST_FILE})")
    raw = read_bytes(path, CAP_MANIFEST, root=Path(bundle), error=BundleError)
    if trust is not None:
        from deepinfer.bundles.signing import verify_bytes

        verify_bytes(raw, Path(bundle) / SIGNATURE_FILE, trust)
    data = parse_json(raw, str(path), error=BundleError)
    return parse(data, str(path))


def _need(cond: bool, key: tuple, message: str) -> None:
    if not cond:
        raise Problem(key, message)


def check(m: Manifest) -> None:
    """Ranges and cross-references (types are the dataclasses')."""
    t = m.topology
    topo = t.topology
    _need(min(t.tp, t.ep, t.cp) >= 1, ("topology",), f"degrees must be at least 1, got tp={t.tp} ep={t.ep} cp={t.cp}")
    _need(
        (t.world_size, t.groups, t.dispatch) == (topo.world, topo.groups, topo.dispatch),
        ("topology",),
        f"world_size {t.world_size}, groups {t.groups}, dispatch {t.dispatch} do not follow from tp={t.tp} "
        f"ep={t.ep} cp={t.cp} (expected {topo.world}, {topo.groups}, {topo.dispatch})",
    )
    kv = m.kv
    for name in ("block_size", "num_blocks", "slots", "max_blocks"):
        _need(getattr(kv, name) >= 1, ("kv", name), f"must be at least 1, got {getattr(kv, name)}")
    _need(
        kv.divided == t.cp,
        ("kv", "divided"),
        f"the paged pools are divided over {kv.divided} cp rank(s), the topology has cp={t.cp}"
        + (": compiled before cp divided the context; recompile it" if kv.divided == 1 else ""),
    )
    _need(
        (kv.num_blocks - 1) % kv.divided == 0,
        ("kv", "num_blocks"),
        f"{kv.num_blocks} blocks (1 scratch and {kv.num_blocks - 1} usable) do not divide over {kv.divided} cp ranks",
    )
    b = m.buckets
    _need(b.max_context >= 1 and bool(b.shapes), ("buckets",), "needs shapes and a positive max_context")
    _need(
        not b.contexts
        or (list(b.contexts) == sorted(set(b.contexts)) and b.contexts[0] >= 1 and b.contexts[-1] == b.max_context),
        ("buckets", "contexts"),
        f"expected ascending positive context lengths ending at max_context {b.max_context}, got {list(b.contexts)}",
    )
    _need(
        kv.max_blocks == kv.blocks_for(b.max_context),
        ("kv", "max_blocks"),
        f"{kv.max_blocks} blocks do not hold max_context {b.max_context} at block_size {kv.block_size}",
    )
    for name, pool in kv.pools.items():
        _need(pool.dtype in DTYPE_NAMES, ("kv", "pools", name, "dtype"), f"unknown dtype {pool.dtype!r}")
        _need(all(d >= 0 for d in pool.entry_shape), ("kv", "pools", name, "entry_shape"), "negative size")
    # executables: unique, inside the bundle, a known signature
    seen = set()
    key: tuple[str | int, ...]
    for i, e in enumerate(m.regions):
        key = ("regions", i)
        _need(e.name not in seen, key, f"{e.name} is listed twice")
        seen.add(e.name)
        _need(is_inside(e.artifact), key + ("artifact",), f"path {e.artifact!r} is not inside the bundle")
        _need(e.bucket.batch >= 1 and e.bucket.tokens >= 1, key + ("bucket",), "sizes must be positive")
        _need(
            e.bucket.context is None or e.bucket.context in b.context_sizes,
            key + ("bucket", "context"),
            f"{e.bucket.context} is not one of the context buckets {b.context_sizes}",
        )
        _check_table(e, kv, b, key)
        for n, inside in enumerate(e.collectives or ()):
            _need(
                partitions(inside.groups, t.world_size) and len({len(g) for g in inside.groups}) == 1,
                key + ("collectives", n, "groups"),
                f"replica groups {[list(g) for g in inside.groups]} do not partition the {t.world_size} ranks "
                "in equal groups",
            )
        for out, groups in (e.reduced or {}).items():
            _need(out in e.outputs, key + ("reduced", out), f"not an output of the executable ({', '.join(e.outputs)})")
            _need(
                partitions(groups, t.world_size),
                key + ("reduced", out),
                f"replica groups {[list(g) for g in groups]} do not partition the {t.world_size} ranks",
            )
        for j, s in enumerate(e.inputs):
            _need(s.role in ROLES, key + ("inputs", j, "role"), f"unknown role {s.role!r}")
            _need(s.dtype in DTYPE_NAMES, key + ("inputs", j, "dtype"), f"unknown dtype {s.dtype!r}")
        returned = len(e.state_outputs or ()) + len(e.outputs)
        _need(
            e.output_specs is not None and len(e.output_specs) == returned,
            key + ("output_specs",),
            f"expected the signature of its {returned} outputs, got "
            + ("none" if e.output_specs is None else str(len(e.output_specs))),
        )
        if e.aliases:
            for o, src in e.aliases.items():
                _need(0 <= src < len(e.inputs), key + ("aliases", o), f"input {src} out of range")
    kinds = {e.kind for e in m.regions}
    drafts = m.draft_kinds
    # each method a step runs of a kind (decode, or the divided attention's stages; the head's project is
    # the draft's): one executable per bucket (batch sizes may be gathered rows), per context bucket if read
    for kind, method in sorted({(e.kind, e.method) for e in m.regions if e.kind not in drafts} - {DRAFT_PROJECT}):
        mine = [e for e in m.regions if (e.kind, e.method) == (kind, method)]
        contexts = [None] if mine[0].bucket.context is None else b.context_sizes
        what = f"kind {kind!r}" + ("" if method == DECODE else f" ({method})")
        for c in contexts:
            at = [e for e in mine if e.bucket.context == c]
            _need(
                len(at) == len(b.shapes) and {e.bucket.tokens for e in at} == set(b.token_sizes),
                ("regions",),
                f"{what} has executables for {sorted((e.bucket.batch, e.bucket.tokens) for e in at)}"
                + ("" if c is None else f" at context {c}")
                + f", not one for each of the {len(b.shapes)} buckets",
            )
        _need(
            len(mine) == len(b.shapes) * len(contexts),
            ("regions",),
            f"{what} has executables both with and without a context bucket",
        )
    # weights: one list per rank of the world, inside the bundle
    ranks = [layout.rank_key(r) for r in range(t.world_size)]
    _need(
        sorted(m.weights) == sorted(ranks),
        ("weights",),
        f"expected weights for {', '.join(ranks)}, got {', '.join(m.weights) or 'none'}",
    )
    for r, stacks in m.weights.items():
        for i, w in enumerate(stacks):
            for which, path in (("path", w.path), ("shared", w.shared)):
                _need(
                    path is None or is_inside(path), ("weights", r, i, which), f"path {path!r} is not inside the bundle"
                )
            for name, spec in w.tensors.items():
                _need(
                    (w.path if spec.file == "rank" else w.shared) is not None,
                    ("weights", r, i, "tensors", name),
                    f"held in the {spec.file} file, which the entry does not name",
                )
    for name, h in m.host.items():
        _need(is_inside(h.path), ("host", name, "path"), f"path {h.path!r} is not inside the bundle")
    _need(
        ("embed" in m.host) != (m.embed is not None),
        ("host",),
        "lacks the token embedding (embed)"
        if m.embed is None
        else "holds the token embedding (embed) beside the embedding region (embed): one of them, not both",
    )
    _need(
        "engram" in m.host or not any(l.engram for l in m.layers),
        ("host",),
        "lacks the engram tables (engram) its engram layers read",
    )
    if m.model.tokenizer == "tokenizers":
        _need(
            TOKENIZER_FILE in m.host,
            ("host",),
            f"lacks {TOKENIZER_FILE}, which the tokenizer ({m.model.tokenizer!r}) reads",
        )
    engram = any(l.engram for l in m.layers)
    _need(
        ("engram_token_map" in m.host) == (engram and m.model.tokenizer == "tokenizers"),
        ("host",),
        "an engram_token_map goes with engram layers and a 'tokenizers' tokenizer, and only there",
    )
    # layers: every binding names an executable kind and a row of its stacks on every rank
    rows = {r: {w.kind: len(w.layers) for w in stacks} for r, stacks in m.weights.items()}
    for i, l in enumerate(m.layers):
        _need(l.layer == i, ("layers", i, "layer"), f"expected layer {i}, got {l.layer}")
        if l.fused is not None:
            _need(l.fused in kinds, ("layers", i, "fused"), f"no executable of kind {l.fused!r}")
        for slot, binding in l.regions.items():  # a fused layer's slots: weight rows, no executables
            _bound(binding, ("layers", i, "regions", slot), kinds if l.fused is None else None, rows)
        for state, ref in l.state.items():
            key = ("layers", i, "state", state)
            if not (len(ref) == 2 and isinstance(ref[0], str) and isinstance(ref[1], int)):
                raise Problem(key, f"expected [pool name, row], got {list(ref)}")
            held = kv.pools.get(ref[0])
            if held is None:
                raise Problem(key, f"unknown pool {ref[0]!r}")
            _need(0 <= ref[1] < len(held.layers), key, f"row {ref[1]} of pool {ref[0]!r} ({len(held.layers)} rows)")
    _bound(m.head, ("head",), kinds, rows)
    if m.embed is not None:
        _bound(m.embed, ("embed",), kinds, rows)
    if m.draft is not None:
        _check_draft(m, kinds, rows)


DRAFT_PROJECT = ("head", PROJECT)  # the draft's logits: the target head's projection


def _check_draft(m: Manifest, kinds: set, rows: dict) -> None:
    """Every draft stage's binding names a draft executable kind and a row of its stacks; each method of
    each draft kind has executables for every batch bucket (its MoE for the gathered rows of every token
    group under EP dispatch), the head's projection one per batch bucket at the draft's block; the
    features pool holds one row per target layer it reads."""
    d, batches = m.draft, m.buckets.batch_sizes
    assert d is not None, "check() calls this only for a manifest with a draft"
    _need(d.block >= 1 and d.window >= 1, ("draft",), f"block {d.block} and window {d.window} must be positive")
    gathered = m.topology.groups if m.topology.dispatch else 1
    for i, stage in enumerate(d.stages):
        for slot, b in stage.items():
            _bound(b, ("draft", "stages", i, slot), kinds, rows)
            want = {n * (gathered if slot == "moe" else 1) for n in batches}
            methods = {e.method for e in m.regions if e.kind == b.kind}
            _need(bool(methods), ("draft", "stages", i, slot), f"draft kind {b.kind!r} has no executables")
            for method in sorted(methods):
                got = {e.bucket.batch for e in m.regions if (e.kind, e.method) == (b.kind, method)}
                _need(
                    got == want,
                    ("regions",),
                    f"draft kind {b.kind!r} ({method}) has executables for batches {sorted(got)}, "
                    f"not for each of {sorted(want)}",
                )
    kind, method = DRAFT_PROJECT
    got = {e.bucket.batch for e in m.regions if (e.kind, e.method, e.bucket.tokens) == (kind, method, d.block)}
    _need(
        got == set(batches),
        ("regions",),
        f"the head's {method} has executables at the draft's block {d.block} for batches {sorted(got)}, "
        f"not for each of {batches}",
    )
    pool = m.kv.pools.get(d.features)
    _need(
        pool is not None and pool.layers == d.target_layers,
        ("draft", "features"),
        f"pool {d.features!r} must exist with one row per target layer {list(d.target_layers)}",
    )


def _check_table(e: Executable, kv: KV, b: Buckets, key: tuple) -> None:
    """An executable's block table (if it takes one) is as wide as its context bucket's; one without a
    context bucket serves every step, so the bundle must have a single context bucket."""
    for j, s in enumerate(e.inputs):
        if s.name == "block_table" and s.role == "step":
            _need(
                e.bucket.context is not None or len(b.context_sizes) == 1,
                key + ("bucket",),
                f"takes a block table but has no context bucket (the bundle has {b.context_sizes})",
            )
            want = kv.blocks_for(e.bucket.context or b.max_context)
            _need(
                len(s.shape) == 2 and s.shape[1] == want,
                key + ("inputs", j, "shape"),
                f"block table {list(s.shape)}: expected {want} blocks for context "
                f"{e.bucket.context or b.max_context} at block_size {kv.block_size}",
            )


def _bound(b: Binding, key: tuple, kinds: set | None, rows: dict) -> None:
    """A binding's kind has executables (unless `kinds` is None) and its row is in every rank's stacks."""
    if kinds is not None:
        _need(b.kind in kinds, key + ("kind",), f"no executable of kind {b.kind!r}")
    for r, by_kind in rows.items():
        _need(b.kind in by_kind, key + ("kind",), f"{r} has no weights of kind {b.kind!r}")
        _need(
            0 <= b.index < by_kind[b.kind],
            key + ("index",),
            f"row {b.index} of {r}'s {b.kind} stacks ({by_kind[b.kind]} rows)",
        )


def check_files(bundle: Path, m: Manifest, *, digests: bool = True) -> None:
    """Every listed file inside the bundle, present, with its digest; every referenced file listed."""
    bundle = Path(bundle)
    for rel, digest in m.files.items():
        if not is_inside(rel):
            raise BundleError(f"{bundle}: manifest path {rel!r} is not inside the bundle")
        path = bundle / rel
        if not path.is_file():
            raise BundleError(f"{bundle}: missing file {rel} (listed in the manifest)")
        if digests and sha256_file(path) != digest:
            raise BundleError(f"{bundle}: {rel} does not match its digest (altered or corrupt); recompile")
    unlisted = [r for r in m.referenced() if r not in m.files]
    if unlisted:
        raise BundleError(f"{bundle}: {unlisted[0]} is referenced but not covered by a digest")
