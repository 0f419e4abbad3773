"""NaN and infinity never pass silently (issue 16, class 3): in checkpoint tensors (the weight
pass refuses them, naming file, tensor and element), in config values, and in logits (the
sequence stops with the step named instead of emitting token 0)."""

from __future__ import annotations

import json
import shutil

import ml_dtypes
import numpy as np
import pytest
import torch

from deepinfer.bundles.safetensors import read_header
from deepinfer.compiler import pipeline
from deepinfer.compiler.config import load_compile_config
from deepinfer.errors import CheckpointError, ConfigError
from deepinfer.quant.finite import first_nonfinite
from deepinfer.regions.config import load_config
from deepinfer.regions.stepper import Allocator
from deepinfer.runtime.schedule import decode

# every code of each format, decoded by ml_dtypes (the independent reference)
FORMATS = {
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
    "F8_E8M0": ml_dtypes.float8_e8m0fnu,
    "BF16": ml_dtypes.bfloat16,
    "F16": np.float16,
}


@pytest.mark.parametrize("dtype", FORMATS)
def test_every_code_of_small_formats(dtype):
    np_type = np.dtype(FORMATS[dtype])
    codes = np.arange(1 << (8 * np_type.itemsize), dtype=np.uint8 if np_type.itemsize == 1 else np.uint16)
    finite = np.isfinite(codes.view(np_type).astype(np.float32))
    for code in codes:
        one = np.array([0, code, 0], dtype=codes.dtype)
        assert (first_nonfinite(one.view(np.uint8), dtype) == 1) == (not finite[code]), hex(code)


def test_wide_floats_and_positions():
    rng = np.random.default_rng(0)
    for np_type, dtype in ((np.float32, "F32"), (np.float64, "F64")):
        x = rng.standard_normal(3 << 20).astype(np_type)  # spans several slices
        assert first_nonfinite(x.view(np.uint8), dtype) is None
        for value, at in ((np.inf, 2_500_000), (-np.inf, 1_000_003), (np.nan, 17)):
            y = x.copy()
            y[at] = value
            y[at + 5] = np.nan
            assert first_nonfinite(y.reshape(-1, 64).view(np.uint8), dtype) == at
    assert first_nonfinite(np.full(8, 0xFF, np.uint8), "I8") is None  # fp4 pairs and ints have no such codes


def _poison(ckpt, name: str, value: bytes, index: int = 0):
    """Overwrite element `index` of tensor `name` in place."""
    for path in sorted(ckpt.glob("*.safetensors")):
        tensors, _ = read_header(str(path))
        if name in tensors:
            t = tensors[name]
            with open(path, "r+b") as f:
                f.seek(t.offset + index * len(value))
                f.write(value)
            return t
    raise AssertionError(name)


@pytest.mark.parametrize(
    "name, value",
    [
        ("layers.0.attn_norm.weight", np.array([np.nan], ml_dtypes.bfloat16)),
        ("layers.2.attn.wq_b.weight", np.array([0x7F], np.uint8)),
        ("head.weight", np.array([-np.inf], np.float32)),
    ],
)
def test_weight_pass_refuses_non_finite_weights(tmp_path, tiny_ckpt, name, value):
    ckpt = shutil.copytree(tiny_ckpt, tmp_path / "ckpt")
    t = _poison(ckpt, name, value.tobytes(), index=3)
    (tmp_path / "model.toml").write_text(f'[model]\ncheckpoint = "{ckpt}"\n[target]\nexecutable = "exported"\n')
    with pytest.raises(CheckpointError, match=rf"tensor {name}: non-finite value \(NaN or infinity\) at \[") as e:
        pipeline.compile_bundle(load_compile_config(tmp_path / "model.toml"), tmp_path / "out", log=lambda m: None)
    assert str(e.value).startswith(t.path) and "\n" not in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "model.toml"]  # nothing published


def test_config_values_must_be_finite(tmp_path, tiny_ckpt):
    data = json.loads((tiny_ckpt / "config.json").read_text())
    data["text_config"]["routed_scaling_factor"] = float("nan")
    (tmp_path / "config.json").write_text(json.dumps(data))  # writes the NaN literal
    with pytest.raises(ConfigError, match="config.json: NaN is not a JSON number"):  # refused as it is parsed
        load_config(tmp_path)


class NanAtStep:
    """A test double of a model: predicts token 5, and NaN logits from step `bad` on."""

    groups, max_batch, chunk = 1, 1, 4

    def __init__(self, bad: int):
        self.bad, self.steps = bad, 0

    def allocator(self):
        return Allocator(slots=2, blocks=16, block_size=4, max_blocks=4)

    def run(self, rows_by_group, allocs, histories, images, capture=None, last_only=False, greedy=False):
        self.steps += 1
        (rows,) = rows_by_group
        logits = torch.zeros((len(rows), max(len(ids) for _, ids, _ in rows), 8))
        logits[..., 5] = 1.0
        if self.steps >= self.bad:
            logits[..., 2] = float("nan")
        return [logits]


def test_non_finite_logits_stop_the_sequence_and_name_the_step():
    [g] = decode(NanAtStep(bad=3), [[1, 1]], max_new_tokens=8, eos=7)
    assert g.generated == [5, 5]  # steps 1 and 2, kept
    assert g.error == "non-finite logits (NaN or infinity) at position 3, step 3"
