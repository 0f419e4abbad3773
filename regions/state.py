"""Per-layer KV/state layouts of a V4.1 model (see `regions/attention.py` for their meaning).

`state_layout` is the one place that knows which layer owns which state and
its shape, given the pool geometry: `slots` sequence slots (slot 0 scratch),
`blocks` paged blocks of `block_size` token positions (block 0 scratch), and
`slack` rows of every per-slot ring beyond the window or ratio it must hold: the
most drafts a verify step carries, so that what a rejected draft writes never
overwrites a position the sequence still reads (`runtime/schedule.py`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from deepinfer.bundles.manifest import blocks_per_rank as manifest_blocks_per_rank
from deepinfer.errors import ConfigError
from deepinfer.regions.config import TextConfig

if TYPE_CHECKING:
    from deepinfer.regions.step import LayerPlan


PAGED = ("ckv", "ikeys")  # indexed by block; the others by sequence slot


def blocks_per_rank(num_blocks: int, cp: int) -> int:
    """Blocks a paged pool (`PAGED`) holds on each cp rank of a token group.

    `num_blocks` ([kv] num_blocks) counts the token group's blocks: scratch block 0 and
    `num_blocks - 1` usable ones, divided block-wise over its cp ranks (a sequence's logical
    block j lives on cp rank j % cp). Each rank holds its `(num_blocks - 1) / cp` usable blocks
    and a scratch block 0 of its own; at cp = 1, all `num_blocks`. Per-slot pools stay whole.
    Checked here (a ConfigError); the formula is the bundle format's (`bundles.manifest.blocks_per_rank`)."""
    usable, rest = divmod(num_blocks - 1, cp)
    if rest or usable < 1:
        raise ConfigError(
            f"{num_blocks} blocks (block 0 scratch) do not divide over cp = {cp} ranks: num_blocks - 1 must be "
            f"a positive multiple of {cp}; nearest valid: {' or '.join(map(str, nearest_num_blocks(num_blocks, cp)))}"
        )
    return manifest_blocks_per_rank(num_blocks, cp)


def nearest_num_blocks(num_blocks: int, cp: int, least: int = 2) -> tuple[int, ...]:
    """The valid `num_blocks` at `cp` (num_blocks - 1 a multiple of cp) nearest `num_blocks`, each at least `least`."""
    below = num_blocks - (num_blocks - 1) % cp
    return tuple(n for n in (below, below + cp) if n >= max(least, cp + 1)) or (-(-(least - 1) // cp) * cp + 1,)


@dataclass(frozen=True)
class StateSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


def check_block_size(c: TextConfig, block_size: int) -> None:
    ratios = {r for r in c.compress_ratios[: c.num_hidden_layers] if r}
    bad = [r for r in ratios if block_size % r]
    if block_size <= 0 or bad:
        raise ConfigError(
            f"block_size {block_size} must be a positive multiple of every compress ratio {sorted(ratios)}"
        )


def layer_state(
    c: TextConfig, p: LayerPlan, *, slots: int, blocks: int, block_size: int, dtype: torch.dtype, slack: int = 0
) -> list[StateSpec]:
    """The state views layer `p` owns (reuse/reindex layers read their source's); the per-slot rings
    (`win`, `part_kv`, `part_gate`) have `slack` rows beyond the window or ratio."""
    hd = c.head_dim
    specs = [StateSpec("win", (slots, c.sliding_window + slack, hd), dtype)]
    if p.attn == "source":
        per_block = block_size // p.ratio
        specs += [
            StateSpec("ckv", (blocks, per_block, hd), dtype),
            StateSpec("ikeys", (blocks, per_block, c.index_head_dim), dtype),
        ]
        if p.ratio > 1:
            specs += [
                StateSpec("part_kv", (slots, p.ratio + slack, hd), torch.float32),
                StateSpec("part_gate", (slots, p.ratio + slack, hd), torch.float32),
            ]
    return specs


def state_layout(
    c: TextConfig,
    plans: list[LayerPlan],
    *,
    slots: int,
    blocks: int,
    block_size: int,
    dtype: torch.dtype,
    slack: int = 0,
) -> dict[int, list[StateSpec]]:
    check_block_size(c, block_size)
    return {
        p.layer: layer_state(c, p, slots=slots, blocks=blocks, block_size=block_size, dtype=dtype, slack=slack)
        for p in plans
    }


def allocate(layout: dict[int, list[StateSpec]]) -> dict[int, dict[str, torch.Tensor]]:
    """Zero-filled tensors for a layout (the reference model's own buffers)."""
    return {layer: {s.name: torch.zeros(s.shape, dtype=s.dtype) for s in specs} for layer, specs in layout.items()}


# the block size of the geometries `reads_context` compares (any positive size serves: a block table,
# and every width derived from it, differs between one block and two)
CONTEXT_PROBE_BLOCK = 16


@dataclass(frozen=True)
class Geometry:
    """Pool geometry a region's state views and step inputs are shaped by."""

    slots: int  # sequence slots (slot 0 is scratch)
    blocks: int  # paged blocks (block 0 is scratch)
    block_size: int  # token positions per block
    max_blocks: int  # block-table width: blocks per sequence at the (bucket's) context
    slack: int = 0  # per-slot ring rows beyond the window / ratio: the most drafts a verify step carries

    def compressed_width(self, ratio: int) -> int:
        """Compressed entries a sequence can hold at `ratio` (Wc)."""
        return self.max_blocks * self.block_size // ratio

    def at_context(self, context: int) -> Geometry:
        """This geometry with the block table of a `context`-position bucket (the pools unchanged)."""
        return dataclasses.replace(self, max_blocks=-(-context // self.block_size))


def reads_context(region, method: str = "decode") -> bool:
    """Whether a region method's input shapes depend on the block-table width, i.e. on the context
    (block tables, compressed-width carries): its inputs at two geometries that differ only there."""
    g = Geometry(slots=2, blocks=2, block_size=CONTEXT_PROBE_BLOCK, max_blocks=1)
    wide = g.at_context(2 * CONTEXT_PROBE_BLOCK)
    return region.method_inputs(method, 1, 1, g) != region.method_inputs(method, 1, 1, wide)


@dataclass(frozen=True)
class InputSpec:
    """One input of a region method: name, shape, dtype, and its role."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    role: str  # activation | step | state | carry
    high: int | None = None  # an index input's bound: its values lie in [0, high) (token ids: the vocabulary)


def step_inputs(B: int, T: int, g: Geometry, *, paged: bool) -> list[InputSpec]:
    specs = [InputSpec("positions", (B, T), torch.int64, "step"), InputSpec("slots", (B,), torch.int64, "step")]
    if paged:
        specs.append(InputSpec("block_table", (B, g.max_blocks), torch.int64, "step"))
    return specs
