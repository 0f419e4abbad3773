"""The trn2 target's hardware figures for the decode step's cost model (compiler/step_cost.py):
what `deepinfer plan` bounds a step's time with. Each carries its public source and whether a
public document gives it (published), it is assumed, or a Trn2 host measured it (measured: a
figures file `deepinfer doctor` writes, read by `load_figures` for `deepinfer plan --figures`);
docs/trn2.md lists them.

A table of its own, outside the target's LOWERING_MODULES: a figure that changes (once measured
on a Trn2 host) changes no executable, so no cache key.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from deepinfer.errors import ConfigError
from deepinfer.reader import read_bytes

DEVICE_CORES = 8  # NeuronCore-v3 per Trainium2 device: a logical core (rank) of LNC n has n of them


@dataclass(frozen=True)
class Figure:
    """A hardware constant the decode step's cost model (compiler/step_cost.py) bounds time with."""

    value: float
    unit: str
    source: str  # a public document, or why the value was chosen
    # "published" (a public document gives it) | "assumed" (no source found, not measured) |
    # "measured" (a figures file of a Trn2 host gives it: `deepinfer plan --figures`)
    status: str


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


# -- measured figures (`deepinfer doctor` writes them, `deepinfer plan --figures` reads them) --------

FORMAT_KEY, FORMAT_VERSION = "deepinfer_figures", 1
MEASURED_ON = {  # key -> (the types its value may have, what it is)
    "host": ((str,), "a string"),
    "instance_type": ((str, type(None)), "a string or null"),
    "neuronx_cc": ((str, type(None)), "a string or null"),
    "libnrt": ((str, type(None)), "a string or null"),
    "lnc": ((int, type(None)), "an integer or null"),
    "when": ((str,), "an ISO-8601 date and time"),
}
BIGGEST = 1e30  # no figure or payload is near this: larger is a broken file, not a fast machine
CURVES = ("all_reduce", "all_gather")  # "collectives": latency by payload, what each rank puts in


@dataclass(frozen=True)
class Measured:
    """A figures file: the figures a Trn2 host measured, in the units of DEVICE_FIGURES (per device) and
    RANK_FIGURES (per rank), and the in-graph collectives' latency by payload where it measured them."""

    path: Path
    measured_on: dict[str, str | int | None]
    figures: dict[str, tuple[float, str]]  # name -> (value, how it was measured)
    # "all_reduce" | "all_gather" -> ((bytes each rank puts in, seconds), ...), by payload
    collectives: dict[str, tuple[tuple[int, float], ...]]


def _refuse(path: Path, key: str, message: str) -> ConfigError:
    return ConfigError(f"{path}: {key}: {message}")


def _number(path: Path, key: str, value: object, *, integer: bool = False) -> float:
    """`value` if it is a positive finite number (an integer where `integer`), else a ConfigError."""
    kinds = (int,) if integer else (int, float)
    what = f"is not a positive {'integer' if integer else 'number'}"
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise _refuse(path, key, f"{json.dumps(value)[:60]} {what}")
    if value <= 0 or value > BIGGEST or not math.isfinite(value):  # a huge int compares, never converts
        raise _refuse(path, key, f"{str(value)[:60]} {what} up to {BIGGEST:g}")
    return value


def _object(path: Path, key: str, value: object, allowed: tuple[str, ...]) -> dict:
    """`value` if it is a JSON object whose keys are among `allowed`, else a ConfigError naming them."""
    if not isinstance(value, dict):
        raise _refuse(path, key or "(top level)", f"expected a JSON object, got {json.dumps(value)[:60]}")
    for name in value:
        if name not in allowed:
            raise _refuse(path, f"{key}.{name}" if key else name, f"unknown key; expected one of {', '.join(allowed)}")
    return value


def _not_json(constant: str) -> float:
    raise ValueError(f"{constant} is not JSON")


def load_figures(path: Path) -> Measured:
    """The figures file at `path` (docs/trn2.md, "Measured figures"), checked: a ConfigError of one
    line naming the file and the key for anything else."""
    path = Path(path)
    data = read_bytes(path, error=ConfigError)
    try:
        doc = json.loads(data.decode("utf-8"), parse_constant=_not_json)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        why = "nested too deeply" if isinstance(e, RecursionError) else str(e).splitlines()[0]
        raise ConfigError(f"{path}: not a JSON figures file ({why})") from None
    if not isinstance(doc, dict):
        raise _refuse(path, "(top level)", f"expected a JSON object, got {json.dumps(doc)[:60]}")
    if FORMAT_KEY not in doc:
        raise _refuse(path, FORMAT_KEY, 'missing; a figures file starts with {"deepinfer_figures": 1, ...}')
    if doc[FORMAT_KEY] != FORMAT_VERSION or isinstance(doc[FORMAT_KEY], bool):
        raise _refuse(path, FORMAT_KEY, f"version {json.dumps(doc[FORMAT_KEY])}; this deepinfer reads version 1")
    _object(path, "", doc, (FORMAT_KEY, "measured_on", "figures", "collectives"))
    for key in ("measured_on", "figures"):
        if key not in doc:
            raise _refuse(path, key, "missing")
    return Measured(
        path,
        _measured_on(path, doc["measured_on"]),
        _figures(path, doc["figures"]),
        _curves(path, doc.get("collectives", {})),
    )


