"""Device memory a bundle needs per rank, checked against the target's at compile time.

Per rank (every rank holds the same shapes: one executable set serves all):

    weights      the rank's layer-major stacks: every weight spec of a kind's region
                 (already shaped for one rank) x the layers of that kind, exactly the
                 tensor bytes of weights/rank-R/*.safetensors (less their JSON headers)
    pools        every KV/state pool as a rank holds it:
                 layers owning it x (blocks | slots) x entry shape x dtype size, where a
                 paged pool (ckv, ikeys) holds its cp rank's share of the token group's
                 blocks (`pool_entries`: regions/state.blocks_per_rank) and a per-slot
                 pool every slot
    contexts     a prompt chunk divided by rows ([prompt] rows = "divided", regions/rows.py):
                 every rank's pages of a kv source's sequence, gathered by its layer and held
                 until its last reader (`gathered_contexts`): the largest source's at the
                 largest batch and context (the runtime holds one source's at a time)
    executables  the compiled files, all loaded at once (known after compiling)
    scratch      the largest executable's peak of intermediate tensors, from a liveness
                 pass over its lowered FX graph (known after tracing; see `scratch_bytes`);
                 also per region kind (`scratch_by_kind`): the MoE's is bounded by a tile of
                 its expert slices' weights, whatever the rows of a step (kernels/linear.py)

Host-resident tensors (`compiler/weights.py` places them: the token embedding where the
target looks it up on the host, the engram
tables, the vision tower) are host memory: reported beside the total (`host`), never in it.

The limit per rank is `[memory] limit_gib` when given, else the target's device
memory (`Target.device_memory`): trn2 -> 12 GiB of HBM per physical NeuronCore times
LNC; cpu -> none (host memory is the runtime machine's, unknown at compile time). `[memory] reserve_gib` is kept free for the
runtime and collectives.

The pipeline checks three times, each as soon as the numbers exist: weights + pools
right after planning (before any weight is written or graph traced), + scratch after
tracing (before compiling), + executables when the manifest is written (it records the
breakdown per rank under "memory"). Over the limit is a ConfigError with the breakdown.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from deepinfer.bundles.layout import rank_key
from deepinfer.bundles.manifest import PAGES, ROWS_SLOT, Executable, Pool
from deepinfer.compiler.config import config_error
from deepinfer.compiler.plan import RegionPlan
from deepinfer.compiler.pools import plan_pools
from deepinfer.compiler.spec import Log, Spec
from deepinfer.compiler.weights import host_bytes
from deepinfer.regions.prefix import PREFIX_STATE_BUDGET, state_every
from deepinfer.regions.rows import ROWS_ATTEND, ROWS_WRITE
from deepinfer.regions.state import Geometry, blocks_per_rank
from deepinfer.units import human

GiB = 1 << 30
SCRATCH_METHOD = (
    "peak live bytes of intermediate tensors in the largest lowered graph "
    "(views share their base; inputs not counted; no fusion assumed: an upper bound)"
)


def spec_pools(spec: Spec, plan: RegionPlan):
    """The bundle's state pools and each layer's views of them (`compiler.pools.plan_pools`), as `spec`
    lays them out: its block size and dtype, the draft's features pool, the rings' slack."""
    return plan_pools(
        spec.model.text,
        plan.layers,
        block_size=spec.config.kv.block_size,
        dtype=spec.dtype,
        draft=bool(plan.draft),
        slack=spec.geometry.slack,
    )


def _nbytes(shape, dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


class Graph(Protocol):
    """What the budget reads of a traced graph: a manifest entry, or a planned graph's figure."""

    @property
    def name(self) -> str: ...

    @property
    def kind(self) -> str: ...

    @property
    def scratch_bytes(self) -> int | None: ...


def weights_by_kind(plan: RegionPlan, *, whole: bool = False) -> dict[str, int]:
    """Bytes of each kind's stacks on one rank; with `whole`, unsharded (the checkpoint's shapes, as
    one rank would hold them at tp = ep = cp = 1)."""
    return {
        kind: len(kp.layers)
        * sum(_nbytes(s.buffer_shape, s.dtype) for s in (kp.full_specs if whole else kp.region.specs))
        for kind, kp in plan.kinds.items()
    }


def divided(p: Pool, cp: int) -> bool:
    """Whether a rank holds a share of pool `p`: paged pools are divided block-wise over the cp ranks."""
    return p.dim == "blocks" and cp > 1


def pool_entries(p: Pool, geometry: Geometry, cp: int = 1) -> int:
    """Blocks (paged pools: this cp rank's share, its scratch block included) or slots (whole on
    every rank) of pool `p` on one rank."""
    return blocks_per_rank(geometry.blocks, cp) if p.dim == "blocks" else geometry.slots


