"""The release's fused layer modules at the released dimensions, each lowered and checked on XLA:CPU.

    python bench/release_modules.py [--workdir DIR] [--experts 8] [--ep 2] [--cp 2] [--kinds all] [--json]

trn2's `layers = "fused"` (compiler/layers.py) makes each layer kind one HLO module holding its
regions and every collective between them. This bench builds one such module for each layer kind
of the release, at the release's text dimensions (regions/synthetic.py: hidden 5120, 64 heads of
512, the indexer, compressor and engram widths) and the release's layout at two ranks (ep = cp = 2:
the divided attention's merges and the MoE's all-reduce inside the module; `--cp 1` gives EP
dispatch instead), one decode bucket (batch 1, tokens 1, `--context` positions in blocks of 128).

The model is `make-tiny --geometry release`'s config with one layer more (`config`): the release's
layer 14 is a ratio-2 kv source that also has an engram, a layer kind (`layer_source_r2_engram`)
the 7-layer geometry lacks; 8 routed experts by default (the release has 384: fewer experts and
layers, never smaller hidden sizes). Only its config.json is written: the modules are built from the
plan, and the check runs them on seeded random weights in their stored formats, as the compile does.

Each kind runs in a process of its own (`--one KIND`), so its peak RSS is its own (`os.wait4`):
it parses and plans the model.toml, lowers the kind's pieces and links them into one module
(`layers.build` and `layers.emit`: the lowering), then runs the target's check (`layers.check`: the
module on one XLA:CPU replica a rank against the layer's ops run eagerly with the host's
collectives). Reported per module: its bucket, the HloModuleProto's bytes and instruction count
(every computation's), its collectives, the lowering's wall time and the process's peak RSS when it
ended, the check's wall time, max |diff| and score against its tolerance, and the process's peak
RSS. A module that does not lower or check is reported with the one line it failed with.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

from common import toml_text

BLOCK = 128  # the release's block size (bench/engram.py)
INSTRUCTION = re.compile(r"\s*(?:ROOT )?[\w.\-]+ = \S")


def config(experts: int) -> dict:
    """config.json of `make-tiny --geometry release` with a ratio-2 kv source that has an engram
    (layer 3, as the release's layer 14): 8 layers, one of each release layer kind."""
    from deepinfer.regions.synthetic import release_geometry_config

    c = release_geometry_config(experts)
    text = c["text_config"]
    rows = text["engram_num_embeddings"][0]
    text.update(
        num_hidden_layers=8,
        compress_ratios=[0, 0, 2, 2, 2, 1, 1, 1],
        kv_source_layer_ids=[2, 3, 5],
        index_source_layer_ids=[2, 3, 5, 6],
        candidate_source_layer_id=5,
        engram_layer_ids=[1, 3],
        engram_num_embeddings=[rows, rows],
    )
    c["generator"]["layers"] = 8
    return c


def model_toml(work: Path, a: argparse.Namespace) -> Path:
    """The model.toml of the modules: trn2, fused layers, the chosen layout, one decode bucket."""
    ckpt = work / "ckpt"
    ckpt.mkdir(parents=True, exist_ok=True)
    (ckpt / "config.json").write_text(json.dumps(config(a.experts), indent=1))
    blocks = -(-a.context // BLOCK)
    toml = work / "model.toml"
    toml.write_text(
        toml_text(
            {
                "model": {"checkpoint": ckpt, "dtype": a.dtype, "cache_quant": False},
                "target": {"name": "trn2", "executable": "neff", "options": {"lnc": 2, "layers": "fused"}},
                "buckets": {"batch": [1], "tokens": [1], "max_context": a.context},
                "kv": {"block_size": BLOCK, "num_blocks": -(-blocks // a.cp) * a.cp + 1},
                "parallel": {"tp": 1, "ep": a.ep, "cp": a.cp},
            }
        )
    )
    return toml


def planned(toml: Path):
    """The spec and plan of `toml`, as `deepinfer-compile --hlo-only` makes them."""
    from deepinfer.compiler import pipeline
    from deepinfer.compiler.config import load_compile_config

    spec = pipeline.parse(load_compile_config(toml), True, lambda m: None)
    return spec, pipeline.plan(spec, lambda m: None)


def release_kinds(experts: int) -> list[str]:
    """The release's fused layer kinds (its 40 layers' config, planned without a tensor), once each
    checked to be in `config`'s plan with the same regions at the same weight shapes (but the MoE's and
    engram's, which hold fewer experts and rows by design)."""
    import torch

    from deepinfer.compiler.plan import plan_regions
    from deepinfer.regions.config import parse_config
    from deepinfer.regions.synthetic import release_config

    release, ours = (
        plan_regions(parse_config(c).text, torch.bfloat16, True) for c in (release_config(), config(experts))
    )
    kinds = ours.fused_kinds()
    for name, lk in release.fused_kinds().items():
        if name not in kinds or kinds[name].slots != lk.slots:
            raise SystemExit(f"the bench's model has no layer kind {name} as the release's ({lk.slots})")
        for _, kind in lk.slots:
            shapes = [[s.shape for s in p.kinds[kind].region.specs] for p in (release, ours)]
            if kind not in ("moe", "engram") and shapes[0] != shapes[1]:
                raise SystemExit(f"{name}: region {kind}'s weight shapes are not the release's")
    return list(release.fused_kinds())


def instructions(proto: bytes) -> int:
    """Instructions of every computation of an HloModuleProto (its HLO text's instruction lines)."""
    from jax._src.lib import xla_client

    return sum(1 for line in xla_client.XlaComputation(proto).as_hlo_text().splitlines() if INSTRUCTION.match(line))


def peak_gib() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)


def one(toml: Path, kind: str, out: Path) -> dict:
    """Lower and check the module of layer kind `kind` (this process's work under `--one`)."""
    from deepinfer.compiler import layers

    spec, plan = planned(toml)
    lk = plan.fused_kinds()[kind]
    exe = next(e for e in spec.executables(plan) if e.kind == kind)
    proto = out / f"{exe.name}.hlo.pb"
    start = time.perf_counter()
    built = layers.build(spec, plan, lk, exe)
    entry, _ = layers.emit(spec, exe, built, proto)
    lowered_s = time.perf_counter() - start
    lowering_gib = peak_gib()
    data = proto.read_bytes()
    figures = {
        "kind": kind,
        "bucket": exe.name.removeprefix(f"{kind}.{exe.method}."),
        "layers_of_kind": list(lk.layers),
        "hlo_bytes": len(data),
        "instructions": instructions(data),
        "collectives": [f"{c.op} {c.value}" for c in entry.collectives or ()],
        "lower_s": round(lowered_s, 1),
        "lowering_peak_rss_gib": lowering_gib,
    }
    start = time.perf_counter()
    result = layers.check(spec, plan, lk, exe, built, proto, lambda m: print(m, file=sys.stderr))
    figures["check_s"] = round(time.perf_counter() - start, 1)
    figures["check"] = result
    return figures


def measure(argv: list[str], log: Path) -> tuple[dict, dict]:
    """Run one child; (its wall time, peak RSS by wait4 and exit status, the JSON it printed last)."""
    start = time.perf_counter()
    with open(log, "w") as err:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True)
        assert proc.stdout is not None
        stdout = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
    rc = os.waitstatus_to_exitcode(status)
    lines = log.read_text(errors="replace").strip().splitlines()
    run = {"wall_s": round(time.perf_counter() - start, 1), "peak_rss_gib": round(usage.ru_maxrss / 2**20, 2), "rc": rc}
    if rc:
        run["failed"] = lines[-1] if lines else f"exit {rc}"
    answer = stdout.strip().splitlines()
    return run, (json.loads(answer[-1]) if answer and not rc else {})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=Path("build/release-modules"))
    ap.add_argument("--experts", type=int, default=8, help="routed experts (the release has 384)")
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--context", type=int, default=1024, help="the decode bucket's context (positions)")
    ap.add_argument("--kinds", default="all", help="comma-separated layer kinds (default: every release kind)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # the child: lower and check this kind
    a = ap.parse_args()
    work = a.workdir.resolve()
    if a.one:
        from deepinfer.errors import DeepinferError

        try:
            print(json.dumps(one(work / "model.toml", a.one, work)))
        except DeepinferError as e:  # a lowering or check refused: its one line, as the compile says it
            raise SystemExit(f"{a.one}: {type(e).__name__}: {e}") from None
        return
    release = release_kinds(a.experts)
    kinds = release if a.kinds == "all" else a.kinds.split(",")
    unknown = sorted(set(kinds) - set(release))
    if unknown:
        ap.error(f"--kinds: not a release layer kind: {', '.join(unknown)} (the kinds: {', '.join(release)})")
    (work / "tmp").mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TMPDIR", str(work / "tmp"))
    model_toml(work, a)
    results = []
    for kind in kinds:
        argv = [sys.executable, __file__, "--workdir", str(work), "--one", kind]
        run, figures = measure(argv, work / f"{kind}.log")
        r = {"kind": kind, **figures, **run}
        results.append(r)
        print(line(r), file=sys.stderr, flush=True)
    out = {
        "experts": a.experts,
        "dtype": a.dtype,
        "parallel": {"tp": 1, "ep": a.ep, "cp": a.cp},
        "context": a.context,
        "modules": results,
    }
    print(json.dumps(out, indent=2) if a.json else table(out))


def line(r: dict) -> str:
    if r["rc"]:
        return f"{r['kind']:26s} FAILED (exit {r['rc']}, {r['wall_s']} s): {r['failed']}"
    c = r["check"]
    return (
        f"{r['kind']:26s} {r['bucket']:9s} {r['hlo_bytes'] / 2**20:7.2f} MiB {r['instructions']:6d} instr  "
        f"lower {r['lower_s']:6.1f} s {r['lowering_peak_rss_gib']:5.2f} GiB  check {r['check_s']:6.1f} s "
        f"{r['peak_rss_gib']:5.2f} GiB  max|diff| {c['max_abs']:.2g} score {c['score']:.2g}"
    )


def table(out: dict) -> str:
    rows = [
        "| kind | bucket | HLO MiB | instructions | collectives | lower s | lowering peak GiB | check s | peak GiB "
        "| max abs diff | score (tolerance) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in out["modules"]:
        if r["rc"]:
            rows.append(f"| {r['kind']} | failed: {r['failed']} |")
            continue
        c = r["check"]
        rows.append(
            f"| {r['kind']} | {r['bucket']} | {r['hlo_bytes'] / 2**20:.2f} | {r['instructions']} | "
            f"{len(r['collectives'])} | {r['lower_s']} | {r['lowering_peak_rss_gib']} | {r['check_s']} | "
            f"{r['peak_rss_gib']} | {c['max_abs']:.2g} | {c['score']:.2g} ({c['tolerance']:g}) |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    main()
