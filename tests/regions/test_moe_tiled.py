"""The MoE region's tiled form (prompt chunks, regions/topology.moe_form) against the grouped one.

Above the crossover the region computes its rows' chosen experts in tiles (`kernels/linear.moe_tiled`);
the grouped form (`moe_experts`: every expert's slice over every row, dense routing weights) is the
reference it replaced. Both run on the same region's stacks, at one rank (each expert's output in the
activation dtype) and on a slice rank of ep = 4 (w2 over the slices in float32), at the tiny model's
dimensions and at the release's hidden size and expert width with few experts (synthetic weights).
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.bundles.topology import Topology
from deepinfer.compiler.shard import shard
from deepinfer.kernels.linear import tiles_bound
from deepinfer.regions.config import parse_config
from deepinfer.regions.examples import example_inputs, random_weights
from deepinfer.regions.moe import MoE, route
from deepinfer.regions.state import Geometry
from deepinfer.regions.synthetic import synthetic_config
from deepinfer.regions.tiny import tiny_config
from deepinfer.regions.topology import moe_form, moe_tile

OPS = torch.ops.deepinfer


def _grouped(region: MoE, x, weights, experts):
    """The grouped form on `region`'s stacks: every expert's slice over every row, dense weights."""
    dense = torch.zeros(x.shape[0], region.c.n_routed_experts).scatter(1, experts, weights)
    return OPS.moe_experts(
        x, dense, *region.stacks(), region.c.swiglu_limit, region.scale_blocks(x.device), region.ep > 1
    )


def _rank(full: MoE, topo: Topology, rank: int, dtype) -> MoE:
    """Rank `rank`'s MoE of `topo`, holding its shards of `full`'s weights."""
    region = MoE(full.c, dtype=dtype, topo=topo)
    for spec in region.specs:
        getattr(region, spec.name).copy_(
            shard("moe", spec.name, getattr(full, spec.name), full.c, topo, rank, spec.buffer_shape)
        )
    region.rank.fill_(rank)
    return region


def _region(config: dict, dtype, seed: int) -> MoE:
    c = parse_config(config).text
    region = MoE(c, dtype=dtype)
    for name, value in random_weights(region, seed).items():
        getattr(region, name).copy_(value)
    return region


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rank", [None, 1, 2], ids=["one-rank", "slice-1", "slice-2"])
@pytest.mark.parametrize("rows", [16, 45])
def test_tiny_tiled_region_equals_grouped(dtype, rank, rows):
    """The tiny model's MoE (8 experts, top-2) at one rank and on slice ranks of ep = 4: `routed` in the
    tiled form gives the grouped form's output (fp32 within float32 rounding; bf16 within the expert
    tests' tolerance, the same products and per-expert roundings), and the whole decode agrees too."""
    full = _region(tiny_config(), dtype, seed=4)
    region = full if rank is None else _rank(full, Topology(cp=4, ep=4), rank, dtype)
    c = region.c
    assert moe_form(rows, c.num_experts_per_tok, c.n_routed_experts) == "tiled"
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, c.hidden_size, generator=gen).to(dtype)
    weights, experts = route(x, region.gate, region.gate_bias.expand(rows, -1), c.num_experts_per_tok, True, 2.5)
    got, want = region.routed(x, weights, experts), _grouped(region, x, weights, experts)
    tol = 1e-5 if dtype == torch.float32 or rank is not None else 2e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())


def test_tiny_tiled_decode_equals_the_one_rank_grouped_decode():
    """The whole MoE site at ep = 4: the slice ranks' tiled partials, summed, give the one-rank region's
    decode with its routed experts in the grouped form."""
    full = _region(tiny_config(), torch.float32, seed=5)
    topo, g = Topology(cp=4, ep=4), Geometry(slots=2, blocks=2, block_size=16, max_blocks=1)
    h, pre, is_image = example_inputs(full.input_specs(2, 12, g), g, seed=6)
    assert moe_form(24, full.c.num_experts_per_tok, full.c.n_routed_experts) == "tiled"
    parts = [_rank(full, topo, r, torch.float32).decode(h, pre, is_image) for r in range(topo.world)]
    full.routed = lambda x, weights, experts: _grouped(full, x, weights, experts)  # the grouped form
    want_h, want_pre = full.decode(h, pre, is_image)
    got = torch.stack([p[0] for p in parts]).sum(0)
    torch.testing.assert_close(got, want_h.float(), rtol=1e-5, atol=1e-5 * want_h.abs().max().item())
    assert all(torch.equal(p[1], want_pre) for p in parts)


@pytest.mark.parametrize("ep, rank", [(1, 0), (4, 3)])
def test_release_width_tiled_region_equals_grouped(ep, rank):
    """Hidden 5120, expert width 2304 (ep = 4: 576-column slices), 8 experts top-6, bf16 activations:
    40 rows x 6 assignments in tiles of `moe_tile` rows give the grouped form's output."""
    full = _region(synthetic_config(experts=8), torch.bfloat16, seed=7)
    region = full if ep == 1 else _rank(full, Topology(cp=4, ep=4), rank, torch.bfloat16)
    c, rows = region.c, 40
    assert (c.hidden_size, c.moe_intermediate_size, c.num_experts_per_tok) == (5120, 2304, 6)
    tile = moe_tile(rows, 6, 8)
    assert tile == 32 and region.gathered(rows)["w1"] == tiles_bound(rows * 6, 8, tile)
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(rows, c.hidden_size, generator=gen).to(torch.bfloat16)
    weights, experts = route(x, region.gate, region.gate_bias.expand(rows, -1), 6, True, 2.5)
    got, want = region.routed(x, weights, experts), _grouped(region, x, weights, experts)
    tol = 1e-5 if ep > 1 else 2e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())
