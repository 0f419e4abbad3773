"""Reading a V4.1 checkpoint in the release's native layout (safetensors).

A checkpoint directory holds `config.json` and either `model.safetensors` or
shards listed by `model.safetensors.index.json`. Tensors are read lazily
through memory maps; every problem is a `CheckpointError` that names the file
and the tensor.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from deepinfer.bundles.safetensors import TensorInfo, read_header
from deepinfer.errors import CheckpointError
from deepinfer.regions.base import Region, WeightSpec

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class Checkpoint:
    """Name -> tensor access over a checkpoint directory."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        index = self.dir / INDEX_FILE
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index}: not a safetensors index ({e})") from None
        elif (self.dir / SINGLE_FILE).exists():
            weight_map = dict.fromkeys(read_header(str(self.dir / SINGLE_FILE))[0], SINGLE_FILE)
        else:
            raise CheckpointError(f"{self.dir}: no {SINGLE_FILE} or {INDEX_FILE}")
        self.files = {name: self.dir / f for name, f in weight_map.items()}
        self._headers: dict[Path, dict[str, TensorInfo]] = {}
        self._handles: dict[Path, object] = {}

    def names(self) -> list[str]:
        return list(self.files)

    def tensor(self, name: str) -> TensorInfo:
        """Where a tensor lies in its file, from the file's (checked) header."""
        path = self._path(name)
        if path not in self._headers:
            self._headers[path] = read_header(str(path))[0]
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

    def load_spec(self, prefix: str, spec: WeightSpec) -> torch.Tensor:
        """One region weight: the checkpoint tensor(s) in the region's storage dtype."""
        keys = [prefix + spec.key.format(e=e) for e in range(spec.experts)] if spec.experts \
            else [prefix + spec.key]
        parts = [self.get(k, spec.ckpt_dtype, spec.shape) for k in keys]
        t = torch.stack(parts) if spec.experts else parts[0]
        return t.view(spec.dtype) if t.dtype != spec.dtype else t


def load_region(ckpt: Checkpoint, region: Region, prefix: str) -> None:
    """Fill a region's weight buffers from the checkpoint tensors under `prefix`."""
    for spec in region.specs:
        getattr(region, spec.name).copy_(ckpt.load_spec(prefix, spec))