def _measured_on(path: Path, value: object) -> dict[str, str | int | None]:
    on = _object(path, "measured_on", value, tuple(MEASURED_ON))
    for key, (kinds, what) in MEASURED_ON.items():
        if key not in on:
            raise _refuse(path, f"measured_on.{key}", "missing")
        got = on[key]
        if isinstance(got, bool) or not isinstance(got, kinds):
            raise _refuse(path, f"measured_on.{key}", f"{json.dumps(got)[:60]} is not {what}")
    try:
        datetime.fromisoformat(on["when"])
    except ValueError:
        raise _refuse(path, "measured_on.when", f"{json.dumps(on['when'])[:60]} is not ISO-8601") from None
    if on["lnc"] is not None:
        _number(path, "measured_on.lnc", on["lnc"], integer=True)
    return dict(on)


def _figures(path: Path, value: object) -> dict[str, tuple[float, str]]:
    out = {}
    known = (*DEVICE_FIGURES, *RANK_FIGURES)
    for name, entry in _object(path, "figures", value, known).items():
        key = f"figures.{name}"
        for part in ("value", "how"):
            if part not in _object(path, key, entry, ("value", "how")):
                raise _refuse(path, f"{key}.{part}", "missing")
        if not isinstance(entry["how"], str):
            raise _refuse(path, f"{key}.how", f"{json.dumps(entry['how'])[:60]} is not a string")
        out[name] = (float(_number(path, f"{key}.value", entry["value"])), entry["how"])
    return out


def _curves(path: Path, value: object) -> dict[str, tuple[tuple[int, float], ...]]:
    out = {}
    for kind, pairs in _object(path, "collectives", value, CURVES).items():
        key = f"collectives.{kind}"
        if not isinstance(pairs, list) or not pairs:
            raise _refuse(path, key, "expected a non-empty list of [payload_bytes, seconds]")
        points = []
        for i, pair in enumerate(pairs):
            if not isinstance(pair, list) or len(pair) != 2:
                raise _refuse(path, f"{key}[{i}]", f"{json.dumps(pair)[:60]} is not [payload_bytes, seconds]")
            size = int(_number(path, f"{key}[{i}][0]", pair[0], integer=True))
            points.append((size, float(_number(path, f"{key}[{i}][1]", pair[1]))))
        sizes = [size for size, _ in points]
        if len(set(sizes)) != len(sizes):
            raise _refuse(path, key, "a payload size is measured twice")
        out[kind] = tuple(sorted(points))
    return out


def measured_figures(defaults: dict[str, Figure], measured: Measured, lnc: int) -> dict[str, Figure]:
    """A rank's figures (`defaults`, Trn2Target.step_figures at `lnc`) with the measured ones in their
    place: a device's figure times lnc / DEVICE_CORES, as the defaults are; the rest unchanged."""
    out = dict(defaults)
    for name, (value, how) in measured.figures.items():
        share = lnc / DEVICE_CORES if name in DEVICE_FIGURES else 1
        at = f", LNC {measured.measured_on['lnc']}" if measured.measured_on["lnc"] not in (None, lnc) else ""
        source = f"{measured.path} ({measured.measured_on['host']}{at}): {how}"
        out[name] = Figure(value * share, defaults[name].unit, source, "measured")
    return out


def curve_seconds(curve: tuple[tuple[int, float], ...], payload: int, beyond_s_per_byte: float) -> float:
    """A collective's seconds at `payload` bytes a rank by a measured curve ((bytes, seconds), by
    size): linear between its points, its smallest's below them, above the largest that one's plus
    the extra bytes at `beyond_s_per_byte` (the link's)."""
    if payload <= curve[0][0]:
        return curve[0][1]
    for (b0, s0), (b1, s1) in zip(curve, curve[1:]):
        if payload <= b1:
            return s0 + (s1 - s0) * (payload - b0) / (b1 - b0)
    size, seconds = curve[-1]
    return seconds + (payload - size) * beyond_s_per_byte
