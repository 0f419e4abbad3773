"""The ranges and cross-references of a manifest whose types `schema.build` has checked.

`check` runs one check per section of the manifest, in this order (the first problem found is the
one reported): the topology, the kv cache, the buckets, the pools, the executables (each on its
own, then every kind's coverage of the buckets), the weights, the host files, the layers, the
model's ends (head and embedding), the draft. Each raises `schema.Problem` with the key path of
what is wrong; `manifest_io.parse` turns it into a `BundleError` naming the file.
"""

from __future__ import annotations

from deepinfer.bundles import layout
from deepinfer.bundles.layout import TOKENIZER_FILE, is_inside
from deepinfer.bundles.manifest import (
    CAPTURE_SLOT,
    DECODE,
    DRAFT_MODULE,
    DTYPE_NAMES,
    ENGRAM_ROWS_MIX,
    HEAD_ROWS,
    KV,
    LAYER_ROWS,
    MOE_ROWS,
    PROJECT,
    ROLES,
    ROWS_PREFIX,
    Binding,
    Buckets,
    Executable,
    Manifest,
    Ranks,
)
from deepinfer.bundles.topology import partitions
from deepinfer.schema import Problem

DRAFT_PROJECT = ("head", PROJECT)  # the draft's logits: the target head's projection

# kind -> rows of its weight stacks, per rank ("rank-R")
Rows = dict[str, dict[str, int]]


def check(m: Manifest) -> None:
    """Ranges and cross-references (types are the dataclasses')."""
    _check_topology(m.topology)
    _check_kv(m.kv, m.topology)
    _check_buckets(m.buckets, m.kv)
    _check_pools(m.kv)
    _check_regions(m)
    _check_coverage(m)
    _check_weights(m)
    _check_host(m)
    kinds = {e.kind for e in m.regions}
    rows = {r: {w.kind: len(w.layers) for w in stacks} for r, stacks in m.weights.items()}
    _check_layers(m, kinds, rows)
    _bound(m.head, ("head",), kinds, rows)
    if m.embed is not None:
        _bound(m.embed, ("embed",), kinds, rows)
    if m.draft is not None:
        _check_draft(m, kinds, rows)


def _need(cond: bool, key: tuple, message: str) -> None:
    if not cond:
        raise Problem(key, message)


def _check_topology(t: Ranks) -> None:
    """The degrees are positive and the sizes recorded beside them follow from them."""
    topo = t.topology
    _need(min(t.tp, t.ep, t.cp) >= 1, ("topology",), f"degrees must be at least 1, got tp={t.tp} ep={t.ep} cp={t.cp}")
    _need(
        (t.world_size, t.groups, t.dispatch) == (topo.world, topo.groups, topo.dispatch),
        ("topology",),
        f"world_size {t.world_size}, groups {t.groups}, dispatch {t.dispatch} do not follow from tp={t.tp} "
        f"ep={t.ep} cp={t.cp} (expected {topo.world}, {topo.groups}, {topo.dispatch})",
    )


def _check_kv(kv: KV, t: Ranks) -> None:
    """Positive sizes; the paged pools divided over the topology's cp ranks, evenly."""
    sizes = {"block_size": kv.block_size, "num_blocks": kv.num_blocks, "slots": kv.slots, "max_blocks": kv.max_blocks}
    for name, size in sizes.items():
        _need(size >= 1, ("kv", name), f"must be at least 1, got {size}")
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


def _check_buckets(b: Buckets, kv: KV) -> None:
    """Shapes and ascending context buckets ending at max_context, which the block table holds."""
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


def _check_pools(kv: KV) -> None:
    for name, pool in kv.pools.items():
        _need(pool.dtype in DTYPE_NAMES, ("kv", "pools", name, "dtype"), f"unknown dtype {pool.dtype!r}")
        _need(all(d >= 0 for d in pool.entry_shape), ("kv", "pools", name, "entry_shape"), "negative size")


