"""The weight pass's plan: which checkpoint bytes go to which bundle file, for every rank.

For each region kind and each of its weights, the layers of that kind are stacked along a
new first dimension, so binding layer i is a slice view (no copy per call). A stack that
every rank holds whole (attention without tp, the router, norms, ...) is written once, to
`weights/shared/<kind>.safetensors`, and referenced by every rank's manifest entry; the
others go to `weights/rank-R/<kind>.safetensors` (with one rank, everything goes there).
What a rank holds of a tensor is `compiler/shard.py`'s cut. The `release` recipe keeps the
release's formats (fp8 e4m3fn codes, [32, 32] ue8m0 scales, fp4 pairs), as uint8.
Host-resident tensors (the token embedding, the vision tower) go to `host/`.

Nothing here reads tensor data: the plan is headers and offsets (`compiler/stream.py` moves
the bytes). Every source tensor is checked here, dtype and shape, naming its file.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from deepinfer.bundles import layout
from deepinfer.bundles.manifest import HostFile, TensorShape, WeightStack
from deepinfer.bundles.safetensors import TensorInfo
from deepinfer.compiler import shard
from deepinfer.compiler.stream import OutFile, OutTensor, Piece
from deepinfer.errors import CheckpointError
from deepinfer.regions.base import WeightSpec
from deepinfer.regions.checkpoint import Checkpoint

if TYPE_CHECKING:                      # types only: the weights' cache key must not see the region classes
    from deepinfer.compiler.plan import KindPlan, RegionPlan

SAFETENSORS_DTYPES = {"uint8": "U8", "int8": "I8", "bfloat16": "BF16", "float32": "F32", "float16": "F16",
                      "int64": "I64", "int32": "I32", "bool": "BOOL"}
SHARED = "shared"
PADDED = ("table", "table_s")          # engram tables: a layer's own rows, then zeros to the largest
FORMATS = {"F8_E4M3": "e4m3fn", "F8_E8M0": "ue8m0-u8-row-major", "I8": "e2m1-x2-u8", "BF16": "bf16", "F32": "f32"}


def _st_dtype(spec: WeightSpec) -> str:
    return SAFETENSORS_DTYPES[str(spec.dtype).removeprefix("torch.")]


def _source(ckpt: Checkpoint, name: str, spec: WeightSpec, padded: bool) -> TensorInfo:
    """The checkpoint tensor `name`, checked against the spec (rows may be fewer when padded)."""
    t = ckpt.tensor(name)
    path = ckpt.files[name]
    if t.dtype != spec.ckpt_dtype:
        raise CheckpointError(f"{path}: tensor {name} has dtype {t.dtype}, expected {spec.ckpt_dtype}")
    ok = t.shape == spec.shape or (padded and t.shape[1:] == spec.shape[1:] and t.shape[0] <= spec.shape[0])
    if not ok:
        raise CheckpointError(f"{path}: tensor {name} has shape {list(t.shape)}, expected {list(spec.shape)}")
    return t


def _row_bytes(shape: tuple[int, ...], itemsize: int) -> int:
    """Bytes of one row (dim 0) of a tensor of `shape` (a vector's rows are its elements)."""
    return math.prod(shape[1:]) * itemsize if len(shape) > 1 else itemsize


def _pieces(ckpt: Checkpoint, kind: str, kp, spec: WeightSpec, full: WeightSpec, cut: shard.Cut) -> list[Piece]:
    """Where each layer's part of weight `spec` comes from, as pieces of its stack [layers, ...]."""
    if cut.zero:
        return []
    itemsize = spec.dtype.itemsize
    slot = math.prod(spec.buffer_shape) * itemsize             # one layer of the stack
    out = []
    for i, layer in enumerate(kp.layers):
        prefix = "" if layer < 0 else f"layers.{layer}."
        if full.experts:                                       # one checkpoint tensor per expert
            e0, e1 = cut.experts or (0, full.experts)
            per_expert = math.prod(spec.shape) * itemsize
            for e in range(e0, e1):
                src = _source(ckpt, prefix + full.key.format(e=e), full, False)
                out.append(Piece(src, (0, src.shape[0]), None, i * slot + (e - e0) * per_expert, src.row_bytes))
            continue
        src = _source(ckpt, prefix + full.key, full, spec.name in PADDED)
        rows = cut.rows or (0, src.shape[0] if src.shape else 1)
        out.append(Piece(src, rows, cut.cols, i * slot, _row_bytes(spec.shape, itemsize)))
    return out


def stack_files(spec, plan: RegionPlan, ckpt: Checkpoint, staging: Path,
                wanted=None) -> tuple[list[OutFile], dict[str, list[WeightStack]]]:
    """The output files of every rank's stacks, and each rank's manifest entries.

    `wanted(rel)`: whether file `rel` (relative to the bundle) must be written (a cached one
    is fetched instead); its entries are made either way."""
    c, topo = spec.model.text, spec.topology
    files: dict[str, OutFile] = {}
    entries: dict[str, list[WeightStack]] = {}
    for kind, kp in plan.kinds.items():
        shared = {s.name for s in kp.region.specs
                  if topo.world > 1 and shard.replicated(kind, s.name, c, topo)}
        for rank in range(topo.world):
            tensors, paths = {}, {}
            for s, full in zip(kp.region.specs, kp.full_specs):
                where = SHARED if s.name in shared else "rank"
                rel = layout.shared_weights_path(kind) if where == SHARED else layout.weights_path(rank, kind)
                paths[where] = rel
                tensors[s.name] = TensorShape(shape=(len(kp.layers), *s.buffer_shape), dtype=str(s.dtype).removeprefix(
                    "torch."), file=where, format=FORMATS[s.ckpt_dtype])
                if where == SHARED and rank > 0:
                    continue                                   # planned once, for rank 0
                if wanted is not None and not wanted(rel):
                    continue
                f = files.setdefault(rel, OutFile(str(staging / rel)))
                f.tensors.append(OutTensor(s.name, _st_dtype(s), (len(kp.layers), *s.buffer_shape),
                                           _pieces(ckpt, kind, kp, s, full, shard.cut(kind, s.name, c, topo, rank))))
            entries.setdefault(layout.rank_key(rank), []).append(WeightStack(
                kind=kind, path=paths.get("rank"), shared=paths.get(SHARED), layers=tuple(kp.layers),
                tensors=tensors))
    return list(files.values()), entries


def host_entries(vision: bool = False) -> dict[str, HostFile]:
    """The manifest's host-resident tensors: the token embedding (and the vision tower)."""
    out = {"embed": HostFile(path=layout.host_path(layout.HOST_EMBED_FILE), tensor="embed")}
    if vision:
        out["vision"] = HostFile(path=layout.host_path(layout.HOST_VISION_FILE), tensors="checkpoint names")
    return out


def _whole(src: TensorInfo, name: str) -> OutTensor:
    return OutTensor(name, src.dtype, src.shape, [Piece(src, (0, src.shape[0] if src.shape else 1), None, 0,
                                                         src.row_bytes)])


def host_files(model, ckpt: Checkpoint, staging: Path, wanted=None) -> list[OutFile]:
    """The token embedding, and the vision tower as checkpointed (V41Config `model`)."""
    t = model.text
    embed = WeightSpec("embed", "embed.weight", (t.vocab_size, t.hidden_size), "BF16")
    out = []
    rel = host_entries()["embed"].path
    if wanted is None or wanted(rel):
        out.append(OutFile(str(staging / rel), [_whole(_source(ckpt, embed.key, embed, False), "embed")]))
    if model.vision.num_hidden_layers > 0:
        from deepinfer.regions.vision import vision_specs

        rel = host_entries(vision=True)["vision"].path
        if wanted is None or wanted(rel):
            specs = vision_specs(model.vision, t.hidden_size)
            out.append(OutFile(str(staging / rel), [
                _whole(_source(ckpt, name, WeightSpec(name, name, shape, dtype), False), name)
                for name, (shape, dtype) in specs.items()]))
    return out


def source_names(kp: KindPlan) -> list[str]:
    """The checkpoint tensors a kind's stacks are built from."""
    names = []
    for spec in kp.full_specs:
        for layer in kp.layers:
            prefix = "" if layer < 0 else f"layers.{layer}."
            keys = [spec.key.format(e=e) for e in range(spec.experts)] if spec.experts else [spec.key]
            names += [prefix + k for k in keys]
    return names
