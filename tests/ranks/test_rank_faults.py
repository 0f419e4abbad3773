"""A rank killed mid-generation ends the others with one line naming it, within a bounded time.

Real processes on a 2-rank (ep = 2) tiny bundle at its cheapest (saved ExportedPrograms, decode
bucket only, compiled once for this module): deepinfer-serve (this process leads,
its follower one process) and deepinfer-run (both ranks processes of the command). Each rank writes
its pid once loaded (the test hook $DEEPINFER_TEST_RANK_PIDS, runtime/liveness.py), and is SIGKILLed
while the leader streams or generates; or a rank is SIGKILLed as soon as its process appears in /proc,
before the rendezvous. Every wait is bounded: a hang in a collective fails the test.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from deepinfer.runtime.liveness import EXIT_STATUS, TEST_PIDS_ENV, collect
from deepinfer.runtime.serving.server_process import ServerProcess

from ..conftest import _compile_tiny

pytestmark = pytest.mark.xdist_group("rank-faults")  # the bundle tests share one of their own

ENDS_WITHIN_S = 60  # the bound on a survivor's exit (the collective timeout is ten minutes)
START_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def ep2_bundle(tmp_path_factory, tiny_ckpt) -> Path:
    """The tiny model on two ranks (ep = 2), decode only: cheap to compile and to load."""
    return _compile_tiny(
        tmp_path_factory,
        "ep2",
        tiny_ckpt,
        executable="exported",
        tokens=[1],
        max_context=64,
        num_blocks=9,
        parallel=(1, 2, 1),
    )


def pid_of(pids: Path, rank: int, timeout_s: float = START_TIMEOUT_S) -> int:
    """The pid rank `rank` wrote once loaded."""
    deadline = time.monotonic() + timeout_s
    while not (pids / f"rank-{rank}.pid").exists():
        assert time.monotonic() < deadline, f"rank {rank} did not load in {timeout_s} s"
        time.sleep(0.05)
    return int((pids / f"rank-{rank}.pid").read_text())


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def stream_started(url: str):
    """A streamed completion long enough to be mid-generation when a rank dies; its first chunk read."""
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 50, "stream": True}
    req = urllib.request.Request(
        url + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    response = urllib.request.urlopen(req, timeout=120)
    assert response.readline().startswith(b"data: ")
    return response


@pytest.mark.slow  # compiles and loads a bundle
def test_a_killed_follower_stops_the_server_with_one_line_naming_it(ep2_bundle, tmp_path):
    server = ServerProcess(ep2_bundle, "--model-name", "tiny", "--threads", "1", env={TEST_PIDS_ENV: str(tmp_path)})
    try:
        response = stream_started(server.url)
        os.kill(pid_of(tmp_path, 1), signal.SIGKILL)
        assert server.proc.wait(ENDS_WITHIN_S) == EXIT_STATUS
        response.close()
        err = server.proc.stderr.read()
        assert "Traceback" not in err
        assert err.strip().splitlines()[-1].startswith("error: rank 1 (pid ") and "killed by SIGKILL" in err
    finally:
        server.stop()


@pytest.mark.slow  # compiles and loads a bundle
def test_a_killed_rank_ends_deepinfer_run_with_one_line_naming_it(ep2_bundle, tmp_path):
    run = subprocess.Popen(
        [sys.executable, "-m", "deepinfer.runtime.cli", str(ep2_bundle), "--prompt", "Hello"]
        + ["--max-new-tokens", "50", "--threads", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, TEST_PIDS_ENV: str(tmp_path)},
    )
    try:
        pid_of(tmp_path, 0)
        os.kill(pid_of(tmp_path, 1), signal.SIGKILL)
        _, err = run.communicate(timeout=ENDS_WITHIN_S)
        assert run.returncode == 2 and "Traceback" not in err
        assert err.strip().splitlines()[-1] == "error: rank 1: was killed by SIGKILL without a result"
        assert gone(pid_of(tmp_path, 0))
    finally:
        run.kill()
        run.wait(ENDS_WITHIN_S)


NOTICED_WITHIN_S = 8  # the bound on ending a run whose rank died before the rendezvous (gloo's store waits minutes)


def rank_processes(parent: int) -> list[int]:
    """The pids of the processes `parent` has spawned with multiprocessing (spawn_main in their command
    line: its ranks), oldest first, read from /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:  # it ended while we looked
            continue
        if int(fields[1]) == parent and b"spawn_main" in cmdline:
            found.append((int(fields[19]), int(stat.parent.name)))  # (start time, pid)
    return [pid for _, pid in sorted(found)]


