"""What a compile builds (`Spec`) and how it runs (`Run`): what every pass and cache key takes.

The first pass, `parse`, resolves model.toml (a `CompileConfig`) and the checkpoint's config.json
into a `Spec`, frozen from then on: the model, the rank layout, the target, the state geometry,
the weight recipe. `Run` says how the compile runs (staging directory, workers, log, cache),
never what it builds, so nothing in it may reach a cache key.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from deepinfer.bundles.manifest import BEST, DECODE, HEAD_ROWS
from deepinfer.bundles.topology import Topology
from deepinfer.compiler.cache.local import Cache
from deepinfer.compiler.config import CompileConfig, config_error
from deepinfer.compiler.plan import Exe, RegionPlan
from deepinfer.compiler.targets import TARGETS, Target
from deepinfer.compiler.weights import RECIPES, Recipe
from deepinfer.errors import ConfigError
from deepinfer.regions import topology
from deepinfer.regions.config import V41Config, load_config
from deepinfer.regions.state import Geometry, check_block_size, nearest_num_blocks
from deepinfer.regions.step import DTYPES

Log = Callable[[str], None]


@dataclass(frozen=True, kw_only=True)
class Spec:
    """What a compile builds, resolved from model.toml and the checkpoint's config."""

    config: CompileConfig
    model: V41Config
    topology: Topology
    target: Target
    geometry: Geometry
    hlo_only: bool = False

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.config.model.dtype]

    @property
    def draft(self) -> bool:
        """Whether the bundle holds the checkpoint's speculative draft ([speculative] draft)."""
        return self.config.speculative.draft is not None

    @property
    def recipe(self) -> Recipe:
        """The weight recipe: [quant] recipe, or the target's own for "target"."""
        name = self.config.quant.recipe
        return RECIPES[self.target.recipe if name == "target" else name]

    @property
    def device_embedding(self) -> bool:
        """Whether the token embedding is a region (token ids in, its table a device weight):
        [host] embedding = false, or the target's choice where model.toml leaves it unset."""
        host = self.config.host.embedding
        return self.target.device_embedding if host is None else not host

    @property
    def divided_rows(self) -> bool:
        """Whether a prompt chunk's rows are divided over the token group ([prompt] rows = "divided")."""
        return self.config.prompt.rows == "divided"

    @property
    def fused(self) -> bool:
        """One executable per layer (the target fuses layers, compiler/layers.py), not per region call;
        with a draft, the layers it reads capture its features inside (capture twins)."""
        return self.target.fused_layers

    def executables(self, plan: RegionPlan) -> list[Exe]:
        """Every executable the bundle holds, in plan order: fused layers' where the target fuses them
        (`fused`), else `region_executables`."""
        if not self.fused:
            return self.region_executables(plan)
        b = self.config.buckets
        gathered = self.topology.groups if self.topology.dispatch else 1
        rows = self.topology.group_size if self.divided_rows else 1
        exes = plan.fused_executables(b.shapes(), b.contexts, gathered, rows)
        if self.head_best:  # the head's greedy choice in its graph, at every bucket the head has
            heads = [e for e in exes if e.kind in ("head", HEAD_ROWS) and e.method == DECODE]  # and a divided chunk's
            exes += [Exe(e.kind, BEST, e.batch, e.tokens, None) for e in heads]
        return exes

    @property
    def head_best(self) -> bool:
        """Whether the head also picks a greedy step's (value, index) pairs in its graph (`Head.best`):
        fused layers (trn2) with several ranks, where a greedy step's pairs cross ranks and the logits
        slice need not leave the device."""
        return self.fused and self.topology.world > 1

    def region_executables(self, plan: RegionPlan) -> list[Exe]:
        """One executable per region kind, method and bucket, in plan order (MoE on gathered rows under
        EP dispatch): the per-region form, and the pieces a fused layer is made of."""
        gathered = self.topology.groups if self.topology.dispatch else 1
        b = self.config.buckets
        rows = self.topology.group_size if self.divided_rows else 1
        exes = plan.executables(b.shapes(), b.contexts, gathered, rows)
        if self.fused and rows > 1:  # a prompt step runs the layers' rows modules: no replicated piece there
            exes = [e for e in exes if not plan.replicated_prompt_piece(e)]
        return exes

    def geometry_at(self, context: int | None) -> Geometry:
        """The geometry an executable of context bucket `context` is traced with (None: the full one)."""
        return self.geometry if context is None else self.geometry.at_context(context)


