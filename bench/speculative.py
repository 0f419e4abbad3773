"""Speculative decoding on the tiny AOTInductor bundle at ep = 2: plain decode against verify steps.

    python bench/speculative.py [--bundle build/tiny-spec-ep2] [--new-tokens 61] [--repeats 3] [--json]
    python bench/speculative.py --executable exported --bundle build/tiny-spec-ep2-exported  # no C++ compile
    python bench/speculative.py --toml examples/tiny/speculative.toml --bundle build/tiny-spec   # one rank

On one bundle (compiled from examples/tiny/speculative_ep2.toml when --bundle does not exist:
buckets tokens 1, 6 and 8, two ranks with the draft's experts divided over them), its ranks started
once (this process leads, a follower process per other rank), best of `repeats` for one prompt:

    plain         greedy decoding, one token a step: seconds per decode step
    all accepted  the test double that drafts the plain run's own continuation
                  (regions/speculative.py): every verify step is 6 tokens and keeps them all
    corrupting    the double that replaces one drafted token of each block (a random offset, seeded):
                  the target keeps the drafts before it, then its own token
    dspark        the checkpoint's own tiny DSpark draft, compiled into the bundle
                  ([speculative] draft; random weights: it accepts next to nothing)

Reported: decode and verify step times and their ratio (`verify_over_decode_step`, target at
most 2.0), tokens per verify step, accepted and wasted drafts per verify step and tokens/s per
drafter, and the speedups over plain decoding (`tokens_per_step_all_accepted` at least 5,
`speedup_all_accepted` at least 2.5; `tokens_per_step_corrupting` against the 2.78 of the
loop that fed a rejected block's accepted tokens again, measured on this bundle's one-rank form).
Times are the decode phase only: a run of `new_tokens` minus a run of one token (the prompt).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from common import ROOT, ensure_bundle, share_inductor_cache

share_inductor_cache()

PROMPT = "The quick brown fox jumps over the lazy dog."
TARGETS = {"verify_over_decode_step": 2.0, "tokens_per_step_all_accepted": 5, "speedup_all_accepted": 2.5}
REFED_CORRUPTING = 2.78  # tokens per verify step of the corrupting double (seed 0) when accepted tokens were fed again


def decode_seconds(generate, new_tokens: int) -> float:
    """Seconds of the decode phase: a run of new_tokens minus a run of the prompt alone."""
    start = time.perf_counter()
    generate(1)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    generate(new_tokens)
    return time.perf_counter() - start - prefill


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path, default=ROOT / "build" / "tiny-spec-ep2")
    ap.add_argument("--toml", type=Path, default=ROOT / "examples" / "tiny" / "speculative_ep2.toml")
    ap.add_argument(
        "--executable",
        choices=["aoti", "exported"],
        default="aoti",
        help="executable kind of a bundle compiled here (the toml's is aoti)",
    )
    ap.add_argument("--new-tokens", type=int, default=61, help="tokens per run (61: 1 + 10 blocks of 6)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from deepinfer.runtime import RunOptions, load
    from deepinfer.runtime.bundle import open_bundle
    from deepinfer.runtime.ranks import Leader

    ensure_bundle(args.bundle, args.toml, args.executable)
    world = open_bundle(args.bundle).manifest.topology.world_size
    leader = Leader(args.bundle, world, RunOptions(threads=1)) if world > 1 else None
    session = leader.executor if leader is not None else load(args.bundle)
    try:
        out = measure(session, world, args)
    finally:
        if leader is not None:
            leader.close()
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{'figure':34s} value")
        for k, v in out.items():
            print(f"{k:34s} {v}")


def measure(session, world: int, args) -> dict:
    """Every drafter's decode phase on the loaded leader `session`, best of args.repeats."""
    import torch

    from deepinfer.regions.speculative import AllAcceptedDraftDouble, OneRejectedDraftDouble
    from deepinfer.regions.tokenizer import ByteTokenizer
    from deepinfer.runtime import Stats
    from deepinfer.runtime.schedule import decode

    block = session.config.text.dspark_block_size
    if block + 1 not in session.sizes.token_sizes:
        sys.exit(f"{args.bundle}: no tokens bucket of {block + 1} (the verify step); compile with tokens including it")
    if session.manifest.draft is None:
        sys.exit(f"{args.bundle}: compiled without the draft; recompile it from {args.toml} ([speculative] draft)")
    prompt = ByteTokenizer().encode(PROMPT)
    n, eos, vocab = args.new_tokens, session.config.eos_token_id, session.config.text.vocab_size

    def run(k: int, drafter=None):
        with torch.inference_mode():
            return decode(session.steps(Stats()), [prompt], k, eos=eos, drafter=drafter)

    plain = run(n)
    drafters = {
        "all_accepted": lambda: AllAcceptedDraftDouble(plain, block),
        "corrupting": lambda: OneRejectedDraftDouble(plain, block, vocab, seed=0),
        "dspark": lambda: session.dspark(Stats()),
    }
    best = {"plain": float("inf")} | {k: float("inf") for k in drafters}
    stats = {}
    for _ in range(args.repeats):
        best["plain"] = min(best["plain"], decode_seconds(run, n))
        for name, make in drafters.items():
            drafter = make()
            best[name] = min(best[name], decode_seconds(lambda k, d=drafter: run(k, d), n))
            got = run(n, make())
            assert got[0].tokens == plain[0].tokens, f"{name}: speculative output differs from plain"
            stats[name] = got.speculation
    decode_step = best["plain"] / (n - 1)
    verify_step = best["all_accepted"] / stats["all_accepted"].verify_steps
    out = {
        "bundle": str(args.bundle),
        "ranks": world,
        "new_tokens": n,
        "block": block,
        "decode_step_ms": round(decode_step * 1e3, 3),
        "verify_step_ms": round(verify_step * 1e3, 3),
        "verify_over_decode_step": round(verify_step / decode_step, 3),
        "tokens_per_s_plain": round((n - 1) / best["plain"], 1),
    }
    for name in drafters:
        s = stats[name]
        out[f"tokens_per_step_{name}"] = round(s.tokens_per_step, 3)
        out[f"accepted_per_step_{name}"] = round(s.accepted / max(1, s.verify_steps), 3)
        out[f"wasted_per_step_{name}"] = round((s.drafted - s.accepted) / max(1, s.verify_steps), 3)
        out[f"tokens_per_s_{name}"] = round((n - 1) / best[name], 1)
        out[f"speedup_{name}"] = round(best["plain"] / best[name], 3)
    out["corrupting_over_refed"] = round(out["tokens_per_step_corrupting"] / REFED_CORRUPTING, 3)
    out["targets_met"] = (
        out["verify_over_decode_step"] <= TARGETS["verify_over_decode_step"]
        and out["tokens_per_step_all_accepted"] >= TARGETS["tokens_per_step_all_accepted"]
        and out["speedup_all_accepted"] >= TARGETS["speedup_all_accepted"]
        and out["corrupting_over_refed"] >= 1.3
    )
    return out


if __name__ == "__main__":
    main()
