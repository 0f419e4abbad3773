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

KILL_AT_ENV = "DEEPINFER_TEST_KILL_AT"
POINTS = ("entry", "weights", "trace", "emit", "compile", "publish")


def kill_point(point: str) -> None:
    """SIGKILL this process when the test hook names `point` (no cleanup, no exit handlers run)."""
    assert point in POINTS, point
    if os.environ.get(KILL_AT_ENV) == point:
        os.kill(os.getpid(), signal.SIGKILL)
