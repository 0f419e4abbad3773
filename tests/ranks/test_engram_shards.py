"""The engram divided over a token group, without processes: each rank's partial keys and value
(its input columns of `wkv`, compiler/shard.py), summed over the group in float32 as the "engram
all-reduce" does, then the gate and the update (`mix`), equal the one-rank engram's `decode`.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deepinfer.bundles.manifest import DECODE
from deepinfer.bundles.topology import Topology
from deepinfer.compiler.shard import WHOLE, ZERO, Cut, cut, replicated, shard
from deepinfer.kernels.formats import dequant_fp8_rows
from deepinfer.regions.checkpoint import Checkpoint, load_region
from deepinfer.regions.config import load_config
from deepinfer.regions.engram import Engram
from deepinfer.regions.examples import example_inputs
from deepinfer.regions.state import Geometry
from deepinfer.regions.topology import ENGRAM_KV, ENGRAM_MIX, boundary_reduce, engram_slice, engram_width

ops = torch.ops.deepinfer
G = Geometry(slots=3, blocks=4, block_size=16, max_blocks=2)


@pytest.fixture(scope="module")
def text(tiny_ckpt):
    return load_config(tiny_ckpt).text


def _ranked(full: Engram, c, topo: Topology, rank: int) -> Engram:
    """The engram built for `topo`, holding rank `rank`'s shards of `full`'s weights."""
    region = Engram(c, dtype=full.dtype, topo=topo)
    for spec in region.specs:
        part = shard("engram", spec.name, getattr(full, spec.name), c, topo, rank, spec.buffer_shape)
        getattr(region, spec.name).copy_(part)
    region.rank.fill_(rank)
    return region


def _divided(full: Engram, c, topo: Topology, h, rows, rows_s, token_mask) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's `kv` summed over its token group (float32), then `mix` on each rank -> (the summed
    keys and value, the streams), the same on every rank of the group (checked)."""
    for group in topo.token_groups():
        regions = [_ranked(full, c, topo, r) for r in group]
        assert all(r.methods() == (ENGRAM_KV, ENGRAM_MIX) for r in regions)
        parts = [r.kv(rows, rows_s) for r in regions]
        assert all(p.dtype == torch.float32 for p in parts)
        holders = [r for r, p in zip(group, parts) if p.any()]
        assert holders == [r for r in group if engram_slice(c, topo, r) is not None]  # the others add zeros
        kv = torch.stack(parts).sum(0)
        outs = [r.mix(h, kv, token_mask) for r in regions]
        assert all(torch.equal(o, outs[0]) for o in outs)
    return kv, outs[0]


def _one_rank_kv(full: Engram, rows, rows_s) -> torch.Tensor:
    x = dequant_fp8_rows(rows, rows_s, full.dtype, full.fp8_format).flatten(-2)
    return ops.blockquant_gemm(x, full.wkv, full.wkv_s, full.fp8).float()


LAYOUTS = {"tp=2": Topology(tp=2), "cp=2": Topology(cp=2), "cp=ep=4": Topology(cp=4, ep=4)}
LAYOUTS["tp=2,cp=2"] = Topology(tp=2, cp=2)


@pytest.mark.parametrize("topo", LAYOUTS.values(), ids=LAYOUTS)
def test_engram_partials_all_reduced_give_the_one_rank_engram(tiny_ckpt, text, topo):
    """The tiny model's engram (4 hash heads x 32: 128 columns, 4 blocks) over token groups of 2 and 4."""
    full = Engram(text, dtype=torch.float32)
    load_region(Checkpoint(tiny_ckpt), full, "layers.1.")
    h, rows, rows_s, token_mask = example_inputs(full.input_specs(2, 3, G), G, seed=11)
    token_mask[1, 2] = False  # a padded token: no update
    want = full.decode(h, rows, rows_s, token_mask)
    kv, got = _divided(full, text, topo, h, rows, rows_s, token_mask)
    torch.testing.assert_close(kv, _one_rank_kv(full, rows, rows_s), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[1, 2], h[1, 2]) and not torch.equal(got, h)
    width = engram_width(text, topo)
    assert width * topo.group_size == 128 and _ranked(full, text, topo, 1).wkv.shape[-1] == width


def _synthetic(c, seed: int) -> Engram:
    """The one-rank engram of config `c` with seeded weights: fp8 codes without NaN, scales near 2^-7."""
    gen = torch.Generator().manual_seed(seed)
    full = Engram(c, dtype=torch.float32)
    codes = torch.randint(0, 0x7F, full.wkv.shape, generator=gen, dtype=torch.uint8)
    full.wkv.copy_(codes | (torch.randint(0, 2, full.wkv.shape, generator=gen, dtype=torch.uint8) << 7))
    full.wkv_s.copy_(torch.randint(118, 122, full.wkv_s.shape, generator=gen, dtype=torch.uint8))
    full.q_weight.copy_(1 + 0.1 * torch.randn(full.q_weight.shape, generator=gen))
    full.k_weight.copy_(1 + 0.1 * torch.randn(full.k_weight.shape, generator=gen))
    return full


