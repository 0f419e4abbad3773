"""A decode step's cost on one rank, from a plan alone (issue 29 item 6): nothing runs.

`deepinfer plan` prints it for every decode bucket (batch x context) when its target gives the
hardware figures the model needs (`Target.step_figures`: trn2 does); bench/step_model.py reads
it. Per rank and decode step (one token a sequence, B sequences of a context bucket in the token
group):

    weight bytes     what each executable's lowered module reads (compiler/step_reads.py): every weight
                     parameter of every layer whole, the routed experts' slices a step gathers (a row's
                     chosen ones below the crossover; a tile's above it), the head's rows; of the embedding
                     table only the step's B rows. Expected under uniform routing and worst case alike
    state bytes      each layer's window ring, the K = min(index_topk, Wc) selected compressed entries
                     a rank's attend gathers (static: it attends those it holds, masks the rest) and the
                     index keys it scores (its ceil(Wc / cp) per index layer), in the activation dtype;
                     Wc = context / ratio
    FLOPs            the matmuls (`layer_flops`), 2 a multiply-add, at the rank's shapes; weight
                     formats do not change them
    executions,      BundlePlan.per_step, as it counts them (a region or attention stage each
    collectives      today; fewer where a target runs a layer as one execution)
    collective bytes what a rank sends a step, by collective (`collective_bytes`)
    host<->device    the host inputs a step changes (token ids, or the embedded streams where the
                     host looks them up; positions; each engram layer's rows) and the rank's
                     logits slice; while a collective other than the logits gather runs on the
                     host, also every execution's streams (h, pre) both ways and each such
                     collective's payload down and back up

Lower bound (`lower_bound`): max(bytes read / HBM bandwidth, FLOPs / the peak FLOP/s of the
activation dtype) + in-graph collectives x their latency + the bytes they put on the links / link
bandwidth + host collectives x a host round trip + executions x launch overhead + host<->device
bytes / host link bandwidth.

Figures: the target's (`Target.step_figures`), or with `deepinfer plan --figures FILE` those a Trn2
host measured in their place (`with_measured`, BundlePlan.measured). Where the file holds the
in-graph collectives' latency by payload ("collectives": all_reduce, all_gather), each in-graph
collective of that kind is timed by its curve at the bytes a rank puts in a call (`curve_timed`:
interpolated; the reduce-scatter by the all-reduce's), in place of collective_s + its link bytes /
link bandwidth; the others keep that.

The selected entries are the one read a static shape keeps above a rank's share: the merged selection
can fall on one rank's blocks, so every rank's attend gathers K rows (about K / cp of them its own).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from deepinfer.bundles.topology import Topology
from deepinfer.compiler.budget import human
from deepinfer.compiler.config import config_error
from deepinfer.compiler.step_reads import read_bytes, weight_flops
from deepinfer.compiler.targets.trn2_figures import Measured, curve_seconds, measured_figures
from deepinfer.regions.config import TextConfig
from deepinfer.regions.step import LayerPlan
from deepinfer.regions.topology import head_rows

if TYPE_CHECKING:
    from deepinfer.compiler.bundle_plan import BundlePlan
    from deepinfer.compiler.targets.trn2_figures import Figure

F32 = 4
INDEX = 8  # int64: token ids, positions, global entry indices
LOGITS = "logits all-gather"
# per_step says how many collectives the executables hold, not which: they are taken in this order,
# the boundary all-reduces first (what trn2's collectives = "graph" moves into the modules,
# regions.topology.boundary_reduce), then EP's rows, the divided attention's merges, the logits
GRAPH_ORDER = (
    "attention all-reduce",
    "ep all-reduce",
    "engram all-reduce",
    "ep dispatch all-gather",
    "ep combine reduce-scatter",
    "cp query all-gather",
    "cp selection all-gather",
    "cp attention max all-gather",
    "cp attention all-reduce",
    LOGITS,
)


# -- what a step does ---------------------------------------------------------------------------


def layer_flops(plan: BundlePlan, p: LayerPlan, batch: int, context: int) -> dict[str, int]:
    """FLOPs of layer `p` on one rank at `batch` sequences of a `context`-position bucket, by part:
    its weight matmuls at the rank's shapes (`step_reads.weight_flops`: the routed experts' gathered
    slices, each against its row, or above the crossover its tile's rows) and, per row, the attention over its keys:
    the window and the selected entries the rank holds, every head the rank attends over each, and
    the index scores over the rank's share of the keys."""
    c, topo = plan.spec.model.text, plan.spec.topology
    out = weight_flops(plan, p.layer, batch)
    attn = plan.regions.kinds[plan.regions.bindings[p.layer]["attn"][0]].region
    Hi, di = c.index_n_heads, c.index_head_dim
    keys = c.sliding_window
    if p.ratio:
        width = context // p.ratio  # Wc
        keys += min(c.index_topk, width)  # gathered on every rank, its own unmasked
        if p.attn in ("source", "reindex"):
            out["index scores"] = 2 * batch * -(-width // topo.cp) * Hi * (di + 1)  # q . k per head, its weight
    heads = int(attn.heads)  # the heads this rank attends (a region attribute, not a buffer)
    out["attention"] = 2 * batch * keys * heads * c.head_dim * 2  # scores and the weighted sum
    return out


def step_flops(plan: BundlePlan, batch: int, context: int) -> dict[str, int]:
    """A decode step's FLOPs on one rank, by part: every layer's (the MoE's at the rows it gathers
    under EP dispatch) and the rank's head slice."""
    c, topo = plan.spec.model.text, plan.spec.topology
    total: dict[str, int] = {}
    for p in plan.regions.layers:
        for part, f in layer_flops(plan, p, batch, context).items():
            total[part] = total.get(part, 0) + f
    total["head"] = batch * 2 * head_rows(c, topo) * c.hidden_size
    return total


def state_bytes(
    c: TextConfig, layers: Sequence[LayerPlan], batch: int, context: int, act_bytes: int, share: int, slack: int = 0
) -> int:
    """Bytes of state a rank reads a decode step when it holds 1/`share` of each sequence's
    compressed entries (cp; 1: all of them), its window rings `slack` rows beyond the window."""
    total = 0
    for p in layers:
        total += batch * (c.sliding_window + slack) * c.head_dim * act_bytes  # the window ring
        if p.ratio:
            width = context // p.ratio
            total += batch * min(c.index_topk, width) * c.head_dim * act_bytes  # the selected entries gathered
            if p.attn in ("source", "reindex"):
                total += batch * -(-width // share) * c.index_head_dim * act_bytes  # index keys scored
    return total


def weight_bytes(plan: BundlePlan, batch: int) -> int:
    """Device weight bytes a rank reads a decode step (`step_reads.read_bytes`, summed over kinds)."""
    return sum(read_bytes(plan, batch).values())


def collective_bytes(
    c: TextConfig, topo: Topology, batch: int, act_bytes: int, context: int, logit_rows: int | None = None
) -> dict[str, int]:
    """Bytes one rank sends a decode step, by collective (runtime/ranks.Comm's), summed over the
    layers: `batch` sequences per token group at a `context`-position bucket; `logit_rows` the rows
    the head runs on where fewer (a prompt chunk's: one a sequence, its last).

        attention all-reduce     float32 partial streams [B, n, D] after every attention (its heads
                                 or output rows divided over the token group, tp * cp > 1)
        ep all-reduce            float32 partial streams after every MoE (tokens replicated)
        ep dispatch all-gather   packed rows (h in the activation dtype, pre, is_image) once a layer
        ep combine reduce-scat.  float32 partials of every rank's rows
        engram all-reduce        float32 partial keys and value [B, (n+1)*D] of every engram layer
                                 (its projection divided over the token group: tp * cp > 1)
        logits all-gather        the rank's float32 slice of the vocabulary [B, head rows]
        cp ...                   the divided attention's merges (`divided_merges`)
    """
    layers, n, D = c.num_hidden_layers, c.hc_mult, c.hidden_size
    streams = batch * n * D * F32
    out: dict[str, int] = {}
    if topo.group_size > 1:
        out["attention all-reduce"] = layers * streams
    if topo.dispatch:
        out["ep dispatch all-gather"] = layers * batch * (n * D * act_bytes + n * F32 + 1)
        out["ep combine reduce-scatter"] = layers * topo.world * streams
    elif topo.ep > 1:
        out["ep all-reduce"] = layers * streams
    if topo.group_size > 1 and c.engram_layer_ids:
        out["engram all-reduce"] = len(c.engram_layer_ids) * batch * (n + 1) * D * F32
    if topo.world > 1:
        out[LOGITS] = (batch if logit_rows is None else logit_rows) * head_rows(c, topo) * F32
    if topo.cp > 1:
        out.update(divided_merges(c, topo.tp, batch, act_bytes, context, cp=topo.cp))
    return out


def divided_merges(c: TextConfig, tp: int, batch: int, act_bytes: int, context: int, *, cp: int = 1) -> dict[str, int]:
    """The divided attention's merges (runtime/ranks.Comm.topk, .blocks, .attention): bytes one cp
    rank sends a decode step. Selection: every index layer's K best (score in the activation dtype,
    int64 global index) [B, K], and on the candidate source its N best blocks the same way; attention:
    every compressed layer's float32 softmax max [B, H] and its numerator and sum [B, H, hd + 1]; query:
    every compressed layer's query rows (its H/(tp*cp) heads, on index layers its 1/cp of the indexer's)."""
    heads = c.num_attention_heads // tp
    pair = act_bytes + INDEX
    select = maxima = reduce = query = 0
    for layer in range(c.num_hidden_layers):
        ratio = c.compress_ratios[layer]
        if not ratio:
            continue
        index_rows = c.index_n_heads * c.index_head_dim if c.layer_kind(layer) in ("source", "reindex") else 0
        query += batch * (heads // cp * c.head_dim + index_rows // cp) * act_bytes  # its query rows
        maxima += batch * heads * F32
        reduce += batch * heads * (c.head_dim + 1) * F32
        width = context // ratio  # Wc
        if c.layer_kind(layer) in ("source", "reindex"):
            select += batch * min(c.index_topk, width) * pair
        if layer == c.candidate_source_layer_id:
            select += batch * min(c.candidate_topk_blocks, -(-width // c.candidate_block_size)) * pair
    return {
        "cp query all-gather": query,
        "cp selection all-gather": select,
        "cp attention max all-gather": maxima,
        "cp attention all-reduce": reduce,
    }


def link_bytes(name: str, sent: int, topo: Topology) -> int:
    """Bytes a collective puts on a rank's links: an all-gather brings in (group - 1) times what each
    rank sends; a ring reduce-scatter sends (group - 1) / group of its payload (`sent`, the partials of
    every rank's rows), and a ring all-reduce (a reduce-scatter, then an all-gather) about twice it."""
    group = topo.cp if name.startswith("cp") else topo.group_size if name == LOGITS else topo.world
    if "reduce-scatter" in name:
        return sent * (group - 1) // group
    if "all-gather" not in name:
        return 2 * sent
    return (group - 1) * sent


def stream_bytes(c: TextConfig, batch: int, act_bytes: int) -> int:
    """The streams one execution takes and gives: h [B, n, D] and pre [B, n] float32."""
    return batch * c.hc_mult * (c.hidden_size * act_bytes + F32)


def host_inputs(c: TextConfig, batch: int, act_bytes: int, *, device_embedding: bool, engram_layers: int) -> int:
    """Host input bytes a decode step changes (the runtime writes one only when its bytes change):
    token ids (or, looked up on the host, the embedded streams [B, n, D]), positions, and each engram
    layer's hashed rows (fp8 [B, heads, hd] and their ue8m0 scales [B, heads, hd / 32]). Slots,
    block tables and masks change when a sequence starts or takes a block."""
    tokens = INDEX if device_embedding else c.hc_mult * c.hidden_size * act_bytes
    rows = c.engram_hash_heads * (c.engram_head_dim + -(-c.engram_head_dim // 32))
    return batch * (tokens + INDEX + engram_layers * rows)


def through_host(
    c: TextConfig,
    host: dict[str, int],
    counts: dict[str, int],
    sent: dict[str, int],
    executions: int,
    rows: int,
    act: int,
) -> dict[str, int]:
    """Host<->device bytes of the collectives a step runs on the host (`host`: calls by name) beyond the
    choice's (the logits' gather, the (value, index) pairs'): every execution's streams both ways and
    each such collective's payload down and back up; none without such a collective."""
    others = {name: k for name, k in host.items() if name != LOGITS and "pick" not in name}
    if not others:
        return {}
    return {
        "streams": executions * 2 * stream_bytes(c, rows, act),
        "collectives": 2 * sum(sent[name] * k // counts[name] for name, k in others.items()),
    }


def in_executables(counts: dict[str, int], n: int) -> dict[str, int]:
    """How many calls of each collective the executables hold when they hold `n` (GRAPH_ORDER)."""
    out = {}
    for name in sorted(counts, key=GRAPH_ORDER.index):
        out[name] = min(counts[name], n)
        n -= out[name]
    return out


def collective_terms(
    plan: BundlePlan, per_step: dict, rows: int, context: int, logit_rows: int | None = None
) -> tuple[dict, dict, int, dict]:
    """A step's collectives at `rows` token rows a token group and a `context` bucket (the head on
    `logit_rows` of them where given: `collective_bytes`): the bytes a rank
    sends by collective (`collective_bytes`), the calls the executables hold by collective
    (`in_executables`), the bytes those a measured curve does not time put on the rank's links
    (`link_bytes`), and the seconds of those it times by collective (`curve_timed`)."""
    spec = plan.spec
    c, topo = spec.model.text, spec.topology
    counts = per_step["collectives_by_name"]
    sent = collective_bytes(c, topo, rows, spec.dtype.itemsize, context, logit_rows)
    graph = in_executables(counts, per_step["collectives_in_executables"])
    timed = curve_timed(plan, {name: (k, sent[name] // counts[name]) for name, k in graph.items() if k})
    link = sum(link_bytes(name, sent[name] * k // counts[name], topo) for name, k in graph.items() if name not in timed)
    return sent, graph, link, timed


def curve_timed(plan: BundlePlan, calls: dict[str, tuple[int, int]]) -> dict[str, float]:
    """Seconds of the in-graph collectives a measured latency curve times (BundlePlan.measured's
    "collectives"): `calls` {name: (calls, bytes a rank puts in one)}; an all-gather by the all_gather
    curve, an all-reduce or reduce-scatter by the all_reduce one, beyond the largest payload measured
    its link bytes at the link's bandwidth. Empty without curves."""
    curves = plan.measured.collectives if plan.measured is not None else {}
    if not curves:
        return {}
    per_byte = 1 / figures_of(plan)["link_bytes_per_s"].value
    out = {}
    for name, (k, payload) in calls.items():
        curve = curves.get("all_gather" if "all-gather" in name else "all_reduce")
        if curve is not None:
            beyond = link_bytes(name, 1, plan.spec.topology) * per_byte
            out[name] = k * curve_seconds(curve, payload, beyond)
    return out


def lower_bound(
    figures: dict[str, Figure],
    dtype: str,
    *,
    bytes_read: int,
    flops: int,
    executions: int,
    in_graph: int,
    link: int,
    on_host: int,
    host_device: int,
    timed_s: float = 0.0,
) -> dict[str, float]:
    """A step's lower-bound time and its terms, in ms: memory and compute (`dtype`'s peak; an fp8
    Tensor Engine's beside it), collective links, latency, and the estimate. `in_graph` and `link`:
    the in-graph collectives no measured curve times; `timed_s` the seconds of those one does."""
    v = {name: f.value for name, f in figures.items()}
    memory = bytes_read / v["hbm_bytes_per_s"]
    compute = flops / v[f"{dtype}_flops_per_s"]
    links = link / v["link_bytes_per_s"]
    latency = (
        in_graph * v["collective_s"]
        + links
        + timed_s
        + on_host * v["host_collective_s"]
        + executions * v["launch_s"]
        + host_device / v["host_link_bytes_per_s"]
    )
    return {
        "memory_ms": memory * 1e3,
        "compute_ms": compute * 1e3,
        "compute_fp8_ms": flops / v["fp8_flops_per_s"] * 1e3,
        "collective_link_ms": links * 1e3,
        "latency_ms": latency * 1e3,
        "estimated_ms": (max(memory, compute) + latency) * 1e3,
    }


# -- a plan's step ------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepCost:
    """One rank's decode step at one bucket (every figure per rank and step)."""

    batch: int
    context: int
    weight_bytes: int  # expected under uniform routing
    weight_bytes_worst: int  # any routing: a static gather reads its entries whatever they are, so the same
    weight_bytes_by_kind: dict[str, int]
    state_bytes: int
    flops: int
    flops_by_part: dict[str, int]
    executions: int
    collectives: int
    collectives_by_name: dict[str, int]
    collectives_in_executables: int
    collective_bytes: dict[str, int]  # sent, by collective
    collective_link_bytes: int  # of the collectives in the executables no measured curve times
    collectives_by_curve_ms: dict[str, float]  # in-graph collectives a measured latency curve times
    host_device_bytes: int
    host_device_by_part: dict[str, int]
    memory_ms: float
    compute_ms: float
    compute_fp8_ms: float
    collective_link_ms: float
    latency_ms: float
    estimated_ms: float

    def to_dict(self) -> dict:
        return asdict(self)


def plan_figures(plan: BundlePlan) -> dict[str, Figure] | None:
    """The figures the plan's step model uses: its target's (None: the target has none), with those
    a Trn2 host measured in their place (BundlePlan.measured, `with_measured`)."""
    target = plan.spec.target
    figures = target.step_figures()
    if figures is None or plan.measured is None:
        return figures
    assert target.lnc is not None  # a target with figures (trn2) has logical cores
    return measured_figures(figures, plan.measured, target.lnc)


def with_measured(plan: BundlePlan, measured: Measured) -> BundlePlan:
    """`plan` with the figures of a figures file (trn2_figures.load_figures) in place of its target's;
    a target without the step model refuses them."""
    figures_of(plan)
    return dataclasses.replace(plan, measured=measured)


def figures_of(plan: BundlePlan) -> dict[str, Figure]:
    """The plan's hardware figures (`plan_figures`); a target without them has no step cost model."""
    figures = plan_figures(plan)
    if figures is None:
        raise config_error(
            plan.spec.config,
            "target",
            "name",
            f"{plan.spec.target.name} gives no hardware figures for the decode step's cost model, "
            'which models trn2 ([target] name = "trn2")',
        )
    return figures


def step_cost(plan: BundlePlan, batch: int, context: int, per_step: dict | None = None) -> StepCost:
    """One rank's decode step at `batch` sequences of a `context`-position bucket; executions and
    collectives as `per_step` counts them (default: the plan's own, BundlePlan.per_step)."""
    figures = figures_of(plan)
    spec = plan.spec
    c, topo, act = spec.model.text, spec.topology, spec.dtype.itemsize
    per_step = plan.per_step if per_step is None else per_step
    layers = plan.regions.layers
    flops = step_flops(plan, batch, context)
    by_kind = read_bytes(plan, batch)
    weights = sum(by_kind.values())
    state = state_bytes(c, layers, batch, context, act, topo.cp, spec.geometry.slack)
    counts, executions = per_step["collectives_by_name"], per_step["executions"]
    sent, graph, link, timed = collective_terms(plan, per_step, batch, context)
    host = {name: counts[name] - graph[name] for name in counts if counts[name] > graph[name]}
    engram = sum(p.engram_rows > 0 for p in layers)
    moved = {
        "inputs": host_inputs(c, batch, act, device_embedding=spec.device_embedding, engram_layers=engram),
        "logits": batch * head_rows(c, topo) * F32,
    }
    moved.update(through_host(c, host, counts, sent, executions, batch, act))
    times = lower_bound(
        figures,
        spec.config.model.dtype,
        bytes_read=weights + state,
        flops=sum(flops.values()),
        executions=executions,
        in_graph=sum(k for name, k in graph.items() if name not in timed),
        link=link,
        on_host=sum(host.values()),
        host_device=sum(moved.values()),
        timed_s=sum(timed.values()),
    )
    return StepCost(
        batch=batch,
        context=context,
        weight_bytes=weights,
        weight_bytes_worst=weights,
        weight_bytes_by_kind=by_kind,
        state_bytes=state,
        flops=sum(flops.values()),
        flops_by_part=flops,
        executions=executions,
        collectives=sum(counts.values()),
        collectives_by_name=dict(counts),
        collectives_in_executables=sum(graph.values()),
        collective_bytes={name: sent[name] for name in counts},
        collective_link_bytes=link,
        collectives_by_curve_ms={name: s * 1e3 for name, s in timed.items()},
        host_device_bytes=sum(moved.values()),
        host_device_by_part=moved,
        **times,
    )


def decode_buckets(plan: BundlePlan) -> list[tuple[int, int]]:
    """(batch, context) of every decode bucket of the plan."""
    b = plan.spec.config.buckets
    return [(batch, context) for batch in b.batch for context in b.contexts]


def report(plan: BundlePlan) -> dict | None:
    """`deepinfer plan --json`'s "step_cost": the constants and one entry per decode bucket; None
    where the target gives no hardware figures."""
    figures = plan_figures(plan)
    if figures is None:
        return None
    m = plan.measured
    return {
        "per": "rank and decode step",
        "figures": {name: asdict(f) for name, f in figures.items()},
        "measured": None
        if m is None
        else {
            "path": str(m.path),
            "measured_on": m.measured_on,
            "collectives": {k: list(map(list, c)) for k, c in m.collectives.items()},
        },
        "buckets": [step_cost(plan, b, ctx).to_dict() for b, ctx in decode_buckets(plan)],
    }


def columns(label: str, heads: Sequence[str], rows: Sequence[tuple[str, Callable]], items: Sequence) -> list[str]:
    """A plan's table: a header line (`label`, one head a column), then one line a row (its label, its
    cell function of each of `items`, one a column)."""
    out = [f"  {label:<38}" + "".join(f"{h:>18}" for h in heads)]
    return out + [f"  {name:<38}" + "".join(f"{cell(item):>18}" for item in items) for name, cell in rows]


def _kind_cell(kind: str, s: StepCost) -> str:
    return human(s.weight_bytes_by_kind[kind])


def lines(plan: BundlePlan) -> list[str]:
    """The plan's text: one column per decode bucket, then the constants."""
    target = plan.spec.target
    figures = plan_figures(plan)
    if figures is None:
        return [f"decode step cost: modelled for trn2 only (target {target.name} gives no hardware figures)"]
    costs = [step_cost(plan, b, ctx) for b, ctx in decode_buckets(plan)]
    rows: list[tuple[str, Callable[[StepCost], str]]] = [
        ("weight bytes read (any routing)", lambda s: human(s.weight_bytes)),
        *((f"  {kind}", functools.partial(_kind_cell, kind)) for kind in costs[0].weight_bytes_by_kind),
        ("state bytes read", lambda s: human(s.state_bytes)),
        ("FLOPs", lambda s: f"{s.flops / 1e9:,.2f} G"),
        ("executions", lambda s: f"{s.executions}"),
        ("collectives (in executables)", lambda s: f"{s.collectives} ({s.collectives_in_executables})"),
        ("collective bytes sent", lambda s: human(sum(s.collective_bytes.values()))),
        ("host<->device bytes", lambda s: human(s.host_device_bytes)),
        ("memory time (ms)", lambda s: f"{s.memory_ms:.2f}"),
        (f"compute time at {plan.spec.config.model.dtype} peak (ms)", lambda s: f"{s.compute_ms:.2f}"),
        ("latency terms (ms)", lambda s: f"{s.latency_ms:.2f}"),
        ("estimate, a lower bound (ms)", lambda s: f"{s.estimated_ms:.2f}"),
    ]
    m = plan.measured
    what = "nothing measured" if m is None else f"figures measured on {m.measured_on['host']}: {m.path}"
    out = [
        f"decode step per rank, modelled for trn2 at LNC {target.lnc} (max(memory, compute) + latency terms; {what}):",
        *columns("batch x context", [f"{s.batch} x {s.context:,}" for s in costs], rows, costs),
    ]
    out.append("  figures (per rank; measured / published / assumed):")
    out += [f"    {name:<22} {f.value:g} {f.unit} ({f.status}: {f.source})" for name, f in figures.items()]
    if m is not None and m.collectives:
        curves = ", ".join(f"{kind} at {len(c)} payloads" for kind, c in m.collectives.items())
        out.append(f"  in-graph collectives timed by the measured latency by payload ({curves}), interpolated")
    return out
