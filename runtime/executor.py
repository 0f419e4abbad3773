"""A loaded bundle: executables, bound weights, state pools, built once and never rebound.

Loading memory-maps the weights, loads each executable once and binds each layer's weights as
views into the layer-major stacks. The host files (the token embedding where the bundle has no
embedding region, engram tables) are memory-mapped too, by every rank from the same file: a step
reads the embedding rows of its tokens (or hands the ids to the embedding region) and the engram
rows of its hashes (the leader broadcasts the hashes, never the rows).

An `Executor` is what a loaded bundle is (frozen: its bindings never change; the pools' contents
are the state a run writes). What a run changes lives beside it: `Stats` (time per region kind and
step), and the `Steps` a scheduler drives (`regions.stepper.Stepper`): each step pads its rows to
the nearest batch and tokens buckets and runs the smallest context bucket that holds its longest
sequence, with the same region wiring as the reference (`run_layers`).
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from deepinfer.bundles import manifest as mf
from deepinfer.bundles.manifest import blocks_per_rank
from deepinfer.host import physical_memory
from deepinfer.regions.config import TextConfig, V41Config
from deepinfer.regions.engram_hash import EngramHasher
from deepinfer.regions.spans import ImageEmbeds
from deepinfer.regions.step import DTYPES, Batch, Embedding, EngramRows, LayerPlan, Merge, run_fused, run_layers
from deepinfer.regions.stepper import Allocator, Capture, Drafter, Row, bucket_at_least, make_batch, table_width
from deepinfer.runtime.backends import Placement, placement_for
from deepinfer.runtime.bundle import (
    Bundle,
    check_executables,
    executable_file,
    open_bundle,
    require_draft,
    stack_tensors,
    tensors,
)
from deepinfer.runtime.options import RunOptions
from deepinfer.runtime.schedule import Completions, decode

if TYPE_CHECKING:  # runtime.ranks loads executors: only the type here
    from deepinfer.regions.drafting import DraftBatch
    from deepinfer.runtime.ranks import Comm

# on_call(layer, slot, kind, inputs, run) -> outputs, where run() calls the executable (deepinfer/diff.py)
OnCall = Callable[[int, str, str, tuple, Callable[[], list]], list]


@dataclass
class Stats:
    """What a run measured on this rank: host time per region kind and per step."""

    calls: dict = field(default_factory=lambda: defaultdict(int))
    seconds: dict = field(default_factory=lambda: defaultdict(float))  # host time in the executable
    overhead: float = 0.0  # runtime time around region calls (argument lists, lookups)
    steps: int = 0
    step_seconds: float = 0.0
    by_tokens: dict = field(default_factory=dict)  # tokens bucket -> [steps, seconds] (picklable: ranks send it)
    tokens: int = 0  # real tokens processed
    padded: int = 0  # token slots computed (incl. padding)

    def table(self) -> list[dict]:
        total = sum(self.seconds.values()) or 1.0
        return [
            {
                "kind": k,
                "calls": self.calls[k],
                "total_ms": self.seconds[k] * 1e3,
                "mean_us": self.seconds[k] / self.calls[k] * 1e6,
                "share": self.seconds[k] / total,
            }
            for k in sorted(self.seconds, key=lambda k: -self.seconds[k])
        ]

    def record_step(self, batch: Batch, seconds: float) -> None:
        self.step_seconds += seconds
        self.steps += 1
        shape = self.by_tokens.setdefault(batch.tokens.shape[1], [0, 0.0])
        shape[0] += 1
        shape[1] += seconds
        self.padded += batch.tokens.numel()
        self.tokens += int((batch.positions >= 0).sum())


@dataclass(frozen=True)
class Sizes:
    """The shapes a loaded bundle runs at: KV blocks and slots, and its buckets."""

    block_size: int
    max_blocks: int  # blocks of one sequence's table at max_context
    num_blocks: int  # the token group's blocks (block 0 is scratch)
    divided: int  # the paged pools divided over this many cp ranks (regions/divided.py)
    num_slots: int  # sequence slots (slot 0 is scratch)
    batch_sizes: tuple[int, ...]
    token_sizes: tuple[int, ...]
    context_blocks: tuple[int, ...]  # the context buckets' block-table widths
    slack: int  # per-slot ring rows beyond the window / ratio: the most drafts a verify step may carry


@dataclass(frozen=True)
class HostTables:
    """What a step reads on the host: the token embedding (None: the bundle's embedding region runs
    on the device), engram's hasher and tables (None without engram layers)."""

    embed: Embedding | None
    hasher: EngramHasher | None
    engram: EngramRows | None


