"""A loaded bundle: executables, weight views, state pools; greedy generation.

Opening validates the manifest once (format version, types, cross-references,
digests, target and toolchain) and parses the model config once; loading
memory-maps the weights, loads each executable once and binds
each layer's weights as views into the layer-major stacks. The host files (token
embedding where the bundle has no embedding region, engram tables) are memory-mapped
too, by every rank from the same file: a step reads the embedding rows of its tokens
(or hands the ids to the embedding region) and the engram rows of its hashes (the
leader broadcasts the hashes, never the rows). Generation runs
prompts as decode-shaped chunks padded to the nearest bucket, then one token
per step, with the same region wiring as the reference (`run_layers`). Each
step also runs the smallest context bucket that holds its longest sequence:
its block tables are that bucket's width, and the kinds built per context
bucket run that bucket's executables.
"""

from __future__ import annotations

import functools
import math
import os
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from deepinfer.bundles import manifest as mf
from deepinfer.bundles.layout import MANIFEST_FILE
from deepinfer.bundles.safetensors import load_mmap
from deepinfer.host import physical_memory
from deepinfer.regions.config import V41Config, parse_config
from deepinfer.regions.engram_hash import EngramHasher
from deepinfer.regions.generate import Allocator, Generation, Row, bucket_at_least, greedy, make_batch, table_width
from deepinfer.regions.step import DTYPES, Batch, Embedding, EngramRows, LayerPlan, plan_layers, run_layers
from deepinfer.runtime.backends import check_compatible, placement_for


@dataclass
class Stats:
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


@dataclass(frozen=True)
class Bundle:
    """A bundle opened for running: its path, its manifest (read and checked once) and its model config
    (parsed once)."""

    path: Path
    manifest: mf.Manifest
    config: V41Config
    identity: tuple[int, int] = (0, 0)  # the directory's (device, inode) when it was opened

    def check_unchanged(self) -> None:
        """Refuse a bundle directory replaced since it was opened (`deepinfer-compile --force` renames
        a new bundle into place): what was loaded would mix two bundles' files."""
        if _identity(self.path) != self.identity:
            raise mf.BundleError(
                f"{self.path}: replaced while it was being loaded (a compile with --force?); "
                "nothing from it is used; run again"
            )


def _identity(path: Path) -> tuple[int, int]:
    try:
        st = os.stat(path)
    except OSError:
        return (-1, -1)
    return (st.st_dev, st.st_ino)


def open_bundle(path: str | Path, *, verify: bool = True, trust=None) -> Bundle:
    """Read and check a bundle's manifest (format version first, types, cross-references), its files
    (present; digests unless `verify` is off) and that this process can run it; parse its config.
    With `trust` (an Ed25519 public key, `bundles.signing.load_public_key`), the manifest must carry a
    signature by that key, checked before anything else is read. Loading checks at its end that the
    directory is still the one opened here."""
    path = Path(path)
    if trust is not None and not verify:
        raise mf.BundleError(
            f"{path}: a trusted key needs the digest check (the signature covers the files "
            "through their digests); drop --no-verify"
        )
    identity = _identity(path)
    manifest = mf.read(path, trust=trust)
    mf.check_files(path, manifest, digests=verify)
    check_compatible(manifest, path)
    bundle = Bundle(path, manifest, parse_config(manifest.model.config, str(path / MANIFEST_FILE)), identity)
    check_layers(bundle)
    bundle.check_unchanged()
    return bundle


METHOD, DRAFT_PROJECT = mf.DECODE, mf.PROJECT  # a step's regions' method; the draft's logits (the head's)
LAYER_FIELDS = ("attn", "ratio", "kv_source", "candidate_source", "uses_candidates")


