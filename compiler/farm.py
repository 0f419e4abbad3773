"""The compile farm: compile jobs as Ray tasks across a cluster (`deepinfer-compile --ray`).

    host (this module)                            each worker (compiler/farm_worker.py)
    ------------------                            -------------------------------------
    connect (before any pass: a bad address
      fails in seconds)
    weights, trace, lower: as without a farm
    per job: the lowered program's bytes
      (ray.put) and a `Task` --------------------> writes them into a local temp dir, checks its
                                                  toolchain is the host's, compiles (jobs.run_job)
    the executable's bytes, written beside  <---- `Result`: bytes, digest, node, seconds (with a
      and verified against the digest             store: published there, the host reads it through)
    cache store, lock release, progress line

Nothing needs a shared file system. A worker that dies mid-job (killed, its node lost) is run
again by Ray (`max_retries`); a job that raises is run again on another node where there is
one, and fails the compile when two attempts fail the same way (or after `ATTEMPTS`), in one
line naming the region, bucket, node and the log kept in `<out>.failed-logs/`.

Signing stays on the host: with --sign the executables come back through Ray and the host's
cache signs what it stores, so a private key never travels to a worker. Ray is an optional
extra (`deepinfer[farm]`), imported only when --ray is given.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from deepinfer.bundles.manifest_io import sha256_file
from deepinfer.compiler.cache.keys import Key
from deepinfer.compiler.farm_worker import (
    HOST_PATHS,
    TEST_DIE_ONCE,
    TEST_FAIL,
    TEST_HOOK_PREFIX,
    WORKER_LOG,
    FarmError,
    Ledger,
    Result,
    Task,
    differences,
    probe,
    with_message,
    work,
)
from deepinfer.compiler.jobs import Job, torch_threads
from deepinfer.errors import DeepinferError

if TYPE_CHECKING:
    from deepinfer.compiler.cache.local import Cache
    from deepinfer.compiler.cache.remote import Store

__all__ = ["TEST_DIE_ONCE", "TEST_FAIL", "FarmError", "connect", "run_farm"]

INSTALL_HINT = "pip install 'deepinfer[farm]'"
CONNECT_TIMEOUT_S = 10.0  # a cluster address that does not answer fails in this time
SYSTEM_RETRIES = 2  # Ray runs a task again when its worker or node dies (max_retries)
ATTEMPTS = 3  # runs of a job that raises; two that fail the same way fail the compile sooner
POLL_S = 0.5
PROBE_TIMEOUT_S = 120.0  # each node's toolchain check (`_qualified`) answers within this
LEDGER_TIMEOUT_S = 120.0  # the ledger actor (which attempt started where) answers within this
# toolchain parts a node may declare as a Ray resource "<prefix>:<version>" (`ray start --resources`):
# where any node declares one, jobs go only to the nodes declaring the host's version, one unit a job
RESOURCES = {"neuronx-cc": "neuronx_cc"}


def ray_module():
    """Ray, imported on first use (an optional extra)."""
    try:
        import ray
    except ImportError:
        raise FarmError(f"--ray needs Ray, which is not installed: {INSTALL_HINT}") from None
    return ray


_connected: str | None = None  # the address this process joined


def connect(address: str) -> None:
    """Join the Ray cluster at `address` ("auto": the one this node belongs to), once per process."""
    global _connected
    ray = ray_module()
    if ray.is_initialized() and _connected == address:
        return
    if address != "auto":
        _reachable(address)
    if ray.is_initialized():
        ray.shutdown()
    try:
        ray.init(address=address, logging_level="ERROR", log_to_driver=False, configure_logging=False)
    except Exception as e:  # Ray raises ConnectionError, RuntimeError or ValueError here
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise FarmError(f"--ray {address}: cannot join the Ray cluster ({first}); {_START_HINT}") from None
    _connected = address


_START_HINT = "start one with `ray start --head` and pass the address it prints, or --ray auto on one of its nodes"


def _reachable(address: str) -> None:
    """Fail in CONNECT_TIMEOUT_S, not Ray's minutes of retries, when nothing answers at HOST:PORT."""
    hostport = address.removeprefix("ray://")
    host, sep, port = hostport.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise FarmError(f"--ray {address}: expected auto or HOST:PORT (the address `ray start --head` prints)")
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as e:
        raise FarmError(f"--ray {address}: cannot reach it ({e.strerror or e}); {_START_HINT}") from None


