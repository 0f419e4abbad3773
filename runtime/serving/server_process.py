"""`ServerProcess`: a real `deepinfer-serve` in a subprocess, for tests and benchmarks; `RayServeProcess`:
one on Ray Serve (`--ray-serve`), N replicas behind one endpoint."""

from __future__ import annotations


class ServerProcess:
    """`deepinfer-serve BUNDLE --port 0 ARGS` in a subprocess on 127.0.0.1, for tests and benchmarks:
    `url` is read from its first line (the port it bound; no race for a free port); every wait is
    bounded; `stop` sends SIGTERM, then kills after `timeout_s`. `die_with_parent`: the server gets
    SIGTERM when this process dies, however it dies (Linux's PR_SET_PDEATHSIG: a Ray Serve replica's
    child, runtime/serving/ray_serve.py)."""

    def __init__(
        self,
        bundle,
        *args: str,
        start_timeout_s: float = 300.0,
        env: dict | None = None,
        die_with_parent: bool = False,
    ):
        import os
        import queue
        import re
        import subprocess
        import sys
        import threading

        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "deepinfer.runtime.serving.cli",
                str(bundle),
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                *args,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
            preexec_fn=_die_with_parent if die_with_parent else None,
        )
        lines: queue.Queue = queue.Queue()
        stdout = self.proc.stdout
        assert stdout is not None  # stdout=PIPE

        def read() -> None:
            for line in stdout:
                lines.put(line)

        threading.Thread(target=read, daemon=True).start()
        try:
            first = lines.get(timeout=start_timeout_s)
        except queue.Empty:
            self.stop()
            raise TimeoutError(f"deepinfer-serve printed nothing in {start_timeout_s:.0f} s") from None
        found = re.search(r" on (http://127\.0\.0\.1:\d+) ", first)
        if not found:
            self.stop()
            raise RuntimeError(f"deepinfer-serve: {first!r} {self.proc.stderr.read() if self.proc.stderr else ''}")
        self.url = found.group(1)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, timeout_s: float = 30.0) -> int:
        """Stop the server; its exit status."""
        import signal
        import subprocess

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=timeout_s)
        return self.proc.returncode


def _die_with_parent() -> None:
    """In the child before it execs: SIGTERM when the parent dies (Linux prctl PR_SET_PDEATHSIG)."""
    import ctypes
    import signal

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class RayServeProcess:
    """`deepinfer-serve BUNDLE --ray-serve ADDRESS --replicas N ARGS` in a subprocess, the endpoint on
    127.0.0.1:`port` (Ray Serve's proxy binds the port it is given, so the caller picks a free one),
    ready once `/health` counts every replica (bounded by `start_timeout_s`)."""

    def __init__(self, bundle, address: str, replicas: int, port: int, *args: str, start_timeout_s: float = 600.0):
        import subprocess
        import sys
        import time

        cmd = [sys.executable, "-m", "deepinfer.runtime.serving.cli", str(bundle), "--ray-serve", address]
        cmd += ["--replicas", str(replicas), "--host", "127.0.0.1", "--port", str(port), *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + start_timeout_s
        while self.health().get("replicas_ready") != replicas:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"deepinfer-serve --ray-serve exited: {self.proc.stderr.read() if self.proc.stderr else ''}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"{replicas} replicas were not ready in {start_timeout_s:.0f} s")
            time.sleep(1)

    def health(self) -> dict:
        """The endpoint's /health body ({} while it does not answer)."""
        import json
        import urllib.request

        try:
            with urllib.request.urlopen(self.url + "/health", timeout=10) as r:
                return json.loads(r.read())
        except (OSError, ValueError):
            return {}

    def stop(self, timeout_s: float = 180.0) -> int:
        """SIGTERM (the application deleted, its replicas stopped), then kill after `timeout_s`; the exit status."""
        import subprocess

        self.proc.terminate()
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(timeout=30)


def free_port() -> int:
    """A port free now on 127.0.0.1 (for Ray Serve's proxy, which cannot take port 0 and say which it got)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
