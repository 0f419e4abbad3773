"""Fetch or build: what the compile passes do with the cache for each file they make.

    trace pass     `fetch` a cached trace record whose executable the cache holds (neither traced nor
                   compiled), else trace, lower, and `store` the trace record (`trace_record` reads one)
    weights pass   `held`: lock every file's entry, fetch what the cache holds; the pass builds and
                   stores the rest before the locks are released
    compile pass   `compile_jobs`: each executable compiled at most once among the compiles sharing
                   the cache (here, in parallel, or on the Ray cluster)

A miss is logged part by part at debug verbosity and, under --require-cache, fails with why (`missed`).
The keys themselves are built in `artifact_keys.py`.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from deepinfer.bundles import manifest as mf
from deepinfer.bundles import manifest_io
from deepinfer.compiler.cache.artifact_keys import executable_key
from deepinfer.compiler.cache.entry import CacheError
from deepinfer.compiler.cache.keys import Key
from deepinfer.compiler.cache.local import Cache
from deepinfer.compiler.jobs import Job, run_job, run_jobs
from deepinfer.compiler.kill_points import kill_point
from deepinfer.compiler.plan import Exe, RegionPlan
from deepinfer.compiler.spec import Run, Spec
from deepinfer.reader import ReadError, parse_json

# --- the trace pass's fetch and store ------------------------------------------------------------


def fetch(cache: Cache, key: Key, exe: Exe, dest: Path) -> mf.Executable | None:
    """The manifest entry of a cached trace of `exe` whose executable the cache holds (copied to
    `dest`); None when either is missing."""
    record = trace_record(cache, key)
    if record is None:
        return None
    try:
        entry = manifest_io.parse_executable(record["entry"], f"cached trace record of {exe.name}")
    except mf.BundleError as e:  # a record this deepinfer cannot read: rebuilt, as any corrupt entry
        cache.reject("trace", key, str(e))
        return None
    if not cache.get_file("executable", record["executable_key"], dest):
        return None
    return entry


def trace_record(cache: Cache, key: Key) -> dict | None:
    """The cached trace record of `key` ({"executable_key": str, "entry": {...}}); None on a miss. A
    record that is not one (corrupt, of the wrong types) is reported once, removed and a miss."""
    data = cache.get_bytes("trace", key)
    if data is None:
        return None
    try:
        record = parse_json(data, "trace record")
    except ReadError as e:
        cache.reject("trace", key, str(e))
        return None
    if not (
        isinstance(record, dict)
        and isinstance(record.get("executable_key"), str)
        and isinstance(record.get("entry"), dict)
        and isinstance(record["entry"].get("scratch_bytes", 0), (int, type(None)))
    ):
        cache.reject("trace", key, "trace record of the wrong shape")
        return None
    return record


def store(
    spec: Spec, plan: RegionPlan, cache: Cache, key: Key, exe: Exe, graph: str, kernels: list[str], entry: mf.Executable
) -> Key:
    """Put the trace record of `exe` (the digest of its lowered `graph`, the `kernels` it reaches)
    in the cache under its trace `key`: its executable's key and manifest entry. Returns the
    executable key."""
    executable = executable_key(spec, plan, exe, graph, kernels)
    record = {"executable_key": executable.digest, "kernels": kernels, "entry": manifest_io.to_json(entry)}
    cache.put_bytes("trace", key, json.dumps(record).encode())
    return executable


# --- the weights pass: held entries; and a miss explained (every pass) ---------------------------


@contextlib.contextmanager
def held(run: Run, keys: dict[str, tuple[str, Key]]) -> Iterator[set[str]]:
    """Lock every file's entry (sorted: compiles sharing a cache never deadlock), fetch those the
    cache holds into the staging bundle, yield their paths; the caller builds and stores the rest
    before the locks are released, so a file is built once among concurrent compiles."""
    cache = run.cache
    fetched: set[str] = set()
    if cache is None:
        yield fetched
        return
    locks = []
    try:
        for kind, key in sorted(keys.values(), key=lambda kk: kk[1].digest):
            locks.append(cache.lock(kind, key))
        for rel, (kind, key) in keys.items():  # plan order: the first miss named is the first file
            if cache.get_file(kind, key, run.staging / rel):
                fetched.add(rel)
            else:
                missed(run, kind, key)
        yield fetched
    finally:
        for lock in locks:
            lock.release()


def missed(run: Run, kind: str, key: Key) -> None:
    """A miss: log the key's parts at debug verbosity; under --require-cache, fail with why."""
    if run.verbose:
        run.log(f"cache miss: {kind} {key.identity} {key.digest[:16]}")
        for line in key.lines():
            run.log(line)
    cache = run.cache
    if not run.require_cache or cache is None:
        return
    near = cache.closest(kind, key.identity)
    if near is None and cache.remote_url:
        why = f"neither the cache at {cache.dir} nor the store {cache.remote_url} holds a {kind} for it"
    elif near is None:
        why = f"the cache at {cache.dir} holds no {kind} for it"
    else:
        old = {p["name"]: p["hash"] for p in near.meta.get("parts", [])}
        diff = [n for n, h in key.part_hashes.items() if old.get(n) != h]
        why = (
            f"key part(s) {', '.join(diff)} differ from the cached entry {near.key[:16]} "
            f"(deepinfer cache explain {near.key[:16]} {key.digest[:16]})"
        ) + (f"; the store {cache.remote_url} holds no {kind} for it either" if cache.remote_url else "")
    raise CacheError(f"--require-cache: cache miss for {kind} {key.identity}: {why}")


