"""A verify step's cost with the DSpark draft on one rank, from a plan alone (issue 42): nothing runs.

With [speculative] draft a decode step of B sequences is a verify step and a draft step:

    target    the anchor and the block's drafts, T = the smallest tokens bucket holding
              dspark_block_size + 1 rows a sequence, through every layer and the head: the decode
              step's model (compiler/step_cost.py) at B * T rows, with the state read as a prompt
              chunk reads it (each window ring once a sequence) and the capture's (trn2: inside each
              target layer's fused module, compiler/layers.py's capture twins): as lowered, a
              sequence's whole features ring [W + P, D] read and written at each target layer.
              The head's choice per vocabulary slice: a greedy step's rows cross ranks as (value,
              index) pairs, not logits; where the head picks in its graph (fused layers, several
              ranks: `Head.best`) only the pairs leave the device, 8 bytes a row, else each rank's
              slice comes back to its host, where its pair is taken
    draft     the next block, P = dspark_block_size positions: its context from the features rings
              (W positions of D per target layer), every stage's attention and MoE (their weights at
              B * P rows, the routed experts' gathered slices as the target's), the last stage's
              normalize, the target head's projection, then the block's tokens chosen position by
              position on each rank's vocabulary slice: one all-gather of (value, index) pairs each

Executions and collectives: the target's as its plan counts them (BundlePlan.per_step: trn2's fused
layers hold the capture, so it adds neither); the draft's one execution where the target fuses
layers, else one per region method it calls with its collectives on the host (`draft_calls`). A
draft stage's collectives are at P rows: the attention's all-reduce over the token group (its heads are
divided over it as the target's window attention's), the MoE's as the target's (EP all-reduce, or dispatch
and combine); then P pick all-gathers over every rank (each rank's host gets every group's drafts).

Where the target fuses layers (trn2) the draft step is one module a batch bucket (compiler/draft_layers.py,
`fused_draft`): its context, each stage's attention and MoE with their collectives, the normalize,
the target head's projection and the P positions' picks with their all-gathers, all in one execution,
every group's drafts back to each rank's host; `draft_module=False` models the draft per region call.

The step's time is the target's lower bound plus the draft's (the draft's block starts at the token
the verify accepted last, so nothing overlaps); the time per output token at an acceptance of a
tokens a step is that over a (`ACCEPTANCE`: the seed's measured DSpark figures at EP = CP = 64).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from deepinfer.bundles.manifest import DRAFT_MODULE
from deepinfer.compiler.budget import human
from deepinfer.compiler.step_cost import (
    F32,
    INDEX,
    LOGITS,
    collective_terms,
    columns,
    decode_buckets,
    figures_of,
    host_inputs,
    link_bytes,
    lower_bound,
    plan_figures,
    step_flops,
    stream_bytes,
    through_host,
)
from deepinfer.compiler.step_reads import layer_bytes, read_bytes, region_flops, slot_rows
from deepinfer.regions.topology import head_rows

if TYPE_CHECKING:
    from deepinfer.compiler.bundle_plan import BundlePlan

ACCEPTANCE = (2.70, 3.10, 3.34)  # tokens a verify step at EP = CP = 64, the seed's DSpark figures
PAIR = 8  # a (value, index) pair as the ranks send it: float32 value and int32 index (runtime/ranks.Comm.picks)
PICKS = "greedy pick all-gather"  # the target's choice per vocabulary slice, a pair a row (Comm.argmax_pairs)
DRAFT_PICKS = "draft pick all-gather"  # the draft's, a pair a row and block position (Comm.picks)


@dataclass(frozen=True)
class Part:
    """One execution group's figures per rank: the target's verify or the draft's step."""

    executions: int
    collectives_by_name: dict[str, int]
    collectives_on_host: int
    collective_bytes: dict[str, int]  # sent, by collective
    weight_bytes: int
    state_bytes: int
    flops: int
    host_device_bytes: int
    memory_ms: float
    compute_ms: float
    latency_ms: float
    estimated_ms: float


