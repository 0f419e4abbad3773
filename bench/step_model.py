"""Benchmark (a model, nothing runs): what one rank reads, sends and launches per decode step, and
the step's lower-bound time, for the per-region form of today and one execution per layer.

    python bench/step_model.py                              # examples/release/model.toml, batch 1 and 8
    python bench/step_model.py --toml my/model.toml --context 1048576 --json

The plan of the model.toml (`deepinfer plan` without scratch: no checkpoint data is read) gives each
region kind's weights on a rank and the (kind, method)s each layer calls. Per rank and decode step
(T = 1, B sequences of `--context` positions in the token group):

    weight bytes     every device weight stack row a layer binds, read once (the grouped MoE runs
                     all of a rank's experts whatever the routing); the embedding's B rows, not its table
    state bytes      window rings, the selected compressed entries a rank holds (K / cp of them) and
                     the index keys it scores (its 1/cp of Wc per index layer), bf16
    executions       per-region form: embed + each layer's attention stages, MoE, engram + head;
                     per-layer form (issue 29's target): one per layer + embed + head
    collectives      bench/ranks.py's collectives at this layout (count, bytes sent)
    host<->device    per-region form with host collectives: every execution's streams in and out
                     (h bf16 and pre float32) and each boundary's float32 partials; per-layer form
                     with collectives in the graph: the step's host inputs and the rank's logits

Lower bound: (weight + state bytes) / HBM bandwidth + collectives x in-graph collective latency +
the bytes the collectives put on the links / link bandwidth (a ring all-reduce moves twice its
payload; an all-gather brings in cp - 1 times it) + executions x launch overhead + host<->device
bytes / host link bandwidth. The constants and their
sources are in HARDWARE; which are measured and which assumed is printed with them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

# (value, unit, source, measured or assumed)
HARDWARE = {
    "hbm_bytes_per_s": (
        0.725e12,
        "B/s per LNC-2 rank",
        "Trainium2 Architecture Guide for NKI: 2.9 TB/s per device of 4 LNC-2 logical cores",
        "published",
    ),
    "collective_s": (
        25e-6,
        "s per in-graph all-reduce or all-gather",
        "NxD Inference on DeepSeek-V3 at TP = 64 (issue 29's figure); not measured here",
        "assumed",
    ),
    "link_bytes_per_s": (
        320e9,
        "B/s of NeuronLink per LNC-2 rank",
        "AWS's Trn2 announcement: NeuronLink-v3 1.28 TB/s per device, of 4 LNC-2 ranks; not in the docs found",
        "assumed",
    ),
    "launch_s": (
        20e-6,
        "s per device execution",
        "no public figure found; an nrt_execute round trip of a loaded NEFF",
        "assumed",
    ),
    "host_link_bytes_per_s": (
        32e9,
        "B/s host<->device",
        "PCIe Gen5 x16 order of magnitude; not measured",
        "assumed",
    ),
    "host_collective_s": (
        200e-6,
        "s per host collective round trip",
        "device->host copy, gloo over shared memory, host->device; not measured",
        "assumed",
    ),
}
BF16 = 2


def step(plan, batch: int, context: int) -> dict:
    """One rank's figures per decode step at `batch` sequences of `context` positions."""
    from ranks import divided_merges

    c, topo = plan.spec.config, plan.spec.topology
    text = plan.spec.model.text
    d = plan.to_dict()
    kinds = d["kinds"]
    weights = sum(k["weights_per_rank"] for name, k in kinds.items() if k["slot"] != "embed")
    weights += batch * text.hidden_size * BF16  # the embedding's rows
    cp = topo.cp
    layers = d["layers"]

    def state_read(share: int) -> int:  # bytes of state a rank reads when it holds 1/share of the context
        total = 0
        for layer in layers:
            total += batch * text.sliding_window * text.head_dim * BF16  # the window ring
            if layer["ratio"]:
                width = context // layer["ratio"]
                total += batch * -(-min(text.index_topk, width) // share) * text.head_dim * BF16  # selected
                if layer["attn"] in ("source", "reindex"):
                    total += batch * -(-width // share) * text.index_head_dim * BF16  # index keys scored
        return total

    state = state_read(cp)
    per_step = plan.per_step  # the plan's count of executions and collectives per decode step
    seed_executions = 2 + sum(2 + (1 if layer["engram"] else 0) for layer in layers)  # one attention call each
    executions_region = per_step["executions"]
    executions_layer = len(layers) + 2
    act = BF16
    streams = batch * text.hc_mult * text.hidden_size
    moe_reduce = {"ep all-reduce": len(layers) * streams * 4} if topo.ep > 1 and not topo.dispatch else {}
    sent = {**moe_reduce, "logits all-gather": batch * d["weights"]["head"]["rows_per_rank"] * 4}
    counts = per_step["collectives_by_name"]
    if cp > 1:
        sent.update(divided_merges(text, len(layers), topo.tp, batch, act, context))
    collectives = sum(counts.values())
    on_links = sum(
        b * (topo.cp - 1 if "all-gather" in name and name.startswith("cp") else 2) for name, b in sent.items()
    )
    # per-region form: every execution's streams cross the host both ways, and every boundary collective
    # sends its float32 payload down and back up
    per_exec = 2 * (streams * act + batch * text.hc_mult * 4)
    host_region = executions_region * per_exec + 2 * sum(sent.values())
    metadata = batch * (8 + 8 + 8 + 4 * -(-context // c.kv.block_size))  # token, position, slot, table
    host_layer = metadata + sent["logits all-gather"]
    hw = {k: v[0] for k, v in HARDWARE.items()}
    memory_s = (weights + state) / hw["hbm_bytes_per_s"]
    links_s = on_links / hw["link_bytes_per_s"]
    layer_s = (
        memory_s
        + collectives * hw["collective_s"]
        + links_s
        + executions_layer * hw["launch_s"]
        + host_layer / hw["host_link_bytes_per_s"]
    )
    region_s = (
        memory_s
        + collectives * hw["host_collective_s"]
        + executions_region * hw["launch_s"]
        + host_region / hw["host_link_bytes_per_s"]
    )
    # the seed's layout: one execution per region, cp replicated (every rank reads the whole context's
    # state and holds the whole float32 head), the MoE all-reduce on the host
    whole_head = text.vocab_size * text.hidden_size * 4 - d["weights"]["head"]["bytes_per_rank"]
    seed_memory_s = (weights + whole_head + state_read(1)) / hw["hbm_bytes_per_s"]
    seed_host = seed_executions * per_exec + 2 * sum(moe_reduce.values()) + batch * text.vocab_size * 4
    seed_s = (
        seed_memory_s
        + counts["ep all-reduce"] * hw["host_collective_s"]
        + seed_executions * hw["launch_s"]
        + seed_host / hw["host_link_bytes_per_s"]
    )
    return {
        "batch": batch,
        "context": context,
        "weight_bytes": weights,
        "state_bytes": state,
        "executions_per_region": executions_region,
        "executions_per_layer": executions_layer,
        "collectives": counts,
        "collective_bytes": sent,
        "host_device_bytes_per_region": host_region,
        "host_device_bytes_per_layer": host_layer,
        "memory_ms": memory_s * 1e3,
        "collective_link_bytes": on_links,
        "collective_link_ms": links_s * 1e3,
        "estimated_ms_per_layer_form": layer_s * 1e3,
        "estimated_ms_per_region_form": region_s * 1e3,
        "executions_seed_layout": seed_executions,
        "estimated_ms_seed_layout": seed_s * 1e3,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--toml", type=Path, default=ROOT / "examples" / "release" / "model.toml")
    ap.add_argument("--context", type=int, help="positions per sequence (default: the toml's max_context)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from deepinfer.compiler.bundle_plan import plan_bundle
    from deepinfer.compiler.config import load_compile_config

    plan = plan_bundle(load_compile_config(args.toml), scratch=False)
    context = args.context or plan.spec.config.buckets.max_context
    rows = [step(plan, b, context) for b in (1, 8)]
    err = sys.stderr if args.json else sys.stdout
    topo = plan.spec.topology
    print(
        f"{args.toml}: tp={topo.tp} ep={topo.ep} cp={topo.cp}, context {context:,}, per rank per decode step", file=err
    )
    figures = [
        ("weight bytes read", "weight_bytes"),
        ("state bytes read", "state_bytes"),
        ("executions, per-region form", "executions_per_region"),
        ("executions, one per layer", "executions_per_layer"),
        ("host<->device B, per-region", "host_device_bytes_per_region"),
        ("host<->device B, per-layer", "host_device_bytes_per_layer"),
        ("HBM time (ms)", "memory_ms"),
        ("collective bytes on links", "collective_link_bytes"),
        ("collective link time (ms)", "collective_link_ms"),
        ("estimate, per-layer (ms)", "estimated_ms_per_layer_form"),
        ("estimate, per-region (ms)", "estimated_ms_per_region_form"),
        ("executions, seed's layout", "executions_seed_layout"),
        ("estimate, seed's layout (ms)", "estimated_ms_seed_layout"),
    ]
    print(f"{'':<32}" + "".join(f"{'batch ' + str(r['batch']):>18}" for r in rows), file=err)
    for label, key in figures:
        cells = "".join(f"{r[key]:>18,.2f}" if isinstance(r[key], float) else f"{r[key]:>18,}" for r in rows)
        print(f"{label:<32}{cells}", file=err)
    for name in rows[0]["collectives"]:
        cells = "".join(f"{r['collectives'][name]:>4} calls {r['collective_bytes'][name]:>10,} B" for r in rows)
        print(f"{name:<32}{cells}", file=err)
    print("constants:", file=err)
    for key, (value, unit, source, how) in HARDWARE.items():
        print(f"  {key:<22} {value:g} {unit} ({how}: {source})", file=err)
    if args.json:
        b1 = rows[0]
        print(
            json.dumps(
                {
                    "context": context,
                    # the bundle as built today: one execution per region and attention stage, host collectives
                    "executions_per_step": b1["executions_per_region"],
                    "collectives_per_step": sum(b1["collectives"].values()),
                    "weight_bytes_per_step_b1": b1["weight_bytes"],
                    "host_device_bytes_per_step_b1": b1["host_device_bytes_per_region"],
                    "estimated_step_ms_b1": b1["estimated_ms_per_region_form"],
                    # issue 29's target, modelled (not built): one execution per layer, collectives in the graph
                    "one_execution_per_layer": {
                        "executions_per_step": b1["executions_per_layer"],
                        "host_device_bytes_per_step_b1": b1["host_device_bytes_per_layer"],
                        "estimated_step_ms_b1": b1["estimated_ms_per_layer_form"],
                    },
                    "seed_layout_estimated_step_ms_b1": b1["estimated_ms_seed_layout"],
                    "rows": rows,
                    "constants": {
                        k: {"value": v[0], "unit": v[1], "source": v[2], "kind": v[3]} for k, v in HARDWARE.items()
                    },
                }
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
