"""Benchmark: bytes each rank moves per decode step, per collective, for tp / ep / cp layouts.

    python bench/ranks.py                                   # tiny model config, batch 1 per token group
    python bench/ranks.py --config path/config.json --batch 8 --dtype bf16
    python bench/ranks.py --measure build/ranks             # also run compiled bundles and count bytes
    python bench/ranks.py --json                            # one JSON object on stdout (table on stderr)

Per decode step (T = 1, `--batch` sequences per token group) and per rank, the
payload each collective of runtime/ranks.py sends, summed over the layers:

    tp all-reduce            float32 partial streams [B, n, D] after every attention
    ep all-reduce            float32 partial streams after every MoE (tokens replicated)
    ep dispatch all-gather   packed rows (h in the activation dtype, pre, is_image), sent once,
                             received from every other rank
    ep combine reduce-scat.  float32 partials of every rank's rows
    logits all-gather        the leader's sampler: each rank's float32 slice of the vocabulary
                             [B, rows] (the head is split over the token group: rows = vocab /
                             (tp * cp) padded to 32; the whole vocabulary in a group of one)

and at the release's shapes (examples/release/config.json at EP = CP = 64, batch 1 and 8) the
logits all-gather beside the MoE all-reduce, whatever --config says.

next to what an uneven all-to-all would move for the same routing: each token's
collapsed input x [D] to the distinct remote ranks holding its k experts, and
their float32 outputs back (uniform routing: E[distinct ranks] = R (1 - (1 - 1/R)^k)).
The all-to-all ships x, not the n hyper-connection streams, because it would run
inside the MoE region; ours crosses the region boundary with the streams.

With --measure DIR, every bundle DIR/<name> compiled for a listed layout
(see tests/conftest.py `rank_bundle` for the model.toml) is run with one-token
prompts (so every step is a decode step) and the bytes counted by the
collectives are reported per step, beside the model's prediction for B = 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

LAYOUTS = {
    "tp=2": (2, 1, 1),
    "ep=2": (1, 2, 1),
    "ep=4": (1, 4, 1),
    "cp=2": (1, 1, 2),
    "cp=ep=4": (1, 4, 4),
    "ep=8": (1, 8, 1),
    "cp=ep=8": (1, 8, 8),
}
DTYPE_BYTES = {"fp32": 4, "bf16": 2}


def predicted(text, layers: int, tp: int, ep: int, cp: int, B: int, act_bytes: int) -> dict:
    """Bytes one rank sends per decode step, per collective, and the all-to-all comparison."""
    from deepinfer.bundles.topology import Topology
    from deepinfer.regions.topology import head_rows

    topo = Topology(tp=tp, ep=ep, cp=cp)
    n, D, k = text.hc_mult, text.hidden_size, text.num_experts_per_tok
    R = topo.world
    streams = B * n * D * 4
    out: dict[str, int] = {}
    if tp > 1:
        out["tp all-reduce"] = layers * streams
    if ep > 1 and not topo.dispatch:
        out["ep all-reduce"] = layers * streams
    if topo.dispatch:
        row = n * D * act_bytes + n * 4 + 1
        out["ep dispatch all-gather"] = layers * B * row
        out["ep combine reduce-scatter"] = layers * R * streams
    if R > 1:
        out["logits all-gather"] = B * head_rows(text, topo) * 4
    a2a = 0
    if ep > 1:
        distinct = R * (1 - (1 - 1 / R) ** k)
        remote = distinct * (R - 1) / R
        tokens = B if topo.dispatch else B / R  # replicated tokens: each rank routes its share
        a2a = round(layers * tokens * remote * (D * act_bytes + D * 4))
    return {"collectives": out, "total": sum(out.values()), "all_to_all": a2a}


def release_logits() -> list[dict]:
    """The logits all-gather and the MoE all-reduce per rank per decode step at the release's shapes
    (EP = CP = 64, one token group), batch 1 and 8."""
    from deepinfer.regions.config import load_config

    text = load_config(ROOT / "examples" / "release").text
    rows = []
    for B in (1, 8):
        sent = predicted(text, text.num_hidden_layers, 1, 64, 64, B, DTYPE_BYTES["bf16"])["collectives"]
        rows.append(
            {"batch": B, "logits all-gather": sent["logits all-gather"], "ep all-reduce": sent["ep all-reduce"]}
        )
    return rows


def measure(bundle: Path, steps: int) -> dict:
    from deepinfer.runtime import RunOptions, generate

    run = generate(bundle, [[0]], RunOptions(max_new_tokens=steps, threads=1))
    decode_steps = run.stats.steps
    per_rank = {r: {k: v / decode_steps for k, v in sent.items()} for r, sent in run.sent.items()}
    return {"steps": decode_steps, "per_rank": per_rank}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", type=Path, help="a V4.1 config.json (default: the tiny model's)")
    ap.add_argument("--batch", type=int, default=1, help="decode sequences per token group")
    ap.add_argument("--dtype", choices=DTYPE_BYTES, default="fp32", help="activation dtype")
    ap.add_argument("--measure", type=Path, help="a folder of compiled bundles named like the layouts")
    ap.add_argument("--steps", type=int, default=4, help="decode steps per measured run")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from deepinfer.bundles.layout import MANIFEST_FILE
    from deepinfer.regions.config import load_config, parse_config
    from deepinfer.regions.tiny import tiny_config

    model = load_config(args.config.parent) if args.config else parse_config(tiny_config(), "tiny")
    text = model.text
    rows, measured = [], {}
    for name, (tp, ep, cp) in LAYOUTS.items():
        p = predicted(text, text.num_hidden_layers, tp, ep, cp, args.batch, DTYPE_BYTES[args.dtype])
        rows.append({"layout": name, **p})
        bundle = args.measure / name if args.measure else None
        if bundle is not None and (bundle / MANIFEST_FILE).exists():
            measured[name] = {
                **measure(bundle, args.steps),
                "predicted_b1": predicted(text, text.num_hidden_layers, tp, ep, cp, 1, DTYPE_BYTES[args.dtype])[
                    "collectives"
                ],
            }
    err = sys.stderr if args.json else sys.stdout
    print(
        f"bytes per rank per decode step: {text.num_hidden_layers} layers, hidden {text.hidden_size} x "
        f"hc {text.hc_mult}, {text.n_routed_experts} experts top-{text.num_experts_per_tok}, batch "
        f"{args.batch} per token group, {args.dtype} activations",
        file=err,
    )
    print(f"{'layout':<9}{'collective':<28}{'bytes':>14}{'all-to-all':>14}{'ratio':>8}", file=err)
    for r in rows:
        first = True
        for coll, b in (r["collectives"] or {"(none)": 0}).items():
            a2a = f"{r['all_to_all']:>14,}" if first and r["all_to_all"] else f"{'':>14}"
            ratio = f"{r['total'] / r['all_to_all']:>8.2f}" if first and r["all_to_all"] else f"{'':>8}"
            print(f"{r['layout'] if first else '':<9}{coll:<28}{b:>14,}{a2a}{ratio}", file=err)
            first = False
    for name, m in measured.items():
        sent = m["per_rank"][0]
        print(
            f"measured {name} (rank 0, {m['steps']} steps): "
            + ", ".join(f"{k} {v:,.0f} (model {m['predicted_b1'].get(k, 0):,})" for k, v in sent.items()),
            file=err,
        )
    release = release_logits()
    for r in release:
        gather, moe = r["logits all-gather"], r["ep all-reduce"]
        print(
            f"release (EP = CP = 64), batch {r['batch']}: logits all-gather {gather:,} B a rank "
            f"({gather / moe:.2%} of the MoE all-reduce's {moe:,})",
            file=err,
        )
    if args.json:
        print(
            json.dumps(
                {
                    "batch": args.batch,
                    "dtype": args.dtype,
                    "layers": text.num_hidden_layers,
                    "layouts": rows,
                    "measured": measured,
                    "release": release,
                }
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
