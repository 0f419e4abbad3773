"""deepinfer-serve under concurrent streaming clients, against one request at a time, in one run.

    python bench/serve.py [--bundle build/tiny-serve] [--requests 16] [--max-tokens 32] [--json]
                          [--structured-clients 4] [--repeats 3] [--structured-only]

Starts `deepinfer-serve` on the tiny AOTInductor bundle (compiled from
examples/tiny/model_serve.toml when --bundle does not exist: batch buckets 1 and 8,
prompt chunks of 8), then sends the same `--requests` prompts through 1 (the
baseline: one request at a time), 4 and 8 concurrent streaming clients. Each
level reports generated tokens/s over its wall time, time to first token and the
gaps between streamed chunks (inter-token latency; a chunk is one token unless a
multi-byte character spans two) as p50/p99, measured by the clients. Then a burst
of `--burst` requests at once: every one must come back exactly once, and the
server's RSS (from /proc) afterwards is compared with its idle figure before the
burst. Clients are plain http.client threads, light next to the server.

Prefix caching: `--prefix-requests` requests of 120 token ids (`--prefix-len`) sharing their first
96 (`--shared`, 80%) go one
at a time after one request that fills the cache with that prefix, against as many requests of
the same length with prefixes of their own (misses); `ttft_shared_prefix_cached_over_uncached` is
the ratio of their median times to first token (target <= 0.4), each request's
`usage.prompt_tokens_details.cached_tokens` checked (96 on a hit, 0 on a miss). `--prefix-only`
runs just that; `--cp2` runs it on a cp = ep = 2 bundle too (`--bundle-cp2`, compiled from
examples/tiny/model_serve_cp2.toml when absent), `ttft_shared_prefix_cached_over_uncached_cp2`.

Structured output: the same prompts through `--structured-clients` concurrent clients twice, plain
and with a JSON schema (`response_format`; one string property the model fills until `max_tokens`,
so both runs generate as many tokens), `--repeats` times alternated. Their inter-token latency is
the server's (`deepinfer_inter_token_latency_seconds` over the run: its sum over its count), per
token: the clients' chunk gaps would not compare, as the random model's free text holds many
partial UTF-8 characters that wait for their next byte, and the JSON's strings fewer.
`structured_over_plain_itl` is the median over the repeats of the constrained run's mean over the
plain one's (issue 32's target: at most 1.1). `--structured-only` runs just these.

`--replicas`: only the endpoint on Ray Serve, one replica against two under the same load, and the
prefix affinity of conversations over two (bench/serve_replicas.py: `replicas_2_over_1_throughput`,
`prefix_affinity_hit_rate`).
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlparse

import serve_replicas
from common import ROOT, ensure_bundle, percentile, server_metrics, share_inductor_cache, status_kib

share_inductor_cache()

MODEL = "tiny"
PROMPTS = [
    "Hello, world",
    "The quick brown fox jumps over the lazy dog.",
    "abc",
    "1 + 1 =",
    "Once upon a time",
    "def main():",
    "GET / HTTP/1.1",
    "Dear Sir or Madam,",
]
LEVELS = (1, 4, 8)
TIMEOUT_S = 600
# one unbounded string: a constrained request runs to max_tokens as a plain one does (same load)
STRUCTURED_FORMAT = {
    "type": "json_schema",
    "json_schema": {
        "name": "note",
        "schema": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
    },
}


def stream(url: str, prompt: str | list[int], max_tokens: int, extra: dict | None = None) -> dict:
    """One streamed completion (`extra`: more body fields): {"sent", "chunks": [arrival times], "tokens",
    "cached", "id", "finish"}."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=TIMEOUT_S)
    body = json.dumps(
        {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            **(extra or {}),
        }
    )
    sent = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:200]!r}")
    out = {"sent": sent, "chunks": [], "tokens": 0, "cached": None, "id": None, "finish": None}
    for line in resp:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        event = json.loads(line[6:])
        out["id"] = event["id"]
        if event.get("usage"):
            out["tokens"] = event["usage"]["completion_tokens"]
            out["cached"] = (event["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
        for choice in event.get("choices", []):
            if choice["text"]:
                out["chunks"].append(time.perf_counter())
            if choice["finish_reason"]:
                out["finish"] = choice["finish_reason"]
    conn.close()
    return out


def level(url: str, clients: int, prompts: list[str], max_tokens: int, extra: dict | None = None) -> dict:
    """`prompts` through `clients` concurrent streaming clients."""
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda p: stream(url, p, max_tokens, extra), prompts))
    wall = time.perf_counter() - start
    tokens = sum(r["tokens"] for r in results)
    ttft = [(r["chunks"][0] - r["sent"]) * 1e3 for r in results if r["chunks"]]
    itl = [(b - a) * 1e3 for r in results for a, b in zip(r["chunks"], r["chunks"][1:])]
    return {
        "clients": clients,
        "requests": len(results),
        "generated_tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p99_ms": percentile(ttft, 99),
        "itl_p50_ms": percentile(itl, 50),
        "itl_p99_ms": percentile(itl, 99),
    }