@dataclass(frozen=True)
class VerifyCost:
    """One rank's verify step with the draft at `batch` sequences of a `context` bucket."""

    batch: int
    context: int
    rows: int  # the verify's tokens bucket a sequence (block + 1, or the smallest bucket above it)
    block: int  # the draft's positions a step (dspark_block_size)
    fused_draft: bool  # the draft step is one execution (a fused target), else one a region call
    pairs: bool  # the target's choice leaves a rank as (value, index) pairs, not its logits slice
    target: Part
    draft: Part
    executions: int
    collectives: int
    host_device_bytes: int
    estimated_ms: float

    def tpot_ms(self, accepted: float) -> float:
        """Modelled time per output token at `accepted` tokens a verify step."""
        return self.estimated_ms / accepted

    def to_dict(self) -> dict:
        return {**asdict(self), "tpot_ms": {f"{a:.2f}": self.tpot_ms(a) for a in ACCEPTANCE}}


def verify_rows(plan: BundlePlan) -> int:
    """The tokens bucket a verify step runs: the smallest holding block + 1, else the largest (the
    scheduler feeds what fits)."""
    need, tokens = plan.spec.model.text.dspark_block_size + 1, sorted(plan.spec.config.buckets.tokens)
    return next((t for t in tokens if t >= need), tokens[-1])


def fused_draft(plan: BundlePlan) -> bool:
    """Whether the plan runs a draft step as one execution: where the target fuses layers, the draft
    step is one module a batch bucket (compiler/draft_layers.py), unless neuronx-cc refused it
    (`per_region`, compiler/fallback.py)."""
    return plan.spec.fused and bool(plan.regions.draft) and DRAFT_MODULE not in plan.per_region


def verify_cost(
    plan: BundlePlan, batch: int, context: int, *, pairs: bool = True, draft_module: bool | None = None
) -> VerifyCost:
    """One rank's verify step with the draft; `pairs`: the target's choice as (value, index) pairs (a
    greedy step's), else its logits slice (a step that samples or returns logprobs); `draft_module`:
    the draft step as one execution with its collectives inside (None: as planned, `fused_draft`;
    False: per region call, to compare)."""
    rows = verify_rows(plan)
    fused = fused_draft(plan) if draft_module is None else draft_module
    target, draft = target_part(plan, batch, rows, context, pairs), draft_part(plan, batch, fused)
    return VerifyCost(
        batch=batch,
        context=context,
        rows=rows,
        block=plan.spec.model.text.dspark_block_size,
        fused_draft=fused,
        pairs=pairs,
        target=target,
        draft=draft,
        executions=target.executions + draft.executions,
        collectives=sum(target.collectives_by_name.values()) + sum(draft.collectives_by_name.values()),
        host_device_bytes=target.host_device_bytes + draft.host_device_bytes,
        estimated_ms=target.estimated_ms + draft.estimated_ms,
    )


def target_part(plan: BundlePlan, batch: int, rows: int, context: int, pairs: bool) -> Part:
    """The target's verify: the decode step's model at batch * rows token rows."""
    from deepinfer.compiler.prompt_cost import chunk_state_bytes

    spec = plan.spec
    c, topo, act = spec.model.text, spec.topology, spec.dtype.itemsize
    per_step = plan.per_step
    n = batch * rows
    counts = dict(per_step["collectives_by_name"])
    sent, graph, link, timed = collective_terms(plan, per_step, n, context)
    if pairs and LOGITS in counts:  # the head's choice per slice: a pair a row instead of its logits slice
        sent[PICKS] = n * PAIR
        counts[PICKS] = counts.pop(LOGITS)
        sent.pop(LOGITS)
    # the capture, as lowered: each target layer's ring of every slot in the step read and written whole
    capture = (
        2 * len(c.dspark_target_layer_ids) * batch * (c.sliding_window + c.dspark_block_size) * c.hidden_size * act
    )
    state = batch * chunk_state_bytes(c, plan, rows, context, act) + capture
    # the rank's pairs come back where its head picks in its graph (`Spec.head_best`), else its slice
    out = n * PAIR if pairs and spec.head_best else n * head_rows(c, topo) * F32
    engram = sum(p.engram_rows > 0 for p in plan.regions.layers)
    moved = host_inputs(c, n, act, device_embedding=spec.device_embedding, engram_layers=engram) + out
    host = {name: k - graph.get(name, 0) for name, k in counts.items() if k > graph.get(name, 0)}
    moved += sum(through_host(c, host, counts, sent, per_step["executions"], n, act).values())
    return _part(
        plan,
        executions=per_step["executions"],
        counts=counts,
        on_host=sum(counts.values()) - sum(graph.values()),
        sent=sent,
        weights=sum(read_bytes(plan, n).values()),
        state=state,
        flops=sum(step_flops(plan, n, context).values()),
        moved=moved,
        graph=sum(k for name, k in graph.items() if name not in timed),
        link=link,
        timed_s=sum(timed.values()),
    )


