"""The widest sort / top-k left in the trn2 target's HLO modules at a context (neuronx-cc fails above 16,384).

    python bench/selection.py [--context 1048576] [--kinds attn_source_r1_cand,...] [--reference] [--json]

Lowers every region kind of the tiny checkpoint (generated into a temporary directory) with the
release's selection sizes (index_topk 512, candidate_topk_blocks 2048 of candidate_block_size 8;
the compressed widths depend only on the context and the ratios, not on the model's width) for a
(1, 1) decode step whose block table spans `--context` positions, and reads every sort and top-k
back from each HloModuleProto (compiler/targets/hlo.selection_widths). Nothing runs on XLA:CPU.
`--reference` lowers the selection as the reference does (one stable sort over the whole row, as
before the blockwise lowering) and reports instead of refusing, to show what the lowering avoids.
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time
from pathlib import Path

import torch

from deepinfer.compiler.plan import plan_regions
from deepinfer.compiler.targets import hlo, trn2
from deepinfer.compiler.trace import trace
from deepinfer.kernels.registry import LOWERINGS
from deepinfer.regions.config import load_config
from deepinfer.regions.state import Geometry
from deepinfer.regions.tiny import make_tiny

RELEASE_SELECTION = {"index_topk": 512, "candidate_topk_blocks": 2048, "candidate_block_size": 8}
BLOCK_SIZE = 16


def measure(context: int, kinds: list[str] | None, work: Path) -> list[dict]:
    ckpt = make_tiny(work / "tiny")
    config_path = ckpt / "config.json"
    config = json.loads(config_path.read_text())
    config["text_config"].update(RELEASE_SELECTION, max_position_embeddings=context)
    config_path.write_text(json.dumps(config))
    regions = plan_regions(load_config(ckpt).text, torch.float32, True).kinds
    g = Geometry(slots=2, blocks=context // BLOCK_SIZE + 1, block_size=BLOCK_SIZE, max_blocks=context // BLOCK_SIZE)
    target = trn2.Trn2Target("neff", {})
    rows = []
    for kind in kinds or regions:
        start = time.perf_counter()
        region = regions[kind].region
        ep, sig = trace(region, 1, 1, g, dynamic=False)
        out = work / f"{kind}.hlo.pb"
        target.emit(target.lower(ep), [s.name for s in sig.all], region.output_names(), out)
        widths = hlo.selection_widths(out.read_bytes())
        rows.append(
            {
                "kind": kind,
                "widths": sorted({w for _, w in widths}),
                "ops": sorted({op for op, _ in widths}),
                "hlo_bytes": out.stat().st_size,
                "seconds": round(time.perf_counter() - start, 1),
                "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
            }
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=1048576)
    p.add_argument("--kinds", default="", help="comma-separated region kinds (default: all)")
    p.add_argument("--reference", action="store_true", help="lower the selection as one full-row sort")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.reference:
        LOWERINGS["trn2"].pop("top_indices")
        trn2.MAX_SELECTION_WIDTH = 1 << 62
    with tempfile.TemporaryDirectory() as tmp:
        rows = measure(args.context, [k for k in args.kinds.split(",") if k] or None, Path(tmp))
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    for r in rows:
        print(
            f"{r['kind']:24s} sort/top-k widths {r['widths']}  (HLO {r['hlo_bytes']} B, {r['seconds']} s, "
            f"peak RSS {r['peak_rss_mib']} MiB)"
        )
    print(f"widest at context {args.context}: {max((w for r in rows for w in r['widths']), default=0)}")


if __name__ == "__main__":
    main()
