"""Reading a V4.1 checkpoint in the release's native layout (safetensors).

A checkpoint directory holds `config.json` and either `model.safetensors` or
shards listed by `model.safetensors.index.json`. Tensors are read lazily
through memory maps; every problem is a `CheckpointError` that names the file
and the tensor.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path, PurePosixPath

import torch
from safetensors import safe_open

from deepinfer.bundles.safetensors import TensorInfo, read_header
from deepinfer.errors import CheckpointError
from deepinfer.quant.stream_plan import SCALE_DTYPES, block_from_grid, scale_names
from deepinfer.reader import MIB, load_json, open_regular
from deepinfer.regions.base import Region, WeightSpec
from deepinfer.regions.config import CONFIG_FILE

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CAP_INDEX = 64 * MIB  # a release's index names ~100k tensors (~10 MB)


def _check_weight_map(index: Path, weight_map) -> None:
    """Every entry a tensor name -> a file name inside the checkpoint directory."""
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index}: weight_map is a {type(weight_map).__name__}, expected an object")
    for name, file in weight_map.items():
        p = PurePosixPath(file) if isinstance(file, str) else None
        if p is None or p.is_absolute() or ".." in p.parts or file in ("", "."):
            raise CheckpointError(
                f"{index}: weight_map[{name!r}] = {file!r} is not a file inside the checkpoint directory"
            )


def _check_shards(directory: Path, index: Path, weight_map: dict) -> None:
    """Every file the index names is a regular file (checked once per file, on its descriptor):
    a missing shard, a directory or a symlink loop is refused here, naming the index entry."""
    first: dict[str, str] = {}
    for name, file in weight_map.items():
        first.setdefault(file, name)
    for file, name in first.items():
        path = directory / file

        def error(msg: str, name=name, file=file, path=path) -> CheckpointError:
            return CheckpointError(f"{index}: weight_map[{name!r}] = {file!r}: {msg.removeprefix(f'{path}: ')}")

        os.close(open_regular(path, error=error))


class Checkpoint:
    """Name -> tensor access over a checkpoint directory.

    With `data` false only the safetensors headers need to be there (a headers-only
    checkpoint, or a release whose data is not to be touched): names, dtypes, shapes and
    offsets are all a plan needs; reading a tensor then fails."""

    def __init__(self, directory: str | Path, *, data: bool = True):
        self.dir = Path(directory)
        self.data = data
        index = self.dir / INDEX_FILE
        if index.exists() or index.is_symlink():
            parsed = load_json(index, CAP_INDEX, error=CheckpointError)
            if not isinstance(parsed, dict) or "weight_map" not in parsed:
                raise CheckpointError(f"{index}: not a safetensors index (no weight_map object)")
            weight_map = parsed["weight_map"]
            _check_weight_map(index, weight_map)
            _check_shards(self.dir, index, weight_map)
        elif (self.dir / SINGLE_FILE).exists() or (self.dir / SINGLE_FILE).is_symlink():
            weight_map = dict.fromkeys(read_header(str(self.dir / SINGLE_FILE), data=data)[0], SINGLE_FILE)
        else:
            raise CheckpointError(f"{self.dir}: no {SINGLE_FILE} or {INDEX_FILE}")
        self.files = {name: self.dir / f for name, f in weight_map.items()}
        self._headers: dict[Path, dict[str, TensorInfo]] = {}
        self._handles: dict[Path, safe_open] = {}
        self._rescaled: tuple[tuple[str, str], tuple[torch.Tensor, torch.Tensor]] | None = None

    @classmethod
    def described(cls, directory: str | Path, tensors: dict[str, TensorInfo]) -> Checkpoint:
        """A checkpoint known by its tensors' descriptions alone, no files (what `config.json`
        implies, to plan a compile without the weights): every description's path is where
        its errors point; nothing can be read."""
        ckpt = cls.__new__(cls)
        ckpt.dir, ckpt.data = Path(directory), False
        ckpt.files = {name: Path(t.path) for name, t in tensors.items()}
        ckpt._headers = {}
        for name, t in tensors.items():
            ckpt._headers.setdefault(Path(t.path), {})[name] = t
        ckpt._handles, ckpt._rescaled = {}, None
        return ckpt

    def names(self) -> list[str]:
        return list(self.files)

    def layers_beyond(self, num_layers: int) -> list[int]:
        """Layer indices the checkpoint holds (`layers.N.*`) at or past `num_layers`: weights a
        config with that many layers leaves unused."""
        found = {int(n.split(".")[1]) for n in self.files if n.startswith("layers.") and n.split(".")[1].isdigit()}
        return sorted(i for i in found if i >= num_layers)

    def tensor(self, name: str) -> TensorInfo:
        """Where a tensor lies in its file, from the file's (checked) header."""
        path = self._path(name)
        if path not in self._headers:
            self._headers[path] = read_header(str(path), data=self.data)[0]
        entry = self._headers[path].get(name)
        if entry is None:
            raise CheckpointError(f"{path}: tensor {name} is listed in the index but not in the file")
        return entry

    def info(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(dtype string, shape) of a tensor from its file's header."""
        t = self.tensor(name)
        return t.dtype, t.shape

    def _path(self, name: str) -> Path:
        if name not in self.files:
            raise CheckpointError(f"{self.dir}: missing tensor {name}")
        return self.files[name]

    def get(self, name: str, dtype: str | None = None, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """Read a tensor, checking its stored dtype and shape when given."""
        path = self._path(name)
        got_dtype, got_shape = self.info(name)
        if dtype is not None and got_dtype != dtype:
            raise CheckpointError(f"{path}: tensor {name} has dtype {got_dtype}, expected {dtype}")
        if shape is not None and got_shape != tuple(shape):
            raise CheckpointError(f"{path}: tensor {name} has shape {list(got_shape)}, expected {list(shape)}")
        if path not in self._handles:
            self._handles[path] = safe_open(str(path), framework="pt")
        try:
            return self._handles[path].get_tensor(name)
        except Exception as e:  # safetensors raises its own error types for corrupt data
            raise CheckpointError(f"{path}: cannot read tensor {name} ({e})") from None

    def scale_of(self, weight: str) -> str:
        """The scale tensor of fp8 weight `weight` (`X.weight`): `X.scale` (ue8m0, as released)
        or, in a DeepSeek-V3-style checkpoint, `X.weight_scale_inv` (float32, [128, 128] blocks)."""
        names = scale_names(weight)
        for name in names:
            if name in self.files:
                return name
        raise CheckpointError(f"{self.dir}: missing tensor {names[0]} (nor {names[1]})")

    def fp8_blocks(self, weight: str) -> tuple[TensorInfo, TensorInfo, tuple[int, int]]:
        """An fp8 weight's codes, its scale tensor (dtype checked) and the block each scale covers."""
        codes, scales = self.tensor(weight), self.tensor(self.scale_of(weight))
        if scales.dtype not in SCALE_DTYPES:
            raise CheckpointError(
                f"{scales.path}: tensor {scales.name} has dtype {scales.dtype}, expected {' or '.join(SCALE_DTYPES)}"
            )
        return codes, scales, block_from_grid(codes, scales, SCALE_DTYPES[scales.dtype])

    def fp8_weight(self, spec: WeightSpec, key: str) -> str | None:
        """The fp8 weight (`X.weight`, F8_E4M3) whose codes or scales region weight `key` is;
        None for anything else (an fp4 weight's scales among them)."""
        if spec.experts or spec.ckpt_dtype not in ("F8_E4M3", "F8_E8M0"):
            return None
        weight = key if spec.ckpt_dtype == "F8_E4M3" else key.removesuffix("scale") + "weight"
        if weight not in self.files or self.tensor(weight).dtype != "F8_E4M3":
            return None
        return weight

    def float_scaled(self, spec: WeightSpec, key: str) -> str | None:
        """The fp8 weight behind `key` when the checkpoint scales it by float32 blocks
        (`X.weight_scale_inv`): then a region's codes and ue8m0 scales are computed from it."""
        weight = self.fp8_weight(spec, key)
        return weight if weight and self.scale_of(weight).endswith("weight_scale_inv") else None

    def sources(self, spec: WeightSpec, key: str) -> list[str]:
        """The checkpoint tensors region weight `key` is computed from."""
        weight = self.fp8_weight(spec, key)
        return [key] if weight is None else [weight, self.scale_of(weight)]

    def rescaled(self, weight: str, fp8_format: str = "e4m3fn") -> tuple[torch.Tensor, torch.Tensor]:
        """A float-scaled fp8 weight as the release stores it: codes (e4m3fn, or another
        quant/formats.py format) with ue8m0 scales on [32, 32] blocks (per-row scales stay per
        row), through quant/rescale's LUT path (one rounding per element: the nearest code to
        code * scale_inv / new scale)."""
        from deepinfer.quant.rescale import rescale_fp32

        if self._rescaled and self._rescaled[0] == (weight, fp8_format):  # codes, then their scales
            return self._rescaled[1]
        _, inv, src = self.fp8_blocks(weight)
        out, out_s = rescale_fp32(
            self.get(weight).view(torch.uint8).numpy(),
            self.get(inv.name, "F32").numpy(),
            src,
            release_block(src),
            fp8_format,
        )
        self._rescaled = ((weight, fp8_format), (torch.from_numpy(out), torch.from_numpy(out_s)))
        return self._rescaled[1]

    def load_spec(self, prefix: str, spec: WeightSpec, fp8_format: str = "e4m3fn") -> torch.Tensor:
        """One region weight: the checkpoint tensor(s) in the region's storage dtype (fp8 weights
        scaled by float32 blocks rescaled, to codes of `fp8_format`)."""
        keys = [prefix + spec.key.format(e=e) for e in range(spec.experts)] if spec.experts else [prefix + spec.key]
        weight = self.float_scaled(spec, keys[0])
        if weight is not None:
            t = self.rescaled(weight, fp8_format)[0 if spec.ckpt_dtype == "F8_E4M3" else 1]
            if tuple(t.shape) != spec.shape:
                raise CheckpointError(
                    f"{self.files[weight]}: tensor {keys[0]} would have shape {list(t.shape)} "
                    f"after rescaling, expected {list(spec.shape)}"
                )
            return t
        parts = [self.get(k, spec.ckpt_dtype, spec.shape) for k in keys]
        t = torch.stack(parts) if spec.experts else parts[0]
        return t.view(spec.dtype) if t.dtype != spec.dtype else t


def release_block(src: tuple[int, int]) -> tuple[int, int]:
    """The release's scale block for fp8 weights scaled on `src` blocks: [32, 32], or one
    scale per row and 32 columns for per-row scaled tensors."""
    return (1, 32) if src[0] == 1 else (32, 32)


def load_region(ckpt: Checkpoint, region: Region, prefix: str) -> None:
    """Give a region's weight buffers the checkpoint tensors under `prefix`: each buffer becomes
    the tensor read (its shape and dtype checked), so a region built on the meta device holds
    the weights once, with no zero-filled buffer to copy them into (at the released dimensions
    that fill was a second copy of every weight and 30 s of the reference's 42 s load, profiled)."""
    for spec in region.specs:
        t = ckpt.load_spec(prefix, spec)
        own = region._buffers[spec.name]
        assert own is not None, f"{region.kind}.{spec.name}: a region registers no empty buffers"
        if tuple(t.shape) != tuple(own.shape) or t.dtype != own.dtype:
            raise CheckpointError(
                f"{ckpt.dir}: {prefix}{spec.key} reads as {list(t.shape)} {t.dtype}, "
                f"the {region.kind} region holds {list(own.shape)} {own.dtype}"
            )
        region._buffers[spec.name] = t
    if region.rank.is_meta:
        region._buffers["rank"] = torch.zeros((), dtype=torch.int64)


@contextlib.contextmanager
def written_checkpoint(out_dir: Path, config: dict, weight_map: dict[str, str], total_bytes: int):
    """Write a checkpoint directory atomically: yields a sibling temporary directory to write the
    safetensors files into; on success the config and the index are added and the directory takes
    `out_dir`'s place (absent or empty); on any error it is removed."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        yield tmp
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        os.chmod(tmp, 0o755)
        if out_dir.exists():
            out_dir.rmdir()
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
