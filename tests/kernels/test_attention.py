"""Attention kernels (kernels/attention.py) against per-query loops."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import deepinfer.kernels  # noqa: F401  (registers the ops)

OPS = torch.ops.deepinfer


# ---------------------------------------------------------------- sparse_attn


def _loop_sparse_attn(q, kv, valid, sink, scale):
    """For each query and head: softmax over [scale * q.k for valid keys] + [sink], values kv."""
    b_, t_, h_, d = q.shape
    out = torch.zeros(b_, t_, h_, d, dtype=torch.float64)
    for b in range(b_):
        for t in range(t_):
            keys = [k for k in range(kv.shape[2]) if bool(valid[b, t, k])]
            for h in range(h_):
                logits = [scale * float(q[b, t, h].double() @ kv[b, t, k].double()) for k in keys]
                top = max(logits + [float(sink[h])])
                e = [math.exp(v - top) for v in logits]
                denom = sum(e) + math.exp(float(sink[h]) - top)
                for w, k in zip(e, keys):
                    out[b, t, h] += w / denom * kv[b, t, k].double()
    return out


def _attn_inputs(gen, b, t, h, k, d, p_valid=0.6):
    q = torch.randn(b, t, h, d, generator=gen)
    kv = torch.randn(b, t, k, d, generator=gen)
    valid = torch.rand(b, t, k, generator=gen) < p_valid
    sink = torch.randn(h, generator=gen)
    return q, kv, valid, sink


def test_sparse_attn_matches_loop():
    gen = torch.Generator().manual_seed(0)
    q, kv, valid, sink = _attn_inputs(gen, 2, 3, 4, 10, 16)
    valid[0, 0] = False  # a query with no keys at all
    got = OPS.sparse_attn(q, kv, valid, sink, 16**-0.5)
    assert got.shape == q.shape and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _loop_sparse_attn(q, kv, valid, sink, 16**-0.5), rtol=1e-5, atol=1e-6)
    assert torch.equal(got[0, 0], torch.zeros(4, 16))  # all weight on the zero-value sink


@pytest.mark.parametrize("garbage", [float("nan"), float("inf"), float("-inf"), 3e38])
def test_sparse_attn_ignores_garbage_in_invalid_keys(garbage):
    gen = torch.Generator().manual_seed(1)
    q, kv, valid, sink = _attn_inputs(gen, 2, 3, 4, 10, 16)
    clean = _loop_sparse_attn(q, kv, valid, sink, 0.25)
    dirty = kv.clone()
    dirty[~valid] = garbage
    got = OPS.sparse_attn(q, dirty, valid, sink, 0.25)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), clean, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shares", [2, 3])
def test_partial_attention_shares_merge_to_the_whole(shares):
    """Keys split among ranks (each key on one, the sink on the first): the shares' numerators, maxima
    and sums merged by log-sum-exp are the per-query loop's attention over every key; a share with
    no key and no sink has max -inf and sum 0 and weighs nothing."""
    from deepinfer.regions.divided import merge_attention

    gen = torch.Generator().manual_seed(3)
    q, kv, valid, sink = _attn_inputs(gen, 2, 3, 4, 12, 16)
    valid[0, 0] = False  # a query with no key anywhere: the sink alone
    owner = torch.randint(0, shares, (2, 3, 12), generator=gen)
    owner[1, 2] = 0  # a query whose keys are all on the first share: the others are empty
    parts = [
        OPS.sparse_attn_partial(q, kv, valid & (owner == r), sink, 0.25, torch.tensor(r == 0)) for r in range(shares)
    ]
    assert float(parts[1][1][1, 2].max()) == float("-inf") and float(parts[1][2][1, 2].abs().max()) == 0.0
    got = merge_attention(*(torch.stack(x) for x in zip(*parts)))
    torch.testing.assert_close(got.double(), _loop_sparse_attn(q, kv, valid, sink, 0.25), rtol=1e-5, atol=1e-6)


def test_sparse_attn_sink_takes_its_share():
    # one valid key with logit 0 and a sink logit 0: the key gets half the weight
    q = torch.zeros(1, 1, 2, 4)
    kv = torch.ones(1, 1, 3, 4)
    valid = torch.tensor([[[False, True, False]]])
    sink = torch.tensor([0.0, math.log(3.0)])
    got = OPS.sparse_attn(q, kv, valid, sink, 1.0)
    torch.testing.assert_close(got[0, 0, 0], torch.full((4,), 0.5))
    torch.testing.assert_close(got[0, 0, 1], torch.full((4,), 0.25))


def test_sparse_attn_scale_applies_to_logits_not_sink():
    q = torch.tensor([[[[2.0, 0.0]]]])
    kv = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]]])
    valid = torch.ones(1, 1, 2, dtype=torch.bool)
    sink = torch.tensor([1.0])
    got = OPS.sparse_attn(q, kv, valid, sink, 0.5)
    # logits 1 (key 0), 0 (key 1), sink 1
    e = [math.e, 1.0, math.e]
    want = torch.tensor([e[0], e[1]], dtype=torch.float64) / sum(e)
    torch.testing.assert_close(got[0, 0, 0].double(), want, rtol=1e-6, atol=0)


def test_sparse_attn_bf16():
    gen = torch.Generator().manual_seed(2)
    q, kv, valid, sink = _attn_inputs(gen, 1, 4, 2, 12, 32)
    q, kv = q.to(torch.bfloat16), kv.to(torch.bfloat16)
    got = OPS.sparse_attn(q, kv, valid, sink, 32**-0.5)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), _loop_sparse_attn(q, kv, valid, sink, 32**-0.5), rtol=2**-7, atol=2**-8)


@settings(max_examples=15, deadline=None)
@given(
    b=st.integers(1, 2),
    t=st.integers(1, 3),
    h=st.integers(1, 3),
    k=st.integers(1, 9),
    d=st.integers(1, 8),
    seed=st.integers(0, 2**16),
)
def test_sparse_attn_property(b, t, h, k, d, seed):
    gen = torch.Generator().manual_seed(seed)
    q, kv, valid, sink = _attn_inputs(gen, b, t, h, k, d)
    kv = torch.where(valid.unsqueeze(-1), kv, torch.full_like(kv, float("nan")))
    got = OPS.sparse_attn(q, kv, valid, sink, d**-0.5)
    assert got.shape == (b, t, h, d)
    torch.testing.assert_close(got.double(), _loop_sparse_attn(q, kv, valid, sink, d**-0.5), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- index_score


def _loop_index_score(q, k, w, visible):
    b_, t_, h_, _ = q.shape
    n = k.shape[1]
    out = torch.full((b_, t_, n), float("-inf"), dtype=torch.float64)
    for b in range(b_):
        for t in range(t_):
            for j in range(n):
                if not bool(visible[b, t, j]):
                    continue
                out[b, t, j] = sum(
                    max(float(q[b, t, h].double() @ k[b, j].double()), 0.0) * float(w[b, t, h]) for h in range(h_)
                )
    return out


def test_index_score_matches_loop():
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 3, 4, 16, generator=gen)
    k = torch.randn(2, 7, 16, generator=gen)
    w = torch.randn(2, 3, 4, generator=gen)
    visible = torch.rand(2, 3, 7, generator=gen) < 0.7
    got = OPS.index_score(q, k, w, visible)
    assert got.shape == (2, 3, 7) and got.dtype == torch.float32
    want = _loop_index_score(q, k, w, visible)
    assert torch.equal(torch.isneginf(got), ~visible)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_index_score_relu_per_head_before_weighting():
    # head 0 dot = +2, head 1 dot = -3: relu drops head 1 even with a negative weight
    q = torch.tensor([[[[1.0, 0.0], [-1.5, 0.0]]]])
    k = torch.tensor([[[2.0, 0.0]]])
    w = torch.tensor([[[0.5, -4.0]]])
    got = OPS.index_score(q, k, w, torch.ones(1, 1, 1, dtype=torch.bool))
    assert got.item() == 1.0


def test_index_score_causal_visibility():
    # compressed entry t is visible at position p iff t < (p + 1) // ratio
    ratio, positions, entries = 2, 8, 4
    visible = torch.tensor([[[j < (p + 1) // ratio for j in range(entries)] for p in range(positions)]])
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(1, positions, 2, 8, generator=gen)
    k = torch.randn(1, entries, 8, generator=gen)
    w = torch.rand(1, positions, 2, generator=gen)
    got = OPS.index_score(q, k, w, visible)
    assert torch.isneginf(got[0, 0]).all()  # position 0 sees nothing
    assert torch.isfinite(got[0, 7]).all()  # position 7 sees all 4
    torch.testing.assert_close(got.double(), _loop_index_score(q, k, w, visible), rtol=1e-5, atol=1e-5)


def test_index_score_bf16():
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 3, 4, 32, generator=gen).to(torch.bfloat16)
    k = torch.randn(1, 6, 32, generator=gen).to(torch.bfloat16)
    w = torch.rand(1, 3, 4, generator=gen)
    visible = torch.ones(1, 3, 6, dtype=torch.bool)
    got = OPS.index_score(q, k, w, visible)
    assert got.dtype == torch.bfloat16
    want = _loop_index_score(q, k, w, visible)
    torch.testing.assert_close(got.double(), want, rtol=2**-6, atol=0.1)


# ---------------------------------------------------------------- compress_pool


def _loop_compress_pool(kv, gate):
    b_, g_, r, c = kv.shape
    out = torch.zeros(b_, g_, c, dtype=torch.float64)
    for b in range(b_):
        for g in range(g_):
            for ch in range(c):
                z = [float(gate[b, g, j, ch]) for j in range(r)]
                top = max(z)
                e = [math.exp(v - top) for v in z]
                out[b, g, ch] = sum(e[j] / sum(e) * float(kv[b, g, j, ch]) for j in range(r))
    return out


@pytest.mark.parametrize("r", [1, 2, 4])
def test_compress_pool_matches_loop(r):
    gen = torch.Generator().manual_seed(r)
    kv = torch.randn(2, 3, r, 10, generator=gen)
    gate = torch.randn(2, 3, r, 10, generator=gen) * 3
    got = OPS.compress_pool(kv, gate)
    assert got.shape == (2, 3, 10) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _loop_compress_pool(kv, gate), rtol=1e-5, atol=1e-6)
    if r == 1:
        assert torch.equal(got, kv[:, :, 0])


def test_compress_pool_softmax_over_tokens_per_channel():
    kv = torch.tensor([[[[1.0, 10.0], [3.0, 30.0]]]])  # [1, 1, r=2, C=2]
    gate = torch.tensor([[[[0.0, 1000.0], [0.0, -1000.0]]]])  # channel 0 even, channel 1 token 0
    got = OPS.compress_pool(kv, gate)
    torch.testing.assert_close(got, torch.tensor([[[2.0, 10.0]]]))


def test_compress_pool_bf16_inputs_float32_output():
    gen = torch.Generator().manual_seed(6)
    kv = torch.randn(1, 2, 2, 16, generator=gen).to(torch.bfloat16)
    gate = torch.randn(1, 2, 2, 16, generator=gen).to(torch.bfloat16)
    got = OPS.compress_pool(kv, gate)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _loop_compress_pool(kv, gate), rtol=1e-5, atol=1e-6)
