"""The ranks' set-up for collectives compiled into NEFFs (runtime/neuron/collectives.py, runtime/neuron/arrival.py),
in real processes over gloo with a file rendezvous: the leader's NEURON_RT_ROOT_COMM_ID reaches every
rank, a user's value is kept only when every rank holds it, and a rank that never arrives at a
collective libnrt call ends the run within the collective timeout, named. Collective calls run on the
libnrt TEST DOUBLE (doubles/fake_nrt.c), which makes each rank wait for the others in a shared
directory and logs rank, world, root and model per call: it proves nothing about Trn2 collectives,
only what the runtime asks of libnrt and what it does when a rank does not come.

The leader's chooser asks the OS for a free port once (bind to port 0, then release); nothing here
binds the port it names (the double never listens), so no test races for one. The session tests at
the end compile a two-rank bundle (slow) and run it with deepinfer's own launcher.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import re
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from deepinfer.errors import DeepinferError
from deepinfer.runtime import RunOptions, generate
from deepinfer.runtime.bundle import open_bundle
from deepinfer.runtime.neuron import arrival, collectives
from deepinfer.runtime.neuron.device import DeviceTensor, NeuronCore, NeuronModel
from deepinfer.runtime.neuron.libnrt import ENV_ROOT_COMM
from deepinfer.runtime.ranks import init

from .conftest import fake_model, finished_copy, fnv1a

WORLD = 2
START_S = 120  # a spawned rank imports torch: generous on a loaded 2-core machine
SLACK_S = 5.0  # past the collective timeout: two watchdog ticks, the report, the exit


def _manifest(target: str = "trn2", world: int = WORLD, reduced: bool = True):
    """What collectives reads of a manifest: the target, the world, whether each executable holds
    collectives."""
    return SimpleNamespace(
        target=SimpleNamespace(name=target),
        topology=SimpleNamespace(world_size=world),
        regions=(SimpleNamespace(holds_collectives=False), SimpleNamespace(holds_collectives=reduced)),
    )


def _spawn(target, args_of, tmp_path):
    """Start WORLD ranks running `target(rank, WORLD, rendezvous, *args_of(rank), out)` -> (procs, out)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    rendezvous = str(tmp_path / "rendezvous")
    procs = [ctx.Process(target=target, args=(r, WORLD, rendezvous, *args_of(r), out)) for r in range(WORLD)]
    for p in procs:
        p.start()
    return procs, out