PREFIX_LEN, SHARED = 120, 96  # token ids per prompt; shared by the cached ones (80%)


def shared_prefix(url: str, requests: int, length: int = PREFIX_LEN, shared: int = SHARED, max_tokens: int = 4) -> dict:
    """TTFT of requests sharing a cached prompt prefix against requests of the same length that miss
    (prefixes of their own), one at a time, alternating, so both see the same server."""
    rng = random.Random(0)

    def ids(n: int) -> list[int]:
        return [rng.randrange(3, 250) for _ in range(n)]

    prefix = ids(shared)
    stream(url, prefix + ids(length - shared), max_tokens)  # fills the cache with the prefix
    cached, uncached = [], []
    for _ in range(requests):
        miss = stream(url, ids(length), max_tokens)
        hit = stream(url, prefix + ids(length - shared), max_tokens)
        if (hit["cached"], miss["cached"]) != (shared, 0):
            raise RuntimeError(f"cached_tokens {hit['cached']} on a hit, {miss['cached']} on a miss")
        uncached.append((miss["chunks"][0] - miss["sent"]) * 1e3)
        cached.append((hit["chunks"][0] - hit["sent"]) * 1e3)
    return {
        "requests": requests,
        "prompt_tokens": length,
        "shared_tokens": shared,
        "ttft_cached_p50_ms": statistics.median(cached),
        "ttft_uncached_p50_ms": statistics.median(uncached),
        "ttft_shared_prefix_cached_over_uncached": statistics.median(cached) / statistics.median(uncached),
    }


def prefix_at_ranks(args) -> dict:
    """`shared_prefix` on the cp = ep = 2 bundle (`--bundle-cp2`, compiled from `--toml-cp2` when
    absent): deepinfer-serve leads its follower, the slot states saved on both ranks."""
    from deepinfer.runtime.serving.server_process import ServerProcess

    ensure_bundle(args.bundle_cp2, args.toml_cp2)
    server = ServerProcess(args.bundle_cp2, "--model-name", MODEL, "--threads", str(args.threads))
    try:
        level(server.url, 2, PROMPTS, 4)  # warm-up
        return {**shared_prefix(server.url, args.prefix_requests, args.prefix_len, args.shared), "ranks": 2}
    finally:
        server.stop()


def server_itl(url: str) -> tuple[float, float]:
    """The server's inter-token latency histogram so far: (sum of seconds, count)."""
    samples = server_metrics(url, TIMEOUT_S)
    if samples is None:
        raise RuntimeError(f"{url}/metrics did not answer")
    name = "deepinfer_inter_token_latency_seconds"
    return samples[f"{name}_sum"], samples[f"{name}_count"]


def measured(url: str, clients: int, prompts: list[str], max_tokens: int, extra: dict | None = None) -> dict:
    """`level`, with the server's mean inter-token latency over it (`server_itl_ms`)."""
    s0, n0 = server_itl(url)
    out = level(url, clients, prompts, max_tokens, extra)
    s1, n1 = server_itl(url)
    out["server_itl_ms"] = (s1 - s0) / max(1.0, n1 - n0) * 1e3
    return out