# --- the compile pass: each job once among the compiles sharing the cache ----------------------


Progress = Callable[[int, int, Job, float], None]


def compile_jobs(run: Run, jobs: Sequence[Job], keys: dict[str, Key], progress: Progress) -> tuple[str, ...]:
    """Compile each job's executable once across every compile sharing the cache: the
    jobs whose lock this compile takes run here (in parallel, or on the Ray cluster of
    `run.ray`); the others are waited for and then fetched (or compiled here if their
    compile died). Returns the names of those compiled here, in the order they finished
    (without a cache: every job, in order)."""
    cache = run.cache
    if cache is None:
        if run.ray is not None:
            _on_farm(run, list(jobs), None, lambda job: None)
        else:
            run_jobs(list(jobs), run.jobs, progress)
        return tuple(job.name for job in jobs)
    mine, theirs, locks, built = [], [], {}, []
    for job in jobs:
        key = keys[job.name]
        lock = cache.lock("executable", key, blocking=False)
        if not lock.held:
            theirs.append(job)
        elif cache.get_file("executable", key, job.out):  # stored since the trace pass
            lock.release()
            run.log(f"cached {job.name}")
        else:
            locks[job.name] = lock
            mine.append(job)

    def keep(job: Job) -> None:
        cache.put_file("executable", keys[job.name], job.out)
        kill_point("compile")
        built.append(job.name)
        locks.pop(job.name).release()

    def done(i: int, total: int, job: Job, seconds: float) -> None:
        keep(job)
        progress(i, total, job, seconds)

    try:
        if run.ray is not None:
            _on_farm(run, mine, keys, keep)
        else:
            run_jobs(mine, run.jobs, done)
    finally:
        for lock in locks.values():
            lock.release()
    for i, job in enumerate(theirs, 1):
        key = keys[job.name]
        run.log(f"waiting for another compile of {job.name}")
        with cache.lock("executable", key, blocking=True):
            if cache.get_file("executable", key, job.out):
                run.log(f"cached {job.name}")
                continue
            seconds = run_job(job)
            cache.put_file("executable", key, job.out)
            built.append(job.name)
            progress(i, len(theirs), job, seconds)
    return tuple(built)


def _on_farm(run: Run, jobs: list[Job], keys: dict[str, Key] | None, keep: Callable[[Job], None]) -> None:
    """The jobs as Ray tasks (compiler/farm.py); `keep(job)` once each executable is in the staging
    bundle. With the cache's remote store, workers publish there and the host reads through it."""
    from deepinfer.compiler import farm

    farm.run_farm(jobs, run.log, keep, keys=keys, cache=run.cache)
