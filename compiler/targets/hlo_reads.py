"""What an HLO module reads of each of its parameters: the figure the step cost model must agree with.

A parameter is read whole unless every use of it takes part of it: a gather or dynamic slice by
runtime indices (the MoE's routed expert slices: trn2's DMA reads those rows only), or a static
slice. Reshapes and bitcasts are views: their uses count as the parameter's. The module is read
from its HLO text (the ENTRY computation, unoptimized as the lowering wrote it), parameters by the
NEFF tensor names the lowering stamped on them (`hlo.finish_module`).
"""

from __future__ import annotations

import math
import re

from deepinfer.compiler.targets.hlo import _need

ELEMENT_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4}
ELEMENT_BYTES |= {"s64": 8, "u64": 8, "f64": 8}
PARTIAL = ("gather", "dynamic-slice", "slice")  # a use that reads only its result's elements
VIEWS = ("reshape", "bitcast", "bitcast-convert")  # a use that reads nothing itself: its uses count
INSTRUCTION = re.compile(r"\s*(?:ROOT )?([\w.\-]+) = (\S+?) ([a-z][\w\-]*)\((.*?)\)(.*)$")
NAME = re.compile(r'neff_input_names="([^"]*)"')


def _bytes(shape: str) -> int:
    """Bytes of an array type as HLO text writes it (`bf16[2,3]{1,0}`); 0 for tuples and tokens."""
    m = re.match(r"([a-z]+\d*)\[([\d,]*)\]", shape)
    if m is None or m.group(1) not in ELEMENT_BYTES:
        return 0
    dims = [int(d) for d in m.group(2).split(",") if d]
    return math.prod(dims) * ELEMENT_BYTES[m.group(1)]


def entry_text(proto: bytes) -> list[str]:
    """The instruction lines of an HloModuleProto's ENTRY computation."""
    _need("jax")
    from jax._src.lib import xla_client

    lines = xla_client.XlaComputation(proto).as_hlo_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("ENTRY "))
    out = []
    for line in lines[start + 1 :]:
        if line.startswith("}"):
            break
        out.append(line)
    return out


def parameter_reads(proto: bytes) -> dict[str, int]:
    """Bytes the module reads of each parameter, by its NEFF input name (see the module docstring)."""
    size: dict[str, int] = {}
    uses: dict[str, list[tuple[str, int, str]]] = {}  # value -> (opcode, operand position, result) of each use
    params: dict[str, str] = {}  # instruction -> input name
    for line in entry_text(proto):
        m = INSTRUCTION.match(line)
        if m is None:
            continue
        name, shape, opcode, operands, rest = m.groups()
        size[name] = _bytes(shape)
        if opcode == "parameter":
            found = NAME.search(rest)
            if found:
                params[name] = found.group(1)
            continue
        for position, operand in enumerate(o.strip() for o in operands.split(",")):
            if operand in size:
                uses.setdefault(operand, []).append((opcode, position, name))
    return {input_name: _read(value, size, uses) for value, input_name in params.items()}


def _read(value: str, size: dict[str, int], uses: dict[str, list[tuple[str, int, str]]]) -> int:
    """Bytes read of `value`: its partial uses' results and what its views' uses read; all of it if
    any use reads it whole."""
    total = 0
    for opcode, position, result in uses.get(value, []):
        if opcode in VIEWS:
            total += _read(result, size, uses)
        elif opcode in PARTIAL and position == 0:
            total += size[result]
        else:
            return size[value]
    return min(total, size[value])
