"""Ranks over torch.distributed: collectives at region boundaries, leader and followers.

One process per rank (gloo on CPU; the Neuron process group on Trn2), launched
by `deepinfer-run` itself or by torchrun. Rank 0 leads: it schedules every step
and broadcasts the step's host metadata (tokens, positions, slots, block
tables, engram hashes) for each token group; followers run the steps they are
sent and never sample. Collectives (regions/topology.py for the layout):

    attention,          all-reduce of the float32 partial streams over the token group (the
    tp * cp > 1         heads divided over it; the DSpark draft's over the tp group); divided
                        over cp, one all-gather of the ranks' query rows after `query`
    MoE, ep > 1         tokens replicated in the EP group: one all-reduce of the float32
                        partials; otherwise dispatch = one all-gather of packed uint8 rows
                        (h, pre, is_image as bytes) and combine = one float32 reduce-scatter;
                        a prompt chunk divided by rows: dispatch = one all-gather of each rank's
                        rows' x and routing (`routes`), combine = one reduce-scatter of the
                        D-wide float32 partials to each rank's rows
    engram, tp * cp > 1 all-reduce of the float32 partial keys and value over the token group
                        (its projection's input columns divided over the group), mid-region; a
                        prompt chunk divided by rows: one reduce-scatter of every row's partials
                        to each rank's rows (`scatter`)
    head                one all-gather of every rank's logits slice [B, T, rows] (the head is
                        split by vocabulary over each token group); a group's slices side by
                        side, the padding rows dropped, are its logits [B, T, V] for the
                        leader's sampler
    draft tokens        per block position, one all-gather of each rank's best (value, index)
                        of its vocabulary slice (`picks`, regions/picking.py): the draft's
                        logits are gathered only where asked for (runtime/draft.py)
    greedy steps        where every row is greedy and no request needs the logits (the
                        scheduler says, `Stepper.run(greedy=True)`), one all-gather of each
                        rank's best (value, index) of its slice per row (`greedy`) instead of
                        the logits'

Large float32 collectives run in chunks of at most `chunk_bytes` per rank.
Every collective counts the bytes this rank sends (`Comm.sent`).
"""

from __future__ import annotations

import os
import tempfile
import time
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from deepinfer.bundles.signing import trusted
from deepinfer.bundles.topology import Topology
from deepinfer.errors import DeepinferError
from deepinfer.regions import divided
from deepinfer.regions.stepper import Greedy
from deepinfer.runtime import liveness
from deepinfer.runtime.bundle import Bundle, open_bundle
from deepinfer.runtime.executor import Executor, Stats
from deepinfer.runtime.generation import generate_loaded
from deepinfer.runtime.liveness import FollowerWatch, collect, ignore_interrupts, say, watch_launcher
from deepinfer.runtime.loading import load
from deepinfer.runtime.neuron import collectives
from deepinfer.runtime.options import CHUNK_BYTES, COLLECTIVE_TIMEOUT_S, LoadOptions, RunOptions
from deepinfer.runtime.requests import Completions

DRAFT_PICKS = "draft pick all-gather"  # the draft's (value, index) pairs, P a draft step (`Comm.picks`)
GREEDY_PICKS = "greedy pick all-gather"  # a greedy step's (value, index) pairs, a row each (`Comm.argmax_pairs`)
DRAFT_ATTENTION_SUM = "draft attention all-reduce"  # a draft stage's partial streams over the token group


