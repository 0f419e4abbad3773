"""Benchmark: bytes each rank moves per decode step, per collective, for tp / ep / cp layouts.

    python bench/ranks.py                                   # tiny model config, batch 1 per token group
    python bench/ranks.py --config path/config.json --batch 8 --dtype bf16
    python bench/ranks.py --measure build/ranks             # also run compiled bundles and count bytes
    python bench/ranks.py --json                            # one JSON object on stdout (table on stderr)

Per decode step (T = 1, `--batch` sequences per token group) and per rank, the
payload each collective of runtime/ranks.py sends, summed over the layers:

    attention all-reduce     float32 partial streams [B, n, D] after every attention
    ep all-reduce            float32 partial streams after every MoE (tokens replicated)
    ep dispatch all-gather   packed rows (h in the activation dtype, pre, is_image), sent once,
                             received from every other rank
    ep combine reduce-scat.  float32 partials of every rank's rows
    logits all-gather        the leader's sampler: each rank's float32 slice of the vocabulary
                             [B, rows] (the head is split over the token group: rows = vocab /
                             (tp * cp) padded to 32; the whole vocabulary in a group of one)
    cp selection all-gather  the divided attention (cp > 1): every index layer's K best (score in
                             the activation dtype, int64 global index) [B, K], K = min(index_topk,
                             Wc), and on the candidate source its N best blocks the same way
    cp attention max all-gather  every compressed layer's partial softmax max, float32 [B, H]
    cp attention all-reduce  every compressed layer's scaled numerator and sum, float32
                             [B, H, head_dim + 1] (log-sum-exp merge; no KV row leaves its rank)

Wc is a sequence's compressed entries at the step's context bucket (--context); past
K * ratio positions the merges no longer grow with the context. An all-gather's rank receives
(cp - 1) times what it sends and merges cp x K candidates; an all-reduce's ring moves about twice
its payload whatever cp.

At the release's shapes (examples/release/config.json at EP = CP = 64), whatever --config says:
batch 1 and 8 at contexts 8K, 64K and 1M, every collective above beside the MoE all-reduce.

next to what an uneven all-to-all would move for the same routing: each token's
collapsed input x [D] to the distinct remote ranks holding its k experts, and
their float32 outputs back (uniform routing: E[distinct ranks] = R (1 - (1 - 1/R)^k)).
The all-to-all ships x, not the n hyper-connection streams, because it would run
inside the MoE region; ours crosses the region boundary with the streams.

With --measure DIR, every bundle DIR/<name> compiled for a listed layout
(see tests/conftest.py `rank_bundle` for the model.toml) is run with one-token
prompts (so every step is a decode step) and the bytes counted by the
collectives are reported per step, beside the model's prediction for B = 1;
then with a 132-token prompt, for the rows each execution of a prompt chunk
takes over the chunk's tokens, each row counted at the share of its work the
rank does there (`prompt_rows_per_rank_over_chunk`: runtime/stats.py
`SLICED`: the MoE's experts, the engram's kv and the head compute each row with
a rank's column slice, 1 / d of it), and as whole rows
(`prompt_rows_taken_per_execution_over_chunk`). Both are 1 plus the last
chunk's padding where every rank of a token group computes every row the same
way; the layout "cp=ep=4,divided" is cp=ep=4 compiled with [prompt] rows =
"divided", docs/ranks.md "Dividing a prompt's rows").
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
    "cp=ep=4,divided": (1, 4, 4),  # [prompt] rows = "divided": the decode the same, prompt rows divided
    "ep=8": (1, 8, 1),
    "cp=ep=8": (1, 8, 8),
}
DTYPE_BYTES = {"fp32": 4, "bf16": 2}


def predicted(text, tp: int, ep: int, cp: int, B: int, act_bytes: int, context: int) -> dict:
    """Bytes one rank sends per decode step at a `context`-position bucket, per collective
    (compiler/step_cost.collective_bytes, what `deepinfer plan` models), and the all-to-all comparison."""
    from deepinfer.bundles.topology import Topology
    from deepinfer.compiler.step_cost import collective_bytes

    topo = Topology(tp=tp, ep=ep, cp=cp)
    D, k = text.hidden_size, text.num_experts_per_tok
    R = topo.world
    out = collective_bytes(text, topo, B, act_bytes, context)
    a2a = 0
    if ep > 1:
        distinct = R * (1 - (1 - 1 / R) ** k)
        remote = distinct * (R - 1) / R
        tokens = B if topo.dispatch else B / R  # replicated tokens: each rank routes its share
        a2a = round(text.num_hidden_layers * tokens * remote * (D * act_bytes + D * 4))
    return {"collectives": out, "total": sum(out.values()), "all_to_all": a2a}


RELEASE_CONTEXTS = (8192, 65536, 1048576)
RELEASE_COLLECTIVES = (
    "cp selection all-gather",
    "cp attention max all-gather",
    "cp attention all-reduce",
    "logits all-gather",
    "ep all-reduce",
)


def release_rows() -> list[dict]:
    """Each collective's bytes per rank per decode step at the release's shapes (EP = CP = 64, one
    token group, bf16 activations), batch 1 and 8, contexts 8K, 64K and 1M."""
    from deepinfer.regions.config import load_config

    text = load_config(ROOT / "examples" / "release").text
    rows = []
    for B in (1, 8):
        for context in RELEASE_CONTEXTS:
            p = predicted(text, 1, 64, 64, B, DTYPE_BYTES["bf16"], context)
            sent = p["collectives"]
            rows.append({"batch": B, "context": context, **{k: sent[k] for k in RELEASE_COLLECTIVES}})
    return rows


def selection_growth() -> list[dict]:
    """How the selection merge grows with cp and k at the release (batch 1, 1M context): a rank sends
    its own K best per index layer whatever cp, receives (cp - 1) times that and merges cp x K."""
    from deepinfer.compiler.step_cost import divided_merges
    from deepinfer.regions.config import load_config

    text = load_config(ROOT / "examples" / "release").text
    sent = divided_merges(text, 1, 1, DTYPE_BYTES["bf16"], RELEASE_CONTEXTS[-1])
    per_rank = sent["cp selection all-gather"]
    index_layers = sum(text.layer_kind(i) in ("source", "reindex") for i in range(text.num_hidden_layers))
    return [
        {
            "cp": cp,
            "sent": per_rank,
            "received": (cp - 1) * per_rank,
            "merged_per_index_layer": cp * text.index_topk,
            "index_layers": index_layers,
        }
        for cp in (2, 8, 64)
    ]


LONG_PROMPT = [0] + [(7 * i) % 250 + 3 for i in range(131)]  # 132 tokens: 17 chunks of the tiny buckets' 8


def measure(bundle: Path, steps: int) -> dict:
    """Run a compiled bundle with a one-token prompt (every step a decode step, all in its smallest
    context bucket) and count each rank's bytes per step; then a 132-token prompt, whose chunks'
    executions the leader counts (`PromptRows.share_over_chunk`: the rows' work an execution of a
    prompt chunk does over the chunk's tokens, and `rows_over_chunk`, its rows whole; a chunk run as
    micro-batches, regions/micro.py, counts each call site once, its rows summed over the
    micro-batches)."""
    from deepinfer.bundles import manifest_io
    from deepinfer.runtime import RunOptions, generate

    run = generate(bundle, [[0]], RunOptions(max_new_tokens=steps, threads=1))
    decode_steps = run.stats.steps
    per_rank = {r: {k: v / decode_steps for k, v in sent.items()} for r, sent in run.sent.items()}
    m = manifest_io.read(bundle)
    prompt = generate(bundle, [LONG_PROMPT], RunOptions(max_new_tokens=1, threads=1)).stats
    return {
        "steps": decode_steps,
        "context": m.buckets.context_sizes[0],
        "per_rank": per_rank,
        "prompt_chunks": prompt.prompt.steps,
        "prompt_rows_per_rank_over_chunk": prompt.prompt.share_over_chunk,
        "prompt_rows_taken_per_execution_over_chunk": prompt.prompt.rows_over_chunk,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", type=Path, help="a V4.1 config.json (default: the tiny model's)")
    ap.add_argument("--batch", type=int, default=1, help="decode sequences per token group")
    ap.add_argument("--dtype", choices=DTYPE_BYTES, default="fp32", help="activation dtype")
    ap.add_argument("--measure", type=Path, help="a folder of compiled bundles named like the layouts")
    ap.add_argument("--steps", type=int, default=4, help="decode steps per measured run")
    ap.add_argument("--context", type=int, default=48, help="the context bucket of the predicted steps")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from deepinfer.bundles.layout import MANIFEST_FILE
    from deepinfer.regions.config import load_config, parse_config
    from deepinfer.regions.tiny import tiny_config

    model = load_config(args.config.parent) if args.config else parse_config(tiny_config(), "tiny")
    text = model.text
    rows, measured = [], {}
    for name, (tp, ep, cp) in LAYOUTS.items():
        act = DTYPE_BYTES[args.dtype]
        rows.append({"layout": name, **predicted(text, tp, ep, cp, args.batch, act, args.context)})
        bundle = args.measure / name if args.measure else None
        if bundle is not None and (bundle / MANIFEST_FILE).exists():
            got = measure(bundle, args.steps)
            model_b1 = predicted(text, tp, ep, cp, 1, act, got["context"])["collectives"]
            measured[name] = {**got, "predicted_b1": model_b1}
    err = sys.stderr if args.json else sys.stdout
    print(
        f"bytes per rank per decode step: {text.num_hidden_layers} layers, hidden {text.hidden_size} x "
        f"hc {text.hc_mult}, {text.n_routed_experts} experts top-{text.num_experts_per_tok}, batch "
        f"{args.batch} per token group, {args.dtype} activations, context bucket {args.context}",
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
            f"measured {name} (rank 0, {m['steps']} steps at context {m['context']}): "
            + ", ".join(f"{k} {v:,.0f} (model {m['predicted_b1'].get(k, 0):,})" for k, v in sent.items()),
            file=err,
        )
        print(
            f"  a {len(LONG_PROMPT)}-token prompt in {m['prompt_chunks']} chunks: an execution does "
            f"{m['prompt_rows_per_rank_over_chunk']:.3f} x a chunk's tokens of rows' work and takes "
            f"{m['prompt_rows_taken_per_execution_over_chunk']:.3f} x of rows (1: every rank computes every row)",
            file=err,
        )
    release, growth = release_rows(), selection_growth()
    print("\nrelease (EP = CP = 64, bf16): bytes a rank sends per decode step", file=err)
    short = ["selection", "attn max", "attn all-reduce", "logits", "MoE all-reduce", "cp/MoE"]
    print(f"{'batch':>5}{'context':>10}" + "".join(f"{h:>17}" for h in short), file=err)
    for r in release:
        cp_bytes = sum(r[k] for k in RELEASE_COLLECTIVES[:3])
        figures = [f"{r[k]:>17,}" for k in RELEASE_COLLECTIVES] + [f"{cp_bytes / r['ep all-reduce']:>17.2%}"]
        print(f"{r['batch']:>5}{r['context']:>10,}" + "".join(figures), file=err)
    print("selection merge at the release, batch 1, 1M context, by cp (K = index_topk per index layer):", file=err)
    for g in growth:
        print(
            f"  cp {g['cp']:>2}: sends {g['sent']:,} B, receives {g['received']:,} B, merges "
            f"{g['merged_per_index_layer']:,} candidates in each of {g['index_layers']} index layers",
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
                    "prompt_rows_per_rank_over_chunk": {
                        n: m["prompt_rows_per_rank_over_chunk"] for n, m in measured.items()
                    },
                    "prompt_rows_taken_per_execution_over_chunk": {
                        n: m["prompt_rows_taken_per_execution_over_chunk"] for n, m in measured.items()
                    },
                    "release": release,
                    "selection_growth": growth,
                }
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