def draft_part(plan: BundlePlan, batch: int, fused: bool) -> Part:
    """The draft's step: one execution with its collectives inside where the draft is fused, else
    one a region call with its collectives on the host (and the streams through the host for them)."""
    c, topo, act = plan.spec.model.text, plan.spec.topology, plan.spec.dtype.itemsize
    P = c.dspark_block_size
    counts, sent = draft_collectives(plan, batch)
    weights, state, flops = draft_reads(plan, batch)
    executions = 1 if fused else draft_calls(plan)
    moved = batch * P * (c.hc_mult * c.hidden_size * act + 2 * INDEX) + 2 * batch * INDEX  # block, slots, anchors
    if fused:  # every group's drafts back to each rank's host
        moved += topo.groups * batch * P * INDEX
    if not fused and counts:  # every collective through the host: the streams and payloads both ways
        moved += executions * 2 * stream_bytes(c, batch * P, act) + 2 * sum(sent.values())
    link = sum(link_bytes(_link_name(name), b, topo) for name, b in sent.items()) if fused else 0
    return _part(
        plan,
        executions=executions,
        counts=counts,
        on_host=0 if fused else sum(counts.values()),
        sent=sent,
        weights=weights,
        state=state,
        flops=flops,
        moved=moved,
        graph=sum(counts.values()) if fused else 0,
        link=link,
    )


def draft_calls(plan: BundlePlan) -> int:
    """A draft step's executions per region call: the context, every stage's attention and MoE
    methods, the head's normalize, the target head's projection, and the choice: the head's `tokens`
    in one call, or one `pick` a position with the vocabulary split over a token group."""
    regions, topo = plan.regions, plan.spec.topology
    methods = {k: {e[1] for e in plan.executables if e[0] == k} for k in regions.draft_kinds}
    calls = 1 + 1 + 1  # context, normalize, project
    for stage in regions.draft:
        calls += sum(len(methods[kind]) for slot, (kind, _) in stage.items() if slot in ("attn", "moe"))
    return calls + (plan.spec.model.text.dspark_block_size if topo.world > 1 else 1)


def _link_name(name: str) -> str:
    """The step model's name whose group a draft collective's links are counted over (`link_bytes`)."""
    return LOGITS if "pick" in name else name.removeprefix("draft ")


def draft_collectives(plan: BundlePlan, batch: int) -> tuple[dict[str, int], dict[str, int]]:
    """A draft step's collectives on a rank: calls and bytes sent, by name (the module's docstring)."""
    c, topo, act = plan.spec.model.text, plan.spec.topology, plan.spec.dtype.itemsize
    stages, P = len(plan.regions.draft), c.dspark_block_size
    streams = batch * P * c.hc_mult * c.hidden_size * F32
    calls: dict[str, int] = {}
    sent: dict[str, int] = {}

    def add(name: str, k: int, b: int) -> None:
        if k:
            calls[name], sent[name] = k, b

    if topo.group_size > 1:  # its heads divided over the token group (compiler/shard.py)
        add("draft attention all-reduce", stages, stages * streams)
    if topo.world > 1:  # over every rank: each rank's host gets every group's drafts
        add(DRAFT_PICKS, P, P * batch * PAIR)
    if topo.dispatch:
        packed = batch * P * (c.hc_mult * c.hidden_size * act + c.hc_mult * F32 + 1)
        add("draft ep dispatch all-gather", stages, stages * packed)
        add("draft ep combine reduce-scatter", stages, stages * topo.world * streams)
    elif topo.ep > 1:
        add("draft ep all-reduce", stages, stages * streams)
    return calls, sent