def check_layers(bundle: Bundle) -> None:
    """The manifest's layer table against the model config it carries: each layer's attention
    role as the config's schedule gives it, and each (kind, index) binding the layer's place among
    the layers of that kind (stacks are layer-major in layer order). A table edited by hand (two
    layers' weights swapped, a layer's kind changed) is refused before anything is loaded."""
    where = bundle.path / MANIFEST_FILE
    m = bundle.manifest
    want = plan_layers(bundle.config.text)
    if [l.layer for l in m.layers] != [p.layer for p in want]:
        raise mf.BundleError(
            f"{where}: layers lists {[l.layer for l in m.layers]}, the model config has {len(want)} layers"
        )
    seen: dict[str, int] = defaultdict(int)
    for i, (l, p) in enumerate(zip(m.layers, want)):
        for name in LAYER_FIELDS:
            if getattr(l, name) != getattr(p, name):
                raise mf.BundleError(
                    f"{where}: layers[{i}].{name} is {getattr(l, name)!r}; the model config "
                    f"gives layer {p.layer} {getattr(p, name)!r}"
                )
        if l.engram != bool(p.engram_rows):
            raise mf.BundleError(
                f"{where}: layers[{i}].engram is {l.engram}; the model config gives layer "
                f"{p.layer} {bool(p.engram_rows)}"
            )
        for slot, b in l.regions.items():
            if b.index != seen[b.kind]:
                raise mf.BundleError(
                    f"{where}: layers[{i}].regions.{slot}.index is {b.index}; layer {p.layer} is "
                    f"number {seen[b.kind]} of kind {b.kind} in layer order"
                )
            seen[b.kind] += 1


