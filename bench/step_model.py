"""Benchmark (a model, nothing runs): what one rank reads, computes, sends and launches per decode
step, and the step's lower-bound time, for the bundle as planned, the per-region form and the seed's
layout.

    python bench/step_model.py                              # examples/release/model.toml, batch 1 and 8
    python bench/step_model.py --toml my/model.toml --context 1048576 --json
    python bench/step_model.py --figures deepinfer-figures.json   # figures a Trn2 host measured

The model is compiler/step_cost.py, what `deepinfer plan` prints per decode bucket (its figures, its
trn2 constants and their sources are there). This reads it at one context for three forms:

    as planned       the plan's own per_step: trn2 fuses each layer into one execution with its
                     collectives inside (compiler/layers.py; `layers = "fused"`, the default)
    per-region       the same model.toml with `layers = "regions"` and host collectives: a region or
                     attention stage an execution, every collective between them on the host
    seed's layout    one execution per region (one attention call a layer), cp replicated (every
                     rank reads the whole context's state and holds the whole float32 head), the
                     MoE all-reduce on the host

and a prompt's time to first token at batch 1 (compiler/prompt_cost.py) for prompts of 8K, 64K and
1M tokens, planned at context buckets 8K / 64K / 1M (`LONG`), in chunks of the toml's largest tokens
bucket, beside other chunk sizes (`--chunks`), and the compute bound: the prompt's useful FLOPs over
every rank's peak. Beside it, the same prompts with each chunk divided by rows over the token group
(compiler/prompt_rows.py: what `[prompt] rows = "divided"` builds), in chunks of `--divided-chunk`
tokens and at each of `--chunks`, each chunk run as two micro-batches of half of it (regions/micro.py,
compiler/rows_layers.py: one's collectives on the links while the other computes;
compiler/prompt_rows.micro_chunk_cost), and beside them the same chunks in one pass; the JSON's
`divided` holds them (`one_pass` the latter). The release's own figures (the top-level `ttft_*`) are
its model.toml's chunks as trn2 builds them (`deepinfer plan` gives the same): divided by rows since
issue 41's third stop, each chunk as two micro-batches inside each layer's rows module since its fourth
(`--toml examples/release/model_replicated.toml` gives every rank every row).

With `--figures FILE` (a figures file `deepinfer doctor` writes: docs/trn2.md), every plan here uses the
figures a Trn2 host measured in place of the target's (`deepinfer plan --figures`), each marked measured.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


SEED_SHARED_RANKS = 18  # the seed split the shared expert's 2,304 columns over 18 ranks
LONG = (8192, 65536, 1048576)  # the context buckets a prompt's cost is planned at
DRAFT_TOML = ROOT / "examples" / "release" / "model_dspark.toml"  # the release with its DSpark draft


def seed_weights(plan, batch: int) -> int:
    """What a rank of the seed's layout read a decode step: every kind's unsharded weights (the attention
    of every head, the engram, the whole float32 head), of the MoE its E / ep whole experts (all of them,
    whatever the routing) and 1/18 of the shared expert, of the embedding the step's rows."""
    from deepinfer.bundles.manifest import ROWS_SLOT
    from deepinfer.compiler.shard import ROUTED
    from deepinfer.compiler.step_reads import spec_bytes

    regions, ep = plan.regions, plan.spec.topology.ep
    total = 0
    for kind, kp in regions.kinds.items():
        if kind in regions.draft_kinds or kp.slot == ROWS_SLOT:  # the rows twins run prompt chunks only
            continue
        if kp.slot == "embed":
            (table,) = kp.full_specs
            total += batch * spec_bytes(table) // table.shape[0]
            continue
        per_layer = 0
        for spec in kp.full_specs:
            n = spec_bytes(spec)
            if kp.slot == "moe" and spec.name in ROUTED:
                n //= ep
            elif kp.slot == "moe" and spec.name.startswith("sw"):
                n //= SEED_SHARED_RANKS
            per_layer += n
        total += per_layer * max(1, len(kp.layers))
    return total


