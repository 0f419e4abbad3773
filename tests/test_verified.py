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

from deepinfer.bundles import verified as verified_module
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


def _anonymous_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))


def test_a_trusted_load_holds_its_weights_and_one_buffer_not_a_second_copy(tmp_path, monkeypatch):
    """Issue 44 item 3: each file is hashed as it streams to where it is used. A weights file goes
    straight into the memory its tensors use (no other copy); anything else (an executable) goes
    through one buffer of CHUNK_BYTES into a private file, and no memory holds it afterwards."""
    monkeypatch.setattr(verified_module, "CHUNK_BYTES", 1 << 20)
    values = np.arange(5 << 18, dtype=np.float32)  # 5 MiB: five pieces of the buffer
    weights = _tensor_file(tmp_path / "w.safetensors", values)
    program = np.random.default_rng(0).integers(0, 256, 48 << 20, dtype=np.uint8).tobytes()  # 48 MiB
    (tmp_path / "exe.pt2").write_bytes(program)
    before = _anonymous_kib()
    verified = open_verified(tmp_path, {"w.safetensors": _digest(weights), "exe.pt2": _digest(program)}, BundleError)
    held = _anonymous_kib() - before
    assert verified.held_bytes() == len(weights) and verified.buffer_bytes == 1 << 20
    assert held < 24 << 10, f"{held} KiB of anonymous memory held after verifying a 48 MiB executable"
    with verified.private_copy("exe.pt2") as path:
        assert path.read_bytes() == program and path.stat().st_mode & 0o077 == 0
    with verified.open("exe.pt2") as f:
        assert f.read(4) == program[:4]
    memory = verified.data("w.safetensors")
    tensor = load_buffer(memory, "w.safetensors")["w"]
    start = np.frombuffer(memory, dtype=np.uint8).ctypes.data
    assert start <= tensor.data_ptr() < start + len(weights)  # the tensor is the hashed bytes themselves
    assert torch.equal(tensor, torch.from_numpy(values))
    verified.close()
    assert not path.parent.parent.exists()  # the private files go with it


def test_a_file_hashed_piece_by_piece_is_refused_whole_when_any_piece_differs(tmp_path, monkeypatch):
    monkeypatch.setattr(verified_module, "CHUNK_BYTES", 4096)
    data = bytes(range(256)) * 64  # four pieces
    for name in ("w.safetensors", "exe.pt2"):
        (tmp_path / name).write_bytes(data[:-1] + b"\x00")  # the last piece's last byte
        with pytest.raises(BundleError, match=rf"{name} does not match its digest"):
            open_verified(tmp_path, {name: _digest(data)}, BundleError)


def test_no_room_for_a_private_copy_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    import errno

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    (tmp_path / "exe.pt2").write_bytes(b"program")
    monkeypatch.setattr(verified_module.tempfile, "mkstemp", full)
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(verified_module.tempfile, "tempdir", str(tmp_path / "tmp"))
    with pytest.raises(BundleError, match=r"exe\.pt2: cannot copy it into a private directory .*No space left") as e:
        open_verified(tmp_path, {"exe.pt2": _digest(b"program")}, BundleError)
    assert "\n" not in str(e.value) and list((tmp_path / "tmp").iterdir()) == []  # the private store went too


def test_a_trusted_rank_verifies_only_the_files_it_uses(rank_bundle, tmp_path):
    """A rank of a trusted 2-rank bundle streams its own weight files, those every rank shares, the host
    files and the executables; never the other rank's weights (each rank read every file before)."""
    from deepinfer.bundles import layout
    from deepinfer.bundles.signing import keygen, load_private_key, load_public_key, sign_file
    from deepinfer.runtime.bundle import open_bundle

    bundle = shutil.copytree(rank_bundle(ep=2), tmp_path / "bundle")
    keygen(tmp_path / "k.pem", tmp_path / "k.pub")
    sign_file(bundle / layout.MANIFEST_FILE, load_private_key(tmp_path / "k.pem"), bundle / layout.SIGNATURE_FILE)
    for rank in (0, 1):
        opened = open_bundle(bundle, trust=load_public_key(tmp_path / "k.pub"), rank=rank)
        m, verified = opened.manifest, opened.verified
        assert verified is not None
        mine = {f for w in m.rank_weights(rank) for f in w.files}
        theirs = {f for w in m.rank_weights(1 - rank) for f in w.files} - mine
        assert theirs and all(f not in verified for f in theirs)
        assert all(f in verified for f in m.files if f not in theirs)
        weights = sum((bundle / f).stat().st_size for f in m.files if f.endswith(".safetensors") and f not in theirs)
        assert verified.held_bytes() == weights
