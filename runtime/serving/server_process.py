"""`ServerProcess`: a real `deepinfer-serve` in a subprocess, for tests and benchmarks."""

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