def seed_layout(plan, today) -> dict:
    """The seed's layout at `today`'s bucket: (executions, estimate in ms). Its FLOPs are taken as
    today's, fewer than it computes (whole selections, the whole head, every head's projections): its
    memory time bounds it."""
    from deepinfer.compiler import step_cost as sc

    c, act = plan.spec.model.text, plan.spec.dtype.itemsize
    layers, batch = plan.regions.layers, today.batch
    executions = 2 + sum(2 + (p.engram_rows > 0) for p in layers)
    weights = seed_weights(plan, batch)
    state = sc.state_bytes(c, layers, batch, today.context, act, share=1)
    moe = today.collective_bytes.get("ep all-reduce", 0)
    host = executions * 2 * sc.stream_bytes(c, batch, act) + 2 * moe + batch * c.vocab_size * sc.F32
    times = sc.lower_bound(
        sc.figures_of(plan),
        plan.spec.config.model.dtype,
        bytes_read=weights + state,
        flops=today.flops,
        executions=executions,
        in_graph=0,
        link=0,
        on_host=today.collectives_by_name.get("ep all-reduce", 0),
        host_device=host,
    )
    return {"executions": executions, "estimated_ms": times["estimated_ms"], "weight_bytes": weights}


def step(plan, regions_plan, batch: int, context: int) -> dict:
    """One rank's figures per decode step at `batch` sequences of `context` positions: `plan` as
    planned, `regions_plan` its per-region form."""
    from deepinfer.compiler.step_cost import step_cost

    planned = step_cost(plan, batch, context)
    today = step_cost(regions_plan, batch, context)
    seed = seed_layout(plan, today)
    return {
        "batch": batch,
        "context": context,
        "weight_bytes": planned.weight_bytes,
        "weight_bytes_worst": planned.weight_bytes_worst,
        "weight_bytes_by_kind": planned.weight_bytes_by_kind,
        "state_bytes": planned.state_bytes,
        "flops": planned.flops,
        "flops_by_part": planned.flops_by_part,
        "executions": planned.executions,
        "executions_per_region": today.executions,
        "collectives": planned.collectives_by_name,
        "collectives_in_executables": planned.collectives_in_executables,
        "collective_bytes": planned.collective_bytes,
        "host_device_bytes": planned.host_device_bytes,
        "host_device_bytes_per_region": today.host_device_bytes,
        "memory_ms": planned.memory_ms,
        "compute_ms": planned.compute_ms,
        "collective_link_bytes": planned.collective_link_bytes,
        "collective_link_ms": planned.collective_link_ms,
        "estimated_ms": planned.estimated_ms,
        "estimated_ms_per_region_form": today.estimated_ms,
        "executions_seed_layout": seed["executions"],
        "estimated_ms_seed_layout": seed["estimated_ms"],
        "weight_bytes_seed_layout": seed["weight_bytes"],
    }


def per_region(config):
    """`config` with its trn2 layers per region and host collectives (other targets as they are)."""
    import dataclasses

    if config.target.name != "trn2":
        return config
    options = {**config.target.options, "layers": "regions", "collectives": "host"}
    return dataclasses.replace(config, target=dataclasses.replace(config.target, options=options))


def long_context(config):
    """`config` with context buckets `LONG` and blocks for 8 sequences of the longest (1M x 8 fits)."""
    import dataclasses

    buckets = dataclasses.replace(config.buckets, max_context=LONG[-1], context=LONG)
    blocks = 8 * LONG[-1] // config.kv.block_size + 1
    return dataclasses.replace(config, buckets=buckets, kv=dataclasses.replace(config.kv, num_blocks=blocks))


def planned(config, measured=None):
    """`config`'s plan (no scratch), with the measured figures of a figures file where given."""
    from deepinfer.compiler.bundle_plan import plan_bundle
    from deepinfer.compiler.step_cost import with_measured

    plan = plan_bundle(config, scratch=False)
    return plan if measured is None else with_measured(plan, measured)