def pool_bytes(p: Pool, geometry: Geometry, cp: int = 1) -> int:
    """Bytes of pool `p` on one rank of a token group of `cp` ranks ([layers, blocks | slots, *entry])."""
    return _nbytes((len(p.layers), pool_entries(p, geometry, cp), *p.entry_shape), getattr(torch, p.dtype))


def pools_by_name(pools: dict[str, Pool], geometry: Geometry, cp: int = 1) -> dict[str, int]:
    return {name: pool_bytes(p, geometry, cp) for name, p in pools.items()}


def slot_state_bytes(pools: dict[str, Pool]) -> int:
    """One sequence slot's per-slot state on one rank (every `slots` pool's rows: the window rings,
    the compressor's partial groups, a draft's features ring): what prefix caching keeps with a
    cached block where it keeps one (regions/prefix.py)."""
    return sum(
        _nbytes((len(p.layers), *p.entry_shape), getattr(torch, p.dtype)) for p in pools.values() if p.dim == "slots"
    )


def prefix_state(pools: dict[str, Pool], budget: int = PREFIX_STATE_BUDGET) -> dict:
    """`deepinfer plan`'s prefix cache figures: the slot state per rank, the blocks per kept state
    within `budget` bytes a cached block (`regions.prefix.state_every`), the bytes kept per block."""
    state = slot_state_bytes(pools)
    every = state_every(state, budget)
    return {
        "slot_state_bytes": state,
        "budget_bytes": budget,
        "state_every_blocks": every,
        "kept_bytes_per_block": state / every,
    }


def prefix_state_line(pools: dict[str, Pool]) -> str:
    d = prefix_state(pools)
    every = d["state_every_blocks"]
    return (
        f"  prefix cache: a slot's state is {human(d['slot_state_bytes'])} a rank, kept with every "
        f"{every} cached block(s): {human(d['kept_bytes_per_block'])} a block (budget {human(d['budget_bytes'])}; "
        f"a hit prefills at most {every - 1} block(s) again)"
    )


# -- scratch: a liveness pass over a lowered graph -------------------------------------------------


def _concrete(n) -> int:
    from torch.fx.experimental.symbolic_shapes import optimization_hint

    return int(optimization_hint(n, fallback=1)) if isinstance(n, torch.SymInt) else int(n)


def _value_bytes(val) -> int:
    if isinstance(val, torch.Tensor):
        return math.prod(_concrete(d) for d in val.shape) * val.element_size()
    if isinstance(val, (tuple, list)):
        return sum(_value_bytes(v) for v in val)
    return 0


def _aliases(node: torch.fx.Node) -> bool:
    """A view, an in-place write or a getitem: no new memory, the first input's storage."""
    if node.target is operator.getitem:
        return True
    schema = getattr(node.target, "_schema", None)
    return bool(schema and schema.returns and schema.returns[0].alias_info is not None)


def scratch_bytes(ep: torch.export.ExportedProgram) -> int:
    """Peak bytes of intermediate tensors alive at once when the graph runs node by node.

    Each node that allocates holds its output from its definition to the last use of
    it or of any view of it; graph outputs live to the end. Graph inputs (weights,
    pools, activations) are counted elsewhere. A fusing compiler holds less: this
    is an upper bound on what an executable needs beyond its inputs.
    """
    nodes = list(ep.graph.nodes)
    storage: dict[torch.fx.Node, torch.fx.Node | None] = {}  # node -> the node that allocated its memory
    size: dict[torch.fx.Node, int] = {}
    for n in nodes:
        if n.op == "placeholder":
            storage[n] = None
        elif n.op == "call_function":
            base = next((a for a in n.all_input_nodes), None)
            if _aliases(n) and base is not None:
                storage[n] = storage[base]
            else:
                storage[n], size[n] = n, _value_bytes(n.meta.get("val"))
    last = {s: i for i, s in enumerate(nodes) if s in size}
    for i, n in enumerate(nodes):
        for a in n.all_input_nodes:
            s = storage.get(a)
            if s is not None:
                last[s] = len(nodes) if n.op == "output" else max(last[s], i)
    live = peak = 0
    frees: dict[int, int] = {}
    for i, n in enumerate(nodes):
        if n in size:
            live += size[n]
            peak = max(peak, live)
            frees[last[n]] = frees.get(last[n], 0) + size[n]
        live -= frees.pop(i, 0)
    return peak


# -- the breakdown and the checks ----------------------------------------------------------------