Binding = tuple[str, list]  # (kind, weight views and the rank in the executable's input order)
BOUNDARY_METHODS = (mf.DECODE, "output")  # the methods whose outputs cross a region boundary (Comm.after)
LAYER_SLOT = "layer"  # a fused layer's binding: its one executable (manifest Layer.fused)
STEP, DRAFT_STEP = "step", "draft"  # what the leader sends its followers (`Executor.follow`)


@dataclass(frozen=True, kw_only=True)
class Executor:
    """A bundle loaded as one rank: immutable bindings of executables, weights and pools."""

    bundle: Bundle
    rank: int
    comm: Comm | None  # the ranks' collectives when the bundle has several
    sizes: Sizes
    plans: tuple[LayerPlan, ...]
    host: HostTables
    placement: Placement  # where executables run and tensors live
    executables: Mapping[tuple, Callable]  # (kind, method, batch, tokens, table width or None) -> executable
    context_methods: frozenset[tuple[str, str]]  # (kind, method)s built per context bucket
    # (kind, method)s whose executables sum their streams over the ranks themselves (manifest `reduced`)
    reduced_in_graph: frozenset[tuple[str, str]]
    bound: Mapping[tuple[int, str], Binding]  # (layer, slot) -> binding; the head is (-1, "head")
    # fused layers (trn2): each layer kind's non-weight inputs and its outputs, by name; a fused layer's
    # binding is bound[(layer, LAYER_SLOT)]
    fused: Mapping[str, tuple[tuple[str, ...], tuple[str, ...]]]
    draft_bound: Mapping[tuple[int, str], Binding]  # (stage, slot) -> binding of the draft's regions
    pools: Mapping[str, Tensor]
    states: Mapping[int, Mapping[str, Tensor]]  # layer -> state name -> its view of a pool

    @property
    def path(self) -> Path:
        return self.bundle.path

    @property
    def manifest(self) -> mf.Manifest:
        return self.bundle.manifest

    @property
    def config(self) -> V41Config:
        return self.bundle.config

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.manifest.model.dtype]

    @property
    def merge(self) -> Merge | None:
        """How the divided attention's shares merge: over the cp group's collectives (None at cp = 1)."""
        return self.comm if self.sizes.divided > 1 else None

    def close(self) -> None:
        """Release the executables and device memory (a no-op for host bundles)."""
        self.placement.close()

    def steps(self, stats: Stats, on_call: OnCall | None = None) -> Steps:
        """What a scheduler drives for one run on this executor (the leader's, with several ranks);
        `on_call` wraps every region call (`deepinfer diff`)."""
        return Steps(self, stats, on_call)

    def follow(self, stats: Stats) -> None:
        """Follower ranks: run the steps and draft steps the leader sends until it sends None (no
        sampling): each message is ("step", batches, capture?) or ("draft", batches), a batch per
        token group; this rank runs its group's and joins the logits all-gather."""
        comm = self.comm
        assert comm is not None, "a follower is one of several ranks"
        vocab = self.config.text.vocab_size
        with torch.inference_mode():
            while (message := comm.step()) is not None:
                what, batches, *flags = message
                batch = batches[comm.group]
                if what == DRAFT_STEP:
                    comm.gather_logits(self._draft_step(batch, stats), vocab)
                else:
                    capture = self.capture(stats) if flags[0] else None
                    comm.gather_logits(self.forward(batch, stats, capture=capture), vocab)

    def forward(
        self, batch: Batch, stats: Stats, *, on_call: OnCall | None = None, capture: Capture | None = None
    ) -> Tensor:
        """This rank's step: the embedding (the host lookup, or the embedding region fed the token
        ids), every layer and the head -> logits [B, T, V], this rank's vocabulary slice [B, T, rows]
        with several ranks (`Comm.gather_logits` makes them whole). `capture`: what the step writes
        for the draft (`capture`)."""
        start = time.perf_counter()
        invoke = self._invoke(batch.block_table.shape[1], stats, on_call)
        if self.host.embed is not None:
            h, pre = self.host.embed(batch.tokens, batch.is_image, batch.image_rows)
        else:  # a text-only step's zero image rows equal the last ones: the device staging skips them
            rows = batch.image_rows
            if rows is None:
                rows = torch.zeros(*batch.tokens.shape, self.config.text.hidden_size, dtype=self.dtype)
            h, pre = invoke(-1, "embed", batch.tokens, batch.is_image, rows)
        if self.fused:
            assert capture is None, "a bundle with a draft runs its layers per region"
            invoke_layer = self._invoke_layer(batch.block_table.shape[1], stats, on_call)
            logits = run_fused(self.plans, invoke_layer, invoke, self.states, h, pre, batch, self.host.engram)
        else:
            logits = run_layers(self.plans, invoke, self.states, h, pre, batch, self.host.engram, capture, self.merge)
        stats.record_step(batch, time.perf_counter() - start)
        return logits

    def _invoke(
        self, blocks: int, stats: Stats, on_call: OnCall | None, bound: Mapping[tuple[int, str], Binding] | None = None
    ):
        """invoke(layer, slot, *inputs) for one step whose block tables are `blocks` wide (`bound`:
        the bindings it looks (layer, slot) up in, the target's unless given)."""
        executables, comm, context_methods = self.executables, self.comm, self.context_methods
        bound = self.bound if bound is None else bound
        reduced = self.reduced_in_graph

        def invoke(layer: int, slot: str, *inputs, method: str = mf.DECODE):
            t0 = time.perf_counter()
            kind, weights = bound[(layer, slot)]
            if comm is not None and slot == "moe" and comm.topo.dispatch:
                inputs = comm.dispatch(*inputs)  # every group's rows
            width = blocks if (kind, method) in context_methods else None
            exe = executables[(kind, method, inputs[0].shape[0], inputs[0].shape[1], width)]
            args = weights + list(inputs)
            t1 = time.perf_counter()
            out = exe(args) if on_call is None else on_call(layer, slot, kind, inputs, lambda: exe(args))
            t2 = time.perf_counter()
            name = kind if method == mf.DECODE else f"{kind}.{method}"
            stats.calls[name] += 1
            stats.seconds[name] += t2 - t1
            stats.overhead += t1 - t0
            # a region's streams leave `decode` (or the divided attention's last stage, `output`) as
            # partials to sum over ranks; reduced: summed in the graph
            if comm is None or method not in BOUNDARY_METHODS or (kind, method) in reduced:
                return out
            return comm.after(slot, out, self.dtype)

        return invoke

    def _invoke_layer(self, blocks: int, stats: Stats, on_call: OnCall | None):
        """invoke_layer(layer, values) for one step whose block tables are `blocks` wide: the layer's
        one executable (its collectives inside) on the values its inputs name -> its outputs by name."""
        executables, bound, fused, context_methods = self.executables, self.bound, self.fused, self.context_methods

        def invoke_layer(layer: int, values: Mapping[str, Tensor]) -> dict[str, Tensor]:
            t0 = time.perf_counter()
            kind, weights = bound[(layer, LAYER_SLOT)]
            names, outputs = fused[kind]
            inputs = [values[n] for n in names]
            width = blocks if (kind, mf.DECODE) in context_methods else None
            exe = executables[(kind, mf.DECODE, inputs[0].shape[0], inputs[0].shape[1], width)]
            args = weights + inputs
            t1 = time.perf_counter()
            out = exe(args) if on_call is None else on_call(layer, LAYER_SLOT, kind, tuple(inputs), lambda: exe(args))
            stats.calls[kind] += 1
            stats.seconds[kind] += time.perf_counter() - t1
            stats.overhead += t1 - t0
            return dict(zip(outputs, out))

        return invoke_layer

    def dspark(self, stats: Stats):
        """The bundle's compiled DSpark draft as a `regions.stepper.Drafter` (`regions.drafting.DSparkDrafter`):
        its executables at the batch buckets, its features pool written by the target's steps (`capture`),
        every rank running each draft step (this executor is the leader's); no checkpoint is read."""
        require_draft(self.bundle)
        from deepinfer.regions.drafting import DSparkDrafter  # the collapse op: only where a draft runs

        comm, vocab = self.comm, self.config.text.vocab_size

        def forward(batches: list[DraftBatch]) -> list[Tensor]:
            if comm is None:
                return [self._draft_step(batches[0], stats)]
            comm.step((DRAFT_STEP, batches))
            return comm.gather_logits(self._draft_step(batches[comm.group], stats), vocab)

        return DSparkDrafter(
            self.config.text,
            self._draft_invoke(stats),
            forward,
            self.capture(stats),
            batch_sizes=list(self.sizes.batch_sizes),
            groups=self.manifest.topology.groups,
        )

    def _draft_invoke(self, stats: Stats):
        """invoke(stage, slot, *inputs, method=...) over the draft's executables, with the collectives
        the target's regions of the same slots have (slot `project`: the target head's `project`)."""
        invoke = self._invoke(0, stats, None, {**self.draft_bound, (-1, "head"): self.bound[(-1, "head")]})

        def draft_invoke(stage: int, slot: str, *inputs, method: str = mf.DECODE):
            if slot == mf.PROJECT:
                return invoke(-1, "head", *inputs, method=mf.PROJECT)
            return invoke(stage, slot, *inputs, method=method)

        return draft_invoke

    def _draft_step(self, batch: DraftBatch, stats: Stats) -> Tensor:
        """This rank's share of a draft step for its token group -> its logits (vocabulary rows)."""
        from deepinfer.regions.drafting import draft_forward

        assert self.host.embed is not None, "a bundle with a draft embeds on the host (compiler/spec.py)"
        return draft_forward(self.config.text, self._draft_invoke(stats), self.host.embed, self._rings(), batch)

    def _rings(self) -> list[Tensor]:
        """The features pool's ring of each of the draft's target layers [slots, R, D]."""
        d = require_draft(self.bundle)
        pool = self.pools[d.features]
        return [self.placement.view(pool, i) for i in range(len(d.target_layers))]

    def capture(self, stats: Stats) -> Capture:
        """What a step runs for the draft (`regions.stepper.Capture`): the compiled capture, writing
        each target layer's features ring on this rank."""
        d = require_draft(self.bundle)
        return CompiledCapture(tuple(d.target_layers), self._draft_invoke(stats), tuple(self._rings()))


