"""The compile farm's worker side (compiler/farm.py is the host's): what travels to a Ray worker,
the job function it runs, and what comes back. Imported by every worker; Ray itself only inside
the job function.
"""

from __future__ import annotations

import os
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeGuard

from deepinfer.bundles.manifest_io import sha256_file
from deepinfer.compiler.cache.keys import Key
from deepinfer.compiler.jobs import Job, run_job
from deepinfer.errors import DeepinferError

if TYPE_CHECKING:
    from deepinfer.compiler.cache.remote import Store

HOST_PATHS = ("TORCHINDUCTOR_CACHE_DIR", "TMPDIR")  # set on workers as on the host (`_host_paths`)
# Test hooks, read by the worker's job function (`work`); the host forwards them to the workers.
TEST_HOOK_PREFIX = "DEEPINFER_TEST_FARM_"
TEST_DIE_ONCE = "DEEPINFER_TEST_FARM_DIE_ONCE"  # a marker path: the first job to see it absent makes it and exits
TEST_FAIL = "DEEPINFER_TEST_FARM_FAIL"  # jobs whose name contains this raise, every attempt
WORKER_LOG = "<worker log>"  # a refusal's message names the job's log by this; the host puts its own path


class FarmError(DeepinferError):
    """--ray without Ray, a cluster that cannot be reached, or a job that failed on the farm."""


# --- what travels ------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Task:
    """One job as a worker gets it: the Job's fields without its host paths (the lowered program's
    bytes travel beside it, as a Ray object)."""

    name: str
    target: str
    executable: str
    options: dict
    lowered: str  # file names, in the worker's temp dir
    out: str
    log: str | None
    toolchain: dict[str, str]  # the host's: a worker with another refuses the job
    paths: dict[str, str]  # the host's Inductor cache dir and TMPDIR: AOTInductor bakes them into its output
    threads: int  # the host's torch threads: Inductor emits parallel loops only for more than one
    key: Key | None = None  # the executable key (a store publishes under it)
    store: Store | None = None  # publish there and return no bytes (a Store pickles as its url and endpoint)


@dataclass(frozen=True, kw_only=True)
class Result:
    name: str
    node: str  # IP
    node_id: str
    seconds: float
    digest: str = ""  # "sha256:..." of the executable
    data: bytes | None = None  # the executable (none when published to a store)
    log: bytes | None = None  # the compiler's log, where the target writes one
    error: str | None = None  # "Type: message" of a failed attempt
    trace: str = ""  # its traceback
    # the compiler refused the program (`refusal`): the error a local job raises, its log named WORKER_LOG
    refused: DeepinferError | None = None


class Ledger:
    """A Ray actor (no CPU) each attempt reports its start to: what runs where, and retries
    (Ray runs a task again after its worker dies without telling the caller)."""

    def __init__(self) -> None:
        self.starts: dict[str, list[tuple[str, str]]] = {}

    def start(self, name: str, node: str, node_id: str) -> None:
        self.starts.setdefault(name, []).append((node, node_id))

    def snapshot(self) -> dict[str, list[tuple[str, str]]]:
        return self.starts


# --- the job function -------------------------------------------------------------------------


def work(task: Task, lowered: bytes, ledger) -> Result:
    """Compile one job on this node in a temp dir of its own; failures come back as data."""
    import ray

    node, node_id = ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id()
    ray.get(ledger.start.remote(task.name, node, node_id))
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="deepinfer-farm-") as tmp:
        work = Path(tmp)
        log = work / task.log if task.log else None
        try:
            _test_hooks(task.name)
            _host_threads(task.threads)  # first: the toolchain names the threads the code is written for
            _check_toolchain(task, node)
            _host_paths(task.paths)
            (work / task.lowered).write_bytes(lowered)
            job = Job(task.name, work / task.lowered, work / task.out, task.target, task.executable, task.options, log)
            run_job(job)
            out = work / task.out
            digest = sha256_file(out)
            data = None if task.store is not None and _publish(task, out, work) else out.read_bytes()
        except Exception as e:
            message = f"{type(e).__name__}: {e}".replace(tmp, "<worker dir>")
            return Result(
                name=task.name,
                node=node,
                node_id=node_id,
                seconds=time.perf_counter() - start,
                log=_read(log),
                error=message,
                trace=traceback.format_exc(),
                refused=_refused(e, log, tmp) if refusal(e) else None,
            )
        return Result(
            name=task.name,
            node=node,
            node_id=node_id,
            seconds=time.perf_counter() - start,
            digest=digest,
            data=data,
            log=_read(log),
        )


