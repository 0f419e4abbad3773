"""The engine's Prometheus metrics: deepinfer's own names, and the names routers read (vLLM's).

`Metrics` is one engine's registry (`deepinfer-serve`'s /metrics); `MetricsEvents` counts what the
scheduler reports (`runtime.schedule.Events`) into it.

Beside the `deepinfer_*` series, the engine exports the series that the routers in front of vLLM
read to choose a replica, under vLLM's names and with its `model_name` label (the served model),
so an endpoint picker or router made for vLLM can read a deepinfer replica unchanged
(docs/serving.md, "Serving beyond one instance"):

    vllm:num_requests_running       gauge    sequences in the running batch
    vllm:num_requests_waiting       gauge    requests waiting to join it
    vllm:kv_cache_usage_perc        gauge    KV blocks held by running sequences over the blocks they
                                             can hold, a fraction (0 to 1); cached blocks nobody holds
                                             count as free, as vLLM counts them
    vllm:gpu_cache_usage_perc       gauge    the same, under the name older routers read
    vllm:prefix_cache_queries_total counter  prompt tokens looked up in the prefix cache
    vllm:prefix_cache_hits_total    counter  of those, the tokens it held
    vllm:prompt_tokens_total        counter  prompt tokens processed
    vllm:generation_tokens_total    counter  tokens generated
    vllm:time_to_first_token_seconds, vllm:inter_token_latency_seconds   histograms, as deepinfer's
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from deepinfer.runtime.requests import Request
from deepinfer.runtime.schedule import Events

if TYPE_CHECKING:  # prometheus_client loads with the first engine (Metrics.new)
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# seconds: step times of a tiny CPU bundle (~ms) up to a release rank's prefill chunk (~s)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
STEP_TOKEN_BUCKETS = tuple(float(1 << i) for i in range(15))  # 1 .. 16384 tokens
STEP_TOKENS_HELP = "Tokens one step fed: prompt chunks, decode and verify rows (--max-step-tokens bounds it)"


@dataclass(frozen=True)
class VllmMetrics:
    """The series routers made for vLLM read (the module's docstring), bound to one `model_name`."""

    running: Gauge
    waiting: Gauge
    kv_usage: Gauge
    gpu_cache_usage: Gauge
    prefix_queries: Counter
    prefix_hits: Counter
    prompt_tokens: Counter
    generation_tokens: Counter
    ttft: Histogram
    itl: Histogram

    @classmethod
    def new(cls, registry: CollectorRegistry, model: str) -> VllmMetrics:
        from prometheus_client import Counter, Gauge, Histogram

        def bound(kind, name: str, what: str, **kw):
            return kind(f"vllm:{name}", what, ["model_name"], registry=registry, **kw).labels(model)

        usage = "KV-cache usage: blocks held by running sequences over those they can hold (1 = full)"
        return cls(
            running=bound(Gauge, "num_requests_running", "Requests in the running batch"),
            waiting=bound(Gauge, "num_requests_waiting", "Requests waiting to join the batch"),
            kv_usage=bound(Gauge, "kv_cache_usage_perc", usage),
            gpu_cache_usage=bound(Gauge, "gpu_cache_usage_perc", usage + " (the name older routers read)"),
            prefix_queries=bound(Counter, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache"),
            prefix_hits=bound(Counter, "prefix_cache_hits", "Prompt tokens the prefix cache held"),
            prompt_tokens=bound(Counter, "prompt_tokens", "Prompt tokens processed"),
            generation_tokens=bound(Counter, "generation_tokens", "Tokens generated"),
            ttft=bound(Histogram, "time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS),
            itl=bound(Histogram, "inter_token_latency_seconds", "Between two tokens", buckets=LATENCY_BUCKETS),
        )


@dataclass(frozen=True)
class Metrics:
    """The engine's Prometheus metrics, in a registry of their own (one per engine: `Metrics.new()`)."""

    registry: CollectorRegistry
    requests: Counter
    queue_depth: Gauge
    running: Gauge
    prompt_tokens: Counter
    generated_tokens: Counter
    kv_blocks: Gauge
    kv_blocks_total: Gauge
    step: Histogram
    ttft: Histogram
    drafted: Counter
    accepted: Counter
    verify_steps: Counter
    itl: Histogram
    prefix_hit_tokens: Counter
    prefix_blocks: Gauge
    prefix_evicted: Counter
    step_tokens: Histogram
    vllm: VllmMetrics

    @classmethod
    def new(cls, model: str = "deepinfer") -> Metrics:
        """A registry of its own; `model`: the served model's name (vLLM's `model_name` label)."""
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

        disable_created_metrics()  # no `_created` timestamp series beside every counter
        r = CollectorRegistry()
        return cls(
            registry=r,
            requests=Counter(
                "deepinfer_requests",
                "Requests by outcome: the finish reason (stop, length, "
                "cancelled, error) or why it was refused (queue_full, bad_request)",
                ["outcome"],
                registry=r,
            ),
            queue_depth=Gauge("deepinfer_queue_depth", "Requests waiting to join the batch", registry=r),
            running=Gauge("deepinfer_running_sequences", "Sequences in the running batch", registry=r),
            prompt_tokens=Counter("deepinfer_prompt_tokens", "Prompt tokens processed", registry=r),
            generated_tokens=Counter("deepinfer_generated_tokens", "Tokens generated", registry=r),
            kv_blocks=Gauge("deepinfer_kv_blocks_in_use", "KV blocks held by running sequences", registry=r),
            kv_blocks_total=Gauge(
                "deepinfer_kv_blocks",
                "KV blocks sequences can hold (the pool less the scratch block, over every token group)",
                registry=r,
            ),
            step=Histogram("deepinfer_step_seconds", "Time of one batched step", buckets=LATENCY_BUCKETS, registry=r),
            ttft=Histogram(
                "deepinfer_time_to_first_token_seconds",
                "From a request's arrival to its first token",
                buckets=LATENCY_BUCKETS,
                registry=r,
            ),
            drafted=Counter(
                "deepinfer_drafted_tokens", "Tokens drafted for greedy requests (--speculative)", registry=r
            ),
            accepted=Counter("deepinfer_accepted_tokens", "Drafted tokens the target's verify steps kept", registry=r),
            verify_steps=Counter(
                "deepinfer_verify_steps", "Verify steps: one sequence's row of a step that carried drafts", registry=r
            ),
            itl=Histogram(
                "deepinfer_inter_token_latency_seconds",
                "Between two tokens of one request",
                buckets=LATENCY_BUCKETS,
                registry=r,
            ),
            prefix_hit_tokens=Counter(
                "deepinfer_prefix_cache_hit_tokens",
                "Prompt tokens whose KV came from the prefix cache instead of a prefill",
                registry=r,
            ),
            prefix_blocks=Gauge(
                "deepinfer_prefix_cache_blocks", "KV blocks the prefix cache holds (shared or evictable)", registry=r
            ),
            prefix_evicted=Counter(
                "deepinfer_prefix_cache_evicted_blocks",
                "Cached KV blocks evicted (least recently released first) for want of free blocks",
                registry=r,
            ),
            step_tokens=Histogram("deepinfer_step_tokens", STEP_TOKENS_HELP, buckets=STEP_TOKEN_BUCKETS, registry=r),
            vllm=VllmMetrics.new(r, model),
        )

    def text(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


class MetricsEvents(Events):
    """The scheduler's events counted in `Metrics`: token latencies from each request's arrival."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics
        self.arrived: dict[Request, float] = {}  # a running or waiting request -> when it was submitted
        self.last_token: dict[Request, float] = {}
        self.evicted = 0  # evictions counted so far
        self.capacity = 0  # KV blocks sequences can hold, over every token group (`set_capacity`)

    def set_capacity(self, blocks: int) -> None:
        """KV blocks sequences can hold (the pools less their scratch blocks, over every token group)."""
        self.capacity = blocks
        self.metrics.kv_blocks_total.set(blocks)

    def queued(self, running: int, waiting: int) -> None:
        """A request joined the waiting queue (between step boundaries)."""
        m = self.metrics
        m.running.set(running)
        m.queue_depth.set(waiting)
        m.vllm.running.set(running)
        m.vllm.waiting.set(waiting)

    def stepped(self, seconds: float) -> None:
        self.metrics.step.observe(seconds)

    def fed(self, prompt: int, decode: int, rows: int, longest: int) -> None:
        self.metrics.step_tokens.observe(prompt + decode)

    def prompt_tokens(self, n: int) -> None:
        if n:
            self.metrics.prompt_tokens.inc(n)
            self.metrics.vllm.prompt_tokens.inc(n)

    def token(self, request: Request, now: float) -> None:
        self.metrics.generated_tokens.inc()
        self.metrics.vllm.generation_tokens.inc()
        last = self.last_token.get(request)
        if last is None:
            ttft = now - self.arrived.get(request, now)
            self.metrics.ttft.observe(ttft)
            self.metrics.vllm.ttft.observe(ttft)
        else:
            self.metrics.itl.observe(now - last)
            self.metrics.vllm.itl.observe(now - last)
        self.last_token[request] = now

    def drafts(self, drafted: int, accepted: int) -> None:
        self.metrics.drafted.inc(drafted)
        self.metrics.accepted.inc(accepted)
        self.metrics.verify_steps.inc()

    def finished(self, request: Request, reason: str) -> None:
        self.arrived.pop(request, None)
        self.last_token.pop(request, None)
        self.metrics.requests.labels(reason).inc()

    def load(self, running: int, waiting: int, kv_blocks: int) -> None:
        self.queued(running, waiting)
        self.metrics.kv_blocks.set(kv_blocks)
        fraction = kv_blocks / self.capacity if self.capacity else 0.0
        self.metrics.vllm.kv_usage.set(fraction)
        self.metrics.vllm.gpu_cache_usage.set(fraction)

    def prefix_query(self, tokens: int) -> None:
        self.metrics.vllm.prefix_queries.inc(tokens)

    def prefix_hit(self, tokens: int) -> None:
        self.metrics.prefix_hit_tokens.inc(tokens)
        self.metrics.vllm.prefix_hits.inc(tokens)

    def prefix_cache(self, blocks: int, evicted: int) -> None:
        self.metrics.prefix_blocks.set(blocks)
        if evicted > self.evicted:
            self.metrics.prefix_evicted.inc(evicted - self.evicted)
            self.evicted = evicted
