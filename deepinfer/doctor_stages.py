"""The device stages of `deepinfer doctor` (deepinfer/doctor.py): modules, collectives, measurements.

Each returns its Stage, or raises a DeepinferError whose one line is its FAIL reason. Everything a
stage builds lives under the doctor's work directory (--work): the tiny bundle (modules/hlo, the
HLO-stage bundle checked on XLA:CPU; modules/neff, the same finished by neuronx-cc), the probe NEFFs,
the compiler's logs (*/logs/), and XLA:CPU's outputs each device run was compared with (*/reference/).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import torch

from deepinfer.bundles.neff import output_name
from deepinfer.doctor import PHYSICAL_CORES_PER_DEVICE, Doctor, Stage
from deepinfer.errors import DeepinferError
from deepinfer.runtime.neuron import probe

RANK_TIMEOUT_S = 600.0
ROUND_TRIP_BYTES = 10 << 10  # about one decode step's activations of a token at hidden 5,120 (bf16)
HOST_LINK_BYTES = 64 << 20
TINY_TOML = """# written by `deepinfer doctor`: examples/tiny/model_trn2.toml at one bucket (batch 1, 1 token)
[model]
checkpoint = "checkpoint"
tiny = {{ seed = 0, layers = 6 }}
dtype = "fp32"
cache_quant = true

[target]
name = "trn2"
executable = "neff"
options = {{ lnc = {lnc}, optlevel = 2, layers = "fused" }}

[buckets]
batch = [1]
tokens = [1]
max_context = 128

[kv]
block_size = 16
num_blocks = 24
"""


class DoctorCheckFailed(DeepinferError):
    """A device result differs from XLA:CPU, or a rank of the collectives probe failed."""


def _needs(doctor: Doctor, *python: str) -> str | None:
    """Why a device stage cannot run here (its SKIP reason), or None."""
    tool = doctor.stages.get("toolchain")
    if tool is None or tool.status == "FAIL":
        return "toolchain failed"
    missing = []
    if doctor.host.compiler is None:
        missing.append("neuronx-cc not found on PATH")
    if doctor.host.libnrt is None:
        missing.append("libnrt not found")
    missing += [f"{m} not installed (pip install 'deepinfer[trn2]')" for m in python if not importlib.util.find_spec(m)]
    return "; ".join(missing) or None


# --- probe modules: StableHLO -> HLO -> NEFF, and XLA:CPU's answers -------------------------------


def lower(p: probe.Probe, path: Path) -> Path:
    """The probe's HloModuleProto at `path`, its tensors named for the NEFF (as the trn2 target names them)."""
    from deepinfer.compiler.targets import hlo

    names = [n for n, _ in p.inputs]
    text = hlo.finish_module(p.text(), {}, names, [output_name(n) for n, _ in p.outputs])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(hlo.to_hlo_proto(text))
    return path


def build(probes: list[probe.Probe], work: Path, lnc: int) -> dict[str, Path]:
    """Each probe lowered and compiled by neuronx-cc into `work` -> {name: NEFF path}; the compiler's
    log of each in work/logs/<name>.log (named by the error a failure raises). A NEFF already there
    from the same HLO module, compiler version and LNC (its `.key` beside it) is kept, not rebuilt."""
    import hashlib

    from deepinfer.compiler.targets import neuronxcc

    opts = neuronxcc.NeuronCompileOptions(lnc=lnc)
    compiler = neuronxcc.find_compiler()
    if compiler is None:
        raise neuronxcc.NeuronCompilerMissing(neuronxcc.MISSING_MESSAGE)
    version = neuronxcc.compiler_version(compiler)
    built = {}
    for p in probes:
        hlo_path = lower(p, work / f"{p.name}.hlo.pb")
        neff, key_path = work / f"{p.name}.neff", work / f"{p.name}.key"
        # the StableHLO source, not the proto's bytes: those carry a module id that differs per process
        key = hashlib.sha256(f"{p.text()}|neuronx-cc {version}|lnc {lnc}".encode()).hexdigest()
        if not (neff.is_file() and key_path.is_file() and key_path.read_text() == key):
            key_path.unlink(missing_ok=True)
            log = work / probe.LOGS_DIR / f"{p.name}.log"
            neuronxcc.compile_neff(hlo_path, neff, log, opts, region=f"probe {p.name}", compiler=compiler)
            key_path.write_text(key)
        built[p.name] = neff
    return built


