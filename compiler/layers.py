"""One execution per layer (trn2): a layer's regions and every collective between them in one module.

The per-region form runs a decode step as one device execution per region call (each divided
attention stage one call) with the ranks' collectives on the host between them: 130 executions and
126 host collectives a step at the release. With `[target] options layers = "fused"` (trn2's
default) a layer is one executable instead: a **layer kind** is the region kinds a layer runs
(engram, attention kind, MoE: `fused_kinds`), and its module runs them in order with their
collectives inside (`ops`):

    engram (where the layer has one); over a token group of several ranks: kv -> all-reduce of the
        partial keys and value over the token group -> mix (regions/engram.py)
    capture (a layer the draft reads: its kind's capture twin, `..._capture`): the draft's features
        of the streams the attention reads, written into the layer's features ring, a state input
        aliased to its output as the pools' (regions/dspark.py DraftCapture); no collective
    attention: decode; or, with the paged state divided over cp ranks (regions/divided.py),
        query -> all-gather of the ranks' query rows over the cp group -> select -> all-gather each
        rank's K best over the cp group -> merge_topk (and the candidate pool's blocks the same way)
        -> attend -> all-reduce (max) of the softmax maxima -> scale the shares -> all-reduce (sum)
        of numerators and sums -> divide -> output
    tp * cp > 1: all-reduce of the attention's partial streams over the token group (its heads,
        or the row-split output's rows, divided over it)
    MoE: ep all-reduce of the partials over the token group; or, with EP dispatch, all-gather of
        every group's rows, the MoE on them, reduce-scatter of the partials and this rank's rows

Each piece is lowered as the per-region form lowers it and the pieces are spliced into one module
(compiler/targets/link.py). Every layer of a kind, and every rank, runs the same executable: its
weight inputs are each slot's stack rows (`<slot>.<name>`), bound per layer as the regions' are.

The compile checks each layer module on XLA:CPU, one replica a rank (up to hlo.MAX_REPLICAS ranks),
against `interpret`: the same ops run eagerly per rank, the pieces as the regions' torch code and
the collectives as the host computes them (regions/divided.py's merges, sums over the groups).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from deepinfer.bundles import layout, manifest_io, neff
from deepinfer.bundles import manifest as mf
from deepinfer.bundles.manifest import CAPTURE_SLOT, DECODE, DRAFT_MODULE, HEAD_ROWS, LAYER_ROWS
from deepinfer.bundles.topology import Topology
from deepinfer.compiler import budget
from deepinfer.compiler.executables import Graph, lower
from deepinfer.compiler.plan import Exe, LayerKind, RegionPlan
from deepinfer.compiler.prompt_rows import fused_passes
from deepinfer.compiler.spec import Log, Spec
from deepinfer.compiler.targets import hlo, link
from deepinfer.compiler.targets.hlo import Collective, Groups
from deepinfer.compiler.targets.trn2 import CheckFailed, Trn2Target
from deepinfer.errors import DeepinferError
from deepinfer.regions import divided, micro, picking
from deepinfer.regions.base import Region
from deepinfer.regions.examples import example_inputs, random_weights
from deepinfer.regions.state import InputSpec

# --- the ops a layer kind runs ---------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """A slot's region method. `inputs` renames its inputs (method input -> value), `outputs` its
    outputs (method output -> value)."""

    slot: str
    method: str
    inputs: tuple[tuple[str, str], ...] = ()
    outputs: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Glue:
    """A small torch function between collectives (`GLUE[fn]`, with `world` where it takes it, and
    `kwargs`); its module function is named `piece` where one module runs it at several shapes."""

    fn: str
    args: tuple[str, ...]
    results: tuple[str, ...]
    kwargs: tuple[tuple[str, int], ...] = ()
    piece: str = ""


Op = Run | Glue | Collective


def own_rows(x: torch.Tensor, rank: torch.Tensor, world: int) -> torch.Tensor:
    """Rows [world * B, ...] of every rank -> this rank's B rows (rank-major, as the gather made them)."""
    rows = x.view(world, x.shape[0] // world, *x.shape[1:])
    return torch.index_select(rows, 0, rank.clamp(0, world - 1).reshape(1)).squeeze(0)  # a gather in HLO


GLUE: dict[str, Callable[..., torch.Tensor | tuple[torch.Tensor, ...]]] = {
    "merge_topk": divided.merge_topk,
    "merge_blocks": divided.merge_blocks,
    "attention_scale": divided.attention_scale,
    "attention_divide": divided.attention_divide,
    "own_rows": own_rows,
    # the draft step's choice per vocabulary slice (compiler/draft_layers.py, regions/picking.py)
    "pack_pick": picking.pack_pick,
    "merge_pairs": picking.merge_pairs,
    "next_position": picking.next_position,
    "stack_drafts": picking.stack_drafts,
    # a divided prompt chunk's micro-batches (compiler/rows_layers.py, regions/micro.py)
    "split_rows": micro.split_rows,
    "join_rows": micro.join_rows,
    "position_order": micro.position_order,
}
# the glue that takes the topology's sizes, by keyword
TOPOLOGY_GLUE: dict[str, Callable[[Topology], dict[str, int]]] = {
    "own_rows": lambda t: {"world": t.world},
    "merge_pairs": lambda t: {"groups": t.groups},
}


def ops(lk: LayerKind, plan: RegionPlan, topo: Topology, dtype: torch.dtype) -> list[Op]:
    """What a layer of kind `lk` runs on a rank of `topo`, in order."""
    slots = dict(lk.slots)
    attn = plan.kinds[slots["attn"]].region
    out: list[Op] = []
    if "engram" in slots:
        out += _engram(plan.kinds[slots["engram"]].region, topo)
    if CAPTURE_SLOT in slots:  # on the h, pre the attention reads; the ring written in place
        out.append(Run(CAPTURE_SLOT, DECODE, outputs=(("written", "captured"),)))
    methods = attn.methods()
    if methods == (DECODE,):
        out.append(Run("attn", DECODE))
    else:
        out += _divided(attn, topo)
    if topo.group_size > 1:  # the heads divided over the token group: its partial streams summed
        out.append(Collective("all_reduce", "h", "h", _groups(topo.token_groups()), to=dtype))
    return out + moe_ops("moe", topo, dtype)


def moe_ops(slot: str, topo: Topology, dtype: torch.dtype) -> list[Op]:
    """The MoE of slot `slot` on the streams h, pre: with EP dispatch, every rank's rows gathered, the
    MoE on them, the partials reduce-scattered back to each rank's rows; else the MoE on this rank's
    rows, its partials all-reduced over the ep ranks where they are several."""
    world = _groups([list(range(topo.world))])
    if not topo.dispatch:
        out: list[Op] = [Run(slot, DECODE)]
        return out + ([Collective("all_reduce", "h", "h", world, to=dtype)] if topo.ep > 1 else [])
    return [
        Collective("all_gather", "h", "h_all", world),
        Collective("all_gather", "pre", "pre_all", world),
        Collective("all_gather", "is_image", "is_image_all", world),
        Run(
            slot,
            DECODE,
            inputs=(("h", "h_all"), ("pre", "pre_all"), ("is_image", "is_image_all")),
            outputs=(("h", "h_part"), ("pre", "pre_rows")),
        ),
        Collective("reduce_scatter", "h_part", "h", world, to=dtype),
        Glue("own_rows", ("pre_rows", "rank"), ("pre",)),
    ]


def _engram(engram: Region, topo: Topology) -> list[Op]:
    """The engram: whole, or its projection divided over the token group, the partials summed between
    its two methods ("engram all-reduce")."""
    if engram.methods() == (DECODE,):
        return [Run("engram", DECODE)]
    kv, mix = engram.methods()
    return [Run("engram", kv), Collective("all_reduce", "kv", "kv", _groups(topo.token_groups())), Run("engram", mix)]


def _divided(attn, topo: Topology) -> list[Op]:
    """The divided attention's stages and merges over the cp groups (regions/divided.py): the query
    rows gathered once, the selection's pairs gathered and merged, the attention's shares merged by
    log-sum-exp; the output's partial streams are summed over the token group after it (`ops`)."""
    cp = _groups(topo.cp_groups())
    out: list[Op] = [Run("attn", "query"), Collective("all_gather", "query", "queries", cp, stack=True)]
    if "select" in attn.methods():
        out += [
            Run("attn", "select"),
            Collective("all_gather", "values", "values_all", cp, stack=True),
            Collective("all_gather", "index", "index_all", cp, stack=True),
            Glue("merge_topk", ("values_all", "index_all"), ("topk",)),
        ]
        if "block_values" in attn.method_outputs("select"):
            out += [
                Collective("all_gather", "block_values", "block_values_all", cp, stack=True),
                Collective("all_gather", "block_index", "block_index_all", cp, stack=True),
                Glue("merge_blocks", ("block_values_all", "block_index_all"), ("cand",)),
            ]
    return out + [
        Run("attn", "attend"),
        Collective("all_reduce", "top", "top_max", cp, reduce="max"),
        Glue("attention_scale", ("numerator", "top", "total", "top_max"), ("numerator_s", "total_s")),
        Collective("all_reduce", "numerator_s", "numerator_sum", cp),
        Collective("all_reduce", "total_s", "total_sum", cp),
        Glue("attention_divide", ("numerator_sum", "total_sum"), ("attention",)),
        Run("attn", "output"),
    ]


def _groups(groups) -> Groups:
    return tuple(tuple(g) for g in groups)


def collectives_of(steps: Sequence[Op]) -> list[dict]:
    """The collectives a layer kind's module holds, for its manifest entry: op, value, groups."""
    return [
        {"op": s.op, "value": s.src, "groups": [list(g) for g in s.groups]} for s in steps if isinstance(s, Collective)
    ]


# --- building a layer kind's module ----------------------------------------------------------------


@dataclass
class Built:
    """A layer module as built: its pieces' graphs, its steps (link's), signature and outputs."""

    steps: list
    pieces: dict[str, str]  # piece name -> StableHLO text
    graphs: dict[str, Graph]  # Run piece name -> its region graph
    params: list[InputSpec]  # the rank, the weights ("<slot>.<name>"), then the layer's inputs
    state_outputs: list[str]
    outputs: list[str]
    ops: list[Op]


Lowered = dict[Exe, tuple[Graph, str]]  # a region piece -> its graph and StableHLO text


def build(spec: Spec, plan: RegionPlan, lk: LayerKind, exe: Exe, memo: Lowered | None = None) -> Built:
    """Lower every piece of `lk` at `exe`'s bucket and wire them: the steps `link` runs. `memo` keeps
    the region pieces lowered by earlier layer kinds of the compile (every kind runs the MoE)."""
    memo = {} if memo is None else memo
    kind_ops, outputs, pieces_at, inputs = _module_of(spec, plan, lk, exe)
    weights: list[InputSpec] = []
    rank: InputSpec | None = None
    made: set[str] = set()
    pieces: dict[str, str] = {}
    graphs: dict[str, Graph] = {}
    steps: list = []
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for op in kind_ops:
        if isinstance(op, Run):
            piece = f"{op.slot}.{op.method}"
            at = pieces_at[(op.slot, op.method)]
            if at not in memo:
                graph = lower(spec, plan, at)
                memo[at] = graph, hlo.to_stablehlo(graph.program, trn2(spec).frontend)
            graph, pieces[piece] = memo[at]
            graphs[piece] = graph
            args, rank = _wire_inputs(op, graph, weights, inputs, made, shapes, rank)
            state = _state_outputs(graph)
            named = dict(op.outputs)
            results = state + [named.get(o, o) for o in graph.entry.outputs]
            steps.append(link.Call(piece, tuple(args), tuple(results)))
            made.update(results)
            for r, v in zip(results, _output_values(graph)):
                shapes[r] = (tuple(v.shape), v.dtype)
        elif isinstance(op, Collective):
            if op.src not in made and op.src not in inputs:  # a layer input moved first (EP dispatch's is_image)
                inputs[op.src] = _layer_input(plan, lk, exe, spec, op.src)
            steps.append(op)
            made.add(op.dst)
            shapes[op.dst] = _collective_shape(op, *_shape_of(op.src, shapes, inputs))
        else:
            args_shapes = [_shape_of(a, shapes, inputs) for a in op.args]
            program, values = _glue_program(_glue_fn(op, spec.topology), args_shapes)
            pieces[op.piece or op.fn] = hlo.to_stablehlo(spec.target.lower(program), trn2(spec).frontend)
            steps.append(link.Call(op.piece or op.fn, op.args, op.results))
            made.update(op.results)
            for r, v in zip(op.results, values):
                shapes[r] = (tuple(v.shape), v.dtype)
    assert rank is not None, "every region takes its rank"
    return Built(
        steps=steps,
        pieces=pieces,
        graphs=graphs,
        params=[rank, *weights, *inputs.values()],  # the rank first, as every region takes it
        state_outputs=[n for n, s in inputs.items() if s.role == "state" and n in made],
        outputs=outputs,
        ops=kind_ops,
    )


def _module_of(spec: Spec, plan: RegionPlan, lk: LayerKind, exe: Exe):
    """What layer module `lk` at `exe` runs: (its ops, its outputs, the region executable each (slot,
    method) piece is lowered as, the inputs it takes that no piece's own would name: a divided chunk's)."""
    pieces_at = plan.pieces(lk, exe, spec.topology.groups if spec.topology.dispatch else 1)
    inputs: dict[str, InputSpec] = {}
    if lk.name == DRAFT_MODULE:
        from deepinfer.compiler import draft_layers

        return draft_layers.ops(plan, spec.topology, spec.dtype), [draft_layers.OUTPUT], pieces_at, inputs
    if exe.method != LAYER_ROWS and lk.name != HEAD_ROWS:
        outputs = ["h", "pre", *plan.kinds[dict(lk.slots)["attn"]].region.output_names()[2:]]
        return ops(lk, plan, spec.topology, spec.dtype), outputs, pieces_at, inputs
    from deepinfer.compiler import rows_layers  # a prompt chunk divided by rows

    g = spec.geometry_at(exe.context)
    if lk.name == HEAD_ROWS:  # it takes the rank's rows of the chunk
        inputs.update(rows_layers.head_inputs(plan, exe, spec.topology.group_size, g))
        return rows_layers.head_ops(spec.topology, exe), rows_layers.head_outputs(exe.method), pieces_at, inputs
    kind_ops, inputs = rows_layers.module(lk, plan, spec.topology, exe, g)
    return kind_ops, rows_layers.outputs(lk, plan), rows_layers.pieces(plan, lk, exe, spec.topology), inputs


def _wire_inputs(
    op: Run,
    graph: Graph,
    weights: list[InputSpec],
    inputs: dict[str, InputSpec],
    made: set[str],
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]],
    rank: InputSpec | None,
) -> tuple[list[str], InputSpec | None]:
    """A region piece's arguments by module name: its weights as `<slot>.<name>` (added to `weights`
    once), the rank, and its other inputs renamed as the op says (a new one added to `inputs`
    unless an earlier step makes it) -> (its arguments, the rank's spec)."""
    rename = dict(op.inputs)
    args = []
    for s in graph.entry.inputs:
        if s.role in ("weight", "rank"):
            name = "rank" if s.role == "rank" else f"{op.slot}.{s.name}"
            if s.role == "rank":
                rank = InputSpec("rank", s.shape, getattr(torch, s.dtype), "rank")
                shapes["rank"] = (tuple(s.shape), rank.dtype)
            elif name not in {w.name for w in weights}:
                weights.append(InputSpec(name, s.shape, getattr(torch, s.dtype), "weight"))
        else:
            name = rename.get(s.name, s.name)
            if name not in made and name not in inputs:
                inputs[name] = InputSpec(name, s.shape, getattr(torch, s.dtype), s.role)
        args.append(name)
    return args, rank


