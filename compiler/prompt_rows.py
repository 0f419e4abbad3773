"""A prompt chunk divided by rows over the token group, costed per rank (issue 41): the step that
`[prompt] rows = "divided"` builds (regions/rows.py: on cpu its stages, regions/step.rows_steps; on
trn2 one module a layer, compiler/rows_layers.py), modelled at a plan's topology and target figures:
the release's prompt chunks (examples/release/model.toml), beside the replicated chunks `prompt_cost`
models.

Rank j of d (the token group: tp = 1, ep = cp = d) takes T / d consecutive rows of a T-token chunk:

    own rows, whole weights   the attention site's mixes, the projections, the compressor's and the
                              indexer's, the MoE site's mixes and the router (`moe_in`; `ROW_PARTS`:
                              the model's arithmetic for T / d tokens), and the attention: every head
                              of its rows over the window and the K entries each selects (static K,
                              as the replicated step gathers)
    every row                 the routed experts' slices at T rows and the shared expert's slice
                              (`moe_experts`) on gathered rows, and the engram's `kv` (its slice of
                              the projection; its `rows_mix` on a rank's rows), as rows_steps runs
                              them; the index scores: its rows against every key (T / d x width),
                              what the replicated step spends on T x width / cp
    the last row              the head (`prompt_cost.last_row_head`), after the rows' gather
    weights read              the plan's per kind at T rows, each attention kind's whole weights
                              (its rows twin) in place of its slices
    state                     the window ring read and every row written (each rank keeps the ring
                              whole), the selected entries of its rows, every index key (the joined
                              pages), its own entries written and the whole context joined
    collectives               a layer's rows all-gather (packed float32 rows), a kv source's two
                              context all-gathers (its pages of the latents and the index keys), the
                              MoE's dispatch all-gather (its rows' x and routing: D x act + k x
                              (4 + 8) bytes a row) and combine reduce-scatter (every row's D-wide
                              float32 partial); the engram's reduce-scatter (every row's float32
                              partial keys and value to each rank's rows), the head's rows
                              all-gather, the logits' of the last row

Every collective is counted inside the executables (trn2's place for them: `collective_s` each, and
its bytes over the links).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from deepinfer.compiler.prompt_cost import ChunkCost, last_row_head, timed_chunk, useful_flops
from deepinfer.compiler.step_cost import F32, LOGITS, curve_timed, figures_of, link_bytes, lower_bound, step_flops
from deepinfer.compiler.step_reads import read_bytes, spec_bytes
from deepinfer.regions.topology import head_rows

if TYPE_CHECKING:
    from deepinfer.compiler.bundle_plan import BundlePlan

ROW_PARTS = (
    "mixes, attention site",
    "attention projections",
    "compressor",
    "indexer queries",
    "mixes, moe site",
    "router",
)
MICRO_BATCHES = 2  # a divided chunk's micro-batches (regions/micro.py: where the half chunk's bucket is built)
# a rank's row of the MoE's dispatch: x in the activation dtype, its k weights (float32) and experts (int64)
EXPERT_ID = 8


def fused_passes(tokens: int, group: int) -> int:
    """The micro-batches trn2's rows modules run a divided chunk of `tokens` rows as (compiler/rows_layers.py):
    MICRO_BATCHES where a rank has a whole number of rows of each, else one."""
    return MICRO_BATCHES if tokens % (MICRO_BATCHES * group) == 0 else 1


def own_rows(plan: BundlePlan, rows: int) -> int:
    """A rank's rows of a chunk of `rows` (the last rank's padding counted)."""
    return -(-rows // plan.spec.topology.group_size)


def divided_flops(plan: BundlePlan, rows: int, context: int) -> dict[str, int]:
    """One rank's FLOPs of a divided chunk, by part (the module's table)."""
    c = plan.spec.model.text
    own = own_rows(plan, rows)
    flops = last_row_head(step_flops(plan, rows, context), rows)
    mine = useful_flops(c, own)
    for part in ROW_PARTS:
        flops[part] = mine[part]
    attention = 0
    for p in plan.regions.layers:
        keys = c.sliding_window + (min(c.index_topk, context // p.ratio) if p.ratio else 0)
        attention += 2 * own * keys * c.num_attention_heads * c.head_dim * 2
    flops["attention"] = attention
    return flops


def divided_weight_bytes(plan: BundlePlan, rows: int) -> int:
    """Weight bytes a rank reads in a divided chunk: the plan's at `rows` rows, each attention kind's
    whole weights instead of its slices."""
    regions = plan.regions
    total = 0
    for kind, n in read_bytes(plan, rows).items():
        kp = regions.kinds[kind]
        whole = kp.slot == "attn"
        total += sum(spec_bytes(s) for s in kp.full_specs) * len(kp.layers) if whole else n
    return total


def divided_state_bytes(plan: BundlePlan, rows: int, context: int) -> int:
    """State bytes a rank reads and writes in a divided chunk (the module's table)."""
    c, act, cp = plan.spec.model.text, plan.spec.dtype.itemsize, plan.spec.topology.cp
    own, hd, di = own_rows(plan, rows), c.head_dim, c.index_head_dim
    total = 0
    for p in plan.regions.layers:
        total += (c.sliding_window + rows) * hd * act
        if not p.ratio:
            continue
        width = context // p.ratio
        total += own * min(c.index_topk, width) * hd * act
        if p.attn in ("source", "reindex"):
            total += width * di * act  # every key, the joined pages
        if p.attn == "source":
            total += -(-rows // p.ratio // cp) * (hd + di) * act  # its own entries written
            total += width * (hd + di) * act  # the context joined from every rank's pages
    return total


def divided_collectives(plan: BundlePlan, rows: int, context: int) -> dict[str, tuple[int, int]]:
    """name -> (calls, bytes one rank sends) of a divided chunk."""
    c, topo, act = plan.spec.model.text, plan.spec.topology, plan.spec.dtype.itemsize
    own, n, D, hd, di = own_rows(plan, rows), c.hc_mult, c.hidden_size, c.head_dim, c.index_head_dim
    streams = n * (D * act + F32)  # a row of h and pre
    routed = D * act + c.num_experts_per_tok * (F32 + EXPERT_ID)  # a row of x and its routing
    out: dict[str, list[int]] = {}

    def add(name: str, calls: int, sent: int) -> None:
        got = out.setdefault(name, [0, 0])
        got[0] += calls
        got[1] += sent

    for p in plan.regions.layers:
        packed = hd * (3 if p.ratio > 1 else 2) if p.attn == "source" else hd
        add("rows all-gather", 1, own * packed * F32)
        if p.attn == "source":
            add("rows context all-gather", 2, -(-(context // p.ratio) // topo.cp) * (hd + di) * act)
        if p.engram_rows:  # its kv's float32 partials of every row, to each rank's rows
            add("engram reduce-scatter", 1, rows * (n + 1) * D * F32)
        add("ep dispatch all-gather", 1, own * routed)
        add("ep combine reduce-scatter", 1, rows * D * F32)
    add("rows all-gather", 1, own * streams)  # the head's rows
    add(LOGITS, 1, head_rows(c, topo) * F32)  # the head on the chunk's last row
    return {name: (calls, sent) for name, (calls, sent) in out.items()}


def divided_chunk_cost(plan: BundlePlan, rows: int, context: int) -> ChunkCost:
    """One rank's divided prompt chunk of `rows` tokens (batch 1) at a `context`-position bucket, run in
    one pass."""
    return _divided(plan, rows, context)[0]


def micro_chunk_cost(plan: BundlePlan, rows: int, context: int) -> ChunkCost:
    """`divided_chunk_cost` for a chunk run as MICRO_BATCHES micro-batches of rows / MICRO_BATCHES
    (regions/micro.py, compiler/rows_layers.py: one's collectives on the links while another computes).
    Each micro-batch reads the weights again and costs its own arithmetic and collectives; its link
    time overlaps the others' memory and compute, except about one layer's (the first micro-batch's
    first gather and the last one's last combine have nothing beside them): the estimate is max(the
    passes' max(memory, compute), their link time) + that layer's links + the passes' other latency
    (per-collective latency, host bytes: not overlapped) + the launches: each pass's own on the cpu
    target (a region call a stage), once a chunk where the target fuses layers (both passes inside a
    layer's one module)."""
    m = MICRO_BATCHES
    one, links_ms, launch_ms = _divided(plan, rows // m, context)
    launches = 1 if plan.spec.fused else m
    busy, wire = m * max(one.memory_ms, one.compute_ms), m * links_ms
    other = m * (one.latency_ms - links_ms - launch_ms) + launches * launch_ms + links_ms / len(plan.regions.layers)
    estimated = max(busy, wire) + other
    return replace(
        one,
        rows=rows,
        weight_bytes=m * one.weight_bytes,
        state_bytes=m * one.state_bytes,
        flops=m * one.flops,
        flops_by_part={part: m * f for part, f in one.flops_by_part.items()},
        executions=launches * one.executions,
        collectives=m * one.collectives,
        collective_bytes=m * one.collective_bytes,
        memory_ms=m * one.memory_ms,
        compute_ms=m * one.compute_ms,
        latency_ms=estimated - busy,  # what the chunk waits beyond its passes' memory or compute
        estimated_ms=estimated,
    )


def built_passes(plan: BundlePlan, rows: int) -> int:
    """The micro-batches the plan's bundle runs a divided chunk of `rows` as: trn2's rows modules'
    (`fused_passes`); the cpu runtime's, where the half chunk's tokens bucket is built and divides over
    the group (runtime/executor.py)."""
    group = plan.spec.topology.group_size
    if plan.spec.fused:
        return fused_passes(rows, group)
    half = rows // MICRO_BATCHES
    built = {t for _, t in plan.spec.config.buckets.shapes()}
    return MICRO_BATCHES if half * MICRO_BATCHES == rows and half in built and half % group == 0 else 1


def built_divided_cost(plan: BundlePlan, rows: int, context: int) -> ChunkCost:
    """A divided chunk as the plan's bundle runs it: in `built_passes` micro-batches."""
    many = built_passes(plan, rows) > 1
    return micro_chunk_cost(plan, rows, context) if many else divided_chunk_cost(plan, rows, context)


def _divided(plan: BundlePlan, rows: int, context: int) -> tuple[ChunkCost, float, float]:
    """`divided_chunk_cost` and the ms of its latency that is link time (bytes on the links, and the
    collectives a measured curve times) and launches."""
    spec = plan.spec
    figures, topo = figures_of(plan), spec.topology
    flops = divided_flops(plan, rows, context)
    weights = divided_weight_bytes(plan, rows)
    state = divided_state_bytes(plan, rows, context)
    collectives = divided_collectives(plan, rows, context)
    timed = curve_timed(plan, {name: (calls, sent // calls) for name, (calls, sent) in collectives.items()})
    untimed = {name: kc for name, kc in collectives.items() if name not in timed}
    link = sum(link_bytes(name, sent // calls, topo) * calls for name, (calls, sent) in untimed.items())
    layers = plan.regions.layers
    # a layer: one module where the target fuses layers (compiler/rows_layers.py); else rows_in,
    # rows_attend, moe_in, moe_experts, moe_out (+ rows_write, the engram's kv and rows_mix)
    stages = [1 if spec.fused else 5 + (p.attn == "source") + 2 * (p.engram_rows > 0) for p in layers]
    executions = 2 + sum(stages)
    calls = sum(k for k, _ in collectives.values())
    times = lower_bound(
        figures,
        spec.config.model.dtype,
        bytes_read=weights + state,
        flops=0,
        executions=executions,
        in_graph=sum(k for k, _ in untimed.values()),
        link=link,
        on_host=0,
        host_device=own_rows(plan, rows) * 2 * F32 + head_rows(spec.model.text, topo) * F32,
        timed_s=sum(timed.values()),
    )
    sent = sum(sent for _, sent in collectives.values())
    cost = timed_chunk(plan, rows, context, flops, weights, state, executions, calls, sent, times)
    launch_ms = executions * figures["launch_s"].value * 1e3
    return cost, times["collective_link_ms"] + sum(timed.values()) * 1e3, launch_ms