@dataclass(frozen=True)
class CompiledCapture:
    """`regions.stepper.Capture` over a bundle's compiled capture: writes a target layer's features
    ring on this rank."""

    layers: tuple[int, ...]
    invoke: Callable
    rings: tuple[Tensor, ...]

    def __call__(self, layer: int, h: Tensor, pre: Tensor, positions: Tensor, slots: Tensor) -> None:
        self.invoke(0, "capture", h, pre, positions, slots, self.rings[self.layers.index(layer)])


@dataclass(frozen=True)
class Steps:
    """A loaded bundle as the scheduler drives it (`regions.stepper.Stepper`): the leader's side of
    every step, timed into `stats`; with several ranks it sends each step to the followers."""

    executor: Executor
    stats: Stats
    on_call: OnCall | None = None

    @property
    def groups(self) -> int:
        return self.executor.manifest.topology.groups

    @property
    def max_batch(self) -> int:
        return self.executor.sizes.batch_sizes[-1]

    @property
    def chunk(self) -> int:
        return self.executor.sizes.token_sizes[-1]

    def allocator(self) -> Allocator:
        s = self.executor.sizes  # a divided pool: one shard per cp rank, each of its own blocks
        return Allocator(s.num_slots, blocks_per_rank(s.num_blocks, s.divided), s.block_size, s.max_blocks, s.divided)

    def save_slot(self, group: int, slot: int) -> dict[str, Tensor]:
        """A copy of `slot`'s rows of every per-slot pool (one rank's: the followers' pools are theirs)."""
        x = self.executor
        assert x.comm is None, "a slot's state is saved on one rank only"
        return {name: x.pools[name][:, slot].clone() for name, p in x.manifest.kv.pools.items() if p.dim == "slots"}

    def load_slot(self, group: int, slot: int, state: dict[str, Tensor]) -> None:
        x = self.executor
        assert x.comm is None, "a slot's state is loaded on one rank only"
        for name, rows in state.items():
            x.pools[name][:, slot].copy_(rows)

    @property
    def slack(self) -> int:
        return self.executor.sizes.slack

    def run(
        self,
        rows_by_group: list[list[Row]],
        allocs: list[Allocator],
        histories: Mapping[int, Sequence[int]],
        images: Mapping[int, ImageEmbeds | None],
        capture: Capture | None = None,
    ) -> list[Tensor]:
        """One step of every token group, padded to the nearest bucket -> each group's logits. The
        context bucket is the smallest whose block table holds the longest sequence after the step
        (its highest written position + 1), for every group alike. With `capture` (the bundle's
        drafter's) every rank runs its own compiled capture."""
        x, s = self.executor, self.executor.sizes
        B = bucket_at_least(list(s.batch_sizes), max(1, *(len(r) for r in rows_by_group)))
        T = bucket_at_least(list(s.token_sizes), max(len(ids) for rows in rows_by_group for _, ids, _ in rows))
        blocks = table_width(rows_by_group, s.block_size, list(s.context_blocks))
        batches = [
            make_batch(
                rows,
                list(range(len(rows))),
                B,
                T,
                blocks=blocks,
                alloc=alloc,
                histories=histories,
                images=images,
                hasher=x.host.hasher,
                pad=x.config.pad_token_id,
                dtype=x.dtype,
            )
            for rows, alloc in zip(rows_by_group, allocs)
        ]
        comm = x.comm
        if comm is None:
            return [x.forward(batches[0], self.stats, on_call=self.on_call, capture=capture)]
        comm.step((STEP, batches, capture is not None))
        logits = x.forward(batches[comm.group], self.stats, on_call=self.on_call, capture=capture)  # [B, T, rows]
        return comm.gather_logits(logits, x.config.text.vocab_size)


