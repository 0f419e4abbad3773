"""Executables load without unpickling: a `.pt2` whose sample inputs carry a pickle payload is
refused with one line, and the payload never runs (plain `torch.export.load` runs it)."""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import pytest
import torch

from deepinfer.bundles.pt2 import UnsafeArchiveError, load_exported


class Payload:
    """Unpickling this creates `marker`: the stand-in for arbitrary code."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


class Double(torch.nn.Module):
    def forward(self, x):
        return x * 2


@pytest.fixture
def saved(tmp_path) -> Path:
    path = tmp_path / "ok.pt2"
    torch.export.save(torch.export.export(Double(), (torch.ones(3),)), str(path))
    return path


def _rewrite(src: Path, dst: Path, edit) -> Path:
    """A copy of archive `src` with each member's bytes passed through edit(name, data)."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, edit(info.filename, zin.read(info.filename)))
    return dst


def test_a_clean_program_loads_and_runs(saved):
    ep = load_exported(saved)
    assert torch.equal(ep.module()(torch.arange(3.0)), torch.tensor([0.0, 2.0, 4.0]))


def test_pickled_sample_inputs_are_refused_and_never_run(saved, tmp_path):
    marker = tmp_path / "payload-ran"
    payload = io.BytesIO()
    torch.save(((Payload(marker),), {}), payload)  # what a full unpickle of the file runs
    evil = _rewrite(
        saved,
        tmp_path / "evil.pt2",
        lambda name, data: payload.getvalue() if name.endswith("sample_inputs/model.pt") else data,
    )
    with pytest.raises(UnsafeArchiveError, match=r"evil\.pt2: .*never unpickles") as err:
        load_exported(evil)
    assert "\n" not in str(err.value)
    assert not marker.exists()
    torch.export.load(str(evil))  # the threat this guards against: torch's own load runs it
    assert marker.exists()


def test_payload_configs_asking_for_pickle_are_refused(saved, tmp_path):
    def edit(name, data):
        if name.endswith("model_weights_config.json"):
            return json.dumps({"config": {"w": {"path_name": "weight_0", "use_pickle": True}}}).encode()
        return data

    with pytest.raises(UnsafeArchiveError, match="stores 'w' pickled"):
        load_exported(_rewrite(saved, tmp_path / "pickled.pt2", edit))


def test_custom_objects_are_refused(saved, tmp_path):
    path = tmp_path / "obj.pt2"
    _rewrite(saved, path, lambda name, data: data)
    with zipfile.ZipFile(path, "a") as z:
        z.writestr("ok/data/constants/custom_obj_0", b"\x80\x04N.")
    with pytest.raises(UnsafeArchiveError, match="holds a pickled object"):
        load_exported(path)


def test_not_an_archive(tmp_path):
    path = tmp_path / "junk.pt2"
    path.write_bytes(b"not a zip")
    with pytest.raises(UnsafeArchiveError, match="not a readable .pt2 archive"):
        load_exported(path)