def _stop(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(30)


# --- NEURON_RT_ROOT_COMM_ID -----------------------------------------------------------------------

SCENARIOS = {  # per rank: the value the user set (None: unset)
    "chosen": (None, None),
    "kept": ("10.1.2.3:45678", "10.1.2.3:45678"),
    "differs": ("10.1.2.3:45678", None),
    "malformed": ("10.1.2.3", "10.1.2.3"),
}


def _root_comm_rank(rank: int, world: int, rendezvous: str, out) -> None:
    """Every scenario in turn, in one process group: what share_root_comm returns or raises here."""
    init(rank, world, rendezvous, timeout_s=60)
    try:
        results = {}
        for name, values in SCENARIOS.items():
            os.environ.pop(ENV_ROOT_COMM, None)
            if values[rank] is not None:
                os.environ[ENV_ROOT_COMM] = values[rank]
            try:
                got = collectives.share_root_comm(rank, world, collectives.LOCAL_HOST)
                results[name] = ("ok", got, os.environ.get(ENV_ROOT_COMM))
            except collectives.RootCommError as e:  # every rank sees every value: all refuse alike
                results[name] = ("error", str(e), os.environ.get(ENV_ROOT_COMM))
        out.put((rank, results))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def root_comm_runs(tmp_path_factory) -> dict[int, dict]:
    """{rank: {scenario: (outcome, value or message, the variable after)}}, from two rank processes."""
    procs, out = _spawn(_root_comm_rank, lambda r: (), tmp_path_factory.mktemp("root-comm"))
    try:
        got = dict(out.get(timeout=START_S) for _ in procs)
        for p in procs:
            p.join(60)
            assert p.exitcode == 0
    finally:
        _stop(procs)
    return got


def test_the_leader_chooses_the_root_comm_and_every_rank_sets_it(root_comm_runs):
    outcomes = [root_comm_runs[r]["chosen"] for r in range(WORLD)]
    assert all(o[0] == "ok" and o[1] == o[2] for o in outcomes), outcomes  # returned and in the environment
    assert len({o[1] for o in outcomes}) == 1
    host, port = outcomes[0][1].rsplit(":", 1)
    assert host == collectives.LOCAL_HOST and 0 < int(port) < 65536


def test_a_root_comm_the_user_set_on_every_rank_is_kept(root_comm_runs):
    assert [root_comm_runs[r]["kept"] for r in range(WORLD)] == [("ok", "10.1.2.3:45678", "10.1.2.3:45678")] * 2


def test_a_root_comm_that_differs_between_ranks_is_refused_in_one_line(root_comm_runs):
    for r in range(WORLD):
        outcome, message, after = root_comm_runs[r]["differs"]
        assert outcome == "error" and "\n" not in message
        assert f"{ENV_ROOT_COMM} differs between the ranks (10.1.2.3:45678 on rank 0, unset on rank 1)" in message
        assert after == SCENARIOS["differs"][r]  # nothing set
    outcome, message, _ = root_comm_runs[0]["malformed"]
    assert outcome == "error" and message.startswith(f"{ENV_ROOT_COMM}=10.1.2.3 is not <ip>:<port>")


def test_only_a_trn2_bundle_with_collectives_in_its_neffs_is_prepared(monkeypatch):
    """cpu bundles, host collectives and single ranks: no watch, the variable untouched, no collective
    over the process group (none exists here)."""
    assert collectives.in_graph_collectives(_manifest())
    monkeypatch.delenv(ENV_ROOT_COMM, raising=False)
    for manifest in (_manifest(target="cpu"), _manifest(reduced=False), _manifest(world=1)):
        assert not collectives.in_graph_collectives(manifest)
        collectives.prepare(manifest, 0, None, host=collectives.LOCAL_HOST, timeout_s=1)
        assert arrival._WATCH is None and ENV_ROOT_COMM not in os.environ
    assert arrival.rank_spans([0, 1, 2, 5, 7, 8]) == "ranks 0-2, 5, 7-8" and arrival.rank_spans([3]) == "rank 3"


# --- the bounded wait, on the libnrt double -------------------------------------------------------


def _neuron_rank(rank, world, rendezvous, env, models, executions, timeout_s, out) -> None:
    """A rank as the start-up path makes one (process group, then collectives.prepare), loading
    `models` with collectives on the libnrt double and executing each `executions` times in turn.
    Puts (rank, "start" | "done" | "error", message, monotonic time)."""
    os.environ.update(env)  # the double, its log, the shared directory, the hang knob
    os.environ.pop(ENV_ROOT_COMM, None)

    def report(error):
        out.put((rank, "error", str(error), time.monotonic()))
        out.close()
        out.join_thread()

    store = init(rank, world, rendezvous, timeout_s=60)
    try:
        collectives.prepare(_manifest(), rank, store, host=collectives.LOCAL_HOST, timeout_s=timeout_s, report=report)
        out.put((rank, "start", os.environ[ENV_ROOT_COMM], time.monotonic()))
        with NeuronCore() as core:
            loaded = [NeuronModel.load(core, m, collectives=(rank, world)) for m in models]
            x = DeviceTensor.from_torch(core, torch.tensor([rank, 7], dtype=torch.int32), "x")
            y = DeviceTensor.allocate(core, 8, "y")
            for _ in range(executions):
                for model in loaded:
                    model.execute([x], [y])
        out.put((rank, "done", None, time.monotonic()))
    finally:
        arrival.install(None)
        dist.destroy_process_group()


def _run_neuron_ranks(tmp_path, fake_nrt_path, models_of, *, hang=None, executions=2, timeout_s=2.0):
    """Two ranks of `_neuron_rank` (rank r loads `models_of(r)`) -> (events {rank: {kind: (message,
    time)}}, exit codes ("frozen" for a rank the double stopped), the ranks' double logs). Waits until
    every rank is done, or one reported an error and the ranks not frozen have exited; never past
    START_S, and every rank process is gone on return."""
    shared = tmp_path / "collectives"
    shared.mkdir()
    logs = [tmp_path / f"nrt-{r}.log" for r in range(WORLD)]

    def args_of(r):
        env = {
            "DEEPINFER_LIBNRT": str(fake_nrt_path),
            "FAKE_NRT_LOG": str(logs[r]),
            "FAKE_NRT_COLLECTIVES_DIR": str(shared),
            "FAKE_NRT_HANG_RANK": hang or "",
        }
        return env, [str(m) for m in models_of(r)], executions, timeout_s

    procs, out = _spawn(_neuron_rank, args_of, tmp_path)
    events: dict[int, dict] = {r: {} for r in range(WORLD)}
    deadline = time.monotonic() + START_S
    try:
        while time.monotonic() < deadline:
            try:
                rank, kind, message, when = out.get(timeout=1)
                events[rank][kind] = (message, when)
            except queue.Empty:
                pass
            finished = [p.exitcode is not None or "done" in events[r] for r, p in enumerate(procs)]
            errored = any("error" in e for e in events.values())
            if all(finished) or (errored and all(p.exitcode is not None for p in procs if not _frozen(p))):
                break
        for p in procs:
            if not _frozen(p):
                p.join(30)
        return events, [p.exitcode if not _frozen(p) else "frozen" for p in procs], logs
    finally:
        _stop(procs)


def _frozen(p) -> bool:
    """The process is stopped (SIGSTOP, the double's hang), not running and not exited."""
    try:
        with open(f"/proc/{p.pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "T"
    except FileNotFoundError:
        return False


def _collective_calls(log) -> list[tuple[str, str, str, str]]:
    """(function, rank, model, call) of each completed collective call in a rank's double log."""
    out = []
    for line in log.read_text().splitlines():
        if "rank=" in line and line.endswith("-> 0"):
            fields = dict(re.findall(r"(\w+)=(\S+)", line))
            out.append((line.split()[0], fields["rank"], fields.get("model", "comm"), fields["call"]))
    return out


@pytest.fixture
def two_models(tmp_path):
    a = fake_model(tmp_path / "a.fake", {"x": 8}, {"y": 8}, {"y": "x"})
    b = fake_model(tmp_path / "b.fake", {"x": 8}, {"y": 8}, {})
    return a, b


def test_ranks_load_and_execute_the_same_neffs_in_the_same_order(tmp_path, fake_nrt_path, two_models):
    """Every rank's double log holds the same collective calls (the communicator, then each load,
    then each execution) with the same models in the same order, under the leader's root."""
    events, exits, logs = _run_neuron_ranks(tmp_path, fake_nrt_path, lambda r: two_models)
    assert exits == [0, 0] and all("done" in events[r] for r in range(WORLD)), events
    root = events[0]["start"][0]
    assert events[1]["start"][0] == root and root.startswith(f"{collectives.LOCAL_HOST}:")
    calls = [_collective_calls(log) for log in logs]
    a, b = (fnv1a(m.read_bytes()) for m in two_models)
    want = ["comm", a, b, a, b, a, b]  # set-up, loads, two rounds of executions
    for r in range(WORLD):
        assert [c[2] for c in calls[r]] == want and {c[1] for c in calls[r]} == {str(r)}
        assert [c[3] for c in calls[r]] == [str(n) for n in range(1, 8)]
        assert all(f"root={root}" in ln for ln in logs[r].read_text().splitlines() if "rank=" in ln)
    assert [(f, m, n) for f, _, m, n in calls[0]] == [(f, m, n) for f, _, m, n in calls[1]]


def test_a_rank_that_never_arrives_ends_the_run_naming_it(tmp_path, fake_nrt_path, two_models):
    """Rank 1 stops at its collective call 4 (its first execution: after the set-up and two loads):
    rank 0, blocked in the double waiting for it, ends itself within the timeout and says which rank
    never came; rank 1, frozen, is the launcher's to kill."""
    timeout_s = 2.0
    events, exits, logs = _run_neuron_ranks(tmp_path, fake_nrt_path, lambda r: two_models, hang="1:4")
    message, when = events[0]["error"]
    assert message == (
        f"rank 1 did not arrive at collective call 4 (execute of a.fake) within {timeout_s:g} s; {arrival.TIMEOUT_FIX}"
    )
    assert when - events[0]["start"][1] < timeout_s + SLACK_S
    assert exits == [arrival.EXIT_STATUS, "frozen"]
    assert "nrt_execute rank=1 call=4 FAKE_NRT_HANG_RANK" in logs[1].read_text()
    assert [c[3] for c in _collective_calls(logs[0])] == ["1", "2", "3"]  # call 4 never completed


def test_ranks_at_different_neffs_end_the_run_with_one_line(tmp_path, fake_nrt_path, two_models):
    """Rank 1 loads the NEFFs in the other order: at call 2 the ranks wait for each other at different
    models, forever on the double; both end themselves within the timeout, with the same line."""
    timeout_s = 2.0
    events, exits, _ = _run_neuron_ranks(
        tmp_path, fake_nrt_path, lambda r: two_models if r == 0 else two_models[::-1], timeout_s=timeout_s
    )
    assert exits == [arrival.EXIT_STATUS, arrival.EXIT_STATUS]
    messages = {events[r]["error"][0] for r in range(WORLD)}
    assert messages == {
        "the ranks are at different NEFFs at collective call 2 (load of a.fake on rank 0, load of b.fake on "
        f"rank 1), none completed; {arrival.TIMEOUT_FIX}"
    }
    for r in range(WORLD):
        assert events[r]["error"][1] - events[r]["start"][1] < timeout_s + SLACK_S


# --- a two-rank session on the doubles ------------------------------------------------------------


@pytest.fixture(scope="module")
def two_rank_bundle(trn2_ep2_bundle, tmp_path_factory) -> Path:
    """A copy of the tiny model for trn2 at ep = 2 (tests/conftest.py: each layer one executable
    holding its dispatch collectives), finished by the stand-in neuronx-cc (TEST DOUBLE NEFFs)."""
    return finished_copy(trn2_ep2_bundle, tmp_path_factory.mktemp("trn2-ranks") / "bundle")


@pytest.mark.slow
def test_a_two_rank_session_runs_the_same_neffs_in_the_same_order(two_rank_bundle, session_env):
    """deepinfer's own launcher (generate_ranks) runs both ranks on the doubles: each builds the
    communicator under the leader's root, loads the layer NEFFs (which hold the collectives), and
    executes one per layer per step; the two ranks' collective calls match one for one. Between the
    embedding and the head nothing crosses to the host (issue 29): from one step's first layer to the
    next's, a rank reads back its greedy pairs alone (the head picks in its graph) and writes only the
    step's host inputs."""
    m = open_bundle(two_rank_bundle).manifest
    reduced = {Path(e.artifact).name for e in m.regions if e.holds_collectives}
    assert reduced and all(n.startswith("layer_") for n in reduced) and len(reduced) == len({l.fused for l in m.layers})
    for e in m.regions:  # each layer's dispatch: gathers in, the combine's reduce-scatter out
        if e.holds_collectives:
            assert [c.op for c in e.collectives or ()] == ["all_gather"] * 3 + ["reduce_scatter"]
    done = generate(two_rank_bundle, [[1, 5, 9]], RunOptions(max_new_tokens=2, collective_timeout_s=60, timeout_s=600))
    assert done[0].error is None and len(done[0].tokens) == 5
    calls = {r: _collective_calls_of(session_env, r) for r in range(WORLD)}
    assert calls[0] == calls[1] and calls[0][0] == ("nrt_build_global_comm", "comm", "1")
    loads = [c for c in calls[0] if c[0] == "nrt_load_collectives"]
    assert len(loads) == len(reduced)
    executes = [c for c in calls[0] if c[0] == "nrt_execute"]
    assert len(executes) == len(m.layers) * done.stats.steps
    # host<->device bytes of each rank, sampled at each step's first layer execution (cumulative counts)
    # a greedy step: the head picks in its graph (`Head.best`), its (value, index) pairs come back alone
    head = next(e for e in m.regions if (e.kind, e.method) == ("head", "best"))
    pairs = next(s for s in head.output_specs or () if s.name == "best")
    pair_bytes = 4 * pairs.shape[0] * pairs.shape[1] * pairs.shape[2]  # [B, T, 2] float32
    step_inputs = {
        s.name: torch.Size(s.shape).numel() * getattr(torch, s.dtype).itemsize
        for e in m.regions
        for s in e.inputs
        if s.role == "step"
    }
    for r in range(WORLD):
        firsts = _execute_bytes(session_env, r)[:: len(m.layers)]
        assert len(firsts) == done.stats.steps
        for (to_device, to_host), (next_device, next_host) in zip(firsts, firsts[1:]):
            assert next_host - to_host == pair_bytes  # the head's pairs: no logits, stream or partial
            # the step's ids, positions and the like (rank 1's token group has no sequence: nothing changes)
            assert (16 if r == 0 else 0) <= next_device - to_device <= sum(step_inputs.values())
    roots = {re.search(r"root=(\S+)", ln).group(1) for ln in session_env.read_text().splitlines() if "root=" in ln}
    assert len(roots) == 1 and roots.pop().startswith(f"{collectives.LOCAL_HOST}:")


@pytest.mark.slow
def test_a_rank_that_never_arrives_ends_a_session_naming_it(two_rank_bundle, session_env, monkeypatch):
    """The double freezes rank 1 at its first execution of a NEFF with collectives: generate_ranks
    raises, within the collective timeout plus slack, the one line that names rank 1, and no rank
    process is left."""
    timeout_s = 3.0
    loads = sum(1 for e in open_bundle(two_rank_bundle).manifest.regions if e.holds_collectives)
    monkeypatch.setenv("FAKE_NRT_HANG_RANK", f"1:{2 + loads}")  # past the set-up and the loads
    start = time.monotonic()
    with pytest.raises(
        DeepinferError,
        match=r"^rank 0: CollectiveTimeout: rank 1 did not arrive at collective call \d+ \(execute of layer_",
    ):
        generate(
            two_rank_bundle, [[1, 5, 9]], RunOptions(max_new_tokens=2, collective_timeout_s=timeout_s, timeout_s=600)
        )
    assert time.monotonic() - start < START_S
    assert "FAKE_NRT_HANG_RANK" in session_env.read_text() and not mp.active_children()


def _execute_bytes(log: Path, rank: int) -> list[tuple[int, int]]:
    """(to_device, to_host) bytes since nrt_init at each of `rank`'s collective executions, in order."""
    out = []
    for line in log.read_text().splitlines():
        if line.startswith("nrt_execute ") and f" rank={rank} " in line and line.endswith("-> 0"):
            fields = dict(re.findall(r"(\w+)=(\S+)", line))
            out.append((int(fields["to_device"]), int(fields["to_host"])))
    return out


def _collective_calls_of(log: Path, rank: int) -> list[tuple[str, str, str]]:
    """(function, model, call) of each completed collective call of `rank` in the shared log."""
    return [(f, m, n) for f, r, m, n in _collective_calls(log) if r == str(rank)]
