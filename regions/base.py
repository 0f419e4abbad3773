"""What every region module shares: weight specs, the rank buffer, the dtype.

A region is an `nn.Module` whose compiled method (`decode`) is a pure function
of its inputs: activations, the layer's state views, positions, the layer's
weights (registered buffers, lifted into graph inputs by the compiler) and the
rank (a registered buffer). One instance holds one layer's weights; every layer
of a kind runs the same traced graph with its own weights bound.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from deepinfer.bundles.manifest import DECODE, PROJECT
from deepinfer.kernels.formats import FP8_GEMM_FORMATS
from deepinfer.regions.config import TextConfig

if TYPE_CHECKING:
    from deepinfer.regions.state import Geometry, InputSpec

# what a compiled method returns: its one output, or its outputs in order
Outputs = torch.Tensor | tuple[torch.Tensor, ...]

# checkpoint storage dtype name -> dtype the region holds it in. fp8 codes, fp4
# pairs and ue8m0 scales travel as uint8 (no dtype bitcasts inside graphs).
CKPT_DTYPES = {
    "F8_E4M3": torch.uint8,
    "F8_E8M0": torch.uint8,
    "I8": torch.uint8,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
}


@dataclass(frozen=True)
class WeightSpec:
    """One weight of a region: its buffer, checkpoint key, shape and storage dtype.

    `key` is relative to the layer prefix (`layers.N.`) and may contain `{e}`:
    then the buffer stacks `experts` checkpoint tensors along a new first dim.
    """

    name: str
    key: str
    shape: tuple[int, ...]
    ckpt_dtype: str
    experts: int = 0

    @property
    def dtype(self) -> torch.dtype:
        return CKPT_DTYPES[self.ckpt_dtype]

    @property
    def buffer_shape(self) -> tuple[int, ...]:
        return ((self.experts,) if self.experts else ()) + self.shape


def fp8_specs(name: str, key: str, rows: int, cols: int) -> list[WeightSpec]:
    """An fp8 [rows, cols] weight and its [ceil(rows/32), ceil(cols/32)] ue8m0 scale."""
    return [
        WeightSpec(name, f"{key}.weight", (rows, cols), "F8_E4M3"),
        WeightSpec(f"{name}_s", f"{key}.scale", (-(-rows // 32), -(-cols // 32)), "F8_E8M0"),
    ]


def engram_table_specs(c: TextConfig) -> list[WeightSpec]:
    """The engram tables (codes and per-row ue8m0 scales of every engram layer), keyed by their
    checkpoint names. No region holds them: they stay on the host (regions.step.EngramRows)."""
    hd = c.engram_head_dim
    return [
        spec
        for codes, scales, rows in c.engram_tables()
        for spec in (
            WeightSpec(codes, codes, (rows, hd), "F8_E4M3"),
            WeightSpec(scales, scales, (rows, -(-hd // 32)), "F8_E8M0"),
        )
    ]


def fp4_specs(name: str, key: str, rows: int, cols: int, experts: int) -> list[WeightSpec]:
    """Per-expert fp4 [rows, cols] weights (packed [rows, cols/2]) and [rows, cols/32] scales."""
    return [
        WeightSpec(name, f"{key}.weight", (rows, cols // 2), "I8", experts),
        WeightSpec(f"{name}_s", f"{key}.scale", (rows, -(-cols // 32)), "F8_E8M0", experts),
    ]


class Region(nn.Module):
    """Base of every region: allocates the weight buffers and the rank buffer.

    `fp8_format` is the format of the fp8 codes its buffers hold: the checkpoint's
    "e4m3fn", or "e4m3" where the compile's weight recipe converted them (a compiler
    sets it on the instance before tracing; its decoders follow it)."""

    kind: str = ""
    fp8_format: str = "e4m3fn"
    # the compiled method: every kind defines it, each with its own inputs (`input_specs`)
    decode: Callable[..., Outputs]

    if TYPE_CHECKING:

        def __getattr__(self, name: str) -> torch.Tensor:
            """A region holds buffers only (its weights and `rank`), no submodules: what nn.Module's
            attribute lookup finds on it is a tensor."""
            ...

    def __init__(self, specs: list[WeightSpec], dtype: torch.dtype):
        super().__init__()
        self.specs = specs
        self.dtype = dtype
        self.register_buffer("rank", torch.zeros((), dtype=torch.int64))
        for spec in specs:
            self.register_buffer(spec.name, torch.zeros(spec.buffer_shape, dtype=spec.dtype))

    def input_specs(self, B: int, T: int, g: Geometry) -> list[InputSpec]:
        """The inputs of `decode` for a [B, T] step; every kind defines its own."""
        raise NotImplementedError(f"{type(self).__name__} does not define input_specs")

    def method_inputs(self, method: str, B: int, T: int, g) -> list:
        """The inputs of compiled method `method` for a [B, T] step: `input_specs` for `decode`, every
        region's; `<method>_inputs` for another (the head's `project`, the divided attention's stages)."""
        return self.input_specs(B, T, g) if method == DECODE else getattr(self, f"{method}_inputs")(B, T, g)

    def output_names(self) -> list[str]:
        """The names of `decode`'s outputs, in order; every kind defines its own."""
        raise NotImplementedError(f"{type(self).__name__} does not define output_names")

    def method_outputs(self, method: str) -> list[str]:
        """The names of compiled method `method`'s outputs: `output_names` for `decode` (and the head's
        `project`, whose one output is the same logits); `<method>_outputs` for the others."""
        return self.output_names() if method in (DECODE, PROJECT) else getattr(self, f"{method}_outputs")()

    def methods(self) -> tuple[str, ...]:
        """The methods a step runs of this kind, in order (one executable per bucket each)."""
        return (DECODE,)

    def gathered(self, rows: int) -> dict[str, int]:
        """The weights a step of `rows` token rows reads by a gather along their first dim instead of
        whole: buffer name -> entries gathered (what the cost model counts, compiler/step_reads.py).
        None for most kinds; the MoE's routed expert slices (rows x k of them below its crossover, its
        tiled form's tiles above it)."""
        return {}

    def gathered_rows(self, rows: int) -> int:
        """Token rows each entry of `gathered` multiplies in a step of `rows` rows (the cost model's
        FLOPs): 1 where an entry is gathered for one row; the MoE's tiled form, its tile's rows."""
        return 1

    @property
    def fp8(self) -> str:
        """The blockquant_gemm format name of this region's fp8 weights."""
        return FP8_GEMM_FORMATS[self.fp8_format]

    def w(self, name: str) -> torch.Tensor:
        return getattr(self, name)

    def with_weights(self, tensors: dict[str, torch.Tensor]) -> Region:
        """A shallow copy holding `tensors` as its buffers (every buffer, by name, same shapes and
        dtypes); this region is unchanged (a plan's regions hold meta buffers only)."""
        missing = sorted(set(self._buffers) - set(tensors))
        if missing:
            raise KeyError(f"{self.kind}: no tensor for buffer(s) {', '.join(missing)}")
        for name, t in tensors.items():
            own = self._buffers[name]
            assert own is not None, f"{self.kind}.{name}: a region registers no empty buffers"
            if tuple(t.shape) != tuple(own.shape) or t.dtype != own.dtype:
                raise ValueError(
                    f"{self.kind}.{name}: {tuple(t.shape)} {t.dtype}, the region holds {tuple(own.shape)} {own.dtype}"
                )
        copy = object.__new__(type(self))
        copy.__dict__.update(self.__dict__)
        copy._buffers = dict(tensors)
        return copy