# --- the host's side ---------------------------------------------------------------------------


Finished = Callable[[Job], None]  # store in the cache and release the job's lock


def run_farm(
    jobs: Sequence[Job],
    log: Callable[[str], None],
    finished: Finished,
    *,
    keys: dict[str, Key] | None = None,
    cache: Cache | None = None,
) -> dict[str, float]:
    """Run every job on the cluster joined by `connect`; `finished(job)` once its executable is at
    `job.out`. With a `cache` whose remote store is on, and which neither signs nor trusts a key,
    workers publish each executable to the store under its key in `keys`, and the host reads it
    through the store; otherwise the bytes come back through Ray. Returns seconds per job. Raises
    FarmError naming the job, node and log."""
    ray = ray_module()
    if not jobs:
        return {}
    tasks = _tasks(jobs, keys, cache)
    resources, qualified = _qualified(ray, tasks[jobs[0].name], log)
    remote = ray.remote(work)
    ledger = ray.remote(num_cpus=0)(Ledger).remote()
    options = dict(_ray_options(), **resources)
    by_name = {job.name: job for job in jobs}
    blobs = {job.name: ray.put(job.lowered.read_bytes()) for job in jobs}
    progress = Progress(len(jobs), _cpus(ray))
    errors: dict[str, list[Result]] = {}

    def submit(name: str, avoid: str | None = None) -> None:
        opts = _placed(dict(options, name=f"deepinfer {name}"), avoid, qualified)
        pending[remote.options(**opts).remote(tasks[name], blobs[name], ledger)] = name

    pending: dict = {}
    seconds: dict[str, float] = {}
    try:
        for job in jobs:
            submit(job.name)
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=POLL_S)
            starts = _snapshot(ray, ledger)
            for ref in ready:
                name = pending.pop(ref)
                job = by_name[name]
                result = _result(ray, ref, job, starts, log)
                if result.error is not None:
                    _failed_attempt(job, result, errors)
                    progress.failed_attempt()
                    submit(name, avoid=result.node_id)
                    continue
                _land(job, result, cache, keys)
                seconds[name] = result.seconds
                finished(job)
                log(progress.done(job, result, starts, set(pending.values())))
            if not ready and progress.changed(starts, set(pending.values())):
                log(progress.line(starts, set(pending.values())))
    finally:
        for ref in pending:
            ray.cancel(ref, force=True)
        ray.kill(ledger)
    return seconds


def _snapshot(ray, ledger) -> dict[str, list[tuple[str, str]]]:
    """The ledger's record of which attempt started on which node, or a FarmError if it does not answer."""
    try:
        return ray.get(ledger.snapshot.remote(), timeout=LEDGER_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        raise FarmError(
            f"farm: the job ledger (a Ray actor on the head node) did not answer in {LEDGER_TIMEOUT_S:g} s;"
            " the cluster is overloaded or its head node is gone"
        ) from None


def _result(ray, ref, job: Job, starts: dict[str, list[tuple[str, str]]], log: Callable[[str], None]) -> Result:
    """An attempt's result; raises where the compile stops: its worker died (SYSTEM_RETRIES + 1
    times), or the compiler refused the program (the error a local job raises: no node does better)."""
    try:
        result = ray.get(ref)
    except ray.exceptions.RayError as e:
        raise _died(job, starts.get(job.name, []), e) from None
    if result.refused is not None:
        raise _refused(job, result, log)
    return result


def _placed(opts: dict, avoid: str | None, qualified: list[str]) -> dict:
    """`opts` with a soft affinity to another qualified node than `avoid` (where a task failed), if any."""
    other = next((n for n in qualified if n != avoid), None) if avoid else None
    if other:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id=other, soft=True)
    return opts


