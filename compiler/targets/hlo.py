"""Traced region -> XLA HLO (HloModuleProto) for neuronx-cc, and running it on XLA:CPU.

    ExportedProgram (static shapes, state writes returned as outputs)
      -> StableHLO       torch-mlir's FX importer (front end "torch-mlir"), or
                         torch-xla's exporter (front end "torch-xla", on Neuron images)
      -> HloModuleProto  jaxlib's MLIR -> XLA computation converter
      -> XLA:CPU         jaxlib's PJRT CPU client, to check every graph numerically

State pools are inputs whose new contents come back as outputs; each such
output is declared a must-alias of its input (the HLO module's
input_output_alias), so the device updates the pool in place rather than
copying it. Parameters and the root tuple carry the NEFF tensor names
(`finish_module`).

The heavy libraries (torch-mlir, jax/jaxlib, torch-xla) are imported lazily:
a missing one is a `LoweringUnavailable` naming the package and how to install it.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from deepinfer.bundles.topology import partitions
from deepinfer.errors import DeepinferError

FRONTENDS = ("torch-mlir", "torch-xla")
INSTALL = {
    "torch_mlir": "pip install 'deepinfer[trn2]' (torch-mlir from PyPI)",
    "jax": "pip install 'deepinfer[trn2]' (jax and jaxlib from PyPI)",
    "torch_xla": 'use a Neuron image (torch-xla ships with torch-neuronx) or choose frontend = "torch-mlir"',
}


class LoweringUnavailable(DeepinferError):
    """A package the HLO lowering needs is not installed."""


class LoweringError(DeepinferError):
    """A graph could not be lowered to HLO."""


def _need(module: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise LoweringUnavailable(
            f"the trn2 target needs {module.replace('_', '-')} to lower graphs to HLO ({e}); {INSTALL[module]}"
        ) from None


@functools.cache
def versions(frontend: str) -> dict[str, str]:
    """Versions of the lowering toolchain (they go into cache keys and the manifest)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for dist in ("jax", "jaxlib", "torch-mlir" if frontend == "torch-mlir" else "torch-xla"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = "absent"
    return out


# --- decompositions for ops the StableHLO legalization lacks -------------------------------------


def _rshift(x, k):
    return torch.floor_divide(x, 2 ** int(k))  # arithmetic shift == floor division by 2^k


def _lshift(x, k):
    return x * (2 ** int(k))  # wraps like the shift in two's complement


def _sort(x, *, stable=None, dim=-1, descending=False):
    # torch-mlir lowers aten.sort only; finish_module() makes every lowered sort stable
    return torch.ops.aten.sort.default(x, dim, descending)


def _remainder(a, b):
    # torch-mlir lowers remainder to stablehlo.remainder, whose sign follows the dividend
    # (C fmod); torch's follows the divisor. Negative ring offsets need torch's.
    return a - torch.div(a, b, rounding_mode="floor") * b


def _widened(op):
    """`op` with uint8 operands widened to int32: torch-mlir emits signed comparisons for
    uint8, which the HLO verifier rejects. Other dtypes fall through to the op itself."""

    def run(a, b, *rest):
        if a.dtype != torch.uint8 and not (isinstance(b, torch.Tensor) and b.dtype == torch.uint8):
            return NotImplemented

        def widen(x):
            return x.to(torch.int32) if isinstance(x, torch.Tensor) and x.dtype == torch.uint8 else x

        return op(widen(a), widen(b), *rest)

    return run


def hlo_decompositions() -> dict:
    """aten ops torch-mlir cannot lower to StableHLO (or lowers wrongly) -> equivalent ones."""
    aten = torch.ops.aten
    table = {
        aten.__rshift__.Scalar: _rshift,
        aten.__lshift__.Scalar: _lshift,
        aten.sort.stable: _sort,
        aten.remainder.Scalar: _remainder,
        aten.remainder.Tensor: _remainder,
    }
    for name in ("eq", "ne", "lt", "le", "gt", "ge"):
        for overload in ("Scalar", "Tensor"):
            op = getattr(getattr(aten, name), overload)
            table[op] = _widened(op)
    return table


# --- front ends -----------------------------------------------------------------------------------


def to_stablehlo(ep: torch.export.ExportedProgram, frontend: str = "torch-mlir") -> str:
    """A decomposed, functional ExportedProgram -> StableHLO text (function @main)."""
    if frontend == "torch-xla":
        _need("torch_xla")
        # optional, and not among the type-checked dependencies (no wheel for every host)
        stablehlo = importlib.import_module("torch_xla.stablehlo")
        return stablehlo.exported_program_to_stablehlo(ep).get_stablehlo_text("forward")
    _need("torch_mlir")
    from torch_mlir import fx
    from torch_mlir.compiler_utils import TorchMlirCompilerError

    try:
        module = fx.export_and_import(ep, output_type="stablehlo", func_name="main")
    except TorchMlirCompilerError as e:
        lines = [l for l in str(e).splitlines() if "error:" in l] or str(e).splitlines()[:1]
        raise LoweringError(f"torch-mlir could not lower to StableHLO: {lines[0].strip()}") from None
    return module.operation.get_asm(enable_debug_info=False)


def _walk(op):
    yield op
    for region in op.regions:
        for block in region.blocks:
            for inner in block.operations:
                yield from _walk(inner)


def finish_module(
    text: str,
    aliases: dict[int, int],
    input_names: list[str],
    output_names: list[str],
    reduce: dict[int, list[list[int]]] | None = None,
    reduced_dtype: torch.dtype | None = None,
) -> str:
    """The StableHLO edits neuronx-cc and libnrt need, through the MLIR API:

    - every `stablehlo.sort` becomes stable. torch-mlir lowers only `aten.sort`, with
      is_stable = false; the indexer's top-k needs the lowest index among equal scores
      (see kernels/select.py), and a stable sort is a valid unstable one;
    - {j: i} in `aliases` makes output j a must-alias of parameter i (the module's
      `mhlo.input_output_alias`, kind must_alias): the runtime binds one device buffer as
      both, and the compiler must write the pool in place (a may-alias leaves it free to
      write elsewhere and return the copy, which a bound-twice buffer would not see);
    - parameter i carries the frontend attribute `neff_input_names = input_names[i]`, and the
      root, an explicit tuple, `neff_output_names` = the comma-joined `output_names`: the
      NEFF's tensors then have our names, so the runtime binds by name and never by libnrt's
      (lexical) order of tensors;
    - a result that is a parameter unchanged is returned through a `copy` (neuronx-cc cannot
      return a raw parameter);
    - {j: groups} in `reduce` sums output j over each replica group inside the module: a
      `stablehlo.all_reduce` in the form AWS's own HLO producers write (replica_groups and an
      add as to_apply; no channel_id, no replica count: neuronx-cc takes the world from the
      runtime's collective load), on floating outputs only (neuronx-cc rejects an integer
      all-reduce, NCC_EVRF061), then converted to `reduced_dtype` where given (the float32
      partials' sum becomes the activation dtype the next region reads, as the host path casts).
    """
    _need("jax")
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir

    for name in (*input_names, *output_names):
        if not name or "," in name:
            raise LoweringError(f"tensor name {name!r} cannot be a NEFF tensor name (empty or with a comma)")
    with mlir.make_ir_context(), ir.Location.unknown():
        module = ir.Module.parse(text)
        main = None
        for op in module.body.operations:
            for inner in _walk(op):
                if inner.operation.name == "stablehlo.sort":
                    inner.attributes["is_stable"] = ir.BoolAttr.get(True)
            if "sym_name" in op.attributes and ir.StringAttr(op.attributes["sym_name"]).value == "main":
                main = op
        if main is None:
            raise LoweringError("no @main function in the lowered module")
        _name_inputs(main, input_names)
        if reduce:
            _reduce_results(main, reduce, output_names, reduced_dtype)
        _tuple_root(main, output_names)
        if aliases:
            module.operation.attributes["mhlo.input_output_alias"] = _must_alias(aliases)
        asm = module.operation.get_asm(enable_debug_info=False)
        assert isinstance(asm, str)  # text, not bytecode: binary=False
        return asm


def _frontend(**attrs: str):
    from jax._src.lib.mlir import ir

    return ir.DictAttr.get({k: ir.StringAttr.get(v) for k, v in attrs.items()})


def _name_inputs(main, names: list[str]) -> None:
    from jax._src.lib.mlir import ir

    n = len(main.regions[0].blocks[0].arguments)
    if len(names) != n:
        raise LoweringError(f"@main takes {n} parameters, {len(names)} input names were given")
    old = (
        list(ir.ArrayAttr(main.attributes["arg_attrs"]))
        if "arg_attrs" in main.attributes
        else [ir.DictAttr.get({}) for _ in range(n)]
    )
    new = []
    for name, attrs in zip(names, old):
        entries = ir.DictAttr(attrs)
        d = {entries[i].name: entries[i].attr for i in range(len(entries))}
        d["mhlo.frontend_attributes"] = _frontend(neff_input_names=name)
        new.append(ir.DictAttr.get(d))
    main.attributes["arg_attrs"] = ir.ArrayAttr.get(new)


def _tuple_root(main, names: list[str]) -> None:
    """@main returns one explicit tuple (named, parameters copied) instead of its results."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import func
    from jax._src.lib.mlir.dialects import hlo as stablehlo

    block = main.regions[0].blocks[0]
    ret = list(block.operations)[-1]
    values = list(ret.operands)
    if len(names) != len(values):
        raise LoweringError(f"@main returns {len(values)} results, {len(names)} output names were given")
    with ir.InsertionPoint(ret):
        values = [
            ir.Operation.create("mhlo.copy", results=[v.type], operands=[v]).result
            if isinstance(v.owner, ir.Block)
            else v
            for v in values
        ]
        root = stablehlo.TupleOp(values)
        root.operation.attributes["mhlo.frontend_attributes"] = _frontend(neff_output_names=",".join(names))
        func.ReturnOp([root.result])
    ret.erase()
    ftype = ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value)
    main.attributes["function_type"] = ir.TypeAttr.get(ir.FunctionType.get(ftype.inputs, [root.result.type]))
    if "res_attrs" in main.attributes:
        del main.attributes["res_attrs"]


MLIR_FLOATS = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}

# --- collectives ---------------------------------------------------------------------------------

Groups = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class Collective:
    """A collective over `groups` (replica groups partitioning the ranks) of value `src`, named `dst`:

    - all_reduce: the sum (or max) over each group, same shape;
    - all_gather: the group's values along `dim`, concatenated; with `stack`, along a new leading
      dim instead ([n, *shape], rank order within the group);
    - reduce_scatter: the sum over each group, split along `dim`, this rank's part.

    Floats only for the reductions (neuronx-cc rejects integer all-reduce, NCC_EVRF061); a bool
    gathers as bytes. `to` converts the result (a float32 partial sum to the streams' dtype)."""

    op: Literal["all_reduce", "all_gather", "reduce_scatter"]
    src: str
    dst: str
    groups: Groups
    dim: int = 0
    stack: bool = False
    reduce: Literal["add", "max"] = "add"
    to: torch.dtype | None = None


MLIR_TYPES = {
    **MLIR_FLOATS,
    torch.int64: "i64",
    torch.int32: "i32",
    torch.uint8: "ui8",
    torch.int8: "i8",
    torch.int16: "i16",
    torch.bool: "i1",
}


def collective(step: Collective, value, where: str):
    """`step` applied to MLIR `value` at the current insertion point -> its result (`where` names the
    step in errors): the op in AWS's form, a bool gathered as bytes, the result converted to `step.to`."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import hlo as stablehlo

    groups = [list(g) for g in step.groups]
    if not partitions(groups, sum(map(len, groups))) or len({len(g) for g in groups}) != 1:
        raise LoweringError(f"{where}: replica groups {groups} do not partition the ranks in equal groups")
    table = ir.DenseIntElementsAttr.get(np.asarray(groups, dtype=np.int64))  # type: ignore[call-overload]  # numpy stubs: __buffer__ only on 3.12+
    if step.op == "all_gather":
        result = _all_gather(step, value, table, len(groups[0]))
    else:
        result = _reduction(step, value, table, len(groups[0]), where)
    if step.to is not None:
        to = ir.RankedTensorType.get(list(ir.RankedTensorType(result.type).shape), ir.Type.parse(MLIR_TYPES[step.to]))
        if to != result.type:
            result = stablehlo.ConvertOp(to, result).result
    return result


def _all_gather(step: Collective, value, table, n: int):
    """stablehlo.all_gather of `value` over the groups of `table` (`n` ranks each); a bool travels as bytes."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import hlo as stablehlo

    kind = ir.RankedTensorType(value.type)
    element, shape = kind.element_type, list(kind.shape)
    down = element.maybe_downcast()
    boolean = isinstance(down, ir.IntegerType) and down.width == 1
    if boolean:  # bytes on the links, a bool again after
        element = ir.IntegerType.get_unsigned(8)
        value = stablehlo.ConvertOp(ir.RankedTensorType.get(shape, element), value).result
    dim = step.dim
    if step.stack:
        shape = [1, *shape]
        value = stablehlo.ReshapeOp(ir.RankedTensorType.get(shape, element), value).result
        dim = 0
    gathered = [*shape]
    gathered[dim] *= n
    i64 = ir.IntegerType.get_signless(64)
    result = ir.Operation.create(
        "stablehlo.all_gather",
        results=[ir.RankedTensorType.get(gathered, element)],
        operands=[value],
        attributes={"all_gather_dim": ir.IntegerAttr.get(i64, dim), "replica_groups": table},
    ).result
    if boolean:
        result = stablehlo.ConvertOp(ir.RankedTensorType.get(gathered, ir.IntegerType.get_signless(1)), result).result
    return result


def _reduction(step: Collective, value, table, n: int, where: str):
    """stablehlo.all_reduce or reduce_scatter (sum or max) of float `value` over the groups of `table`."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import hlo as stablehlo

    kind = ir.RankedTensorType(value.type)
    element, shape = kind.element_type, list(kind.shape)
    if not isinstance(element.maybe_downcast(), ir.FloatType):
        raise LoweringError(
            f"{where}: {element} is not a float type (neuronx-cc rejects integer reductions, NCC_EVRF061; "
            "move integers with all-gather)"
        )
    attributes = {"replica_groups": table}
    out_shape = list(shape)
    if step.op == "reduce_scatter":
        if out_shape[step.dim] % n:
            raise LoweringError(f"{where}: dim {step.dim} of {shape} does not split over {n} ranks")
        out_shape[step.dim] //= n
        attributes["scatter_dimension"] = ir.IntegerAttr.get(ir.IntegerType.get_signless(64), step.dim)
    elif step.op != "all_reduce":
        raise LoweringError(f"{where}: unknown collective {step.op}")
    op = ir.Operation.create(
        f"stablehlo.{step.op}",
        results=[ir.RankedTensorType.get(out_shape, element)],
        operands=[value],
        attributes=attributes,
        regions=1,
    )
    scalar = ir.RankedTensorType.get([], element)
    body = op.regions[0].blocks.append(scalar, scalar)
    with ir.InsertionPoint(body):
        combine = stablehlo.AddOp if step.reduce == "add" else stablehlo.MaxOp
        stablehlo.ReturnOp([combine(body.arguments[0], body.arguments[1]).result])
    return op.result


def _reduce_results(main, reduce: dict[int, list[list[int]]], names: list[str], dtype: torch.dtype | None) -> None:
    """@main's results j in `reduce` summed over their replica groups (an all_reduce before the
    return), converted to `dtype` where given."""
    from jax._src.lib.mlir import ir

    ret = list(main.regions[0].blocks[0].operations)[-1]
    values = list(ret.operands)
    with ir.InsertionPoint(ret):
        for j, groups in sorted(reduce.items()):
            if not 0 <= j < len(values):
                raise LoweringError(f"all-reduce of result {j}: @main returns {len(values)} results")
            step = Collective(
                "all_reduce", names[j], names[j], tuple(map(tuple, groups)), to=dtype if dtype in MLIR_FLOATS else None
            )
            ret.operands[j] = collective(step, values[j], f"all-reduce of {names[j]}")


def _must_alias(aliases: dict[int, int]):
    """mhlo.input_output_alias entries: output j must alias the whole of parameter i."""
    from jax._src.lib.mlir import ir

    i64 = ir.IntegerType.get_signless(64)
    entries = [
        ir.DictAttr.get(
            {
                "alias": ir.DictAttr.get(
                    {
                        "kind": ir.StringAttr.get("must_alias"),
                        "parameter_number": ir.IntegerAttr.get(i64, i),
                        "parameter_index": ir.DenseI64ArrayAttr.get([]),
                    }
                ),
                "output_index": ir.DenseI64ArrayAttr.get([j]),
            }
        )
        for j, i in sorted(aliases.items())
    ]
    return ir.ArrayAttr.get(entries)


def to_hlo_proto(stablehlo: str) -> bytes:
    """StableHLO text -> serialized HloModuleProto (what neuronx-cc --framework XLA reads)."""
    _need("jax")
    from jax._src.lib import xla_client

    try:
        computation = xla_client._xla.mlir.mlir_module_to_xla_computation(
            stablehlo, use_tuple_args=False, return_tuple=False
        )
    except Exception as e:
        raise LoweringError(f"StableHLO -> HLO conversion failed: {str(e).splitlines()[0]}") from None
    return computation.as_serialized_hlo_module_proto()


# Sort and top-k ops in an HLO module: custom-call targets neuronx-cc or XLA use for top-k.
TOPK_TARGETS = ("TopK", "AwsNeuronTopK")


def selection_widths(proto: bytes) -> list[tuple[str, int]]:
    """(op, width) for every sort and top-k of an HloModuleProto: the length of the dimension it
    sorts or selects over. Read from the module itself (converted back to MLIR), so it sees what
    neuronx-cc will read, whatever produced the ops."""
    _need("jax")
    from jax._src.interpreters import mlir
    from jax._src.lib import xla_client
    from jax._src.lib.mlir import ir

    found = []
    with mlir.make_ir_context():
        module = ir.Module.parse(xla_client._xla.mlir.hlo_to_stablehlo(proto))
        for op in module.body.operations:
            for inner in _walk(op):
                name = inner.operation.name
                if name.endswith(".sort"):
                    shape = ir.RankedTensorType(inner.operands[0].type).shape
                    dim = ir.IntegerAttr(inner.attributes["dimension"]).value
                    found.append(("sort", shape[dim]))
                elif name.endswith((".top_k", ".topk")) or (
                    name.endswith(".custom_call")
                    and ir.StringAttr(inner.attributes["call_target_name"]).value in TOPK_TARGETS
                ):
                    found.append((name.rsplit(".", 1)[1], ir.RankedTensorType(inner.operands[0].type).shape[-1]))
    return found


# --- XLA:CPU --------------------------------------------------------------------------------------


# CPU devices XLA:CPU offers (a module with collectives runs one replica on each of N of them)
MAX_REPLICAS = 8


@functools.cache
def _cpu_client():
    jax = _need("jax")
    jax.config.update("jax_enable_x64", True)  # int64 inputs keep their type
    jax.config.update("jax_num_cpu_devices", MAX_REPLICAS)
    from jax._src import xla_bridge

    return xla_bridge.get_backend("cpu")


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.contiguous().numpy()


def _to_torch(a: np.ndarray) -> torch.Tensor:
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(np.array(a).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.array(a))


class CpuHlo:
    """An HloModuleProto compiled for XLA:CPU: call(list of tensors) -> list of tensors."""

    def __init__(self, proto: bytes):
        from jax._src.lib import xla_client

        client = _cpu_client()
        module = xla_client._xla.mlir.hlo_to_stablehlo(proto)
        self.device = client.local_devices()[0]
        self.executable = client.compile_and_load(
            module, xla_client.DeviceList(tuple([self.device])), xla_client.CompileOptions()
        )
        self.client = client

    def __call__(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        import jax

        arrays = [jax.device_put(_to_numpy(t), self.device) for t in inputs]
        results = self.executable.execute_sharded(arrays).disassemble_into_single_device_arrays()
        return [_to_torch(np.asarray(r[0])) for r in results]


class CpuReplicas:
    """An HloModuleProto holding cross-replica collectives, compiled for `n` replicas on XLA:CPU
    (one CPU device each): call(one input list per replica) -> one output list per replica."""

    def __init__(self, proto: bytes, n: int):
        from jax._src.lib import xla_client

        if not 1 <= n <= MAX_REPLICAS:
            raise ValueError(f"{n} replicas: XLA:CPU here offers 1 to {MAX_REPLICAS}")
        client = _cpu_client()
        self.devices = client.local_devices()[:n]
        options = xla_client.CompileOptions()
        options.num_replicas = n
        options.device_assignment = xla_client.DeviceAssignment.create(np.arange(n).reshape(n, 1))
        self.executable = client.compile_and_load(
            xla_client._xla.mlir.hlo_to_stablehlo(proto), xla_client.DeviceList(tuple(self.devices)), options
        )

    def __call__(self, inputs: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        import jax
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        if len(inputs) != len(self.devices):
            raise ValueError(f"{len(inputs)} input lists for {len(self.devices)} replicas")
        # each argument one array over the replicas' devices whose shards differ: a replicated
        # sharding gives every device a buffer of the parameter's own shape (a 0-d rank too)
        sharding = NamedSharding(Mesh(np.array(self.devices), ("replica",)), PartitionSpec())
        args = []
        for i, per_replica in enumerate(zip(*inputs, strict=True)):  # one argument, every replica's value
            if len({(tuple(t.shape), t.dtype) for t in per_replica}) != 1:
                raise ValueError(f"argument {i}: the replicas' tensors differ in shape or dtype")
            parts = [jax.device_put(_to_numpy(t), d) for t, d in zip(per_replica, self.devices)]
            args.append(jax.make_array_from_single_device_arrays(tuple(per_replica[0].shape), sharding, parts))
        results = self.executable.execute_sharded(args).disassemble_into_single_device_arrays()
        return [[_to_torch(np.asarray(out[r])) for out in results] for r in range(len(self.devices))]
