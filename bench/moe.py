"""Benchmark: one rank's MoE layer at the release's dimensions, whole local experts against expert slices.

    python bench/moe.py                       # batch 1 and 8, a table
    python bench/moe.py --batches 1,8 --repeats 20 --json
    python bench/moe.py --rows 2048 --experts 48 --repeats 3   # a prompt chunk: grouped vs tiled

One rank of the release at EP = 64 (hidden 5120, moe_intermediate 2304, 384 routed experts,
top-6; regions/synthetic.py), its whole MoE site (mixes, norm, router, routed experts, shared
expert slice), in two layouts, each traced, lowered and compiled by AOTInductor as the cpu
target does (compiler/trace.py, `CpuTarget.lower`, `aoti_compile_and_package`) and run from
its package on seeded random weights of the real shapes and dtypes (fp4 codes with ue8m0
scales; `regions/examples.random_weights`):

- dense: today's layout, the rank's 6 whole experts (384 / 64), every one computed over the
  step's rows with dense routing weights (`kernels/linear.moe_experts` on [6, 2304, ...]);
- divided: a 36-column slice of all 384 experts (regions/topology.expert_slice_width), the
  rows' chosen slices gathered (`moe_gathered`) while rows x 6 < 384 (`moe_form`).

The two packages run alternately, call after call, in one process (the same machine state);
the best and the median of --repeats calls are reported, wall and process CPU time. Weight
bytes read per call: every weight of the layer the graph reads; the routed experts' part
for dense is the 6 whole experts, for divided rows x 6 gathered slices (the same under any
routing: the gather reads one slice per (row, choice), repeats included).

`--rows N` times a prompt chunk of N rows instead, the routed experts alone at one rank's shapes (a
36-column slice of each expert at EP = 64, hidden 5120; `--experts` fewer than the release's 384 to
fit the machine, never smaller hidden sizes), in the two static forms above the crossover, each op
run eagerly (its pure-torch reference) on seeded random weights and the router's own choices:

- grouped: every expert's slice over every row with dense routing weights (`moe_experts`);
- tiled: the N x 6 assignments grouped by expert in tiles of `regions/topology.moe_tile` rows, each
  tile one gathered slice (`moe_tiled`; the region's form above the crossover).

Printed per form: best and median wall time, the matmul FLOPs (2 a multiply-add, padding rows
included) over the useful ones (N x 6 slices' rows) and the routed weight bytes read (grouped: every
slice; tiled: its static tile count's gathered slices); `--json` adds `tiled_over_grouped_prompt`
(best time, tiled over grouped) and `tiled_flops_over_useful`.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

from common import share_inductor_cache, timing_options, torch_threads, work_dir

EP, ROWS_TOKENS = 64, 1  # the release's expert-parallel degree; one token a row (decode)


def batches_list(text: str) -> list[int]:
    try:
        return [int(b) for b in text.split(",") if b]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected batch sizes like 1,8") from None


def whole_experts_moe(c, dtype, topo):
    """Today's layout of an MoE rank: E / ep whole experts, grouped over every row each call."""
    import torch

    from deepinfer.kernels import linear  # noqa: F401  (registers the ops)
    from deepinfer.regions.base import fp4_specs
    from deepinfer.regions.moe import MoE, moe_specs

    class WholeExperts(MoE):
        def __init__(self):
            super().__init__(c, dtype=dtype, topo=topo)
            local, I, D = c.n_routed_experts // topo.ep, c.moe_intermediate_size, c.hidden_size
            whole = [
                *fp4_specs("w1", "ffn.experts.{e}.w1", I, D, local),
                *fp4_specs("w3", "ffn.experts.{e}.w3", I, D, local),
                *fp4_specs("w2", "ffn.experts.{e}.w2", D, I, local),
            ]
            by_name = {s.name: s for s in whole}
            self.specs = [by_name.get(s.name, s) for s in moe_specs(c, topo)]
            for s in whole:
                self.register_buffer(s.name, torch.zeros(s.buffer_shape, dtype=s.dtype))

        def routed(self, x, weights, experts):
            local = self.w1.shape[0]
            ids = torch.arange(local, device=x.device) + (self.rank % self.ep) * local
            dense = (weights.unsqueeze(-1) * (experts.unsqueeze(-1) == ids)).sum(1)  # [N, local]
            stacks = (self.w1, self.w1_s, self.w3, self.w3_s, self.w2, self.w2_s)
            return torch.ops.deepinfer.moe_experts(x, dense, *stacks, c.swiglu_limit)

    with torch.device("meta"):
        return WholeExperts()


