"""A prompt chunk divided by rows as one execution a layer (trn2's fused path, issue 41): the stages of
regions/rows.py and regions/moe.py's divided methods, with the collectives between them inside one
module, as compiler/layers.py builds a layer's decode.

On the cpu target a divided chunk runs each stage as a region call with the ranks' collectives on the
host between them (`regions.step.rows_steps`): 5 to 8 executions and 3 to 5 host collectives a layer.
Here a fused layer kind has a second method, `manifest.LAYER_ROWS`, built at each prompt bucket of a
bundle compiled with `[prompt] rows = "divided"` (`RegionPlan.fused_executables`). Its module takes a
rank's T / d rows of the chunk's streams (h, pre) and gives them back through the layer (`ops`):

    engram (where the layer has one): kv on every row of the chunk (the rank's input columns of the
        looked-up rows) -> reduce-scatter of the partial keys and value along the rows -> rows_mix on
        the rank's rows
    rows_in on the rank's rows -> all-gather of the packed window latents (and compressor projections)
        along the rows: the chunk's
    a kv source: rows_write (every rank pools the chunk's groups, writes the entries it owns) ->
        all-gather of every rank's pages of the sequence (stacked) -> outputs `ckv_pages`,
        `ikeys_pages`, which the source's reindex and reuse layers take as inputs
    rows_attend on the rank's rows (every head; the selection over the joined context)
    MoE: moe_in on the rank's rows -> all-gather of x and the routing along the rows -> moe_experts on
        every row (the rank's columns of every expert) -> reduce-scatter of the float32 partials along
        the rows -> moe_out on the rank's rows

Where a rank's rows of the chunk split in two (`prompt_rows.fused_passes`), the module runs the chunk
as two micro-batches of half of it (`micro`; regions/micro.py runs them so on the cpu target): the
rank's rows arrive in micro order (`regions.micro.micro_rows`), glue splits them and the chunk's inputs
per micro-batch, each micro-batch runs the ops above on its half, and the two interleave between
collectives (A1 B1 A2 B2 ...), so that one's collective can be on the links while the other computes.
B's stages of a layer read the state A's wrote (the state values keep their names), as two
consecutive chunks do; glue joins the rows' outputs, and a kv source gives B's gathered pages (every
entry of the chunk; A's causal masks never select B's). The head puts the gathered rows back in
position order.

The groups are the token group's ranks: divided rows need tp = 1 and ep = cp, so a token group is
every rank (compiler/config.py). A row's streams never leave the device: the embedding takes the rank's
rows' tokens (its executable at T / d tokens), and after the last layer the head is one module too
(`manifest.HEAD_ROWS`, `head_ops`): the rank's rows of h and pre all-gathered along the rows, then the
head's `decode` (this rank's vocabulary slice of every row's logits) or `best` (their greedy pairs).

The compile checks each module on XLA:CPU against the same ops run eagerly (`layers.check`);
tests/trn2/test_rows_layers.py runs it against the cpu runtime's stage calls (`rows_steps`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

from deepinfer.bundles.manifest import (
    BEST,
    DECODE,
    ENGRAM_ROWS_MIX,
    MOE_EXPERTS,
    MOE_IN,
    MOE_OUT,
    OWN_POSITIONS,
    PAGES,
    ROWS_SLOT,
)
from deepinfer.bundles.topology import Topology
from deepinfer.compiler.layers import Glue, Op, Run, _groups
from deepinfer.compiler.plan import Exe, LayerKind, RegionPlan
from deepinfer.compiler.prompt_rows import fused_passes
from deepinfer.compiler.targets.hlo import Collective
from deepinfer.regions.rows import ROWS_ATTEND, ROWS_IN, ROWS_WRITE
from deepinfer.regions.state import Geometry, InputSpec
from deepinfer.regions.topology import ENGRAM_KV

ROWS = 1  # the token dim of a stage's [B, T, ...] values: the gathers and scatters run along it


def module(lk: LayerKind, plan: RegionPlan, topo: Topology, exe: Exe, g: Geometry) -> tuple[list[Op], dict]:
    """What layer kind `lk` runs on a rank's rows of a divided prompt chunk at `exe`'s bucket, in order
    (`one_pass`, or its micro-batches', `micro`), and the module's inputs by name."""
    one = one_pass(lk, plan, topo)
    named, full = explicit(one, lk, plan, exe.batch, exe.tokens, g)
    m = fused_passes(exe.tokens, topo.group_size)
    if m == 1:
        return one, full
    _, part = explicit(one, lk, plan, exe.batch, exe.tokens // m, g)
    return micro(named, m, full, part, outputs(lk, plan)), full


def pieces(plan: RegionPlan, lk: LayerKind, exe: Exe, topo: Topology) -> dict[tuple[str, str], Exe]:
    """The region executable each piece of the rows module at `exe` is lowered as: at a micro-batch's
    tokens, where the module runs the chunk as several."""
    return plan.pieces(lk, exe._replace(tokens=exe.tokens // fused_passes(exe.tokens, topo.group_size)))


def one_pass(lk: LayerKind, plan: RegionPlan, topo: Topology) -> list[Op]:
    """What layer kind `lk` runs on a rank's rows of a divided prompt chunk in one pass, in order."""
    slots = dict(lk.slots)
    group = _groups(topo.token_groups())
    out: list[Op] = []
    if "engram" in slots:
        out += [
            Run("engram", ENGRAM_KV),
            Collective("reduce_scatter", "kv", "kv", group, dim=ROWS),
            Run("engram", ENGRAM_ROWS_MIX),
        ]
    out += [
        Run(ROWS_SLOT, ROWS_IN, inputs=(("positions", OWN_POSITIONS),)),
        Collective("all_gather", "packed", "packed", group, dim=ROWS),
    ]
    if ROWS_WRITE in plan.kinds[slots[ROWS_SLOT]].region.methods():
        out += [Run(ROWS_SLOT, ROWS_WRITE, outputs=tuple((p, f"{p}_mine") for p in PAGES))]
        out += [Collective("all_gather", f"{p}_mine", p, group, stack=True) for p in PAGES]
    gathered = (("x", "x_all"), ("weights", "weights_all"), ("experts", "experts_all"))
    return out + [
        Run(ROWS_SLOT, ROWS_ATTEND),
        Run("moe", MOE_IN),
        *(Collective("all_gather", mine, every, group, dim=ROWS) for mine, every in gathered),
        Run("moe", MOE_EXPERTS, inputs=gathered),
        Collective("reduce_scatter", "partial", "out", group, dim=ROWS),
        Run("moe", MOE_OUT),
    ]


def explicit(one: list[Op], lk: LayerKind, plan: RegionPlan, B: int, T: int, g: Geometry):
    """Ops `one` on a [B, T] chunk with every region input and output named (each Run's `inputs` and
    `outputs` listing all of its method's), and the module's inputs by value name, in the order its
    steps first read them (the values no step before makes; not the weights and the rank)."""
    slots = dict(lk.slots)
    made: set[str] = set()
    inputs: dict[str, InputSpec] = {}
    out: list[Op] = []
    for op in one:
        if isinstance(op, Collective):
            made.add(op.dst)
            out.append(op)
            continue
        assert isinstance(op, Run), "a rows module's pass has no glue"
        region = plan.kinds[slots[op.slot]].region
        rename, named = dict(op.inputs), dict(op.outputs)
        specs = region.method_inputs(op.method, B, T, g)
        for s in specs:
            name = rename.get(s.name, s.name)
            if name not in made and name not in inputs:
                inputs[name] = InputSpec(name, s.shape, s.dtype, s.role)
        results = tuple((o, named.get(o, o)) for o in region.method_outputs(op.method))
        made.update(v for _, v in results)
        out.append(Run(op.slot, op.method, tuple((s.name, rename.get(s.name, s.name)) for s in specs), results))
    return out, inputs


def micro(one: list[Op], m: int, full: dict[str, InputSpec], part: dict[str, InputSpec], outs: list[str]) -> list[Op]:
    """Ops `one` run as `m` micro-batches of the chunk (`full`, `part`: the module's inputs at the chunk
    and at a micro-batch): the inputs that differ split along the rows; each pass's values suffixed
    `.j` but the state and the inputs the passes share (the sequences' slots and tables, a kv source's
    pages); the passes interleaved between collectives; the rows' outputs joined; the outputs not of
    the rows (a kv source's gathered pages) the last pass's."""
    split = [v for v, s in full.items() if s.shape != part[v].shape]
    bare = {v for v, s in full.items() if s.role == "state" or v not in split}
    last = {o for o in outs if o in PAGES}

    def name(v: str, j: int) -> str:
        return v if v in bare or (v in last and j == m - 1) else f"{v}.{j}"

    out: list[Op] = [
        Glue("split_rows", (v,), tuple(name(v, j) for j in range(m)), (("parts", m),), f"split.{v}") for v in split
    ]
    segments: list[list[Op]] = [[]]
    for op in one:
        segments[-1].append(op)
        if isinstance(op, Collective):
            segments.append([])
    for segment in segments:
        for j in range(m):
            out += [_renamed(op, functools.partial(name, j=j)) for op in segment]
    joined = [o for o in outs if o not in last]
    return out + [Glue("join_rows", tuple(name(o, j) for j in range(m)), (o,), piece=f"join.{o}") for o in joined]


def _renamed(op: Op, name: Callable[[str], str]) -> Op:
    """`op` (a Collective, or a Run naming all its values: `explicit`) on the values `name` gives."""
    if isinstance(op, Collective):
        return dataclasses.replace(op, src=name(op.src), dst=name(op.dst))
    assert isinstance(op, Run)
    inputs, outputs = (tuple((k, name(v)) for k, v in pairs) for pairs in (op.inputs, op.outputs))
    return dataclasses.replace(op, inputs=inputs, outputs=outputs)


def outputs(lk: LayerKind, plan: RegionPlan) -> list[str]:
    """The module's outputs: the rank's rows' streams (h, pre), its rows' carries (the selection, the
    candidate pool) where the attention makes them, and a kv source's joined context."""
    twin = plan.kinds[dict(lk.slots)[ROWS_SLOT]].region
    pages = list(PAGES) if ROWS_WRITE in twin.methods() else []
    return ["h", "pre", *twin.method_outputs(ROWS_ATTEND)[2:], *pages]


def head_ops(topo: Topology, exe: Exe) -> list[Op]:
    """The head of a divided chunk: the rank's rows gathered along the rows (put back in position order
    where they came in micro order), then its method."""
    group, d = _groups(topo.token_groups()), topo.group_size
    m = fused_passes(exe.tokens, d)
    out: list[Op] = []
    for v in ("h", "pre"):
        out.append(Collective("all_gather", v, v if m == 1 else f"{v}.ranks", group, dim=ROWS))
        if m > 1:
            out.append(Glue("position_order", (f"{v}.ranks",), (v,), (("ranks", d), ("parts", m)), f"order.{v}"))
    return [*out, Run("head", exe.method)]


def head_inputs(plan: RegionPlan, exe: Exe, group: int, geometry: Geometry) -> dict[str, InputSpec]:
    """The head module's inputs: the rank's T / `group` rows of the chunk's streams."""
    specs = plan.kinds["head"].region.method_inputs(DECODE, exe.batch, exe.tokens // group, geometry)
    return {s.name: s for s in specs}


def head_outputs(method: str) -> list[str]:
    return [BEST if method == BEST else "logits"]