def reference(p: probe.Probe, work: Path) -> list[list[torch.Tensor]]:
    """The probe on XLA:CPU (one replica a rank) -> each rank's outputs; kept as raw bytes in
    work/reference/<name>.neff.<NEFF output name> (rank 0's: every rank's are equal for the
    collectives here)."""
    from deepinfer.compiler.targets import hlo

    proto = (work / f"{p.name}.hlo.pb").read_bytes()
    if p.world == 1:
        outs = [hlo.CpuHlo(proto)(probe.inputs(p, 0))]
    else:
        outs = hlo.CpuReplicas(proto, p.world)([probe.inputs(p, r) for r in range(p.world)])
    probe.keep(work, f"{p.name}.neff", [output_name(n) for n, _ in p.outputs], outs[0])
    return outs


# --- modules --------------------------------------------------------------------------------------


def modules(doctor: Doctor) -> Stage:
    """The tiny trn2 bundle (fused layers) compiled by neuronx-cc; one executable of each kind run
    on a NeuronCore and on XLA:CPU on the same fixed inputs, compared as the compile's check compares."""
    skip = _needs(doctor, "jax", "torch_mlir")
    if skip:
        return Stage("modules", "SKIP", skip)
    from deepinfer.bundles import manifest_io
    from deepinfer.runtime.neuron.device import NeuronCore

    root = doctor.work / "modules"
    hlo_dir, neff_dir = _tiny_bundle(root, doctor.host.lnc, doctor.host.neuronx_cc)
    hm, nm = manifest_io.read(hlo_dir), manifest_io.read(neff_dir)
    finished = {e.name: e for e in nm.regions}
    kinds: dict[str, float] = {}
    failed: list[str] = []
    with NeuronCore(None) as core:
        for e in sorted(hm.regions, key=lambda e: e.name):
            if e.kind not in kinds:
                try:
                    kinds[e.kind] = _check_kind(
                        core, e, hlo_dir / e.artifact, neff_dir / finished[e.name].artifact, root
                    )
                except DoctorCheckFailed as err:  # every kind is still run: the report names how many differ
                    kinds[e.kind] = float("nan")
                    failed.append(str(err))
    if failed:
        raise DoctorCheckFailed(f"{len(failed)} of {len(kinds)} kinds differ; the first: {failed[0]}")
    worst = max(kinds.values(), default=0.0)
    return Stage(
        "modules",
        "PASS",
        f"{len(kinds)} kinds compiled by neuronx-cc agree with XLA:CPU on a NeuronCore (worst score {worst:.3g})",
        {"kinds": kinds, "bundle": str(neff_dir)},
    )


def _tiny_bundle(root: Path, lnc: int, compiler_version: str | None) -> tuple[Path, Path]:
    """The tiny model as an HLO-stage bundle (root/hlo, each module checked on XLA:CPU by the compile)
    and a copy finished by neuronx-cc (root/neff); the compile's lines in root/compile.log. Both are
    kept while model.toml, deepinfer and neuronx-cc stay the same (root/built.key, written last)."""
    import hashlib

    from deepinfer import __version__
    from deepinfer.compiler.config import load_compile_config
    from deepinfer.compiler.finish import finish_bundle
    from deepinfer.compiler.pipeline import compile_bundle

    root.mkdir(parents=True, exist_ok=True)
    text = TINY_TOML.format(lnc=lnc)
    key = hashlib.sha256(f"{text}|deepinfer {__version__}|neuronx-cc {compiler_version}".encode()).hexdigest()
    hlo_dir, neff_dir, key_path = root / "hlo", root / "neff", root / "built.key"
    if key_path.is_file() and key_path.read_text() == key:
        return hlo_dir, neff_dir
    key_path.unlink(missing_ok=True)
    toml = root / "model.toml"
    toml.write_text(text)
    with (root / "compile.log").open("a") as f:

        def log(msg: str) -> None:
            f.write(msg + "\n")
            f.flush()

        compile_bundle(load_compile_config(toml), hlo_dir, jobs=1, force=True, log=log, hlo_only=True, cache=None)
        shutil.rmtree(neff_dir, ignore_errors=True)
        shutil.copytree(hlo_dir, neff_dir)
        finish_bundle(neff_dir, jobs=1, log=log)
    key_path.write_text(key)
    return hlo_dir, neff_dir