def _layer_input(plan: RegionPlan, lk: LayerKind, exe: Exe, spec: Spec, name: str) -> InputSpec:
    """The spec of layer input `name` at the layer's own bucket: as the first of its regions that takes it."""
    geometry = spec.geometry_at(exe.context)
    for _, kind in lk.slots:
        region = plan.kinds[kind].region
        for method in region.methods():
            for s in region.method_inputs(method, exe.batch, exe.tokens, geometry):
                if s.name == name:
                    return s
    raise hlo.LoweringError(f"no region of layer kind {lk.name} takes an input {name!r}")


def _shape_of(name: str, shapes: dict, inputs: dict[str, InputSpec]) -> tuple[tuple[int, ...], torch.dtype]:
    """(shape, dtype) of value `name`: made by a step before, or a layer input."""
    if name in shapes:
        return shapes[name]
    s = inputs.get(name)
    if s is None:
        raise hlo.LoweringError(f"no value named {name!r} before it is read")
    return tuple(s.shape), s.dtype


def _collective_shape(
    op: Collective, shape: tuple[int, ...], dtype: torch.dtype
) -> tuple[tuple[int, ...], torch.dtype]:
    n = len(op.groups[0])
    out = list(shape)
    if op.op == "all_gather":
        if op.stack:
            out = [n, *out]
        else:
            out[op.dim] *= n
    elif op.op == "reduce_scatter":
        out[op.dim] //= n
    return tuple(out), op.to or dtype


