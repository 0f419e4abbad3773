"""`deepinfer doctor`: qualify a host for trn2 bundles in one command, stage by stage.

Stages (deepinfer/doctor_stages.py holds the last three), each one line `PASS|FAIL|SKIP <stage>: <reason>`:

  toolchain     neuronx-cc (its version, through the real CLI), libnrt (nrt_init, nrt_get_version,
                its NeuronCore counts), /dev/neuron* devices, the LNC; with --bundle, the host against
                what the bundle was compiled for (neuronx-cc version, target, LNC, ranks vs cores)
  modules       a tiny trn2 bundle compiled by neuronx-cc; one module of each kind loaded on a
                NeuronCore, run on fixed inputs and compared with the same HLO module on XLA:CPU
  collectives   two-rank all-reduce / all-gather NEFFs loaded with nrt_load_collectives under
                NEURON_RT_ROOT_COMM_ID by one process a rank, run and compared with XLA:CPU
  measurements  launch overhead, in-graph collective latency by payload size, HBM read bandwidth,
                host round trip and host link bandwidth; written to the figures file (--figures-out)

A stage SKIPs, saying what is missing, when the SDK or a device is not there, or when the stage it
needs did not pass. Exit status: 0 when no stage FAILs, 1 when one does, 2 for bad input (an
unreadable --bundle).
"""

from __future__ import annotations

import glob
import json
import os
import socket
import traceback
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from deepinfer.errors import DeepinferError

STAGES = ("toolchain", "modules", "collectives", "measurements")
EXIT_OK, EXIT_FAILED = 0, 1
FIGURES_FORMAT = 1
DEFAULT_FIGURES = "deepinfer-figures.json"
ENV_LNC = "NEURON_LOGICAL_NC_CONFIG"
DEFAULT_LNC = 2  # trn2's default logical core (two physical NeuronCore-v3)
PHYSICAL_CORES_PER_DEVICE = 8  # a Trainium2 device
DMI_PRODUCT = Path("/sys/devices/virtual/dmi/id/product_name")  # an EC2 instance's type, e.g. trn2.48xlarge


@dataclass
class Stage:
    """One stage's verdict: status PASS | FAIL | SKIP, a one-line reason, and what it found."""

    name: str
    status: str
    reason: str
    details: dict = field(default_factory=dict)

    def line(self) -> str:
        return f"{self.status} {self.name}: {self.reason}"


@dataclass
class Host:
    """What the toolchain stage found (None: not there or not readable)."""

    compiler: str | None = None
    neuronx_cc: str | None = None
    libnrt: str | None = None
    libnrt_version: str | None = None
    total_cores: int | None = None
    visible_cores: int | None = None
    devices: int = 0
    lnc: int = DEFAULT_LNC
    missing: list[str] = field(default_factory=list)


@dataclass
class Doctor:
    """One run: its options, the host, the stages so far, and what was measured."""

    work: Path
    bundle: Path | None = None
    hbm_bytes: int = 256 << 20
    runs: int = 20
    host: Host = field(default_factory=Host)
    stages: dict[str, Stage] = field(default_factory=dict)
    figures: dict[str, dict] = field(default_factory=dict)
    collectives: dict[str, list[list[float]]] = field(default_factory=dict)
    figures_out: Path = Path(DEFAULT_FIGURES)
    only: tuple[str, ...] = ()  # the device stages to run (--only); () runs every stage

    def selected(self, name: str) -> bool:
        """The toolchain stage always runs: every other stage needs what it finds."""
        return name == "toolchain" or not self.only or name in self.only

    def write_figures(self) -> Path:
        return save_figures(self, self.figures_out)

    def passed(self, name: str) -> bool:
        return name in self.stages and self.stages[name].status == "PASS"

    def failing(self) -> bool:
        return any(s.status == "FAIL" for s in self.stages.values())


def run(doctor: Doctor, echo=print) -> Doctor:
    """Every stage in order, each line echoed as it ends; a stage's unexpected error is its FAIL,
    with the traceback kept in <work>/doctor-<stage>.log (named in the line)."""
    from deepinfer import doctor_stages

    steps = {
        "toolchain": toolchain,
        "modules": doctor_stages.modules,
        "collectives": doctor_stages.collectives,
        "measurements": doctor_stages.measurements,
    }
    doctor.work.mkdir(parents=True, exist_ok=True)
    for name in STAGES:
        try:
            stage = steps[name](doctor) if doctor.selected(name) else Stage(name, "SKIP", "not selected (--only)")
        except DeepinferError as e:
            stage = Stage(name, "FAIL", str(e).splitlines()[0] if str(e) else type(e).__name__)
        except Exception as e:  # a doctor bug or a runtime surprise: one line, the traceback kept
            log = doctor.work / f"doctor-{name}.log"
            log.write_text(traceback.format_exc())
            stage = Stage(name, "FAIL", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} (log: {log})")
        doctor.stages[name] = stage
        echo(stage.line())
    return doctor


# --- toolchain ----------------------------------------------------------------------------------


