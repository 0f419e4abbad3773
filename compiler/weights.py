"""The weight pass's plan: which checkpoint bytes go to which bundle file, for every rank.

For each region kind and each of its weights, the layers of that kind are stacked along a
new first dimension, so binding layer i is a slice view (no copy per call). A stack that
every rank holds whole (attention without tp, the router, norms, ...) is written once, to
`weights/shared/<kind>.safetensors`, and referenced by every rank's manifest entry; the
others go to `weights/rank-R/<kind>.safetensors` (with one rank, everything goes there).
What a rank holds of a tensor is `compiler/shard.py`'s cut. Host-resident tensors (the token
embedding, the vision tower) go to `host/`.

The weight recipe (`RECIPES`, by target: [quant] recipe in model.toml) says how fp8 weights
are stored. `release` keeps the release's formats (fp8 e4m3fn codes, [32, 32] ue8m0 scales,
fp4 pairs), as uint8: the bytes are the checkpoint's. `e4m3` writes IEEE-like e4m3 codes
(what Neuron's float8_e4m3 reads): a scale block holding a magnitude over 240 is halved and
its ue8m0 byte gains one (quant/rescale.convert_format). Either way a checkpoint that ships
float32 block scales (DeepSeek-V3's `weight_scale_inv`, [128, 128]) is rescaled to ue8m0 on
[32, 32] blocks through quant/'s LUT path. Each tensor's manifest entry names its format.

Nothing here reads tensor data: the plan is headers and offsets (`compiler/stream.py` moves
the bytes). Every source tensor is checked here, dtype and shape, naming its file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from deepinfer.bundles import layout
from deepinfer.bundles.manifest import HostFile, TensorShape, WeightStack
from deepinfer.bundles.safetensors import TensorInfo
from deepinfer.compiler import shard
from deepinfer.compiler.stream import Derived, Fp8Convert, OutFile, OutTensor, Piece
from deepinfer.errors import CheckpointError
from deepinfer.quant.formats import FP8_E4M3, FP8_E4M3FN
from deepinfer.quant.rescale import convert_format
from deepinfer.regions.base import WeightSpec
from deepinfer.regions.checkpoint import Checkpoint, release_block

if TYPE_CHECKING:                      # types only: the weights' cache key must not see the region classes
    from deepinfer.compiler.plan import KindPlan, RegionPlan

SAFETENSORS_DTYPES = {"uint8": "U8", "int8": "I8", "bfloat16": "BF16", "float32": "F32", "float16": "F16",
                      "int64": "I64", "int32": "I32", "bool": "BOOL"}
SHARED = "shared"
PADDED = ("table", "table_s")          # engram tables: a layer's own rows, then zeros to the largest
FORMATS = {"F8_E4M3": "e4m3fn", "F8_E8M0": "ue8m0-u8-row-major", "I8": "e2m1-x2-u8", "BF16": "bf16", "F32": "f32"}


@dataclass(frozen=True)
class Recipe:
    """How the weight pass stores fp8 weights: the codes' format (quant/formats.py names);
    scales are ue8m0 bytes, row-major (quant/pack.py LAYOUT_U8), the layout the targets'
    in-graph decoders read."""

    name: str
    fp8_format: str

    def formats(self, ckpt_dtype: str) -> str:
        """The manifest's format name of a tensor stored from `ckpt_dtype`."""
        return self.fp8_format if ckpt_dtype == "F8_E4M3" else FORMATS[ckpt_dtype]


RECIPES = {"release": Recipe("release", FP8_E4M3FN), "e4m3": Recipe("e4m3", FP8_E4M3)}


def _st_dtype(spec: WeightSpec) -> str:
    return SAFETENSORS_DTYPES[str(spec.dtype).removeprefix("torch.")]


def _source(ckpt: Checkpoint, name: str, spec: WeightSpec, padded: bool) -> TensorInfo:
    """The checkpoint tensor `name`, checked against the spec (rows may be fewer when padded)."""
    t = ckpt.tensor(name)
    path = ckpt.files[name]
    if t.dtype != spec.ckpt_dtype:
        raise CheckpointError(f"{path}: tensor {name} has dtype {t.dtype}, expected {spec.ckpt_dtype}")
    if not _fits(t.shape, spec, padded):
        raise CheckpointError(f"{path}: tensor {name} has shape {list(t.shape)}, expected {list(spec.shape)}")
    return t


def _fits(shape: tuple[int, ...], spec: WeightSpec, padded: bool) -> bool:
    """`shape` is the spec's, or (a padded tensor) has no more rows than it."""
    return shape == spec.shape or (padded and shape[1:] == spec.shape[1:] and shape[0] <= spec.shape[0])


