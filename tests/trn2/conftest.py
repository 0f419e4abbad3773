"""The libnrt TEST DOUBLE (doubles/fake_nrt.c), built once per session, a per-test environment for it,
and the fake models it loads."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
STAND_IN = Path(__file__).resolve().parent / "doubles" / "neuronx-cc"
SOURCE = Path(__file__).parent / "doubles" / "fake_nrt.c"
BUILD = ROOT / ".cache" / "fake_nrt"


def _gcc(out: Path, source: Path) -> Path:
    """Compile `source` into the shared library `out` (written beside, then renamed into place)."""
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("gcc not found: the libnrt test double is built from C source at test time")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    subprocess.run([gcc, "-shared", "-fPIC", "-O1", "-Wall", "-o", str(tmp), str(source)], check=True)
    os.replace(tmp, out)
    return out


@pytest.fixture(scope="session")
def fake_nrt_path() -> Path:
    return _gcc(BUILD / "libfake_nrt.so", SOURCE)


@pytest.fixture(scope="session")
def empty_library(tmp_path_factory) -> Path:
    """A shared library that exports none of libnrt's functions."""
    src = tmp_path_factory.mktemp("empty") / "empty.c"
    src.write_text("int not_nrt(void) { return 0; }\n")
    return _gcc(BUILD / "libempty.so", src)


def fake_model(path, inputs: dict, outputs: dict, copies: dict):
    """A fake-model description for the double (NOT a NEFF): sizes in bytes, copies {output: input}."""
    lines = ["FAKE_NRT_MODEL 1"]
    lines += [f"input {n} {b}" for n, b in inputs.items()]
    lines += [f"output {n} {b}" for n, b in outputs.items()]
    lines += [f"copy {o} {i}" for o, i in copies.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def fnv1a(data: bytes) -> str:
    """The double's model identity (FNV-1a 64 of the NEFF bytes), as it logs it."""
    h = 1469598103934665603
    for b in data:
        h = ((h ^ b) * 1099511628211) % (1 << 64)
    return f"{h:016x}"


@dataclass
class FakeNrt:
    path: Path
    log_path: Path

    def lines(self) -> list[str]:
        return self.log_path.read_text().splitlines() if self.log_path.exists() else []

    def calls(self) -> list[str]:
        return [line.split()[0] for line in self.lines()]

    def clear(self) -> None:
        self.log_path.unlink(missing_ok=True)


@pytest.fixture
def fake_nrt(fake_nrt_path, tmp_path, monkeypatch) -> FakeNrt:
    """DEEPINFER_LIBNRT pointed at the double, a fresh call log, no visible-core pinning or injected failure."""
    from deepinfer.runtime.neuron.device import NeuronCore

    monkeypatch.setenv("DEEPINFER_LIBNRT", str(fake_nrt_path))
    monkeypatch.setenv("FAKE_NRT_LOG", str(tmp_path / "nrt.log"))
    monkeypatch.delenv("FAKE_NRT_FAIL", raising=False)
    # set, then delete: monkeypatch then also undoes the NeuronCore(core=k) pinning the tests cause
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "")
    monkeypatch.delenv("NEURON_RT_VISIBLE_CORES")
    yield FakeNrt(fake_nrt_path, tmp_path / "nrt.log")
    monkeypatch.delenv("FAKE_NRT_FAIL", raising=False)
    if NeuronCore._active is not None:  # a failed test must not leave the double initialized
        NeuronCore._active.close()


@pytest.fixture
def stub(tmp_path, monkeypatch) -> str:
    """The stand-in neuronx-cc (a TEST DOUBLE) on DEEPINFER_NEURONX_CC, recording its argv to
    `tmp_path/record.jsonl`."""
    from deepinfer.compiler.targets import neuronxcc as ncc

    STAND_IN.chmod(STAND_IN.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    for var in (
        "FAKE_NEURONX_CC_FAIL",
        "FAKE_NEURONX_CC_FAIL_MATCH",
        "FAKE_NEURONX_CC_SLEEP",
        "FAKE_NEURONX_CC_VERSION",
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("FAKE_NEURONX_CC_PYTHON", sys.executable)
    monkeypatch.setenv("FAKE_NEURONX_CC_RECORD", str(tmp_path / "record.jsonl"))
    monkeypatch.setenv(ncc.ENV_COMPILER, str(STAND_IN))
    ncc._VERSIONS.clear()
    return str(STAND_IN)


def finished_copy(hlo_bundle: Path, dest: Path) -> Path:
    """A copy of an HLO-stage bundle at `dest`, finished by the stand-in neuronx-cc (TEST DOUBLE NEFFs:
    each carries only a description of its HLO module's interface for the libnrt double)."""
    from deepinfer.compiler.finish import finish_bundle
    from deepinfer.compiler.targets import neuronxcc

    shutil.copytree(hlo_bundle, dest)
    STAND_IN.chmod(STAND_IN.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    with pytest.MonkeyPatch.context() as mp:
        for var in (
            "FAKE_NEURONX_CC_FAIL",
            "FAKE_NEURONX_CC_FAIL_MATCH",
            "FAKE_NEURONX_CC_SLEEP",
            "FAKE_NEURONX_CC_VERSION",
            "FAKE_NEURONX_CC_RECORD",
        ):
            mp.delenv(var, raising=False)
        mp.setenv("FAKE_NEURONX_CC_PYTHON", sys.executable)
        mp.setenv(neuronxcc.ENV_COMPILER, str(STAND_IN))
        finish_bundle(dest, jobs=1, log=lambda msg: None)
    return dest


@pytest.fixture
def session_env(fake_nrt_path, tmp_path, monkeypatch) -> Path:
    """What the rank processes of a session on the doubles inherit: the libnrt double, one log for
    every rank (each collective line names its rank), a shared directory to wait in, nothing of
    Neuron's set. Returns the log's path."""
    from deepinfer.runtime.neuron.libnrt import ENV_ROOT_COMM

    (tmp_path / "collectives").mkdir()
    monkeypatch.setenv("DEEPINFER_LIBNRT", str(fake_nrt_path))
    monkeypatch.setenv("FAKE_NRT_LOG", str(tmp_path / "nrt.log"))
    monkeypatch.setenv("FAKE_NRT_COLLECTIVES_DIR", str(tmp_path / "collectives"))
    for var in (
        ENV_ROOT_COMM,
        "FAKE_NRT_HANG_RANK",
        "FAKE_NRT_FAIL",
        "NEURON_RT_VISIBLE_CORES",
        "NEURON_LOGICAL_NC_CONFIG",
    ):
        monkeypatch.delenv(var, raising=False)
    return tmp_path / "nrt.log"


EXCHANGE_WAIT_S = 120  # a rank thread's wait for the others at a collective (`Exchange`)


class Exchange:
    """Every rank's value at a collective, in rank order: the ranks as threads of one test process
    (tests/trn2/test_draft_module.py, test_rows_layers.py), each wait bounded."""

    def __init__(self, world: int):
        self.barrier = threading.Barrier(world, timeout=EXCHANGE_WAIT_S)
        self.values: list = [None] * world

    def all(self, rank: int, value):
        self.values[rank] = value
        self.barrier.wait()
        got = list(self.values)
        self.barrier.wait()
        return got
