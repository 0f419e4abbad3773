"""`deepinfer plan`: what a compile would build, from `config.json` and safetensors headers alone.

Every figure is the compile's own, from its passes run as far as they go without tensor data:

    layer plan, region kinds      spec.parse and pipeline.plan (compiler/plan.py)
    executables, compile jobs     Spec.executables: region kinds x methods x buckets
    weight files, bytes on disk   the weight pass's file plan (pipeline.weight_files): every
                                  source tensor checked against its spec, offsets and headers
                                  laid out, nothing read or written
    state pools                   the state layout pass (pipeline.layout_state), per rank: paged
                                  pools divided over the cp ranks (budget.pool_entries)
    memory per rank, verdict      compiler/budget.py's breakdown, with the scratch of the compile's
                                  graphs: its trace records where the compile cache holds them,
                                  else graphs traced here on fake tensors and lowered
                                  (executables.lower)
    decode step, prompt cost      compiler/step_cost.py per decode bucket, prompt_cost.py per prompt
                                  (8K, 64K, 1M): the figures above, per_step, the target's (trn2)
    the draft ([speculative])     its kinds and executables (compiler/plan.py), its weights per
                                  rank and whole (budget.weights_by_kind), its verify step (verify_cost.py)

The checkpoint is the directory's safetensors headers (`model.safetensors` or the index
and its shards) when it has them, their data never read (it may be absent); else the
tensors `config.json` implies (regions/synthetic.checkpoint_tensors: the regions'
weight specs, what the compile would read). The engram hasher and its token map are
the runtime's (and the compile's, for the map): nothing here needs the tokenizer.

Scratch: every executable whose trace record the compile cache holds (an earlier compile
of the same model.toml wrote it; `--hlo-only` compiles keep none) gives its own figure. A kind
without records is traced here at its largest bucket (most rows per step), which bounds its
other buckets: a graph's intermediates grow with its rows, and the budget takes the
largest over all graphs. At release dimensions that costs about 10 s of CPU and up to 2 GiB
per kind (measured), so `scratch=False` (`--no-scratch`) skips it. The MoE is also traced at
its smallest batch bucket (at the largest tokens bucket), to show whether its scratch
depends on the rows per step.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from deepinfer.bundles import layout
from deepinfer.bundles.manifest import DECODE, PROJECT, Pool
from deepinfer.bundles.safetensors import DTYPES, TensorInfo
from deepinfer.compiler import budget, pipeline, prompt_cost, step_cost, verify_cost
from deepinfer.compiler.budget import Breakdown, human
from deepinfer.compiler.config import CompileConfig, config_error
from deepinfer.compiler.plan import Exe, RegionPlan
from deepinfer.compiler.plan_scratch import MOE, GraphScratch, recorded_scratch, trace_scratch
from deepinfer.compiler.spec import Spec, parse
from deepinfer.compiler.targets.trn2_figures import Measured
from deepinfer.errors import ConfigError
from deepinfer.regions.checkpoint import INDEX_FILE, SINGLE_FILE, Checkpoint
from deepinfer.regions.config import CONFIG_FILE, V41Config
from deepinfer.regions.topology import ENGRAM_KV, boundary_reduce, head_rows

BUNDLE = PurePosixPath("bundle")  # where the planned files would go: paths are reported relative to it


@dataclass
class BundlePlan:
    spec: Spec
    regions: RegionPlan
    checkpoint: str  # where the shapes came from
    executables: list[Exe]
    files: dict[str, int]  # bundle path -> bytes on disk (weights and host files)
    rank_files: dict[str, tuple[str, ...]]  # rank key -> its own weight files
    shared_files: tuple[str, ...]  # weight files every rank loads (stored once)
    pools: dict[str, Pool]
    memory: dict[str, Breakdown]  # rank key -> its breakdown
    scratch: dict[str, int] | None  # graph -> scratch bytes (None: none known)
    recorded: tuple[str, ...]  # the graphs whose scratch came from the cache's trace records
    seconds: float
    # what the bundle holds: `executables` (the per-region graphs, whose scratch is traced), or with
    # fused layers (trn2, compiler/layers.py) one per layer kind and bucket in place of its regions'
    built: list[Exe] = field(default_factory=list)
    # figures a Trn2 host measured (`deepinfer plan --figures`), in place of the target's in the step model
    measured: Measured | None = None
    # fused layer kinds whose layers run per region: neuronx-cc refused them (compiler/fallback.py)
    per_region: frozenset[str] = frozenset()

    # -- figures ---------------------------------------------------------------------------------

    def device_weights(self, rank: str) -> dict[str, int]:
        return self.memory[rank].weights

    def rank_file_bytes(self, rank: str) -> int:
        """Bytes a rank loads from the bundle's weight files: its own and the shared ones."""
        return sum(self.files[f] for f in (*self.rank_files[rank], *self.shared_files))

    @property
    def per_step(self) -> dict:
        """What one decode step runs on a rank: its device executions (the embedding where it is a
        region, each layer's slots, an attention kind's divided stages each, the head) and the ranks'
        collectives by name (runtime/ranks.Comm's), with those the executables hold themselves."""
        topo, collectives, calls = self.spec.topology, dict[str, int](), dict[str, int]()
        if any(kp.slot == "embed" for kp in self.regions.kinds.values()):  # trn2's embed region
            calls["embed"] = 1

        def add(counts: dict[str, int], name: str, n: int = 1) -> None:
            counts[name] = counts.get(name, 0) + n

        step = min(e[3] for e in self.executables)  # a decode step's tokens bucket
        methods = {k: {e[1] for e in self.executables if e[0] == k and e[3] == step} for k in self.regions.kinds}
        fused, in_graph = self.fused_layers, 0
        for p in self.regions.layers:
            mine: dict[str, int] = {}  # this layer's collectives
            if p.layer in fused:  # the layer's regions and their collectives in one executable
                add(calls, "layer")
            for slot, (kind, _) in self.regions.bindings[p.layer].items() if p.layer not in fused else ():
                if methods[kind]:  # a rows twin has no method at a decode step
                    add(calls, slot, len(methods[kind]))
            if topo.group_size > 1:  # the heads (or output rows) divided over the token group
                add(mine, "attention all-reduce")
            if topo.dispatch:
                add(mine, "ep dispatch all-gather")
                add(mine, "ep combine reduce-scatter")
            elif topo.ep > 1:
                add(mine, "ep all-reduce")
            if p.engram_rows and topo.group_size > 1:  # its projection divided over the token group
                add(mine, "engram all-reduce")
            if topo.cp > 1 and p.ratio:
                add(mine, "cp query all-gather")
                if p.attn in ("source", "reindex"):
                    add(mine, "cp selection all-gather", 2 if p.candidate_source else 1)
                add(mine, "cp attention max all-gather")
                add(mine, "cp attention all-reduce")
            for name, n in mine.items():
                add(collectives, name, n)
            if p.layer in fused:  # every collective of the layer
                in_graph += sum(mine.values())
            elif self.spec.target.graph_collectives:  # the boundary all-reduces
                in_graph += sum(
                    bool(boundary_reduce(k, DECODE, topo)) for k, _ in self.regions.bindings[p.layer].values()
                )
                in_graph += bool(p.engram_rows and boundary_reduce("engram", ENGRAM_KV, topo))
        add(calls, "head")
        if topo.world > 1:
            add(collectives, "logits all-gather")
        return {
            "executions": sum(calls.values()),
            "executions_by_slot": calls,
            "collectives": sum(collectives.values()),
            "collectives_by_name": collectives,
            "collectives_in_executables": in_graph,
        }

    @property
    def fused_layers(self) -> set[int]:
        """The layers a step runs as one execution: every layer of a fused compile (trn2's default),
        but those of the layer kinds in `per_region`."""
        kinds = self.regions.fused_kinds().values() if self.spec.fused else ()
        return {layer for lk in kinds if lk.name not in self.per_region for layer in lk.layers}

    @property
    def head(self) -> dict[str, int]:
        """The head's vocabulary split: the ranks of a token group it is split over, the rows each
        holds (padded to whole blocks), the padding rows of a group and a rank's head bytes."""
        t, topo = self.spec.model.text, self.spec.topology
        rows = head_rows(t, topo)
        return {
            "vocab": t.vocab_size,
            "ranks": topo.group_size,
            "rows_per_rank": rows,
            "padding_rows": rows * topo.group_size - t.vocab_size,
            "bytes_per_rank": self.device_weights(layout.rank_key(0))["head"],
        }

    @property
    def draft(self) -> dict | None:
        """The DSpark draft ([speculative] draft; None without): its kinds, its executables (the draft
        kinds' and the target head's `project`, which its logits go through), its weight bytes per rank
        (laid out as the target's layers: in every rank's memory budget) and whole (the checkpoint's,
        what one rank held when the draft was not divided), in total and by kind."""
        kinds = self.regions.draft_kinds
        if not kinds:
            return None
        rank = self.device_weights(layout.rank_key(0))
        whole = budget.weights_by_kind(self.regions, whole=True)
        return {
            "kinds": kinds,
            "stages": len(self.regions.draft),
            "executables": [
                layout.executable_name(*e)
                for e in self.built  # fused (trn2): the capture runs inside the target layers' capture twins
                if e[0] in kinds or (e[0], e[1]) == ("head", PROJECT)
            ],
            "weights_per_rank": sum(rank[k] for k in kinds),
            "weights_whole": sum(whole[k] for k in kinds),
            "by_kind": {k: {"per_rank": rank[k], "whole": whole[k]} for k in kinds},
        }

    @property
    def bundle_bytes(self) -> int:
        """Bytes of the bundle's weight and host files (the executables are known after compiling)."""
        return sum(self.files.values())

    @property
    def moe_scratch(self) -> dict[int, int]:
        """batch -> scratch of the MoE graph (`decode`: not a divided prompt's methods) at the largest
        tokens bucket (from the traced graphs)."""
        if self.scratch is None:
            return {}
        t = max(e[3] for e in self.executables if e[0] == MOE)
        return {
            e[2]: self.scratch[layout.executable_name(*e)]
            for e in self.executables
            if e[:2] == (MOE, DECODE) and e[3] == t and layout.executable_name(*e) in self.scratch
        }

    @property
    def moe_split(self) -> tuple[int, float] | None:
        """(bytes independent of the rows, bytes per row) of the MoE's scratch, from its graphs at
        the smallest and largest batch (rows = batch x tokens): the first is what its experts'
        weights cost (decoded in tiles), the second the rows' activations."""
        moe = self.moe_scratch
        if len(moe) < 2:
            return None
        t = max(e[3] for e in self.executables if e[0] == MOE)
        (b1, s1), (b2, s2) = min(moe.items()), max(moe.items())
        per_row = (s2 - s1) / ((b2 - b1) * t)
        return max(0, round(s1 - per_row * b1 * t)), per_row

    def pool_division(self, p: Pool) -> dict:
        """Whether pool `p` is divided over the cp ranks, its blocks per rank (paged pools) and its
        bytes undivided (the token group's whole pool, as one rank would hold it at cp = 1)."""
        g, cp = self.spec.geometry, self.spec.topology.cp
        return {
            "divided": budget.divided(p, cp),
            "blocks_per_rank": budget.pool_entries(p, g, cp) if p.dim == "blocks" else None,
            "bytes_undivided": budget.pool_bytes(p, g),
        }

    def _pool_note(self, p: Pool) -> str:
        """How a rank holds pool `p`, beside its bytes per rank (nothing to say at cp = 1)."""
        d, g, cp = self.pool_division(p), self.spec.geometry, self.spec.topology.cp
        if d["divided"]:
            whole = human(d["bytes_undivided"])
            return f"  ({d['blocks_per_rank']} of {g.blocks} blocks: divided over cp {cp}; {whole} whole)"
        return "" if cp == 1 else "  (whole on every rank)"

    def _draft_lines(self) -> list[str]:
        d, topo = self.draft, self.spec.topology
        if d is None:
            return []
        name = self.spec.config.speculative.draft
        per_kind = ", ".join(
            f"{k} {human(v['per_rank'])}" + ("" if v["per_rank"] == v["whole"] else f" of {human(v['whole'])}")
            for k, v in d["by_kind"].items()
        )
        return [
            "",
            f"draft ({name}): {d['stages']} stages, kinds {', '.join(d['kinds'])}; {len(d['executables'])} "
            f"executables (each kind and head.{PROJECT} at each batch bucket{'; the capture in the fused twins' * self.spec.fused})",
            f"  weights {human(d['weights_per_rank'])} per rank ({human(d['weights_whole'])} whole; tp {topo.tp}, "
            f"ep {topo.ep}): {per_kind}; in every rank's memory budget",
            f"  executables: {', '.join(d['executables'])}",
        ]

    # -- output ----------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        c = self.spec.config
        return {
            "model_toml": str(c.source),
            "checkpoint": {"path": str(c.model.checkpoint), "source": self.checkpoint},
            "target": {"name": c.target.name, "executable": c.target.executable, "lnc": self.spec.target.lnc},
            "topology": self.spec.topology.to_dict(),
            "layers": self._layers_dict(),
            "kinds": self._kinds_dict(),
            "executables": self._executables_dict(),
            "compile_jobs": len(self.built),
            "draft": self.draft,
            "per_decode_step": self.per_step,
            "step_cost": step_cost.report(self),
            "prompt_cost": prompt_cost.report(self),
            "verify_step": verify_cost.report(self),
            "weights": self._weights_dict(),
            "pools": self._pools_dict(),
            "prefix_cache": budget.prefix_state(self.pools),
            "scratch": self._scratch_dict(),
            "memory": {r: {**d.to_dict(), "fits": d.fits} for r, d in self.memory.items()},
            "bundle": {"bytes": self.bundle_bytes, "executables": None},
            "seconds": round(self.seconds, 2),
        }

    def _layers_dict(self) -> list[dict]:
        return [
            {
                "layer": p.layer,
                "attn": p.attn,
                "ratio": p.ratio,
                "kv_source": p.kv_source,
                "engram": p.engram_rows > 0,
                "regions": {slot: kind for slot, (kind, _) in self.regions.bindings[p.layer].items()},
            }
            for p in self.regions.layers
        ]

    def _kinds_dict(self) -> dict:
        return {
            kind: {
                "slot": kp.slot,
                "layers": kp.layers,
                "executables": [layout.executable_name(*e) for e in self.executables if e[0] == kind],
                "weights_per_rank": self.device_weights(layout.rank_key(0))[kind],
            }
            for kind, kp in self.regions.kinds.items()
        }

    def _executables_dict(self) -> dict:
        return {
            "count": len(self.built),
            "kinds": len(self.regions.kinds),
            "methods": sorted({e[1] for e in self.built}),
            "buckets": [list(s) for s in self.spec.config.buckets.shapes()],
            "names": [layout.executable_name(*e) for e in self.built],
            "fused_layers": {lk.name: list(lk.layers) for lk in self.regions.fused_kinds().values()}
            if self.spec.fused
            else None,
        }

    def _weights_dict(self) -> dict:
        return {
            "files": self.files,
            "shared_files": list(self.shared_files),
            "per_rank_device": {r: sum(d.weights.values()) for r, d in self.memory.items()},
            "per_rank_files": {r: self.rank_file_bytes(r) for r in self.rank_files},
            "head": self.head,
        }

    def _pools_dict(self) -> dict:
        return {
            name: {
                "state": p.state,
                "dim": p.dim,
                "layers": list(p.layers),
                "entry_shape": list(p.entry_shape),
                "dtype": p.dtype,
                "bytes": self.memory[layout.rank_key(0)].pools[name],  # per rank
                **self.pool_division(p),
            }
            for name, p in self.pools.items()
        }

    def _scratch_dict(self) -> dict | None:
        if self.scratch is None:
            return None
        return {
            "method": budget.SCRATCH_METHOD,
            "by_graph": self.scratch,
            "from_cache": list(self.recorded),
            "moe_by_batch": {str(b): n for b, n in self.moe_scratch.items()},
            "moe_fixed_bytes": self.moe_split[0] if self.moe_split else None,
            "moe_bytes_per_row": self.moe_split[1] if self.moe_split else None,
        }

    def lines(self) -> list[str]:
        return [
            *self._header_lines(),
            *self._layer_plan_lines(),
            *self._executable_lines(),
            *self._draft_lines(),
            "",
            *step_cost.lines(self),
            *prompt_cost.lines(self),
            *verify_cost.lines(self),
            *self._weight_lines(),
            *self._pool_lines(),
            *self._scratch_lines(),
            *self._memory_lines(),
            "",
            f"bundle on disk: {human(self.bundle_bytes)} of weights and host files in {len(self.files)} files "
            f"(+ {len(self.built)} executables, sized when compiled)",
        ]

    def _header_lines(self) -> list[str]:
        c, topo, spec = self.spec.config, self.spec.topology, self.spec
        t = spec.model.text
        return [
            f"plan of {c.source} ({self.checkpoint}, {self.seconds:.1f} s)",
            f"model: {t.num_hidden_layers} layers, {t.n_routed_experts} routed experts, hidden {t.hidden_size}; "
            f"target {c.target.name} ({c.target.executable}"
            + (f", LNC {spec.target.lnc})" if spec.target.lnc else ")")
            + f"; tp {topo.tp}, ep {topo.ep}, cp {topo.cp}: {topo.world} ranks",
            "",
        ]

    def _layer_plan_lines(self) -> list[str]:
        out = [f"layer plan: {len(self.regions.layers)} layers -> {len(self.regions.kinds)} region kinds"]
        rank0 = layout.rank_key(0)
        for kind, kp in self.regions.kinds.items():
            layers = (
                kp.slot
                if kp.layers == [-1]
                else ("draft stages " if kp.source != "layers.{}." else "layers ") + budget.id_ranges(kp.layers)
            )
            out.append(f"  {kind:<22} {kp.slot:<7} {layers:<40} {human(self.device_weights(rank0)[kind]):>12} per rank")
        return out

    def _executable_lines(self) -> list[str]:
        c, topo = self.spec.config, self.spec.topology
        shapes = c.buckets.shapes()
        methods = sorted({e[1] for e in self.executables})
        drafted = len(self.regions.draft_kinds) + 1 if self.regions.draft else 0  # + the head's project
        calls = {(e[0], e[1]) for e in self.executables if e[0] not in self.regions.draft_kinds and e[1] != PROJECT}
        staged = sorted({k for k, m in calls if m != DECODE})  # the divided attention's stages (regions/divided.py)
        engram, staged = "engram" in staged, [k for k in staged if k != "engram"]  # the engram: kv, then mix
        out = [
            "",
            (
                f"executables: {len(self.regions.kinds)} kinds x {len(methods)} method(s) ({', '.join(methods)}) "
                if not staged
                else f"executables: {len(self.regions.kinds)} kinds, {len(calls)} (kind, method) calls (the "
                f"{len(staged)} compressed attention kinds as their divided stages{', the engram as kv and mix' if engram else ''}) "
            )
            + f"x {len(shapes)} buckets"
            + (f" ({drafted} draft calls at the {len(c.buckets.batch)} batch buckets only)" if drafted else "")
            + f" = {len(self.executables)}"
            + (
                f"; fused (trn2): one executable a layer, {len(self.regions.fused_kinds())} layer kinds, "
                f"their regions and collectives inside: {len(self.built)} executables"
                if self.spec.fused
                else ""
            )
            + f"; compile jobs: {len(self.built)} (a cache hit skips one)",
            "  buckets (batch x tokens): "
            + ", ".join(f"{b}x{tk}" for b, tk in shapes)
            + ("; the MoE runs on the gathered rows (EP dispatch)" if topo.dispatch else ""),
            self._step_line(),
        ]
        if len(c.buckets.contexts) > 1:
            per_context = sorted({e[0] for e in self.executables if e[4] is not None})
            out.append(
                f"  context buckets: {', '.join(map(str, c.buckets.contexts))} (built per context: "
                f"{', '.join(per_context)})"
            )
        return out

    def _step_line(self) -> str:
        step = self.per_step
        return (
            f"  per decode step and rank: {step['executions']} device executions ("
            + ", ".join(f"{n} {slot}" for slot, n in step["executions_by_slot"].items())
            + f"), {step['collectives']} collectives"
            + (
                " (" + ", ".join(f"{n} {name}" for name, n in step["collectives_by_name"].items()) + ")"
                if step["collectives"]
                else ""
            )
            + (f", {step['collectives_in_executables']} of them inside the executables" if step["collectives"] else "")
        )

    def _weight_lines(self) -> list[str]:
        out = ["", "weights per rank after sharding (device):"]
        out += [
            f"  {ranks}: {human(sum(d.weights.values()))}"
            for ranks, d in budget.by_rank_group(self.memory, _weights_of).items()
        ]
        head = self.head
        out.append(
            f"  head: vocabulary {head['vocab']:,} over the token group's {head['ranks']} rank(s), "
            f"{head['rows_per_rank']:,} rows each ({head['padding_rows']:,} zero rows of padding), "
            f"{human(head['bytes_per_rank'])} per rank"
        )
        own = [f for fs in self.rank_files.values() for f in fs]
        host = [f for f in self.files if f not in own and f not in self.shared_files]
        out.append(
            f"  files: {len(own)} rank files {human(sum(self.files[f] for f in own))}, "
            f"{len(self.shared_files)} shared {human(sum(self.files[f] for f in self.shared_files))}, "
            f"{len(host)} host {human(sum(self.files[f] for f in host))}"
        )
        out += [
            f"  {ranks} load {human(n)} each from the weight files (own and shared)"
            for ranks, n in budget.by_rank_group(
                {r: self.rank_file_bytes(r) for r in self.rank_files}, lambda v: v
            ).items()
        ]
        return out

    def _pool_lines(self) -> list[str]:
        rank0 = layout.rank_key(0)
        out = ["", f"state pools ({len(self.pools)}):"]
        for name, p in self.pools.items():
            out.append(
                f"  {name:<14} {len(p.layers):>3} layers x {p.dim:<6} x {list(p.entry_shape)} {p.dtype:<9} "
                f"{human(self.memory[rank0].pools[name]):>12}" + self._pool_note(p)
            )
        return [*out, budget.prefix_state_line(self.pools)]

    def _scratch_lines(self) -> list[str]:
        if self.scratch is None:
            return ["", "scratch: not traced (--no-scratch) and not in the compile cache"]
        untraced = [k for k in self.regions.kinds if not any(n.startswith(k + ".") for n in self.scratch)]
        out = [
            "",
            "scratch: " + budget.SCRATCH_METHOD,
            f"  {len(self.recorded)} graph(s) from the compile cache's trace records, "
            f"{len(self.scratch) - len(self.recorded)} traced here at their kind's largest bucket"
            + (f"; unknown: {', '.join(untraced)}" if untraced else ""),
        ]
        out += [f"  {name:<36} {human(n):>12}" for name, n in self.scratch.items()]
        if self.moe_split:
            fixed, per_row = self.moe_split
            out.append(
                f"  MoE scratch: {human(fixed)} whatever the rows (its experts' weights, decoded in "
                f"tiles) + {human(round(per_row))} per row (activations); "
                + ", ".join(f"batch {b}: {human(n)}" for b, n in self.moe_scratch.items())
            )
        return out

    def _memory_lines(self) -> list[str]:
        out = ["", "memory budget per rank:"]
        for ranks, d in budget.by_rank_group(self.memory, lambda d: (d.total, d.usable)).items():
            out.append(f"  {ranks}: {'fits' if d.fits else 'DOES NOT FIT'}")
            out += ["  " + line for line in d.lines()]
        return out