@dataclass
class Breakdown:
    weights: dict[str, int]  # kind -> bytes
    pools: dict[str, int]  # pool -> bytes
    limit: int | None
    limit_source: str
    reserve: int = 0
    scratch: int | None = None  # None: not traced yet
    scratch_of: str = ""  # the executable that sets it
    scratch_by_kind: dict[str, int] = field(default_factory=dict)  # kind -> its largest traced scratch
    executables: int | None = None  # None: not compiled yet
    host: dict[str, int] = field(default_factory=dict)  # host file -> bytes (host memory, not in the total)
    contexts: int = 0  # a divided prompt step's gathered pages (`gathered_contexts`)

    @property
    def total(self) -> int:
        device = sum(self.weights.values()) + sum(self.pools.values()) + self.contexts
        return device + (self.scratch or 0) + (self.executables or 0)

    @property
    def usable(self) -> int | None:
        return None if self.limit is None else self.limit - self.reserve

    @property
    def fits(self) -> bool:
        return self.usable is None or self.total <= self.usable

    def lines(self) -> list[str]:
        w, p = sum(self.weights.values()), sum(self.pools.values())
        big = max(self.pools, key=lambda name: self.pools[name]) if self.pools else None
        out = [
            f"  weights      {human(w):>15}  ({len(self.weights)} region kinds)",
            f"  state pools  {human(p):>15}  ({len(self.pools)} pools"
            + (f"; largest {big} {human(self.pools[big])})" if big else ")"),
            *(
                [f"  contexts     {human(self.contexts):>15}  (a divided prompt step's gathered pages)"]
                if self.contexts
                else []
            ),
            f"  executables  {human(self.executables) if self.executables is not None else 'after compiling':>15}",
            f"  scratch      {human(self.scratch) if self.scratch is not None else 'after tracing':>15}"
            + (f"  (largest graph: {self.scratch_of})" if self.scratch_of else ""),
        ]
        if self.scratch_by_kind:
            kinds = sorted(self.scratch_by_kind, key=lambda k: -self.scratch_by_kind[k])
            out.append("    by kind    " + ", ".join(f"{k} {human(self.scratch_by_kind[k])}" for k in kinds))
        limit = (
            "no limit"
            if self.limit is None
            else f"limit {human(self.limit)} ({self.limit_source}) - reserve {human(self.reserve)} = {human(self.usable)}"
        )
        out.append(f"  total        {human(self.total):>15}  per rank; {limit}")
        out.append(
            f"  host         {human(sum(self.host.values())):>15}  (not device memory: "
            + ", ".join(f"{k} {human(v)}" for k, v in self.host.items())
            + ")"
        )
        return out

    def to_dict(self) -> dict:
        return {
            "weights": sum(self.weights.values()),
            "pools": sum(self.pools.values()),
            "executables": self.executables,
            "contexts": self.contexts,
            "scratch": self.scratch,
            "total": self.total,
            "limit": self.limit,
            "limit_source": self.limit_source,
            "reserve": self.reserve,
            "weights_by_kind": self.weights,
            "pools_by_name": self.pools,
            "scratch_of": self.scratch_of,
            "scratch_by_kind": self.scratch_by_kind,
            "scratch_method": SCRATCH_METHOD,
            "host": sum(self.host.values()),
            "host_by_file": self.host,
        }


def gathered_contexts(spec: Spec, plan: RegionPlan) -> int:
    """Bytes of the pages a divided prompt step holds gathered on a rank: a kv source's rows module
    all-gathers every rank's pages of the sequence (its latents and index keys, [d, B, L, *]), which
    its reindex and reuse layers read (`regions.step.run_rows_fused` drops them after the last): the
    largest source's, at the largest tokens bucket and its largest batch bucket (`[buckets]
    prompt_batch`) and the full context; 0 unless divided."""
    if not spec.divided_rows:
        return 0
    tokens = max(spec.config.buckets.tokens)
    batch = max(b for b, t in spec.config.buckets.shapes() if t == tokens)  # [buckets] prompt_batch
    most = 0
    for kp in plan.kinds.values():
        if kp.slot == ROWS_SLOT and ROWS_WRITE in kp.region.methods():
            specs = kp.region.method_inputs(ROWS_ATTEND, batch, tokens, spec.geometry)
            most = max(most, sum(_nbytes(s.shape, s.dtype) for s in specs if s.name in PAGES))
    return most


