"""Decode speed of a compiled tiny bundle against the eager reference, side by side.

    python bench/decode.py [--bundle build/tiny] [--new-tokens 32] [--repeats 3] [--json]

Both run the same prompts in this process, alternating, best of `repeats`:
time per decode step (one token for each sequence of a batch) and per prompt
token, their ratios, and the runtime's own overhead per region call (argument
lists and lookups around each executable call). Compiles the bundle from
examples/tiny/model.toml first when --bundle does not exist.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from common import ROOT, ensure_bundle, share_inductor_cache, timing_options, torch_threads

share_inductor_cache()

PROMPTS = ["Hello, world", "The quick brown fox jumps over the lazy dog.", "abc", "1 + 1 ="]


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(generate, prompts, new_tokens: int) -> tuple[float, float]:
    """(seconds per decode step, seconds per prompt token) from two runs of `generate`."""
    prefill = timed(lambda: generate(prompts, 1))
    full = timed(lambda: generate(prompts, new_tokens))
    steps = new_tokens - 1
    return (full - prefill) / steps, prefill / sum(len(p) for p in prompts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path, default=ROOT / "build" / "tiny")
    ap.add_argument("--toml", type=Path, default=ROOT / "examples" / "tiny" / "model.toml")
    ap.add_argument("--new-tokens", type=int, default=32)
    timing_options(ap, "torch threads for both (default: torch's)")
    args = ap.parse_args()

    import torch

    threads = torch_threads(args.threads)

    from deepinfer.compiler.config import load_compile_config
    from deepinfer.regions.reference import ReferenceModel
    from deepinfer.regions.tokenizer import ByteTokenizer
    from deepinfer.runtime import RunOptions, load
    from deepinfer.runtime.generation import generate_loaded
    from deepinfer.runtime.schedule import decode_model

    ensure_bundle(args.bundle, args.toml)
    session = load(args.bundle)
    m = session.manifest.model
    ckpt = load_compile_config(args.toml).model.checkpoint
    ref = ReferenceModel(ckpt, dtype=m.dtype, cache_quant=m.cache_quant, ties="lowest")
    tok = ByteTokenizer()
    batch = max(session.sizes.batch_sizes)
    prompts = [tok.encode(p) for p in PROMPTS][:batch]
    best = {"bundle": (float("inf"), float("inf")), "eager": (float("inf"), float("inf"))}
    with torch.inference_mode():
        for _ in range(args.repeats):
            bundle = lambda ps, n: generate_loaded(session, ps, RunOptions(max_new_tokens=n))  # noqa: E731
            eager = lambda ps, n: decode_model(ref, ps, n)  # noqa: E731
            for name, gen in (("bundle", bundle), ("eager", eager)):
                step, token = measure(gen, prompts, args.new_tokens)
                best[name] = (min(best[name][0], step), min(best[name][1], token))
    s = generate_loaded(session, prompts, RunOptions(max_new_tokens=args.new_tokens)).stats
    calls = sum(s.calls.values())
    result = {
        "prompts": len(prompts),
        "new_tokens": args.new_tokens,
        "threads": threads,
        "bundle_step_ms": best["bundle"][0] * 1e3,
        "eager_step_ms": best["eager"][0] * 1e3,
        "step_ratio_bundle_over_eager": best["bundle"][0] / best["eager"][0],
        "bundle_prompt_token_ms": best["bundle"][1] * 1e3,
        "eager_prompt_token_ms": best["eager"][1] * 1e3,
        "prompt_ratio_bundle_over_eager": best["bundle"][1] / best["eager"][1],
        "overhead_us_per_call": s.overhead / calls * 1e6,
        "region_calls": calls,
        "executable_us_per_call": sum(s.seconds.values()) / calls * 1e6,
    }
    if args.json:
        print(json.dumps(result))
        return
    print(f"{'':28}{'bundle':>12}{'eager':>12}{'ratio':>8}")
    print(
        f"{'decode step (ms)':28}{result['bundle_step_ms']:>12.2f}{result['eager_step_ms']:>12.2f}"
        f"{result['step_ratio_bundle_over_eager']:>8.3f}"
    )
    print(
        f"{'prompt token (ms)':28}{result['bundle_prompt_token_ms']:>12.2f}{result['eager_prompt_token_ms']:>12.2f}"
        f"{result['prompt_ratio_bundle_over_eager']:>8.3f}"
    )
    print(
        f"runtime overhead {result['overhead_us_per_call']:.1f} us per region call "
        f"(executable {result['executable_us_per_call']:.0f} us); {len(prompts)} prompts, "
        f"{args.new_tokens} new tokens, {result['threads']} threads"
    )


if __name__ == "__main__":
    main()