def toolchain(doctor: Doctor) -> Stage:
    """neuronx-cc, libnrt, devices and LNC; with --bundle, the host against the bundle."""
    host, problems = doctor.host, list[str]()
    _find_compiler(host, problems)
    _open_runtime(host, problems)
    host.devices = len(glob.glob("/dev/neuron[0-9]*"))
    lnc = os.environ.get(ENV_LNC)
    if lnc is not None and lnc not in ("1", "2"):
        problems.append(f"{ENV_LNC}={lnc!r} is not 1 or 2")
    host.lnc = int(lnc) if lnc in ("1", "2") else DEFAULT_LNC
    details = asdict(host)  # every field the stage found, as the JSON report's details
    if doctor.bundle is not None:
        bundle_problems = check_bundle(doctor.bundle, host)
        details["bundle"] = {"path": str(doctor.bundle), "problems": bundle_problems}
        problems += bundle_problems
    if problems:
        return Stage("toolchain", "FAIL", "; ".join(problems), details)
    if host.compiler is None and host.libnrt is None:
        return Stage("toolchain", "SKIP", "; ".join(host.missing), details)
    found = [f"neuronx-cc {host.neuronx_cc}"] if host.neuronx_cc else []
    if host.libnrt_version is not None:
        found.append(f"libnrt {host.libnrt_version}, {host.visible_cores} of {host.total_cores} NeuronCores visible")
    found.append(f"{host.devices} devices, lnc {host.lnc}")
    return Stage("toolchain", "PASS", ", ".join(found + host.missing), details)


def _find_compiler(host: Host, problems: list[str]) -> None:
    from deepinfer.compiler.targets import neuronxcc

    host.compiler = neuronxcc.find_compiler()
    if host.compiler is None:
        host.missing.append(f"neuronx-cc not found on PATH or {neuronxcc.ENV_COMPILER}")
        return
    try:
        host.neuronx_cc = neuronxcc.compiler_version(host.compiler)
    except DeepinferError as e:
        problems.append(str(e))


def _open_runtime(host: Host, problems: list[str]) -> None:
    """libnrt loaded and initialized once (nrt_init, nrt_get_version, the core counts, nrt_close)."""
    from deepinfer.runtime.neuron import libnrt
    from deepinfer.runtime.neuron.device import NeuronCore
    from deepinfer.runtime.neuron.probe import core_counts

    try:
        lib = libnrt.open_library()
    except libnrt.NeuronRuntimeMissing as e:
        host.missing.append(f"libnrt not found ({str(e).split(';')[0]})")
        return
    host.libnrt = lib.path
    try:
        with NeuronCore(None, lib=lib) as core:
            host.libnrt_version = core.version or "(no nrt_get_version)"
            host.total_cores, host.visible_cores = core_counts(lib)
    except DeepinferError as e:
        problems.append(f"libnrt {lib.path}: {e}")
        return
    if not host.visible_cores:
        problems.append(f"libnrt {lib.path} sees no NeuronCore (is the Neuron driver loaded? /dev/neuron*)")


def check_bundle(bundle: Path, host: Host) -> list[str]:
    """What in `bundle`'s manifest this host does not match, one phrase each naming the field
    (an unreadable bundle raises its one-line error: bad input, exit 2)."""
    from deepinfer.bundles import manifest_io

    m = manifest_io.read(bundle)
    where = f"bundle {bundle}"
    if m.target.name != "trn2":
        return [f"{where}: target {m.target.name!r}, not 'trn2' (nothing of it runs on a NeuronCore)"]
    problems = []
    built = m.toolchain.get("neuronx-cc")
    if m.stage == "hlo":
        problems.append(f"{where}: stage 'hlo' (no NEFFs yet: `deepinfer-compile --finish {bundle}`)")
    elif host.neuronx_cc is not None and built != host.neuronx_cc:
        problems.append(f"{where}: toolchain neuronx-cc {built}, this host has {host.neuronx_cc}")
    lnc = m.topology.lnc or 1
    if lnc != host.lnc:
        problems.append(f"{where}: topology lnc {lnc}, this host runs lnc {host.lnc} ({ENV_LNC})")
    if host.visible_cores is not None and m.topology.world_size > host.visible_cores:
        problems.append(
            f"{where}: topology world_size {m.topology.world_size} ranks, this host shows "
            f"{host.visible_cores} logical NeuronCores ({host.devices} devices x "
            f"{PHYSICAL_CORES_PER_DEVICE} cores / lnc {host.lnc})"
        )
    return problems


# --- the report and the figures file --------------------------------------------------------------


def measured_on(host: Host) -> dict:
    """The figures file's `measured_on`."""
    try:
        instance = DMI_PRODUCT.read_text().strip() or None
    except OSError:
        instance = None
    return {
        "host": socket.gethostname(),
        "instance_type": instance,
        "neuronx_cc": host.neuronx_cc,
        "libnrt": host.libnrt_version,
        "lnc": host.lnc,
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def figures_json(doctor: Doctor) -> dict:
    """The figures file (format 1, COMMON43.md): every figure present is measured."""
    out: dict = {
        "deepinfer_figures": FIGURES_FORMAT,
        "measured_on": measured_on(doctor.host),
        "figures": doctor.figures,
    }
    if doctor.collectives:
        out["collectives"] = doctor.collectives
    return out


def save_figures(doctor: Doctor, path: Path) -> Path:
    """The figures file at `path`, written beside and renamed into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(figures_json(doctor), indent=1) + "\n")
    os.replace(tmp, path)
    return path


def report_json(doctor: Doctor, figures_path: Path | None) -> dict:
    """The whole report: each stage (status, reason, details), the figures and where they went."""
    return {
        "stages": [
            {"stage": s.name, "status": s.status, "reason": s.reason, "details": s.details}
            for s in doctor.stages.values()
        ],
        "figures": figures_json(doctor) if doctor.figures else None,
        "figures_file": str(figures_path) if figures_path is not None else None,
        "work": str(doctor.work),
        "exit": EXIT_FAILED if doctor.failing() else EXIT_OK,
    }


def default_work() -> Path:
    """--work's default: $XDG_CACHE_HOME/deepinfer/doctor, else ~/.cache/deepinfer/doctor."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "deepinfer" / "doctor"
