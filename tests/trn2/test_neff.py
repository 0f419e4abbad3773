"""Contract tests of deepinfer.bundles.neff over files written by a STAND-IN for neuronx-cc.

The stand-in (tests/trn2/doubles/neuronx_cc_stub.py) writes the header layout that
bundles/neff.py documents, from the same public sources; these tests check that the reader
and its error messages behave on that layout and on damaged copies of it. They prove
nothing about real NEFFs (whose layout past byte 0xAC rests on one unofficial source) or
about Trn2.
"""

from __future__ import annotations

import importlib.util
import json
import stat
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer.bundles.neff import HEADER_SIZE, NeffError, check_loadable, read_header, summary

DOUBLES = Path(__file__).resolve().parent / "doubles"


def _load_stub():
    spec = importlib.util.spec_from_file_location("neuronx_cc_stub", DOUBLES / "neuronx_cc_stub.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


stub = _load_stub()


def write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


@pytest.fixture
def neff(tmp_path) -> Path:
    return write(tmp_path / "r.neff", stub.neff_bytes("r", lnc=2, compressed=True))


def patched(data: bytes, offset: int, fmt: str, value) -> bytes:
    out = bytearray(data)
    struct.pack_into(fmt, out, offset, value)
    return bytes(out)


# --- round trip through the stand-in compiler ---


@pytest.mark.parametrize("lnc, fast", [(1, False), (2, False), (2, True)])
def test_round_trip_over_stand_in_output(tmp_path, lnc, fast):
    wrapper = DOUBLES / "neuronx-cc"
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    hlo = write(tmp_path / "m.hlo.pb", b"hlo")
    out = tmp_path / "attn.decode.b1t1.neff"
    argv = [
        str(wrapper),
        "compile",
        str(hlo),
        "--framework",
        "XLA",
        "--target",
        "trn2",
        "--lnc",
        str(lnc),
        "-O2",
        "--output",
        str(out),
    ] + (["--enable-fast-loading-neuron-binaries"] if fast else [])
    env = {"PATH": "/usr/bin:/bin", "FAKE_NEURONX_CC_PYTHON": sys.executable}
    subprocess.run(argv, check=True, cwd=tmp_path, env=env, capture_output=True)
    h = read_header(out)
    assert (h.package_version, h.compressed) == ((1, False) if fast else (2, True))
    assert h.header_size == HEADER_SIZE and h.payload_offset == HEADER_SIZE
    assert h.raw_size == out.stat().st_size == HEADER_SIZE + h.data_size
    assert (h.version, h.lnc, h.name, h.build) == ("2.0", lnc, "attn.decode.b1t1", stub.DEFAULT_VERSION)
    assert h.uuid is not None and len(h.uuid) == 36
    assert ("vnc" in h.feature_names()) == (lnc == 2)
    assert len(h.digest) == (32 if not fast else 64)


def test_summary_is_json(neff):
    s = summary(read_header(neff))
    assert json.loads(json.dumps(s)) == s
    assert s["version"] == "2.0" and s["lnc"] == 2 and s["features"] == 0x400
    assert s["feature_names"] == ["vnc"] and s["name"] == "r"
    assert set(s) >= {"version", "lnc", "features", "feature_names", "uuid", "name"}


def test_unknown_feature_bits_are_named_by_position(tmp_path):
    data = patched(stub.neff_bytes("r", lnc=1, compressed=True), 0x220, "<Q", (1 << 40) | 0x4)
    h = read_header(write(tmp_path / "f.neff", data))
    assert h.feature_names() == ["custom_ops", "bit40"]


def test_unrecorded_lnc_and_uuid_read_as_none(tmp_path):
    data = stub.neff_bytes("r", lnc=1, compressed=True)
    data = patched(patched(data, 0x228, "<I", 0), 0xCC, "16s", bytes(16))
    h = read_header(write(tmp_path / "old.neff", data))
    assert h.lnc is None and h.uuid is None
    check_loadable(h, lnc=2, path="regions/old.neff")  # cannot judge: accepted


# --- damaged files ---


def error_for(path: Path) -> str:
    with pytest.raises(NeffError) as info:
        read_header(path)
    msg = str(info.value)
    assert msg.startswith(f"{path}: ") and "\n" not in msg
    return msg


def test_truncated_header(tmp_path, neff):
    assert "truncated NEFF (100 bytes" in error_for(write(tmp_path / "t.neff", neff.read_bytes()[:100]))
    assert "truncated" in error_for(write(tmp_path / "e.neff", b""))


def test_bad_package_version_is_not_a_neff(tmp_path, neff):
    assert "not a NEFF (package version 0" in error_for(
        write(tmp_path / "z.neff", patched(neff.read_bytes(), 0, "<Q", 0))
    )
    assert "not a NEFF (package version 4096" in error_for(
        write(tmp_path / "b.neff", patched(neff.read_bytes(), 0, "<Q", 4096))
    )
    junk = b"\x7fELF" + bytes(2000)
    assert "not a NEFF" in error_for(write(tmp_path / "elf.neff", junk))


def test_bad_header_size(tmp_path, neff):
    msg = error_for(write(tmp_path / "h.neff", patched(neff.read_bytes(), 8, "<Q", 512)))
    assert "header size field 512, expected 1024" in msg


def test_size_mismatch(tmp_path, neff):
    data = neff.read_bytes()
    cut = write(tmp_path / "cut.neff", data[:-10])
    assert (
        f"header says {len(data) - HEADER_SIZE} payload bytes, the file has {len(data) - HEADER_SIZE - 10}"
        in error_for(cut)
    )
    assert "damaged NEFF" in error_for(write(tmp_path / "zero.neff", patched(data, 16, "<Q", 0)))
    assert "damaged NEFF" in error_for(write(tmp_path / "big.neff", patched(data, 16, "<Q", 1 << 40)))


def test_payload_not_a_tar(tmp_path, neff):
    data = neff.read_bytes()
    garbage = data[:HEADER_SIZE] + bytes(range(256)) * ((len(data) - HEADER_SIZE) // 256 + 1)
    garbage = garbage[: len(data)]
    assert "is not a readable tar archive" in error_for(write(tmp_path / "g.neff", garbage))
    broken_gzip = data[: HEADER_SIZE + 12] + bytes(len(data) - HEADER_SIZE - 12)
    assert "is not a readable gzip'd tar archive" in error_for(write(tmp_path / "z.neff", broken_gzip))


def test_missing_file(tmp_path):
    assert "no such NEFF file" in error_for(tmp_path / "absent.neff")


# --- loadability ---


def test_lnc_mismatch_refused(neff):
    h = read_header(neff)
    check_loadable(h, lnc=2, path="regions/x.neff")
    with pytest.raises(NeffError) as info:
        check_loadable(h, lnc=1, path="regions/x.neff")
    assert str(info.value).startswith("regions/x.neff: compiled for LNC 2, this bundle/runtime is configured for LNC 1")


def test_versions_are_the_runtimes_to_judge(tmp_path, neff):
    """A NEFF format or packaging newer than today's is read and passed on: the runtime decides at
    nrt_load (NRT_UNSUPPORTED_NEFF_VERSION, see test_nrt_contract), not a version table kept here."""
    newer = patched(patched(neff.read_bytes(), 0x18, "<Q", 3), 0, "<Q", 3)
    h = read_header(write(tmp_path / "v3.neff", newer))
    assert h.version == "3.0" and h.package_version == 3
    check_loadable(h, lnc=2, path="regions/x.neff")


def test_mismatch_with_manifest_record_refused(tmp_path, neff):
    h = read_header(neff)
    check_loadable(h, lnc=2, path="regions/x.neff", recorded=summary(h))
    other = read_header(write(tmp_path / "other.neff", stub.neff_bytes("r", lnc=2, compressed=True)))
    with pytest.raises(NeffError, match="regions/x.neff: uuid .* differs from the manifest's"):
        check_loadable(other, lnc=2, path="regions/x.neff", recorded=summary(h))
    with pytest.raises(NeffError, match="version '2.0' differs"):
        check_loadable(h, lnc=2, path="regions/x.neff", recorded={"version": "2.1"})
