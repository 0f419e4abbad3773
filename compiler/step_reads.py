"""What a decode step reads and multiplies on one rank, from the regions' own weight specs.

The bytes `deepinfer plan` counts for an executable are the bytes its lowered module reads: every
weight parameter whole, except the stacks a region reads by a gather along their first dim
(`Region.gathered`: the MoE's routed expert slices, rows x k below its crossover, its tiled form's
tiles above it), of which only the gathered entries. The FLOPs of the weight matmuls follow from the
same specs: 2 per multiply-add, one multiply-add per weight element and row (an fp4 byte holds two
elements), a gathered entry against the rows it was gathered for (`Region.gathered_rows`: one, or a
tile's, padding included). Because both come from the specs a region is traced with, the cost
model follows the layout without a second description of it; tests/trn2/test_step_reads.py ties the
bytes to the parameters and gathers of a tiny trn2 bundle's lowered modules.

A static gather reads its entries whatever the routing (shapes are fixed per bucket): the bytes
expected under uniform routing and the worst case are the same figure, reported side by side.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from deepinfer.bundles.manifest import ROWS_SLOT
from deepinfer.regions.base import Region, WeightSpec

if TYPE_CHECKING:
    from deepinfer.bundles.topology import Topology
    from deepinfer.compiler.bundle_plan import BundlePlan
    from deepinfer.compiler.plan import RegionPlan

PROJECTIONS = "attention projections"
# (slot, weight) -> the FLOPs part its matmul counts in; weights not named here are not matmuls
# (norms, biases, sinks, scales) or are counted by the step cost model itself (attention over keys)
PARTS = {
    ("attn", "hc_fn"): "mixes, attention site",
    **{("attn", name): PROJECTIONS for name in ("wq_a", "wq_b", "wkv", "wo_a", "wo_b")},
    **{("attn", name): "compressor" for name in ("c_wkv", "c_wgate", "iwk")},
    **{("attn", name): "indexer queries" for name in ("iwq_b", "iweights")},
    ("moe", "hc_fn"): "mixes, moe site",
    ("moe", "gate"): "router",
    **{("moe", name): "routed experts" for name in ("w1", "w3", "w2")},
    **{("moe", name): "shared expert" for name in ("sw1", "sw3", "sw2")},
    ("engram", "wkv"): "engram",
}
FP4 = "I8"  # the checkpoint dtype of fp4 pairs: two weight elements a byte


def spec_bytes(spec: WeightSpec) -> int:
    """Bytes of one layer's buffer of `spec`."""
    return math.prod(spec.buffer_shape) * spec.dtype.itemsize


def slot_rows(topo: Topology, slot: str, batch: int) -> int:
    """Token rows a slot's region computes in a decode step of `batch` sequences per token group:
    the MoE's are every group's under EP dispatch (it runs on the gathered rows)."""
    return batch * topo.groups if slot == "moe" and topo.dispatch else batch


def layer_bytes(region: Region, rows: int) -> int:
    """Bytes one layer of `region`'s kind reads at `rows` rows: whole buffers, gathered entries."""
    gathered = region.gathered(rows)
    total = 0
    for spec in region.specs:
        n = spec_bytes(spec)
        if spec.name in gathered:
            n = n * gathered[spec.name] // spec.buffer_shape[0]
        total += n
    return total


def read_bytes(plan: BundlePlan, batch: int) -> dict[str, int]:
    """Device weight bytes a rank reads a decode step of `batch` sequences, by region kind: every
    layer of the kind (the draft's kinds and the attention's rows twins, which run prompt chunks only,
    are not in a plain step); of the embedding table the step's rows."""
    regions = plan.regions
    out: dict[str, int] = {}
    for kind, kp in regions.kinds.items():
        if kind in regions.draft_kinds or kp.slot == ROWS_SLOT:
            continue
        if kp.slot == "embed":
            (table,) = kp.region.specs  # [V, D]
            out[kind] = batch * spec_bytes(table) // table.shape[0]
            continue
        out[kind] = layer_bytes(kp.region, slot_rows(plan.spec.topology, kp.slot, batch)) * max(1, len(kp.layers))
    return out


def weight_flops(plan: BundlePlan, layer: int, batch: int) -> dict[str, int]:
    """FLOPs of layer `layer`'s weight matmuls on one rank at `batch` sequences, by part (`PARTS`)."""
    out: dict[str, int] = {}
    for slot, (kind, _) in plan.regions.bindings[layer].items():
        rows = slot_rows(plan.spec.topology, slot, batch)
        for part, f in region_flops(plan.regions.kinds[kind].region, slot, rows).items():
            out[part] = out.get(part, 0) + f
    return out


def region_flops(region: Region, slot: str, rows: int) -> dict[str, int]:
    """FLOPs of one call of `region` in slot `slot` at `rows` rows, by part (`PARTS`)."""
    out: dict[str, int] = {}
    gathered = region.gathered(rows)
    for spec in region.specs:
        part = PARTS.get((slot, spec.name))
        if part is None:
            continue
        macs = math.prod(spec.buffer_shape) * (2 if spec.ckpt_dtype == FP4 else 1)
        if spec.name in gathered:  # each gathered entry meets the rows it was gathered for
            macs = macs * gathered[spec.name] * region.gathered_rows(rows) // spec.buffer_shape[0]
        else:
            macs *= rows
        out[part] = out.get(part, 0) + 2 * macs
    return out


def executable_reads(regions: RegionPlan, topo: Topology, kind: str, rows: int) -> int:
    """Weight bytes one call of executable kind `kind` (a region kind, or trn2's fused layer kind:
    its slots' regions) reads at `rows` token rows a token group: what its lowered module's
    weight parameters give (`compiler.targets.hlo_reads`)."""
    if kind in regions.kinds:
        kp = regions.kinds[kind]
        if kp.slot == "embed":
            (table,) = kp.region.specs
            return rows * spec_bytes(table) // table.shape[0]
        return layer_bytes(kp.region, slot_rows(topo, kp.slot, rows))
    slots = regions.fused_kinds()[kind].slots
    return sum(layer_bytes(regions.kinds[k].region, slot_rows(topo, slot, rows)) for slot, k in slots)
