"""A prompt's cost on one rank and its time to first token, from a plan alone (issue 41): nothing runs.

A prompt of L tokens (batch 1) runs as ceil(L / T) chunks of a prompt bucket of T tokens, each a
step of the plan's executables at T rows and the smallest context bucket that holds the chunk's last
position. A chunk's figures per rank are the decode step's model (compiler/step_cost.py) at T rows:

    weight bytes     what the executables read at T rows (`step_reads.read_bytes`): every weight whole,
                     the routed experts' stacks as the MoE's form at T rows reads them
    state bytes      the window rings once, the K selected entries each row gathers (static: K =
                     min(index_topk, the bucket's entries) whatever the row's position), the rank's index
                     keys once (a chunk scores them in one matmul), the chunk's entries written
    FLOPs            `step_cost.step_flops` at T rows: the matmuls at the rank's shapes (rows that every
                     rank of a token group computes are counted on every rank), each row's attention
                     over its keys, the index scores over the rank's keys, the head on the chunk's last
                     row (`last_row_head`: what the runtime samples from); each part at
                     the peak of the dtype it runs in (`part_dtype`: float32 for the mixes, the router,
                     the compressor, the attention and the head; the activation dtype for the rest)
    collectives      the decode step's (BundlePlan.per_step) at T rows of bytes, the logits' at one row

and its time the decode step's lower bound: max(memory, compute) + latency terms. The time to first
token (TTFT) is the sum over the chunks; nothing overlaps one chunk with the next.

The compute bound is the prompt's useful FLOPs (`useful_flops`: the model's own arithmetic for L
tokens, from the config alone: each token through every layer's projections, its 6 routed experts
and the shared one, its attention over its window and its selected entries, the indexer's scores over
every visible entry, which grow with the square of the context, and the head for the last token) over
the sum of every rank's peak, each part at its dtype's. `ttft / compute bound` is how far the layout
is from dividing the prompt's work over the ranks: while every rank of a token group computes every
row of a chunk (docs/ranks.md, "What a prompt costs"), the parts it computes with whole weights and
every head's attention cost each rank what they cost the whole prompt.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from deepinfer.compiler.budget import human
from deepinfer.compiler.step_cost import (
    F32,
    collective_terms,
    columns,
    figures_of,
    lower_bound,
    plan_figures,
    step_flops,
)
from deepinfer.compiler.step_reads import read_bytes
from deepinfer.regions.config import TextConfig
from deepinfer.regions.topology import head_rows

if TYPE_CHECKING:
    from deepinfer.compiler.bundle_plan import BundlePlan
    from deepinfer.compiler.targets.trn2_figures import Figure

PROMPTS = (8192, 65536, 1048576)  # the prompt lengths `deepinfer plan` models at batch 1
FP32_PARTS = frozenset(
    {"mixes, attention site", "mixes, moe site", "router", "compressor", "attention", "head"}
)  # what runs in float32 whatever the activation dtype (MODEL.md); the rest in the activation dtype


def part_dtype(part: str, act: str) -> str:
    """The dtype FLOPs part `part` runs in, `act` the activation dtype ("bf16" or "fp32")."""
    return "fp32" if part in FP32_PARTS else act


def compute_s(flops: dict[str, int], figures: dict[str, Figure], act: str, ranks: int = 1) -> float:
    """Seconds `flops` (by part) take at `ranks` ranks' peak, each part at its dtype's."""
    return sum(f / (ranks * figures[f"{part_dtype(part, act)}_flops_per_s"].value) for part, f in flops.items())


# -- the model's own arithmetic (independent of the layout) ------------------------------------


def _visible(L: int, ratio: int) -> int:
    """Sum over positions p < L of the compressed entries visible at p, (p + 1) // ratio."""
    # sum_{m=1..L} floor(m / r) = r * q * (q - 1) / 2 + q * (L - q * r + 1), q = L // r
    q = L // ratio
    return ratio * q * (q - 1) // 2 + q * (L - q * ratio + 1)


