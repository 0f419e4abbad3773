"""Benchmark: the compile farm (`deepinfer-compile --ray`) against a local compile of the same model.

    python bench/farm.py                          # examples/tiny/model.toml (aoti, 32 executables)
    python bench/farm.py --executable exported    # no C++ compile: a quick run
    python bench/farm.py --json                   # one JSON object on stdout (table on stderr)

Starts a Ray cluster here (a head and `--nodes - 1` worker nodes, `--cpus` each), then two
`deepinfer-compile --no-cache --json` runs, each in a fresh process:

    local    --jobs N on this host, Inductor's cache in an empty directory
    farm     --ray on the cluster, the same Inductor cache path emptied again (as on a node
             that never compiled the model: workers compile under the host's paths)

farm_matches_local is 1 when the two bundles' manifests are equal (the manifest holds every
executable's sha256) and so is every executable file, else 0 (the differing files are listed).
Saved ExportedPrograms differ between any two traces (torch records object ids in their
metadata), so with `--executable exported` it is 0 whatever the farm does.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def compile_once(toml: Path, out: Path, inductor: Path, extra: list[str]) -> dict:
    shutil.rmtree(inductor, ignore_errors=True)
    inductor.mkdir(parents=True)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(inductor))
    cmd = [sys.executable, "-m", "deepinfer.compiler.cli", str(toml), "-o", str(out), "--force", "--no-cache"]
    start = time.perf_counter()
    proc = subprocess.run([*cmd, "--json", *extra], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode:
        sys.exit(f"compile failed:\n{proc.stderr[-3000:]}")
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    farm_lines = [line for line in proc.stderr.splitlines() if line.startswith("farm [")]
    return {"wall_s": round(wall, 3), "executables": summary["executables"], "last_progress": farm_lines[-1:]}


def regions(bundle: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted((bundle / "regions").iterdir())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=ROOT / "examples/tiny/model.toml")
    ap.add_argument("--executable", choices=["aoti", "exported"], default=None, help="Override [target] executable.")
    ap.add_argument("--jobs", type=int, default=2, help="Worker processes of the local compile.")
    ap.add_argument("--nodes", type=int, default=2, help="Ray nodes started here (head included).")
    ap.add_argument("--cpus", type=int, default=1, help="CPUs (parallel jobs) per node.")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from ray.cluster_utils import Cluster

    with tempfile.TemporaryDirectory(
        prefix="bench-farm-", dir=ROOT / ".cache" if (ROOT / ".cache").is_dir() else None
    ) as tmp_name:
        tmp = Path(tmp_name)
        toml = args.model.resolve()
        if args.executable:
            text = toml.read_text().replace('executable = "aoti"', f'executable = "{args.executable}"')
            text = text.replace('executable = "exported"', f'executable = "{args.executable}"')
            text = text.replace('checkpoint = "checkpoint"', f'checkpoint = "{toml.parent / "checkpoint"}"')
            toml = tmp / "model.toml"
            toml.write_text(text)
        node = {"num_cpus": args.cpus, "object_store_memory": 200 * 2**20}
        cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
        try:
            for _ in range(args.nodes - 1):
                cluster.add_node(**node)
            cluster.wait_for_nodes(timeout=120)
            print("local compile ...", file=sys.stderr, flush=True)
            local = compile_once(toml, tmp / "local", tmp / "inductor", ["--jobs", str(args.jobs)])
            print(f"farm compile on {args.nodes} node(s) ...", file=sys.stderr, flush=True)
            farm = compile_once(toml, tmp / "farm", tmp / "inductor", ["--ray", cluster.address])
        finally:
            cluster.shutdown()
        same_manifest = (tmp / "local/manifest.json").read_bytes() == (tmp / "farm/manifest.json").read_bytes()
        a, b = regions(tmp / "local"), regions(tmp / "farm")
        differing = sorted(n for n in a.keys() | b.keys() if a.get(n) != b.get(n))

    result = {
        "model": str(args.model),
        "executable": args.executable or "as model.toml",
        "nodes": args.nodes,
        "cpus_per_node": args.cpus,
        "runs": {"local": local, "farm": farm},
        "farm_over_local": round(farm["wall_s"] / local["wall_s"], 3),
        "same_manifest": same_manifest,
        "differing_executables": differing,
        "farm_matches_local": int(same_manifest and not differing),
    }
    print(f"{'run':<8} {'wall s':>9} {'executables':>12}", file=sys.stderr)
    for k, r in result["runs"].items():
        print(f"{k:<8} {r['wall_s']:>9.2f} {r['executables']:>12}", file=sys.stderr)
    print(f"farm's last progress line: {''.join(farm['last_progress'])}", file=sys.stderr)
    print(
        f"farm_matches_local {result['farm_matches_local']} (manifest equal: {same_manifest}; "
        f"differing executables: {', '.join(differing) or 'none'})",
        file=sys.stderr,
    )
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
