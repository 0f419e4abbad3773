"""The bundle manifest: the one contract between compiler and runtime.

`Manifest` and its parts are frozen dataclasses, one per section of `manifest.json`. The compiler
builds one and `write`s it; the runtime `read`s it (`bundles/manifest_io.py`), which checks, once
and in this order:

1. `format_version` (written first, checked first): an unknown version is
   refused before anything else is looked at;
2. every value's type (bundles written by hand or damaged in transit);
3. ranges and cross-references (`bundles/manifest_checks.py`): every layer's region kind has an
   executable for every bucket and a weight stack on every rank holding its row, every
   state binding names a pool and a row of it, every path stays inside the
   bundle and is covered by a digest, the topology's derived sizes agree.

`check_files` then checks the files themselves (present, digests match).
`dump` writes exactly the keys the dataclasses hold, `format_version` first.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Literal

from deepinfer.bundles import layout
from deepinfer.bundles.topology import Topology
from deepinfer.errors import DeepinferError

# 2: shared weight stacks, per-tensor file and format; 3: every executable's output signature
# (output_specs), which loading checks with the inputs' against the executable's own file
FORMAT_VERSION = 3
SUPPORTED_VERSIONS = (3,)
# the compiled methods: every region's step, and the target head's vocabulary projection the draft's logits go
# through (the one other method a bundle holds); compiler, runtime and regions spell them only here
DECODE = "decode"
PROJECT = "project"
# the head's greedy choice on its vocabulary slice in the graph (trn2 with several ranks): each row's
# (value, global index) packed [B, T, 2] float32 instead of the slice's logits (regions/head.py)
BEST = "best"
ROWS_PREFIX = "rows_"  # an attention kind's twin for prompt chunks divided by rows (regions/rows.py)
ROWS_SLOT = "rows"  # the slot a layer's twin is bound at
# trn2's fused path, a prompt chunk divided by rows (compiler/rows_layers.py): a layer kind's method for
# it, and the head's one module (the rank's rows gathered, then the head's decode or best)
LAYER_ROWS = "rows"
HEAD_ROWS = "head_rows"
ROWS_LAYER_SLOT = "layer_rows"  # the runtime's binding of a fused layer's `rows` executable
# its values by name: the rank's rows' positions (the stages after `rows_in` take the chunk's), and a kv
# source's joined context (its outputs, the inputs of the layers that read it)
OWN_POSITIONS = "own_positions"
PAGES = ("ckv_pages", "ikeys_pages")
# the draft's capture (regions/dspark.py): draft stage 0's slot, and the slot of a fused layer's capture
# twin (trn2, compiler/layers.py), which runs it inside the layer
CAPTURE_SLOT = "capture"
# trn2's fused path: a draft step as one executable (compiler/draft_layers.py), its weights by slot
# (`Draft.module_binding`)
DRAFT_MODULE = "draft_step"
# the MoE's methods in a prompt chunk divided by rows (regions/moe.py): the site on a rank's rows, the
# experts on every row, the expand on a rank's rows again
MOE_IN, MOE_EXPERTS, MOE_OUT = "moe_in", "moe_experts", "moe_out"
MOE_ROWS = (MOE_IN, MOE_EXPERTS, MOE_OUT)
# the engram's mix on a rank's rows in such a chunk (regions/engram.py), after its `kv` on every row
ENGRAM_ROWS_MIX = "rows_mix"
ROLES = ("rank", "weight", "activation", "step", "state", "carry")
DTYPE_NAMES = ("float32", "bfloat16", "float16", "int64", "int32", "uint8", "int8", "bool")
ModelDtype = Literal["fp32", "bf16"]  # the dtype a bundle computes in
AttentionKind = Literal["window", "source", "reindex", "reuse"]  # a layer's attention (regions/attention.py)


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
    dtype: ModelDtype
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
    def prompt_batch_sizes(self) -> list[int]:
        """The batch buckets of steps of more than one token (`[buckets] prompt_batch`; every batch
        bucket where the bundle has no such step)."""
        return sorted({s.batch for s in self.shapes if s.tokens > 1}) or self.batch_sizes

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
    # the micro-batches trn2's modules of a prompt chunk divided by rows run it as (compiler/rows_layers.py):
    # a rank's rows go in and come out in their order (regions.micro.micro_rows); None: one
    passes: int | None = None

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
    attn: AttentionKind
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
class Fallback:
    """A layer kind neuronx-cc refused to compile as one module (compiler/fallback.py): its layers
    run per region (their `fused` is None) at every bucket the fused kind had (`buckets`). `bucket`
    is the one refused, with its error `code` (NCC_IBIR297); `log` the refused compile's log,
    relative to `<bundle>.failed-logs/` (the bundle keeps a copy at logs/<log>)."""

    buckets: tuple[Shape, ...]
    bucket: Shape
    code: str
    log: str


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

    def module_binding(self, slot: str, head: Binding) -> Binding:
        """The binding behind weight slot `slot` of the draft step's one executable (trn2's fused path,
        `DRAFT_MODULE`): `context` stage 0's, `attn<s>` and `moe<s>` stage s's, `head` the last
        stage's, `project` the target head's (`head`)."""
        if slot == PROJECT:
            return head
        if slot in ("context", "head"):
            return self.stages[0 if slot == "context" else -1][slot]
        staged = re.fullmatch(r"([a-z]+)(\d+)", slot)
        if staged is None or int(staged[2]) >= len(self.stages) or staged[1] not in self.stages[int(staged[2])]:
            raise BundleError(f"the draft step's executable binds a slot {slot!r} that no draft stage has")
        return self.stages[int(staged[2])][staged[1]]


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
    # layer kind -> what neuronx-cc refused of it, its layers run per region instead; None: nothing
    fallback: dict[str, Fallback] | None = None

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