def breakdown(spec: Spec, plan: RegionPlan, executables: Sequence[Graph] = (), files: Sequence[Path] = ()) -> Breakdown:
    """What is known of a compile's needs per rank so far: weights and pools once planned,
    scratch once traced (`executables`), executables once compiled (their `files`)."""
    mem = spec.config.memory
    limit: int | None
    if mem.limit_gib is not None:
        limit, source = int(mem.limit_gib * GiB), "[memory] limit_gib"
    else:
        limit, source = spec.target.device_memory()
    pools, _ = spec_pools(spec, plan)
    out = Breakdown(
        weights_by_kind(plan),
        pools_by_name(pools, spec.geometry, spec.topology.cp),
        limit,
        source,
        reserve=int(mem.reserve_gib * GiB),
        host=host_bytes(spec.model, device_embedding=spec.device_embedding),
        contexts=gathered_contexts(spec, plan),
    )
    if executables:
        known = [(e, n) for e in executables if (n := e.scratch_bytes) is not None]
        if known:
            worst, most = max(known, key=lambda en: en[1])
            out.scratch, out.scratch_of = most, worst.name
            for e, n in known:
                out.scratch_by_kind[e.kind] = max(out.scratch_by_kind.get(e.kind, 0), n)
        if len(known) < len(executables):  # trace records cached by a deepinfer without the estimate
            out.scratch_of += f"{'; ' if known else ''}{len(executables) - len(known)} graph(s) not estimated"
        if files and not spec.hlo_only and all(p.is_file() for p in files):
            out.executables = sum(p.stat().st_size for p in files)
    return out


def check(
    spec: Spec, plan: RegionPlan, when: str, executables: Sequence[Graph] = (), files: Sequence[Path] = ()
) -> Breakdown:
    """Raise ConfigError with the breakdown when rank memory would overflow; else return it."""
    d = breakdown(spec, plan, executables, files)
    if not d.fits:
        raise config_error(
            spec.config,
            "memory",
            "limit_gib",
            f"the bundle does not fit ({when}): it needs {human(d.total)} per rank, more than "
            f"{human(d.usable)} usable; lower [kv] num_blocks or the batch buckets, shard over more "
            "ranks ([parallel]), or set [memory] limit_gib / reserve_gib\n" + "\n".join(d.lines()),
        )
    return d


def check_planned(spec: Spec, plan: RegionPlan, log: Log) -> None:
    """Pass: weights + pools, before any weight is written or graph traced."""
    d = check(spec, plan, "weights and state pools, as planned")
    log(
        f"memory per rank as planned: {human(d.total)} (weights {human(sum(d.weights.values()))}, pools "
        f"{human(sum(d.pools.values()))}); {'no limit' if d.limit is None else f'usable {human(d.usable)}'}; "
        f"host {human(sum(d.host.values()))}"
    )


def check_traced(spec: Spec, plan: RegionPlan, traced: Sequence[Graph], log: Log) -> None:
    """Pass: + the largest traced graph's scratch (`traced`: the trace pass's entries), before compiling."""
    d = check(spec, plan, "with the traced graphs' scratch", traced)
    if d.scratch is not None:
        log(f"memory per rank with scratch: {human(d.total)} (scratch {human(d.scratch)}, {d.scratch_of})")


def per_rank(spec: Spec, d: Breakdown) -> dict[str, Breakdown]:
    """The breakdown of every rank, by rank key (every rank holds the same shapes)."""
    return {rank_key(r): d for r in range(spec.topology.world)}


def record(spec: Spec, plan: RegionPlan, executables: Sequence[Executable], staging: Path) -> dict[str, dict]:
    """The manifest's "memory": the full breakdown per rank, checked once more with the executables."""
    files = [staging / e.artifact for e in executables]
    d = check(spec, plan, "with the compiled executables", executables, files)
    return {rank: b.to_dict() for rank, b in per_rank(spec, d).items()}


def id_ranges(ids: list[int]) -> str:
    """[1, 2, 3, 7] -> '1-3, 7'."""
    parts, start = [], None
    for i, x in enumerate(ids):
        if start is None:
            start = x
        if i + 1 == len(ids) or ids[i + 1] != x + 1:
            parts.append(str(start) if start == x else f"{start}-{x}")
            start = None
    return ", ".join(parts)


def rank_label(ranks: list[str]) -> str:
    """["rank-0", "rank-1"] -> 'ranks 0-1 (2)'."""
    ids = [int(r.rsplit("-", 1)[1]) for r in ranks]
    return f"rank {id_ranges(ids)}" if len(ids) == 1 else f"ranks {id_ranges(ids)} ({len(ids)})"


def by_rank_group(by_rank: dict, key) -> dict:
    """Ranks grouped by `key` of their value -> {label: the first value of the group}."""
    groups: dict = {}
    for r, v in by_rank.items():
        groups.setdefault(key(v), []).append((r, v))
    return {rank_label([r for r, _ in g]): g[0][1] for g in groups.values()}