def spawned(parent: int, count: int, besides: frozenset[int] = frozenset(), timeout_s: float = START_TIMEOUT_S):
    """The first `count` rank processes `parent` spawns (other than `besides`), as soon as they appear:
    before they have imported anything, so long before any reaches the rendezvous."""
    deadline = time.monotonic() + timeout_s
    while len(found := [pid for pid in rank_processes(parent) if pid not in besides]) < count:
        assert time.monotonic() < deadline, f"{len(found)} of {count} rank processes started in {timeout_s} s"
        time.sleep(0.01)
    return found[:count]


@pytest.mark.slow  # compiles and loads a bundle
def test_a_rank_killed_before_the_rendezvous_ends_deepinfer_run_at_once(ep2_bundle, tmp_path):
    """Rank 1 SIGKILLed as soon as its process exists: the command names it in one line within a few
    seconds (rank 0, waiting for it in the rendezvous, is killed rather than left to gloo's timeout)
    and leaves no process and no file behind."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    run = subprocess.Popen(
        [sys.executable, "-m", "deepinfer.runtime.cli", str(ep2_bundle), "--prompt", "Hello"]
        + ["--max-new-tokens", "5", "--threads", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TMPDIR": str(tmp)},
    )
    try:
        ranks = spawned(run.pid, 2)
        os.kill(ranks[1], signal.SIGKILL)
        killed = time.monotonic()
        while run.poll() is None:
            assert time.monotonic() - killed < ENDS_WITHIN_S, "deepinfer-run outlived its killed rank"
            time.sleep(0.05)
        took = time.monotonic() - killed
        _, err = run.communicate(timeout=ENDS_WITHIN_S)
        assert run.returncode == 2 and err.strip().splitlines() == [
            "error: rank 1: was killed by SIGKILL without a result"
        ], err
        assert took < NOTICED_WITHIN_S, f"deepinfer-run ended {took:.1f} s after its rank 1 was killed"
        assert all(gone(pid) for pid in ranks) and list(tmp.iterdir()) == []
    finally:
        run.kill()
        run.wait(ENDS_WITHIN_S)


@pytest.mark.slow  # compiles and loads a bundle
def test_a_follower_killed_before_the_rendezvous_stops_the_server_at_once(ep2_bundle, tmp_path):
    """deepinfer-serve's follower SIGKILLed as soon as its process exists: the server (rank 0, in the
    rendezvous) stops within a few seconds with one line naming it, and leaves no file behind."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    server = subprocess.Popen(
        [sys.executable, "-m", "deepinfer.runtime.serving.cli", str(ep2_bundle), "--host", "127.0.0.1"]
        + ["--port", "0", "--threads", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TMPDIR": str(tmp)},
    )
    try:
        (follower,) = spawned(server.pid, 1)
        os.kill(follower, signal.SIGKILL)
        killed = time.monotonic()
        while server.poll() is None:
            assert time.monotonic() - killed < ENDS_WITHIN_S, "deepinfer-serve outlived its killed follower"
            time.sleep(0.05)
        took = time.monotonic() - killed
        _, err = server.communicate(timeout=ENDS_WITHIN_S)
        assert server.returncode == EXIT_STATUS and "Traceback" not in err, err
        assert err.strip().splitlines()[-1] == (
            f"error: rank 1 (pid {follower}) was killed by SIGKILL; the server stops: every step needs every rank"
        )
        assert took < NOTICED_WITHIN_S, f"deepinfer-serve ended {took:.1f} s after its follower was killed"
        assert list(tmp.iterdir()) == []
    finally:
        server.kill()
        server.wait(ENDS_WITHIN_S)


