"""Loading a bundle as one rank: `load` builds the frozen `Executor` from an opened `Bundle`.

What `runtime.generate(bundle)` does after `open_bundle` (runtime/bundle.py: the manifest read and
checked, the config parsed) is here, in order: the shapes it runs at (`Sizes`: KV blocks and slots,
buckets, the rings' slack), the pools' memory checked against the host before anything is loaded,
the host tables (memory-mapped: the token embedding where the bundle has no embedding region,
engram's hasher and tables, checked against the config), then the executables (each file's
signature first), the weights bound as views into the layer-major stacks, and the state pools.
Every rank memory-maps the same host files. The bundle's own files are read through
runtime/bundle.py (`tensors`, `stack_tensors`, `executable_file`, `check_executables`).
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from types import MappingProxyType

import torch
from torch import Tensor

from deepinfer.bundles import manifest as mf
from deepinfer.bundles.manifest import blocks_per_rank
from deepinfer.host import physical_memory
from deepinfer.regions.config import TextConfig
from deepinfer.regions.engram_hash import EngramHasher
from deepinfer.regions.step import DTYPES, Embedding, EngramRows, LayerPlan
from deepinfer.runtime.backends import Placement, placement_for
from deepinfer.runtime.bundle import (
    Bundle,
    check_executables,
    executable_file,
    open_bundle,
    stack_tensors,
    tensors,
)
from deepinfer.runtime.executor import LAYER_SLOT, ROWS_LAYER_SLOT, Binding, Executor, HostTables, Sizes


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
        prompt_batch_sizes=tuple(m.buckets.prompt_batch_sizes),
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
        kinds = {layer.fused for layer in m.layers if layer.fused is not None} | {mf.HEAD_ROWS}
        fused = {
            (e.kind, e.method): (tuple(s.name for s in e.inputs if s.role not in ("weight", "rank")), e.outputs)
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
        features=MappingProxyType(_features(m, placement, pools)),
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
    methods = {(e.kind, e.method): e.inputs for e in m.regions}  # a one-module kind's weights by method
    rank_tensor = torch.tensor(rank, dtype=torch.int64)

    def views(b: mf.Binding) -> Binding:
        """A binding's kind and its weight views (and the rank) in the executable's input order."""
        return b.kind, [
            rank_tensor if s.role == "rank" else placement.view(stacks[b.kind][s.name], b.index)
            for s in signatures[b.kind]
            if s.role in ("weight", "rank")
        ]

    def module(kind: str, method: str, binding_of: Callable[[str], mf.Binding]) -> Binding:
        """A one-module executable's weights (`<slot>.<name>`, `binding_of` each slot) and rank."""
        return kind, [
            rank_tensor if s.role == "rank" else _slot_view(placement, stacks, s.name, binding_of)
            for s in methods[(kind, method)]
            if s.role in ("weight", "rank")
        ]

    fused = {layer.layer for layer in m.layers if layer.fused is not None}  # their slots have no executables
    draft = m.draft.stages[0] if m.draft else {}  # a capture twin's `capture` slot: stage 0's binding
    bound = {(layer, slot): views(b) for layer, slot, b in m.bindings() if layer not in fused}
    for layer in m.layers:  # a fused layer's one executable: each slot's weights as `<slot>.<name>`
        if layer.fused is not None:
            own = functools.partial(_layer_binding, layer, draft)
            bound[(layer.layer, LAYER_SLOT)] = module(layer.fused, mf.DECODE, own)
            if (layer.fused, mf.LAYER_ROWS) in methods:  # a divided prompt chunk's (compiler/rows_layers.py)
                bound[(layer.layer, ROWS_LAYER_SLOT)] = module(layer.fused, mf.LAYER_ROWS, own)
    if (mf.HEAD_ROWS, mf.DECODE) in methods:  # a divided chunk's head; its `best` binds the same weights
        named = {
            k: [s.name for s in v if s.role == "weight"] for (kind, k), v in methods.items() if kind == mf.HEAD_ROWS
        }
        if named.get(mf.BEST, named[mf.DECODE]) != named[mf.DECODE]:
            raise mf.BundleError(f"{bundle.path}: {mf.HEAD_ROWS}'s best and decode take different weights")
        bound[(-1, mf.HEAD_ROWS)] = module(mf.HEAD_ROWS, mf.DECODE, lambda slot: m.head)
    draft_bound = {
        (stage, slot): views(b)
        for stage, regions in enumerate(m.draft.stages if m.draft else ())
        for slot, b in regions.items()
        if b.kind in signatures  # the capture runs inside the fused layers: no executable of its own
    }
    if m.draft is not None and mf.DRAFT_MODULE in signatures:  # the draft step as one executable (trn2)
        stages, head = m.draft, m.head
        draft_bound[(0, mf.DRAFT_MODULE)] = module(
            mf.DRAFT_MODULE, mf.DECODE, lambda slot: stages.module_binding(slot, head)
        )
    return bound, draft_bound


def _layer_binding(layer: mf.Layer, draft: dict[str, mf.Binding], slot: str) -> mf.Binding:
    """A fused layer's binding of `slot`: its own, else the draft's first stage's (a capture twin's `capture`)."""
    return layer.regions.get(slot) or draft[slot]


def _slot_view(placement: Placement, stacks: dict, name: str, binding_of: Callable[[str], mf.Binding]):
    """A one-module executable's weight input `<slot>.<name>` (a fused layer's, the draft step's): the
    row of that slot's stack it binds (`binding_of`: a fused layer's slot, else the draft's first
    stage's, a capture twin's `capture`; the draft step's, `Draft.module_binding`)."""
    slot, weight = name.split(".", 1)
    binding = binding_of(slot)
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


def _features(m: mf.Manifest, placement: Placement, pools: dict) -> dict[int, Tensor]:
    """A bundle with a draft: target layer -> its features ring, its row of the features pool."""
    if m.draft is None:
        return {}
    pool = pools[m.draft.features]
    return {layer: placement.view(pool, i) for i, layer in enumerate(m.draft.target_layers)}


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