def fixed_inputs(specs, seed: int = 0) -> list[torch.Tensor]:
    """Valid inputs of the manifest's specs, the same on every run: floats N(0, 1) (a `pre` row a
    softmax), fp8 / ue8m0 bytes in [0, 0x80) with no e4m3 all-ones exponent (finite in both formats),
    every index 0 (in range for any table), masks of ones (`token_mask`, `cand`), other flags 0."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in specs:
        dtype = getattr(torch, s.dtype)
        if dtype == torch.uint8:
            t = torch.randint(0, 0x80, s.shape, generator=g, dtype=torch.uint8)
            t[(t & 0x78) == 0x78] ^= 0x40
        elif dtype.is_floating_point:
            t = torch.randn(s.shape, generator=g)
            t = torch.softmax(t, -1) if s.name == "pre" else t
        elif dtype == torch.bool:
            t = torch.full(s.shape, s.name.split(".")[-1] in ("token_mask", "cand"), dtype=torch.bool)
        else:
            t = torch.zeros(s.shape, dtype=dtype)
        out.append(t.to(dtype).contiguous())
    return out


def _check_kind(core, entry, hlo_path: Path, neff_path: Path, root: Path) -> float:
    """One executable on the NeuronCore and on XLA:CPU on fixed inputs -> its worst score, each
    output judged as the compile's check judges it (regions/agreement.py, the fp32 tolerance);
    DoctorCheckFailed names the kind and the first output that differs."""
    from deepinfer.compiler.targets import hlo
    from deepinfer.regions.agreement import ShapeMismatch, compare_tensors, tolerance

    xs = fixed_inputs(entry.inputs)
    ref = hlo.CpuHlo(hlo_path.read_bytes())([x.clone() for x in xs])
    labels = [s.name for s in entry.output_specs or ()]
    probe.keep(root, neff_path.name, [output_name(n) for n in labels], ref)
    got = _run_on_core(core, entry, neff_path, xs)
    tol, worst = tolerance(torch.float32), 0.0
    for label, g, r in zip(labels, got, ref):
        try:
            d = compare_tensors(label, g, r)
        except ShapeMismatch as e:
            raise DoctorCheckFailed(f"kind {entry.kind} ({entry.name}): {e}") from None
        if not d.agrees(tol):
            raise DoctorCheckFailed(
                f"kind {entry.kind} ({entry.name}): output {label} on the NeuronCore differs from XLA:CPU {d.how()} "
                f"(score {d.score:.3g}, tolerance {tol:g}; reference in {root / probe.REFERENCE_DIR})"
            )
        worst = max(worst, d.score)
    return worst


def _run_on_core(core, entry, neff_path: Path, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """`entry`'s NEFF run once on `core`: state inputs resident (written in place), outputs read back."""
    from deepinfer.runtime.neuron.device import DeviceTensor, NeuronExecutable

    specs = [(s.name, tuple(s.shape), getattr(torch, s.dtype)) for s in entry.output_specs or ()]
    aliases = {int(o): int(i) for o, i in (entry.aliases or {}).items()}
    resident = {i: DeviceTensor.from_torch(core, xs[i], entry.inputs[i].name) for i in aliases.values()}
    exe = NeuronExecutable(neff_path, core, [s.name for s in entry.inputs], specs, aliases)
    try:
        outs = exe([resident.get(i, x) for i, x in enumerate(xs)])
        return [o.to_torch(d, s) if isinstance(o, DeviceTensor) else o for o, (_, s, d) in zip(outs, specs)]
    finally:
        exe.close()
        for t in resident.values():
            t.free()


