"""The device work of `deepinfer doctor` (deepinfer/doctor.py): small probe modules written as
StableHLO (deepinfer/doctor_stages.py lowers them, has neuronx-cc compile them and runs them on
XLA:CPU), run here on a NeuronCore and timed.

- `launch`: y = x + x on 4 floats; its median execution time is the launch overhead (launch_s).
- `hbm_read`: the row sums of a [rows, 4096] float32 tensor resident on the device (the module reads
  every byte once); bytes / its median execution time (a lower bound: the launch is in it) is one
  logical core's HBM read bandwidth.
- `all_reduce.<bytes>` / `all_gather.<bytes>`: one collective over two ranks, each rank's input of
  <bytes>, written as AWS's own HLO producers write them (replica_groups, no channel_id: see
  compiler/targets/hlo.py); loaded with nrt_load_collectives under NEURON_RT_ROOT_COMM_ID by one
  process a rank (`python -m deepinfer.runtime.neuron.probe rank ...`, `rank_main`).

Every probe's outputs are compared with the same module on XLA:CPU (hlo.CpuHlo / hlo.CpuReplicas)
on the same seeded inputs; the XLA:CPU outputs are kept beside the NEFFs (`reference/<neff>.<output>`,
raw bytes) so that a failing host's report can be checked against them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from deepinfer.errors import DeepinferError

ROW = 4096  # floats per row of the hbm_read probe
COLLECTIVE_BYTES = (1024, 64 << 10, 1 << 20, 16 << 20)  # each rank's input
WORLD = 2
TIMED_RUNS = 20
REFERENCE_DIR = "reference"
LOGS_DIR = "logs"


@dataclass(frozen=True)
class Probe:
    """One probe module: its StableHLO, its float32 inputs and outputs (name, shape), its world."""

    name: str
    op: str  # "launch" | "hbm_read" | "all_reduce" | "all_gather"
    inputs: tuple[tuple[str, tuple[int, ...]], ...]
    outputs: tuple[tuple[str, tuple[int, ...]], ...]
    world: int = 1

    @property
    def payload(self) -> int:
        """Bytes of one rank's input."""
        return 4 * _numel(self.inputs[0][1])

    def text(self) -> str:
        """The module's StableHLO (function @main)."""
        (_, shape), (_, out) = self.inputs[0], self.outputs[0]
        t, o = _tensor(shape), _tensor(out)
        groups = f"dense<[[{', '.join(map(str, range(self.world)))}]]> : tensor<1x{self.world}xi64>"
        if self.op == "launch":
            body = f"%0 = stablehlo.add %arg0, %arg0 : {t}"
        elif self.op == "hbm_read":
            body = (
                "%c = stablehlo.constant dense<0.0> : tensor<f32>\n"
                f"    %0 = stablehlo.reduce(%arg0 init: %c) applies stablehlo.add across dimensions = [1] "
                f": ({t}, tensor<f32>) -> {o}"
            )
        elif self.op == "all_reduce":
            body = (
                '%0 = "stablehlo.all_reduce"(%arg0) ({\n'
                "    ^bb0(%a: tensor<f32>, %b: tensor<f32>):\n"
                "      %s = stablehlo.add %a, %b : tensor<f32>\n"
                "      stablehlo.return %s : tensor<f32>\n"
                f"    }}) {{replica_groups = {groups}}} : ({t}) -> {o}"
            )
        else:
            body = (
                f'%0 = "stablehlo.all_gather"(%arg0) {{all_gather_dim = 0 : i64, replica_groups = {groups}}} '
                f": ({t}) -> {o}"
            )
        return (
            f"module @{self.op} {{\n  func.func public @main(%arg0: {t}) -> {o} {{\n    {body}\n"
            f"    return %0 : {o}\n  }}\n}}\n"
        )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _tensor(shape: tuple[int, ...]) -> str:
    return f"tensor<{'x'.join(map(str, shape))}xf32>"


def core_counts(lib) -> tuple[int | None, int | None]:
    """(total, visible) NeuronCores as libnrt counts them (nrt.h's nrt_get_total_nc_count and
    nrt_get_visible_nc_count, called between nrt_init and nrt_close); None where this libnrt does not
    export the function. Uncertain (not verified on hardware): whether they count logical cores (at
    the process's LNC) or physical ones; the doctor reports them as libnrt gives them."""
    import ctypes

    out: list[int | None] = []
    for name in ("nrt_get_total_nc_count", "nrt_get_visible_nc_count"):
        if not hasattr(lib.dll, name):
            out.append(None)
            continue
        fn = getattr(lib.dll, name)
        fn.restype, fn.argtypes = ctypes.c_int, [ctypes.POINTER(ctypes.c_uint32)]
        n = ctypes.c_uint32()
        lib._call(name, ctypes.byref(n))
        out.append(n.value)
    return out[0], out[1]