def _stored(ckpt: Checkpoint, name: str, spec: WeightSpec, padded: bool, recipe: Recipe) -> TensorInfo | Derived:
    """The source of weight `name`: the checkpoint tensor itself, or the codes or scales part of
    its fp8 conversion where the recipe changes the format or the checkpoint scales by float32."""
    weight = ckpt.fp8_weight(spec, name)
    if weight is None or (recipe.fp8_format == FP8_E4M3FN and ckpt.tensor(ckpt.scale_of(weight)).dtype == "F8_E8M0"):
        return _source(ckpt, name, spec, padded)             # stored as released: the bytes as they are
    codes, scales, src = ckpt.fp8_blocks(weight)
    dst = release_block(src) if scales.dtype == "F32" else src
    part = Fp8Convert(codes, scales, src, dst, recipe.fp8_format).part(
        "codes" if spec.ckpt_dtype == "F8_E4M3" else "scales")
    if not _fits(part.shape, spec, padded):
        raise CheckpointError(f"{part.path}: tensor {name} has shape {list(part.shape)} as stored, "
                              f"expected {list(spec.shape)}")
    return part


def in_format(specs: list[WeightSpec], tensors: dict[str, torch.Tensor], fmt: str) -> dict[str, torch.Tensor]:
    """A region's weights (release formats, by buffer name) with every fp8 weight and its ue8m0
    scales converted to `fmt` in memory, as the weight pass writes them (quant/rescale's
    convert_format, per scale block). What a check of a converting target's graph runs on."""
    if fmt == FP8_E4M3FN:
        return tensors
    out = dict(tensors)
    by_key = {s.key: s for s in specs}
    for s in specs:
        if s.ckpt_dtype != "F8_E4M3" or s.experts:
            continue
        scale = by_key[s.key.removesuffix("weight") + "scale"]
        codes, scales = tensors[s.name].numpy(), tensors[scale.name].numpy()
        per_row = scales.shape[0] == codes.shape[0] > 1              # engram tables: one scale row per row
        block = (1 if per_row else 32, 32)
        new, new_s = convert_format(codes, scales, block, fmt)
        out[s.name], out[scale.name] = torch.from_numpy(new), torch.from_numpy(new_s)
    return out


def _row_bytes(shape: tuple[int, ...], itemsize: int) -> int:
    """Bytes of one row (dim 0) of a tensor of `shape` (a vector's rows are its elements)."""
    return math.prod(shape[1:]) * itemsize if len(shape) > 1 else itemsize


def _pieces(ckpt: Checkpoint, kp, spec: WeightSpec, full: WeightSpec, cut: shard.Cut, recipe: Recipe) -> list[Piece]:
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
        src = _stored(ckpt, prefix + full.key, full, spec.name in PADDED, recipe)
        rows = cut.rows or (0, src.shape[0] if src.shape else 1)
        out.append(Piece(src, rows, cut.cols, i * slot, _row_bytes(spec.shape, itemsize)))
    return out


def stack_files(spec, plan: RegionPlan, ckpt: Checkpoint, staging: Path,
                wanted=None) -> tuple[list[OutFile], dict[str, list[WeightStack]]]:
    """The output files of every rank's stacks, and each rank's manifest entries.

    `wanted(rel)`: whether file `rel` (relative to the bundle) must be written (a cached one
    is fetched instead); its entries are made either way."""
    c, topo, recipe = spec.model.text, spec.topology, spec.recipe
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
                    "torch."), file=where, format=recipe.formats(s.ckpt_dtype))
                if where == SHARED and rank > 0:
                    continue                                   # planned once, for rank 0
                if wanted is not None and not wanted(rel):
                    continue
                f = files.setdefault(rel, OutFile(str(staging / rel)))
                f.tensors.append(OutTensor(s.name, _st_dtype(s), (len(kp.layers), *s.buffer_shape),
                                           _pieces(ckpt, kp, s, full, shard.cut(kind, s.name, c, topo, rank), recipe)))
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


def source_names(kp: KindPlan, ckpt: Checkpoint) -> list[str]:
    """The checkpoint tensors a kind's stacks are built from (an fp8 weight's codes and
    scales both feed each of them where the recipe converts)."""
    names = {}
    for spec in kp.full_specs:
        for layer in kp.layers:
            prefix = "" if layer < 0 else f"layers.{layer}."
            keys = [spec.key.format(e=e) for e in range(spec.experts)] if spec.experts else [spec.key]
            for k in keys:
                names.update(dict.fromkeys(ckpt.sources(spec, prefix + k)))
    return list(names)
