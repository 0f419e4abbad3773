"""Contract tests of deepinfer.compiler.targets.neuronxcc against a STAND-IN for neuronx-cc.

The stand-in (tests/trn2/doubles/neuronx-cc) accepts the documented flags and writes a
file shaped like a NEFF; it compiles nothing. These tests pin the command line we issue,
how versions are read, how logs are kept and how failures are reported. They prove
nothing about real NEFFs, the real compiler's behaviour, or Trn2.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from deepinfer.bundles.neff import read_header
from deepinfer.compiler.targets import neuronxcc as ncc
from deepinfer.compiler.targets.neuronxcc import (
    KEYED,
    LOG_ONLY,
    NeuronCompileError,
    NeuronCompileOptions,
    NeuronCompilerMissing,
    command,
    compile_neff,
    compiler_version,
    find_compiler,
)

DOUBLES = Path(__file__).resolve().parent / "doubles"
STUB = DOUBLES / "neuronx-cc"
STUB_VERSION = "2.99.0.0+0000000d"
REGION = "attn_window.decode.b1t1"


def recorded(tmp_path) -> list[dict]:
    path = tmp_path / "record.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture
def hlo(tmp_path) -> Path:
    path = tmp_path / "in" / "region.hlo.pb"
    path.parent.mkdir()
    path.write_bytes(b"\x0a\x04test")  # any non-empty bytes: the stand-in does not parse HLO
    return path


# --- the command line ---


def test_command_defaults():
    opts = NeuronCompileOptions()
    assert command("/opt/neuronx-cc", Path("/w/m.hlo.pb"), Path("/w/m.neff"), opts, Path("/w")) == [
        "/opt/neuronx-cc",
        "compile",
        "/w/m.hlo.pb",
        "--framework",
        "XLA",
        "--target",
        "trn2",
        "--lnc",
        "2",
        "--model-type",
        "transformer",
        "-O2",
        "--auto-cast",
        "none",
        "--logfile",
        "/w/log-neuron-cc.txt",
        "--output",
        "/w/m.neff",
    ]


def test_command_options():
    opts = NeuronCompileOptions(
        lnc=1,
        optlevel=3,
        model_type="generic",
        auto_cast="matmult",
        verbose="info",
        extra_flags=("--enable-fast-loading-neuron-binaries",),
    )
    assert command("cc", Path("a.pb"), Path("b.neff"), opts, Path("job")) == [
        "cc",
        "compile",
        "a.pb",
        "--framework",
        "XLA",
        "--target",
        "trn2",
        "--lnc",
        "1",
        "--model-type",
        "generic",
        "-O3",
        "--auto-cast",
        "matmult",
        "--logfile",
        "job/log-neuron-cc.txt",
        "--verbose",
        "info",
        "--output",
        "b.neff",
        "--enable-fast-loading-neuron-binaries",
    ]


def test_command_optlevel_1():
    argv = command("cc", Path("a"), Path("b"), NeuronCompileOptions(optlevel=1), Path("w"))
    assert "-O1" in argv and "-O2" not in argv


# --- options ---


def test_options_defaults_follow_the_cli_reference():
    opts = NeuronCompileOptions()
    assert (
        opts.lnc,
        opts.optlevel,
        opts.model_type,
        opts.auto_cast,
        opts.extra_flags,
        opts.verbose,
        opts.timeout_s,
    ) == (2, 2, "transformer", "none", (), None, 3600.0)


def test_from_dict_builds_options():
    opts = NeuronCompileOptions.from_dict(
        {"lnc": 1, "optlevel": 1, "extra_flags": ["--enable-saturate-infinity"], "timeout_s": 60, "verbose": "debug"}
    )
    assert opts == NeuronCompileOptions(
        lnc=1, optlevel=1, extra_flags=("--enable-saturate-infinity",), timeout_s=60.0, verbose="debug"
    )
    assert NeuronCompileOptions.from_dict({}) == NeuronCompileOptions()


def test_from_dict_unknown_key_lists_valid_ones():
    msg = NeuronCompileOptions.from_dict({"lnc": 2, "opt_level": 3})
    assert isinstance(msg, str)
    assert "'opt_level'" in msg
    for key in KEYED + LOG_ONLY:
        assert key in msg


@pytest.mark.parametrize(
    "options, fragment",
    [
        ({"lnc": 3}, "lnc = 3"),
        ({"lnc": True}, "lnc = True"),
        ({"lnc": "2"}, "lnc = '2'"),
        ({"lnc": 2.0}, "lnc = 2.0"),
        ({"optlevel": 0}, "optlevel = 0"),
        ({"model_type": "cnn"}, "model_type"),
        ({"auto_cast": "matmul"}, "auto_cast = 'matmul'"),
        ({"verbose": 35}, "verbose = 35"),
        ({"timeout_s": 0}, "timeout_s = 0"),
        ({"timeout_s": "1h"}, "timeout_s"),
        ({"extra_flags": "--foo"}, "list of strings"),
        ({"extra_flags": ["--lnc=1"]}, "'--lnc=1'"),
        ({"extra_flags": ["-O3"]}, "'-O3'"),
        ({"extra_flags": ["--output", "x.neff"]}, "'--output'"),
        ({"extra_flags": ["--logical-nc-config", "1"]}, "'--logical-nc-config'"),
    ],
)
def test_from_dict_refuses_bad_values(options, fragment):
    msg = NeuronCompileOptions.from_dict(options)
    assert isinstance(msg, str) and fragment in msg and "\n" not in msg


def test_keyed_and_log_only_partition_every_option():
    names = [f for f in NeuronCompileOptions.__dataclass_fields__]
    assert sorted(KEYED + LOG_ONLY) == sorted(names)
    assert not set(KEYED) & set(LOG_ONLY)
    assert "verbose" in LOG_ONLY and "timeout_s" in LOG_ONLY and "lnc" in KEYED
    assert NeuronCompileOptions(verbose="debug", timeout_s=5).keyed() == NeuronCompileOptions().keyed()
    assert NeuronCompileOptions(lnc=1).keyed() != NeuronCompileOptions().keyed()


# --- finding the compiler and its version ---


def test_find_compiler_prefers_env(stub, monkeypatch, tmp_path):
    assert find_compiler() == stub
    monkeypatch.setenv(ncc.ENV_COMPILER, str(tmp_path / "nope"))
    assert find_compiler() is None


def test_find_compiler_on_path(stub, monkeypatch, tmp_path):
    monkeypatch.delenv(ncc.ENV_COMPILER)
    monkeypatch.setenv("PATH", str(DOUBLES))
    assert find_compiler() == str(STUB)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert find_compiler() is None


def test_compiler_version_parsed_and_cached(stub, tmp_path):
    assert compiler_version(stub) == STUB_VERSION
    assert compiler_version(stub) == STUB_VERSION
    assert [r["argv"] for r in recorded(tmp_path)] == [["--version"]]  # second call: cached


def test_compiler_version_cache_follows_mtime(stub, tmp_path, monkeypatch):
    # a copy of the stand-in's wrapper, so its mtime can change without touching the original
    wrapper = tmp_path / "neuronx-cc"
    wrapper.write_text(f'#!/bin/sh\nexec "$FAKE_NEURONX_CC_PYTHON" "{DOUBLES / "neuronx_cc_stub.py"}" "$@"\n')
    wrapper.chmod(0o755)
    assert compiler_version(str(wrapper)) == STUB_VERSION
    monkeypatch.setenv("FAKE_NEURONX_CC_VERSION", "2.21.1.0+abcdef12")
    assert compiler_version(str(wrapper)) == STUB_VERSION  # same file: cached
    later = time.time() + 10
    os.utime(wrapper, (later, later))
    assert compiler_version(str(wrapper)) == "2.21.1.0+abcdef12"  # "upgraded": asked again


def test_compiler_version_refuses_other_programs():
    with pytest.raises(NeuronCompileError, match="no 'NeuronX Compiler version' line"):
        compiler_version(sys.executable)  # `python --version` answers, but not as neuronx-cc


# --- compile_neff ---


def test_compile_writes_neff_and_keeps_log(stub, hlo, tmp_path):
    out = tmp_path / "bundle" / "regions" / "r.neff"
    log = tmp_path / "bundle" / "logs" / "r.log"
    opts = NeuronCompileOptions(lnc=1)
    assert compile_neff(hlo, out, log, opts, region=REGION) == out.resolve()
    header = read_header(out)
    assert header.lnc == 1 and header.name == "r"
    assert sorted(p.name for p in out.parent.iterdir()) == ["r.neff"]  # job dir removed
    (call,) = recorded(tmp_path)
    workdir = Path(call["cwd"])
    assert workdir.parent == out.parent.resolve() and not workdir.exists()
    assert call["argv"][0] == "compile"
    assert call["argv"] == command(stub, hlo, workdir / "r.neff", opts, workdir)[1:]
    text = log.read_text()
    assert f"region {REGION}" in text and "Compiler status PASS" in text
    assert "--lnc 1" in text  # the command, for reproduction
    assert "wrote a TEST DOUBLE NEFF" in text  # the compiler's own log, kept


def test_compile_failure_names_region_code_and_log(stub, hlo, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_NEURONX_CC_FAIL", "NCC_IBCG902")
    out, log = tmp_path / "out" / "r.neff", tmp_path / "logs" / "r.log"
    with pytest.raises(NeuronCompileError) as info:
        compile_neff(hlo, out, log, NeuronCompileOptions(), region=REGION)
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith(f"region {REGION}: neuronx-cc failed with NCC_IBCG902: stand-in failure")
    assert msg.endswith(f"(log: {log.resolve()})")
    assert log.is_file() and "NCC_IBCG902" in log.read_text()
    assert not out.exists() and list(out.parent.iterdir()) == []


def test_compile_failure_without_code_quotes_last_line(stub, tmp_path):
    empty = tmp_path / "empty.hlo.pb"
    empty.write_bytes(b"")
    with pytest.raises(NeuronCompileError, match=r"failed \(exit 1\): ERROR: input file .* is missing or empty"):
        compile_neff(empty, tmp_path / "r.neff", tmp_path / "r.log", NeuronCompileOptions(), region=REGION)


def test_compile_rejected_flag_is_reported(stub, hlo, tmp_path):
    opts = NeuronCompileOptions(extra_flags=("--no-such-flag",))
    with pytest.raises(NeuronCompileError, match=r"failed \(exit 2\): .*unrecognized arguments: --no-such-flag"):
        compile_neff(hlo, tmp_path / "r.neff", tmp_path / "r.log", opts, region=REGION)


def test_compile_timeout(stub, hlo, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_NEURONX_CC_SLEEP", "60")
    log = tmp_path / "r.log"
    start = time.monotonic()
    with pytest.raises(NeuronCompileError) as info:
        compile_neff(hlo, tmp_path / "o" / "r.neff", log, NeuronCompileOptions(timeout_s=1), region=REGION)
    assert time.monotonic() - start < 30
    assert str(info.value) == f"region {REGION}: neuronx-cc timed out after 1 s (log: {log.resolve()})"
    assert "killed after 1 s" in log.read_text()
    assert list((tmp_path / "o").iterdir()) == []


def test_compile_success_without_output_is_an_error(hlo, tmp_path):
    # a second TEST DOUBLE: a "compiler" that exits 0 and writes nothing
    silent = tmp_path / "silent-neuronx-cc"
    silent.write_text("#!/bin/sh\necho 'Compiler status PASS'\nexit 0\n")
    silent.chmod(0o755)
    with pytest.raises(NeuronCompileError, match=f"region {REGION}: neuronx-cc exited 0 but wrote no NEFF"):
        compile_neff(
            hlo, tmp_path / "r.neff", tmp_path / "r.log", NeuronCompileOptions(), region=REGION, compiler=str(silent)
        )


def test_missing_compiler_message(hlo, tmp_path, monkeypatch):
    monkeypatch.delenv(ncc.ENV_COMPILER, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(NeuronCompilerMissing) as info:
        compile_neff(hlo, tmp_path / "r.neff", tmp_path / "r.log", NeuronCompileOptions(), region=REGION)
    msg = str(info.value)
    assert "\n" not in msg
    for part in (
        "neuronx-cc not found on PATH or DEEPINFER_NEURONX_CC",
        "https://pip.repos.neuron.amazonaws.com",
        "no Trn2 needed",
        "deepinfer-compile --finish BUNDLE",
    ):
        assert part in msg


def test_errors_are_deepinfer_errors():
    from deepinfer.errors import DeepinferError

    assert issubclass(NeuronCompileError, DeepinferError) and issubclass(NeuronCompilerMissing, DeepinferError)


@pytest.mark.parametrize(
    "console, expected",
    [
        (
            "2024-08-15T14:01:19Z [ERROR] [NCC_EVRF029] Operation sort is not supported on trn2.\n",
            "NCC_EVRF029: Operation sort is not supported on trn2.",
        ),
        (
            "[INTERNAL_ERROR] [NCC_INLA001] Unhandled exception with message:\n",
            "NCC_INLA001: Unhandled exception with message:",
        ),
        (
            "RunNeuronCCImpl: [ERROR] [NCC_EOOM001]\n  Maximum peak HBM usage of 32.00GB exceeds HBM limit\n",
            "NCC_EOOM001: Maximum peak HBM usage of 32.00GB exceeds HBM limit",
        ),
        # the older form: a bracketed code of three letters and three digits (aws-neuron-sdk issue 881)
        (
            "INFO: compiling\n2024-04-30T20:50:00Z [TEN404] (aten__add_add.31) Internal tensorizer error: "
            "NeuronValueNumbering - Please open a support ticket\n",
            "TEN404: (aten__add_add.31) Internal tensorizer error: NeuronValueNumbering - Please open a support ticket",
        ),
    ],
)
def test_failure_message_quotes_the_error_line(tmp_path, console, expected):
    # log text in the shapes public neuronx-cc reports show (see the module's sources)
    log = tmp_path / "r.log"
    log.write_text(f"# deepinfer: region {REGION}\n" + console)
    assert ncc._failure_message(REGION, 70, log) == (f"region {REGION}: neuronx-cc failed with {expected} (log: {log})")
