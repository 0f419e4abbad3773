"""Benchmark: how deepinfer-compile scales with the number of layers.

    python bench/compile_scaling.py                          # aoti, 6/12/24 layers, bucket (1, 1)
    python bench/compile_scaling.py --executable exported    # no C++ compile: trace cost only
    python bench/compile_scaling.py --json                   # one JSON object on stdout (table on stderr)

Compiles tiny checkpoints of 6, 12 and 24 layers (`make_tiny(..., layers=N)`)
with the same buckets and prints, for each, the executables compiled and the
seconds of the compiler's passes: in total, and excluding "preprocess weights"
(the only pass whose work should grow with the layer count), with the ratios
against the first (smallest) layer count. Executables are one per (region kind,
method, bucket), so the targets are: the same executables at 24 layers as at
6, and a compile time excluding weights at 24 layers within 1.15x of 6's.

Each compile runs `deepinfer-compile --json` in a fresh process with its own
empty TORCHINDUCTOR_CACHE_DIR, so no run reuses another's compiled graphs
(TMPDIR, where AOTInductor keeps its precompiled header, is inherited).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from common import compile_json, toml_text

TARGET_RATIO = 1.15
WEIGHTS_PASS = "preprocess weights"


def parse_buckets(text: str) -> tuple[list[int], list[int]]:
    """'1,2:1,8' -> batch [1, 2], tokens [1, 8]."""
    try:
        batch, tokens = text.split(":")
        return [int(b) for b in batch.split(",")], [int(t) for t in tokens.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected BATCHES:TOKENS like 1:1 or 1,2:1,8") from None


def model_toml(checkpoint: Path, executable: str, batch: list[int], tokens: list[int]) -> dict:
    max_context = max(32, max(tokens))
    block_size = 16
    num_blocks = -(-max_context // block_size) * max(batch) + 1
    return {
        "model": {"checkpoint": checkpoint, "dtype": "fp32", "cache_quant": True},
        "target": {"name": "cpu", "executable": executable},
        "buckets": {"batch": batch, "tokens": tokens, "max_context": max_context},
        "kv": {"block_size": block_size, "num_blocks": num_blocks},
    }


def compile_once(work: Path, layers: int, args) -> dict:
    """Generate the tiny checkpoint, compile it in a fresh process; -> executables, kinds, seconds."""
    from deepinfer.regions.tiny import make_tiny

    ckpt = make_tiny(work / f"tiny{layers}", layers=layers)
    toml = work / f"model{layers}.toml"
    toml.write_text(toml_text(model_toml(ckpt, args.executable, args.batch, args.tokens)))
    out = work / f"bundle{layers}"
    # the compile's default cache, as `deepinfer-compile` alone uses
    summary = compile_json(
        toml, out, None, inductor=work / f"inductor{layers}", args=["--jobs", str(args.jobs)]
    ).summary
    from deepinfer.bundles import manifest_io

    manifest = manifest_io.read(out)
    passes = summary["seconds"]
    total = sum(passes.values())
    return {
        "executables": summary["executables"],
        "kinds": sorted({e.kind for e in manifest.regions}),
        "total_s": total,
        "excluding_weights_s": total - passes.get(WEIGHTS_PASS, 0.0),
        "passes": passes,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--layers",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[6, 12, 24],
        help="comma-separated layer counts (default 6,12,24); ratios are against the first",
    )
    ap.add_argument("--executable", choices=("aoti", "exported"), default="aoti")
    ap.add_argument("--jobs", type=int, default=1, help="parallel compile workers per bundle")
    ap.add_argument(
        "--buckets",
        type=parse_buckets,
        default=([1], [1]),
        metavar="BATCHES:TOKENS",
        help="decode buckets, e.g. 1,2:1,8 (default 1:1: a few minutes with aoti)",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args()
    args.batch, args.tokens = args.buckets

    runs = {}
    with tempfile.TemporaryDirectory(prefix="compile-scaling-") as tmp:
        for layers in args.layers:
            print(f"compiling {layers} layers ({args.executable}) ...", file=sys.stderr, flush=True)
            runs[layers] = compile_once(Path(tmp), layers, args)

    base = runs[args.layers[0]]
    for r in runs.values():
        r["ratio_total"] = r["total_s"] / base["total_s"]
        r["ratio_excluding_weights"] = r["excluding_weights_s"] / base["excluding_weights_s"]
    ratio_24 = same_24 = None
    if {6, 24} <= runs.keys():
        ratio_24 = runs[24]["excluding_weights_s"] / runs[6]["excluding_weights_s"]
        same_24 = runs[24]["kinds"] == runs[6]["kinds"] and runs[24]["executables"] == runs[6]["executables"]
    result = {
        "executable": args.executable,
        "jobs": args.jobs,
        "buckets": {"batch": args.batch, "tokens": args.tokens},
        "layers": args.layers,
        "executables": {str(n): r["executables"] for n, r in runs.items()},
        "kinds": {str(n): r["kinds"] for n, r in runs.items()},
        "seconds": {
            str(n): {
                "total": round(r["total_s"], 2),
                "excluding_weights": round(r["excluding_weights_s"], 2),
                "passes": {k: round(v, 3) for k, v in r["passes"].items()},
            }
            for n, r in runs.items()
        },
        "ratio_total": {str(n): round(r["ratio_total"], 3) for n, r in runs.items()},
        "ratio_excluding_weights": {str(n): round(r["ratio_excluding_weights"], 3) for n, r in runs.items()},
        "compile_ratio_24_over_6": None if ratio_24 is None else round(ratio_24, 3),
        "targets": {
            "executables_equal_24_6": same_24,
            "compile_ratio_24_over_6_max": TARGET_RATIO,
            "compile_ratio_met": None if ratio_24 is None else ratio_24 <= TARGET_RATIO,
        },
    }
    report(runs, args, base, ratio_24, same_24, file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(result))


def report(runs, args, base, ratio_24, same_24, file) -> None:
    """The table (on stderr with --json, so stdout holds only the JSON object)."""

    def say(line=""):
        print(line, file=file)

    say(
        f"deepinfer-compile scaling: executable={args.executable} jobs={args.jobs} "
        f"buckets batch={args.batch} tokens={args.tokens}"
    )
    say(f"{'layers':>6} {'executables':>11} {'total s':>9} {'excl. weights s':>15} {'x total':>8} {'x excl.':>8}")
    for n, r in runs.items():
        say(
            f"{n:>6} {r['executables']:>11} {r['total_s']:>9.1f} {r['excluding_weights_s']:>15.1f} "
            f"{r['ratio_total']:>7.2f}x {r['ratio_excluding_weights']:>7.2f}x"
        )
    for n, r in runs.items():
        extra = sorted(set(r["kinds"]) - set(base["kinds"]))
        if extra:
            say(f"  {n} layers: kinds not in {args.layers[0]} layers: {', '.join(extra)}")
    if ratio_24 is not None:
        say(
            f"targets: executables 24 == 6 layers: {'yes' if same_24 else 'NO'}; "
            f"compile excl. weights 24/6 = {ratio_24:.2f}x "
            f"({'within' if ratio_24 <= TARGET_RATIO else 'OVER'} {TARGET_RATIO}x)"
        )


if __name__ == "__main__":
    main()
