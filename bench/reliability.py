"""Bad inputs and faults against every surface of deepinfer, on the tiny model (issue 33's figures).

    python bench/reliability.py [--json] [--verbose] [--load-seconds 60] [--clients 64] [--seed 0]
                                [--work DIR] [--only toml,checkpoint,bundle,cache,figures,http,faults,load,rss]

Compiles the tiny model once (saved ExportedPrograms, batch buckets 1, 8 and 64, so that every client
of the load phase can hold a batch row at once; a 2-rank copy for the rank faults), through a cache
kept in .cache/deepinfer-bench, so a second run compiles nothing. Then:

  bad inputs   model.toml mutations and checkpoint files (config.json, the index, safetensors headers,
               quantization_config, special files) under `deepinfer-compile --print-cache-key`;
               bundle files (manifest.json, weights headers, signature.json under --trust, links to
               /dev/zero, FIFOs) under `deepinfer-run`; cache meta.json and digest memos under
               `deepinfer cache verify/ls` and deepinfer-compile; HTTP bodies and headers sent to a
               live deepinfer-serve, and deepinfer-serve on addresses it cannot listen on (a port in
               use, bad hosts); figures files (a Trn2 host's measured figures) under `deepinfer plan
               --figures`. CLIs run in this process through click's runner under an alarm.
               Unclean: a traceback, a hang (past 30 s for a CLI, 60 s for a request), a 5xx, rc
               other than 0 or 2, an error that is not one line, or a server whose engine no longer
               completes a valid request afterwards (then restarted for the next case).
  faults       deepinfer-compile SIGKILLed at each point of DEEPINFER_TEST_KILL_AT, then a compile
               that must reuse every entry; RLIMIT_FSIZE at three sizes; a follower of deepinfer-serve
               and a rank of deepinfer-run SIGKILLed mid-generation, and as soon as its process exists
               (before the rendezvous: ended within 8 s, nothing left); a client gone mid-stream and
               mid-body; SIGTERM mid-stream. Lost data: a bundle or cache entry half written, a later
               compile failing, a slot not freed, a stream cut without its end.
  load         `--clients` threads for `--load-seconds`, a quarter of their requests valid (greedy,
               checked against the unloaded answers), the rest malformed: valid requests lost, the
               server alive after, and p99 latency of valid requests over their unloaded p99.
  rss          peak RSS of a trusted load of the bundle over a plain one's, in fresh processes, and what
               a release rank holds while it loads under --trust, before and now (reliability_rss.py).

Prints a table per surface; `--verbose` prints every unclean case with its output; `--json` prints
one JSON object with the figures. Deterministic: fixed seeds and case lists.
"""

from __future__ import annotations

import argparse
import itertools
import json
import queue
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import reliability_faults as faults
import reliability_http as web
import reliability_rss
from common import ROOT, percentile, share_inductor_cache, toml_text
from reliability_bundles import bundle_cases, cache_cases, doctor_cases
from reliability_files import checkpoint_cases, figures_cases, toml_cases

share_inductor_cache()

CACHE = ROOT / ".cache" / "deepinfer-bench"
SURFACES = ("toml", "checkpoint", "bundle", "cache", "figures", "http", "faults", "load", "rss")


def model_toml(ckpt: Path, *, batch=(1, 8, 64), max_context=64, num_blocks=257, ep: int = 1) -> str:
    sections: dict[str, dict] = {
        "model": {"checkpoint": ckpt, "dtype": "fp32", "cache_quant": True},
        "target": {"name": "cpu", "executable": "exported"},
        "buckets": {"batch": list(batch), "tokens": [1], "max_context": max_context},
        "kv": {"block_size": 16, "num_blocks": num_blocks},
    }
    if ep > 1:
        sections["parallel"] = {"tp": 1, "ep": ep, "cp": 1}
    return toml_text(sections)


def compile_once(text: str, where: Path, log) -> Path:
    from deepinfer.compiler.cache.local import Cache
    from deepinfer.compiler.config import load_compile_config
    from deepinfer.compiler.pipeline import compile_bundle

    where.mkdir(parents=True, exist_ok=True)
    (where / "model.toml").write_text(text)
    start = time.perf_counter()
    compile_bundle(
        load_compile_config(where / "model.toml"), where / "bundle", jobs=1, log=lambda m: None, cache=Cache(CACHE)
    )
    log(f"compiled {where.name} in {time.perf_counter() - start:.0f} s")
    return where / "bundle"


