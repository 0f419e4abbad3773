"""The trn2 target: region -> XLA HLO -> NEFF (neuronx-cc), run by the Neuron runtime.

    trace (static shapes) -> lower (kernel decompositions, NKI where registered and importable)
    -> HLO module (compiler/targets/hlo.py), checked numerically on XLA:CPU against the
       reference region -> neuronx-cc per executable (compiler/targets/neuronxcc.py) -> NEFF

What differs from the cpu target:
- shapes are static: the state pools have the compiled block count and slot count;
- state writes are returned: the new contents of every pool a region writes come first
  among its outputs, each declared a must-alias of its input (input_output_alias), so the
  device updates the pool in place;
- parameters and outputs carry their NEFF tensor names (neff_input_names /
  neff_output_names), and no sort or top-k is wider than neuronx-cc compiles
  (MAX_SELECTION_WIDTH; the indexer selects blockwise, kernels/select.py);
- the token embedding is a region (`embed`): the host sends token ids, the table is a
  resident weight and the streams the first layer reads never leave the device;
- fp8 weights travel as uint8 and every decode is arithmetic (kernels/formats.py), as
  neuronx-cc needs (no dtype bitcasts of graph inputs).

Options (model.toml [target].options): neuronx-cc's (lnc, optlevel, model_type,
auto_cast, extra_flags, verbose, timeout_s) and deepinfer's own (Trn2Options): `frontend`
("torch-mlir", or "torch-xla" where installed), `check` (run the XLA:CPU check,
default true), `fallback` ("regions", the default: a fused layer kind neuronx-cc refuses is
compiled per region, compiler/fallback.py; "none": the refusal stops the compile), `layers`
and `collectives`:

- `layers = "fused"` (the default): a layer's regions (engram, attention and its divided
  stages, MoE) are one executable with every collective between them inside it
  (compiler/layers.py): one device execution per layer, and no activation crosses to the
  host between the embedding and the head;
- `layers = "regions"`: one executable per region call, the per-region form `deepinfer diff`
  ranks; its boundary collectives run on the host (`collectives = "host"`, the default
  there) or, with `collectives = "graph"`, as an all-reduce inside each region's module
  (regions.topology.boundary_reduce; the divided attention's merges and EP dispatch stay on
  the host). Either is checked on XLA:CPU with one replica a rank.
"""

from __future__ import annotations

import dataclasses
import platform
import typing
from pathlib import Path
from typing import ClassVar, Literal

import torch

import deepinfer
from deepinfer import schema
from deepinfer.bundles import neff
from deepinfer.compiler.targets import hlo, neuronxcc
from deepinfer.compiler.targets.trn2_figures import DEVICE_CORES, DEVICE_FIGURES, RANK_FIGURES, Figure
from deepinfer.errors import DeepinferError
from deepinfer.kernels import target_decompositions
from deepinfer.regions.agreement import ShapeMismatch, compare_tensors, tolerance
from deepinfer.regions.examples import random_weights


@dataclasses.dataclass(frozen=True, kw_only=True)
class Trn2Options:
    """deepinfer's own [target].options for trn2 (neuronx-cc's are neuronxcc.NeuronCompileOptions),
    read from the options table by schema.build; each default is here and only here."""

    frontend: Literal["torch-mlir", "torch-xla"] = "torch-mlir"  # hlo.FRONTENDS
    check: Literal[True, False] = True  # run each lowered module on XLA:CPU against its reference
    layers: Literal["fused", "regions"] = "fused"  # one executable per layer, or per region call
    # where a `layers = "regions"` compile runs its boundary all-reduces: None (not given) is
    # "host" there; a fused layer holds every collective in its module, so None is "graph" with
    # fused layers and "host" is refused (check_options)
    collectives: Literal["host", "graph"] | None = None
    # what a compile does when neuronx-cc refuses a fused layer module (an NCC_ error code): compile
    # that layer kind per region and go on ("regions"), or stop ("none"). Left out of cache keys: no
    # executable changes with it, only whether a refused kind's regions are built (compiler/fallback.py)
    fallback: Literal["regions", "none"] = "regions"

    @property
    def graph_collectives(self) -> bool:
        """The ranks' boundary all-reduces run inside the executables."""
        return self.layers == "fused" or self.collectives == "graph"


OWN_OPTIONS = tuple(f.name for f in dataclasses.fields(Trn2Options))
assert typing.get_args(typing.get_type_hints(Trn2Options)["frontend"]) == hlo.FRONTENDS
# neuronx-cc rewrites a sort (and sort-then-slice) into its AwsNeuronTopK, which fails over rows
# wider than this (aws-neuron-sdk issue 1339, open): no HLO module of this target holds one
MAX_SELECTION_WIDTH = 16384
HBM_PER_CORE = 96 * (1 << 30) // 8  # per physical NeuronCore-v3