# --- loading -------------------------------------------------------------------------------------


def load(
    bundle: Bundle | str | Path, *, num_kv_blocks: int | None = None, verify: bool = True, rank: int = 0, comm=None
) -> Executor:
    """Open a bundle (see `open_bundle`; an opened `Bundle` is not read again), then load it as `rank`
    (with `comm`, a runtime.ranks.Comm, when the bundle has several ranks)."""
    if not isinstance(bundle, Bundle):
        bundle = open_bundle(bundle, verify=verify)
    world = bundle.manifest.topology.world_size
    if not 0 <= rank < world:
        raise mf.BundleError(f"{bundle.path}: rank {rank} is outside the bundle's world size {world}")
    if world > 1 and comm is None:
        raise mf.BundleError(
            f"{bundle.path}: a {world}-rank bundle; run it with deepinfer-run (which starts "
            "the ranks) or under torchrun"
        )
    executor = _load(bundle, rank, comm, num_kv_blocks)
    bundle.check_unchanged()
    return executor


def _sizes(bundle: Bundle, num_kv_blocks: int | None) -> Sizes:
    m, kv = bundle.manifest, bundle.manifest.kv
    num_blocks = kv.num_blocks if num_kv_blocks is None else num_kv_blocks
    if num_blocks < 2:
        raise mf.BundleError(f"num_kv_blocks {num_blocks}: needs at least 2 (block 0 is scratch)")
    if (num_blocks - 1) % kv.divided:
        raise mf.BundleError(
            f"num_kv_blocks {num_blocks}: its {num_blocks - 1} usable blocks do not divide over the bundle's "
            f"cp = {kv.divided} ranks (each holds its share of every sequence's blocks)"
        )
    if kv.static_pools and num_blocks != kv.num_blocks:
        raise mf.BundleError(
            f"{bundle.path}: compiled for exactly {kv.num_blocks} KV blocks (static shapes); "
            f"cannot run with {num_blocks} (change [kv] num_blocks and recompile)"
        )
    return Sizes(
        block_size=kv.block_size,
        max_blocks=kv.max_blocks,
        num_blocks=num_blocks,
        divided=kv.divided,
        num_slots=kv.slots,
        batch_sizes=tuple(m.buckets.batch_sizes),
        token_sizes=tuple(m.buckets.token_sizes),
        context_blocks=tuple(kv.blocks_for(c) for c in m.buckets.context_sizes),
        slack=ring_slack(m, bundle.config.text),
    )