def start_server(bundle: Path):
    from deepinfer.runtime.serving.server_process import ServerProcess

    return ServerProcess(bundle, "--model-name", web.MODEL, "--max-queue", "128")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--load-seconds", type=float, default=60.0)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", type=Path, default=None, help="Where to work (default: a temporary directory).")
    ap.add_argument("--only", default=",".join(SURFACES), help="Comma-separated subset of: " + ",".join(SURFACES))
    ap.add_argument("--worker", help=argparse.SUPPRESS)  # run one file surface's cases, one JSON line each
    ap.add_argument("--skip", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    only = set(args.only.split(","))
    work = args.work or Path(tempfile.mkdtemp(prefix="deepinfer-reliability-"))
    work.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    if args.worker:
        return worker(args.worker, work, args.skip)
    from deepinfer.regions.tiny import make_tiny

    started = time.perf_counter()
    ckpt = make_tiny(work / "ckpt", exist_ok=True)
    bundle = compile_once(model_toml(ckpt), work / "serve", log)
    cases, fault_list, load, rss = [], [], {}, {}
    for surface in ("toml", "checkpoint", "bundle", "cache", "figures"):
        if surface in only:
            cases += run_worker(surface, work, log)
    log(f"file surfaces: {len(cases)} cases in {time.perf_counter() - started:.0f} s")
    if "rss" in only:
        rss = {**reliability_rss.measured(bundle, work / "rss"), "release": reliability_rss.release_model()}
        log(f"rss: a trusted load's peak over a plain one's {rss['trusted_over_plain_peak_rss']}")
    if only & {"http", "faults", "load"}:
        server = start_server(bundle)
        servers = [server]

        def restart() -> str:
            servers[-1].stop()
            servers.append(start_server(bundle))
            return servers[-1].url

        try:
            if "http" in only:
                cases += list(web.http_cases(server.url, restart))
                cases += list(web.address_cases(bundle, servers[-1].url))
            url = servers[-1].url
            if "faults" in only:
                fault_list += guarded("client gone", lambda: faults.client_faults(url))
            if "load" in only:
                texts, unloaded = web.expected(url)
                got = web.load(url, texts, args.clients, args.load_seconds, args.seed)
                load = {
                    "valid_requests": got["valid"],
                    "malformed_requests": got["malformed"],
                    "malformed_5xx": got["malformed_5xx"],
                    "valid_requests_lost": len(got["lost"]),
                    "lost": got["lost"][:20],
                    "server_alive": int(web.alive(url)),
                    "unloaded_p99_s": percentile(unloaded, 99),
                    "loaded_p99_s": percentile(got["latencies"], 99),
                }
                load["valid_p99_under_load_over_unloaded"] = load["loaded_p99_s"] / load["unloaded_p99_s"]
            if "faults" in only:
                if not web.alive(servers[-1].url):
                    restart()
                fault_list += guarded("SIGTERM mid-stream", lambda: [faults.sigterm_fault(servers[-1])])
        finally:
            for s in servers:
                s.stop()
    if "faults" in only:
        fault_list += guarded("compile faults", lambda: faults.compile_faults(work / "serve" / "model.toml", work))
        ep2 = compile_once(model_toml(ckpt, batch=(1,), num_blocks=9, ep=2), work / "ep2", log)
        fault_list += guarded("killed rank", lambda: faults.rank_faults(ep2, work))
        fault_list += guarded("rank killed before the rendezvous", lambda: faults.rendezvous_faults(ep2, work))
    report(cases, fault_list, load, rss, args, time.perf_counter() - started)
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)


def guarded(name: str, run) -> list:
    """A fault's results; one whose check itself failed (a request that timed out, a process that never
    started) counts as data lost, with the error."""
    try:
        return run()
    except Exception as e:
        return [faults.Fault(name, True, False, f"{type(e).__name__}: {e}")]


CASE_WATCHDOG_S = 90  # a worker silent this long is stuck in a case: killed, the case a hang
WORKER_MEMORY = 6 << 30  # address space of a worker: a reader without a bound fails there, not the machine


def worker(surface: str, work: Path, skip: int) -> None:
    """Run one file surface's cases in this process (memory-limited), after skipping `skip`."""
    import resource
    from dataclasses import asdict

    import reliability_files

    from deepinfer.cli import main as deepinfer_main
    from deepinfer.compiler.cli import main as compile_main
    from deepinfer.runtime.cli import main as run_main

    resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY, WORKER_MEMORY))
    reliability_files.SKIP["cases"] = skip
    ckpt, toml = work / "ckpt", work / "serve" / "model.toml"
    base, out = toml.read_text(), work / surface
    if surface == "toml":
        made = toml_cases(base, out, compile_main)
    elif surface == "checkpoint":
        made = checkpoint_cases(ckpt, base, out, compile_main)
    elif surface == "bundle":
        made = itertools.chain(
            bundle_cases(work / "serve" / "bundle", out, run_main),
            doctor_cases(work / "serve" / "bundle", out, deepinfer_main),
        )
    elif surface == "figures":
        made = figures_cases(base, out, deepinfer_main)
    else:
        copy = out / "cache-copy"
        shutil.copytree(CACHE, copy, ignore=shutil.ignore_patterns("locks", "tmp"))
        made = cache_cases(copy, toml, out, compile_main, deepinfer_main)
    for case in made:
        if case.why != "skipped":
            print(json.dumps(asdict(case)), flush=True)