def _engram_config(text, *, hidden: int, ngram: int, heads: int, head_dim: int):
    c = dataclasses.replace(
        text, hidden_size=hidden, engram_max_ngram_size=ngram, engram_n_heads=heads, engram_head_dim=head_dim
    )
    assert c.hc_mult == 4
    return c


@pytest.mark.parametrize("cp, holders", [(2, 2), (3, 3), (4, 3), (6, 5)])
def test_engram_columns_that_do_not_divide(text, cp, holders):
    """160 columns (5 hash heads x 32): whole blocks over the first ranks, the last holder's slice
    zero-padded, zeros on the ranks past the columns; the sum is still the one-rank engram."""
    c = _engram_config(text, hidden=text.hidden_size, ngram=6, heads=1, head_dim=32)
    topo = Topology(cp=cp)
    full = _synthetic(c, seed=cp)
    h, rows, rows_s, token_mask = example_inputs(full.input_specs(1, 2, G), G, seed=cp)
    assert [engram_slice(c, topo, r) is not None for r in range(cp)] == [r < holders for r in range(cp)]
    kv, got = _divided(full, c, topo, h, rows, rows_s, token_mask)
    torch.testing.assert_close(kv, _one_rank_kv(full, rows, rows_s), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got, full.decode(h, rows, rows_s, token_mask), rtol=1e-5, atol=1e-5)


def test_engram_at_the_release_widths_over_64_ranks(text):
    """The release's engram widths (D 5120, hc 4, 24 hash heads x 256: wkv [25600, 6144], 157 MB of
    fp8) with synthetic weights, at EP = CP = 64 as 64 slices on one process: 96 columns (3 blocks,
    2.5 MB) a rank, their partials summed are the one-rank keys and value and the same streams."""
    c = _engram_config(text, hidden=5120, ngram=4, heads=8, head_dim=256)
    assert c.engram_hash_heads == 24
    topo = Topology(cp=64, ep=64)
    full = _synthetic(c, seed=0)
    assert tuple(full.wkv.shape) == (25600, 6144)
    assert engram_width(c, topo) == 96 and engram_slice(c, topo, 63) == (6048, 6144)
    h, rows, rows_s, token_mask = example_inputs(full.input_specs(1, 2, G), G, seed=1)
    kv, got = _divided(full, c, topo, h, rows, rows_s, token_mask)
    torch.testing.assert_close(kv, _one_rank_kv(full, rows, rows_s), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got, full.decode(h, rows, rows_s, token_mask), rtol=1e-5, atol=1e-5)
    one = Engram(c, dtype=torch.float32, topo=topo)
    assert one.wkv.numel() + one.wkv_s.numel() == 25600 * 96 + 800 * 3  # 2.46 MB a rank, not 157 MB


def test_engram_cut_and_boundary(text):
    """The cut streams each rank's input columns (scales: their 32-blocks) or nothing; the gate vectors
    stay whole; a token group of one rank (EP dispatch, one rank) keeps the whole projection, one
    method and no collective; over several ranks `kv`'s output is reduced over the token groups."""
    topo = Topology(cp=3)  # 128 columns: 64 (2 blocks) on ranks 0-1, zeros on rank 2
    assert [cut("engram", "wkv", text, topo, r) for r in range(3)] == [Cut(cols=(0, 64)), Cut(cols=(64, 128)), ZERO]
    assert cut("engram", "wkv_s", text, topo, 1) == Cut(cols=(2, 4))
    assert replicated("engram", "q_weight", text, topo) and not replicated("engram", "wkv", text, topo)
    assert boundary_reduce("engram", ENGRAM_KV, topo) == {"kv": [[0, 1, 2]]}
    assert boundary_reduce("engram", ENGRAM_KV, Topology(tp=2, cp=2, ep=4)) == {"kv": [[0, 1, 2, 3]]}
    assert boundary_reduce("engram", ENGRAM_MIX, topo) == {}
    for one in (Topology(), Topology(ep=2)):
        assert Engram(text, dtype=torch.float32, topo=one).methods() == (DECODE,)
        assert all(cut("engram", n, text, one, r) == WHOLE for n in ("wkv", "wkv_s") for r in range(one.world))
        assert boundary_reduce("engram", DECODE, one) == {} and boundary_reduce("engram", ENGRAM_KV, one) == {}
    assert Topology(ep=4).token_groups() == [[0], [1], [2], [3]]
    assert Topology(tp=2, cp=2).token_groups() == [[0, 1, 2, 3]]