@dataclass(frozen=True, kw_only=True)
class Run:
    """How a compile runs: never what it builds."""

    staging: Path  # the bundle being assembled
    out: Path  # where it is published
    jobs: int = 1
    log: Log = print
    cache: Cache | None = None  # fixed settings; what the run does with it goes to its `use` (a CacheUse)
    require_cache: bool = False
    verbose: bool = False
    ray: str | None = None  # compile on this Ray cluster (compiler/farm.py): "auto" or HOST:PORT


def parse(config: CompileConfig, hlo_only: bool, log: Log) -> Spec:
    """Pass: model.toml and the checkpoint's config.json -> what is built, checked against each other
    (the tiny checkpoint is generated first where model.toml asks for it and it is absent)."""
    m = config.model
    if not (m.checkpoint / "config.json").exists() and m.tiny is not None:
        from deepinfer.regions.tiny import make_tiny

        log(
            f"checkpoint {m.checkpoint} absent: generating the tiny checkpoint "
            f"(seed {m.tiny.seed}, {m.tiny.layers} layers)"
        )
        make_tiny(m.checkpoint, seed=m.tiny.seed, layers=m.tiny.layers, exist_ok=True)
    model = load_config(m.checkpoint)
    try:
        check_block_size(model.text, config.kv.block_size)
    except ConfigError as e:
        raise config_error(config, "kv", "block_size", str(e)) from None
    if config.speculative.draft is not None and not model.text.has_draft:
        raise config_error(
            config,
            "speculative",
            "draft",
            f"the checkpoint {m.checkpoint} has no DSpark draft (its config.json's "
            "text_config.num_nextn_predict_layers is 0: no mtp.* tensors); drop the key or "
            "use a checkpoint with a draft",
        )
    bad = topology.check(config.parallel, model.text, draft=config.speculative.draft is not None)
    if bad:
        raise config_error(config, "parallel", bad[0], bad[1])
    t = config.target
    kv, buckets = config.kv, config.buckets
    bad = topology.check_division(config.parallel, model.text, kv.block_size)
    if bad:
        raise config_error(config, "kv", bad[0], bad[1])
    geometry = Geometry(
        slots=max(buckets.batch) + 1,
        blocks=kv.num_blocks,  # the token group's; a divided region's pools hold its rank's share
        block_size=kv.block_size,
        max_blocks=-(-buckets.max_context // kv.block_size),
        # with a draft, the per-slot rings take a verify step's drafts without a copy (runtime/schedule.py)
        slack=model.text.dspark_block_size if config.speculative.draft is not None else 0,
    )
    check_num_blocks(config, geometry)
    spec = Spec(
        config=config,
        model=model,
        topology=config.parallel,
        target=TARGETS[t.name](t.executable or TARGETS[t.name].EXECUTABLES[0], t.options),  # None: its first
        geometry=geometry,
        hlo_only=hlo_only,
    )
    if spec.draft and spec.device_embedding:
        raise config_error(
            config,
            "speculative",
            "draft",
            f"the draft embeds its block with the host's embedding table, and target {t.name} "
            "makes the embedding a device region; add [host] embedding = true to keep it on the host",
        )
    return spec


def check_num_blocks(config: CompileConfig, geometry: Geometry) -> None:
    """[kv] num_blocks counts a token group's blocks; its paged pools divide the usable ones
    (all but scratch block 0) evenly over the group's cp ranks (regions/state.blocks_per_rank)."""
    cp, n = config.parallel.cp, config.kv.num_blocks
    if (n - 1) % cp:
        least = geometry.max_blocks * (geometry.slots - 1) + 1  # [kv] num_blocks's own minimum
        near = " or ".join(map(str, nearest_num_blocks(n, cp, least)))
        raise config_error(
            config,
            "kv",
            "num_blocks",
            f"{n} blocks do not divide over [parallel] cp = {cp}: the paged KV pools are divided block-wise "
            f"over the cp ranks, so num_blocks - 1 (block 0 is scratch) must be a multiple of {cp}; "
            f"nearest valid: {near}",
        )
