"""deepinfer-serve on Ray Serve: two replicas against one under the same load, and prefix affinity.

    python bench/serve_replicas.py [--bundle build/tiny-serve] [--replica-requests 32] [--replica-clients 8] [--json]
    python bench/serve.py --replicas        # the same figures in bench/serve.py's JSON

Starts `deepinfer-serve BUNDLE --ray-serve local` (a Ray cluster of this machine) twice, with one
replica and with two, each replica's server on `--threads` torch threads, and sends the same
`--replica-requests` streaming prompts through `--replica-clients` concurrent clients to each (generated tokens/s
over the wall time): `replicas_2_over_1_throughput`, reported with the machine's core count (two
replicas can only go faster where the cores are free for both). Then, on the two replicas,
`--conversations` conversations of `--turns` turns each, every turn repeating its conversation's
opening (its own 64 token ids, 4 blocks of 16) before a new line: `prefix_affinity_hit_rate` is the
share of the turns after the first that report their opening's tokens as `cached_tokens` (they
reached the replica holding the conversation), turns interleaved across conversations.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path

from common import ROOT, ensure_bundle, share_inductor_cache

from deepinfer.runtime.serving.server_process import RayServeProcess, free_port

share_inductor_cache()

MODEL = "tiny"
START_TIMEOUT_S = 900
OPENING = 64  # token ids a conversation repeats each turn: 4 blocks of 16


def affinity(url: str, conversations: int, turns: int) -> dict:
    """`conversations` x `turns` requests, turn by turn across the conversations, each repeating its
    conversation's opening -> the share of later turns that found it cached."""
    from serve import stream

    rng = random.Random(0)
    openings = [[rng.randrange(3, 250) for _ in range(OPENING)] for _ in range(conversations)]
    hits = later = 0
    for turn in range(turns):
        for opening in openings:
            out = stream(url, opening + [rng.randrange(3, 250) for _ in range(8)], 2)
            if turn:
                later += 1
                hits += out["cached"] >= OPENING
    return {
        "conversations": conversations,
        "turns": turns,
        "later_turns": later,
        "hits": hits,
        "hit_rate": hits / later,
    }


def measure(args) -> dict:
    """Throughput at 1 and 2 replicas under the same load, then the affinity workload on 2."""
    from serve import PROMPTS, level

    ensure_bundle(args.bundle, args.toml)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.replica_requests)]
    out: dict = {"cores": os.cpu_count(), "cores_usable": len(os.sched_getaffinity(0)), "levels": {}}
    for n in (1, 2):
        e = RayServeProcess(
            args.bundle,
            "local",
            n,
            free_port(),
            "--model-name",
            MODEL,
            "--threads",
            str(args.threads),
            "--max-queue",
            "256",
            start_timeout_s=START_TIMEOUT_S,
        )
        try:
            level(e.url, args.replica_clients, PROMPTS, 4)  # warm-up: every replica, every bucket
            out["levels"][n] = level(e.url, args.replica_clients, prompts, args.max_tokens)
            if n == 2:
                out["affinity"] = affinity(e.url, args.conversations, args.turns)
        finally:
            e.stop()
    one, two = (out["levels"][n]["tokens_per_s"] for n in (1, 2))
    out["replicas_2_over_1_throughput"] = two / one
    out["prefix_affinity_hit_rate"] = out["affinity"]["hit_rate"]
    return out


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--replica-requests", type=int, default=32, help="requests of the throughput load")
    ap.add_argument("--replica-clients", type=int, default=8, help="its concurrent streaming clients")
    ap.add_argument("--conversations", type=int, default=8, help="conversations of the affinity workload")
    ap.add_argument("--turns", type=int, default=4, help="turns of each")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path, default=ROOT / "build" / "tiny-serve")
    ap.add_argument("--toml", type=Path, default=ROOT / "examples" / "tiny" / "model_serve.toml")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="each replica's torch threads")
    add_arguments(ap)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    out = measure(args)
    print(json.dumps(out, indent=1) if args.json else summary(out))


def summary(out: dict) -> str:
    """The readable table of `measure`'s figures."""
    lines = [f"{'replicas':>9}{'tok/s':>9}{'TTFT p50':>10}{'ITL p50':>9}  (ms; {out['cores_usable']} usable cores)"]
    for n, r in out["levels"].items():
        lines.append(f"{n:>9}{r['tokens_per_s']:>9.1f}{r['ttft_p50_ms']:>10.1f}{r['itl_p50_ms']:>9.1f}")
    a = out["affinity"]
    lines.append(
        f"replicas_2_over_1_throughput {out['replicas_2_over_1_throughput']:.2f} (target >= 1.5 where the cores "
        f"allow); prefix_affinity_hit_rate {a['hits']}/{a['later_turns']} = {a['hit_rate']:.2f} (target >= 0.9)"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
