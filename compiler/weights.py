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
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file

from deepinfer.bundles import layout
from deepinfer.bundles.manifest import HostFile, TensorShape, WeightStack
from deepinfer.regions.base import WeightSpec
from deepinfer.regions.checkpoint import Checkpoint

if TYPE_CHECKING:                      # a type only: the weights' cache key must not see the region classes
    from deepinfer.compiler.plan import KindPlan


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


def source_names(kp: KindPlan) -> list[str]:
    """The checkpoint tensors a kind's stacks are built from."""
    names = []
    for spec in kp.full_specs:
        for layer in kp.layers:
            prefix = "" if layer < 0 else f"layers.{layer}."
            keys = [spec.key.format(e=e) for e in range(spec.experts)] if spec.experts else [spec.key]
            names += [prefix + k for k in keys]
    return names


def kind_entry(kind: str, kp: KindPlan, rank: int = 0) -> WeightStack:
    """A kind's manifest entry (digest added when the manifest is written)."""
    return WeightStack(kind=kind, path=layout.weights_path(rank, kind), layers=tuple(kp.layers),
                       tensors={s.name: TensorShape(shape=(len(kp.layers), *s.buffer_shape),
                                                    dtype=str(s.dtype).removeprefix("torch."))
                                for s in kp.region.specs})


def write_kind(ckpt: Checkpoint, kind: str, kp: KindPlan, out: Path, rank: int = 0, shard=None) -> WeightStack:
    """Write one kind's stacks for `rank` to its safetensors file under `out`; returns its
    manifest entry. `shard(name, full tensor, shape=)` cuts the rank's part (compiler/shard.py)."""
    tensors = {}
    for spec, full in zip(kp.region.specs, kp.full_specs):
        stack = torch.empty((len(kp.layers),) + spec.buffer_shape, dtype=spec.dtype)
        for i, layer in enumerate(kp.layers):
            prefix = "" if layer < 0 else f"layers.{layer}."
            t = _load_padded(ckpt, prefix, full)
            stack[i] = shard(spec.name, t, shape=spec.buffer_shape) if shard else t
        tensors[spec.name] = stack
    entry = kind_entry(kind, kp, rank)
    (out / entry.path).parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / entry.path))
    return entry


def host_entries(vision: bool = False) -> dict[str, HostFile]:
    """The manifest's host-resident tensors: the token embedding (and the vision tower)."""
    out = {"embed": HostFile(path=layout.host_path(layout.HOST_EMBED_FILE), tensor="embed")}
    if vision:
        out["vision"] = HostFile(path=layout.host_path(layout.HOST_VISION_FILE), tensors="checkpoint names")
    return out


def write_host_vision(ckpt: Checkpoint, out: Path, config) -> None:
    """The vision tower, aligner and image delimiters, as stored in the checkpoint (V41Config `config`)."""
    from deepinfer.regions.vision import vision_specs

    rel = host_entries(vision=True)["vision"].path
    (out / rel).parent.mkdir(parents=True, exist_ok=True)
    tensors = {name: ckpt.get(name, dtype, shape).contiguous()
               for name, (shape, dtype) in vision_specs(config.vision, config.text.hidden_size).items()}
    save_file(tensors, str(out / rel))


def write_host(ckpt: Checkpoint, out: Path, vocab: int, hidden: int) -> None:
    rel = host_entries()["embed"].path
    (out / rel).parent.mkdir(parents=True, exist_ok=True)
    save_file({"embed": ckpt.get("embed.weight", "BF16", (vocab, hidden)).contiguous()}, str(out / rel))