def rss_mib(pid: int) -> float:
    kib = status_kib("VmRSS", pid)
    if not kib:
        raise RuntimeError(f"no VmRSS for process {pid}")
    return kib / 1024


def burst(url: str, pid: int, n: int, max_tokens: int) -> dict:
    """`n` requests at once (the queue holds them); each must come back once; RSS before and after."""
    idle = rss_mib(pid)
    barrier = threading.Barrier(n, timeout=TIMEOUT_S)

    def one(i: int) -> dict:
        barrier.wait()
        return stream(url, PROMPTS[i % len(PROMPTS)], max_tokens)

    start = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(one, range(n)))
    wall = time.perf_counter() - start
    time.sleep(1.0)  # the engine's last step and the server's last writes
    after = rss_mib(pid)
    ids = [r["id"] for r in results]
    return {
        "requests": n,
        "completed": sum(r["finish"] is not None for r in results),
        "unique_ids": len(set(ids)),
        "wall_s": wall,
        "rss_idle_mib": idle,
        "rss_after_mib": after,
        "rss_ratio": after / idle,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path, default=ROOT / "build" / "tiny-serve")
    ap.add_argument("--toml", type=Path, default=ROOT / "examples" / "tiny" / "model_serve.toml")
    ap.add_argument("--requests", type=int, default=16, help="requests per level (the same prompts at each)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--burst", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1, help="the server's torch threads")
    ap.add_argument("--prefix-requests", type=int, default=8, help="requests of each kind for the prefix cache")
    ap.add_argument("--prefix-len", type=int, default=PREFIX_LEN, help="token ids per prefix-cache prompt")
    ap.add_argument("--shared", type=int, default=SHARED, help="of them shared (a multiple of the bundle's block size)")
    ap.add_argument("--prefix-only", action="store_true", help="only the prefix cache's measurement")
    ap.add_argument("--cp2", action="store_true", help="the prefix cache's measurement on a cp = ep = 2 bundle too")
    ap.add_argument("--bundle-cp2", type=Path, default=ROOT / "build" / "tiny-serve-cp2")
    ap.add_argument("--toml-cp2", type=Path, default=ROOT / "examples" / "tiny" / "model_serve_cp2.toml")
    ap.add_argument("--structured-clients", type=int, default=4, help="concurrent clients of the structured run")
    ap.add_argument("--structured-only", action="store_true", help="only the plain and structured runs")
    ap.add_argument("--repeats", type=int, default=3, help="plain and structured runs, alternated")
    ap.add_argument(
        "--replicas", action="store_true", help="only two replicas against one on Ray Serve (serve_replicas.py)"
    )
    serve_replicas.add_arguments(ap)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.replicas:  # replicas_2_over_1_throughput and prefix_affinity_hit_rate (issue 45)
        out = serve_replicas.measure(args)
        print(json.dumps(out, indent=1) if args.json else serve_replicas.summary(out))
        return

    from deepinfer.runtime.serving.server_process import ServerProcess

    ensure_bundle(args.bundle, args.toml)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]
    server = ServerProcess(
        args.bundle,
        "--model-name",
        MODEL,
        "--threads",
        str(args.threads),
        "--max-queue",
        str(max(args.burst, args.requests)),
    )
    try:
        level(server.url, 8, PROMPTS, 4)  # warm-up: every bucket once
        prefix = None
        if not args.structured_only:
            prefix = shared_prefix(server.url, args.prefix_requests, args.prefix_len, args.shared)
        structured: dict = {"plain": [], "json_schema": []}
        levels, burst_out = {}, None
        if not args.prefix_only:
            level(server.url, 8, PROMPTS, 4, {"response_format": STRUCTURED_FORMAT})  # and the grammar engine
            c, fmt = args.structured_clients, {"response_format": STRUCTURED_FORMAT}
            for _ in range(args.repeats):  # alternated, so that a neighbour's load falls on both alike
                structured["plain"].append(measured(server.url, c, prompts, args.max_tokens))
                structured["json_schema"].append(measured(server.url, c, prompts, args.max_tokens, fmt))
        if not (args.prefix_only or args.structured_only):
            levels = {c: level(server.url, c, prompts, args.max_tokens) for c in LEVELS}
            burst_out = burst(server.url, server.pid, args.burst, 8)
    finally:
        status = server.stop()
    prefix_cp2 = prefix_at_ranks(args) if args.cp2 else None
    out = {
        "bundle": str(args.bundle),
        "max_tokens": args.max_tokens,
        "server_threads": args.threads,
        "levels": levels,
        "burst": burst_out,
        "prefix_cache": prefix,
        "prefix_cache_cp2": prefix_cp2,
        "server_exit": status,
        "ttft_shared_prefix_cached_over_uncached": prefix["ttft_shared_prefix_cached_over_uncached"]
        if prefix
        else None,
        "ttft_shared_prefix_cached_over_uncached_cp2": prefix_cp2["ttft_shared_prefix_cached_over_uncached"]
        if prefix_cp2
        else None,
        "structured": structured,
        # the median over the repeats of (structured / plain server ITL), each pair run back to back
        "structured_over_plain_itl": statistics.median(
            s["server_itl_ms"] / p["server_itl_ms"] for p, s in zip(structured["plain"], structured["json_schema"])
        )
        if structured["plain"]
        else None,
    }
    if levels:
        out["throughput_ratio_8_over_1"] = levels[8]["tokens_per_s"] / levels[1]["tokens_per_s"]
        out["itl_p99_ms_8"] = levels[8]["itl_p99_ms"]
    if args.json:
        print(json.dumps(out, indent=1))
        return
    for suffix, p in (("", prefix), ("_cp2", prefix_cp2)):
        if p:
            print(
                f"prefix cache{' at cp = ep = 2' if suffix else ''}: {p['requests']} requests of {p['prompt_tokens']} "
                f"tokens sharing {p['shared_tokens']}: TTFT p50 {p['ttft_cached_p50_ms']:.1f} ms cached, "
                f"{p['ttft_uncached_p50_ms']:.1f} ms uncached (ttft_shared_prefix_cached_over_uncached{suffix} "
                f"{p['ttft_shared_prefix_cached_over_uncached']:.2f}, target <= 0.4)"
            )
    print(f"{'clients':>14}{'tok/s':>9}{'tokens':>8}{'TTFT p50':>10}{'p99':>8}{'ITL p50':>9}{'p99':>8}  (ms)")
    rows = [(str(c), r) for c, r in levels.items()]
    c = args.structured_clients
    rows += [(f"{c} {name[:5]} {i}", r) for name, runs in structured.items() for i, r in enumerate(runs)]
    for name, r in rows:
        print(
            f"{name:>14}{r['tokens_per_s']:>9.1f}{r['generated_tokens']:>8}{r['ttft_p50_ms']:>10.1f}"
            f"{r['ttft_p99_ms']:>8.1f}{r['itl_p50_ms']:>9.1f}{r['itl_p99_ms']:>8.1f}"
        )
    for name, runs in structured.items():
        print(f"{name}: server ITL (ms) " + ", ".join(f"{r['server_itl_ms']:.2f}" for r in runs))
    if out["structured_over_plain_itl"] is not None:
        print(f"structured over plain, server ITL: {out['structured_over_plain_itl']:.3f} (target <= 1.1)")
    b = burst_out
    if b is not None:
        print(
            f"throughput 8 / 1: {out['throughput_ratio_8_over_1']:.2f}x; burst of {b['requests']}: {b['completed']} "
            f"completed, {b['unique_ids']} distinct ids; RSS {b['rss_idle_mib']:.1f} -> {b['rss_after_mib']:.1f} MiB "
            f"({(b['rss_ratio'] - 1) * 100:+.1f}%)"
        )
    if status != 0:
        sys.exit(f"the server exited with status {status}")


if __name__ == "__main__":
    main()