RINGS = ("win", "part_kv", "part_gate")  # the per-slot rings (regions/state.py): a window or ratio, and slack


def ring_slack(m: mf.Manifest, c: TextConfig) -> int:
    """The rows the bundle's per-slot rings hold beyond their window or ratio, read from its pools'
    entry shapes (regions/state.py `layer_state`): a draft block with [speculative] draft, else 0
    (and 0 for every bundle compiled before the rings had slack)."""
    ratio = {entry.layer: entry.ratio for entry in m.layers}
    return min(
        (
            pool.entry_shape[0] - (c.sliding_window if pool.state == "win" else ratio[pool.layers[0]])
            for pool in m.kv.pools.values()
            if pool.state in RINGS
        ),
        default=0,
    )


def _load(bundle: Bundle, rank: int, comm, num_kv_blocks: int | None) -> Executor:
    m = bundle.manifest
    sizes = _sizes(bundle, num_kv_blocks)
    pool_shapes = _pool_shapes(m, sizes)
    _check_pool_memory(bundle, pool_shapes, sizes)  # before anything is loaded
    plans = tuple(
        LayerPlan(
            layer=entry.layer,
            attn=entry.attn,
            ratio=entry.ratio,
            kv_source=entry.kv_source,
            candidate_source=entry.candidate_source,
            uses_candidates=entry.uses_candidates,
            engram_rows=int(entry.engram),
        )
        for entry in m.layers
    )
    # the host tables (memory-mapped, checked against the config) before the executables, whose
    # load is most of a session's start: a damaged bundle is refused in a moment
    host = _host_tables(bundle, plans)
    placement = placement_for(m, bundle.path, rank)
    try:
        executables, context_methods = _load_executables(bundle, placement)
        bound, draft_bound = _bind_weights(bundle, placement, rank)
        kinds = {layer.fused for layer in m.layers if layer.fused is not None}
        fused = {
            e.kind: (tuple(s.name for s in e.inputs if s.role not in ("weight", "rank")), e.outputs)
            for e in m.regions
            if e.kind in kinds
        }
        pools, states = _allocate_pools(m, placement, pool_shapes)
    except BaseException:
        placement.close()  # a refused load must not keep the device
        raise
    return Executor(  # read-only views: bindings are made here once
        bundle=bundle,
        rank=rank,
        comm=comm,
        sizes=sizes,
        plans=plans,
        host=host,
        placement=placement,
        executables=MappingProxyType(executables),
        context_methods=context_methods,
        reduced_in_graph=frozenset((e.kind, e.method) for e in m.regions if e.reduced),
        bound=MappingProxyType(bound),
        fused=MappingProxyType(fused),
        draft_bound=MappingProxyType(draft_bound),
        pools=MappingProxyType(pools),
        states=MappingProxyType({layer: MappingProxyType(views) for layer, views in states.items()}),
    )