def compiled(meta, batch: int, geometry, out: Path):
    """`meta` (a region of meta weights) traced for [batch, 1], lowered and compiled as the cpu target
    does -> (the loaded package's runner, the lowered graph)."""
    import torch

    from deepinfer.compiler.targets.cpu import CpuTarget
    from deepinfer.compiler.trace import concrete_inputs, trace

    ep, _ = trace(meta, batch, ROWS_TOKENS, geometry)
    lowered = CpuTarget().lower(ep)
    concrete_inputs(lowered)
    torch._inductor.aoti_compile_and_package(lowered, package_path=str(out))
    return torch._inductor.aoti_load_package(str(out)), lowered


def read_bytes(region, batch: int, divided: bool) -> tuple[int, int]:
    """(the routed experts' weight bytes one call reads, every other weight's) of `region`."""
    routed = other = 0
    for s in region.specs:
        n = math.prod(s.buffer_shape) * s.dtype.itemsize
        if s.name in ("w1", "w1_s", "w3", "w3_s", "w2", "w2_s"):
            routed += n // s.experts * batch * region.c.num_experts_per_tok if divided else n
        else:
            other += n
    return routed, other


def time_pair(runners: dict, inputs: dict, repeats: int) -> dict[str, dict[str, float]]:
    """Each runner called alternately `repeats` times (after one warm call each): best and median ms."""
    import torch

    walls: dict[str, list[float]] = {k: [] for k in runners}
    cpus: dict[str, list[float]] = {k: [] for k in runners}
    with torch.inference_mode():
        for name, run in runners.items():
            run(*inputs[name])
        for _ in range(repeats):
            for name, run in runners.items():
                start, start_cpu = time.perf_counter(), time.process_time()
                run(*inputs[name])
                walls[name].append((time.perf_counter() - start) * 1e3)
                cpus[name].append((time.process_time() - start_cpu) * 1e3)
    return {
        name: {
            "best_ms": min(walls[name]),
            "median_ms": statistics.median(walls[name]),
            "cpu_best_ms": min(cpus[name]),
        }
        for name in runners
    }


def measure(batches: list[int], repeats: int) -> dict:
    import torch

    from deepinfer.bundles.topology import Topology
    from deepinfer.compiler import budget
    from deepinfer.regions.config import parse_config
    from deepinfer.regions.examples import example_inputs, random_weights
    from deepinfer.regions.moe import MoE
    from deepinfer.regions.state import Geometry
    from deepinfer.regions.synthetic import synthetic_config
    from deepinfer.regions.topology import expert_slice_width, moe_form

    c = parse_config(synthetic_config(experts=384)).text
    topo, dtype = Topology(ep=EP), torch.bfloat16
    geometry = Geometry(slots=2, blocks=2, block_size=16, max_blocks=1)
    with torch.device("meta"):
        metas = {"dense": whole_experts_moe(c, dtype, topo), "divided": MoE(c, dtype=dtype, topo=topo)}
    weights = {k: random_weights(m, seed=1) for k, m in metas.items()}
    order = {k: [n for n, _ in m.named_buffers()] for k, m in metas.items()}
    result = {
        "experts": c.n_routed_experts,
        "ep": EP,
        "top_k": c.num_experts_per_tok,
        "hidden": c.hidden_size,
        "intermediate": c.moe_intermediate_size,
        "slice_width": expert_slice_width(c, topo),
        "dense_local_experts": metas["dense"].w1.shape[0],
        "dtype": "bf16",
        "repeats": repeats,
        "batches": [],
    }
    with work_dir("bench-moe-") as tmp:
        for batch in batches:
            runners, inputs, row = {}, {}, {"batch": batch, "form": moe_form(batch, c.num_experts_per_tok, 384)}
            step = example_inputs(metas["divided"].input_specs(batch, ROWS_TOKENS, geometry), geometry, seed=batch)
            for name, meta in metas.items():
                start = time.perf_counter()
                runners[name], lowered = compiled(meta, batch, geometry, Path(tmp) / f"{name}-{batch}.pt2")
                routed, other = read_bytes(meta, batch, name == "divided")
                row[name] = {
                    "compile_s": round(time.perf_counter() - start, 1),
                    "scratch_bytes": budget.scratch_bytes(lowered),
                    "routed_bytes": routed,
                    "weight_bytes": routed + other,
                }
                inputs[name] = [weights[name][n] for n in order[name]] + step
            for name, t in time_pair(runners, inputs, repeats).items():
                row[name].update(t)
            row["divided_over_dense"] = row["divided"]["best_ms"] / row["dense"]["best_ms"]
            row["divided_over_dense_median"] = row["divided"]["median_ms"] / row["dense"]["median_ms"]
            result["batches"].append(row)
            print(json.dumps(row), file=sys.stderr)
    for row in result["batches"]:
        result[f"moe_b{row['batch']}_divided_over_dense"] = row["divided_over_dense"]
        for name in ("dense", "divided"):
            result[f"moe_b{row['batch']}_weight_bytes_{name}"] = row[name]["weight_bytes"]
    return result