def draft_reads(plan: BundlePlan, batch: int) -> tuple[int, int, int]:
    """A draft step's weight bytes, state bytes and weight FLOPs on a rank: every stage's regions at
    their rows (the context projection's at W rows), the target head's slice at P rows, the rings."""
    c, topo, act = plan.spec.model.text, plan.spec.topology, plan.spec.dtype.itemsize
    regions, P = plan.regions, c.dspark_block_size
    weights = flops = 0
    for stage in regions.draft:
        for slot, (kind, _) in stage.items():
            if slot == "capture":  # in the target's steps
                continue
            rows = slot_rows(topo, slot, batch * (c.sliding_window if slot == "context" else P))
            region = regions.kinds[kind].region
            weights += layer_bytes(region, rows)
            flops += sum(region_flops(region, slot, rows).values())
    rows = head_rows(c, topo)
    weights += plan.head["bytes_per_rank"]  # the target head's projection: its vocabulary slice as stored
    flops += 2 * batch * P * rows * c.hidden_size
    state = len(c.dspark_target_layer_ids) * batch * c.sliding_window * c.hidden_size * act
    return weights, state, flops


def _part(
    plan: BundlePlan,
    *,
    executions: int,
    counts: dict[str, int],
    on_host: int,
    sent: dict[str, int],
    weights: int,
    state: int,
    flops: int,
    moved: int,
    graph: int,
    link: int,
    timed_s: float = 0.0,
) -> Part:
    times = lower_bound(
        figures_of(plan),
        plan.spec.config.model.dtype,
        bytes_read=weights + state,
        flops=flops,
        executions=executions,
        in_graph=graph,
        link=link,
        on_host=on_host,
        host_device=moved,
        timed_s=timed_s,
    )
    return Part(
        executions=executions,
        collectives_by_name=counts,
        collectives_on_host=on_host,
        collective_bytes=sent,
        weight_bytes=weights,
        state_bytes=state,
        flops=flops,
        host_device_bytes=moved,
        memory_ms=times["memory_ms"],
        compute_ms=times["compute_ms"],
        latency_ms=times["latency_ms"],
        estimated_ms=times["estimated_ms"],
    )


# -- the plan's text and JSON ---------------------------------------------------------------------


def report(plan: BundlePlan) -> dict | None:
    """`deepinfer plan --json`'s "verify_step": one entry per decode bucket; None without a draft or
    without the target's hardware figures."""
    if not plan.spec.draft or plan_figures(plan) is None:
        return None
    return {
        "per": "rank and verify step (the target's verify and the draft's next block)",
        "acceptance": list(ACCEPTANCE),
        "buckets": [verify_cost(plan, b, ctx).to_dict() for b, ctx in decode_buckets(plan)],
    }


def lines(plan: BundlePlan) -> list[str]:
    """The plan's text: one column per decode bucket (nothing without a draft or hardware figures)."""
    if not plan.spec.draft or plan_figures(plan) is None:
        return []
    costs = [verify_cost(plan, b, ctx) for b, ctx in decode_buckets(plan)]
    v = costs[0]
    form = "one execution, its collectives inside" if v.fused_draft else "an execution a region call"
    rows: list[tuple[str, Callable[[VerifyCost], str]]] = [
        ("executions (target + draft)", lambda s: f"{s.executions} ({s.target.executions} + {s.draft.executions})"),
        (
            "collectives (on the host)",
            lambda s: f"{s.collectives} ({s.target.collectives_on_host + s.draft.collectives_on_host})",
        ),
        ("host<->device bytes", lambda s: human(s.host_device_bytes)),
        ("target verify (ms)", lambda s: f"{s.target.estimated_ms:.2f}"),
        ("draft step (ms)", lambda s: f"{s.draft.estimated_ms:.2f}"),
        ("verify step, a lower bound (ms)", lambda s: f"{s.estimated_ms:.2f}"),
        *((f"per output token at {a:.2f} a step (ms)", lambda s, a=a: f"{s.tpot_ms(a):.2f}") for a in ACCEPTANCE),
    ]
    return [
        f"verify step with the draft per rank ({v.rows} tokens a sequence, a block of {v.block}; the draft {form};"
        " greedy choices as (value, index) pairs):",
        *columns("batch x context", [f"{s.batch} x {s.context:,}" for s in costs], rows, costs),
    ]
