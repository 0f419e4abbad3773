"""Engram placement at the release config: per-rank device bytes, host bytes, bytes per decode step.

    .venv/bin/python bench/engram.py [--ep 64] [--cp 64] [--batch 64]

Writes the release's config.json (MODEL.md: 40 layers, 384 experts, the released schedule,
engram rows [384006168, 384016682], the released vision tower) to a temporary directory,
plans a trn2 (LNC 2) compile of it at EP = CP = 64 without any checkpoint tensor, and prints
as JSON what the compile's own placement and budget code (`compiler/weights.py`,
`compiler/budget.py`) say per rank: device weights by region kind, state pools, host files;
and, from the engram region's own signature, the bytes the host hands the engram region per
decode step and engram layer (its `rows` and `rows_s` inputs) beside what decoding those rows
to bf16 on the host would hand it, and the hashes the leader broadcasts per step.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

from common import toml_text

from deepinfer.regions.synthetic import release_config

BLOCK = 128


def measure(ep: int, cp: int, batch: int, context: int) -> dict:
    from deepinfer.compiler import budget, pipeline
    from deepinfer.compiler.config import load_compile_config

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "release"
        ckpt.mkdir()
        (ckpt / "config.json").write_text(json.dumps(release_config()))
        toml = Path(tmp) / "model.toml"
        # every sequence at full context (block 0 scratch), the usable blocks a multiple of cp (divided over it)
        blocks = -(-batch * -(-context // BLOCK) // cp) * cp + 1
        toml.write_text(
            toml_text(
                {
                    "model": {"checkpoint": ckpt, "dtype": "bf16"},
                    "target": {"name": "trn2", "executable": "neff", "options": {"lnc": 2}},
                    "buckets": {"batch": [1, batch], "tokens": [1], "max_context": context},
                    "kv": {"block_size": BLOCK, "num_blocks": blocks},
                    "parallel": {"tp": 1, "ep": ep, "cp": cp},
                }
            )
        )
        spec = pipeline.parse(load_compile_config(toml), True, lambda m: None)
        plan = pipeline.plan(spec, lambda m: None)
        d = budget.breakdown(spec, plan)
    c = spec.model.text
    sig = {s.name: s for s in plan.kinds["engram"].region.input_specs(batch, 1, spec.geometry)}
    fp8 = sum(math.prod(sig[n].shape) * sig[n].dtype.itemsize for n in ("rows", "rows_s"))
    rows = batch * c.engram_hash_heads
    return {
        "topology": spec.topology.to_dict(),
        "device_weights_per_rank": sum(d.weights.values()),
        "device_weights_by_kind": d.weights,
        "pools_per_rank": sum(d.pools.values()),
        "limit_per_rank": d.limit,
        "host_bytes": d.host,
        "engram_step": {
            "batch": batch,
            "rows": rows,
            "fp8_rows_and_scales_bytes": fp8,
            "bf16_decoded_bytes": rows * c.engram_head_dim * 2,
            "hashes_broadcast_bytes": batch * len(c.engram_layer_ids) * c.engram_hash_heads * 8,
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ep", type=int, default=64)
    ap.add_argument("--cp", type=int, default=64)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=16384, help="max_context: sizes the KV pools only")
    a = ap.parse_args()
    print(json.dumps(measure(a.ep, a.cp, a.batch, a.context), indent=2))


if __name__ == "__main__":
    main()