def measure_prompt(rows: int, experts: int, repeats: int) -> dict:
    """The routed experts of one rank (slices of `experts` experts at EP = 64) over a prompt chunk of
    `rows` rows, grouped (`moe_experts`) and tiled (`moe_tiled`), timed alternately; their results
    compared (within float32 rounding: both contract w2 over the slices in float32)."""
    import torch

    from deepinfer.bundles.topology import Topology
    from deepinfer.compiler.shard import ROUTED
    from deepinfer.compiler.step_reads import spec_bytes
    from deepinfer.kernels.linear import tiles_bound
    from deepinfer.regions.config import parse_config
    from deepinfer.regions.examples import random_weights
    from deepinfer.regions.moe import MoE, route
    from deepinfer.regions.synthetic import synthetic_config
    from deepinfer.regions.topology import moe_form, moe_tile

    c = parse_config(synthetic_config(experts=experts)).text
    k, limit = c.num_experts_per_tok, c.swiglu_limit
    region = MoE(c, dtype=torch.bfloat16, topo=Topology(ep=EP))
    for name, value in random_weights(region, seed=1).items():
        getattr(region, name).copy_(value)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, c.hidden_size, generator=gen).to(torch.bfloat16)
    weights, chosen = route(x, region.gate, region.gate_bias.expand(rows, -1), k, c.norm_topk_prob, 2.5)
    dense = torch.zeros(rows, experts).scatter(1, chosen, weights)
    stacks, blocks, tile = region.stacks(), region.scale_blocks(x.device), moe_tile(rows, k, experts)
    ops = torch.ops.deepinfer
    runners = {
        "grouped": lambda: ops.moe_experts(x, dense, *stacks, limit, blocks, True),
        "tiled": lambda: ops.moe_tiled(x, weights, chosen, *stacks, limit, tile, blocks, True),
    }
    with torch.inference_mode():
        grouped, tiled = runners["grouped"](), runners["tiled"]()
    error = ((tiled - grouped).abs().max() / grouped.abs().max()).item()
    s, D = region.w1.shape[1], c.hidden_size
    entry = sum(spec_bytes(spec) // experts for spec in region.specs if spec.name in ROUTED)  # one slice
    tiles = tiles_bound(rows * k, experts, tile)
    macs = 3 * s * D  # w1, w3, w2 of one slice against one row
    result = {
        "rows": rows,
        "experts": experts,
        "ep": EP,
        "top_k": k,
        "hidden": D,
        "slice_width": s,
        "form": moe_form(rows, k, experts),
        "tile": tile,
        "tiles": tiles,
        "useful_flops": 2 * rows * k * macs,
        "grouped": {"flops": 2 * rows * experts * macs, "routed_bytes": experts * entry},
        "tiled": {"flops": 2 * tiles * tile * macs, "routed_bytes": tiles * entry},
        "max_error_over_max": error,
        "repeats": repeats,
    }
    for name, t in time_pair(runners, dict.fromkeys(runners, ()), repeats).items():
        result[name].update(t)
    result["tiled_over_grouped_prompt"] = result["tiled"]["best_ms"] / result["grouped"]["best_ms"]
    result["tiled_flops_over_useful"] = result["tiled"]["flops"] / result["useful_flops"]
    result["grouped_flops_over_useful"] = result["grouped"]["flops"] / result["useful_flops"]
    return result


def prompt_table(r: dict) -> None:
    print(
        f"Routed experts of one rank, a prompt chunk of {r['rows']} rows: slices of {r['slice_width']} columns of "
        f"{r['experts']} experts (EP = {r['ep']}), hidden {r['hidden']}, top-{r['top_k']}, bf16, "
        f"{r['threads']} threads, {r['repeats']} calls each; tiled: {r['tiles']} tiles of {r['tile']} rows"
    )
    print(f"{'form':>8} {'best ms':>9} {'median ms':>10} {'GFLOP':>8} {'/ useful':>9} {'routed read':>12}")
    for name in ("grouped", "tiled"):
        f = r[name]
        print(
            f"{name:>8} {f['best_ms']:>9.1f} {f['median_ms']:>10.1f} {f['flops'] / 1e9:>8.1f} "
            f"{f['flops'] / r['useful_flops']:>9.2f} {f['routed_bytes'] / 1e6:>10.1f}MB"
        )
    print(f"tiled / grouped: {r['tiled_over_grouped_prompt']:.3f} (best); results within {r['max_error_over_max']:.1e}")


def table(result: dict) -> None:
    print(
        f"MoE layer, one rank of {result['experts']} experts at EP = {result['ep']}: dense = "
        f"{result['dense_local_experts']} whole experts, divided = {result['slice_width']}-column slices of all; "
        f"hidden {result['hidden']}, intermediate {result['intermediate']}, top-{result['top_k']}, bf16, "
        f"{result['threads']} threads, {result['repeats']} calls each"
    )
    head = f"{'batch':>5} {'form':>9} {'layout':>8} {'best ms':>9} {'median ms':>10} {'cpu ms':>8}"
    print(head + f" {'routed read':>12} {'weights read':>13} {'scratch':>10}")
    for row in result["batches"]:
        for name in ("dense", "divided"):
            r = row[name]
            print(
                f"{row['batch']:>5} {row['form'] if name == 'divided' else 'grouped':>9} {name:>8} "
                f"{r['best_ms']:>9.2f} {r['median_ms']:>10.2f} {r['cpu_best_ms']:>8.2f} "
                f"{r['routed_bytes'] / 1e6:>10.1f}MB {r['weight_bytes'] / 1e6:>11.1f}MB "
                f"{r['scratch_bytes'] / 2**20:>7.1f}MiB"
            )
        print(
            f"{'':>5} divided / dense: {row['divided_over_dense']:.3f} (best), "
            f"{row['divided_over_dense_median']:.3f} (median)"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=batches_list, default=[1, 8], help="batch sizes, one token a row (default 1,8)")
    ap.add_argument("--rows", type=int, default=None, help="a prompt chunk of this many rows: grouped vs tiled")
    ap.add_argument("--experts", type=int, default=384, help="with --rows: routed experts (default the release's 384)")
    timing_options(ap)
    ap.set_defaults(repeats=20)
    args = ap.parse_args()
    share_inductor_cache()
    threads = torch_threads(args.threads)
    if args.rows is not None:
        prompt = {**measure_prompt(args.rows, args.experts, args.repeats), "threads": threads}
        if args.json:
            print(json.dumps(prompt))
        else:
            prompt_table(prompt)
        return
    result = {**measure(args.batches, args.repeats), "threads": threads}
    if args.json:
        print(json.dumps(result))
    else:
        table(result)


if __name__ == "__main__":
    main()