# --- collectives ----------------------------------------------------------------------------------


def collectives(doctor: Doctor) -> Stage:
    """The two-rank collective probes: one process a rank (NeuronCore r), loaded with
    nrt_load_collectives under NEURON_RT_ROOT_COMM_ID, each rank's outputs compared with XLA:CPU."""
    skip = _needs(doctor, "jax")
    visible = doctor.host.visible_cores
    if skip is None and visible is not None and visible < probe.WORLD:
        skip = f"needs {probe.WORLD} NeuronCores, libnrt shows {visible}"
    if skip:
        return Stage("collectives", "SKIP", skip)
    root = doctor.work / "collectives"
    probes = probe.collective_probes()
    build(probes, root, doctor.host.lnc)
    refs = {p.name: reference(p, root) for p in probes}
    times = _run_ranks(root, doctor.runs)
    for p in probes:
        for r in range(probe.WORLD):
            got = torch.load(root / "ranks" / f"{p.name}.{r}.pt")
            why = probe.differs(got, refs[p.name][r])
            if why:
                raise DoctorCheckFailed(f"{p.name} (2 ranks) rank {r}: {why}")
    for p in probes:  # the slower rank's median: a collective ends when its last rank does
        doctor.collectives.setdefault(p.op, []).append([p.payload, max(t[p.name] for t in times)])
    sizes = ", ".join(f"{p.payload} B" for p in probes if p.op == "all_reduce")
    return Stage(
        "collectives",
        "PASS",
        f"all-reduce and all-gather over {probe.WORLD} ranks ({sizes}) agree with XLA:CPU",
        {"root_comm": os.environ.get("NEURON_RT_ROOT_COMM_ID"), "execution_s": doctor.collectives},
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ranks(root: Path, runs: int) -> list[dict[str, float]]:
    """One `probe rank` process per rank, NeuronCore r visible to rank r, bounded by RANK_TIMEOUT_S;
    each rank's times, or DoctorCheckFailed naming the rank and its log."""
    comm = os.environ.get("NEURON_RT_ROOT_COMM_ID") or f"127.0.0.1:{_free_port()}"
    procs = []
    for r in range(probe.WORLD):
        env = {**os.environ, "NEURON_RT_ROOT_COMM_ID": comm, "NEURON_RT_VISIBLE_CORES": str(r)}
        (root / f"rank{r}.json").unlink(missing_ok=True)
        argv = [sys.executable, "-m", "deepinfer.runtime.neuron.probe", "rank", "--rank", str(r)]
        argv += ["--world", str(probe.WORLD), "--work", str(root), "--out", str(root / f"rank{r}.json")]
        with (root / f"rank{r}.log").open("w") as log:
            argv += ["--runs", str(runs)]
            procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        for r, p in enumerate(procs):
            try:
                p.wait(timeout=RANK_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                raise DoctorCheckFailed(
                    f"rank {r} of the collectives probe did not finish in {RANK_TIMEOUT_S:.0f} s "
                    f"(NEURON_RT_ROOT_COMM_ID={comm}; log: {root / f'rank{r}.log'})"
                ) from None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [_rank_result(root, r) for r in range(probe.WORLD)]


def _rank_result(root: Path, r: int) -> dict[str, float]:
    import json

    path, log = root / f"rank{r}.json", root / f"rank{r}.log"
    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError):
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.exists() else []
        raise DoctorCheckFailed(
            f"rank {r} of the collectives probe wrote no result ({tail[0] if tail else 'no output'}; log: {log})"
        ) from None
    if "error" in result:
        raise DoctorCheckFailed(f"rank {r}: {result['error']} (log: {log})")
    return result["times"]


# --- measurements ---------------------------------------------------------------------------------


def measurements(doctor: Doctor) -> Stage:
    """Launch overhead, HBM read bandwidth, host round trip and link on one NeuronCore (each probe's
    output checked against XLA:CPU first: a timing of a wrong result means nothing), the collectives'
    latency when that stage passed; the figures written to doctor.figures_out."""
    skip = _needs(doctor, "jax")
    if skip:
        return Stage("measurements", "SKIP", skip)
    root = doctor.work / "measurements"
    launch, hbm = probe.local_probes(doctor.hbm_bytes)
    built = build([launch, hbm], root, doctor.host.lnc)
    found = _time_core(doctor, launch, hbm, built, root)
    lnc = doctor.host.lnc
    per_device = PHYSICAL_CORES_PER_DEVICE // lnc
    figures = {
        "launch_s": {"value": found["launch_s"], "how": f"median of {doctor.runs} nrt_execute of a 4-float NEFF"},
        "hbm_bytes_per_s": {
            "value": found["core_read"] * per_device,
            "how": f"one logical core (lnc {lnc}) reading {hbm.payload} B resident in HBM, over the median "
            f"execution (launch included: a lower bound), x {per_device} logical cores a device",
        },
        "host_link_bytes_per_s": {
            "value": found["host_link"],
            "how": f"{HOST_LINK_BYTES} B written to and read back from the device (nrt_tensor_write/read), medians",
        },
    }
    if doctor.passed("collectives"):
        table = {op: [[b, max(0.0, t - found["launch_s"])] for b, t in rows] for op, rows in doctor.collectives.items()}
        doctor.collectives = table
        figures["collective_s"] = {
            "value": table["all_reduce"][0][1],
            "how": f"all-reduce of {table['all_reduce'][0][0]} B over {probe.WORLD} ranks in a NEFF, median less launch_s",
        }
    else:
        doctor.collectives = {}
    doctor.figures = figures
    where = doctor.write_figures()
    shown = ", ".join(f"{k} {v['value']:.3g}" for k, v in figures.items())
    return Stage("measurements", "PASS", f"{shown}; host round trip {found['round_trip']:.3g} s; wrote {where}", found)


def _time_core(doctor: Doctor, launch: probe.Probe, hbm: probe.Probe, built: dict, root: Path) -> dict[str, float]:
    from deepinfer.runtime.neuron.device import DeviceTensor, NeuronCore

    runs = doctor.runs
    with NeuronCore(None) as core:
        refs = {p.name: reference(p, root)[0] for p in (launch, hbm)}
        for p in (launch, hbm):
            why = probe.differs(probe.executable(core, p, built[p.name])(probe.inputs(p, 0)), refs[p.name])
            if why:
                raise DoctorCheckFailed(f"measurement probe {p.name}: {why}")
        x = probe.inputs(launch, 0)
        fast = probe.executable(core, launch, built["launch"], host=False)
        launch_s = probe.median_s(lambda: fast(x), runs)
        big = DeviceTensor.from_torch(core, probe.inputs(hbm, 0)[0], "hbm_read.x")
        reader = probe.executable(core, hbm, built["hbm_read"], host=False)
        read_s = probe.median_s(lambda: reader([big]), runs)
        small = torch.zeros(ROUND_TRIP_BYTES // 4)
        buf = DeviceTensor.allocate(core, ROUND_TRIP_BYTES, "round_trip")

        def round_trip_once() -> None:
            buf.write_from(small)
            buf.to_torch(torch.float32, small.shape)

        round_trip = probe.median_s(round_trip_once, runs)
        host = torch.zeros(HOST_LINK_BYTES // 4)
        link = DeviceTensor.allocate(core, HOST_LINK_BYTES, "host_link")
        write_s = probe.median_s(lambda: link.write_from(host), max(3, runs // 4))
        back_s = probe.median_s(lambda: link.to_torch(torch.float32, host.shape), max(3, runs // 4))
    return {
        "launch_s": launch_s,
        "hbm_read_s": read_s,
        "core_read": hbm.payload / read_s,
        "round_trip": round_trip,
        "host_link": 2 * HOST_LINK_BYTES / (write_s + back_s),
    }