def _failed_attempt(job: Job, result: Result, errors: dict[str, list[Result]]) -> None:
    """Record a failed attempt of `job` and its farm log; FarmError when it is not worth retrying."""
    errors.setdefault(job.name, []).append(result)
    _write_farm_log(job, errors[job.name])
    if _give_up(errors[job.name]):
        raise _failed(job, errors[job.name])


def _ray_options() -> dict:
    """Each task's Ray options: one CPU, Ray's retries for lost workers, the test hooks passed on."""
    hooks = {k: v for k, v in os.environ.items() if k.startswith(TEST_HOOK_PREFIX)}
    options: dict = {"num_cpus": 1, "max_retries": SYSTEM_RETRIES, "retry_exceptions": False}
    if hooks:
        options["runtime_env"] = {"env_vars": hooks}
    return options


def _tasks(jobs: Sequence[Job], keys: dict[str, Key] | None, cache: Cache | None) -> dict[str, Task]:
    """job name -> what its worker gets: the host's toolchain, its key and the store to publish to."""
    from deepinfer.compiler.targets import TARGETS

    toolchain = TARGETS[jobs[0].target](jobs[0].executable, jobs[0].options).toolchain()
    # signing stays on the host (the private key never travels), and a trusted key would refuse a
    # worker's unsigned entry: then the bytes come back through Ray and the host's cache signs them
    store = cache.remote if cache is not None and cache.sign is None and cache.trust is None else None
    return {job.name: _task(job, toolchain, keys, store) for job in jobs}


def _task(job: Job, toolchain: dict[str, str], keys: dict[str, Key] | None, store: Store | None) -> Task:
    key = keys.get(job.name) if keys else None
    return Task(
        name=job.name,
        target=job.target,
        executable=job.executable,
        options=job.options,
        lowered=job.lowered.name,
        out=job.out.name,
        log=job.log.name if job.log else None,
        toolchain=toolchain,
        paths={n: os.environ[n] for n in HOST_PATHS if n in os.environ},
        threads=torch_threads(),
        key=key,
        store=store if key is not None else None,
    )


def _cpus(ray) -> int:
    return max(1, int(ray.cluster_resources().get("CPU", 1)))


def _qualified(ray, task: Task, log: Callable[[str], None]) -> tuple[dict, list[str]]:
    """The toolchain check on each node before its first job: every node a job may go to must
    have the host's toolchain. Those nodes are the ones with a CPU, or, where any node declares a
    `RESOURCES` part ("neuronx_cc:<version>"), the ones declaring the host's version. Returns the
    tasks' resource options and the qualified nodes' ids; FarmError in one line naming each node
    that differs and both versions (or that declares none, or does not answer)."""
    need = next((f"{RESOURCES[k]}:{v}" for k, v in task.toolchain.items() if k in RESOURCES), None)
    alive = [n for n in ray.nodes() if n.get("Alive")]
    declared = {r: n for n in alive for r in n.get("Resources", {}) if need and r.startswith(need.split(":")[0] + ":")}
    if declared and need not in declared:
        offered = ", ".join(
            f"{r} on {_node(n['NodeManagerAddress'], n['NodeID'])}" for r, n in sorted(declared.items())
        )
        raise FarmError(
            f"farm: no node declares {need}, which the host's compile needs (declared: {offered}); "
            f"start the nodes that have it with `ray start ... --resources '{{\"{need}\": N}}'`"
        )
    wanted = need if declared else "CPU"
    nodes = [n for n in alive if n.get("Resources", {}).get(wanted, 0) >= 1]
    start = time.perf_counter()
    found = _probe(ray, task, nodes)
    log(f"farm: toolchain checked on {len(found)} node(s) ({time.perf_counter() - start:.1f} s)")
    bad = [
        f"{_node(ip, nid)} has {differences(mine, task.toolchain)}" for ip, nid, mine in found if mine != task.toolchain
    ]
    if bad:
        where = f"or declare {need} on the nodes that have it" if need else ""
        raise FarmError(f"farm: {'; '.join(bad)}; install the host's versions there{', ' + where if where else ''}")
    return ({"resources": {need: 1}} if declared else {}), [nid for _, nid, _ in found]


