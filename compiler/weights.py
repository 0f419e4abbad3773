"""Weight preprocessing: checkpoint tensors -> per-kind, layer-major stacks on disk.

For each region kind and each of its weights, the layers of that kind are
stacked along a new first dimension, so binding layer i is a slice view (no
copy per call, one file per kind). The `release` recipe keeps the release's
formats (fp8 e4m3fn codes, [32, 32] ue8m0 scales, fp4 pairs) as uint8.
Host-resident tensors (the token embedding) go to `host/`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from safetensors.torch import save_file

from deepinfer.bundles import layout
from deepinfer.compiler.plan import RegionPlan
from deepinfer.regions.base import WeightSpec
from deepinfer.regions.checkpoint import Checkpoint


def _load_padded(ckpt: Checkpoint, prefix: str, spec: WeightSpec) -> torch.Tensor:
    """A region weight from the checkpoint, zero-padded to the stack's shape.

    Only engram tables differ in shape between layers (row counts); their
    extra rows are never addressed by that layer's hashes.
    """
    if spec.name in ("table", "table_s"):
        own = ckpt.info(prefix + spec.key)[1]
        t = ckpt.load_spec(prefix, dataclasses.replace(spec, shape=own))
        out = torch.zeros(spec.buffer_shape, dtype=t.dtype)
        out[: t.shape[0]] = t
        return out
    return ckpt.load_spec(prefix, spec)


def write_weights(ckpt: Checkpoint, plan: RegionPlan, out: Path, rank: int = 0,
                  progress=lambda msg: None) -> list[dict]:
    """Write one safetensors file per kind under `out`; returns their manifest entries."""
    entries = []
    for kind, kp in plan.kinds.items():
        tensors = {}
        for spec in kp.region.specs:
            shape = (len(kp.layers),) + spec.buffer_shape
            stack = torch.empty(shape, dtype=spec.dtype)
            for i, layer in enumerate(kp.layers):
                prefix = "" if layer < 0 else f"layers.{layer}."
                stack[i] = _load_padded(ckpt, prefix, spec)
            tensors[spec.name] = stack
        rel = layout.weights_path(rank, kind)
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(out / rel))
        entries.append({"kind": kind, "path": rel, "layers": kp.layers,
                        "tensors": {n: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
                                    for n, t in tensors.items()}})
        progress(f"weights {kind}: {len(kp.layers)} layer(s)")
    return entries


def write_host(ckpt: Checkpoint, out: Path, vocab: int, hidden: int) -> dict:
    rel = layout.host_path(layout.HOST_EMBED_FILE)
    (out / rel).parent.mkdir(parents=True, exist_ok=True)
    save_file({"embed": ckpt.get("embed.weight", "BF16", (vocab, hidden)).contiguous()}, str(out / rel))
    return {"embed": {"path": rel, "tensor": "embed"}}
