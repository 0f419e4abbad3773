"""The weight pass's plan: which checkpoint bytes go to which bundle file, for every rank.

For each region kind and each of its weights, the layers of that kind are stacked along a
new first dimension, so binding layer i is a slice view (no copy per call). A stack that
every rank holds whole (attention without tp, the router, norms, ...) is written once, to
`weights/shared/<kind>.safetensors`, and referenced by every rank's manifest entry; the
others go to `weights/rank-R/<kind>.safetensors` (with one rank, everything goes there).
What a rank holds of a tensor is `compiler/shard.py`'s cut. Host-resident tensors go to
`host/`, once for all ranks: the token embedding (where it is not a device region's weight:
trn2 holds it as the `embed` stack, shared by every rank), the engram tables (2 x 384M rows x 256 fp8
at release scale, 189 GiB with their scales: 8x a rank's 24 GiB of device memory; the runtime
memory-maps them and sends each step's rows to the engram region), the vision tower.
This is the placement decision: what `host_bytes` lists is never a device weight, and
the budget counts it apart (`compiler/budget.py`).

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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch

from deepinfer.bundles import layout
from deepinfer.bundles.manifest import HostFile, TensorShape, WeightStack
from deepinfer.bundles.safetensors import TensorInfo
from deepinfer.compiler import shard
from deepinfer.compiler.stream import Derived, Fp8Convert, OutFile, OutTensor, Piece
from deepinfer.errors import CheckpointError
from deepinfer.quant.formats import FP8_E4M3, FP8_E4M3FN
from deepinfer.quant.rescale import convert_format
from deepinfer.regions.base import WeightSpec, engram_table_specs
from deepinfer.regions.checkpoint import Checkpoint, release_block
from deepinfer.regions.config import V41Config

if TYPE_CHECKING:  # types only: the weights' cache key must not see the region classes or the targets
    from deepinfer.compiler.plan import KindPlan, RegionPlan
    from deepinfer.compiler.spec import Spec

SAFETENSORS_DTYPES = {
    "uint8": "U8",
    "int8": "I8",
    "bfloat16": "BF16",
    "float32": "F32",
    "float16": "F16",
    "int64": "I64",
    "int32": "I32",
    "bool": "BOOL",
}
SHARED: Literal["shared"] = "shared"
Wanted = Callable[[str], bool]  # whether a bundle file (relative path) must be written: a cached one is fetched
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


def _source(ckpt: Checkpoint, name: str, spec: WeightSpec) -> TensorInfo:
    """The checkpoint tensor `name`, checked against the spec."""
    t = ckpt.tensor(name)
    path = ckpt.files[name]
    if t.dtype != spec.ckpt_dtype:
        raise CheckpointError(f"{path}: tensor {name} has dtype {t.dtype}, expected {spec.ckpt_dtype}")
    if t.shape != spec.shape:
        raise CheckpointError(f"{path}: tensor {name} has shape {list(t.shape)}, expected {list(spec.shape)}")
    return t


def _stored(ckpt: Checkpoint, name: str, spec: WeightSpec, recipe: Recipe) -> TensorInfo | Derived:
    """The source of weight `name`: the checkpoint tensor itself, or the codes or scales part of
    its fp8 conversion where the recipe changes the format or the checkpoint scales by float32."""
    weight = ckpt.fp8_weight(spec, name)
    if weight is None or (recipe.fp8_format == FP8_E4M3FN and ckpt.tensor(ckpt.scale_of(weight)).dtype == "F8_E8M0"):
        return _source(ckpt, name, spec)  # stored as released: the bytes as they are
    codes, scales, src = ckpt.fp8_blocks(weight)
    dst = release_block(src) if scales.dtype == "F32" else src
    part = Fp8Convert(codes, scales, src, dst, recipe.fp8_format).part(
        "codes" if spec.ckpt_dtype == "F8_E4M3" else "scales"
    )
    if part.shape != spec.shape:
        raise CheckpointError(
            f"{part.path}: tensor {name} has shape {list(part.shape)} as stored, expected {list(spec.shape)}"
        )
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
        new, new_s = convert_format(codes, scales, (32, 32), fmt)
        out[s.name], out[scale.name] = torch.from_numpy(new), torch.from_numpy(new_s)
    return out


def _row_bytes(shape: tuple[int, ...], itemsize: int) -> int:
    """Bytes of one row (dim 0) of a tensor of `shape` (a vector's rows are its elements)."""
    return math.prod(shape[1:]) * itemsize if len(shape) > 1 else itemsize


def _pieces(
    ckpt: Checkpoint, kp: KindPlan, spec: WeightSpec, full: WeightSpec, cut: shard.Cut, recipe: Recipe
) -> list[Piece]:
    """Where each layer's part of weight `spec` comes from, as pieces of its stack [layers, ...]."""
    if cut.zero:
        return []
    itemsize = spec.dtype.itemsize
    slot = math.prod(spec.buffer_shape) * itemsize  # one layer of the stack
    out = []
    for i, layer in enumerate(kp.layers):
        prefix = kp.prefix(layer)
        if full.experts:  # one checkpoint tensor per expert: its rows and columns of the cut, zero-padded
            e0, e1 = cut.experts or (0, full.experts)
            per_expert = math.prod(spec.shape) * itemsize
            for e in range(e0, e1):
                expert = _source(ckpt, prefix + full.key.format(e=e), full)
                rows = cut.rows or (0, expert.shape[0])
                offset = i * slot + (e - e0) * per_expert
                out.append(Piece(expert, rows, cut.cols, offset, _row_bytes(spec.shape, itemsize)))
            continue
        src = _stored(ckpt, prefix + full.key, full, recipe)
        rows = cut.rows or (0, src.shape[0] if src.shape else 1)
        out.append(Piece(src, rows, cut.cols, i * slot, _row_bytes(spec.shape, itemsize)))
    return out


def stack_files(
    spec: Spec, plan: RegionPlan, ckpt: Checkpoint, staging: Path, wanted: Wanted | None = None
) -> tuple[list[OutFile], dict[str, list[WeightStack]]]:
    """The output files of every rank's stacks, and each rank's manifest entries.

    `wanted(rel)`: whether file `rel` (relative to the bundle) must be written (a cached one
    is fetched instead); its entries are made either way."""
    c, topo, recipe = spec.model.text, spec.topology, spec.recipe
    files: dict[str, OutFile] = {}
    entries: dict[str, list[WeightStack]] = {}
    for kind, kp in plan.kinds.items():
        shared = {s.name for s in kp.region.specs if topo.world > 1 and shard.replicated(kind, s.name, c, topo)}
        for rank in range(topo.world):
            tensors, paths = {}, {}
            for s, full in zip(kp.region.specs, kp.full_specs):
                where: Literal["rank", "shared"] = SHARED if s.name in shared else "rank"
                rel = layout.shared_weights_path(kind) if where == SHARED else layout.weights_path(rank, kind)
                paths[where] = rel
                tensors[s.name] = TensorShape(
                    shape=(len(kp.layers), *s.buffer_shape),
                    dtype=str(s.dtype).removeprefix("torch."),
                    file=where,
                    format=recipe.formats(s.ckpt_dtype),
                )
                if where == SHARED and rank > 0:
                    continue  # planned once, for rank 0
                if wanted is not None and not wanted(rel):
                    continue
                f = files.setdefault(rel, OutFile(str(staging / rel)))
                f.tensors.append(
                    OutTensor(
                        s.name,
                        _st_dtype(s),
                        (len(kp.layers), *s.buffer_shape),
                        _pieces(ckpt, kp, s, full, shard.cut(kind, s.name, c, topo, rank), recipe),
                    )
                )
            entries.setdefault(layout.rank_key(rank), []).append(
                WeightStack(
                    kind=kind,
                    path=paths.get("rank"),
                    shared=paths.get(SHARED),
                    layers=tuple(kp.layers),
                    tensors=tensors,
                )
            )
    return list(files.values()), entries


def host_entries(model: V41Config, *, device_embedding: bool) -> dict[str, HostFile]:
    """The manifest's host-resident tensors of V41Config `model`: the token embedding (unless it is
    a device region's weight), the engram tables (with engram layers), the vision tower (with one)."""
    out = {}
    if not device_embedding:
        out["embed"] = HostFile(path=layout.host_path(layout.HOST_EMBED_FILE), tensor="embed")
    if model.text.engram_layer_ids:
        out["engram"] = HostFile(path=layout.host_path(layout.HOST_ENGRAM_FILE), tensors="checkpoint names")
    if model.vision.num_hidden_layers > 0:
        out["vision"] = HostFile(path=layout.host_path(layout.HOST_VISION_FILE), tensors="checkpoint names")
    return out


def _embed_spec(model: V41Config) -> WeightSpec:
    return WeightSpec("embed", "embed.weight", (model.text.vocab_size, model.text.hidden_size), "BF16")


def _vision_specs(model: V41Config) -> list[WeightSpec]:
    if model.vision.num_hidden_layers == 0:
        return []
    from deepinfer.regions.vision import vision_specs

    return [
        WeightSpec(name, name, shape, dtype)
        for name, (shape, dtype) in vision_specs(model.vision, model.text.hidden_size).items()
    ]


def host_bytes(model: V41Config, *, device_embedding: bool) -> dict[str, int]:
    """Bytes of each host file's tensors (V41Config `model`): host memory of the machine that runs
    the bundle, mapped once by every rank it runs there, never a device weight."""
    specs = {"embed": [_embed_spec(model)], "engram": engram_table_specs(model.text), "vision": _vision_specs(model)}
    return {
        name: sum(math.prod(s.shape) * s.dtype.itemsize for s in specs[name])
        for name in host_entries(model, device_embedding=device_embedding)
    }


def _whole(src: TensorInfo | Derived, name: str, spec: WeightSpec) -> OutTensor:
    return OutTensor(
        name,
        _st_dtype(spec),
        spec.shape,
        [Piece(src, (0, spec.shape[0]), None, 0, _row_bytes(spec.shape, spec.dtype.itemsize))],
    )


def host_files(
    model: V41Config,
    ckpt: Checkpoint,
    staging: Path,
    recipe: Recipe,
    wanted: Wanted | None = None,
    *,
    device_embedding: bool,
) -> list[OutFile]:
    """The token embedding (unless on the device), the engram tables (fp8 stored as the recipe
    says, like every fp8 weight) and the vision tower as checkpointed (V41Config `model`)."""
    out = []
    for name, entry in host_entries(model, device_embedding=device_embedding).items():
        if wanted is not None and not wanted(entry.path):
            continue
        if name == "embed":
            spec = _embed_spec(model)
            tensors = [_whole(_source(ckpt, spec.key, spec), "embed", spec)]
        elif name == "engram":
            tensors = [_whole(_stored(ckpt, s.key, s, recipe), s.name, s) for s in engram_table_specs(model.text)]
        else:
            tensors = [_whole(_source(ckpt, s.key, s), s.name, s) for s in _vision_specs(model)]
        out.append(OutFile(str(staging / entry.path), tensors))
    return out


def host_sources(model: V41Config, ckpt: Checkpoint) -> list[str]:
    """The checkpoint tensors the engram host file is built from."""
    return [n for s in engram_table_specs(model.text) for n in ckpt.sources(s, s.key)]


def source_names(kp: KindPlan, ckpt: Checkpoint) -> list[str]:
    """The checkpoint tensors a kind's stacks are built from (an fp8 weight's codes and
    scales both feed each of them where the recipe converts)."""
    names = {}
    for spec in kp.full_specs:
        for layer in kp.layers:
            prefix = kp.prefix(layer)
            keys = [spec.key.format(e=e) for e in range(spec.experts)] if spec.experts else [spec.key]
            for k in keys:
                names.update(dict.fromkeys(ckpt.sources(spec, prefix + k)))
    return list(names)