class Session:
    def __init__(self, bundle: Bundle, *, num_kv_blocks: int | None = None, rank: int = 0, comm=None):
        m = bundle.manifest
        self.bundle, self.path, self.manifest, self.config = bundle, bundle.path, m, bundle.config
        self.dtype = DTYPES[m.model.dtype]
        self.plans = [
            LayerPlan(
                layer=l.layer,
                attn=l.attn,
                ratio=l.ratio,
                kv_source=l.kv_source,
                candidate_source=l.candidate_source,
                uses_candidates=l.uses_candidates,
                engram_rows=int(l.engram),
            )
            for l in m.layers
        ]
        kv = m.kv
        self.block_size, self.max_blocks = kv.block_size, kv.max_blocks
        self.num_blocks = kv.num_blocks if num_kv_blocks is None else num_kv_blocks
        self.num_slots = kv.slots
        if self.num_blocks < 2:
            raise mf.BundleError(f"num_kv_blocks {self.num_blocks}: needs at least 2 (block 0 is scratch)")
        if kv.static_pools and self.num_blocks != kv.num_blocks:
            raise mf.BundleError(
                f"{self.path}: compiled for exactly {kv.num_blocks} KV blocks (static shapes); "
                f"cannot run with {self.num_blocks} (change [kv] num_blocks and recompile)"
            )
        self.batch_sizes, self.token_sizes = m.buckets.batch_sizes, m.buckets.token_sizes
        self.context_blocks = [kv.blocks_for(c) for c in m.buckets.context_sizes]  # block-table widths
        self.rank = torch.tensor(rank, dtype=torch.int64)
        self.topology = m.topology.topology
        self.comm = comm
        self._check_pool_memory()  # before anything is loaded
        # the host tables (memory-mapped, checked against the config) before the executables, whose
        # load is most of a session's start: a damaged bundle is refused in a moment
        self.embed = None  # the bundle's embedding region (m.embed) runs on the device
        if m.embed is None:
            host = m.host["embed"]
            self.embed = Embedding(load_mmap(self.path / host.path)[host.tensor], self.config.text.hc_mult, self.dtype)
        self.hasher = EngramHasher(self.config.text, self._token_map()) if self.config.text.engram_layer_ids else None
        self.engram = None
        if any(p.engram_rows for p in self.plans):  # the manifest then names the host file
            tables = self.path / m.host["engram"].path
            self.engram = EngramRows.of(self.config.text, load_mmap(tables), str(tables))
        self.placement = placement_for(m, self.path, rank)
        try:
            self._load_executables()
            self._bind_weights(rank)
            self._allocate_pools()
        except BaseException:
            self.placement.close()  # a refused load must not keep the device
            raise
        self.stats = Stats()
        # optional hook around every region call: on_call(layer, slot, kind, inputs, run) -> outputs,
        # where run() calls the executable (deepinfer/diff.py); None costs one test per call
        self.on_call = None
        self.capture = None  # layers whose attention inputs a drafter reads (regions.step.run_layers)

    # -- loading ------------------------------------------------------------------------------

    def _token_map(self):
        """Engram's compressed token map the bundle carries (None: the identity, byte-level tokenizer)."""
        host = self.manifest.host.get("engram_token_map")
        return None if host is None else load_mmap(self.path / host.path)[host.tensor].numpy()

    def _load_executables(self) -> None:
        """(kind, method, batch, tokens, block-table width or None for kinds that do not read one) -> executable."""
        self.executables, self.signatures, self.context_kinds = {}, {}, set()
        kv = self.manifest.kv
        for e in self.manifest.regions:
            b = e.bucket
            blocks = None if b.context is None else kv.blocks_for(b.context)
            self.executables[(e.kind, e.method, b.batch, b.tokens, blocks)] = self.placement.load(
                e, self.path / e.artifact
            )
            self.signatures[e.kind] = e.inputs
            if blocks is not None:
                self.context_kinds.add(e.kind)

    def _bind_weights(self, rank: int) -> None:
        """(layer, slot) -> (kind, weight views in the executable's input order)."""
        try:
            entries = self.manifest.rank_weights(rank)
        except mf.BundleError as e:
            raise mf.BundleError(f"{self.path}: {e}") from None
        stacks = {
            e.kind: {
                name: self.placement.resident(t, f"{e.kind}.{name}") for name, t in stack_tensors(self.path, e).items()
            }
            for e in entries
        }

        def views(b: mf.Binding) -> tuple[str, list]:
            """A binding's kind and its weight views (and the rank) in the executable's input order."""
            return b.kind, [
                self.rank if s.role == "rank" else self.placement.view(stacks[b.kind][s.name], b.index)
                for s in self.signatures[b.kind]
                if s.role in ("weight", "rank")
            ]

        self.bound = {(layer, slot): views(b) for layer, slot, b in self.manifest.bindings()}
        # (stage, slot) -> (kind, weight views) of the draft's regions
        self.draft_bound = {
            (stage, slot): views(b)
            for stage, regions in enumerate(self.manifest.draft.stages if self.manifest.draft else ())
            for slot, b in regions.items()
        }

    def _pool_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {
            name: (
                (len(pool.layers), self.num_blocks if pool.dim == "blocks" else self.num_slots, *pool.entry_shape),
                getattr(torch, pool.dtype),
            )
            for name, pool in self.manifest.kv.pools.items()
        }

    def _check_pool_memory(self) -> None:
        """Pools a host bundle cannot allocate on this host are refused before anything is loaded."""
        need = sum(math.prod(shape) * dtype.itemsize for shape, dtype in self._pool_shapes().values())
        if self.manifest.target.name == "cpu" and need > physical_memory():
            raise mf.BundleError(
                f"{self.path}: the KV/state pools need {need / 2**30:.1f} GiB at num_kv_blocks "
                f"{self.num_blocks}, more than this host's {physical_memory() / 2**30:.1f} GiB of memory"
            )

    def _allocate_pools(self) -> None:
        self.pools, self.states = {}, defaultdict(dict)
        for name, (shape, dtype) in self._pool_shapes().items():
            self.pools[name] = self.placement.resident(torch.zeros(shape, dtype=dtype), f"pool.{name}")
        for l in self.manifest.layers:
            for state, (pool, index) in l.state.items():
                self.states[l.layer][state] = self.placement.view(self.pools[pool], index)

    def close(self) -> None:
        """Release the executables and device memory (a no-op for host bundles)."""
        self.placement.close()

    @functools.cached_property
    def vision(self):
        """The host-resident vision tower (host/vision.safetensors), loaded on first use."""
        tower = load_vision(self.bundle)
        self.bundle.check_unchanged()
        return tower

    # -- running ------------------------------------------------------------------------------

    def _invoke(self, blocks: int):
        """invoke(layer, slot, *inputs) for one step whose block tables are `blocks` wide."""
        executables, bound, stats, on_call, comm = self.executables, self.bound, self.stats, self.on_call, self.comm
        context_kinds = self.context_kinds

        def invoke(layer: int, slot: str, *inputs):
            t0 = time.perf_counter()
            kind, weights = bound[(layer, slot)]
            if comm is not None and slot == "moe" and comm.topo.dispatch:
                inputs = comm.dispatch(*inputs)  # every group's rows
            exe = executables[
                (kind, METHOD, inputs[0].shape[0], inputs[0].shape[1], blocks if kind in context_kinds else None)
            ]
            args = weights + list(inputs)
            t1 = time.perf_counter()
            out = exe(args) if on_call is None else on_call(layer, slot, kind, inputs, lambda: exe(args))
            t2 = time.perf_counter()
            stats.calls[kind] += 1
            stats.seconds[kind] += t2 - t1
            stats.overhead += t1 - t0
            return out if comm is None else comm.after(slot, out, self.dtype)

        return invoke

    def _run(self, batch: Batch) -> torch.Tensor:
        """One step: the embedding (the host lookup, or the embedding region fed the token ids),
        every layer and the head -> logits [B, T, V]."""
        start = time.perf_counter()
        invoke = self._invoke(batch.block_table.shape[1])
        if self.embed is not None:
            h, pre = self.embed(batch.tokens, batch.is_image, batch.image_rows)
        else:  # a text-only step's zero image rows equal the last ones: the device staging skips them
            rows = (
                batch.image_rows
                if batch.image_rows is not None
                else torch.zeros(*batch.tokens.shape, self.config.text.hidden_size, dtype=self.dtype)
            )
            h, pre = invoke(-1, "embed", batch.tokens, batch.is_image, rows)
        logits = run_layers(self.plans, invoke, self.states, h, pre, batch, self.engram, self.capture)
        seconds = time.perf_counter() - start
        self.stats.step_seconds += seconds
        self.stats.steps += 1
        shape = self.stats.by_tokens.setdefault(batch.tokens.shape[1], [0, 0.0])
        shape[0] += 1
        shape[1] += seconds
        self.stats.padded += batch.tokens.numel()
        self.stats.tokens += int((batch.positions >= 0).sum())
        return logits

    # -- the draft ---------------------------------------------------------------------------------

    def dspark(self):
        """The bundle's compiled DSpark draft as a `generate.Drafter` (`regions.drafting.DSparkDrafter`):
        its executables at the batch buckets, its features pool; no checkpoint is read."""
        d = require_draft(self.bundle)
        from deepinfer.regions.drafting import DSparkDrafter  # the collapse op: only where a draft runs

        return DSparkDrafter(
            self.config.text, self._draft_invoke(), self.embed, self.pools[d.features], self.batch_sizes
        )

    def _draft_invoke(self):
        """invoke(stage, slot, *inputs) over the draft's executables (stage -1: the head's `project`)."""
        executables, stats, draft_bound, head = self.executables, self.stats, self.draft_bound, self.bound[(-1, "head")]

        def invoke(stage: int, slot: str, *inputs):
            kind, weights = head if slot == DRAFT_PROJECT else draft_bound[(stage, slot)]
            method = DRAFT_PROJECT if slot == DRAFT_PROJECT else METHOD
            exe = executables[(kind, method, inputs[0].shape[0], inputs[0].shape[1], None)]
            t0 = time.perf_counter()
            out = exe(weights + list(inputs))
            name = kind if method == METHOD else f"{kind}.{method}"
            stats.calls[name] += 1
            stats.seconds[name] += time.perf_counter() - t0
            return out

        return invoke

    # -- what `greedy` drives ----------------------------------------------------------------------

    @property
    def groups(self) -> int:
        return self.topology.groups

    @property
    def max_batch(self) -> int:
        return self.batch_sizes[-1]

    @property
    def chunk(self) -> int:
        return self.token_sizes[-1]

    def allocator(self) -> Allocator:
        return Allocator(self.num_slots, self.num_blocks, self.block_size, self.max_blocks)

    def slot_states(self) -> list[torch.Tensor]:
        """Each layer's views of the pools indexed by sequence slot (window rings, compressor partials)."""
        pools = self.manifest.kv.pools
        return [
            self.states[l.layer][state]
            for l in self.manifest.layers
            for state, (pool, _) in l.state.items()
            if pools[pool].dim == "slots"
        ]

    def run(self, rows_by_group: list[list[Row]], allocs: list[Allocator], gens, images) -> list[torch.Tensor]:
        """Leader: one step of every token group, padded to the nearest bucket -> each group's logits.
        The context bucket is the smallest whose block table holds the longest sequence after the step
        (its highest written position + 1), for every group alike."""
        B = bucket_at_least(self.batch_sizes, max(1, *(len(r) for r in rows_by_group)))
        T = bucket_at_least(self.token_sizes, max(len(ids) for rows in rows_by_group for _, ids, _ in rows))
        blocks = table_width(rows_by_group, self.block_size, self.context_blocks)
        batches = [
            make_batch(
                rows,
                list(range(len(rows))),
                B,
                T,
                blocks=blocks,
                alloc=alloc,
                gens=gens,
                images=images,
                hasher=self.hasher,
                pad=self.config.pad_token_id,
                dtype=self.dtype,
            )
            for rows, alloc in zip(rows_by_group, allocs)
        ]
        if self.comm is None:
            return [self._run(batches[0])]
        self.comm.step(batches)
        return self.comm.gather_logits(self._run(batches[self.comm.group]))

    def serve(self) -> None:
        """Follower ranks: run the steps the leader sends until it sends None (no sampling)."""
        with torch.inference_mode():
            while (batches := self.comm.step()) is not None:
                self.comm.gather_logits(self._run(batches[self.comm.group]))

    @torch.inference_mode()
    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        *,
        eos: int | None = None,
        images: list | None = None,
        drafter=None,
    ) -> list[Generation]:
        """Greedy generation (on the leader with several ranks: followers `serve`); a request
        that cannot get blocks fails alone (its `error` is set). images[i] (spans.ImageEmbeds
        from `spans.with_images`, or None): prompt i's image positions and their embeddings.
        With `drafter` (a `generate.Drafter`), speculative decoding: the same tokens, verified
        `drafter.block` + 1 at a time (the bundle's tokens buckets should hold that width)."""
        eos = self.config.eos_token_id if eos is None else eos
        if drafter is not None and self.comm is not None:
            raise mf.BundleError(
                f"{self.path}: speculative decoding runs on single-rank bundles only (its rollback "
                "restores the leader's per-slot state)"
            )
        try:
            return greedy(self, prompts, max_new_tokens, eos=eos, images=images, drafter=drafter)
        finally:
            if self.comm is not None:
                self.comm.step(None)


