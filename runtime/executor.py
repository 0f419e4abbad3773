"""A loaded bundle: executables, bound weights, state pools, built once and never rebound.

An `Executor` is what a loaded bundle is (frozen: its bindings never change; the pools' contents
are the state a run writes); `runtime/loading.py` builds one from an opened bundle (the weights
memory-mapped and bound as views into the layer-major stacks, each executable loaded once). What a
run changes lives beside it: `Stats` (time per region kind and step), and the `Steps` a scheduler
drives (`regions.stepper.Stepper`): each step pads its rows to the nearest batch and tokens buckets
and runs the smallest context bucket that holds its longest sequence, with the same region wiring
as the reference (`run_layers`). A step reads the embedding rows of its tokens on the host (or hands
the ids to the embedding region) and the engram rows of its hashes (the leader broadcasts the
hashes, never the rows). The bundle's compiled draft runs on it through `runtime/draft.py`.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from deepinfer.bundles import manifest as mf
from deepinfer.bundles.manifest import blocks_per_rank
from deepinfer.regions import micro
from deepinfer.regions.config import V41Config
from deepinfer.regions.engram_hash import EngramHasher
from deepinfer.regions.prefix import SlotState
from deepinfer.regions.spans import ImageEmbeds
from deepinfer.regions.step import (
    DTYPES,
    Batch,
    Embedding,
    EngramRows,
    LayerPlan,
    Merge,
    rows_steps,
    run_fused,
    run_layers,
    run_rows_fused,
)
from deepinfer.regions.stepper import Allocator, Capture, Greedy, Row, bucket_at_least, make_batch, table_width
from deepinfer.regions.topology import ENGRAM_KV
from deepinfer.runtime import draft, slot_store
from deepinfer.runtime.backends import Placement
from deepinfer.runtime.bundle import Bundle
from deepinfer.runtime.slot_store import LOAD, SAVE, SlotRef, copy_slot, put_slot
from deepinfer.runtime.stats import SLICED, Stats

if TYPE_CHECKING:  # runtime.ranks loads executors, regions.drafting loads where a draft runs: types only
    from deepinfer.regions.drafting import DSparkDrafter
    from deepinfer.runtime.ranks import Comm

# on_call(layer, slot, kind, inputs, run) -> outputs, where run() calls the executable (deepinfer/diff.py)
OnCall = Callable[[int, str, str, tuple, Callable[[], list]], list]


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
    prompt_batch_sizes: tuple[int, ...]  # the batch buckets of steps of more than one token
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
# the methods whose outputs cross a region boundary (Comm.after); the divided engram's `kv` is summed
# over the token group before its `mix`
BOUNDARY_METHODS = (mf.DECODE, "output", ENGRAM_KV)
LAYER_SLOT = "layer"  # a fused layer's binding: its one executable (manifest Layer.fused)
ROWS_LAYER_SLOT = mf.ROWS_LAYER_SLOT  # its divided prompt chunk's executable (the kind's `rows` method)
STEP = "step"  # what the leader sends its followers for a target step (`Executor.follow`; draft.DRAFT_STEP)


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
    # fused layers (trn2): each (layer kind, method)'s non-weight inputs and its outputs, by name; a fused
    # layer's binding is bound[(layer, LAYER_SLOT)] (a divided prompt chunk's, ROWS_LAYER_SLOT; the head's
    # module after it, (-1, HEAD_ROWS))
    fused: Mapping[tuple[str, str], tuple[tuple[str, ...], tuple[str, ...]]]
    draft_bound: Mapping[tuple[int, str], Binding]  # (stage, slot) -> binding of the draft's regions
    pools: Mapping[str, Tensor]
    states: Mapping[int, Mapping[str, Tensor]]  # layer -> state name -> its view of a pool
    # a bundle with a draft: each target layer's features ring [slots, R, D], its row of the features pool
    features: Mapping[int, Tensor] = field(default_factory=dict)
    # prefix caching over several ranks: this rank's copies of saved slot states by id (runtime/slot_store.py)
    slot_states: dict[int, dict[str, Tensor]] = field(default_factory=dict)

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
        sampling): each message is ("step", batches, capture?, greedy?) or ("draft", batches, logits?), a
        batch per token group (this rank runs its group's and joins the collectives: a step's logits
        all-gather or, greedy, its pairs', a draft step's picks, `draft.choose`), or a prefix cache's slot save or load
        (runtime/slot_store.py)."""
        comm = self.comm
        assert comm is not None, "a follower is one of several ranks"
        vocab = self.config.text.vocab_size
        with torch.inference_mode():
            while (message := comm.step()) is not None:
                if message[0] == slot_store.SLOT:
                    slot_store.apply(self, *message[1:])
                    continue
                what, batches, *flags = message
                batch = batches[comm.group]
                if what == draft.DRAFT_STEP:
                    draft.choose(self, batches, stats, flags[0])
                else:
                    capture, greedy = self.capture(stats) if flags[0] else None, flags[1]
                    if greedy:
                        self.paired_step(batch, stats, capture=capture)
                    else:
                        comm.gather_logits(self.forward(batch, stats, capture=capture), vocab)

    def paired_step(
        self, batch: Batch, stats: Stats, *, on_call: OnCall | None = None, capture: Capture | None = None
    ) -> list[Greedy]:
        """A step on this rank of several where every row is greedy and none needs logits -> each token
        group's choices, only (value, index) pairs crossing ranks (`Comm.best_pairs`): picked by the
        head in its graph where the bundle has its `best` method (trn2: no logits leave the device),
        else on the host from this rank's logits slice (`Comm.argmax_pairs`)."""
        comm = self.comm
        assert comm is not None, "greedy pairs cross ranks"
        if any(key[:2] == (self.bound[(-1, "head")][0], mf.BEST) for key in self.executables):
            pairs = self.forward(batch, stats, on_call=on_call, capture=capture, head=mf.BEST)  # [B, T, 2]
            return comm.best_pairs(pairs[..., 0], pairs[..., 1].long())
        logits = self.forward(batch, stats, on_call=on_call, capture=capture)
        return comm.argmax_pairs(logits, self.config.text.vocab_size)

    def forward(
        self,
        batch: Batch,
        stats: Stats,
        *,
        on_call: OnCall | None = None,
        capture: Capture | None = None,
        head: str = mf.DECODE,
    ) -> Tensor:
        """This rank's step: the embedding (the host lookup, or the embedding region fed the token
        ids), every layer and the head -> logits [B, T, V], this rank's vocabulary slice [B, T, rows]
        with several ranks (`Comm.gather_logits` makes them whole). `capture`: what the step writes
        for the draft (`capture`). `head`: the head's method (`mf.BEST`: its slice's greedy pairs)."""
        start = time.perf_counter()
        if capture is None and self.own_rows(batch) is not None:  # divided by rows (regions/rows.py)
            if self.fused:  # trn2: one rows module a layer (compiler/rows_layers.py)
                logits = self._divided_fused(batch, stats, on_call, head)
            else:
                logits = self._divided(batch, stats, on_call)
            stats.record_step(batch, time.perf_counter() - start)
            return logits
        invoke = self.invoker(batch.block_table.shape[1], stats, on_call, step_tokens=batch.tokens.shape[1])
        if head != mf.DECODE:
            invoke = _head_method(invoke, head)
        if self.host.embed is not None:
            h, pre = self.host.embed(batch.tokens, batch.is_image, batch.image_rows)
        else:  # a text-only step's zero image rows equal the last ones: the device staging skips them
            rows = batch.image_rows
            if rows is None:
                rows = torch.zeros(*batch.tokens.shape, self.config.text.hidden_size, dtype=self.dtype)
            h, pre = invoke(-1, "embed", batch.tokens, batch.is_image, rows)
        if self.fused:  # a target layer's capture twin writes its ring at every step (`features`)
            invoke_layer = self._invoke_layer(batch.block_table.shape[1], stats, on_call)
            # a layer kind neuronx-cc refused to compile fused runs per region (compiler/fallback.py)
            regions = {p.layer for p in self.plans if (p.layer, LAYER_SLOT) not in self.bound}
            logits = run_fused(
                self.plans,
                invoke_layer,
                invoke,
                self.states,
                h,
                pre,
                batch,
                self.host.engram,
                regions,
                self.merge,
                divided_engram=self.manifest.topology.topology.group_size > 1,
                features=self.features,
                capture=capture,
            )
        else:
            logits = run_layers(
                self.plans,
                invoke,
                self.states,
                h,
                pre,
                batch,
                self.host.engram,
                capture,
                self.merge,
                divided_engram=self.manifest.topology.topology.group_size > 1,
            )
        stats.record_step(batch, time.perf_counter() - start)
        return logits

    def head_at(self, B: int, T: int) -> bool:
        """Whether the bundle holds the head at batch B and T tokens."""
        kind = self.bound[(-1, "head")][0]
        return any(key[:4] == (kind, mf.DECODE, B, T) for key in self.executables)

    def own_rows(self, batch: Batch) -> slice | None:
        """This rank's rows of a prompt step divided by rows (a step of several tokens a whole number of
        rows a rank; a bundle with the `rows` twins and the host's embedding, or trn2's fused layers with
        every layer's rows module and the head's), else None."""
        T, group = batch.tokens.shape[1], self.manifest.topology.topology.group_size
        if T == 1 or T % group:
            return None
        if self.fused:
            every = (-1, mf.HEAD_ROWS) in self.bound and all(
                (p.layer, ROWS_LAYER_SLOT) in self.bound for p in self.plans
            )
            return _share(T, group, self.rank) if every else None
        if (0, mf.ROWS_SLOT) not in self.bound or self.host.embed is None:
            return None
        return _share(T, group, self.rank)

    def _divided_fused(self, batch: Batch, stats: Stats, on_call: OnCall | None, head: str) -> Tensor:
        """A prompt step divided by rows on trn2's fused layers (compiler/rows_layers.py): the rank's rows
        embedded, one execution a layer (its kind's rows module, the collectives inside), then the head's
        module (the rows gathered inside) as `head` -> this rank's slice of every row's logits (or pairs)."""
        group, T, blocks = self.manifest.topology.topology.group_size, batch.tokens.shape[1], batch.block_table.shape[1]
        # the rank's rows, in micro order where the modules run the chunk as micro-batches
        passes = next(
            (e.passes or 1 for e in self.manifest.regions if (e.kind, e.bucket.tokens) == (mf.HEAD_ROWS, T)), 1
        )
        own = _share(T, group, self.rank) if passes == 1 else micro.micro_rows(T, group, self.rank, passes)
        invoke = self.invoker(blocks, stats, on_call, step_tokens=T)
        if self.host.embed is not None:
            h, pre = self.host.embed(batch.tokens[:, own], batch.is_image[:, own], _rows_of(batch.image_rows, own))
        else:
            rows = _rows_of(batch.image_rows, own)
            if rows is None:
                rows = torch.zeros(batch.tokens.shape[0], T // group, self.config.text.hidden_size, dtype=self.dtype)
            h, pre = invoke(-1, "embed", batch.tokens[:, own], batch.is_image[:, own], rows)
        invoke_layer = self._invoke_layer(blocks, stats, on_call)
        h, pre = run_rows_fused(self.plans, invoke_layer, self.states, h, pre, batch, self.host.engram, own)
        out = invoke_layer(-1, {"h": h, "pre": pre}, slot=mf.HEAD_ROWS, method=head, chunk=T)
        return next(iter(out.values()))

    def _divided(self, batch: Batch, stats: Stats, on_call: OnCall | None) -> Tensor:
        """A prompt step divided by rows over the token group (regions/rows.py): as two micro-batches of
        half the chunk, one's collectives on the wire while the other computes, where the bundle has the
        half's tokens bucket and it divides over the group (regions/micro.py); else as one."""
        comm, group, T = self.comm, self.manifest.topology.topology.group_size, batch.tokens.shape[1]
        assert comm is not None and self.host.embed is not None
        half = T // 2
        parts = (
            micro.split(batch, 2) if half in self.sizes.token_sizes and half % group == 0 else [(batch, slice(0, T))]
        )
        invoke = self.invoker(batch.block_table.shape[1], stats, on_call, step_tokens=T, passes=len(parts))
        steps = []
        for part, _ in parts:
            own = _share(part.tokens.shape[1], group, self.rank)
            h, pre = self.host.embed(part.tokens[:, own], part.is_image[:, own], _rows_of(part.image_rows, own))
            steps.append(rows_steps(self.plans, invoke, self.states, h, pre, part, self.host.engram, comm, own))
        logits = micro.drive(steps, comm.start if len(steps) > 1 else micro.now)
        return logits[0] if parts[0][0] is batch else micro.join(batch, parts, logits)

    def invoker(
        self,
        blocks: int,
        stats: Stats,
        on_call: OnCall | None,
        bound: Mapping[tuple[int, str], Binding] | None = None,
        step_tokens: int | None = None,
        passes: int = 1,
    ):
        """invoke(layer, slot, *inputs) for one step whose block tables are `blocks` wide (`bound`:
        the bindings it looks (layer, slot) up in, the target's unless given; `step_tokens`: the
        step's tokens a sequence, for `Stats.record_rows`; `passes`: the micro-batches it runs as)."""
        executables, comm, context_methods = self.executables, self.comm, self.context_methods
        bound = self.bound if bound is None else bound
        reduced = self.reduced_in_graph
        topo = self.manifest.topology.topology
        divisors = {"ep": topo.ep, "group": topo.group_size}
        shares = {key: 1 / divisors[group] for key, group in SLICED.items()}

        def invoke(layer: int, slot: str, *inputs, method: str = mf.DECODE, chunk: int | None = None, whole=True):
            """`chunk`: the step's tokens bucket where the first input's rows are a rank's share of it (a
            prompt divided by rows); `whole` false: the outputs as the executable gives them (partials)."""
            t0 = time.perf_counter()
            kind, weights = bound[(layer, slot)]
            if comm is not None and slot == "moe" and comm.topo.dispatch:
                inputs = comm.dispatch(*inputs)  # every group's rows
            width = blocks if (kind, method) in context_methods else None
            exe = executables[(kind, method, inputs[0].shape[0], chunk or inputs[0].shape[1], width)]
            args = weights + list(inputs)
            t1 = time.perf_counter()
            out = exe(args) if on_call is None else on_call(layer, slot, kind, inputs, lambda: exe(args))
            t2 = time.perf_counter()
            name = kind if method == mf.DECODE else f"{kind}.{method}"
            stats.calls[name] += 1
            stats.record_rows(inputs[0].shape, step_tokens, passes, shares.get((slot, method), 1.0))
            stats.seconds[name] += t2 - t1
            stats.overhead += t1 - t0
            # a region's streams leave `decode` (or the divided attention's last stage, `output`) as
            # partials to sum over ranks; reduced: summed in the graph
            if comm is None or not whole or method not in BOUNDARY_METHODS or (kind, method) in reduced:
                return out
            return comm.after(slot, out, self.dtype, kind)

        return invoke

    def _invoke_layer(self, blocks: int, stats: Stats, on_call: OnCall | None):
        """invoke_layer(layer, values) for one step whose block tables are `blocks` wide: the layer's
        one executable (its collectives inside) on the values its inputs name -> its outputs by name."""
        executables, bound, fused, context_methods = self.executables, self.bound, self.fused, self.context_methods

        def invoke_layer(
            layer: int,
            values: Mapping[str, Tensor],
            *,
            slot: str = LAYER_SLOT,
            method: str = mf.DECODE,
            chunk: int | None = None,
        ) -> dict[str, Tensor]:
            """`chunk`: the step's tokens bucket where the streams are a rank's share of it (divided rows)."""
            t0 = time.perf_counter()
            kind, weights = bound[(layer, slot)]
            names, outputs = fused[(kind, method)]
            inputs = [values[n] for n in names]
            width = blocks if (kind, method) in context_methods else None
            exe = executables[(kind, method, inputs[0].shape[0], chunk or inputs[0].shape[1], width)]
            args = weights + inputs
            t1 = time.perf_counter()
            out = exe(args) if on_call is None else on_call(layer, slot, kind, tuple(inputs), lambda: exe(args))
            name = kind if method == mf.DECODE else f"{kind}.{method}"
            stats.calls[name] += 1
            stats.record_rows(inputs[0].shape, chunk)
            stats.seconds[name] += time.perf_counter() - t1
            stats.overhead += t1 - t0
            return dict(zip(outputs, out))

        return invoke_layer

    def dspark(self, stats: Stats) -> DSparkDrafter:
        """The bundle's compiled DSpark draft as a `regions.stepper.Drafter` (see `draft.dspark`)."""
        return draft.dspark(self, stats)

    def capture(self, stats: Stats) -> Capture:
        """What a step runs for the draft: the compiled capture on this rank (see `draft.capture`)."""
        return draft.capture(self, stats)


@dataclass(frozen=True)
class Steps:
    """A loaded bundle as the scheduler drives it (`regions.stepper.Stepper`): the leader's side of
    every step, timed into `stats`; with several ranks it sends each step to the followers."""

    executor: Executor
    stats: Stats
    on_call: OnCall | None = None
    ids: Iterator[int] = field(default_factory=itertools.count)  # slot states saved over several ranks
    forgotten: list[int] = field(default_factory=list)  # their ids evicted since the last slot message

    @property
    def groups(self) -> int:
        return self.executor.manifest.topology.groups

    @property
    def max_batch(self) -> int:
        return self.executor.sizes.batch_sizes[-1]

    @property
    def chunk(self) -> int:
        return self.executor.sizes.token_sizes[-1]

    @property
    def prompt_batch(self) -> int:
        """Sequences of one group in a step with a prompt chunk (`[buckets] prompt_batch`)."""
        return self.executor.sizes.prompt_batch_sizes[-1]

    def allocator(self) -> Allocator:
        s = self.executor.sizes  # a divided pool: one shard per cp rank, each of its own blocks
        return Allocator(s.num_slots, blocks_per_rank(s.num_blocks, s.divided), s.block_size, s.max_blocks, s.divided)

    def save_slot(self, group: int, slot: int) -> SlotState:
        """A copy of `slot`'s per-slot pools: on one rank the copies, over several a `SlotRef` every
        rank of `group` keeps its own copy under (runtime/slot_store.py)."""
        if self.executor.comm is None:
            return copy_slot(self.executor, slot)
        ref = SlotRef(next(self.ids))
        self._slot_message(SAVE, group, slot, ref)
        return ref

    def load_slot(self, group: int, slot: int, state: SlotState) -> None:
        if self.executor.comm is None:
            put_slot(self.executor, slot, state)
        else:
            self._slot_message(LOAD, group, slot, state)

    def forget_slot(self, group: int, state: SlotState) -> None:
        """The prefix cache evicted `state`: over several ranks its id is freed on every rank with the
        next slot message."""
        if isinstance(state, SlotRef):
            self.forgotten.append(state.id)

    def _slot_message(self, op: str, group: int, slot: int, ref: SlotRef) -> None:
        x = self.executor
        assert x.comm is not None
        sent = slot_store.message(op, group, slot, ref, self.forgotten)
        self.forgotten.clear()
        x.comm.step(sent)
        slot_store.apply(x, *sent[1:])

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
        last_only: bool = False,
        greedy: bool = False,
    ) -> list[Tensor | Greedy]:
        """One step of every token group, padded to the nearest bucket -> each group's logits (each
        row's last only with `last_only`, where the head has that bucket: a prompt step then runs the
        head on one row a sequence, not on the chunk's every row); with `greedy` over several ranks,
        each group's `Greedy` choices, only (value, index) pairs all-gathered (`Comm.argmax_pairs`). The
        context bucket is the smallest whose block table holds the longest sequence after the step
        (its highest written position + 1), for every group alike. With `capture` (the bundle's
        drafter's) every rank runs its own compiled capture."""
        x, s = self.executor, self.executor.sizes
        T = bucket_at_least(list(s.token_sizes), max(len(ids) for rows in rows_by_group for _, ids, _ in rows))
        sizes = s.batch_sizes if T == 1 else s.prompt_batch_sizes
        B = bucket_at_least(list(sizes), max(1, *(len(r) for r in rows_by_group)))
        last_only = last_only and T > 1 and x.head_at(B, 1) and x.placement.host_values
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
                last_only=last_only,
            )
            for rows, alloc in zip(rows_by_group, allocs)
        ]
        comm = x.comm
        if comm is None:
            return [x.forward(batches[0], self.stats, on_call=self.on_call, capture=capture)]
        comm.step((STEP, batches, capture is not None, greedy))
        batch = batches[comm.group]
        if greedy:
            return list(x.paired_step(batch, self.stats, on_call=self.on_call, capture=capture))
        logits = x.forward(batch, self.stats, on_call=self.on_call, capture=capture)  # [B, T, rows]
        return list(comm.gather_logits(logits, x.config.text.vocab_size))


def _head_method(invoke, method: str):
    """`invoke` with the head's call made as `method`."""

    def head_as(layer: int, slot: str, *inputs, **options):
        if (layer, slot) == (-1, "head"):
            options["method"] = method
        return invoke(layer, slot, *inputs, **options)

    return head_as


def _share(T: int, group: int, rank: int) -> slice:
    """Rank `rank`'s T / group consecutive rows of T (its place in its token group; regions/rows.rows_of)."""
    n, c = T // group, rank % group
    return slice(c * n, (c + 1) * n)


def _rows_of(t: Tensor | None, own: slice | Tensor) -> Tensor | None:
    return None if t is None else t[:, own]
