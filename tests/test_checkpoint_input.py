"""Checkpoint headers, index and config ids: one line naming file and tensor (or key), never a
read outside the checkpoint directory (issue 16, class 6)."""

from __future__ import annotations

import json
import shutil
import struct

import pytest

from deepinfer.bundles.safetensors import read_header
from deepinfer.errors import CheckpointError, ConfigError
from deepinfer.regions.checkpoint import Checkpoint
from deepinfer.regions.config import load_config


def _file(tmp_path, header, data_len: int = 64, raw: bytes | None = None):
    text = raw if raw is not None else json.dumps(header).encode()
    path = tmp_path / "t.safetensors"
    path.write_bytes(struct.pack("<Q", len(text)) + text + bytes(data_len))
    return str(path)


def _entry(offsets, dtype="F32", shape=(4,)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


HEADERS = {
    "length 2^40": (None, struct.pack("<Q", 1 << 40), "header length 1099511627776 does not fit"),
    "a JSON list": ([1, 2], None, "header is not a JSON object"),
    "no data_offsets": ({"w": {"dtype": "F32", "shape": [4]}}, None, "lacks dtype/shape/data_offsets"),
    "overlapping": ({"a": _entry((0, 16)), "b": _entry((8, 24))}, None, "tensor 'b': data overlaps tensor 'a'"),
    "reversed": ({"w": _entry((16, 0))}, None, "malformed shape"),
    "unknown dtype": ({"w": _entry((0, 16), dtype="F7")}, None, "unexpected dtype 'F7'"),
    "bytes != shape": ({"w": _entry((0, 12))}, None, "needs 16"),
}


@pytest.mark.parametrize("case", HEADERS)
def test_malformed_headers(tmp_path, case):
    header, raw, message = HEADERS[case]
    if raw is not None and header is None:
        path = tmp_path / "t.safetensors"
        path.write_bytes(raw + bytes(64))
        path = str(path)
    else:
        path = _file(tmp_path, header)
    with pytest.raises(CheckpointError) as e:
        read_header(path)
    assert message in str(e.value) and path in str(e.value) and "\n" not in str(e.value)


def _with_index(tmp_path, tiny_ckpt, weight_map):
    ckpt = shutil.copytree(tiny_ckpt, tmp_path / "ckpt")
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return ckpt


def test_index_entries_stay_inside_the_checkpoint(tmp_path, tiny_ckpt):
    for weight_map, message in (
        ([1, 2], "weight_map is a list, expected an object"),
        ({"embed.weight": "../../../../etc/passwd"}, "is not a file inside the checkpoint"),
        ({"embed.weight": "/etc/passwd"}, "is not a file inside the checkpoint"),
        ({"embed.weight": 3}, "is not a file inside the checkpoint"),
    ):
        ckpt = _with_index(tmp_path, tiny_ckpt, weight_map)
        with pytest.raises(CheckpointError, match=message) as e:
            Checkpoint(ckpt)
        assert str(e.value).startswith(str(ckpt / "model.safetensors.index.json"))
        shutil.rmtree(ckpt)


@pytest.mark.parametrize("key", ["bos_token_id", "eos_token_id", "pad_token_id", "image_token_id"])
def test_token_ids_inside_the_vocabulary(tmp_path, tiny_ckpt, key):
    data = json.loads((tiny_ckpt / "config.json").read_text())
    data[key] = data["text_config"]["vocab_size"]
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=rf"config.json: {key} \d+ is outside the vocabulary \[0, \d+\)"):
        load_config(tmp_path)


def test_unused_checkpoint_layers_are_named(tiny_ckpt):
    ckpt = Checkpoint(tiny_ckpt)
    assert ckpt.layers_beyond(6) == []
    assert ckpt.layers_beyond(4) == [4, 5]
