"""A test hook: `DEEPINFER_TEST_KILL_AT=<point>` makes deepinfer-compile SIGKILL itself at that point.

The fault tests (tests/compiler/test_faults.py) and bench/reliability.py use it to show that a compile
killed anywhere leaves no bundle at `-o`, no visible partial cache entry, and a cache the next compile
reuses. Unset (always, outside tests), `kill_point` does nothing. The points, in the order a cold
compile reaches them:

    entry     a cache entry half written: its artifact in the cache's tmp/, its meta.json not yet
    weights   the first weight file stored in the cache, the others not
    trace     the first trace record stored in the cache
    emit      the first lowered program written for its compile job
    compile   the first executable compiled and stored in the cache
    publish   the whole bundle in its staging directory, not yet renamed to `-o`
"""

from __future__ import annotations

import os
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import subprocess

KILL_AT_ENV = "DEEPINFER_TEST_KILL_AT"
POINTS = ("entry", "weights", "trace", "emit", "compile", "publish")
COMPILE_TIMEOUT_S = 600  # a tiny compile takes about 30 s cold on 2 loaded cores


def kill_point(point: str) -> None:
    """SIGKILL this process when the test hook names `point` (no cleanup, no exit handlers run)."""
    assert point in POINTS, point
    if os.environ.get(KILL_AT_ENV) == point:
        os.kill(os.getpid(), signal.SIGKILL)


def compile_process(
    toml: Path,
    out: Path,
    cache: Path | None,
    *,
    args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    fsize: int | None = None,
    timeout: float | None = COMPILE_TIMEOUT_S,
) -> subprocess.CompletedProcess[str]:
    """`deepinfer-compile TOML -o OUT --cache-dir CACHE --json ARGS` in a process of its own, for the fault
    tests and the benchmarks: `cache` None leaves `--cache-dir` out (the compile's default cache, or none
    with `--no-cache` in `args`); with `env` added to its environment (`KILL_AT_ENV`), and with `fsize`, no
    file it writes may grow past that many bytes (RLIMIT_FSIZE; SIGXFSZ ignored, so an over-limit write
    fails with EFBIG as on a full disk); killed past `timeout` seconds (None: never). A
    `subprocess.CompletedProcess` with its text output."""
    import resource
    import subprocess
    import sys

    def limited(limit: int) -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    where = [] if cache is None else ["--cache-dir", str(cache)]
    return subprocess.run(
        [sys.executable, "-m", "deepinfer.compiler.cli", str(toml), "-o", str(out), *where, "--json", *args],
        env={**os.environ, **(env or {})},
        preexec_fn=None if fsize is None else lambda: limited(fsize),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
