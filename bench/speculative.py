"""Speculative decoding on the tiny AOTInductor bundle: plain decode against verify steps.

    python bench/speculative.py [--bundle build/tiny-spec] [--new-tokens 61] [--repeats 3] [--json]
    python bench/speculative.py --executable exported --bundle build/tiny-spec-exported   # no C++ compile

In one process, on one bundle (compiled from examples/tiny/speculative.toml when --bundle does
not exist: buckets tokens 1, 6 and 8), best of `repeats` for one prompt at batch 1:

    plain         greedy decoding, one token a step: seconds per decode step
    all accepted  the test double that drafts the plain run's own continuation
                  (regions/speculative.py): every verify step is 6 tokens and keeps them all
    dspark        the checkpoint's own tiny DSpark draft, compiled into the bundle
                  ([speculative] draft; random weights: it accepts next to nothing)

Reported: decode and verify step times and their ratio (`verify_over_decode_step`, target at
most 2.0), tokens per verify step and tokens/s per draft, and the all-accepted speedup over
plain decoding (`tokens_per_step_all_accepted` at least 5, `speedup_all_accepted` at least 2.5).
Times are the decode phase only: a run of `new_tokens` minus a run of one token (the prompt).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(ROOT / ".cache" / "inductor"))

PROMPT = "The quick brown fox jumps over the lazy dog."
TARGETS = {"verify_over_decode_step": 2.0, "tokens_per_step_all_accepted": 5, "speedup_all_accepted": 2.5}


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
    ap.add_argument("--bundle", type=Path, default=ROOT / "build" / "tiny-spec")
    ap.add_argument("--toml", type=Path, default=ROOT / "examples" / "tiny" / "speculative.toml")
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

    import torch

    from deepinfer.compiler.config import load_compile_config
    from deepinfer.compiler.pipeline import compile_bundle
    from deepinfer.regions.speculative import AllAcceptedDraftDouble
    from deepinfer.regions.tokenizer import ByteTokenizer
    from deepinfer.runtime import RunOptions, Stats, load
    from deepinfer.runtime.executor import generate_loaded

    if not args.bundle.exists():
        print(f"compiling {args.toml} -> {args.bundle}", file=sys.stderr)
        config = load_compile_config(args.toml)
        target = dataclasses.replace(config.target, executable=args.executable)
        compile_bundle(dataclasses.replace(config, target=target), args.bundle, jobs=2)
    session = load(args.bundle)
    block = session.config.text.dspark_block_size
    if block + 1 not in session.sizes.token_sizes:
        sys.exit(
            f"{args.bundle}: no tokens bucket of {block + 1} (the verify step); compile with tokens "
            f"including {block + 1}"
        )
    if session.manifest.draft is None:
        sys.exit(f"{args.bundle}: compiled without the draft; recompile it from {args.toml} ([speculative] draft)")
    prompt = ByteTokenizer().encode(PROMPT)
    n = args.new_tokens

    def run(k: int, drafter=None):
        return generate_loaded(session, [prompt], RunOptions(max_new_tokens=k), drafter=drafter)

    with torch.inference_mode():
        plain = run(n)
        drafters = {
            "all_accepted": lambda: AllAcceptedDraftDouble(plain, block),
            "dspark": lambda: session.dspark(Stats()),
        }
        best = {"plain": float("inf")} | {k: float("inf") for k in drafters}
        stats = {}
        for _ in range(args.repeats):
            best["plain"] = min(best["plain"], decode_seconds(run, n))
            for name, make in drafters.items():
                drafter = make()
                seconds = decode_seconds(lambda k, d=drafter: run(k, d), n)
                best[name] = min(best[name], seconds)
                got = run(n, make())
                assert got[0].tokens == plain[0].tokens, f"{name}: speculative output differs from plain"
                stats[name] = got.speculation
    decode_step = best["plain"] / (n - 1)
    verify_step = best["all_accepted"] / stats["all_accepted"].verify_steps
    out = {
        "bundle": str(args.bundle),
        "new_tokens": n,
        "block": block,
        "decode_step_ms": round(decode_step * 1e3, 3),
        "verify_step_ms": round(verify_step * 1e3, 3),
        "verify_over_decode_step": round(verify_step / decode_step, 3),
        "tokens_per_s_plain": round((n - 1) / best["plain"], 1),
    }
    for name in drafters:
        out[f"tokens_per_step_{name}"] = round(stats[name].tokens_per_step, 3)
        out[f"tokens_per_s_{name}"] = round((n - 1) / best[name], 1)
        out[f"speedup_{name}"] = round(best["plain"] / best[name], 3)
    out["targets_met"] = (
        out["verify_over_decode_step"] <= TARGETS["verify_over_decode_step"]
        and out["tokens_per_step_all_accepted"] >= TARGETS["tokens_per_step_all_accepted"]
        and out["speedup_all_accepted"] >= TARGETS["speedup_all_accepted"]
    )
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:32s} {v}")


if __name__ == "__main__":
    main()