def _host_tables(bundle: Bundle, plans: tuple[LayerPlan, ...]) -> HostTables:
    m, text = bundle.manifest, bundle.config.text
    embed = None  # the bundle's embedding region (m.embed) runs on the device
    if m.embed is None:
        entry = m.host["embed"]
        embed = Embedding(tensors(bundle, entry.path)[entry.tensor], text.hc_mult, DTYPES[m.model.dtype])
    hasher = None
    if text.engram_layer_ids:  # the compressed token map the bundle carries (none: the identity, byte-level)
        mapped = m.host.get("engram_token_map")
        token_map = None if mapped is None else tensors(bundle, mapped.path)[mapped.tensor].numpy()
        hasher = EngramHasher(text, token_map)
    engram = None
    if any(p.engram_rows for p in plans):  # the manifest then names the host file
        tables = m.host["engram"].path
        engram = EngramRows.of(text, tensors(bundle, tables), str(bundle.path / tables))
    return HostTables(embed, hasher, engram)


def _load_executables(bundle: Bundle, placement: Placement) -> tuple[dict, frozenset[tuple[str, str]]]:
    """(kind, method, batch, tokens, block-table width or None for kinds that do not read one) ->
    executable; and the (kind, method)s built per context bucket."""
    check_executables(bundle)  # every file's signature, before any program is loaded
    executables, context_methods = {}, set()
    kv = bundle.manifest.kv
    for e in bundle.manifest.regions:
        b = e.bucket
        blocks = None if b.context is None else kv.blocks_for(b.context)
        with executable_file(bundle, e.artifact) as path:
            executables[(e.kind, e.method, b.batch, b.tokens, blocks)] = placement.load(e, path)
        if blocks is not None:
            context_methods.add((e.kind, e.method))
    return executables, frozenset(context_methods)


