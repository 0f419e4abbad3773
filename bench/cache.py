"""Benchmark: the artifact cache. Cold compile, warm compile, and a compile after one kernel changed.

    python bench/cache.py                          # examples/tiny/model.toml (aoti, 32 executables)
    python bench/cache.py --executable exported    # no C++ compile: a quick run
    python bench/cache.py --json                   # one JSON object on stdout (table on stderr)

Three runs of `deepinfer-compile --json`, each in a fresh process with its own
empty TORCHINDUCTOR_CACHE_DIR, sharing one deepinfer cache directory that
starts empty:

    cold     empty cache: every weight stack and executable is built
    warm     nothing changed: everything comes from the cache (weights included)
    kernel   after a source change to one kernel (--kernel, default compress_pool:
             a comment appended to a line of its reference, restored afterwards)

Reports wall times (process start to exit), the ratios to the cold run, and
which executables each run compiled. Targets: warm at most 3% of cold, and
after the kernel change exactly the executables whose graphs reach the kernel
(read from the cache's trace records) recompile.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from common import ROOT, compile_json, with_executable, work_dir

TARGET_WARM = 0.03


def compile_once(toml: Path, out: Path, cache: Path, jobs: int, inductor: Path) -> dict:
    r = compile_json(toml, out, cache, inductor=inductor, args=["--force", "--jobs", str(jobs)])
    return {"wall_s": r.wall_s, "executables": r.summary["executables"], "compiled": sorted(r.summary["compiled"])}


class TouchedKernel:
    """Append a comment to the last line of a kernel reference's source; restore it on exit."""

    def __init__(self, name: str):
        from deepinfer.kernels import KERNELS

        self.kernel = KERNELS[name]
        self.path = self.kernel.source
        self.original = self.path.read_text()

    def __enter__(self):
        import inspect

        lines, start = inspect.getsourcelines(self.kernel.reference)
        text = self.original.splitlines(keepends=True)
        i = start - 1 + len(lines) - 1  # the reference's last line
        text[i] = text[i].rstrip("\n") + "  # touched by bench/cache.py\n"
        self._write("".join(text))
        return self

    def __exit__(self, *exc):
        self._write(self.original)

    def _write(self, text: str) -> None:
        tmp = self.path.with_name(f".{self.path.name}.bench")
        tmp.write_text(text)
        os.replace(tmp, self.path)


def reaching(cache: Path, kernel: str) -> list[str]:
    """Executables whose graphs reach `kernel`, from the cache's trace records."""
    names = set()
    for meta in (cache / "v1" / "trace").glob("*/*/meta.json"):
        record = json.loads((meta.parent / "artifact").read_text())
        if kernel in record["kernels"]:
            names.add(json.loads(meta.read_text())["identity"])
    return sorted(names)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=ROOT / "examples/tiny/model.toml")
    ap.add_argument(
        "--executable",
        choices=["aoti", "exported"],
        default=None,
        help="Override [target] executable (default: the model.toml's).",
    )
    ap.add_argument("--kernel", default="compress_pool", help="Kernel whose source the third run changes.")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    with work_dir("bench-cache-") as tmp_name:
        tmp = Path(tmp_name)
        toml = with_executable(args.model, args.executable, tmp)
        cache = tmp / "cache"
        runs = {}
        for name in ("cold", "warm", "kernel"):
            print(f"{name} compile ...", file=sys.stderr, flush=True)
            if name == "kernel":
                with TouchedKernel(args.kernel):
                    runs[name] = compile_once(toml, tmp / "bundle", cache, args.jobs, tmp / f"inductor-{name}")
            else:
                runs[name] = compile_once(toml, tmp / "bundle", cache, args.jobs, tmp / f"inductor-{name}")
        expected = reaching(cache, args.kernel)

    cold = runs["cold"]["wall_s"]
    for r in runs.values():
        r["over_cold"] = round(r["wall_s"] / cold, 4)
    result = {
        "model": str(args.model),
        "executable": args.executable or "as model.toml",
        "jobs": args.jobs,
        "kernel": args.kernel,
        "runs": runs,
        "warm_over_cold": runs["warm"]["over_cold"],
        "kernel_over_cold": runs["kernel"]["over_cold"],
        "compiled": {k: len(r["compiled"]) for k, r in runs.items()},
        "kernel_reached_by": expected,
        "targets": {
            "warm_over_cold_max": TARGET_WARM,
            "warm_ok": runs["warm"]["over_cold"] <= TARGET_WARM,
            "only_reaching_recompiled": runs["kernel"]["compiled"] == expected,
        },
    }
    print("\n".join(table(result)), file=sys.stderr)
    if args.json:
        print(json.dumps(result))


def table(result: dict) -> list[str]:
    """The runs, what the kernel change reached and recompiled, and the targets: the lines printed on stderr."""
    runs, expected, targets = result["runs"], result["kernel_reached_by"], result["targets"]
    lines = [f"{'run':<8} {'wall s':>9} {'/cold':>7} {'compiled':>9}"]
    for k, r in runs.items():
        lines.append(f"{k:<8} {r['wall_s']:>9.2f} {r['over_cold']:>7.3f} {len(r['compiled']):>5}/{r['executables']}")
    return [
        *lines,
        f"kernel {result['kernel']} is reached by {len(expected)}: {', '.join(expected)}",
        f"recompiled after the change: {', '.join(runs['kernel']['compiled']) or 'none'}",
        f"targets: warm/cold {result['warm_over_cold']:.4f} <= {TARGET_WARM}: {targets['warm_ok']}; "
        f"only reaching executables recompiled: {targets['only_reaching_recompiled']}",
    ]


if __name__ == "__main__":
    main()
