"""TEST DOUBLE: a stand-in for AWS's neuronx-cc. It compiles nothing.

It accepts the documented `neuronx-cc compile` flags (rejecting unknown or malformed ones
with a usage error and a non-zero exit, as an argparse CLI does), prints a `--version`
line in the real format, and writes a file that is structurally a NEFF (the 1024-byte
header laid out as deepinfer.bundles.neff documents, then a gzip'd tar) holding only a
note that it is a test double. Nothing run against it says anything about real NEFFs,
the real compiler, or Trn2.

When its input is a serialized HloModuleProto it can read (through jaxlib, when the
Python running it has jax), the payload also holds `fake-model.txt`: a description of
the module's interface for the libnrt TEST DOUBLE (tests/trn2/doubles/fake_nrt.c), which
finds it inside the NEFF. Tensors take the names the module stamps on them (the frontend
attributes neff_input_names on each parameter, neff_output_names on the root tuple), listed
in lexical order of their names as libnrt lists them; `copy <output> <input>` per
must-alias entry of input_output_alias; sizes in bytes. Such a payload is an uncompressed
tar (package version 1) so the double can find the text by searching the bytes. Input it
cannot read (any other bytes, a module without names or with a may-alias) gets the note alone.

Environment:
  FAKE_NEURONX_CC_RECORD=path   append {"argv": [...], "cwd": ...} as one JSON line per call
  FAKE_NEURONX_CC_FAIL=NCC_X    print an error line in the real format and exit 70
  FAKE_NEURONX_CC_FAIL_MATCH=re with FAKE_NEURONX_CC_FAIL: fail only modules whose --output file
                                name matches the regular expression (re.search), compile the others
  FAKE_NEURONX_CC_SLEEP=N       sleep N seconds first (timeout tests)
  FAKE_NEURONX_CC_VERSION=v     the version to report (default below)
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import os
import re
import struct
import sys
import tarfile
import time
import uuid

DEFAULT_VERSION = "2.99.0.0+0000000d"  # real format, impossible release: a double
HEADER = struct.Struct("<QQQQQ128sI32s16s256sI64sQI")
HEADER_SIZE = 1024
NOTE = (
    b"This file was written by tests/trn2/doubles/neuronx_cc_stub.py, a TEST DOUBLE of "
    b"neuronx-cc. It contains no executable code and cannot run on any Neuron device.\n"
)


def version() -> str:
    return os.environ.get("FAKE_NEURONX_CC_VERSION", DEFAULT_VERSION)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="neuronx-cc compile", allow_abbrev=False)
    p.add_argument("model_files")
    p.add_argument("--framework", required=True, choices=["XLA"])
    p.add_argument("--target", required=True, choices=["inf2", "trn1", "trn1n", "trn2"])
    p.add_argument("--model-type", default="generic", choices=["generic", "transformer", "unet-inference"])
    p.add_argument("--auto-cast", default="none", choices=["none", "matmult", "all"])
    p.add_argument("--auto-cast-type", default="bf16", choices=["bf16", "fp16", "tf32", "fp8_e4m3"])
    p.add_argument("--lnc", "--logical-nc-config", "-lnc", dest="lnc", type=int, choices=[1, 2])
    p.add_argument("--optlevel", "-O", dest="optlevel", type=int, default=2, choices=[1, 2, 3])
    p.add_argument("--distribution-strategy", choices=["llm-training", "nemo"])
    p.add_argument("--native-int64", choices=["default", "enabled", "disabled"])
    p.add_argument("--implicit-integer-downcast")
    for flag in (
        "--enable-mixed-precision-accumulation",
        "--disable-mixed-precision-accumulation",
        "--enable-saturate-infinity",
        "--enable-fast-context-switch",
        "--enable-fast-loading-neuron-binaries",
    ):
        p.add_argument(flag, action="store_true")
    p.add_argument("--logfile", default="log-neuron-cc.txt")
    p.add_argument("--output", default="file.neff")
    p.add_argument("--verbose", choices=["debug", "info", "warning", "error", "critical"])
    return p


def fake_model(hlo: bytes) -> str | None:
    """The fake-model text for fake_nrt.c describing an HloModuleProto's entry computation,
    or None when `hlo` is not one this Python can read."""
    try:
        from jax._src.interpreters import mlir
        from jax._src.lib import xla_client
        from jax._src.lib.mlir import ir
    except ImportError:
        return None
    try:
        bytecode = xla_client._xla.mlir.hlo_to_stablehlo(hlo)
        root = next(
            ln
            for ln in xla_client.XlaComputation(hlo).as_hlo_text().splitlines()
            if ln.lstrip().startswith("ROOT ") and "neff_output_names" in ln
        )
    except Exception:
        return None
    with mlir.make_ir_context():
        module = ir.Module.parse(bytecode)
        main = next(
            op
            for op in module.body.operations
            if "sym_name" in op.attributes and ir.StringAttr(op.attributes["sym_name"]).value == "main"
        )
        ftype = ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value)
        inputs = [
            ir.StringAttr(ir.DictAttr(ir.DictAttr(a)["mhlo.frontend_attributes"])["neff_input_names"]).value
            for a in ir.ArrayAttr(main.attributes["arg_attrs"])
        ]
        outputs = re.search(r'neff_output_names="([^"]*)"', root).group(1).split(",")
        sizes = {("input", n): _nbytes(t) for n, t in zip(inputs, ftype.inputs)}
        sizes.update({("output", n): _nbytes(t) for n, t in zip(outputs, ftype.results)})
        # libnrt lists a NEFF's tensors in lexical order of their names (input0, input1, input10, ...)
        lines = ["FAKE_NRT_MODEL 1"] + [f"{usage} {name} {size}" for (usage, name), size in sorted(sizes.items())]
        attrs = module.operation.attributes
        aliases = ir.ArrayAttr(attrs["mhlo.input_output_alias"]) if "mhlo.input_output_alias" in attrs else []
        for attr in aliases:  # {alias = {kind = "must_alias", parameter_number = i, ...}, output_index = array<i64: j>}
            entry = ir.DictAttr(attr)
            (j,) = ir.DenseI64ArrayAttr(entry["output_index"])
            alias = ir.DictAttr(entry["alias"])
            if ir.StringAttr(alias["kind"]).value != "must_alias":
                return None  # a may-alias: the runtime could not bind one buffer as both
            lines.append(f"copy {outputs[j]} {inputs[ir.IntegerAttr(alias['parameter_number']).value]}")
    return "\n".join(lines + ["end"]) + "\n"


def _nbytes(t) -> int:
    from jax._src.lib.mlir import ir

    t = ir.RankedTensorType(t)
    n = 1
    for d in t.shape:
        n *= d
    return n * max(1, (t.element_type.width + 7) // 8)  # i1 (pred) is stored as a byte


def neff_bytes(name: str, lnc: int, compressed: bool, model: str | None = None) -> bytes:
    """A structurally valid NEFF: header, then a (gzip'd) tar holding NOTE, and `model` as
    fake-model.txt when given (then always a plain tar: the libnrt double searches the bytes)."""
    members = [("TEST-DOUBLE.txt", NOTE)] + ([("fake-model.txt", model.encode())] if model else [])
    compressed = compressed and model is None
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for member, data in members:
            info = tarfile.TarInfo(member)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    payload = gzip.compress(buf.getvalue(), mtime=0) if compressed else buf.getvalue()
    pkg = 2 if compressed else 1
    digest = hashlib.md5(payload).digest() + b"0" * 16 if compressed else hashlib.sha256(payload).digest()
    features = 0x400 if lnc > 1 else 0  # "vnc" bit for LNC > 1
    header = HEADER.pack(
        pkg,
        HEADER_SIZE,
        len(payload),
        2,
        0,
        version().encode(),
        int(compressed),
        digest,
        uuid.uuid4().bytes,
        name.encode()[:255],
        1,
        bytes(64),
        features,
        lnc,
    )
    return header.ljust(HEADER_SIZE, b"\0") + payload


def compile_(argv: list[str]) -> int:
    args = parser().parse_args(argv)  # exits 2 with a usage message on bad flags
    lnc = args.lnc if args.lnc is not None else (2 if args.target == "trn2" else 1)
    with open(args.logfile, "a") as log:
        log.write(f"INFO [neuronx-cc stand-in]: compile {' '.join(argv)}\n")
        if lnc == 2 and args.target != "trn2":
            return _error(
                log,
                "NCC_EARG001",
                f"Unsupported Logical Neuron Core configuration {lnc} for target {args.target}",
                exit_code=70,
            )
        if not os.path.isfile(args.model_files) or os.path.getsize(args.model_files) == 0:
            print(f"ERROR: input file {args.model_files} is missing or empty (stand-in)", file=sys.stderr)
            return 1
        fail = os.environ.get("FAKE_NEURONX_CC_FAIL")
        match = os.environ.get("FAKE_NEURONX_CC_FAIL_MATCH")
        if fail and (not match or re.search(match, os.path.basename(args.output))):
            kind = "INTERNAL_ERROR" if fail[4:5] == "I" else "ERROR"
            print("Compiler status: starting stand-in", flush=True)
            return _error(
                log, fail, f"stand-in failure requested through FAKE_NEURONX_CC_FAIL ({kind})", exit_code=70, kind=kind
            )
        name = os.path.splitext(os.path.basename(args.output))[0]
        with open(args.model_files, "rb") as f:
            model = fake_model(f.read())
        data = neff_bytes(name, lnc, compressed=not args.enable_fast_loading_neuron_binaries, model=model)
        with open(args.output, "wb") as f:
            f.write(data)
        log.write("INFO [neuronx-cc stand-in]: wrote a TEST DOUBLE NEFF\n")
    print("Compiler status PASS", flush=True)
    return 0


def _error(log, code: str, message: str, *, exit_code: int, kind: str = "ERROR") -> int:
    """Report like neuronx-cc: `<time> [ERROR] [NCC_XXXX000] message` on stderr and in the log."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    line = f"{stamp} [{kind}] [{code}] {message}"
    print(line, file=sys.stderr, flush=True)
    log.write(line + "\n")
    print(f"Diagnostic logs stored in {os.path.abspath(log.name)}", file=sys.stderr, flush=True)
    return exit_code


def main(argv: list[str]) -> int:
    record = os.environ.get("FAKE_NEURONX_CC_RECORD")
    if record:
        with open(record, "a") as f:
            f.write(json.dumps({"argv": argv, "cwd": os.getcwd()}) + "\n")
    sleep = float(os.environ.get("FAKE_NEURONX_CC_SLEEP", "0") or 0)
    if sleep:
        time.sleep(sleep)
    if argv[:1] == ["--version"]:
        print(
            f"NeuronX Compiler version {version()}\n\nPython version {sys.version.split()[0]}\n"
            "HWM version (test double)\nNumPy version (test double)"
        )
        return 0
    if argv[:1] == ["compile"]:
        return compile_(argv[1:])
    print("usage: neuronx-cc {compile,list-operators} ... (test double)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
