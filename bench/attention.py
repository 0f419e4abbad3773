"""Benchmark: one rank's compressed attention layer at the release's dimensions, replicated against divided.

    python bench/attention.py                      # a ratio-2 reuse layer, batch 1 and 8, bf16
    python bench/attention.py --json --repeats 5

Both forms are one rank of the release's layout at its real widths (hidden 5120, 64 heads of 512,
q_lora 1280, 8 output groups of 1024; synthetic weights of the real shapes and formats), each of
their methods traced, lowered for the cpu target and compiled with AOTInductor as the compiler
does, and timed side by side in one run (the best of --repeats of the whole layer, every method in
order):

    replicated   what a rank ran before heads were divided over the token group: every head's
                 projections (wq_b, wo_a, wo_b whole) and the attention over the K selected entries
                 (the one-rank region's `decode`: at cp = 64 a rank ran the same projections in its
                 attend and output stages)
    divided      the rank of EP = CP = 64 (compiler/step_reads.py counts what it reads): `query` (its
                 head's wq_b rows), `attend` (every head over the entries it gathers), `output` (its
                 128 rows of wo_a, its columns of wo_b)

A ratio-2 reuse layer is the release's most common (30 of 40 layers): it selects nothing itself, so
neither form scores index keys and the comparison is the projections' and the attention's. The
collectives between the divided stages are not run (a CPU has none of the device's links):
docs/ranks.md and `deepinfer plan` count them.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from common import timing_options, torch_threads

LAYER = 3  # the release-geometry model's ratio-2 reuse layer (regions/synthetic.release_geometry_config)


def compiled_methods(region, B: int, geometry, workdir: Path, tag: str):
    """Each of `region`'s methods at a [B, 1] step: (name, AOTInductor runner, its flat arguments)."""
    import torch

    from deepinfer.compiler.targets.cpu import CpuTarget
    from deepinfer.compiler.trace import concrete_inputs, trace
    from deepinfer.regions.examples import example_inputs, random_weights

    weights = random_weights(region)
    real = region.with_weights(weights)
    flat_weights = [t for _, t in real.named_buffers()]
    out = []
    for method in region.methods():
        ep, sig = trace(region, B, 1, geometry, method, dynamic=False)
        lowered = CpuTarget().lower(ep)
        concrete_inputs(lowered)
        package = workdir / f"{tag}.{method}.b{B}.pt2"
        torch._inductor.aoti_compile_and_package(lowered, package_path=str(package))
        runner = torch._inductor.aoti_load_package(str(package))
        out.append((method, runner, [*flat_weights, *example_inputs(sig.inputs, geometry)]))
    return out, sum(t.numel() * t.element_size() for name, t in weights.items() if name != "rank")


def best_of(methods, repeats: int) -> float:
    """The best wall time (ms) of every method once, in order, over `repeats` runs."""
    import torch

    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats + 1):  # the first run warms up
            start = time.perf_counter()
            for _, runner, args in methods:
                runner(*args)
            best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", default="1,8", help="batch sizes (default 1,8)")
    timing_options(ap)
    args = ap.parse_args()

    import torch

    from deepinfer.bundles.topology import Topology
    from deepinfer.regions.config import parse_config
    from deepinfer.regions.plan import make_attention
    from deepinfer.regions.state import Geometry
    from deepinfer.regions.step import plan_layers
    from deepinfer.regions.synthetic import release_geometry_config

    threads = torch_threads(args.threads)
    c = parse_config(release_geometry_config()).text
    p = plan_layers(c)[LAYER]
    assert p.attn == "reuse" and p.ratio == 2, p
    # K = 512 selected entries: 8 blocks of 64 compressed entries a sequence; 64 usable blocks over cp = 64
    geometry = Geometry(slots=9, blocks=65, block_size=128, max_blocks=8)
    forms = {"replicated": Topology(), "divided": Topology(ep=64, cp=64)}
    rows = []
    with tempfile.TemporaryDirectory(dir=Path(__file__).resolve().parent.parent / ".cache") as tmp:
        for B in [int(b) for b in args.batch.split(",")]:
            row: dict = {"batch": B}
            built = {}
            for name, topo in forms.items():
                with torch.device("meta"):
                    region = make_attention(c, p, torch.bfloat16, False, topo)
                built[name], row[f"{name}_weight_bytes"] = compiled_methods(region, B, geometry, Path(tmp), name)
                row[f"{name}_methods"] = [m for m, _, _ in built[name]]
            for name in forms:  # side by side: alternate the forms' runs
                row[f"{name}_ms"] = best_of(built[name], args.repeats)
            row["divided_over_replicated"] = row["divided_ms"] / row["replicated_ms"]
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    result = {
        "layer": f"ratio-{p.ratio} {p.attn} (release dims)",
        "threads": threads,
        "rows": rows,
        **{f"attention_b{r['batch']}_divided_over_replicated": r["divided_over_replicated"] for r in rows},
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(
        f"one rank's {result['layer']} attention layer, AOTInductor on CPU, {threads} threads, best of {args.repeats}"
    )
    print(f"{'batch':>6}{'replicated ms':>16}{'divided ms':>12}{'ratio':>8}{'replicated B':>16}{'divided B':>14}")
    for r in rows:
        print(
            f"{r['batch']:>6}{r['replicated_ms']:>16.2f}{r['divided_ms']:>12.2f}{r['divided_over_replicated']:>8.3f}"
            f"{r['replicated_weight_bytes']:>16,}{r['divided_weight_bytes']:>14,}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