def _check_regions(m: Manifest) -> None:
    """Every executable listed once, each checked on its own."""
    seen = set()
    for i, e in enumerate(m.regions):
        key = ("regions", i)
        _need(e.name not in seen, key, f"{e.name} is listed twice")
        seen.add(e.name)
        _check_executable(e, key, m)


def _check_executable(e: Executable, key: tuple, m: Manifest) -> None:
    """Inside the bundle, in a bucket of the bundle's, with a known signature."""
    b = m.buckets
    _need(is_inside(e.artifact), key + ("artifact",), f"path {e.artifact!r} is not inside the bundle")
    _need(e.bucket.batch >= 1 and e.bucket.tokens >= 1, key + ("bucket",), "sizes must be positive")
    _need(
        e.bucket.context is None or e.bucket.context in b.context_sizes,
        key + ("bucket", "context"),
        f"{e.bucket.context} is not one of the context buckets {b.context_sizes}",
    )
    _check_table(e, m.kv, b, key)
    _check_collectives(e, key, m.topology.world_size)
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


def _check_collectives(e: Executable, key: tuple, world_size: int) -> None:
    """The replica groups of its collectives and reduced outputs partition the world."""
    for n, inside in enumerate(e.collectives or ()):
        _need(
            partitions(inside.groups, world_size) and len({len(g) for g in inside.groups}) == 1,
            key + ("collectives", n, "groups"),
            f"replica groups {[list(g) for g in inside.groups]} do not partition the {world_size} ranks "
            "in equal groups",
        )
    for out, groups in (e.reduced or {}).items():
        _need(out in e.outputs, key + ("reduced", out), f"not an output of the executable ({', '.join(e.outputs)})")
        _need(
            partitions(groups, world_size),
            key + ("reduced", out),
            f"replica groups {[list(g) for g in groups]} do not partition the {world_size} ranks",
        )