def _probe(ray, task: Task, nodes: list[dict]) -> list[tuple[str, str, dict[str, str]]]:
    """Each node's (IP, id, toolchain), from a task pinned there (no CPU: it runs beside busy jobs)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    remote = ray.remote(probe)
    refs = {
        remote.options(
            num_cpus=0,
            name="deepinfer toolchain check",
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=n["NodeID"], soft=False),
        ).remote(task.target, task.executable, task.options, task.threads): n
        for n in nodes
    }
    ready, late = ray.wait(list(refs), num_returns=len(refs), timeout=PROBE_TIMEOUT_S)
    if late:
        silent = ", ".join(_node(refs[r]["NodeManagerAddress"], refs[r]["NodeID"]) for r in late)
        for ref in late:
            ray.cancel(ref, force=True)
        raise FarmError(f"farm: {silent} did not answer the toolchain check in {PROBE_TIMEOUT_S:g} s")
    return [ray.get(r) for r in refs]


def _refused(job: Job, result: Result, log: Callable[[str], None]) -> DeepinferError:
    """The compiler's refusal from a worker as a local job raises it, its log at `job.log`."""
    assert result.refused is not None
    if result.log is not None and job.log is not None:
        job.log.parent.mkdir(parents=True, exist_ok=True)
        job.log.write_bytes(result.log)
    log(f"farm: {job.name} refused by the compiler on {_node(result.node, result.node_id)}")
    return with_message(result.refused, str(result.refused).replace(WORKER_LOG, str(job.log or "no log kept")))


def _land(job: Job, result: Result, cache: Cache | None, keys: dict[str, Key] | None) -> None:
    """Put the executable at job.out (through the store, or from the bytes) and check its digest."""
    if result.log is not None and job.log is not None:
        job.log.parent.mkdir(parents=True, exist_ok=True)
        job.log.write_bytes(result.log)
    if result.data is None:
        if cache is None or keys is None or not cache.get_file("executable", keys[job.name], job.out):
            raise FarmError(
                f"farm: {_what(job)}: compiled on {_node(result.node, result.node_id)} and published, "
                "but the store does not hand it back; check the store's credentials on the workers"
            )
    else:
        job.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = job.out.with_name(f".{job.out.name}.farm-{os.getpid()}")
        tmp.write_bytes(result.data)
        os.replace(tmp, job.out)
    got = sha256_file(job.out)
    if got != result.digest:
        job.out.unlink(missing_ok=True)
        raise FarmError(
            f"farm: {_what(job)}: the executable from {_node(result.node, result.node_id)} arrived with "
            f"digest {got[:23]}, not the {result.digest[:23]} it was compiled with; compile again"
        )


def _give_up(errors: list[Result]) -> bool:
    return len(errors) >= ATTEMPTS or len({r.error for r in errors}) < len(errors)


def _what(job: Job) -> str:
    """The region and bucket a job builds, for messages."""
    if job.exe is None:
        return f"executable {job.name}"
    e = job.exe
    context = f", context {e.context}" if e.context is not None else ""
    return f"region {e.kind} ({e.method}), bucket batch {e.batch} x tokens {e.tokens}{context}"


def _node(ip: str, node_id: str) -> str:
    return f"node {ip} (id {node_id[:12]})"


def _farm_log(job: Job) -> Path | None:
    return job.log.with_name(f"{job.name}.farm.log") if job.log is not None else None