class Comm:
    """This process's rank, its groups and the collectives the session calls."""

    def __init__(self, topo: Topology, rank: int, *, chunk_bytes: int = CHUNK_BYTES):
        self.topo, self.rank, self.world = topo, rank, topo.world
        self.group = topo.group_of(rank)
        self.chunk = chunk_bytes // 4  # float32 elements per chunk
        self.cp_group = self.token_group = None
        for ranks in topo.cp_groups():  # every rank creates every subgroup, in one order  # the cp ranks that divide a group's context (regions/divided.py)
            made = dist.new_group(ranks) if topo.cp > 1 else None
            if rank in ranks:
                self.cp_group = made
        for ranks in topo.token_groups():  # the attention's partial streams, the engram's keys and value
            made = dist.new_group(ranks) if topo.group_size > 1 else None
            if rank in ranks:
                self.token_group = made
        self.sent: dict[str, int] = defaultdict(int)
        self.seconds: dict[str, float] = defaultdict(float)
        self._wire: ThreadPoolExecutor | None = None  # `start`'s one thread, made on first use

    @property
    def leader(self) -> bool:
        return self.rank == 0

    # -- host metadata ------------------------------------------------------------------------

    def step(self, message=None):
        """Leader: send the next step (`Executor.follow`'s messages: its kind and a batch per token
        group; None ends the run). Follower: receive it. Returns the message."""
        box = [message]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    # -- region boundaries --------------------------------------------------------------------

    def after(self, slot: str, out: list, dtype: torch.dtype, kind: str) -> list:
        """Combine a region's (of `kind`) outputs over its group (the attention's over the token group,
        the draft's too, MoE with ep, the engram's partial keys and value over the token group): as
        regions/topology.boundary_reduce says."""
        if slot == "engram" and self.topo.group_size > 1:  # its `kv`: float32 into `mix`
            return [self._all_reduce(out[0], "engram all-reduce", self.token_group), *out[1:]]
        if slot == "attn" and self.topo.group_size > 1:  # the target's heads or the draft's
            name = "attention all-reduce" if kind.startswith("attn") else DRAFT_ATTENTION_SUM
            return [self._all_reduce(out[0], name, self.token_group).to(dtype), *out[1:]]
        if slot == "moe" and self.topo.ep > 1:
            if self.topo.dispatch:
                B = out[0].shape[0] // self.world
                own = slice(self.rank * B, (self.rank + 1) * B)
                return [self._reduce_scatter(out[0]).to(dtype), out[1][own]]
            return [self._all_reduce(out[0], "ep all-reduce", None).to(dtype), *out[1:]]
        return out

    # -- the divided attention's merges (regions.step.Merge; regions/divided.py defines them) --------

    def queries(self, query: torch.Tensor) -> torch.Tensor:
        """Every cp rank's query rows (its heads' queries, its rows of the indexer's), one all-gather."""
        (got,) = self._cp_gather((query,), "cp query all-gather")
        return got

    def topk(self, values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Every cp rank's K best (score, global index) gathered, the K best of them kept."""
        return divided.merge_topk(*self._cp_gather((values, index), "cp selection all-gather"))

    def blocks(self, values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """The candidate pool's blocks: every cp rank's best gathered, the best of them kept."""
        return divided.merge_blocks(*self._cp_gather((values, index), "cp selection all-gather"))

    def attention(self, numerator: torch.Tensor, top: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
        """Log-sum-exp merge of the cp ranks' partial attention, as `divided.merge_attention`: the
        maxima all-gathered (small), then each rank's numerator and sum scaled by exp(max - global
        max) and summed with one float32 all-reduce."""
        start = time.perf_counter()
        (tops,) = self._cp_gather((top,), "cp attention max all-gather")
        numerator, total = divided.attention_scale(numerator, top, total, tops.amax(0))
        summed = self._all_reduce(
            torch.cat((numerator.flatten(), total.flatten())), "cp attention all-reduce", self.cp_group
        )
        n = numerator.numel()
        out = divided.attention_divide(summed[:n].view_as(numerator), summed[n:].view_as(total))
        self.seconds["cp attention merge"] += time.perf_counter() - start
        return out

    def _cp_gather(self, tensors: tuple[torch.Tensor, ...], name: str) -> list[torch.Tensor]:
        """Each tensor gathered over the cp group -> [cp, *shape] each."""
        start = time.perf_counter()
        out = []
        for tensor in tensors:
            t = tensor.contiguous()
            got = torch.empty((self.topo.cp * t.shape[0], *t.shape[1:]), dtype=t.dtype)  # ranks along dim 0
            dist.all_gather_into_tensor(got, t, group=self.cp_group)
            self.sent[name] += t.numel() * t.element_size()
            out.append(got.view(self.topo.cp, *t.shape))
        self.seconds[name] += time.perf_counter() - start
        return out

    def start(self, fn, args: tuple) -> Future:
        """Start collective `fn(*args)` on this rank's one collective thread and return at once (a
        `regions.micro.Start`: a micro-batch computes while another's collective is on the wire). The
        thread runs them in the order they start, the order every rank starts them in; nothing else
        may call a collective of this rank until their results are taken."""
        if self._wire is None:
            self._wire = ThreadPoolExecutor(1, thread_name_prefix="deepinfer-collectives")
        return self._wire.submit(fn, *args)

    # -- a prompt chunk divided by rows (regions.step.Rows; tp = 1, ep = cp: the token group is the world) --

    def rows(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's rows [B, n, ...] -> the chunk's [B, cp * n, ...], one all-gather."""
        return self.rows_named(t, "rows all-gather")

    def rows_named(self, t: torch.Tensor, name: str) -> torch.Tensor:
        """`rows`, its bytes counted under `name`."""
        (got,) = self._cp_gather((t,), name)
        return torch.cat(got.unbind(0), 1)

    def pages(self, *parts: torch.Tensor) -> list[torch.Tensor]:
        """This rank's pages of a kv source's context -> every rank's [cp, ...], one all-gather each."""
        return self._cp_gather(parts, "rows context all-gather")

    def combine(self, partial: torch.Tensor) -> torch.Tensor:
        """The MoE's float32 partials [B, T, D] over every row of the chunk -> this rank's rows [B, T / cp, D],
        summed over the ranks: one reduce-scatter (the rows put rank-major first)."""
        return self.scatter(partial, "ep combine reduce-scatter")

    def scatter(self, partial: torch.Tensor, name: str) -> torch.Tensor:
        """Float32 partials [B, T, ...] over every row of a divided chunk -> this rank's rows [B, T / cp,
        ...] summed over the ranks, one reduce-scatter counted as `name`."""
        B, T = partial.shape[:2]
        by_rank = partial.unflatten(1, (self.world, T // self.world)).movedim(1, 0)  # [world, B, T / world, ...]
        return self._reduce_scatter(by_rank.flatten(0, 1), name)

    def routes(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor):
        """Every rank's rows of the MoE's input x [B, n, D] and routing (weights [B, n, k] float32,
        experts [B, n, k]) -> the chunk's [B, cp * n, ...]: one all-gather of the rows packed as bytes."""
        parts = (x, weights, experts)
        widths = [t.shape[-1] * t.element_size() for t in parts]
        packed = torch.cat([t.contiguous().view(torch.uint8) for t in parts], -1)  # [B, n, bytes]
        rows = self.rows_named(packed, "ep dispatch all-gather")
        out, at = [], 0
        for t, width in zip(parts, widths):
            out.append(rows[..., at : at + width].contiguous().view(t.dtype))
            at += width
        return tuple(out)

    def dispatch(self, h: torch.Tensor, pre: torch.Tensor, is_image: torch.Tensor):
        """Every rank's (h, pre, is_image) rows, gathered with one all-gather of packed bytes."""
        start = time.perf_counter()
        B, T = h.shape[:2]
        parts = [
            h.contiguous().view(B, T, -1).view(torch.uint8),
            pre.contiguous().view(torch.uint8),
            is_image.contiguous().view(torch.uint8).unsqueeze(-1),
        ]
        widths = [p.shape[-1] for p in parts]
        rows = torch.cat(parts, dim=-1).reshape(B * T, -1)  # [rows, bytes]
        out = torch.empty((self.world * rows.shape[0], rows.shape[1]), dtype=torch.uint8)
        dist.all_gather_single(out, rows)
        self.sent["ep dispatch all-gather"] += rows.numel()
        self.seconds["ep dispatch all-gather"] += time.perf_counter() - start
        out = out.view(self.world * B, T, -1)
        h_bytes, pre_bytes, _ = widths
        hs = out[..., :h_bytes].contiguous().view(h.dtype).view(self.world * B, *h.shape[1:])
        ps = out[..., h_bytes : h_bytes + pre_bytes].contiguous().view(pre.dtype).view(self.world * B, *pre.shape[1:])
        images = out[..., h_bytes + pre_bytes].bool()
        return hs, ps, images

    def gather_logits(self, logits: torch.Tensor, vocab: int, name: str = "logits all-gather") -> list[torch.Tensor]:
        """This rank's slice of its group's logits [B, T, rows] -> each token group's logits
        [B, T, vocab], on every rank: one all-gather of the slices (counted as `name`); a group's ranks
        hold its vocabulary in rank order, the rows past `vocab` are padding (regions/topology.head_rows)."""
        start = time.perf_counter()
        B, T, rows = logits.shape
        out = torch.empty((self.world * B, T, rows), dtype=logits.dtype)
        dist.all_gather_single(out, logits.contiguous())
        self.sent[name] += logits.numel() * logits.element_size()
        self.seconds[name] += time.perf_counter() - start
        groups, size = self.topo.groups, self.topo.group_size
        slices = out.view(groups, size, B, T, rows).permute(0, 2, 3, 1, 4)  # [groups, B, T, size, rows]
        whole = slices.reshape(groups, B, T, size * rows)[..., :vocab]  # [groups, B, T, V]
        return [g.contiguous() for g in whole.unbind(0)]

    def picks(
        self, value: torch.Tensor, index: torch.Tensor, name: str = DRAFT_PICKS
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's best of its vocabulary slice for each row (value [...] float32, global index
        [...], any leading shape) -> every rank's (values [world, ...], indices [world, ...] int64),
        rank-major: one all-gather of the pairs packed as int32 (8 bytes a row; an index fits: the
        vocabulary is under 2^31), counted as `name` (regions/picking.py)."""
        start = time.perf_counter()
        packed = torch.stack((value.float().view(torch.int32), index.to(torch.int32)), -1).reshape(-1, 2)
        out = torch.empty((self.world * packed.shape[0], 2), dtype=torch.int32)
        dist.all_gather_single(out, packed.contiguous())
        self.sent[name] += packed.numel() * packed.element_size()
        self.seconds[name] += time.perf_counter() - start
        out = out.view(self.world, *value.shape, 2)
        return out[..., 0].contiguous().view(torch.float32), out[..., 1].long()

    def argmax_pairs(self, logits: torch.Tensor, vocab: int) -> list[Greedy]:
        """A step where every row is greedy and no request needs the logits: this rank's slice of its
        group's logits [B, T, rows] -> each token group's choices (`Greedy`: tokens and values [B, T]),
        on every rank. Each rank takes its slice's best (value, global index) per row
        (`regions.picking.slice_best`: NaN where a logit of its slice is not finite) and only these
        pairs are all-gathered (8 bytes a row, "greedy pick all-gather"), merged per group into the
        one-rank argmax (`merge_best`): the logits [B, T, V] never cross ranks."""
        from deepinfer.regions.picking import slice_best

        first = (self.rank % self.topo.group_size) * logits.shape[-1]  # this rank's place in its group's vocabulary
        return self.best_pairs(*slice_best(logits, first, vocab))

    def best_pairs(self, value: torch.Tensor, index: torch.Tensor) -> list[Greedy]:
        """This rank's best (value, global index) of its slice for each row [B, T] (`slice_best`, or
        the head's `best` in its graph) -> each token group's choices: one all-gather of the pairs, merged
        per group into the one-rank argmax (`merge_best`)."""
        from deepinfer.regions.picking import merge_best

        size = self.topo.group_size
        values, indices = self.picks(value, index, GREEDY_PICKS)  # [world, B, T]
        out = []
        for g in range(self.topo.groups):
            value, token = merge_best(values[g * size : (g + 1) * size], indices[g * size : (g + 1) * size])
            out.append(Greedy(token, value))
        return out

    # -- float32 collectives in chunks --------------------------------------------------------

    def _all_reduce(self, x: torch.Tensor, name: str, group) -> torch.Tensor:
        start = time.perf_counter()
        flat = x.float().contiguous().view(-1).clone()
        for i in range(0, flat.numel(), self.chunk):
            piece = flat[i : i + self.chunk]
            dist.all_reduce(piece, group=group)
        self.sent[name] += flat.numel() * 4
        self.seconds[name] += time.perf_counter() - start
        return flat.view(x.shape)

    def _reduce_scatter(self, x: torch.Tensor, name: str = "ep combine reduce-scatter") -> torch.Tensor:
        """x [world * B, ...] float32 partials -> this rank's rows [B, ...], summed over ranks."""
        start = time.perf_counter()
        per = x.float().contiguous().view(self.world, -1)
        out = torch.empty(per.shape[1], dtype=torch.float32)
        for i in range(0, per.shape[1], self.chunk):
            piece = out[i : i + self.chunk]
            dist.reduce_scatter_single(piece, per[:, i : i + self.chunk].contiguous().view(-1))
        self.sent[name] += per.numel() * 4
        self.seconds[name] += time.perf_counter() - start
        return out.view(x.shape[0] // self.world, *x.shape[1:])


# --- launching ----------------------------------------------------------------------------------


def init(
    rank: int, world: int, rendezvous: str | Path | None = None, *, timeout_s: float = COLLECTIVE_TIMEOUT_S
) -> dist.Store:
    """Join the process group (gloo on CPU). `rendezvous`: a file path the ranks of one run share
    (no port to pick, so none to race for); without it, torchrun's environment (env://).
    Every collective fails after `timeout_s` rather than hang on a dead rank. Returns the store the
    ranks met through (init_process_group's own, made here so the ranks can leave markers in it:
    `collectives.prepare`)."""
    method = f"file://{Path(rendezvous).resolve()}" if rendezvous is not None else "env://"
    timeout = timedelta(seconds=timeout_s)
    store, rank, world = next(dist.rendezvous(method, rank, world, timeout=timeout))
    store.set_timeout(timeout)
    # the process group's keys under the prefix init_process_group gives them when it makes the store
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("default_pg", store), rank=rank, world_size=world, timeout=timeout
    )
    return store


def torchrun_rank() -> tuple[int, int] | None:
    """(rank, world) when started by torchrun, else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


def load_here(opened: Bundle, launched: tuple[int, int] | None, options: LoadOptions) -> Executor | None:
    """Load an opened bundle in this process: the one rank, or under torchrun (`launched`, from
    `torchrun_rank`) the rank torchrun made this process -> its executor (the leader's); a follower
    runs the leader's steps until it ends, then this returns None."""
    comm = None
    if launched is not None:
        rank, _ = launched
        timeout_s = options.collective_timeout_s
        store = init(rank, opened.manifest.topology.world_size, timeout_s=timeout_s)
        # rank 0 as the others reach it: the host torchrun names for the process group's store
        collectives.prepare(opened.manifest, rank, store, host=os.environ["MASTER_ADDR"], timeout_s=timeout_s)
        comm = Comm(opened.manifest.topology.topology, rank, chunk_bytes=options.chunk_bytes)
    executor = load(opened, num_kv_blocks=options.num_kv_blocks, rank=comm.rank if comm else 0, comm=comm)
    if comm is not None and not comm.leader:
        executor.follow(Stats())
        return None
    return executor


def load_rank(rank: int, world: int, rendezvous: str, bundle: str, options: LoadOptions, report=None) -> Executor:
    """Join the ranks' process group and load `bundle` as `rank` (its executor holds the Comm). The
    caller destroys the process group. `report`: where a collective that never completes is reported
    before the process ends (`collectives.prepare`; default stderr)."""
    if options.threads:
        torch.set_num_threads(options.threads)
    store = init(rank, world, rendezvous, timeout_s=options.collective_timeout_s)
    opened = open_bundle(bundle, verify=options.verify, trust=trusted(options.trust), rank=rank)
    collectives.prepare(
        opened.manifest,
        rank,
        store,
        host=collectives.LOCAL_HOST,
        timeout_s=options.collective_timeout_s,
        report=report,
    )
    comm = Comm(opened.manifest.topology.topology, rank, chunk_bytes=options.chunk_bytes)
    return load(opened, rank=rank, comm=comm, num_kv_blocks=options.num_kv_blocks)


def _rank_main(
    rank: int, world: int, rendezvous: str, bundle: str, prompts, options: RunOptions, results, launcher
) -> None:
    watch_launcher(launcher, rank, "deepinfer-run (which started the ranks)")

    def report(error: Exception) -> None:  # from the arrival watch, which then ends this process
        results.put({"rank": rank, "error": f"{type(error).__name__}: {error}"})
        results.close()
        results.join_thread()  # flushed to the parent first

    try:
        executor = load_rank(rank, world, rendezvous, bundle, options.load_options(), report)
        liveness.loaded(rank)
        comm = executor.comm
        assert comm is not None  # load_rank gives every rank its Comm
        if comm.leader:
            results.put(leader_result(executor, generate_loaded(executor, prompts, options)))
        else:
            executor.follow(Stats())
            results.put(follower_result(executor))
    except BaseException as e:  # the parent reports the first failure, in one line
        results.put({"rank": rank, "error": f"{type(e).__name__}: {e}"})
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def leader_result(executor: Executor, outs: Completions) -> dict:
    """What the leader's process reports of a run: its completions (logits as numpy: tensors would
    travel as shared memory of a process that may exit), stats, and its collectives' bytes and seconds."""
    comm = executor.comm
    assert comm is not None  # load_rank gives every rank its Comm
    logits = [[row.numpy() for row in out.logits] for out in outs]
    for out in outs:
        out.logits = []
    return {
        "outs": list(outs),
        "logits": logits,
        "stats": outs.stats,
        "speculation": outs.speculation,
        "steps": outs.steps,
        "sent": dict(comm.sent),
        "seconds": dict(comm.seconds),
        "pools": _pool_bytes(executor),
    }


def follower_result(executor: Executor) -> dict:
    """What a follower's process reports of a run: the bytes its collectives sent, its pools."""
    comm = executor.comm
    assert comm is not None  # load_rank gives every rank its Comm
    return {"rank": comm.rank, "sent": dict(comm.sent), "pools": _pool_bytes(executor)}


def completions(items: list[dict]) -> Completions:
    """Every rank's report of one run (`leader_result`, `follower_result`) -> the leader's completions
    with their `stats`, `sent` ({rank: {collective: bytes}}), `seconds` and `pools`; the first rank's
    error, if any, raised."""
    errors = [f"rank {i['rank']}: {i['error']}" for i in items if "error" in i]
    if errors:
        raise DeepinferError(errors[0])
    leader = next(i for i in items if i.get("rank", 0) == 0)
    for out, rows in zip(leader["outs"], leader["logits"]):
        out.logits = [torch.from_numpy(row) for row in rows]
    sent = {i.get("rank", 0): i["sent"] for i in items}
    pools = {i.get("rank", 0): i["pools"] for i in items}
    return Completions(
        leader["outs"],
        speculation=leader["speculation"],
        steps=leader["steps"],
        stats=leader["stats"],
        sent=sent,
        seconds=leader["seconds"],
        pools=pools,
    )


def _pool_bytes(executor: Executor) -> dict[str, int]:
    """The bytes of each state pool this rank allocated (a host tensor, or on trn2 a device stack)."""
    return {
        name: t.numel() * t.element_size() if isinstance(t, torch.Tensor) else t.rows * t.row_bytes
        for name, t in executor.pools.items()
    }


LEADER = "the leader (rank 0, deepinfer-serve)"


def _follower_main(rank: int, world: int, rendezvous: str, bundle: str, options: LoadOptions, leader) -> None:
    """A follower rank of a leader in another process (`Leader`): run its steps until it sends None;
    exits with one line when the leader is gone (`leader`, the read end of its pipe) or a step fails."""
    ignore_interrupts()
    watch_launcher(leader, rank, LEADER)
    try:
        executor = load_rank(rank, world, rendezvous, bundle, options)
        liveness.loaded(rank)
        executor.follow(Stats())
    except Exception as e:  # one line; the leader's watch names this rank as it ends
        if liveness.closed(leader, 1.0):  # the leader died: that is the news, not the broken collective
            liveness.launcher_gone(rank, LEADER)
        say(f"error: rank {rank}: {type(e).__name__}: {e}")
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class Leader:
    """This process as rank 0 of a multi-rank bundle, the followers one process each on this host
    (what `deepinfer-serve` runs: the leader schedules every step, the followers run what it sends).

    `executor` is the leader's; `close` ends the followers' loop and waits for them (at most
    `timeout_s` each before they are killed). A follower that ends before `close` ends this process
    with one line naming it, and the followers exit once this process is gone (runtime/liveness.py)."""

    def __init__(self, bundle: Path, world: int, options: LoadOptions, *, timeout_s: float = 30.0):
        import torch.multiprocessing as mp

        self.timeout_s = timeout_s
        self._tmp = tempfile.TemporaryDirectory(prefix="deepinfer-ranks-")
        rendezvous = str(Path(self._tmp.name) / "rendezvous")
        ctx = mp.get_context("spawn")
        options = options.load_options()
        ends, self._alive = ctx.Pipe(duplex=False)  # never written: closed when this process ends
        self.procs = [
            ctx.Process(target=_follower_main, args=(r, world, rendezvous, str(bundle), options, ends), daemon=True)
            for r in range(1, world)
        ]
        for p in self.procs:
            p.start()
        ends.close()
        self.watch = FollowerWatch(
            dict(enumerate(self.procs, 1)),
            what="the server stops: every step needs every rank",
            cleanup=self._tmp.cleanup,
        )
        try:
            self.executor = load_rank(0, world, rendezvous, str(bundle), options)
        except BaseException:
            self._stop()
            raise

    def close(self) -> None:
        self.watch.stop()
        try:
            comm = self.executor.comm
            assert comm is not None  # load_rank gives every rank its Comm
            comm.step(None)
        finally:
            self._stop()

    def _stop(self) -> None:
        self.watch.stop()
        for p in self.procs:
            p.join(timeout=self.timeout_s)
            if p.is_alive():
                p.kill()
                p.join(timeout=self.timeout_s)
        if dist.is_initialized():
            dist.destroy_process_group()
        self._alive.close()
        self._tmp.cleanup()


def generate_ranks(bundle: Bundle, prompts: list[list[int]], options: RunOptions) -> Completions:
    """Start one process per rank of an opened `bundle` on this host (gloo), generate on the leader.

    The whole run may take at most `options.timeout_s`; a rank that dies or fails ends it with that
    rank's error. Returns the leader's completions with its `stats`, and `sent`: {rank: {collective:
    bytes}}; `seconds`: the leader's {collective: seconds}."""
    import torch.multiprocessing as mp

    world = bundle.manifest.topology.world_size
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    ends, alive = ctx.Pipe(duplex=False)  # never written: closed when this process ends (runtime/liveness.py)
    with tempfile.TemporaryDirectory(prefix="deepinfer-ranks-") as tmp, alive:
        rendezvous = str(Path(tmp) / "rendezvous")
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(r, world, rendezvous, str(bundle.path), prompts, options, results, ends),
                daemon=True,
            )
            for r in range(world)
        ]
        for p in procs:
            p.start()
        ends.close()
        items: list[dict] = []
        try:
            items = collect(procs, results, options.timeout_s)
        finally:  # a rank that died or failed: the others are killed at once (runtime/liveness.py)
            liveness.end(procs, ok=bool(items) and not any("error" in i for i in items))
    return completions(items)
