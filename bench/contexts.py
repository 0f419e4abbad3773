"""What context buckets save at the release's schedule: the compressed entries a decode step scores and addresses.

    python bench/contexts.py [--contexts 8192,65536,1048576] [--block-size 128] [--cp 64] [--json]

With static shapes, every compressed attention layer addresses its sequence's whole block table of
compressed KV (and, where it selects, scores that many index keys), whatever the sequence's length.
For the release's 40-layer schedule (MODEL.md: ratios [0, 0] + [2] * 18 + [1] * 20, kv sources
2, 8, 14, 20, index sources 2, 8, ... 36) this prints, per context bucket, the width each kind of
layer scores, and per decode step and sequence the entries scored over the index layers and the
compressed KV every compressed layer's graph addresses (its block table's pages, bf16 latents of
head_dim 512: an upper bound on what it reads, as a compiler may fuse the page gather with the
top-k gather). Beside the entries scored per step, those each rank scores once the paged pools
are divided block-wise over `--cp` context-parallel ranks (a sequence's block j on cp rank j % cp:
its share of the block table, rounded up). The widths are the executables' own
(`Geometry.at_context`, the compiler's plan of the layers); nothing runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from deepinfer.regions.config import parse_config
from deepinfer.regions.state import Geometry
from deepinfer.regions.step import plan_layers
from deepinfer.regions.synthetic import release_config


def release_text_config():
    return parse_config(release_config(), "the release (MODEL.md)").text


def widths(contexts: list[int], block_size: int, cp: int = 64) -> list[dict]:
    c = release_text_config()
    plans = plan_layers(c)
    full = Geometry(slots=2, blocks=2, block_size=block_size, max_blocks=1)
    out = []
    for context in contexts:
        g = full.at_context(context)
        scoring = [p for p in plans if p.attn in ("source", "reindex")]
        scored = sum(g.compressed_width(p.ratio) for p in scoring)
        share = dataclasses.replace(g, max_blocks=-(-g.max_blocks // cp))  # one cp rank's blocks of the table
        scored_per_rank = sum(share.compressed_width(p.ratio) for p in scoring)
        addressed = sum(g.compressed_width(p.ratio) for p in plans if p.ratio)
        out.append(
            {
                "context": context,
                "table_blocks": g.max_blocks,
                "scored_per_layer": {
                    f"ratio {r}": g.compressed_width(r) for r in sorted({p.ratio for p in plans if p.ratio})
                },
                "topk": c.index_topk,
                "scored_per_step": scored,
                "cp": cp,
                "scored_per_step_per_rank": scored_per_rank,
                "addressed_per_step": addressed,
                "addressed_gib_per_step": addressed * c.head_dim * 2 / 2**30,
            }
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="8192,65536,1048576", help="context buckets (positions)")
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--cp", type=int, default=64, help="context-parallel ranks the paged pools divide over")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    rows = widths([int(x) for x in a.contexts.split(",")], a.block_size, a.cp)
    if a.json:
        print(json.dumps(rows))
        return
    per_rank = f"scored/step/rank (cp {a.cp})"
    print(
        f"{'context':>9} {'blocks':>7} {'scored/layer (r1, r2)':>22} {'scored/step':>12} {per_rank:>25} "
        f"{'KV addressed/step':>18}"
    )
    for r in rows:
        per = ", ".join(str(v) for v in r["scored_per_layer"].values())
        print(
            f"{r['context']:>9} {r['table_blocks']:>7} {per:>22} {r['scored_per_step']:>12} "
            f"{r['scored_per_step_per_rank']:>25} {r['addressed_gib_per_step']:>14.3f} GiB"
        )
    print(
        f"per decode step and sequence, bf16 latents of {release_text_config().head_dim}; "
        "top-k selects at most 512 of the scored entries"
    )


if __name__ == "__main__":
    main()