def _pump(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


def run_worker(surface: str, work: Path, log) -> list:
    """A surface's cases from worker processes: one that dies (a crash, the memory limit) costs the
    case it was running, counted unclean, and the next worker goes on after it."""
    import subprocess

    from reliability_files import Case

    done: list = []
    while True:
        shutil.rmtree(work / surface, ignore_errors=True)
        (work / surface).mkdir(parents=True)
        cmd = [sys.executable, __file__, "--worker", surface, "--work", str(work), "--skip", str(len(done))]
        errors = work / f"{surface}.stderr"
        with open(errors, "w") as stderr:
            p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True)
            lines: queue.Queue = queue.Queue()
            threading.Thread(target=_pump, args=(p.stdout, lines), daemon=True).start()
            while True:
                try:
                    line = lines.get(timeout=CASE_WATCHDOG_S)
                except queue.Empty:  # a case the alarm could not interrupt (a blocking open of a FIFO)
                    p.kill()
                    break
                if line is None:
                    break
                done.append(Case(**json.loads(line)))
                with open(work / "cases.jsonl", "a") as kept:  # what a run cut short has found so far
                    kept.write(line)
        err = errors.read_text()
        if p.wait() == 0:
            log(f"{surface}: {len(done)} cases")
            return done
        why = "hang (killed by the bench)" if p.returncode == -9 else f"crash (rc {p.returncode})"
        done.append(Case(surface, f"case {len(done) + 1}", False, why, err[-2000:]))


def report(cases, fault_list, load: dict, rss: dict, args, seconds: float) -> None:
    surfaces = Counter(c.surface for c in cases)
    unclean = [c for c in cases if not c.clean]
    figures = {
        "bad_inputs_tried": len(cases),
        "bad_inputs_unclean": len(unclean),
        "faults_tried": len(fault_list),
        "faults_lost_data": sum(f.lost for f in fault_list),
        "faults_unclean": sum(not f.clean for f in fault_list),
        **{
            k: load[k]
            for k in ("valid_requests_lost", "server_alive", "valid_p99_under_load_over_unloaded")
            if k in load
        },
        **({"trusted_over_plain_peak_rss": rss["trusted_over_plain_peak_rss"]} if rss else {}),
        "by_surface": {
            s: {"tried": n, "unclean": sum(1 for c in unclean if c.surface == s)} for s, n in surfaces.items()
        },
        "load": {k: v for k, v in load.items() if k != "lost"},
        "rss": rss,
        "seconds": round(seconds, 1),
    }
    if args.json:
        print(json.dumps(figures))
    else:
        print(f"{'surface':<12} {'tried':>6} {'unclean':>8}  unclean by kind")
        for s, n in surfaces.items():
            kinds = Counter(c.why for c in unclean if c.surface == s)
            print(f"{s:<12} {n:>6} {sum(kinds.values()):>8}  {dict(kinds) or ''}")
        print(f"\n{'fault':<46} {'lost data':>9} {'clean':>6}")
        for f in fault_list:
            print(f"{f.name:<46} {'yes' if f.lost else 'no':>9} {'yes' if f.clean else 'no':>6}")
        if load:
            print(
                f"\nload: {args.clients} clients x {args.load_seconds:.0f} s: {load['valid_requests']} valid, "
                f"{load['malformed_requests']} malformed ({load['malformed_5xx']} 5xx or no answer); valid lost "
                f"{load['valid_requests_lost']}, server alive {load['server_alive']}, p99 {load['loaded_p99_s']:.3f} s "
                f"loaded / {load['unloaded_p99_s']:.3f} s unloaded = {load['valid_p99_under_load_over_unloaded']:.2f}"
            )
        if rss:
            print(reliability_rss.table(rss, rss["release"]))
        print(f"\n{json.dumps({k: v for k, v in figures.items() if not isinstance(v, dict)})}")
    if args.verbose:
        for c in unclean:
            print(f"\n--- {c.surface}: {c.name}: {c.why}\n{c.output}", file=sys.stderr)
        for f in fault_list:
            if f.lost or not f.clean:
                print(f"\n--- fault: {f.name}: lost={f.lost} clean={f.clean}\n{f.output}", file=sys.stderr)
        for line in load.get("lost", []):
            print(f"\n--- lost valid request: {line}", file=sys.stderr)


if __name__ == "__main__":
    main()