def prompts(config, chunks: list[int], measured=None) -> dict:
    """Time to first token at batch 1 for prompts of LONG's lengths, in the toml's largest tokens
    bucket and in each of `chunks` (the chunk-size sweep at 64K)."""
    from deepinfer.compiler.prompt_cost import prompt_cost

    plan = planned(long_context(config), measured)
    chunk = max(plan.spec.config.buckets.tokens)
    costs = {L: prompt_cost(plan, L, chunk) for L in LONG}
    sweep = {T: prompt_cost(plan, LONG[1], T) for T in sorted({*chunks, chunk})}
    return {"chunk": chunk, "costs": costs, "sweep": sweep}


def divided(config, chunk: int, chunks: list[int], measured=None) -> dict:
    """`prompts`' figures with each chunk divided by rows (compiler/prompt_rows.py), where the
    topology allows it (tp = 1, ep = cp > 1), else {}."""
    from deepinfer.compiler.prompt_cost import prompt_cost
    from deepinfer.compiler.prompt_rows import MICRO_BATCHES, divided_chunk_cost, micro_chunk_cost

    plan = planned(long_context(config), measured)
    topo = plan.spec.topology
    if topo.tp != 1 or topo.ep != topo.cp or topo.cp == 1:
        return {}
    costs = {L: prompt_cost(plan, L, chunk, micro_chunk_cost) for L in LONG}
    sweep = {T: prompt_cost(plan, LONG[1], T, micro_chunk_cost) for T in sorted({*chunks, chunk})}
    one_pass = {L: prompt_cost(plan, L, chunk, divided_chunk_cost) for L in LONG}
    return {"chunk": chunk, "costs": costs, "sweep": sweep, "one_pass": one_pass, "micro_batches": MICRO_BATCHES}


def verify(config, context: int, measured=None) -> dict:
    """The verify step with the DSpark draft (compiler/verify_cost.py) at batch 1 and 8 of `DRAFT_TOML`,
    the bundle as planned (trn2: fused layers holding the capture, the draft step one module) beside
    its per-region form with every choice's full logits gathered (issue 42's before) and the fused
    layers with the draft step per region call (the last stop's)."""
    from deepinfer.compiler.verify_cost import verify_cost

    plan, before = planned(config, measured), planned(per_region(config), measured)
    out = {"plan": plan}
    for b in (1, 8):
        out[b] = (
            verify_cost(plan, b, context),
            verify_cost(before, b, context, pairs=False),
            verify_cost(plan, b, context, draft_module=False),
        )
    return out


def print_verify(v: dict, plain: dict, err) -> None:
    from deepinfer.compiler.verify_cost import ACCEPTANCE

    print(
        "verify step with the DSpark draft, per rank (as planned: the draft step one module | per-region"
        " form, full logits | fused layers, the draft per region call):",
        file=err,
    )
    shown = [
        ("executions", lambda c: f"{c.executions:,}"),
        (
            "collectives (on the host)",
            lambda c: f"{c.collectives} ({c.target.collectives_on_host + c.draft.collectives_on_host})",
        ),
        ("host<->device bytes", lambda c: f"{c.host_device_bytes:,}"),
        ("target verify (ms)", lambda c: f"{c.target.estimated_ms:,.2f}"),
        ("draft step (ms)", lambda c: f"{c.draft.estimated_ms:,.2f}"),
        ("verify step (ms)", lambda c: f"{c.estimated_ms:,.2f}"),
        *((f"per output token at {a:.2f} (ms)", lambda c, a=a: f"{c.tpot_ms(a):,.2f}") for a in ACCEPTANCE),
    ]
    heads = "".join(f"{f'batch {b}':>14}{'(per region)':>14}{'(draft p.r.)':>12}" for b in (1, 8))
    print(f"{'':<32}{heads}", file=err)
    for label, cell in shown:
        cells = "".join(f"{cell(v[b][0]):>14}{cell(v[b][1]):>14}{cell(v[b][2]):>12}" for b in (1, 8))
        print(f"{label:<32}{cells}", file=err)
    ratio = "".join(
        f"{v[b][0].estimated_ms / plain[b]:>14,.2f}{v[b][1].estimated_ms / plain[b]:>14,.2f}"
        f"{v[b][2].estimated_ms / plain[b]:>12,.2f}"
        for b in (1, 8)
    )
    print(f"{'verify / plain fused step':<32}{ratio}", file=err)


