"""The trn2 target's hardware figures for the decode step's cost model (compiler/step_cost.py):
what `deepinfer plan` bounds a step's time with. Each carries its public source and whether a
public document gives it (published) or it is assumed; docs/trn2.md lists them.

A table of its own, outside the target's LOWERING_MODULES: a figure that changes (once measured
on a Trn2 host) changes no executable, so no cache key.
"""

from __future__ import annotations

from dataclasses import dataclass

DEVICE_CORES = 8  # NeuronCore-v3 per Trainium2 device: a logical core (rank) of LNC n has n of them


@dataclass(frozen=True)
class Figure:
    """A hardware constant the decode step's cost model (compiler/step_cost.py) bounds time with."""

    value: float
    unit: str
    source: str  # a public document, or why the value was chosen
    status: str  # "published" (a public document gives it) | "assumed" (no source found, not measured)


NEURON_DOCS = "AWS Neuron docs"
# per Trainium2 device; a rank gets lnc / DEVICE_CORES of each (Trn2Target.step_figures)
DEVICE_FIGURES = {
    "hbm_bytes_per_s": Figure(
        2.9e12,
        "B/s",
        f"{NEURON_DOCS}, Trainium2 Architecture Guide for NKI: 4 HBM stacks, 96 GiB at 2.9 TB/s",
        "published",
    ),
    "bf16_flops_per_s": Figure(
        667e12, "FLOP/s", f"{NEURON_DOCS}, Trainium2 Architecture: 667 BF16/FP16/TF32 TFLOPS dense", "published"
    ),
    "fp8_flops_per_s": Figure(
        1299e12, "FLOP/s", f"{NEURON_DOCS}, Trainium2 Architecture: 1,299 FP8 TFLOPS dense", "published"
    ),
    "fp32_flops_per_s": Figure(
        181e12, "FLOP/s", f"{NEURON_DOCS}, Trainium2 Architecture: 181 FP32 TFLOPS", "published"
    ),
    "link_bytes_per_s": Figure(
        1.28e12, "B/s", "AWS's Trn2 announcement: NeuronLink-v3 at 1.28 TB/s; not in the Neuron docs found", "assumed"
    ),
}
# per rank, whatever its LNC
RANK_FIGURES = {
    "collective_s": Figure(
        25e-6,
        "s per in-graph all-reduce or all-gather",
        "NxD Inference on DeepSeek-V3 at TP = 64 (issue 29)",
        "assumed",
    ),
    "launch_s": Figure(
        20e-6, "s per device execution", "no public figure found: an nrt_execute of a loaded NEFF", "assumed"
    ),
    "host_link_bytes_per_s": Figure(32e9, "B/s host<->device", "PCIe Gen5 x16, order of magnitude", "assumed"),
    "host_collective_s": Figure(
        200e-6, "s per host collective", "device->host copy, gloo over shared memory, host->device", "assumed"
    ),
}
