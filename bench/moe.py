"""Benchmark: the MoE region at the release's widths, against the rows of a step.

    python bench/moe.py                                   # 8 local experts, top-6, bf16; rows 1, 8, 64
    python bench/moe.py --experts 384 --ep 64 --time-rows 1,64   # one rank of the release: 6 local experts
    python bench/moe.py --experts 6 --rows 1,8,64 --time-rows 1,8 --dtype fp32 --json

For each row count (one step's tokens, B = rows, T = 1) the region is traced and
lowered for the cpu target exactly as the compiler does (compiler/trace.py, the cpu
target's reference inlining) and reports the budget's scratch figure
(`compiler/budget.scratch_bytes`, the peak of live intermediates, an upper bound)
and the lowered graph's node count. For the row counts in --time-rows it also runs
one call of the region eagerly on seeded random weights of the real shapes
(`regions/examples.random_weights`) and reports the best of --repeats: wall time and
the process's CPU time (all threads; steadier than wall time on a shared machine).

Hidden 5120 and moe_intermediate 2304 are the release's (regions/synthetic.py);
only the expert count is small: `--experts` routed experts, `--ep` ranks (the
region of rank 0 holds experts / ep of them; the release's ranks hold 384 / 64 = 6).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from common import timing_options, torch_threads


def rows_list(text: str) -> list[int]:
    try:
        return [int(r) for r in text.split(",") if r]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected row counts like 1,8,64") from None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=8, help="routed experts, all local (default 8)")
    ap.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (default 1: all experts local)")
    ap.add_argument("--rows", type=rows_list, default=[1, 8, 64], help="rows per step to trace (default 1,8,64)")
    ap.add_argument("--time-rows", type=rows_list, default=[1, 8, 64], help="rows per step to time (default 1,8,64)")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="activation dtype (default bf16)")
    timing_options(ap)
    args = ap.parse_args()

    import torch

    from deepinfer.bundles.topology import Topology
    from deepinfer.compiler import budget
    from deepinfer.compiler.targets.cpu import CpuTarget
    from deepinfer.compiler.trace import trace
    from deepinfer.regions.config import parse_config
    from deepinfer.regions.examples import example_inputs, random_weights
    from deepinfer.regions.moe import MoE
    from deepinfer.regions.state import Geometry
    from deepinfer.regions.step import DTYPES
    from deepinfer.regions.synthetic import synthetic_config

    threads = torch_threads(args.threads)
    c = parse_config(synthetic_config(experts=args.experts)).text
    dtype = DTYPES[args.dtype]
    geometry = Geometry(slots=2, blocks=2, block_size=16, max_blocks=1)
    with torch.device("meta"):
        meta = MoE(c, dtype=dtype, topo=Topology(ep=args.ep))
    region = meta.with_weights(random_weights(meta)) if args.time_rows else None
    result = {
        "experts": args.experts,
        "ep": args.ep,
        "local_experts": meta.w1.shape[0],
        "top_k": c.num_experts_per_tok,
        "hidden": c.hidden_size,
        "intermediate": c.moe_intermediate_size,
        "dtype": args.dtype,
        "threads": threads,
        "rows": [],
    }
    for rows in sorted(set(args.rows) | set(args.time_rows)):
        row = {"rows": rows}
        if rows in args.rows:
            ep, _ = trace(meta, rows, 1, geometry)
            lowered = CpuTarget().lower(ep)
            row["scratch_bytes"] = budget.scratch_bytes(lowered)
            row["nodes"] = sum(1 for n in lowered.graph.nodes if n.op == "call_function")
        if rows in args.time_rows:
            inputs = example_inputs(region.input_specs(rows, 1, geometry), geometry)
            best, best_cpu = float("inf"), float("inf")
            with torch.inference_mode():
                for _ in range(args.repeats):
                    start, start_cpu = time.perf_counter(), time.process_time()
                    region.decode(*inputs)
                    best = min(best, time.perf_counter() - start)
                    best_cpu = min(best_cpu, time.process_time() - start_cpu)
            row["call_ms"], row["cpu_ms"] = best * 1e3, best_cpu * 1e3
        result["rows"].append(row)
        print(json.dumps(row), file=sys.stderr)
    if args.json:
        print(json.dumps(result))
        return
    print(
        f"MoE region: {result['local_experts']} local experts of {args.experts}, top-{c.num_experts_per_tok}, hidden {c.hidden_size}, "
        f"intermediate {c.moe_intermediate_size}, {args.dtype}, {result['threads']} threads"
    )
    print(f"{'rows':>6}{'scratch':>14}{'nodes':>8}{'call ms':>10}{'cpu ms':>10}")
    for row in result["rows"]:
        scratch = budget.human(row["scratch_bytes"]) if "scratch_bytes" in row else "-"
        call = f"{row['call_ms']:.0f}" if "call_ms" in row else "-"
        cpu = f"{row['cpu_ms']:.0f}" if "cpu_ms" in row else "-"
        print(f"{row['rows']:>6}{scratch:>14}{row.get('nodes', '-'):>8}{call:>10}{cpu:>10}")


if __name__ == "__main__":
    main()
