"""bench/reliability.py's faults: deepinfer-compile killed at each point and under a full disk, a rank
killed under deepinfer-serve and deepinfer-run, clients that go away, SIGTERM mid-stream."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from common import server_metrics
from reliability_http import VALID, request

TIMEOUT_S = 600
RANK_BOUND_S = 60  # a survivor of a killed rank must be gone within this


@dataclass
class Fault:
    name: str
    lost: bool  # data lost: a half-written bundle or cache entry, a later compile failing, a slot not freed
    clean: bool  # ended as it should (one line, the right status)
    output: str = ""


def broken_entries(cache: Path) -> list[str]:
    """Entries visible in the cache that are not whole."""
    from deepinfer.bundles.manifest_io import sha256_file

    bad = []
    for entry in sorted((cache / "v1").glob("*/??/*")):
        kind = entry.parent.parent.name
        if kind in ("tmp", "locks", "files"):
            continue
        try:
            meta = json.loads((entry / "meta.json").read_text())
            whole = meta["key"] == entry.name and sha256_file(entry / "artifact") == meta["digest"]
        except (OSError, ValueError, KeyError):
            whole = False
        if not whole:
            bad.append(f"{kind}/{entry.name}")
    return bad


def one_line(stderr: str) -> bool:
    return (
        "Traceback" not in stderr
        and stderr.strip().splitlines()[-1:] != []
        and (stderr.strip().splitlines()[-1].startswith("error:"))
    )


def compile_faults(toml: Path, work: Path) -> list[Fault]:
    from deepinfer.compiler.kill_points import KILL_AT_ENV, POINTS, compile_process

    out: list[Fault] = []
    cache, bundle = work / "kill-cache", work / "kill-bundle"
    for point in POINTS:
        r = compile_process(toml, bundle, cache, env={KILL_AT_ENV: point})
        bad = broken_entries(cache)
        lost = bundle.exists() or bool(bad)
        out.append(Fault(f"kill -9 at {point}", lost, r.returncode == -signal.SIGKILL, f"{bad} {r.stderr[-500:]}"))
    r = compile_process(toml, bundle, cache)
    ok = r.returncode == 0 and json.loads(r.stdout or "{}").get("compiled") == []
    out.append(Fault("compile after the kills reuses every entry", not ok, ok, r.stderr[-1000:]))
    for fsize in (60_000, 150_000, 1_000_000):
        cache, bundle = work / f"fsize-cache-{fsize}", work / f"fsize-bundle-{fsize}"
        r = compile_process(toml, bundle, cache, fsize=fsize)
        bad = broken_entries(cache) if cache.exists() else []
        staging = [p.name for p in work.glob(f".{bundle.name}.tmp-*")]
        lost = bundle.exists() or bool(bad) or bool(staging)
        clean = r.returncode == 2 and one_line(r.stderr)
        out.append(Fault(f"RLIMIT_FSIZE {fsize} bytes", lost, clean, f"{bad} {staging} {r.stderr[-500:]}"))
    return out


def _pid(pids: Path, rank: int, timeout_s: float = TIMEOUT_S) -> int:
    deadline = time.monotonic() + timeout_s
    while not (pids / f"rank-{rank}.pid").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank} did not load")
        time.sleep(0.05)
    return int((pids / f"rank-{rank}.pid").read_text())


def rank_faults(bundle: Path, work: Path) -> list[Fault]:
    """A follower of deepinfer-serve, then rank 1 of deepinfer-run, SIGKILLed while generating."""
    from deepinfer.runtime.liveness import TEST_PIDS_ENV
    from deepinfer.runtime.serving.server_process import ServerProcess

    out = []
    pids = work / "serve-pids"
    pids.mkdir()
    server = ServerProcess(bundle, "--model-name", "tiny", "--threads", "1", env={TEST_PIDS_ENV: str(pids)})
    try:
        body = json.dumps({**VALID, "max_tokens": 40, "stream": True}).encode()
        import threading

        threading.Thread(target=request, args=(server.url, body), daemon=True).start()
        time.sleep(1.0)
        os.kill(_pid(pids, 1), signal.SIGKILL)
        try:
            rc = server.proc.wait(RANK_BOUND_S)
        except subprocess.TimeoutExpired:
            rc = None
        err = server.proc.stderr.read() if rc is not None else "still running"
        clean = rc not in (None, 0) and one_line(err) and "rank 1" in err.strip().splitlines()[-1]
        out.append(Fault("deepinfer-serve follower killed", rc is None, clean, err[-800:]))
    finally:
        server.stop()
    pids = work / "run-pids"
    pids.mkdir()
    run = subprocess.Popen(
        [sys.executable, "-m", "deepinfer.runtime.cli", str(bundle), "--prompt", "Hello", "--max-new-tokens", "40"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, TEST_PIDS_ENV: str(pids)},
    )
    try:
        _pid(pids, 0)
        os.kill(_pid(pids, 1), signal.SIGKILL)
        try:
            _, err = run.communicate(timeout=RANK_BOUND_S)
        except subprocess.TimeoutExpired:
            err = "still running"
        clean = run.returncode == 2 and one_line(err) and "rank 1" in err.strip().splitlines()[-1]
        out.append(Fault("deepinfer-run rank killed", run.returncode is None, clean, err[-800:]))
    finally:
        run.kill()
        run.wait(TIMEOUT_S)
    return out


def metric(url: str, name: str) -> float:
    return (server_metrics(url) or {}).get(name, float("nan"))


def freed(url: str, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if metric(url, "deepinfer_running_sequences") == 0 and metric(url, "deepinfer_kv_blocks_in_use") == 0:
            return True
        time.sleep(0.1)
    return False


def client_faults(url: str) -> list[Fault]:
    """A client gone mid-stream, and one gone mid-body: no slot or block kept, the server serving."""
    import socket
    from urllib.parse import urlparse

    u = urlparse(url)
    out = []
    with socket.create_connection((u.hostname, u.port), timeout=60) as s:
        body = json.dumps({**VALID, "max_tokens": 40, "stream": True}).encode()
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + b"Content-Length: %d\r\n\r\n" % len(body)
            + body
        )
        s.recv(4096)  # the headers and the first chunk
    ok = freed(url) and request(url, json.dumps(VALID).encode())[0] == 200
    out.append(Fault("client gone mid-stream", not ok, ok))
    with socket.create_connection((u.hostname, u.port), timeout=60) as s:
        s.sendall(b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{"model": ')
    ok = freed(url) and request(url, json.dumps(VALID).encode())[0] == 200
    out.append(Fault("client gone mid-body", not ok, ok))
    return out


def sigterm_fault(server) -> Fault:
    """SIGTERM while a stream runs: it ends with a finish_reason and [DONE], and the server exits 0."""
    import http.client
    from urllib.parse import urlparse

    u = urlparse(server.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    conn.request(
        "POST",
        "/v1/completions",
        json.dumps({**VALID, "max_tokens": 40, "stream": True}),
        {"Content-Type": "application/json"},
    )
    r = conn.getresponse()
    first = r.readline()  # through the chunked decoding (r.fp is the raw socket)
    server.proc.send_signal(signal.SIGTERM)
    try:
        rest = first + r.read()
    except (OSError, http.client.HTTPException) as e:
        rest = first + f" [{type(e).__name__}]".encode()
    try:
        rc = server.proc.wait(120)
    except subprocess.TimeoutExpired:
        rc = None
    text = rest.decode("utf-8", "replace")
    done = "[DONE]" in text and '"finish_reason": "' in text.replace('"finish_reason":"', '"finish_reason": "')
    return Fault("SIGTERM mid-stream", not done, done and rc == 0, f"rc {rc}; {text[-300:]}")


RENDEZVOUS_BOUND_S = 8  # a rank that dies before the rendezvous must end its run within this (gloo: minutes)


def rank_processes(parent: int) -> list[int]:
    """The processes `parent` spawned with multiprocessing (its ranks), oldest first, from /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == parent and b"spawn_main" in cmdline:
            found.append((int(fields[19]), int(stat.parent.name)))  # (start time, pid)
    return [pid for _, pid in sorted(found)]


