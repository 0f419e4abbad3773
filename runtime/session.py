"""A loaded bundle: executables, weight views, state pools; greedy generation.

Loading validates the manifest (format version, digests, target and
toolchain), memory-maps the weights, loads each executable once and binds
each layer's weights as views into the layer-major stacks. Generation runs
prompts as decode-shaped chunks padded to the nearest bucket, then one token
per step, with the same region wiring as the reference (`run_layers`).
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from deepinfer.bundles import manifest as mf
from deepinfer.bundles.safetensors import load_mmap
from deepinfer.bundles.topology import Topology
from deepinfer.regions.config import parse_config
from deepinfer.regions.engram_hash import EngramHasher
from deepinfer.regions.generate import Allocator, Generation, Row, bucket_at_least, greedy, make_batch
from deepinfer.regions.step import DTYPES, Batch, Embedding, LayerPlan, run_layers
from deepinfer.runtime.backends import check_compatible, placement_for


@dataclass
class Stats:
    calls: dict = field(default_factory=lambda: defaultdict(int))
    seconds: dict = field(default_factory=lambda: defaultdict(float))     # host time in the executable
    overhead: float = 0.0             # runtime time around region calls (argument lists, lookups)
    steps: int = 0
    step_seconds: float = 0.0
    tokens: int = 0                   # real tokens processed
    padded: int = 0                   # token slots computed (incl. padding)

    def table(self) -> list[dict]:
        total = sum(self.seconds.values()) or 1.0
        return [{"kind": k, "calls": self.calls[k], "total_ms": self.seconds[k] * 1e3,
                 "mean_us": self.seconds[k] / self.calls[k] * 1e6, "share": self.seconds[k] / total}
                for k in sorted(self.seconds, key=lambda k: -self.seconds[k])]


class Session:
    def __init__(self, bundle: Path, manifest: dict, *, num_kv_blocks: int | None = None, rank: int = 0,
                 comm=None):
        self.path, self.manifest = Path(bundle), manifest
        self.config = parse_config(manifest["model"]["config"], f"{bundle}/manifest.json")
        self.dtype = DTYPES[manifest["model"]["dtype"]]
        self.plans = [LayerPlan(layer=l["layer"], attn=l["attn"], ratio=l["ratio"], kv_source=l["kv_source"],
                                candidate_source=l["candidate_source"], uses_candidates=l["uses_candidates"],
                                engram_rows=int(l["engram"])) for l in manifest["layers"]]
        kv = manifest["kv"]
        self.block_size, self.max_blocks = kv["block_size"], kv["max_blocks"]
        self.num_blocks, self.num_slots = num_kv_blocks or kv["num_blocks"], kv["slots"]
        if kv.get("static_pools") and self.num_blocks != kv["num_blocks"]:
            raise mf.BundleError(f"{bundle}: compiled for exactly {kv['num_blocks']} KV blocks (static shapes); "
                                 f"cannot run with {self.num_blocks} (change [kv] num_blocks and recompile)")
        shapes = manifest["buckets"]["shapes"]
        self.batch_sizes = sorted({s["batch"] for s in shapes})
        self.token_sizes = sorted({s["tokens"] for s in shapes})
        self.rank = torch.tensor(rank, dtype=torch.int64)
        self.topology = Topology(*(manifest["topology"][k] for k in ("tp", "ep", "cp")))
        self.comm = comm
        self.placement = placement_for(manifest, self.path, rank)
        try:
            self._load_executables()
            self._bind_weights(rank)
            self._allocate_pools()
        except BaseException:
            self.placement.close()          # a refused load must not keep the device
            raise
        host = manifest["host"]["embed"]
        embed = load_mmap(self.path / host["path"])[host["tensor"]]
        self.embed = Embedding(embed, self.config.text.hc_mult, self.dtype)
        self.hasher = EngramHasher(self.config.text) if self.config.text.engram_layer_ids else None
        self.stats = Stats()
        # optional hook around every region call: on_call(layer, slot, kind, inputs, run) -> outputs,
        # where run() calls the executable (deepinfer/diff.py); None costs one test per call
        self.on_call = None

    # -- loading ------------------------------------------------------------------------------

    def _load_executables(self) -> None:
        self.executables, self.signatures = {}, {}
        for r in self.manifest["regions"]:
            key = (r["kind"], r["bucket"]["batch"], r["bucket"]["tokens"])
            self.executables[key] = self.placement.load(r, self.path / r["artifact"])
            self.signatures[r["kind"]] = r["inputs"]

    def _bind_weights(self, rank: int) -> None:
        """(layer, slot) -> (kind, weight views in the executable's input order)."""
        entries = self.manifest["weights"].get(f"rank-{rank}")
        if entries is None:
            raise mf.BundleError(f"{self.path}: no weights for rank {rank}")
        stacks = {e["kind"]: {name: self.placement.resident(t, f"{e['kind']}.{name}")
                              for name, t in load_mmap(self.path / e["path"]).items()} for e in entries}
        self.bound = {}
        places = [(l["layer"], slot, b) for l in self.manifest["layers"] for slot, b in l["regions"].items()]
        places.append((-1, "head", self.manifest["head"]))
        for layer, slot, b in places:
            kind, index = b["kind"], b["index"]
            views = [self.rank if s["role"] == "rank" else self.placement.view(stacks[kind][s["name"]], index)
                     for s in self.signatures[kind] if s["role"] in ("weight", "rank")]
            self.bound[(layer, slot)] = (kind, views)

    def _allocate_pools(self) -> None:
        self.pools, self.states = {}, defaultdict(dict)
        for name, pool in self.manifest["kv"]["pools"].items():
            size = self.num_blocks if pool["dim"] == "blocks" else self.num_slots
            self.pools[name] = self.placement.resident(
                torch.zeros((len(pool["layers"]), size, *pool["entry_shape"]), dtype=getattr(torch, pool["dtype"])),
                f"pool.{name}")
        for l in self.manifest["layers"]:
            for state, (pool, index) in l["state"].items():
                self.states[l["layer"]][state] = self.placement.view(self.pools[pool], index)

    def close(self) -> None:
        """Release the executables and device memory (a no-op for host bundles)."""
        self.placement.close()

    @functools.cached_property
    def vision(self):
        """The host-resident vision tower (host/vision.safetensors), loaded on first use."""
        return load_vision(self.path, self.manifest)

    # -- running ------------------------------------------------------------------------------

    def _invoke(self):
        executables, bound, stats, on_call, comm = self.executables, self.bound, self.stats, self.on_call, self.comm

        def invoke(layer: int, slot: str, *inputs):
            t0 = time.perf_counter()
            kind, weights = bound[(layer, slot)]
            if comm is not None and slot == "moe" and comm.topo.dispatch:
                inputs = comm.dispatch(*inputs)                 # every group's rows
            exe = executables[(kind, inputs[0].shape[0], inputs[0].shape[1])]
            args = weights + list(inputs)
            t1 = time.perf_counter()
            out = exe(args) if on_call is None else on_call(layer, slot, kind, inputs, lambda: exe(args))
            t2 = time.perf_counter()
            stats.calls[kind] += 1
            stats.seconds[kind] += t2 - t1
            stats.overhead += t1 - t0
            return out if comm is None else comm.after(slot, out, self.dtype)
        return invoke

    def _run(self, batch: Batch) -> torch.Tensor:
        """One step through every layer and the head -> logits [B, T, V]."""
        h, pre = self.embed(batch.tokens, batch.is_image, batch.image_rows)
        start = time.perf_counter()
        logits = run_layers(self.plans, self._invoke(), self.states, h, pre, batch)
        self.stats.step_seconds += time.perf_counter() - start
        self.stats.steps += 1
        self.stats.padded += batch.tokens.numel()
        self.stats.tokens += int((batch.positions >= 0).sum())
        return logits

    # -- what `greedy` drives ----------------------------------------------------------------------

    @property
    def groups(self) -> int:
        return self.topology.groups

    @property
    def max_batch(self) -> int:
        return self.batch_sizes[-1]

    @property
    def chunk(self) -> int:
        return self.token_sizes[-1]

    def allocator(self) -> Allocator:
        return Allocator(self.num_slots, self.num_blocks, self.block_size, self.max_blocks)

    def run(self, rows_by_group: list[list[Row]], allocs: list[Allocator], gens, images) -> list[torch.Tensor]:
        """Leader: one step of every token group, padded to the nearest bucket -> each group's logits."""
        B = bucket_at_least(self.batch_sizes, max(1, *(len(r) for r in rows_by_group)))
        T = bucket_at_least(self.token_sizes, max(len(ids) for rows in rows_by_group for _, ids, _ in rows))
        batches = [make_batch(rows, list(range(len(rows))), B, T, alloc=alloc, gens=gens, images=images,
                              hasher=self.hasher, pad=self.config.pad_token_id, dtype=self.dtype)
                   for rows, alloc in zip(rows_by_group, allocs)]
        if self.comm is None:
            return [self._run(batches[0])]
        self.comm.step(batches)
        return self.comm.gather_logits(self._run(batches[self.comm.group]))

    def serve(self) -> None:
        """Follower ranks: run the steps the leader sends until it sends None (no sampling)."""
        with torch.inference_mode():
            while (batches := self.comm.step()) is not None:
                self.comm.gather_logits(self._run(batches[self.comm.group]))

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, *, eos: int | None = None,
                 images: list | None = None) -> list[Generation]:
        """Greedy generation (on the leader with several ranks: followers `serve`); a request
        that cannot get blocks fails alone (its `error` is set). images[i] (spans.ImageEmbeds
        from `spans.with_images`, or None): prompt i's image positions and their embeddings."""
        eos = self.config.eos_token_id if eos is None else eos
        try:
            return greedy(self, prompts, max_new_tokens, eos=eos, images=images)
        finally:
            if self.comm is not None:
                self.comm.step(None)