def _glue_fn(op: Glue, topo: Topology):
    sizes = {**(TOPOLOGY_GLUE[op.fn](topo) if op.fn in TOPOLOGY_GLUE else {}), **dict(op.kwargs)}
    return functools.partial(GLUE[op.fn], **sizes) if sizes else GLUE[op.fn]


class _Glue(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        out = self.fn(*args)
        return tuple(out) if isinstance(out, tuple) else (out,)


def _glue_program(fn, args_shapes) -> tuple[torch.export.ExportedProgram, list[torch.Tensor]]:
    """`fn` exported at its arguments' shapes (zeros: it has no data-dependent shapes) -> (the
    program, its outputs there, whose shapes name the next steps' values)."""
    args = tuple(torch.zeros(shape, dtype=dtype) for shape, dtype in args_shapes)
    module = _Glue(fn)
    with torch.no_grad():
        values = list(module(*args))
        program = torch.export.export(module, args)
    return program, values


def _state_outputs(graph: Graph) -> list[str]:
    """The state inputs a piece writes, in its output order (the region's mutations come first)."""
    ep = graph.program
    user = [s.arg.name for s in ep.graph_signature.input_specs if s.kind.name == "USER_INPUT"]
    return [
        graph.names[user.index(o.target)]
        for o in ep.graph_signature.output_specs
        if o.kind.name == "USER_INPUT_MUTATION"
    ]


def _output_values(graph: Graph) -> list:
    return [a.meta["val"] for a in graph.program.graph.output_node().args[0]]


def entry_of(spec: Spec, exe: Exe, built: Built) -> mf.Executable:
    """The layer executable's manifest entry (the target's fields are added by `emit`)."""
    return mf.Executable(
        kind=exe.kind,
        method=exe.method,
        bucket=mf.Shape(batch=exe.batch, tokens=exe.tokens, context=exe.context),
        artifact=layout.executable_path(*exe, spec.target.suffix),
        executable=spec.target.executable,
        inputs=tuple(
            mf.TensorSpec(name=s.name, shape=tuple(s.shape), dtype=str(s.dtype).removeprefix("torch."), role=s.role)
            for s in built.params
        ),
        outputs=tuple(built.outputs),
        scratch_bytes=max((budget.scratch_bytes(g.program) or 0 for g in built.graphs.values()), default=0),
    )


def emit(spec: Spec, exe: Exe, built: Built, out: Path) -> tuple[mf.Executable, str]:
    """Link, finish and write the layer module to `out` -> (its manifest entry, its StableHLO text)."""
    names = [s.name for s in built.params]
    params = [(s.name, link.tensor_type(s.shape, s.dtype)) for s in built.params]
    labels = built.state_outputs + built.outputs
    try:
        text = link.link(params, built.pieces, built.steps, labels)
        aliases = {j: names.index(n) for j, n in enumerate(built.state_outputs)}
        text = hlo.finish_module(text, aliases, names, [neff.output_name(n) for n in labels])
        proto = hlo.to_hlo_proto(text)
    except DeepinferError as e:
        raise type(e)(f"layer {exe.name}: {e}") from None
    trn2(spec).refuse_wide_selections(proto)
    out.write_bytes(proto)
    types = link.result_types(text)
    entry = entry_of(spec, exe, built)
    entry = dataclasses.replace(
        entry,
        state_outputs=tuple(built.state_outputs),
        aliases=aliases,
        output_specs=tuple(mf.TensorSpec(name=n, shape=s, dtype=d) for n, (s, d) in zip(labels, types)),
    )
    fields: dict = {"collectives": collectives_of(built.ops)}
    if exe.method == LAYER_ROWS or exe.kind == HEAD_ROWS:
        fields["passes"] = fused_passes(exe.tokens, spec.topology.group_size)
    fields = {k: v for k, v in fields.items() if v and v != 1}
    return dataclasses.replace(entry, **manifest_io.executable_fields(fields)), text


def trn2(spec: Spec) -> Trn2Target:
    """The compile's target: only trn2 fuses layers."""
    assert isinstance(spec.target, Trn2Target), "only the trn2 target fuses layers"
    return spec.target


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


# --- the reference: the same ops, eagerly, one rank after another --------------------------------------


def interpret(
    built: Built,
    regions: Mapping[str, Region],
    ranks: Sequence[dict[str, torch.Tensor]],
    topo: Topology,
) -> list[list[torch.Tensor]]:
    """Run the layer's ops eagerly for every rank in `ranks` (each: its parameters by name), the
    pieces as their regions' torch code (`regions`: slot -> region holding the slot's weights) and the
    collectives as the host computes them -> each rank's outputs (state outputs, then the outputs)."""
    envs = [dict(r) for r in ranks]
    for op, call in zip(built.ops, built.steps, strict=True):  # a step an op (a piece may run twice)
        if isinstance(op, Run):
            graph = built.graphs[call.piece]
            n_weights = sum(1 for s in graph.entry.inputs if s.role in ("weight", "rank"))
            state = _state_outputs(graph)
            for env in envs:
                region = regions[op.slot].with_weights({**_buffers(regions[op.slot]), "rank": env["rank"]})
                args = [env[a].clone() for a in call.args[n_weights:]]
                names = [s.name for s in graph.entry.inputs[n_weights:]]
                with torch.no_grad():
                    out = getattr(region, op.method)(*args)
                out = list(out) if isinstance(out, (tuple, list)) else [out]
                env.update(zip(call.results, [args[names.index(n)] for n in state] + out))
        elif isinstance(op, Glue):
            fn = _glue_fn(op, topo)
            for env in envs:
                out = fn(*[env[a] for a in op.args])
                env.update(zip(op.results, out if isinstance(out, tuple) else (out,)))
        else:
            _host_collective(op, envs)
    labels = built.state_outputs + built.outputs
    return [[env[n] for n in labels] for env in envs]


def _buffers(region: Region) -> dict[str, torch.Tensor]:
    return {k: v for k, v in region._buffers.items() if v is not None}


def _host_collective(op: Collective, envs: list[dict]) -> None:
    for group in op.groups:
        values = [envs[r][op.src] for r in group]
        if op.op == "all_gather":
            result = torch.stack(values) if op.stack else torch.cat(values, op.dim)
            parts = [result] * len(group)
        else:
            stacked = torch.stack([v.float() for v in values])
            total = stacked.amax(0) if op.reduce == "max" else stacked.sum(0)
            parts = list(total.chunk(len(group), op.dim)) if op.op == "reduce_scatter" else [total] * len(group)
        for r, part in zip(group, parts):
            envs[r][op.dst] = part.to(op.to) if op.to is not None else part.to(values[0].dtype)


def check(spec: Spec, plan: RegionPlan, lk: LayerKind, exe: Exe, built: Built, proto: Path, log: Log) -> dict | None:
    """Run the layer module on XLA:CPU, one replica a rank, against `interpret` on the same inputs: each
    slot's seeded random weights (as the weight recipe stores them) and the bucket's example inputs.
    Returns the figures for the manifest entry; None where the world has more ranks than XLA:CPU
    replicas here (said in the log: tests/trn2/test_layers.py runs the layouts)."""
    from deepinfer.compiler.weights import in_format
    from deepinfer.regions.agreement import tolerance

    topo = spec.topology
    world = topo.world
    if world > hlo.MAX_REPLICAS:
        log(f"lowered {exe.name}: {world} ranks, more than the {hlo.MAX_REPLICAS} XLA:CPU replicas here: not run")
        return None
    slots = dict(lk.slots)
    regions, flat_weights = {}, {}
    for slot, kind in slots.items():
        region = plan.kinds[kind].region
        stored = in_format(region.specs, random_weights(region, 0), region.fp8_format)
        regions[slot] = region.with_weights(stored)
        flat_weights.update({f"{slot}.{k}": v for k, v in stored.items() if k != "rank"})
    inputs = [s for s in built.params if s.role not in ("weight", "rank")]
    values = dict(zip([s.name for s in inputs], example_inputs(inputs, spec.geometry_at(exe.context))))
    ranks = [{**flat_weights, **values, "rank": torch.tensor(r)} for r in range(world)]
    names = [s.name for s in built.params]
    flats = [[rank[n].clone() for n in names] for rank in ranks]
    program = hlo.CpuReplicas(proto.read_bytes(), world) if world > 1 else None
    got = program(flats) if program is not None else [hlo.CpuHlo(proto.read_bytes())(flats[0])]
    refs = interpret(built, regions, ranks, topo)
    labels = built.state_outputs + built.outputs
    where = f"layer {exe.name}"
    for label, ref in zip(labels, refs[0]):
        if ref.is_floating_point() and bool(ref.isnan().any()):
            raise CheckFailed(
                f"{where}: the reference's {label} holds NaN on the check's inputs: it would prove nothing"
            )
    diffs = []
    for g, r in zip(got, refs):
        diffs += trn2(spec).agree(g, r, labels, spec.dtype, where)
    if not diffs:
        raise CheckFailed(f"{where}: nothing to compare")
    return {
        "max_abs": max(d.max_abs for d in diffs),
        "score": max(d.score for d in diffs),
        "tolerance": tolerance(spec.dtype),
        "replicas": world,
    }


def trace(
    spec: Spec, plan: RegionPlan, lk: LayerKind, exe: Exe, lowered: Path, log: Log, memo: Lowered | None = None
) -> tuple[mf.Executable, str, list[str]]:
    """The trace pass's steps for a fused layer: lower its pieces (`memo`: those lowered before),
    link and write its module to `lowered`, check it (unless the target's check is off) -> (its
    manifest entry, the digest of its module, the kernels its pieces reach)."""
    built = build(spec, plan, lk, exe, memo)
    entry, text = emit(spec, exe, built, lowered)
    if not spec.target.check:
        log(f"lowered {exe.name}: HLO {lowered.stat().st_size} bytes (check off)")
    else:
        result = check(spec, plan, lk, exe, built, lowered, log)
        if result is not None:
            entry = dataclasses.replace(entry, check=result)
            log(
                f"lowered {exe.name}: HLO {lowered.stat().st_size} bytes, {len(entry.collectives or ())} collectives, "
                f"XLA:CPU on {result['replicas']} replica(s) vs the ops run eagerly: max |diff| "
                f"{result['max_abs']:.2g}, score {result['score']:.2g} (tolerance {result['tolerance']:g})"
            )
    kernels = sorted({k for g in built.graphs.values() for k in g.kernels})
    return entry, digest(text), kernels
