"""Every step of the toolchain at the released dimensions: wall time and peak RSS of each.

    python bench/release_geometry.py [--workdir DIR] [--experts 8] [--steps all] [--json]

On the synthetic checkpoint of `deepinfer make-tiny --geometry release` (the release's text
dimensions and formats, 7 layers holding every region kind of the release, few experts; 5.97 GiB
at 8 experts), this runs, each as its own process so its peak RSS is its own (`os.wait4`):

    make-tiny          the checkpoint (skipped when DIR/ckpt exists)
    reference          `deepinfer reference` in fp32, lowest-index top-k ties, logits dumped
    floor-fp32         `deepinfer noise-floor` on the reference's tokens (fp32: summation order)
    compile-exported   an fp32 bundle of exported programs, one bucket
    run-exported       `deepinfer-run` of the prompt, logits dumped
    compare-exported   `deepinfer compare` against the reference within the fp32 floor
    compile-aoti / run-aoti / compare-aoti      the same with AOTInductor executables
    hlo-only           the trn2 target lowers every region kind to HLO and checks it on XLA:CPU
    floor-bf16 / compile-bf16 / run-bf16 / compare-bf16   a bf16 bundle against the fp32
                       reference within the floor `deepinfer noise-floor --dtype bf16` measures

Every bundle has one bucket (batch 1, tokens 1: the prompt runs a token a step) and
`max_context` 64, so each executable is traced once; --steps runs a subset (a step whose input
step ran before keeps that output: `--steps compile-aoti,run-aoti,compare-aoti` after a whole run). A step that fails is
reported with its exit status and the last line of its stderr; later steps that need its output
are skipped. Peak RSS counts the memory-mapped checkpoint or bundle pages a process touched.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from common import toml_text

STEPS = [
    "make-tiny",
    "reference",
    "floor-fp32",
    "compile-exported",
    "run-exported",
    "compare-exported",
    "compile-aoti",
    "run-aoti",
    "compare-aoti",
    "hlo-only",
    "floor-bf16",
    "compile-bf16",
    "run-bf16",
    "compare-bf16",
]
NEEDS = {
    "reference": ["make-tiny"],
    "floor-fp32": ["reference"],
    "compile-exported": ["make-tiny"],
    "run-exported": ["compile-exported"],
    "compare-exported": ["run-exported", "floor-fp32"],
    "compile-aoti": ["make-tiny"],
    "run-aoti": ["compile-aoti"],
    "compare-aoti": ["run-aoti", "floor-fp32"],
    "hlo-only": ["make-tiny"],
    "floor-bf16": ["reference"],
    "compile-bf16": ["make-tiny"],
    "run-bf16": ["compile-bf16"],
    "compare-bf16": ["run-bf16", "floor-bf16"],
}

TARGETS = {
    "exported": {"executable": "exported"},
    "aoti": {"executable": "aoti"},
    "trn2": {"name": "trn2", "executable": "neff", "options": {"lnc": 2}},
}


def model_toml(dtype: str, target: str) -> str:
    """One bucket (batch 1, tokens 1) of the checkpoint in ./ckpt."""
    return toml_text(
        {
            "model": {"checkpoint": "ckpt", "dtype": dtype, "cache_quant": False},
            "target": TARGETS[target],
            "buckets": {"batch": [1], "tokens": [1], "max_context": 64},
            "kv": {"block_size": 16, "num_blocks": 5},
        }
    )


def tool(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


def commands(prompt: str, new_tokens: int, experts: int, jobs: int) -> dict[str, list[str]]:
    def run(b: str, dump: str) -> list[str]:
        return [
            tool("deepinfer-run"),
            b,
            "--prompt",
            prompt,
            "--max-new-tokens",
            str(new_tokens),
            "--dump-logits",
            dump,
        ]

    def compare(dump: str, floor: str) -> list[str]:
        return [tool("deepinfer"), "compare", dump, "ref.st", "--floor", floor]

    def compile_(toml: str, b: str) -> list[str]:
        return [tool("deepinfer-compile"), toml, "-o", b, "--force", "--no-cache", "--jobs", str(jobs)]

    return {
        "make-tiny": [tool("deepinfer"), "make-tiny", "ckpt", "--geometry", "release", "--experts", str(experts)],
        "reference": [
            tool("deepinfer"),
            "reference",
            "ckpt",
            "--prompt",
            prompt,
            "--max-new-tokens",
            str(new_tokens),
            "--dtype",
            "fp32",
            "--no-cache-quant",
            "--topk-ties",
            "lowest",
            "--dump-logits",
            "ref.st",
        ],
        "floor-fp32": [tool("deepinfer"), "noise-floor", "ckpt", "ref.st", "--dtype", "fp32", "-o", "floor_fp32.json"],
        "compile-exported": compile_("exported.toml", "b_exported"),
        "run-exported": run("b_exported", "run_exported.st"),
        "compare-exported": compare("run_exported.st", "floor_fp32.json"),
        "compile-aoti": compile_("aoti.toml", "b_aoti"),
        "run-aoti": run("b_aoti", "run_aoti.st"),
        "compare-aoti": compare("run_aoti.st", "floor_fp32.json"),
        "hlo-only": [tool("deepinfer-compile"), "trn2.toml", "-o", "b_trn2", "--force", "--no-cache", "--hlo-only"],
        "floor-bf16": [tool("deepinfer"), "noise-floor", "ckpt", "ref.st", "--dtype", "bf16", "-o", "floor_bf16.json"],
        "compile-bf16": compile_("bf16.toml", "b_bf16"),
        "run-bf16": run("b_bf16", "run_bf16.st"),
        "compare-bf16": compare("run_bf16.st", "floor_bf16.json"),
    }


def measure(argv: list[str], cwd: Path, log: Path) -> dict:
    """Run one step; its wall time, peak RSS (its own: wait4's rusage) and exit status."""
    start = time.perf_counter()
    with open(log, "w") as err:
        proc = subprocess.Popen(argv, cwd=cwd, stdout=err, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    lines = log.read_text(errors="replace").strip().splitlines()
    return {
        "wall_s": round(time.perf_counter() - start, 1),
        "peak_rss_gib": round(usage.ru_maxrss / 2**20, 2),
        "rc": proc.returncode,
        "last_line": lines[-1] if lines else "",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--workdir",
        type=Path,
        default=Path("build/release-geometry"),
        help="where the checkpoint, bundles and logs go (about 25 GiB with every step)",
    )
    ap.add_argument("--experts", type=int, default=8, help="routed experts of the synthetic checkpoint")
    ap.add_argument("--prompt", default="Hi")
    ap.add_argument("--max-new-tokens", type=int, default=2)
    ap.add_argument("--jobs", type=int, default=2, help="compile jobs")
    ap.add_argument("--steps", default="all", help=f"comma-separated subset of: {', '.join(STEPS)}")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    a = ap.parse_args()
    steps = STEPS if a.steps == "all" else [s for s in a.steps.split(",") if s]
    unknown = sorted(set(steps) - set(STEPS))
    if unknown:
        ap.error(f"--steps: unknown step(s) {', '.join(unknown)}")
    work = a.workdir.resolve()
    (work / "tmp").mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(work / "inductor"))
    os.environ.setdefault("TMPDIR", str(work / "tmp"))
    for name, dtype, target in (
        ("exported", "fp32", "exported"),
        ("aoti", "fp32", "aoti"),
        ("trn2", "fp32", "trn2"),
        ("bf16", "bf16", "exported"),
    ):
        (work / f"{name}.toml").write_text(model_toml(dtype, target))
    argv = commands(a.prompt, a.max_new_tokens, a.experts, a.jobs)
    results: dict[str, dict] = {}
    for step in steps:
        if step == "make-tiny" and (work / "ckpt" / "config.json").exists():
            results[step] = {"skipped": "ckpt exists", "rc": 0}
        elif any(results[n].get("rc") != 0 for n in NEEDS.get(step, []) if n in results):
            results[step] = {"skipped": "a step it needs failed"}
        else:
            results[step] = measure(argv[step], work, work / f"{step}.log")
        r = results[step]
        print(
            f"{step:18s} "
            + (
                f"skipped ({r['skipped']})"
                if "skipped" in r
                else f"{r['wall_s']:8.1f} s  {r['peak_rss_gib']:6.2f} GiB  rc {r['rc']}  {r['last_line'][:90]}"
            ),
            file=sys.stderr,
            flush=True,
        )
    ckpt_bytes = sum(f.stat().st_size for f in (work / "ckpt").glob("*.safetensors"))
    out = {
        "experts": a.experts,
        "checkpoint_gib": round(ckpt_bytes / 2**30, 2),
        "prompt": a.prompt,
        "max_new_tokens": a.max_new_tokens,
        "steps": results,
    }
    if a.json:
        print(json.dumps(out, indent=2))
        return
    print(f"\nsynthetic release geometry, {a.experts} experts, checkpoint {out['checkpoint_gib']} GiB\n")
    print("| step | wall s | peak RSS GiB | rc |\n|---|---|---|---|")
    for step, r in results.items():
        if "skipped" not in r:
            print(f"| {step} | {r['wall_s']} | {r['peak_rss_gib']} | {r['rc']} |")


if __name__ == "__main__":
    main()