def load_vision(bundle: Path, manifest: dict):
    """A bundle's host-resident vision tower and aligner (regions.vision, imported only here)."""
    from deepinfer.regions.vision import VisionTower, tensor_getter

    host = manifest["host"].get("vision")
    if host is None:
        raise mf.BundleError(f"{bundle}: the bundle has no vision tower (its checkpoint's "
                             "vision_config.num_hidden_layers is 0); it cannot take images")
    config = parse_config(manifest["model"]["config"], f"{bundle}/manifest.json")
    tensors = load_mmap(Path(bundle) / host["path"])
    return VisionTower(config, tensor_getter(tensors, str(Path(bundle) / host["path"])),
                       DTYPES[manifest["model"]["dtype"]], f"{bundle}/manifest.json")


def load(path: str | Path, *, num_kv_blocks: int | None = None, verify: bool = True, rank: int = 0,
         comm=None) -> Session:
    """Open a bundle: validate (format version first, files, digests, target, toolchain), then load
    it as `rank` (with `comm`, a runtime.ranks.Comm, when the bundle has several ranks)."""
    path = Path(path)
    manifest = mf.read(path)
    mf.validate(path, manifest, digests=verify)
    check_compatible(manifest, path)
    world = manifest["topology"].get("world_size", 1)
    if not 0 <= rank < world:
        raise mf.BundleError(f"{path}: rank {rank} is outside the bundle's world size {world}")
    if world > 1 and comm is None:
        raise mf.BundleError(f"{path}: a {world}-rank bundle; run it with deepinfer-run (which starts "
                             "the ranks) or under torchrun")
    return Session(path, manifest, num_kv_blocks=num_kv_blocks, rank=rank, comm=comm)
