"""One HLO module from several: a layer's region stages and the collectives between them.

A step of a layer on trn2 is one device execution (issue 29): its engram, its attention (the divided
attention's stages and their merges), its MoE and every collective a boundary needs run inside one
module. Each piece is lowered on its own, as the per-region form lowers it (StableHLO text whose
@main is the piece), and `link` splices them into one @main: each piece's body moved in place, its
parameters replaced by the values the steps before it made, with the collectives between them
written in the form AWS's own HLO producers write (replica_groups; no channel_id, no replica count:
neuronx-cc takes the world from the runtime's collective load). The result is flat (no calls), so
neuronx-cc and XLA:CPU see one computation, and `hlo.finish_module` names, aliases and tuples it as
it does a region's module.

Values are named: the layer's parameters by their input names, each step's results by the names the
step gives them; a later step reads them by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deepinfer.compiler.targets.hlo import MLIR_TYPES, Collective, LoweringError, _need, collective


@dataclass(frozen=True)
class Call:
    """Run piece `piece` (StableHLO text with @main) on the values `args` (one per parameter, in
    order); its results are named `results` (one per result, in order)."""

    piece: str
    args: tuple[str, ...]
    results: tuple[str, ...]


Step = Call | Collective


def tensor_type(shape: Sequence[int], dtype: torch.dtype) -> str:
    """The MLIR type text of a tensor (`tensor<2x3xf32>`; a scalar: `tensor<i64>`)."""
    if dtype not in MLIR_TYPES:
        raise LoweringError(f"no HLO element type for {dtype}")
    return "tensor<" + "".join(f"{d}x" for d in shape) + MLIR_TYPES[dtype] + ">"


def link(
    params: Sequence[tuple[str, str]], pieces: dict[str, str], steps: Sequence[Step], results: Sequence[str]
) -> str:
    """StableHLO text of one @main(params) -> results running `steps` in order. `params`: (name, MLIR
    tensor type) of each parameter; `pieces`: name -> StableHLO text whose @main a `Call` runs (used
    once each). Raises LoweringError naming the step where a name or type does not match."""
    _need("jax")
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import func

    with mlir.make_ir_context(), ir.Location.unknown():
        out = ir.Module.create()
        types = [ir.Type.parse(t) for _, t in params]
        with ir.InsertionPoint(out.body):
            main = func.FuncOp("main", ir.FunctionType.get(types, []))
        block = main.add_entry_block()  # type: ignore[attr-defined]  # the generated stubs lack it
        env: dict[str, ir.Value] = {name: block.arguments[i] for i, (name, _) in enumerate(params)}
        if len(env) != len(params):
            raise LoweringError("the linked module's parameter names repeat")
        with ir.InsertionPoint(block):
            anchor = func.ReturnOp([])  # steps are placed before it; replaced by the real return
        parsed: list = []  # the pieces' modules stay alive until their bodies are moved
        for n, step in enumerate(steps):
            where = f"step {n} ({step.piece if isinstance(step, Call) else step.op + ' of ' + step.src})"
            if isinstance(step, Call):
                if step.piece not in pieces:
                    raise LoweringError(f"{where}: no piece named {step.piece!r}")
                module = ir.Module.parse(pieces[step.piece])
                parsed.append(module)
                outs = _splice(module, step, env, anchor, where)
                env.update(zip(step.results, outs))
            else:
                if step.src not in env:
                    raise LoweringError(f"{where}: no value named {step.src!r} before it")
                with ir.InsertionPoint(anchor):
                    env[step.dst] = collective(step, env[step.src], where)
        missing = [r for r in results if r not in env]
        if missing:
            raise LoweringError(f"the linked module returns {', '.join(missing)}, which no step makes")
        with ir.InsertionPoint(anchor):
            func.ReturnOp([env[r] for r in results])
        anchor.operation.erase()
        main.attributes["function_type"] = ir.TypeAttr.get(ir.FunctionType.get(types, [env[r].type for r in results]))
        if not out.operation.verify():
            raise LoweringError("the linked module does not verify")
        asm = out.operation.get_asm(enable_debug_info=False)
        assert isinstance(asm, str)
        return asm


def _splice(module, step: Call, env: dict, anchor, where: str) -> list:
    """Move the body of `module`'s @main before `anchor`, its parameters bound to `env`'s values of
    `step.args` -> the values it returns."""
    from jax._src.lib.mlir import ir

    funcs = [op for op in module.body.operations if op.operation.name == "func.func"]
    names = [ir.StringAttr(f.attributes["sym_name"]).value for f in funcs]
    if names != ["main"]:
        raise LoweringError(f"{where}: a piece must hold @main alone (it holds {', '.join('@' + n for n in names)})")
    body = funcs[0].regions[0].blocks[0]
    if len(body.arguments) != len(step.args):
        raise LoweringError(f"{where}: @main takes {len(body.arguments)} parameters, {len(step.args)} were named")
    ops = list(body.operations)
    ret = ops[-1]
    outs = list(ret.operands)
    if len(outs) != len(step.results):
        raise LoweringError(f"{where}: @main returns {len(outs)} results, {len(step.results)} were named")
    for arg, name in zip(body.arguments, step.args):  # every check before anything moves: the IR of
        # two modules tied together half way would outlive neither safely
        value = env.get(name)
        if value is None:
            raise LoweringError(f"{where}: no value named {name!r} before it")
        if value.type != arg.type:
            raise LoweringError(f"{where}: {name} is {value.type}, the piece takes {arg.type}")
    for arg, name in zip(body.arguments, step.args):
        arg.replace_all_uses_with(env[name])
    outs = list(ret.operands)  # again: a result that is a parameter passed through is now env's value
    for op in ops[:-1]:
        op.move_before(anchor)
    funcs[0].operation.erase()  # its return's uses of the moved values go before the module does
    return outs


# MLIR element type -> torch dtype name (the manifest's)
TORCH_NAMES = {t: str(d).removeprefix("torch.") for d, t in MLIR_TYPES.items()}


def result_types(text: str) -> list[tuple[tuple[int, ...], str]]:
    """(shape, torch dtype name) of each element of @main's result tuple (a finished module)."""
    _need("jax")
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir

    with mlir.make_ir_context():
        module = ir.Module.parse(text)
        main = next(op for op in module.body.operations if ir.StringAttr(op.attributes["sym_name"]).value == "main")
        (result,) = ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value).results
        out = []
        tuple_type = ir.TupleType(result)
        for i in range(tuple_type.num_types):
            ranked = ir.RankedTensorType(tuple_type.get_type(i))
            out.append((tuple(ranked.shape), TORCH_NAMES[str(ranked.element_type)]))
        return out