def _bind_weights(bundle: Bundle, placement: Placement, rank: int) -> tuple[dict, dict]:
    """(layer, slot) -> (kind, weight views in the executable's input order); the same for the
    draft's (stage, slot)."""
    m = bundle.manifest
    try:
        entries = m.rank_weights(rank)
    except mf.BundleError as e:
        raise mf.BundleError(f"{bundle.path}: {e}") from None
    stacks = {
        e.kind: {name: placement.resident(t, f"{e.kind}.{name}") for name, t in stack_tensors(bundle, e).items()}
        for e in entries
    }
    signatures = {e.kind: e.inputs for e in m.regions}
    rank_tensor = torch.tensor(rank, dtype=torch.int64)

    def views(b: mf.Binding) -> Binding:
        """A binding's kind and its weight views (and the rank) in the executable's input order."""
        return b.kind, [
            rank_tensor if s.role == "rank" else placement.view(stacks[b.kind][s.name], b.index)
            for s in signatures[b.kind]
            if s.role in ("weight", "rank")
        ]

    fused = {layer.layer for layer in m.layers if layer.fused is not None}  # their slots have no executables
    bound = {(layer, slot): views(b) for layer, slot, b in m.bindings() if layer not in fused}
    for layer in m.layers:  # a fused layer's one executable: each slot's weights as `<slot>.<name>`
        if layer.fused is not None:
            bound[(layer.layer, LAYER_SLOT)] = (
                layer.fused,
                [
                    rank_tensor if s.role == "rank" else _slot_view(placement, stacks, layer, s.name)
                    for s in signatures[layer.fused]
                    if s.role in ("weight", "rank")
                ],
            )
    draft_bound = {
        (stage, slot): views(b)
        for stage, regions in enumerate(m.draft.stages if m.draft else ())
        for slot, b in regions.items()
    }
    return bound, draft_bound


def _slot_view(placement: Placement, stacks: dict, layer: mf.Layer, name: str):
    """A fused layer's weight input `<slot>.<name>`: the row of that slot's stack the layer binds."""
    slot, weight = name.split(".", 1)
    binding = layer.regions[slot]
    return placement.view(stacks[binding.kind][weight], binding.index)


def _pool_shapes(m: mf.Manifest, sizes: Sizes) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Each pool's shape on this rank: a paged pool holds this rank's share of the blocks."""
    blocks = blocks_per_rank(sizes.num_blocks, sizes.divided)
    return {
        name: (
            (len(pool.layers), blocks if pool.dim == "blocks" else sizes.num_slots, *pool.entry_shape),
            getattr(torch, pool.dtype),
        )
        for name, pool in m.kv.pools.items()
    }


def _check_pool_memory(bundle: Bundle, shapes: dict, sizes: Sizes) -> None:
    """Pools a host bundle cannot allocate on this host are refused before anything is loaded."""
    need = sum(math.prod(shape) * dtype.itemsize for shape, dtype in shapes.values())
    if bundle.manifest.target.name == "cpu" and need > physical_memory():
        raise mf.BundleError(
            f"{bundle.path}: the KV/state pools need {need / 2**30:.1f} GiB at num_kv_blocks "
            f"{sizes.num_blocks}, more than this host's {physical_memory() / 2**30:.1f} GiB of memory"
        )


def _allocate_pools(m: mf.Manifest, placement: Placement, shapes: dict) -> tuple[dict, dict]:
    pools = {
        name: placement.resident(torch.zeros(shape, dtype=dtype), f"pool.{name}")
        for name, (shape, dtype) in shapes.items()
    }
    states: dict[int, dict[str, Tensor]] = defaultdict(dict)
    for entry in m.layers:
        for state, (pool, index) in entry.state.items():
            states[entry.layer][state] = placement.view(pools[str(pool)], int(index))  # [pool name, row]
    return pools, states


# --- running -------------------------------------------------------------------------------------


def generate_loaded(
    executor: Executor,
    prompts: Sequence[list[int]],
    options: RunOptions,
    *,
    on_call: OnCall | None = None,
    drafter: Drafter | None = None,
) -> Completions:
    """Batch generation on a loaded executor (the leader's, with several ranks: its followers run
    what it sends until this ends them) -> the completions, with this run's `stats` and speculation
    counts. `on_call` wraps every region call (`deepinfer diff`); `drafter` drafts instead of the
    bundle's own (`options.speculative`): the test doubles of `regions/speculative.py`."""
    stats = Stats()
    try:
        with torch.inference_mode():
            if drafter is None and options.speculative:
                drafter = executor.dspark(stats)
            outs = decode(
                executor.steps(stats, on_call),
                prompts,
                options.max_new_tokens,
                eos=executor.config.eos_token_id,
                images=options.images,
                drafter=drafter,
                keep_logits=options.keep_logits,
            )
    finally:
        if executor.comm is not None:
            executor.comm.step(None)
    outs.stats = stats
    return outs