def rendezvous_faults(bundle: Path, work: Path) -> list[Fault]:
    """The last rank of deepinfer-run, then deepinfer-serve's follower, SIGKILLed as soon as its process
    exists (long before the rendezvous): clean when the command ends within RENDEZVOUS_BOUND_S with one
    line naming rank 1, and leaves nothing in its TMPDIR."""
    from deepinfer.runtime.liveness import EXIT_STATUS

    out = []
    commands = {
        "deepinfer-run rank killed before the rendezvous": ("deepinfer.runtime.cli", "--prompt", "Hello", 2, 2),
        "deepinfer-serve follower killed before the rendezvous": (
            "deepinfer.runtime.serving.cli",
            "--port",
            "0",
            1,
            EXIT_STATUS,
        ),
    }
    for name, (module, flag, value, ranks, status) in commands.items():
        tmp = work / f"tmp-{module}"
        tmp.mkdir()
        proc = subprocess.Popen(
            [sys.executable, "-m", module, str(bundle), flag, value, "--threads", "1"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "TMPDIR": str(tmp)},
        )
        try:
            deadline = time.monotonic() + TIMEOUT_S
            while len(pids := rank_processes(proc.pid)) < ranks and time.monotonic() < deadline:
                time.sleep(0.01)
            os.kill(pids[ranks - 1], signal.SIGKILL)
            try:
                _, err = proc.communicate(timeout=RENDEZVOUS_BOUND_S)
            except subprocess.TimeoutExpired:
                err = f"still running {RENDEZVOUS_BOUND_S} s after its rank was killed"
            last = err.strip().splitlines()[-1:]
            clean = proc.returncode == status and one_line(err) and last[0].startswith("error: rank 1")
            out.append(Fault(name, proc.returncode is None, clean and not any(tmp.iterdir()), err[-800:]))
        finally:
            proc.kill()
            proc.wait(TIMEOUT_S)
    return out