def _write_farm_log(job: Job, errors: list[Result]) -> None:
    """Every failed attempt's node and traceback, beside the compiler's log (kept on failure)."""
    path = _farm_log(job)
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "".join(
            f"attempt {i} on {_node(r.node, r.node_id)}, {r.seconds:.1f} s:\n{r.trace}\n"
            for i, r in enumerate(errors, 1)
        )
    )


def _failed(job: Job, errors: list[Result]) -> FarmError:
    last = errors[-1]
    how = "twice the same way" if len({r.error for r in errors}) < len(errors) else f"{len(errors)} times"
    nodes = ", ".join(dict.fromkeys(_node(r.node, r.node_id) for r in errors))
    tail = (last.error or "").strip().splitlines()[-1][:300] if last.error else ""
    logs = [str(p) for p in (_farm_log(job), job.log) if p is not None and p.is_file()]
    return FarmError(f"farm: {_what(job)} failed {how} on {nodes}: {tail}; log: {', '.join(logs) or 'none kept'}")


def _died(job: Job, starts: list[tuple[str, str]], e: Exception) -> FarmError:
    nodes = ", ".join(dict.fromkeys(_node(ip, nid) for ip, nid in starts)) or "no node (it never started)"
    first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
    return FarmError(
        f"farm: {_what(job)}: its worker died {len(starts)} time(s), on {nodes} ({type(e).__name__}: {first}); "
        "see the nodes' Ray logs (/tmp/ray/session_latest/logs)"
    )


class Progress:
    """One line per update, every node's figures in it: done, running, queued, retried, ETA, and
    per node what is done and running there."""

    def __init__(self, total: int, cpus: int) -> None:
        self.total, self.cpus = total, cpus
        self.start = time.perf_counter()
        self.finished: list[tuple[str, str]] = []  # (node label) per job done
        self.raised = 0  # attempts that failed with an error (each run again, or the compile fails)
        self.last: tuple = ()

    def failed_attempt(self) -> None:
        self.raised += 1

    def done(self, job: Job, result: Result, starts, pending: set[str]) -> str:
        self.finished.append((result.node, result.node_id))
        head = f"farm [{len(self.finished)}/{self.total}] compiled {job.name} on {_label(result.node, result.node_id)} ({result.seconds:.1f} s)"
        return f"{head}; {self._figures(starts, pending)}"

    def changed(self, starts, pending: set[str]) -> bool:
        now = (self._figures(starts, pending, eta=False),)
        if now == self.last:
            return False
        self.last = now
        return True

    def line(self, starts, pending: set[str]) -> str:
        return f"farm [{len(self.finished)}/{self.total}] {self._figures(starts, pending)}"

    def _figures(self, starts, pending: set[str], eta: bool = True) -> str:
        running: dict[str, int] = {}
        for name in pending:
            if starts.get(name):
                label = _label(*starts[name][-1])
                running[label] = running.get(label, 0) + 1
        done: dict[str, int] = {}
        for ip, nid in self.finished:
            done[_label(ip, nid)] = done.get(_label(ip, nid), 0) + 1
        n_running = sum(running.values())
        retried = sum(max(0, len(s) - 1) for s in starts.values())
        figures = f"{n_running} running, {len(pending) - n_running} queued, {self.raised} failed, {retried} retried"
        if eta:
            figures += f", ETA {self._eta()}"
        nodes = "; ".join(
            f"{label} {done.get(label, 0)} done {running.get(label, 0)} running" for label in sorted({*done, *running})
        )
        return f"{figures}" + (f" | {nodes}" if nodes else "")

    def _eta(self) -> str:
        n = len(self.finished)
        if n == 0:
            return "?"
        left = (time.perf_counter() - self.start) / n * (self.total - n)
        return f"{left:.0f} s"


def _label(ip: str, node_id: str) -> str:
    return f"{ip}/{node_id[:8]}"