def _check_coverage(m: Manifest) -> None:
    """Each method a step runs of a kind (decode, or the divided attention's stages; the head's project is
    the draft's): one executable per bucket (batch sizes may be gathered rows), per context bucket if read."""
    b, drafts = m.buckets, m.draft_kinds | {DRAFT_MODULE}  # the draft's: at the batch buckets only
    every = [(s.batch, s.tokens) for s in b.shapes]
    prompts = [(n, t) for n, t in every if t > 1]
    methods = {(e.kind, e.method) for e in m.regions}
    fused_rows = any(method == LAYER_ROWS for _, method in methods)  # trn2's rows modules
    divides = fused_rows or any(kind.startswith(ROWS_PREFIX) for kind, _ in methods)
    rows = m.topology.topology.group_size if divides else 1
    for kind, method in sorted({(e.kind, e.method) for e in m.regions if e.kind not in drafts} - {DRAFT_PROJECT}):
        mine = [e for e in m.regions if (e.kind, e.method) == (kind, method)]
        contexts = [None] if mine[0].bucket.context is None else b.context_sizes
        what = f"kind {kind!r}" + ("" if method == DECODE else f" ({method})")
        # a rows twin (or a fused layer's rows method, the head's module after it) at the prompt buckets
        # only; with one, the MoE's divided methods too (keyed by the chunk)
        divided = kind.startswith(ROWS_PREFIX) or method == LAYER_ROWS or kind == HEAD_ROWS
        divided = divided or (rows > 1 and method in (*MOE_ROWS, ENGRAM_ROWS_MIX))
        shapes = prompts if divided else list(every)
        if fused_rows and kind == "embed":  # at a rank's rows' tokens too
            shapes = sorted(set(every) | {(n, t // rows) for n, t in prompts})
        if method == DECODE and (kind, LAYER_ROWS) in methods:  # a prompt step runs its rows method instead
            shapes = [s for s in every if s not in prompts]
        for c in contexts:
            at = [e for e in mine if e.bucket.context == c]
            _need(
                len(at) == len(shapes) and {e.bucket.tokens for e in at} == {t for _, t in shapes},
                ("regions",),
                f"{what} has executables for {sorted((e.bucket.batch, e.bucket.tokens) for e in at)}"
                + ("" if c is None else f" at context {c}")
                + f", not one for each of the {len(shapes)} buckets",
            )
        _need(
            len(mine) == len(shapes) * len(contexts),
            ("regions",),
            f"{what} has executables both with and without a context bucket",
        )


def _check_weights(m: Manifest) -> None:
    """One list of stacks per rank of the world, inside the bundle, each tensor in a file it names."""
    ranks = [layout.rank_key(r) for r in range(m.topology.world_size)]
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


def _check_host(m: Manifest) -> None:
    """Host files inside the bundle: the embedding (unless a region), engram's tables, the tokenizer's."""
    for name, h in m.host.items():
        _need(is_inside(h.path), ("host", name, "path"), f"path {h.path!r} is not inside the bundle")
    _need(
        ("embed" in m.host) != (m.embed is not None),
        ("host",),
        "lacks the token embedding (embed)"
        if m.embed is None
        else "holds the token embedding (embed) beside the embedding region (embed): one of them, not both",
    )
    engram = any(l.engram for l in m.layers)
    _need("engram" in m.host or not engram, ("host",), "lacks the engram tables (engram) its engram layers read")
    if m.model.tokenizer == "tokenizers":
        _need(
            TOKENIZER_FILE in m.host,
            ("host",),
            f"lacks {TOKENIZER_FILE}, which the tokenizer ({m.model.tokenizer!r}) reads",
        )
    _need(
        ("engram_token_map" in m.host) == (engram and m.model.tokenizer == "tokenizers"),
        ("host",),
        "an engram_token_map goes with engram layers and a 'tokenizers' tokenizer, and only there",
    )


def _check_layers(m: Manifest, kinds: set[str], rows: Rows) -> None:
    """Every binding names an executable kind and a row of its stacks on every rank; every state a
    pool and a row of it."""
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
            held = m.kv.pools.get(ref[0])
            if held is None:
                raise Problem(key, f"unknown pool {ref[0]!r}")
            _need(0 <= ref[1] < len(held.layers), key, f"row {ref[1]} of pool {ref[0]!r} ({len(held.layers)} rows)")
    for kind in m.fallback or {}:  # a layer kind compiled per region (compiler/fallback.py): none runs it fused
        runs = [l.layer for l in m.layers if l.fused == kind]
        _need(not runs, ("fallback", kind), f"compiled per region, but layer {runs[0] if runs else ''} runs it fused")


def _check_draft(m: Manifest, kinds: set[str], rows: Rows) -> None:
    """Every draft stage's binding names a draft executable kind and a row of its stacks; each method of
    each draft kind has executables for every batch bucket (its MoE for the gathered rows of every token
    group under EP dispatch), the head's projection one per batch bucket at the draft's block; the
    features pool holds one row per target layer it reads."""
    d, batches = m.draft, m.buckets.batch_sizes
    assert d is not None, "check() calls this only for a manifest with a draft"
    _need(d.block >= 1 and d.window >= 1, ("draft",), f"block {d.block} and window {d.window} must be positive")
    gathered = m.topology.groups if m.topology.dispatch else 1
    # the capture runs inside the fused layers where every target layer is fused (capture twins)
    inside = all(m.layers[t].fused is not None for t in d.target_layers if 0 <= t < len(m.layers))
    for i, stage in enumerate(d.stages):
        for slot, b in stage.items():
            if slot == CAPTURE_SLOT and inside:
                _bound(b, ("draft", "stages", i, slot), None, rows)
                continue
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


def _bound(b: Binding, key: tuple, kinds: set[str] | None, rows: Rows) -> None:
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
