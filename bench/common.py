"""What every bench needs, written once: the repository's paths, percentiles, `/proc` figures, child
processes that answer in JSON, `deepinfer-compile` in a process of its own, model.toml text, a bundle
compiled when absent, and the server's metrics.

The benches are scripts (`python bench/NAME.py`): Python puts bench/ first on sys.path, so each
imports this module as `common`.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
INDUCTOR_CACHE = ROOT / ".cache" / "inductor"


def share_inductor_cache() -> None:
    """Inductor's compiled graphs in the repository's .cache/inductor, unless TORCHINDUCTOR_CACHE_DIR says
    otherwise: a bench run again compiles nothing a run before it compiled."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(INDUCTOR_CACHE))


def work_dir(prefix: str) -> tempfile.TemporaryDirectory:
    """A temporary directory, under the repository's .cache/ where there is one (beside the caches)."""
    cache = ROOT / ".cache"
    return tempfile.TemporaryDirectory(prefix=prefix, dir=cache if cache.is_dir() else None)


def timing_options(ap: argparse.ArgumentParser, threads_help: str = "torch threads (default: torch's)") -> None:
    """`--repeats` (best of), `--threads` and `--json`: the options of a bench that times calls in its process."""
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help=threads_help)
    ap.add_argument("--json", action="store_true")


def torch_threads(n: int | None) -> int:
    """torch's threads set to `n` (None: as torch chose); the number it uses."""
    import torch

    if n:
        torch.set_num_threads(n)
    return torch.get_num_threads()


# --- figures ---------------------------------------------------------------------------------------


def percentile(values: Sequence[float], p: float) -> float:
    """The `p`-th percentile (0 to 100) of `values` as `numpy.percentile` computes it by default: the
    sorted values read at rank p / 100 * (n - 1), interpolated linearly between the two nearest
    (so p99 of 100 values lies between the 99th and the 100th). nan for no values."""
    if not values:
        return float("nan")
    s = sorted(values)
    rank = p / 100 * (len(s) - 1)
    below = math.floor(rank)
    above = min(below + 1, len(s) - 1)
    return s[below] + (s[above] - s[below]) * (rank - below)


def status_kib(field: str, pid: int | str = "self") -> int:
    """A number of `/proc/PID/status` (VmRSS and VmHWM in KiB, PPid); 0 where the process has ended
    or has no such field."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


# --- processes that answer in JSON ----------------------------------------------------------------


def last_json(stdout: str) -> dict:
    """The JSON object on the last line of a process's output (what `--json` prints last)."""
    return json.loads(stdout.strip().splitlines()[-1])


def failed(what: str, proc: subprocess.CompletedProcess) -> SystemExit:
    """The bench's exit when a process it ran failed: its exit status and the end of its stderr."""
    return SystemExit(f"{what} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


def run_child(script: str, *args: str, timeout: float | None = None) -> dict:
    """`python SCRIPT ARGS...` in a fresh process (a bench measuring one run in a process of its own, so
    its peak RSS is that run's): the JSON object it prints last; the bench exits if it fails."""
    proc = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, timeout=timeout)
    if proc.returncode:
        raise failed(f"{Path(script).name} {' '.join(args)}", proc)
    return last_json(proc.stdout)


def answer(figures: dict, base_kib: int) -> None:
    """A child's answer to `run_child`: `figures`, with its resident size at its start (`base_kib`) and its
    peak (`parent_peak_kib`, VmHWM), as one JSON line."""
    print(json.dumps({**figures, "base_kib": base_kib, "parent_peak_kib": status_kib("VmHWM")}))


@dataclass(frozen=True)
class Compiled:
    """One `deepinfer-compile --json` run: its summary object, wall time (start to exit) and stderr."""

    summary: dict
    wall_s: float
    stderr: str


def compile_json(toml: Path, out: Path, cache: Path | None, *, inductor: Path, args: Sequence[str] = ()) -> Compiled:
    """`deepinfer-compile TOML -o OUT --json ARGS` in a fresh process (`compiler/kill_points.compile_process`)
    with Inductor's cache at `inductor`, through the deepinfer cache `cache` (None: the compile's default,
    or none with `--no-cache` in `args`), without a time limit; the bench exits if it fails."""
    from deepinfer.compiler.kill_points import compile_process

    start = time.perf_counter()
    proc = compile_process(toml, out, cache, args=args, env={"TORCHINDUCTOR_CACHE_DIR": str(inductor)}, timeout=None)
    wall = time.perf_counter() - start
    if proc.returncode:
        raise failed(f"compiling {toml}", proc)
    return Compiled(last_json(proc.stdout), round(wall, 3), proc.stderr)


# --- model.toml ------------------------------------------------------------------------------------


def toml_text(sections: Mapping[str, Mapping[str, object]]) -> str:
    """model.toml text of `sections` ({"model": {"checkpoint": ..., ...}, "kv": {...}}), in their order:
    strings and paths, booleans, numbers, lists and inline tables of them."""
    return "\n".join(
        f"[{name}]\n" + "".join(f"{key} = {_toml_value(value)}\n" for key, value in table.items())
        for name, table in sections.items()
    )


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (str, Path)):
        return json.dumps(str(value))  # a TOML basic string: JSON's escapes are TOML's
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"no TOML for {value!r}")


def with_executable(toml: Path, executable: str | None, work: Path) -> Path:
    """`toml`, or where `executable` is given a copy of it in `work` with `[target] executable` set to
    it (its checkpoint path made absolute, as the original's folder resolved it)."""
    toml = toml.resolve()
    if not executable:
        return toml
    data = tomllib.loads(toml.read_text())
    data["model"]["checkpoint"] = str(toml.parent / data["model"]["checkpoint"])
    data["target"]["executable"] = executable
    out = work / "model.toml"
    out.write_text(toml_text(data))
    return out


def ensure_bundle(bundle: Path, toml: Path, executable: str | None = None) -> None:
    """Compile `toml` to `bundle` (two jobs, the default cache) unless `bundle` exists; `executable`
    overrides its `[target] executable`."""
    if bundle.exists():
        return
    import dataclasses

    from deepinfer.compiler.config import load_compile_config
    from deepinfer.compiler.pipeline import compile_bundle

    print(f"compiling {toml} -> {bundle}", file=sys.stderr)
    config = load_compile_config(toml)
    if executable:
        config = dataclasses.replace(config, target=dataclasses.replace(config.target, executable=executable))
    compile_bundle(config, bundle, jobs=2)


# --- deepinfer-serve -------------------------------------------------------------------------------


def server_metrics(url: str, timeout_s: float = 60) -> dict[str, float] | None:
    """The server's `/metrics` samples without labels ({name: value}), or None where it does not answer
    200 (or does not answer)."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout_s)
    try:
        conn.request("GET", "/metrics")
        r = conn.getresponse()
        text = r.read().decode()
        if r.status != 200:
            return None
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()
    samples = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if value and not line.startswith("#") and "{" not in name:
            samples[name] = float(value.split()[0])
    return samples