def _weights_of(d: Breakdown):
    return tuple(sorted(d.weights.items()))


# -- the checkpoint a plan reads --------------------------------------------------------------------


def plan_checkpoint(model: V41Config, directory: Path) -> tuple[Checkpoint, str]:
    """The checkpoint's safetensors headers when it has them (data unread), else the tensors its
    config implies -> (checkpoint, what the shapes came from)."""
    if (directory / INDEX_FILE).exists() or (directory / SINGLE_FILE).exists():
        ckpt = Checkpoint(directory, data=False)
        return ckpt, f"safetensors headers of {len(set(ckpt.files.values()))} file(s)"
    from deepinfer.regions.synthetic import checkpoint_tensors

    source = str(directory / CONFIG_FILE)
    tensors = {
        name: TensorInfo(source, name, dtype, tuple(shape), 0, math.prod(shape) * DTYPES[dtype]().itemsize)
        for name, dtype, shape in checkpoint_tensors(model.to_dict())
    }
    return Checkpoint.described(directory, tensors), f"{CONFIG_FILE} only: shapes from the regions' weight specs"


# -- the API --------------------------------------------------------------------------------------


def plan_bundle(
    config: CompileConfig, *, scratch: bool = True, kinds=None, cache=None, log=lambda msg: None
) -> BundlePlan:
    """Plan the compile of `config` without reading tensor data or writing anything.

    Scratch comes from the trace records `cache` (a compiler/cache/local.Cache) holds; with `scratch`,
    each kind without records (only those of `kinds` when given) is traced on fake tensors. With
    neither, the verdict counts weights and pools only (the compile's first check)."""
    start = time.perf_counter()
    m = config.model
    if not (m.checkpoint / CONFIG_FILE).exists():
        raise config_error(
            config,
            "model",
            "checkpoint",
            f"{m.checkpoint / CONFIG_FILE}: no such file; a plan reads the checkpoint's config"
            + (
                " (the compile generates this tiny checkpoint: `deepinfer make-tiny` it first)"
                if m.tiny is not None
                else ""
            ),
        )
    spec = parse(config, False, log)
    regions = pipeline.plan(spec, lambda msg: None)  # the plan prints its own layer plan
    ckpt, source = plan_checkpoint(spec.model, m.checkpoint)
    planned, stacks = pipeline.weight_files(spec, regions, ckpt, Path(BUNDLE))
    files = {PurePosixPath(f.path).relative_to(BUNDLE).as_posix(): f.layout()[2] for f in planned}
    rank_files = {rank: tuple(s.path for s in entries if s.path) for rank, entries in stacks.items()}
    shared = tuple(dict.fromkeys(s.shared for entries in stacks.values() for s in entries if s.shared))
    executables = spec.region_executables(regions)
    unknown = sorted(set(kinds or ()) - set(regions.kinds))
    if unknown:
        raise ConfigError(f"no region kind {unknown[0]!r} in this model; its kinds: {', '.join(regions.kinds)}")
    known = recorded_scratch(spec, regions, executables, cache) if cache is not None else {}
    missing = [e for e in executables if not any(n.startswith(e[0] + ".") for n in known)]
    traced = {**known, **(trace_scratch(spec, regions, missing, log, kinds) if scratch else {})} or None
    graphs = [GraphScratch(name, n) for name, n in (traced or {}).items()]
    memory = budget.per_rank(spec, budget.breakdown(spec, regions, graphs))
    return BundlePlan(
        spec,
        regions,
        source,
        executables,
        files,
        rank_files,
        shared,
        pipeline.layout_state(spec, regions).pools,
        memory,
        traced,
        tuple(known),
        time.perf_counter() - start,
        spec.executables(regions),
    )