def local_probes(hbm_bytes: int) -> list[Probe]:
    """The one-core probes: launch, and hbm_read over `hbm_bytes` (rounded down to whole rows)."""
    rows = max(1, hbm_bytes // (4 * ROW))
    return [
        Probe("launch", "launch", (("x", (4,)),), (("y", (4,)),)),
        Probe("hbm_read", "hbm_read", (("x", (rows, ROW)),), (("y", (rows,)),)),
    ]


def collective_probes() -> list[Probe]:
    """An all-reduce and an all-gather over two ranks at each size of COLLECTIVE_BYTES."""
    out = []
    for size in COLLECTIVE_BYTES:
        n = size // 4
        out.append(Probe(f"all_reduce.{size}", "all_reduce", (("x", (n,)),), (("y", (n,)),), WORLD))
        out.append(Probe(f"all_gather.{size}", "all_gather", (("x", (n,)),), (("y", (WORLD * n,)),), WORLD))
    return out


def inputs(probe: Probe, rank: int) -> list[torch.Tensor]:
    """The probe's fixed inputs for `rank`: uniform [0, 1) float32, seeded by the probe and rank."""
    g = torch.Generator().manual_seed(1000 * rank + sum(map(ord, probe.name)))
    return [torch.rand(shape, generator=g, dtype=torch.float32) for _, shape in probe.inputs]


def keep(work: Path, neff_name: str, names: list[str], outs: list[torch.Tensor]) -> None:
    """XLA:CPU's outputs of the NEFF `neff_name`, as raw bytes in work/reference/<neff>.<output>."""
    ref = work / REFERENCE_DIR
    ref.mkdir(parents=True, exist_ok=True)
    for name, t in zip(names, outs):
        tmp = ref / f".{neff_name}.{name}.tmp"
        tmp.write_bytes(t.contiguous().view(torch.uint8).numpy().tobytes())
        os.replace(tmp, ref / f"{neff_name}.{name}")


def differs(got: list[torch.Tensor], want: list[torch.Tensor], tol: float = 1e-5) -> str | None:
    """None when every output agrees with XLA:CPU within `tol` (relative to max |ref|), else why not."""
    for k, (g, w) in enumerate(zip(got, want)):
        scale = max(float(w.abs().max()), 1e-30)
        err = float((g.float() - w.float()).abs().max()) / scale
        if not err <= tol:  # NaN fails too
            return f"output {k} differs from XLA:CPU by {err:.3g} of max |ref| {scale:.3g} (tolerance {tol:g})"
    return None


def median_s(call, runs: int = TIMED_RUNS) -> float:
    """The median wall time of `call()` over `runs` calls, after one untimed warm-up call."""
    call()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def executable(core, probe: Probe, neff: Path, *, collectives: tuple[int, int] | None = None, host: bool = True):
    """The probe's NEFF loaded on `core` (outputs read back to the host unless `host` is False)."""
    from deepinfer.runtime.neuron.device import NeuronExecutable

    return NeuronExecutable(
        neff,
        core,
        [n for n, _ in probe.inputs],
        [(n, s, torch.float32) for n, s in probe.outputs],
        host_outputs=None if host else [],
        collectives=collectives,
    )


# --- one rank of the collectives probe (its own process: one NeuronCore and one rank a process) ---


def run_rank(rank: int, world: int, work: Path, runs: int) -> dict:
    """Load every collective probe's NEFF as `rank` of `world`, run it on this rank's inputs, keep the
    outputs (work/ranks/<name>.<rank>.pt) and time it -> {name: median seconds}."""
    from deepinfer.runtime.neuron.device import NeuronCore

    out = work / "ranks"
    out.mkdir(parents=True, exist_ok=True)
    times = {}
    with NeuronCore(None) as core:
        core.join_collectives(rank, world, "deepinfer doctor's collective probe")
        for p in collective_probes():
            exe = executable(core, p, work / f"{p.name}.neff", collectives=(rank, world))
            x = inputs(p, rank)
            torch.save(exe(x), out / f"{p.name}.{rank}.pt")
            times[p.name] = median_s(lambda exe=exe, x=x: exe(x), runs)
    return times


def rank_main(argv: list[str] | None = None) -> int:
    """`python -m deepinfer.runtime.neuron.probe rank --rank R --world N --work DIR --out FILE`: one
    line of JSON in FILE ({"times": {...}} or {"error": "..."}); exit 0, or 1 with the error."""
    ap = argparse.ArgumentParser(prog="python -m deepinfer.runtime.neuron.probe rank")
    ap.add_argument("command", choices=["rank"])
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--runs", type=int, default=TIMED_RUNS)
    a = ap.parse_args(argv)
    try:
        result: dict = {"times": run_rank(a.rank, a.world, a.work, a.runs)}
    except DeepinferError as e:
        result = {"error": str(e)}
    tmp = a.out.with_name(a.out.name + ".tmp")
    tmp.write_text(json.dumps(result) + "\n")
    os.replace(tmp, a.out)
    return 0 if "times" in result else 1


if __name__ == "__main__":
    sys.exit(rank_main())