@pytest.mark.slow  # compiles and loads a bundle
def test_a_rank_killed_before_the_rendezvous_ends_a_start_at_once(ep2_bundle):
    """runtime.launch.start (the rank tests' and benchmarks' started ranks): rank 1 SIGKILLed as soon as
    its process exists ends the start with the error naming it within a few seconds, every rank gone."""
    from deepinfer.errors import DeepinferError
    from deepinfer.runtime import LoadOptions, open_bundle
    from deepinfer.runtime.launch import start

    besides = frozenset(rank_processes(os.getpid()))  # the ranks this session started before
    ranks: list[int] = []
    killed: list[float] = []

    def kill_rank_1() -> None:
        ranks.extend(spawned(os.getpid(), 2, besides))
        os.kill(ranks[1], signal.SIGKILL)
        killed.append(time.monotonic())

    killer = threading.Thread(target=kill_rank_1, daemon=True)
    killer.start()
    with pytest.raises(DeepinferError) as failed:
        start(open_bundle(ep2_bundle), LoadOptions(threads=1), timeout_s=ENDS_WITHIN_S)
    took = time.monotonic() - killed[0]
    assert str(failed.value) == "rank 1: was killed by SIGKILL without a result"
    assert took < NOTICED_WITHIN_S, f"start raised {took:.1f} s after its rank 1 was killed"
    assert all(gone(pid) for pid in ranks)


class _Proc:
    def __init__(self, exitcode):
        self.exitcode = exitcode


def test_a_rank_whose_peer_was_killed_is_not_the_one_named():
    """The survivor's collective fails first (a closed connection) and says so; the killed rank is named."""
    import queue

    results = queue.Queue()
    results.put({"rank": 0, "error": "RuntimeError: [gloo] Connection closed by peer"})
    assert collect([_Proc(1), _Proc(-9)], results, timeout_s=60) == [
        {"rank": 1, "error": "was killed by SIGKILL without a result"}
    ]
    results.put({"rank": 0, "error": "ConfigError: a bad prompt"})  # a failure of its own: itself named
    assert collect([_Proc(1), _Proc(1)], results, timeout_s=60) == [{"rank": 0, "error": "ConfigError: a bad prompt"}]


LAUNCHER = """
import sys, time, multiprocessing as mp
from deepinfer.runtime.liveness import watch_launcher

def rank(conn):
    watch_launcher(conn, 1, "the test's launcher")
    time.sleep(600)

if __name__ == "__main__":
    ends, alive = mp.get_context("spawn").Pipe(duplex=False)
    p = mp.get_context("spawn").Process(target=rank, args=(ends,))
    p.start()
    ends.close()
    print(p.pid, flush=True)
    time.sleep(600)
"""


def test_a_rank_exits_with_one_line_when_its_launcher_is_killed(tmp_path):
    """What a follower does when deepinfer-serve dies, and deepinfer-run's ranks when the command does."""
    script = tmp_path / "launcher.py"
    script.write_text(LAUNCHER)
    launcher = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        rank = int(launcher.stdout.readline())
        launcher.kill()
        launcher.wait(ENDS_WITHIN_S)
        deadline = time.monotonic() + ENDS_WITHIN_S
        while not gone(rank):
            assert time.monotonic() < deadline, "the rank outlived its launcher"
            time.sleep(0.05)
        err = launcher.stderr.read()  # the rank shares its launcher's stderr
        assert err.strip().splitlines() == ["error: rank 1: the test's launcher is gone; rank 1 exits"]
    finally:
        launcher.kill()
        launcher.wait(ENDS_WITHIN_S)