def _read(path: Path | None) -> bytes | None:
    return path.read_bytes() if path is not None and path.is_file() else None


def _test_hooks(name: str) -> None:
    """Test hooks only (tests/cache/test_farm.py): die once, or fail a job every time."""
    marker = os.environ.get(TEST_DIE_ONCE)
    if marker:
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            pass
        else:
            os._exit(1)  # the worker dies mid-job, as when killed
    fail = os.environ.get(TEST_FAIL)
    if fail and fail in name:
        raise RuntimeError(f"{TEST_FAIL}={fail}: this job fails on purpose")


def refusal(e: Exception) -> TypeGuard[DeepinferError]:
    """The compiler rejected the program: neuronx-cc exited with an NCC error code. Every node with
    the host's toolchain rejects it the same way, so it is not run again: it comes back to the host
    as the error a local job raises (compiler/jobs.run_job), for the compile to handle as its own."""
    from deepinfer.compiler.targets.neuronxcc import NeuronRefused

    return isinstance(e, NeuronRefused)


def with_message(e: DeepinferError, message: str) -> DeepinferError:
    """`e` again (same type and attributes) with another message (a path in it replaced): an error
    whose constructor takes more than its message has them as its other args, as jobs.keep_failed_logs
    expects (a refusal's NCC code and region)."""
    again = type(e)(message, *e.args[1:])
    again.__dict__.update(e.__dict__)
    return again


def _refused(e: DeepinferError, log: Path | None, tmp: str) -> DeepinferError:
    message = str(e)
    if log is not None:
        for path in dict.fromkeys((str(log.resolve()), str(log))):
            message = message.replace(path, WORKER_LOG)
    return with_message(e, message.replace(tmp, "<worker dir>"))


def _check_toolchain(task: Task, node: str) -> None:
    """A worker compiles only with the host's toolchain: its key names the host's versions (a node
    that joined after the farm's check, `probe`, is checked here)."""
    from deepinfer.compiler.targets import TARGETS

    mine = TARGETS[task.target](task.executable, task.options).toolchain()
    if mine != task.toolchain:
        raise FarmError(f"node {node} has {differences(mine, task.toolchain)}; install the host's versions there")


def differences(mine: dict[str, str], host: dict[str, str]) -> str:
    """What a node's toolchain has where the host's differs, e.g. "neuronx-cc 2.98.0 where the host's
    compile expects 2.99.0", or "no neuronx-cc where ..."."""
    if "error" in mine:
        return f"a toolchain it cannot report ({mine['error']})"
    return ", ".join(
        f"{'no ' + k if mine.get(k) in (None, 'absent') else f'{k} {mine[k]}'} where the host's compile expects {v}"
        for k, v in host.items()
        if mine.get(k) != v
    )


def probe(target: str, executable: str, options: dict, threads: int) -> tuple[str, str, dict[str, str]]:
    """This node's IP, id and toolchain for `target`, compiled with the host's `threads` (as `work`
    compiles): compiler/farm.py checks each node with it before the first job. A toolchain that
    cannot be read (a broken compiler) comes back as {"error": one line}."""
    import ray

    from deepinfer.compiler.targets import TARGETS

    node, node_id = ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id()
    _host_threads(threads)
    try:
        return node, node_id, TARGETS[target](executable, options).toolchain()
    except DeepinferError as e:
        return node, node_id, {"error": str(e).splitlines()[0][:300]}


def _host_paths(paths: dict[str, str]) -> None:
    """Compile under the host's Inductor cache dir and TMPDIR (created here where absent): AOTInductor
    writes their paths into the generated sources and the library's debug info, so only there does a
    worker build the bytes the host would. Where they cannot be created, the node's own are kept."""
    for name, value in paths.items():
        if os.environ.get(name) == value:
            continue
        try:
            Path(value).mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        os.environ[name] = value
        if name == "TMPDIR":
            tempfile.tempdir = None  # read TMPDIR again


def _host_threads(threads: int) -> None:
    """Compile with the host's torch thread count: Inductor's C++ code generation reads it (OpenMP
    parallel loops are emitted only for more than one thread), and Ray starts a worker with one
    thread per CPU it was given, so a one-CPU worker would write single-threaded code."""
    import torch

    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def _publish(task: Task, out: Path, work: Path) -> bool:
    """Store the executable through a worker-local cache that publishes to the shared store; False
    when the store failed here (its bytes then go back through Ray)."""
    from deepinfer.compiler.cache import open_cache

    assert task.store is not None and task.key is not None
    cache = open_cache(work / "cache", remote=task.store)
    cache.put_file("executable", task.key, out)
    return cache.remote is not None and not cache.read_only  # published, or another publisher was first