def _selected(L: int, ratio: int, k: int) -> int:
    """Sum over positions p < L of min(k, (p + 1) // ratio): the entries each row attends."""
    full = min(L, k * ratio)  # rows before (k * ratio - 1) see fewer than k entries
    return _visible(full, ratio) + (L - full) * k


def useful_flops(c: TextConfig, L: int) -> dict[str, int]:
    """FLOPs of a prompt of `L` tokens at batch 1, by part (2 a multiply-add): the model's arithmetic,
    whatever the layout, from the config alone (`compiler/step_reads.PARTS`' names)."""
    n, D, H, hd, q = c.hc_mult, c.hidden_size, c.num_attention_heads, c.head_dim, c.q_lora_rank
    G, R, I, E, k = c.o_groups, c.o_lora_rank, c.moe_intermediate_size, c.n_routed_experts, c.num_experts_per_tok
    Hi, di, W, K = c.index_n_heads, c.index_head_dim, c.sliding_window, c.index_topk
    layers = c.num_hidden_layers
    out = {
        "mixes, attention site": layers * L * 2 * (2 + n) * n * n * D,
        "mixes, moe site": layers * L * 2 * (2 + n) * n * n * D,
        "attention projections": layers * L * 2 * (q * D + H * hd * q + hd * D + R * H * hd + D * G * R),
        "router": layers * L * 2 * E * D,
        "routed experts": layers * L * 2 * k * 3 * I * D,
        "shared expert": layers * L * 2 * c.n_shared_experts * 3 * I * D,
        "head": 2 * c.vocab_size * D,  # the last token's logits
    }
    window = sum(min(p + 1, W) for p in range(min(L, W))) + max(0, L - W) * W
    compressor = indexer = scores = keys = 0
    for layer in range(layers):
        ratio, kind = c.compress_ratios[layer], c.layer_kind(layer)
        keys += window + (_selected(L, ratio, K) if ratio else 0)
        if kind == "source":  # wkv (and wgate where ratio > 1) per token; wk per compressed entry
            compressor += L * 2 * hd * D * (2 if ratio > 1 else 1) + (L // ratio) * 2 * di * hd
        if kind in ("source", "reindex"):
            indexer += L * 2 * (Hi * di * q + Hi * D)
            scores += 2 * _visible(L, ratio) * Hi * (di + 1)  # q . k per head and its weight: the square
    out["compressor"] = compressor
    out["indexer queries"] = indexer
    out["index scores"] = scores
    out["attention"] = 2 * keys * H * hd * 2  # scores and the weighted sum
    if c.engram_layer_ids:
        out["engram"] = len(c.engram_layer_ids) * L * 2 * (n + 1) * D * c.engram_hash_heads * c.engram_head_dim
    return out


def compute_bound_ms(plan: BundlePlan, L: int) -> float:
    """The prompt's useful FLOPs over every rank's peak, each part at its dtype's, in ms."""
    spec = plan.spec
    flops = useful_flops(spec.model.text, L)
    return compute_s(flops, figures_of(plan), spec.config.model.dtype, spec.topology.world) * 1e3


# -- a plan's prompt chunk ----------------------------------------------------------------------


def chunk_state_bytes(c: TextConfig, plan: BundlePlan, rows: int, context: int, act: int) -> int:
    """State bytes a rank reads and writes in a prompt chunk of `rows` rows at a `context` bucket:
    each layer's window ring once and the chunk's latents written to it, the selected entries each row
    gathers, the rank's index keys once, the compressed entries the chunk writes (its share)."""
    cp, hd = plan.spec.topology.cp, c.head_dim
    total = 0
    for p in plan.regions.layers:
        total += (c.sliding_window + rows) * hd * act  # the ring read, the chunk's rows written
        if p.ratio:
            width = context // p.ratio
            total += rows * min(c.index_topk, width) * hd * act  # gathered per row (static K)
            if p.attn == "source":
                total += -(-rows // p.ratio // cp) * (hd + c.index_head_dim) * act  # its entries written
            if p.attn in ("source", "reindex"):
                total += -(-width // cp) * c.index_head_dim * act  # the rank's index keys, once a chunk
    return total


@dataclass(frozen=True)
class ChunkCost:
    """One rank's prompt chunk of `rows` tokens at a `context` bucket (every figure per rank)."""

    rows: int
    context: int
    weight_bytes: int
    state_bytes: int
    flops: int
    flops_by_part: dict[str, int]
    executions: int
    collectives: int
    collective_bytes: int  # sent
    memory_ms: float
    compute_ms: float
    latency_ms: float
    estimated_ms: float

    @property
    def bound(self) -> str:
        """What limits the chunk: "compute" or "memory" (HBM)."""
        return "compute" if self.compute_ms >= self.memory_ms else "memory"


def last_row_head(flops: dict[str, int], rows: int) -> dict[str, int]:
    """A chunk's FLOPs (`step_flops` at `rows` rows of one sequence) with the head on its last row
    only: what the runtime runs where no request keeps every row's logits (runtime/schedule.py)."""
    return {**flops, "head": flops["head"] // rows}


def chunk_cost(plan: BundlePlan, rows: int, context: int) -> ChunkCost:
    """One rank's prompt chunk of `rows` tokens (batch 1) at a `context`-position bucket."""
    spec = plan.spec
    figures = figures_of(plan)
    c, topo, act = spec.model.text, spec.topology, spec.dtype.itemsize
    per_step = plan.per_step
    flops = last_row_head(step_flops(plan, rows, context), rows)
    weights = sum(read_bytes(plan, rows).values())
    state = chunk_state_bytes(c, plan, rows, context, act)
    counts = per_step["collectives_by_name"]
    sent, graph, link, timed = collective_terms(plan, per_step, rows, context, logit_rows=1)
    times = lower_bound(  # its memory and latency terms; compute below, each part at its dtype's peak
        figures,
        spec.config.model.dtype,
        bytes_read=weights + state,
        flops=0,
        executions=per_step["executions"],
        in_graph=sum(k for name, k in graph.items() if name not in timed),
        link=link,
        on_host=sum(counts.values()) - sum(graph.values()),
        host_device=rows * 2 * F32 + head_rows(c, topo) * F32,  # ids, positions in; the last row's logits out
        timed_s=sum(timed.values()),
    )
    return timed_chunk(
        plan,
        rows,
        context,
        flops,
        weights,
        state,
        per_step["executions"],
        sum(counts.values()),
        sum(sent[name] for name in counts),
        times,
    )


def timed_chunk(
    plan: BundlePlan,
    rows: int,
    context: int,
    flops: dict[str, int],
    weights: int,
    state: int,
    executions: int,
    collectives: int,
    collective_bytes: int,
    times: dict[str, float],
) -> ChunkCost:
    """A chunk's figures with its time: `times` the memory and latency terms (`lower_bound`'s), the
    compute each part's FLOPs at its dtype's peak; the estimate the larger of memory and compute
    plus the latency (any chunk's form: `chunk_cost`, compiler/prompt_rows.divided_chunk_cost)."""
    memory_ms, latency_ms = times["memory_ms"], times["latency_ms"]
    compute_ms = compute_s(flops, figures_of(plan), plan.spec.config.model.dtype) * 1e3
    return ChunkCost(
        rows=rows,
        context=context,
        weight_bytes=weights,
        state_bytes=state,
        flops=sum(flops.values()),
        flops_by_part=flops,
        executions=executions,
        collectives=collectives,
        collective_bytes=collective_bytes,
        memory_ms=memory_ms,
        compute_ms=compute_ms,
        latency_ms=latency_ms,
        estimated_ms=max(memory_ms, compute_ms) + latency_ms,
    )


def context_bucket(plan: BundlePlan, position: int) -> int:
    """The smallest context bucket holding `position` positions (the largest where none does)."""
    contexts = plan.spec.config.buckets.contexts
    return next((ctx for ctx in contexts if ctx >= position), contexts[-1])


@dataclass(frozen=True)
class PromptCost:
    """A prompt of `tokens` tokens at batch 1 in chunks of `chunk` tokens, on one rank."""

    tokens: int
    chunk: int
    chunks: int
    weight_bytes: int
    state_bytes: int
    flops: int
    flops_by_part: dict[str, int]
    executions: int
    collectives: int
    collective_bytes: int
    ttft_ms: float
    memory_ms: float  # summed over the chunks
    compute_ms: float
    latency_ms: float
    bound_chunks: dict[str, int]  # chunks limited by compute, by memory
    useful_flops: int  # the whole prompt's, every rank's together
    useful_flops_by_part: dict[str, int]
    compute_bound_ms: float
    ttft_over_compute_bound: float

    def to_dict(self) -> dict:
        return asdict(self)


def built_chunk_cost(plan: BundlePlan) -> Callable[[BundlePlan, int, int], ChunkCost]:
    """How the plan's bundle runs a prompt chunk: divided by rows over the token group where it is
    compiled with `[prompt] rows = "divided"` (compiler/prompt_rows.py, in the micro-batches the bundle
    runs: trn2's rows modules, compiler/rows_layers.py), else every rank every row (`chunk_cost`)."""
    if not plan.spec.divided_rows:
        return chunk_cost
    from deepinfer.compiler import prompt_rows  # it builds on this module's figures

    return prompt_rows.built_divided_cost


def prompt_cost(
    plan: BundlePlan, tokens: int, chunk: int, cost: Callable[[BundlePlan, int, int], ChunkCost] | None = None
) -> PromptCost:
    """One rank's work for a prompt of `tokens` tokens in chunks of `chunk` (the last one padded to
    the bucket: a static shape), each at the context bucket that holds its last position. `cost`:
    a chunk's (`built_chunk_cost` unless given: compiler/prompt_rows.built_divided_cost models the chunk
    divided by rows)."""
    cost = built_chunk_cost(plan) if cost is None else cost
    n = -(-tokens // chunk)
    by_bucket: dict[int, int] = {}
    for i in range(n):
        ctx = context_bucket(plan, min(tokens, (i + 1) * chunk))
        by_bucket[ctx] = by_bucket.get(ctx, 0) + 1
    costs = [(cost(plan, chunk, ctx), k) for ctx, k in by_bucket.items()]
    parts: dict[str, int] = {}
    for cc, k in costs:
        for part, f in cc.flops_by_part.items():
            parts[part] = parts.get(part, 0) + k * f
    useful = useful_flops(plan.spec.model.text, tokens)
    ttft = sum(cc.estimated_ms * k for cc, k in costs)
    bound = compute_bound_ms(plan, tokens)
    return PromptCost(
        tokens=tokens,
        chunk=chunk,
        chunks=n,
        weight_bytes=sum(cc.weight_bytes * k for cc, k in costs),
        state_bytes=sum(cc.state_bytes * k for cc, k in costs),
        flops=sum(parts.values()),
        flops_by_part=parts,
        executions=sum(cc.executions * k for cc, k in costs),
        collectives=sum(cc.collectives * k for cc, k in costs),
        collective_bytes=sum(cc.collective_bytes * k for cc, k in costs),
        ttft_ms=ttft,
        memory_ms=sum(cc.memory_ms * k for cc, k in costs),
        compute_ms=sum(cc.compute_ms * k for cc, k in costs),
        latency_ms=sum(cc.latency_ms * k for cc, k in costs),
        bound_chunks={
            b: sum(k for cc, k in costs if cc.bound == b)
            for b in ("compute", "memory")
            if any(cc.bound == b for cc, _ in costs)
        },
        useful_flops=sum(useful.values()),
        useful_flops_by_part=useful,
        compute_bound_ms=bound,
        ttft_over_compute_bound=ttft / bound,
    )


def prompt_buckets(plan: BundlePlan) -> list[int]:
    """The plan's prompt buckets: its tokens buckets above one token (decode steps are one)."""
    return [t for t in plan.spec.config.buckets.tokens if t > 1]


def prompt_lengths(plan: BundlePlan) -> list[int]:
    """The prompts modelled: `PROMPTS` up to the plan's max_context."""
    return [L for L in PROMPTS if L <= plan.spec.config.buckets.max_context]


SWEEP = (128, 256, 512, 1024, 2048, 4096, 8192)  # the chunk sizes a plan compares


def chunk_sweep(plan: BundlePlan, tokens: int) -> list[dict]:
    """A prompt of `tokens` tokens in chunks of each size of `SWEEP` and of the plan's prompt buckets:
    its TTFT, its chunks' bound, and whether the plan builds that bucket (whose scratch the memory
    verdict then counts); sizes the plan does not build have no scratch figure here."""
    built = set(prompt_buckets(plan))
    out = []
    for size in sorted({*SWEEP, *built}):
        p = prompt_cost(plan, tokens, size)
        out.append({"chunk": size, "built": size in built, "ttft_ms": p.ttft_ms, "bound_chunks": p.bound_chunks})
    return out


def report(plan: BundlePlan) -> dict | None:
    """`deepinfer plan --json`'s "prompt_cost": per prompt bucket one chunk at each context bucket,
    and per prompt length (`PROMPTS`) its cost in the largest bucket; None where the target gives no
    hardware figures or the plan has no prompt bucket."""
    if plan_figures(plan) is None or not prompt_buckets(plan):
        return None
    chunk = max(prompt_buckets(plan))
    return {
        "per": "rank; prompts at batch 1",
        "chunks": [
            asdict(built_chunk_cost(plan)(plan, t, ctx))
            for t in prompt_buckets(plan)
            for ctx in plan.spec.config.buckets.contexts
        ],
        "prompts": [prompt_cost(plan, L, chunk).to_dict() for L in prompt_lengths(plan)],
        "chunk_sweep": {"tokens": prompt_lengths(plan)[-1], "sizes": chunk_sweep(plan, prompt_lengths(plan)[-1])}
        if prompt_lengths(plan)
        else None,
    }


def lines(plan: BundlePlan) -> list[str]:
    """The plan's text: the prompts at its largest prompt bucket, one column each."""
    if plan_figures(plan) is None or not prompt_buckets(plan):
        return []
    chunk = max(prompt_buckets(plan))
    costs = [prompt_cost(plan, L, chunk) for L in prompt_lengths(plan)]
    if not costs:
        return []
    rows: list[tuple[str, Callable[[PromptCost], str]]] = [
        ("chunks", lambda p: f"{p.chunks:,}"),
        ("weight bytes read", lambda p: human(p.weight_bytes)),
        ("state bytes read", lambda p: human(p.state_bytes)),
        ("FLOPs on this rank", lambda p: f"{p.flops / 1e12:,.1f} T"),
        *(
            (f"  {part}", functools.partial(_part_cell, part))
            for part, _ in sorted(costs[-1].flops_by_part.items(), key=lambda kv: -kv[1])
        ),
        ("collectives", lambda p: f"{p.collectives:,}"),
        ("executions", lambda p: f"{p.executions:,}"),
        (
            "chunks compute / memory bound",
            lambda p: f"{p.bound_chunks.get('compute', 0)} / {p.bound_chunks.get('memory', 0)}",
        ),
        ("time to first token (ms)", lambda p: f"{p.ttft_ms:,.1f}"),
        ("compute bound, all ranks (ms)", lambda p: f"{p.compute_bound_ms:,.1f}"),
        ("TTFT / compute bound", lambda p: f"{p.ttft_over_compute_bound:,.1f}"),
    ]
    out = [
        f"prompt at batch 1 per rank, chunks of {chunk} tokens, modelled for trn2 (sum of the chunks' estimates; "
        "the compute bound: the prompt's useful FLOPs over every rank's peak):",
        *columns("prompt tokens", [f"{p.tokens:,}" for p in costs], rows, costs),
    ]
    tokens = costs[-1].tokens
    out.append(f"  a {tokens:,}-token prompt by chunk size (* built: its scratch is in the memory verdict):")
    for row in chunk_sweep(plan, tokens):
        bound = ", ".join(f"{n} {b}-bound" for b, n in row["bound_chunks"].items())
        out.append(f"    {row['chunk']:>6}{'*' if row['built'] else ' '} {row['ttft_ms']:>14,.1f} ms  ({bound})")
    return out


def _part_cell(part: str, p: PromptCost) -> str:
    return f"{p.flops_by_part.get(part, 0) / 1e12:,.1f} T"
