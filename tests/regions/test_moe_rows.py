"""The MoE of a prompt chunk divided by rows over a token group of d ranks (regions/moe.py, issue 41
item 2): each rank runs `moe_in` on its T / d rows (the site's mixes, ffn_norm, the router), the ranks'
x and routing are gathered (`torch.cat` here, a stand-in for the all-gather), each runs `moe_experts`
on every row with its slice of every expert and of the shared expert, the float32 partials are summed
and split back to the rows' ranks (the reduce-scatter), and each runs `moe_out` on its rows.

At d = 2 and 4, two sequences in chunks of 8 rows and one in a chunk of 4 (image rows among them; the
tiled form, a prompt chunk's), the streams are one rank's `decode` within 4 times the float32 noise
floor the ranks' decode partials already have against it (measured here on the same inputs), the site's
`pre` and routing weights to float32 rounding, the experts chosen exactly; every input matches its
method's specs.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.bundles.topology import Topology
from deepinfer.regions.checkpoint import Checkpoint, load_region
from deepinfer.regions.config import load_config
from deepinfer.regions.examples import example_inputs
from deepinfer.regions.moe import MoE, route
from deepinfer.regions.rows import rows_of
from deepinfer.regions.state import Geometry
from deepinfer.regions.topology import moe_form

from ..ranks.test_shards import ranked

GEOMETRY = Geometry(slots=3, blocks=4, block_size=16, max_blocks=2)


@pytest.fixture(scope="module")
def text(tiny_ckpt):
    return load_config(tiny_ckpt).text


@pytest.fixture(scope="module")
def full(tiny_ckpt, text):
    region = MoE(text, dtype=torch.float32)
    load_region(Checkpoint(tiny_ckpt), region, "layers.1.")
    return region


def call(region, method: str, B: int, T: int, *args):
    """`region.<method>(*args)` for a chunk of [B, T], each argument checked against the method's input
    specs -> its outputs as a tuple, as many as the method names."""
    specs = region.method_inputs(method, B, T, GEOMETRY)
    assert [(tuple(a.shape), a.dtype) for a in args] == [(s.shape, s.dtype) for s in specs], method
    out = getattr(region, method)(*args)
    out = out if isinstance(out, tuple) else (out,)
    assert len(out) == len(region.method_outputs(method)), method
    return out


def divided(ranks: list[MoE], h, pre, is_image):
    """The chunk's rows through the ranks' three methods, the collectives between them done in this
    process -> (h, pre, weights, experts) of every row, in row order."""
    d, (B, T) = len(ranks), is_image.shape
    own = [rows_of(T, d, j) for j in range(d)]
    ins = [call(r, "moe_in", B, T, h[:, rows], pre[:, rows], is_image[:, rows]) for r, rows in zip(ranks, own)]
    x, weights, experts = (torch.cat([i[k] for i in ins], 1) for k in range(3))  # the all-gather
    partials = [call(r, "moe_experts", B, T, x, weights, experts)[0] for r in ranks]
    assert all(p.dtype == torch.float32 and p.shape == x.shape for p in partials)
    assert not torch.equal(partials[0], partials[1])  # each rank really holds a share
    summed = torch.stack(partials).sum(0)  # the reduce-scatter: summed, each rank its rows
    outs = [call(r, "moe_out", B, T, summed[:, rows], h[:, rows], i[3], i[4])[0] for r, rows, i in zip(ranks, own, ins)]
    return torch.cat(outs, 1), torch.cat([i[5] for i in ins], 1), weights, experts


@pytest.mark.parametrize("d", [2, 4])
@pytest.mark.parametrize("B, T", [(2, 8), (1, 4)])
def test_divided_methods_give_the_one_rank_moe(text, full, d, B, T):
    c = text
    assert moe_form(B * T, c.num_experts_per_tok, c.n_routed_experts) == "tiled"  # a prompt chunk's form
    topo = Topology(ep=d, cp=d)
    ranks = [ranked(full, lambda: MoE(c, dtype=torch.float32, topo=topo), "moe", c, topo, j) for j in range(d)]
    h, pre, is_image = example_inputs(full.input_specs(B, T, GEOMETRY), GEOMETRY, seed=5)
    is_image[0, 1] = is_image[-1, T - 1] = True  # the image bias too, on two ranks' rows
    want_h, want_pre = full.decode(h, pre, is_image)

    got_h, got_pre, weights, experts = divided(ranks, h, pre, is_image)

    assert got_h.dtype == h.dtype and got_h.shape == want_h.shape
    # the site on a rank's rows is the site on those rows, to float32 rounding (a matmul over fewer rows
    # may block its sums differently), and routes them to the same experts
    torch.testing.assert_close(got_pre, want_pre)
    x = full._site(h, pre, is_image)[3]
    bias = torch.where(is_image.flatten().unsqueeze(-1), full.gate_bias_vl, full.gate_bias)
    k = c.num_experts_per_tok
    want_w, want_e = route(x.flatten(0, 1), full.gate, bias, k, c.norm_topk_prob, c.routed_scaling_factor)
    assert torch.equal(experts.flatten(0, 1), want_e)
    torch.testing.assert_close(weights.flatten(0, 1), want_w)
    # the noise floor: the ranks' decode partials (every rank every row, the replicated chunk's MoE)
    replicated = torch.stack([r.decode(h, pre, is_image)[0] for r in ranks]).sum(0).to(h.dtype)
    floor = (replicated - want_h).abs().max().item()
    error = (got_h - want_h).abs().max().item()
    assert 0 < floor < 1e-4
    assert error <= 4 * floor, (error, floor)  # measured: 0.7 to 1.6 times it