def require_draft(bundle: Bundle) -> mf.Draft:
    """The bundle's compiled draft; a BundleError in one line for a bundle compiled without one."""
    if bundle.manifest.draft is None:
        raise mf.BundleError(
            f"{bundle.path}: compiled without a speculative draft, so it cannot run --speculative "
            'dspark; add [speculative] draft = "dspark" to its model.toml and compile again'
        )
    return bundle.manifest.draft


def stack_tensors(bundle: Path, entry: mf.WeightStack) -> dict[str, torch.Tensor]:
    """A kind's stacks on one rank, memory-mapped: its own file's and those every rank shares."""
    out = {}
    for rel in entry.files:
        out.update(load_mmap(Path(bundle) / rel))
    return out


def load_vision(bundle: Bundle):
    """A bundle's host-resident vision tower and aligner (regions.vision, imported only here)."""
    from deepinfer.regions.vision import VisionTower, tensor_getter

    host = bundle.manifest.host.get("vision")
    if host is None:
        raise mf.BundleError(
            f"{bundle.path}: the bundle has no vision tower (its checkpoint's "
            "vision_config.num_hidden_layers is 0); it cannot take images"
        )
    path = bundle.path / host.path
    return VisionTower(
        bundle.config,
        tensor_getter(load_mmap(path), str(path)),
        DTYPES[bundle.manifest.model.dtype],
        str(bundle.path / MANIFEST_FILE),
    )


def load(
    bundle: Bundle | str | Path, *, num_kv_blocks: int | None = None, verify: bool = True, rank: int = 0, comm=None
) -> Session:
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
    session = Session(bundle, num_kv_blocks=num_kv_blocks, rank=rank, comm=comm)
    bundle.check_unchanged()
    return session
