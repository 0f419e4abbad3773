"""A multi-rank bundle's processes started once, generating many batches: `start(bundle, options)`.

`runtime.generate` on a multi-rank bundle starts its ranks, runs one batch and ends them
(`ranks.generate_ranks`): most of that is starting the processes and loading the bundle on every
rank. A caller with many batches for one bundle (the rank tests, a benchmark) starts them once here:
`Ranks.generate` runs a batch on the started ranks and returns what `generate_ranks` returns (the
bytes and seconds of that batch's collectives alone), `close` ends them.

Every rank is a process of its own (the leader too: this process joins no process group, so several
bundles' ranks can be started side by side), told what to do next through its own queue; between
batches the ranks wait on that queue, not in a collective (no collective timeout while idle). The
ranks exit when this process is gone (runtime/liveness.py).
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch.distributed as dist

from deepinfer.errors import DeepinferError
from deepinfer.regions.stepper import Drafter
from deepinfer.runtime import liveness
from deepinfer.runtime.bundle import Bundle
from deepinfer.runtime.executor import Stats
from deepinfer.runtime.generation import generate_loaded
from deepinfer.runtime.liveness import collect, watch_launcher
from deepinfer.runtime.options import LoadOptions, RunOptions
from deepinfer.runtime.ranks import completions, follower_result, leader_result, load_rank
from deepinfer.runtime.requests import Completions

LAUNCHER = "the process that started the ranks (runtime.launch)"
FOLLOW = "follow"  # what a follower is told for each batch: run the leader's steps until it ends them


class Ranks:
    """The started ranks of one bundle (`start`): `generate` as often as wanted, then `close`."""

    def __init__(self, bundle: Path, world: int, options: LoadOptions, *, timeout_s: float):
        import torch.multiprocessing as mp

        self.bundle, self.world = bundle, world
        self._tmp = tempfile.TemporaryDirectory(prefix="deepinfer-ranks-")
        rendezvous = str(Path(self._tmp.name) / "rendezvous")
        ctx = mp.get_context("spawn")
        self._results = ctx.Queue()
        self._commands = [ctx.Queue() for _ in range(world)]
        ends, self._alive = ctx.Pipe(duplex=False)  # never written: closed when this process ends
        self.procs = [
            ctx.Process(
                target=_rank_loop,
                args=(r, world, rendezvous, str(bundle), options, self._commands[r], self._results, ends),
                daemon=True,
            )
            for r in range(world)
        ]
        for p in self.procs:
            p.start()
        ends.close()
        self._closed = False
        try:
            self._collect(timeout_s)  # every rank loaded, or the first one's error
        except BaseException:
            self.close()
            raise

    def generate(
        self, prompts: Sequence[list[int]], options: RunOptions, *, drafter: Drafter | None = None
    ) -> Completions:
        """Greedy generation of `prompts` on the started ranks, as `runtime.generate` on the bundle
        (the load options are the ones the ranks were started with; `drafter`: as `generate_loaded`'s)
        -> the completions with this batch's `stats`, `sent`, `seconds` and `pools`. A rank that dies
        or fails ends the batch with that rank's error (and these ranks are then no longer usable)."""
        if self._closed:
            raise DeepinferError(f"{self.bundle}: its ranks were closed")
        self._commands[0].put((list(prompts), options, drafter))
        for queue in self._commands[1:]:
            queue.put(FOLLOW)
        return completions(self._collect(options.timeout_s))

    def close(self, timeout_s: float = 30.0) -> None:
        """End the rank processes (at most `timeout_s` each before they are killed)."""
        if self._closed:
            return
        self._closed = True
        for queue in self._commands:
            queue.put(None)
        for p in self.procs:
            p.join(timeout=timeout_s)
            if p.is_alive():
                p.kill()
                p.join(timeout=timeout_s)
        self._alive.close()
        self._tmp.cleanup()

    def __enter__(self) -> Ranks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _collect(self, timeout_s: float) -> list[dict]:
        items = collect(self.procs, self._results, timeout_s)
        errors = [f"rank {i['rank']}: {i['error']}" for i in items if "error" in i]
        if errors:  # the other ranks wait in the rendezvous or a collective: killed at once
            liveness.end(self.procs, ok=False)
            self.close(timeout_s=10.0)
            raise DeepinferError(errors[0])
        return items


def start(bundle: Bundle, options: LoadOptions, *, timeout_s: float = 3600.0) -> Ranks:
    """Start one process per rank of an opened multi-rank `bundle` on this host (gloo) and load it on
    each, as `options` say; returns once every rank is loaded (at most `timeout_s`), or raises the first
    rank's error."""
    world = bundle.manifest.topology.world_size
    if world < 2:
        raise DeepinferError(f"{bundle.path}: a one-rank bundle; load it with runtime.load")
    return Ranks(bundle.path, world, options.load_options(), timeout_s=timeout_s)


def _rank_loop(
    rank: int, world: int, rendezvous: str, bundle: str, options: LoadOptions, commands, results, launcher
) -> None:
    """One rank: load the bundle, report so, then run each batch it is told until told None."""
    watch_launcher(launcher, rank, LAUNCHER)
    try:
        executor = load_rank(rank, world, rendezvous, bundle, options)
        liveness.loaded(rank)
        comm = executor.comm
        assert comm is not None  # load_rank gives every rank its Comm
        results.put({"rank": rank, "loaded": True})
        while (command := commands.get()) is not None:
            if comm.leader:
                prompts, run, drafter = command
                results.put(leader_result(executor, generate_loaded(executor, prompts, run, drafter=drafter)))
            else:
                executor.follow(Stats())
                results.put(follower_result(executor))
            comm.sent.clear()  # each batch reports its own bytes and seconds
            comm.seconds.clear()
    except BaseException as e:  # the caller reports the first failure, in one line
        results.put({"rank": rank, "error": f"{type(e).__name__}: {e}"})
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
