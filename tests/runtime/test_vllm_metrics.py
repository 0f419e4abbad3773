"""The series routers made for vLLM read (runtime/serving/metrics.py), under vLLM's names.

The engine over the counting model (tests/runtime/test_engine.py) for the counts, whose references are
the prompts' lengths and the blocks the allocator hands out; then a real deepinfer-serve process scraped
over HTTP under load, the `openai` client holding streams open, each documented name found with its
`model_name` label and a value that moves with the load."""

from __future__ import annotations

import re

import pytest

from deepinfer.runtime.requests import Request
from deepinfer.runtime.serving.engine import Engine
from deepinfer.runtime.serving.metrics import Metrics

from .test_prefix_cache import SlotCounting, run_alone

NAMES = (  # docs/serving.md, "Serving beyond one instance"
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
)


def vllm(engine: Engine, name: str) -> float:
    value = engine.metrics.registry.get_sample_value(name, {"model_name": "m"})
    assert value is not None, name
    return value


def test_load_usage_and_prefix_counts_move_with_the_engine():
    model = SlotCounting(chunk=6, block_size=4, blocks=17, max_blocks=8, slots=4)
    engine = Engine(model, eos=1, max_queue=4, prefix_cache=True, metrics=Metrics.new("m"))
    prompt = [5 + i % 20 for i in range(14)]
    run_alone(engine, prompt, 3)
    again = run_alone(engine, prompt[:10] + [7, 7, 7], 3)
    assert again.cached_tokens == 8
    assert vllm(engine, "vllm:prefix_cache_queries_total") == 14 + 13  # every admitted prompt's tokens
    assert vllm(engine, "vllm:prefix_cache_hits_total") == 8
    assert vllm(engine, "vllm:prompt_tokens_total") == engine.metrics.registry.get_sample_value(
        "deepinfer_prompt_tokens_total"
    )
    assert vllm(engine, "vllm:generation_tokens_total") == 6

    assert vllm(engine, "vllm:kv_cache_usage_perc") == 0  # the cached blocks nobody holds count as free
    engine.submit(Request([9] * 13, 8))
    engine.submit(Request([8] * 13, 8))
    assert vllm(engine, "vllm:num_requests_waiting") == 2 and vllm(engine, "vllm:num_requests_running") == 0
    engine.step()
    held = sum(len(t) for t in engine.scheduler.allocs[0].tables.values())  # each its first chunk's block
    assert held == 2 and vllm(engine, "vllm:num_requests_running") == 2
    assert vllm(engine, "vllm:num_requests_waiting") == 0
    assert vllm(engine, "vllm:kv_cache_usage_perc") == vllm(engine, "vllm:gpu_cache_usage_perc") == held / 16


@pytest.mark.slow
def test_a_served_bundle_exports_the_names_and_they_move_with_the_load(aoti_bundle):
    from .test_serve import MODEL, Server

    s = Server(aoti_bundle, "--max-queue", "4")
    try:
        client = s.client()

        def value(name: str) -> float:
            _, text = s.get("/metrics")
            found = re.search(rf'^{re.escape(name)}{{model_name="{MODEL}"}} (\S+)$', text, re.M)
            assert found, name
            return float(found.group(1))

        assert [value(name) for name in NAMES] == [0.0] * len(NAMES)
        running = [client.completions.create(model=MODEL, prompt="Hi", max_tokens=70, stream=True) for _ in range(4)]
        for stream in running:  # each has its first token: the batch of 4 is full
            next(iter(stream))
        waiting = client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, stream=True)
        s.wait_for(lambda: value("vllm:num_requests_waiting") == 1)
        assert value("vllm:num_requests_running") == 4 and 0 < value("vllm:kv_cache_usage_perc") <= 1
        assert value("vllm:generation_tokens_total") >= 4 and value("vllm:prompt_tokens_total") >= 12
        for stream in running:
            stream.close()
        list(waiting)
        s.wait_for(lambda: value("vllm:num_requests_running") == 0)
        assert value("vllm:kv_cache_usage_perc") == 0
        long = "The same system prompt for every turn. "  # 39 tokens of the byte tokenizer: 2 blocks of 16
        hits = value("vllm:prefix_cache_hits_total")
        first = client.completions.create(model=MODEL, prompt=long + "One", max_tokens=2)
        second = client.completions.create(model=MODEL, prompt=long + "Two", max_tokens=2)
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert cached > 0 and value("vllm:prefix_cache_hits_total") - hits == cached
        assert value("vllm:prefix_cache_queries_total") >= first.usage.prompt_tokens + second.usage.prompt_tokens
    finally:
        assert s.stop() == 0, s.proc.stderr.read()