class CheckFailed(DeepinferError):
    """A lowered graph disagrees with its reference region on XLA:CPU."""


class Trn2Target:
    name: ClassVar[str] = "trn2"
    recipe: ClassVar[str] = "e4m3"  # IEEE-like fp8, as Neuron's float8_e4m3 reads it
    EXECUTABLES: ClassVar[tuple[str, ...]] = ("neff",)
    suffix: ClassVar[str] = ".neff"
    lowered_suffix: ClassVar[str] = ".hlo.pb"
    static_shapes: ClassVar[bool] = True
    state_writes: ClassVar[str] = "returned (pool outputs alias their inputs)"
    # ids go in, not rows: the table is a resident weight stack (replicated: every rank embeds its
    # own token group, and a vocabulary split would need a collective before the first layer)
    device_embedding: ClassVar[bool] = True
    # options that only change logs, waiting or checking: left out of cache keys
    LOG_OPTIONS: ClassVar[tuple[str, ...]] = (*neuronxcc.LOG_ONLY, "check", "fallback")
    LOWERING_MODULES: ClassVar[tuple[str, ...]] = (
        "deepinfer.compiler.targets.trn2",
        "deepinfer.compiler.targets.hlo",
        "deepinfer.compiler.targets.neuronxcc",
        "deepinfer.compiler.targets.link",
        "deepinfer.compiler.layers",
        "deepinfer.compiler.draft_layers",
        "deepinfer.compiler.rows_layers",
        "deepinfer.regions.divided",
        "deepinfer.regions.picking",
        "deepinfer.kernels.select",
    )

    def __init__(self, executable: str = "neff", options: dict | None = None):
        self.executable = executable
        self.options = dict(options or {})  # as given: the manifest and the cache keys hold these
        own = _own_options(self.options)
        if isinstance(own, str):
            raise ValueError(own)
        self.own = own
        self.frontend: str = own.frontend
        self.check: bool = own.check
        self.fused_layers = own.layers == "fused"
        self.graph_collectives = own.graph_collectives
        self.fallback: str = own.fallback
        compiler_options = {k: v for k, v in self.options.items() if k not in OWN_OPTIONS}
        compile_options = neuronxcc.NeuronCompileOptions.from_dict(compiler_options)
        if isinstance(compile_options, str):
            raise ValueError(compile_options)
        self.compile_options = compile_options

    @staticmethod
    def check_options(options: dict) -> str | None:
        """A message for the first bad option, else None."""
        own = _own_options(options)
        if isinstance(own, str):
            return own
        if own.layers == "fused" and own.collectives == "host":
            return 'option collectives = "host" needs layers = "regions" (a fused layer holds its collectives)'

        bad = neuronxcc.NeuronCompileOptions.from_dict({k: v for k, v in options.items() if k not in OWN_OPTIONS})
        if isinstance(bad, str):
            return f"{bad} (or deepinfer's own: {', '.join(OWN_OPTIONS)})"
        return None

    @property
    def lnc(self) -> int:
        return self.compile_options.lnc

    def device_memory(self) -> tuple[int | None, str]:
        """HBM per logical NeuronCore: a Trainium2 device has 96 GiB of HBM in 4 stacks for 8
        NeuronCore-v3 (AWS Neuron "Trainium2 Architecture Guide for NKI"), 12 GiB each; a logical
        core of LNC=2 combines two physical cores and their memory ("Logical NeuronCore configuration")."""
        return HBM_PER_CORE * self.lnc, f"trn2 HBM: 12 GiB per NeuronCore x LNC {self.lnc}"

    def step_figures(self) -> dict[str, Figure]:
        """The hardware figures of one rank for the decode step's cost model: the device's
        (DEVICE_FIGURES) times lnc / 8, and the per-rank latencies (RANK_FIGURES)."""
        share = self.lnc / DEVICE_CORES
        unit = f"a rank ({self.lnc} of a device's {DEVICE_CORES} NeuronCore-v3)"
        device = {
            name: Figure(f.value * share, f"{f.unit} {unit}", f.source, f.status) for name, f in DEVICE_FIGURES.items()
        }
        return {**device, **RANK_FIGURES}

    def keyed_options(self) -> dict:
        return {k: v for k, v in self.options.items() if k not in self.LOG_OPTIONS}

    def toolchain(self) -> dict[str, str]:
        compiler = neuronxcc.find_compiler()
        return {
            "deepinfer": deepinfer.__version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
            **hlo.versions(self.frontend),
            "neuronx-cc": neuronxcc.compiler_version(compiler) if compiler else "absent",
        }

    def lower(self, ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
        return ep.run_decompositions({**target_decompositions(self.name), **hlo.hlo_decompositions()})

    def emit(
        self,
        ep: torch.export.ExportedProgram,
        names: list[str],
        outputs: list[str],
        out: Path,
        reduce: dict[str, list[list[int]]] | None = None,
    ) -> dict:
        """Write the HLO module of a lowered program to `out`; returns the executable's outputs:
        {"state_outputs": [input names], "aliases": {out: in}, "output_specs": [{name, shape, dtype}]}.
        The new contents of each written state input come first, then the region's outputs.
        `reduce` {output name: replica groups} sums those outputs over their groups inside the
        module (hlo.finish_module), the collective a region's boundary needs.
        A module holding a sort or top-k wider than neuronx-cc compiles is refused (LoweringError,
        nothing written; the pipeline prefixes the region)."""
        user = [s.arg.name for s in ep.graph_signature.input_specs if s.kind.name == "USER_INPUT"]
        state = [
            names[user.index(o.target)] for o in ep.graph_signature.output_specs if o.kind.name == "USER_INPUT_MUTATION"
        ]
        aliases = {j: names.index(n) for j, n in enumerate(state)}
        labels = state + list(outputs)
        unknown = sorted(set(reduce or {}) - set(labels))
        if unknown:
            raise hlo.LoweringError(f"all-reduce of {', '.join(unknown)}: not an output of the region ({labels})")
        placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
        streams = placeholders[user[names.index("h")]].meta["val"].dtype if "h" in names else None
        text = hlo.finish_module(
            hlo.to_stablehlo(ep, self.frontend),
            aliases,
            names,
            [neff.output_name(n) for n in labels],
            {labels.index(n): groups for n, groups in (reduce or {}).items()},
            streams,  # a reduced stream leaves in the dtype of the streams that came in
        )
        proto = hlo.to_hlo_proto(text)
        self.refuse_wide_selections(proto)
        out.write_bytes(proto)
        values = [a.meta["val"] for a in ep.graph.output_node().args[0]]
        specs = [
            {
                "name": n,
                "shape": list(v.shape),
                "dtype": str(streams if reduce and n in reduce and streams else v.dtype).removeprefix("torch."),
            }
            for n, v in zip(labels, values)
        ]
        out_specs = {"state_outputs": state, "aliases": aliases, "output_specs": specs}
        return {**out_specs, "reduced": reduce} if reduce else out_specs

    @staticmethod
    def refuse_wide_selections(proto: bytes) -> None:
        """LoweringError for a module holding a sort or top-k wider than neuronx-cc compiles."""
        for op, width in hlo.selection_widths(proto):
            if width > MAX_SELECTION_WIDTH:
                raise hlo.LoweringError(
                    f"the HLO module holds a {op} over {width} entries; neuronx-cc compiles "
                    f"sort and top-k up to {MAX_SELECTION_WIDTH} (aws-neuron-sdk issue 1339): "
                    "select blockwise (kernels/select.py)"
                )

    def check_numerics(
        self,
        proto: Path,
        region,
        method: str,
        inputs: list[torch.Tensor],
        names: list[str],
        state_outputs: list[str],
        where: str,
        seed: int = 0,
        reduce: dict[str, list[list[int]]] | None = None,
    ) -> dict:
        """Run the HLO module on XLA:CPU and the reference region eagerly on the same inputs: the
        method's example inputs and seeded random weights of the region's real shapes
        (regions/examples.random_weights; this region's only, freed after), both as the weight
        recipe stores them (e4m3 codes and their scales: compiler/weights.in_format), so the
        module's in-graph decode reads the bytes a bundle holds. Every output must agree
        as `deepinfer diff` judges (regions/agreement.py). Returns {"max_abs", "score",
        "tolerance"}; raises CheckFailed naming the first output that does not.

        A module holding collectives (`reduce`: {output: replica groups}) runs on one XLA:CPU
        replica a rank, each with its rank; each rank's reference is the region at that rank,
        its reduced outputs summed over the rank's group (what the host collectives give)."""
        from deepinfer.compiler.weights import in_format

        weights = random_weights(region, seed)  # the release's formats
        stored = in_format(region.specs, weights, region.fp8_format)  # as the weight recipe writes them
        n_weights = len(names) - len(inputs)
        labels = state_outputs + region.method_outputs(method)
        groups = reduce or {}
        world = sum(map(len, next(iter(groups.values())))) if groups else 1

        def reference(rank: int) -> list[torch.Tensor]:
            mine = {**stored, "rank": torch.tensor(rank)} if groups else stored
            args = [a.clone() for a in inputs]
            with torch.no_grad():
                out = getattr(region.with_weights(mine), method)(*args)
            out = list(out) if isinstance(out, (tuple, list)) else [out]
            return [args[names.index(n) - n_weights] for n in state_outputs] + out

        if not groups:
            flat = [stored[n] for n in names[:n_weights]]
            runs = [hlo.CpuHlo(Path(proto).read_bytes())(flat + [a.clone() for a in inputs])]
            refs = [reference(0)]
        else:
            flats = [[{**stored, "rank": torch.tensor(r)}[n] for n in names[:n_weights]] for r in range(world)]
            runs = hlo.CpuReplicas(Path(proto).read_bytes(), world)([f + [a.clone() for a in inputs] for f in flats])
            refs = _reduced([reference(r) for r in range(world)], groups, labels, region.dtype)
        diffs = []
        for got, ref in zip(runs, refs):
            diffs += self.agree(got, ref, labels, region.dtype, where)
        return {
            "max_abs": max((d.max_abs for d in diffs), default=0.0),
            "score": max((d.score for d in diffs), default=0.0),
            "tolerance": tolerance(region.dtype),
        }

    @staticmethod
    def agree(got: list, ref: list, labels: list[str], dtype: torch.dtype, where: str) -> list:
        """Each output's comparison; raises CheckFailed at the first that does not agree."""
        if len(got) != len(ref):
            raise CheckFailed(f"{where}: the HLO module returns {len(got)} outputs, the region {len(ref)}")
        tol = tolerance(dtype)
        diffs = []
        for label, g, r in zip(labels, got, ref):
            try:
                d = compare_tensors(label, g, r)
            except ShapeMismatch:
                raise CheckFailed(
                    f"{where}: output {label} has shape {tuple(g.shape)} on XLA:CPU, {tuple(r.shape)} in the reference"
                ) from None
            if not d.agrees(tol):
                raise CheckFailed(
                    f"{where}: output {label} differs from the reference {d.how()} on XLA:CPU "
                    f"(score {d.score:.3g}, tolerance {tol:g})"
                )
            diffs.append(d)
        return diffs

    def require_compiler(self) -> None:
        """Before any NEFF job: neuronx-cc must be here (every graph is already lowered and checked)."""
        if neuronxcc.find_compiler() is None:
            raise neuronxcc.NeuronCompilerMissing(
                "every region was lowered to HLO and checked on XLA:CPU, but neuronx-cc is not installed: "
                f"{neuronxcc.MISSING_MESSAGE} (deepinfer-compile --hlo-only writes that bundle)"
            )

    def describe(self, executable: Path) -> dict:
        """The NEFF header's facts for the manifest; a NEFF built for another LNC is refused."""
        header = neff.read_header(executable)
        neff.check_loadable(header, lnc=self.lnc, path=executable.name)
        return {"neff": neff.summary(header)}

    def compile(self, lowered: Path, out: Path, *, log: Path | None = None, name: str = "") -> None:
        """HLO module -> NEFF with neuronx-cc; its log is kept at `log`."""
        neuronxcc.compile_neff(lowered, out, log or out.with_suffix(".log"), self.compile_options, region=name)


def _reduced(
    own: list[list[torch.Tensor]], groups: dict[str, list[list[int]]], labels: list[str], dtype: torch.dtype
) -> list[list[torch.Tensor]]:
    """Each rank's reference outputs with those in `groups` summed over the rank's group (what the
    host collectives give), cast to `dtype` as the module casts them."""
    refs = [list(o) for o in own]
    for name, rank_groups in groups.items():
        j = labels.index(name)
        for g in rank_groups:
            total = torch.stack([own[r][j] for r in g]).sum(0).to(dtype)  # cast in the module
            for r in g:
                refs[r][j] = total
    return refs


def _own_options(options: dict) -> Trn2Options | str:
    """deepinfer's own options out of the [target].options table, or a message for the first bad one."""
    own = {k: v for k, v in options.items() if k in OWN_OPTIONS}
    try:
        return schema.build(Trn2Options, own)
    except schema.Problem as p:
        key = str(p.key[0])
        allowed = schema.describe(typing.get_type_hints(Trn2Options)[key])
        return f"option {key} = {own[key]!r} is not {allowed}"