def print_prompts(p: dict, err) -> None:
    costs, sweep = p["costs"], p["sweep"]
    print(f"prompt at batch 1, chunks of {p['chunk']} tokens, per rank:", file=err)
    print(f"{'':<32}" + "".join(f"{f'{L:,} tokens':>18}" for L in costs), file=err)
    shown = [
        ("chunks", lambda c: f"{c.chunks:,}"),
        ("FLOPs on a rank (T)", lambda c: f"{c.flops / 1e12:,.1f}"),
        ("useful FLOPs, all ranks (T)", lambda c: f"{c.useful_flops / 1e12:,.1f}"),
        ("weight bytes read (GB)", lambda c: f"{c.weight_bytes / 1e9:,.1f}"),
        ("collectives", lambda c: f"{c.collectives:,}"),
        ("time to first token (ms)", lambda c: f"{c.ttft_ms:,.1f}"),
        ("compute bound (ms)", lambda c: f"{c.compute_bound_ms:,.1f}"),
        ("TTFT / compute bound", lambda c: f"{c.ttft_over_compute_bound:,.2f}"),
    ]
    for label, cell in shown:
        print(f"{label:<32}" + "".join(f"{cell(c):>18}" for c in costs.values()), file=err)
    big = costs[LONG[-1]]
    for part in sorted(big.flops_by_part, key=big.flops_by_part.get, reverse=True):
        cells = "".join(f"{c.flops_by_part[part] / 1e12:>18,.1f}" for c in costs.values())
        print(f"  {part:<30}{cells}", file=err)
    print(f"chunk size at {LONG[1]:,} tokens: TTFT (ms), and / compute bound", file=err)
    for T, c in sweep.items():
        print(f"  {T:>6} tokens  {c.ttft_ms:>12,.1f}  {c.ttft_over_compute_bound:>8,.2f}", file=err)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--toml", type=Path, default=ROOT / "examples" / "release" / "model.toml")
    ap.add_argument("--context", type=int, help="positions per sequence (default: the toml's max_context)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--chunks", type=int, nargs="*", default=[128, 512, 2048, 8192], help="prompt chunk sizes to compare at 64K"
    )
    ap.add_argument(
        "--divided-chunk", type=int, default=8192, help="the chunk of the divided-rows figures (default 8192)"
    )
    ap.add_argument(
        "--draft-toml", type=Path, default=DRAFT_TOML, help="the same bundle with [speculative] draft (the verify step)"
    )
    ap.add_argument(
        "--figures", type=Path, help="a figures file of a Trn2 host (`deepinfer doctor`): measured in place of assumed"
    )
    args = ap.parse_args()

    from deepinfer.compiler.config import load_compile_config
    from deepinfer.compiler.step_cost import figures_of
    from deepinfer.compiler.targets.trn2_figures import load_figures
    from deepinfer.errors import ConfigError

    try:
        config = load_compile_config(args.toml)
        draft_config = load_compile_config(args.draft_toml)
        measured = load_figures(args.figures) if args.figures else None
        plan = planned(config, measured)
        regions_plan = planned(per_region(config), measured)
        figures = figures_of(plan)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    context = args.context or plan.spec.config.buckets.max_context
    rows = [step(plan, regions_plan, b, context) for b in (1, 8)]
    err = sys.stderr if args.json else sys.stdout
    topo = plan.spec.topology
    print(
        f"{args.toml}: tp={topo.tp} ep={topo.ep} cp={topo.cp}, context {context:,}, per rank per decode step", file=err
    )
    figures_shown = [
        ("weight bytes read, expected", "weight_bytes"),
        ("weight bytes read, worst case", "weight_bytes_worst"),
        ("state bytes read", "state_bytes"),
        ("FLOPs", "flops"),
        ("executions, as planned", "executions"),
        ("executions, per-region form", "executions_per_region"),
        ("collectives in executables", "collectives_in_executables"),
        ("host<->device B, as planned", "host_device_bytes"),
        ("host<->device B, per-region", "host_device_bytes_per_region"),
        ("HBM time (ms)", "memory_ms"),
        (f"compute time, {plan.spec.config.model.dtype} peak (ms)", "compute_ms"),
        ("collective bytes on links", "collective_link_bytes"),
        ("collective link time (ms)", "collective_link_ms"),
        ("estimate, as planned (ms)", "estimated_ms"),
        ("estimate, per-region (ms)", "estimated_ms_per_region_form"),
        ("weight bytes, seed's layout", "weight_bytes_seed_layout"),
        ("executions, seed's layout", "executions_seed_layout"),
        ("estimate, seed's layout (ms)", "estimated_ms_seed_layout"),
    ]
    print(f"{'':<32}" + "".join(f"{'batch ' + str(r['batch']):>18}" for r in rows), file=err)
    for label, key in figures_shown:
        cells = "".join(f"{r[key]:>18,.2f}" if isinstance(r[key], float) else f"{r[key]:>18,}" for r in rows)
        print(f"{label:<32}{cells}", file=err)
    for kind in rows[0]["weight_bytes_by_kind"]:
        cells = "".join(f"{r['weight_bytes_by_kind'][kind]:>18,}" for r in rows)
        print(f"  {kind:<30}{cells}", file=err)
    for name in rows[0]["collectives"]:
        cells = "".join(f"{r['collectives'][name]:>4} calls {r['collective_bytes'][name]:>10,} B" for r in rows)
        print(f"{name:<32}{cells}", file=err)
    ver = verify(draft_config, context, measured)
    print_verify(ver, {r["batch"]: r["estimated_ms"] for r in rows}, err)
    long = prompts(config, args.chunks, measured)
    print_prompts(long, err)
    rows_divided = divided(config, args.divided_chunk, args.chunks, measured)
    if rows_divided:
        print(
            f"divided by rows over the token group, each chunk as {rows_divided['micro_batches']} micro-batches"
            " (trn2's rows modules and the cpu bundle run them):",
            file=err,
        )
        print_prompts(rows_divided, err)
        print("the same chunks in one pass (no micro-batches): TTFT (ms), and / compute bound", file=err)
        for L, c in rows_divided["one_pass"].items():
            print(f"  {L:>9,} tokens  {c.ttft_ms:>12,.1f}  {c.ttft_over_compute_bound:>6.2f}", file=err)
    print("constants (measured / published / assumed):", file=err)
    for key, f in figures.items():
        print(f"  {key:<22} {f.value:g} {f.unit} ({f.status}: {f.source})", file=err)
    if args.json:
        b1, b8 = rows
        print(
            json.dumps(
                {
                    "context": context,
                    # the bundle as planned (trn2: one execution a layer, its collectives inside)
                    "executions_per_step": b1["executions"],
                    "collectives_per_step": sum(b1["collectives"].values()),
                    "collectives_in_executables": b1["collectives_in_executables"],
                    "weight_bytes_per_step_b1": b1["weight_bytes"],
                    "weight_bytes_worst_b1": b1["weight_bytes_worst"],
                    "weight_bytes_per_step_b8": b8["weight_bytes"],
                    "weight_bytes_worst_b8": b8["weight_bytes_worst"],
                    "weight_bytes_by_kind_b1": b1["weight_bytes_by_kind"],
                    "flops_per_step_b1": b1["flops"],
                    "host_device_bytes_per_step_b1": b1["host_device_bytes"],
                    "estimated_step_ms_b1": b1["estimated_ms"],
                    "estimated_step_ms_b8": b8["estimated_ms"],
                    "collectives_by_name_b1": b1["collectives"],
                    # the per-region form with host collectives (`layers = "regions"`), for comparison
                    "per_region_form": {
                        "executions_per_step": b1["executions_per_region"],
                        "host_device_bytes_per_step_b1": b1["host_device_bytes_per_region"],
                        "estimated_step_ms_b1": b1["estimated_ms_per_region_form"],
                    },
                    "seed_layout_estimated_step_ms_b1": b1["estimated_ms_seed_layout"],
                    # the verify step with the DSpark draft (compiler/verify_cost.py), --draft-toml's bundle
                    "verify_executions_per_step": ver[1][0].executions,
                    "verify_collectives_per_step": ver[1][0].collectives,
                    "verify_over_step_b1": ver[1][0].estimated_ms / b1["estimated_ms"],
                    "verify_over_step_b8": ver[8][0].estimated_ms / b8["estimated_ms"],
                    "verify_host_device_bytes_b1": ver[1][0].host_device_bytes,
                    "verify_step_ms_b1": ver[1][0].estimated_ms,
                    "tpot_ms_b1_at_2_70": ver[1][0].tpot_ms(2.70),
                    "tpot_ms_b1_at_3_10": ver[1][0].tpot_ms(3.10),
                    "tpot_ms_b1_at_3_34": ver[1][0].tpot_ms(3.34),
                    "verify": {str(b): v[0].to_dict() for b, v in ver.items() if b != "plan"},
                    "verify_per_region_form": {str(b): v[1].to_dict() for b, v in ver.items() if b != "plan"},
                    # fused layers with the draft step per region call (before its module)
                    "verify_with_draft_per_region": {
                        "executions_per_step": ver[1][2].executions,
                        "verify_over_step_b1": ver[1][2].estimated_ms / b1["estimated_ms"],
                        "host_device_bytes_b1": ver[1][2].host_device_bytes,
                        "tpot_ms_b1_at_3_10": ver[1][2].tpot_ms(3.10),
                    },
                    "rows": rows,
                    # a prompt at batch 1, planned at context buckets LONG (compiler/prompt_cost.py)
                    "prompt_chunk_tokens": long["chunk"],
                    "ttft_ms_8k": long["costs"][LONG[0]].ttft_ms,
                    "ttft_ms_64k": long["costs"][LONG[1]].ttft_ms,
                    "ttft_ms_1m": long["costs"][LONG[2]].ttft_ms,
                    "compute_bound_ms_64k": long["costs"][LONG[1]].compute_bound_ms,
                    "compute_bound_ms_1m": long["costs"][LONG[2]].compute_bound_ms,
                    "ttft_64k_over_compute_bound": long["costs"][LONG[1]].ttft_over_compute_bound,
                    "ttft_1m_over_compute_bound": long["costs"][LONG[2]].ttft_over_compute_bound,
                    "prompts": {str(L): c.to_dict() for L, c in long["costs"].items()},
                    "ttft_ms_64k_by_chunk": {str(T): c.ttft_ms for T, c in long["sweep"].items()},
                    # the same prompts divided by rows (compiler/prompt_rows.py) in chunks of --divided-chunk,
                    # micro-batched as the bundles run them (compiler/rows_layers.py); `one_pass` without
                    "divided": {
                        "prompt_chunk_tokens": rows_divided["chunk"],
                        "ttft_ms_8k": rows_divided["costs"][LONG[0]].ttft_ms,
                        "ttft_ms_64k": rows_divided["costs"][LONG[1]].ttft_ms,
                        "ttft_ms_1m": rows_divided["costs"][LONG[2]].ttft_ms,
                        "ttft_64k_over_compute_bound": rows_divided["costs"][LONG[1]].ttft_over_compute_bound,
                        "ttft_1m_over_compute_bound": rows_divided["costs"][LONG[2]].ttft_over_compute_bound,
                        "prompts": {str(L): c.to_dict() for L, c in rows_divided["costs"].items()},
                        "ttft_ms_64k_by_chunk": {str(T): c.ttft_ms for T, c in rows_divided["sweep"].items()},
                        "micro_batches": rows_divided["micro_batches"],
                        "one_pass": {
                            "ttft_ms_64k": rows_divided["one_pass"][LONG[1]].ttft_ms,
                            "ttft_64k_over_compute_bound": rows_divided["one_pass"][LONG[1]].ttft_over_compute_bound,
                            "ttft_ms_1m": rows_divided["one_pass"][LONG[2]].ttft_ms,
                        },
                    }
                    if rows_divided
                    else None,
                    "constants": {
                        k: {"value": f.value, "unit": f.unit, "source": f.source, "kind": f.status}
                        for k, f in figures.items()
                    },
                }
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
