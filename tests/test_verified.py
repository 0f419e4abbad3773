"""A trusted bundle's files opened once, without following links, and held as verified
(bundles/verified.py); tensors over the verified bytes (safetensors.load_buffer)."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from deepinfer.bundles.manifest import BundleError
from deepinfer.bundles.safetensors import layout_header, load_buffer, load_mmap
from deepinfer.bundles.verified import open_verified


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _tensor_file(path, values: np.ndarray) -> bytes:
    header, _ = layout_header([("w", "F32", values.shape, values.nbytes)], {})
    data = header + values.tobytes()
    path.write_bytes(data)
    return data


def test_verified_bytes_outlive_any_change_to_the_file(tmp_path):
    (tmp_path / "weights").mkdir()
    data = _tensor_file(tmp_path / "weights" / "w.safetensors", np.arange(6, dtype=np.float32).reshape(2, 3))
    (tmp_path / "exe.pt2").write_bytes(b"program")
    verified = open_verified(
        tmp_path, {"weights/w.safetensors": _digest(data), "exe.pt2": _digest(b"program")}, BundleError
    )
    with open(tmp_path / "weights" / "w.safetensors", "r+b") as f:  # rewritten in place
        f.seek(len(data) - 4)
        f.write(b"\xff\xff\xff\xff")
    os.replace(tmp_path / "weights" / "w.safetensors", tmp_path / "gone")  # and renamed away
    (tmp_path / "exe.pt2").write_bytes(b"another")
    tensors = load_buffer(verified.data("weights/w.safetensors"), "w.safetensors")
    assert torch.equal(tensors["w"], torch.arange(6, dtype=torch.float32).reshape(2, 3))
    assert not torch.equal(load_mmap(tmp_path / "gone")["w"], tensors["w"])  # the file did change
    with verified.private_copy("exe.pt2") as path:
        assert path.read_bytes() == b"program" and path.stat().st_mode & 0o077 == 0
        assert path.parent.stat().st_mode & 0o077 == 0
    assert not path.parent.exists()


@pytest.mark.parametrize("where", ["file", "directory"])
def test_a_link_inside_a_trusted_bundle_is_refused(tmp_path, where):
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "w.bin").write_bytes(b"w")
    if where == "file":
        (tmp_path / "real" / "link.bin").symlink_to(tmp_path / "real" / "w.bin")
        rel = "real/link.bin"
    else:
        (tmp_path / "linked").symlink_to(tmp_path / "real")
        rel = "linked/w.bin"
    with pytest.raises(BundleError, match=f"{rel} cannot be opened without following links") as e:
        open_verified(tmp_path, {rel: _digest(b"w")}, BundleError)
    assert "\n" not in str(e.value)


def test_a_file_that_differs_from_its_digest_or_is_not_regular_is_refused(tmp_path):
    (tmp_path / "w.bin").write_bytes(b"w")
    (tmp_path / "d").mkdir()
    with pytest.raises(BundleError, match=r"w\.bin does not match its digest"):
        open_verified(tmp_path, {"w.bin": _digest(b"v")}, BundleError)
    with pytest.raises(BundleError, match="d is not a regular file"):
        open_verified(tmp_path, {"d": _digest(b"")}, BundleError)
    with pytest.raises(BundleError, match="missing file nope"):
        open_verified(tmp_path, {"nope": _digest(b"")}, BundleError)


def test_a_tokenizer_is_read_from_its_verified_files(tmp_path):
    from deepinfer.regions.hf_tokenizer import TokenizersTokenizer

    source = Path(__file__).parent / "golden" / "synthetic_tokenizer"
    shutil.copytree(source, tmp_path / "tokenizer")
    files = {f"tokenizer/{p.name}": _digest(p.read_bytes()) for p in (tmp_path / "tokenizer").iterdir()}
    verified = open_verified(tmp_path, files, BundleError)
    (tmp_path / "tokenizer" / "tokenizer.json").write_text("{}")  # changed after verification
    with verified.private_dir("tokenizer") as directory:
        tok = TokenizersTokenizer.from_dir(directory)
    assert not directory.exists()
    assert tok.encode_text("hello", False) == TokenizersTokenizer.from_dir(source).encode_text("hello", False)
