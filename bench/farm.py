"""Benchmark: compiling across machines. Section `store`: the cache's remote tier (compiler/cache/remote.py).

    python bench/farm.py                           # examples/tiny/model.toml
    python bench/farm.py --executable exported     # no C++ compile: a quick run
    python bench/farm.py --json                    # one JSON object on stdout (tables on stderr)

store: moto's S3 server on a local port (started here; moto[server], the test extra), two compiles
in this process through `compile_bundle`, each with its own empty local cache directory and
TORCHINDUCTOR_CACHE_DIR, sharing one empty bucket:

    cold         empty store: everything is built, and published
    from_store   an empty local directory, the full store: everything comes from the store

Reports wall times, `warm_from_store_over_cold` (target <= 0.05) and `store_requests_per_hit`: the S3
requests the second compile made (counted by a botocore `before-call` hook) per executable it found.
Both compiles run in one process (the request count needs the client), so the second skips Python's
start and imports: the ratio is a little lower than two separate `deepinfer-compile` runs would give.

farm: a Ray cluster started here (a head and `--nodes - 1` worker nodes, `--cpus` each), then two
`deepinfer-compile --no-cache --json` runs, each in a fresh process:

    local        --jobs N on this host, Inductor's cache in an empty directory
    farm         --ray on the cluster, the same Inductor cache path emptied again (as on a node
                 that never compiled the model: workers compile under the host's paths)

`farm_matches_local` is 1 when the two bundles' manifests are byte-equal (the manifest holds every
executable's sha256) and so is every executable file, else 0 (the differing files are listed).
With `--executable exported` the executables are the host's saved programs, the same bytes in every
process (bundles/pt2.save_exported), so the figure compares the two compiles' traces.

Sections are functions `name(args, tmp) -> dict` in SECTIONS; each prints its own table.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import sys
import time
import uuid
from pathlib import Path

from common import ROOT, compile_json, with_executable, work_dir

TARGET_FROM_STORE = 0.05


def store_section(args, tmp: Path) -> dict:
    import boto3
    from moto.server import ThreadedMotoServer

    from deepinfer.compiler.cache.local import Cache
    from deepinfer.compiler.cache.remote import Store
    from deepinfer.compiler.config import load_compile_config
    from deepinfer.compiler.pipeline import compile_bundle

    for name, value in {
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        os.environ.setdefault(name, value)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        bucket = f"bench-{uuid.uuid4().hex[:12]}"
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
        config = load_compile_config(with_executable(args.model, args.executable, tmp))
        runs = {}
        for name in ("cold", "from_store"):
            print(f"store: {name} compile ...", file=sys.stderr, flush=True)
            store = Store.from_url(f"s3://{bucket}/bench", endpoint)
            requests: list[str] = []
            store.client.meta.events.register("before-call.s3", lambda model, _r=requests, **kw: _r.append(model.name))
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(tmp / f"inductor-{name}")
            cache = Cache(tmp / f"cache-{name}", remote=store)
            start = time.perf_counter()
            report = compile_bundle(
                config, tmp / f"bundle-{name}", jobs=args.jobs, force=True, log=lambda m: None, cache=cache
            )
            wall = time.perf_counter() - start
            found = sum(1 for kind, _ in cache.stats["remote"] if kind == "executable")
            runs[name] = {
                "wall_s": round(wall, 3),
                "executables": report.executables,
                "compiled": len(report.compiled),
                "tiers": report.tiers,
                "requests": len(requests),
                "executables_from_store": found,
            }
    finally:
        server.stop()
    cold, warm = runs["cold"], runs["from_store"]
    ratio = round(warm["wall_s"] / cold["wall_s"], 4)
    per_hit = round(warm["requests"] / max(warm["executables_from_store"], 1), 2)
    print(
        f"{'store run':<12} {'wall s':>8} {'compiled':>9} {'from store':>11} {'published':>10} {'requests':>9}",
        file=sys.stderr,
    )
    for name, r in runs.items():
        print(
            f"{name:<12} {r['wall_s']:>8.2f} {r['compiled']:>5}/{r['executables']:<3} {r['tiers']['store']:>11} "
            f"{r['tiers']['published']:>10} {r['requests']:>9}",
            file=sys.stderr,
        )
    print(
        f"warm_from_store_over_cold {ratio:.4f} (target <= {TARGET_FROM_STORE}); "
        f"store_requests_per_hit {per_hit} (requests per executable found)",
        file=sys.stderr,
    )
    return {
        "runs": runs,
        "warm_from_store_over_cold": ratio,
        "store_requests_per_hit": per_hit,
        "targets": {"warm_from_store_over_cold_max": TARGET_FROM_STORE, "ok": ratio <= TARGET_FROM_STORE},
    }


def _compile_process(toml: Path, out: Path, inductor: Path, extra: list[str]) -> dict:
    """One `deepinfer-compile --no-cache --json` in a fresh process, Inductor's cache at `inductor`
    (emptied first)."""
    shutil.rmtree(inductor, ignore_errors=True)
    inductor.mkdir(parents=True)
    r = compile_json(toml, out, None, inductor=inductor, args=["--force", "--no-cache", *extra])
    progress = [line for line in r.stderr.splitlines() if line.startswith("farm [")]
    return {"wall_s": r.wall_s, "executables": r.summary["executables"], "last_progress": progress[-1:]}


def _region_digests(bundle: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted((bundle / "regions").iterdir())}


def farm_section(args, tmp: Path) -> dict:
    from ray.cluster_utils import Cluster

    toml = with_executable(args.model, args.executable, tmp)
    node = {"num_cpus": args.cpus, "object_store_memory": 200 * 2**20}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    try:
        for _ in range(args.nodes - 1):
            cluster.add_node(**node)
        cluster.wait_for_nodes(timeout=120)
        print("farm: local compile ...", file=sys.stderr, flush=True)
        local = _compile_process(toml, tmp / "local", tmp / "inductor", ["--jobs", str(args.jobs)])
        print(f"farm: farm compile on {args.nodes} node(s) ...", file=sys.stderr, flush=True)
        farm = _compile_process(toml, tmp / "farm", tmp / "inductor", ["--ray", cluster.address])
    finally:
        cluster.shutdown()
    same_manifest = (tmp / "local/manifest.json").read_bytes() == (tmp / "farm/manifest.json").read_bytes()
    a, b = _region_digests(tmp / "local"), _region_digests(tmp / "farm")
    differing = sorted(n for n in a.keys() | b.keys() if a.get(n) != b.get(n))
    matches = int(same_manifest and not differing)
    print(f"{'farm run':<12} {'wall s':>8} {'executables':>12}", file=sys.stderr)
    for name, r in (("local", local), ("farm", farm)):
        print(f"{name:<12} {r['wall_s']:>8.2f} {r['executables']:>12}", file=sys.stderr)
    print(f"farm's last progress line: {''.join(farm['last_progress'])}", file=sys.stderr)
    print(
        f"farm_matches_local {matches} (manifest equal: {same_manifest}; differing executables: "
        f"{', '.join(differing) or 'none'})",
        file=sys.stderr,
    )
    return {
        "nodes": args.nodes,
        "cpus_per_node": args.cpus,
        "runs": {"local": local, "farm": farm},
        "farm_over_local": round(farm["wall_s"] / local["wall_s"], 3),
        "same_manifest": same_manifest,
        "differing_executables": differing,
        "farm_matches_local": matches,
    }


SECTIONS = {"store": store_section, "farm": farm_section}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=ROOT / "examples/tiny/model.toml")
    ap.add_argument("--executable", choices=["aoti", "exported"], default=None, help="Override [target] executable.")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--nodes", type=int, default=2, help="farm: Ray nodes started here (head included).")
    ap.add_argument("--cpus", type=int, default=1, help="farm: CPUs (parallel jobs) per node.")
    ap.add_argument("--only", choices=list(SECTIONS), action="append", help="Run only this section (repeatable).")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    result: dict = {"model": str(args.model), "executable": args.executable or "as model.toml", "jobs": args.jobs}
    with work_dir("bench-farm-") as tmp_name:
        for name in args.only or list(SECTIONS):
            (Path(tmp_name) / name).mkdir()
            result[name] = SECTIONS[name](args, Path(tmp_name) / name)
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
