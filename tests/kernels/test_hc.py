"""Hyper-connection kernels (kernels/hc.py) against MODEL.md's formulas, written as loops."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import deepinfer.kernels  # noqa: F401  (registers the ops)

OPS = torch.ops.deepinfer


def _sigmoid(v: float) -> float:
    return 1.0 / (1.0 + math.exp(-v))


def _loop_mixes(h, fn, base, scale, norm_eps, hc_eps, iters):
    """MODEL.md "Hyper-connection mixes" for one position: h [n, D] -> pre [n], post [n], comb [n, n]."""
    n, d = h.shape
    flat = [float(v) for v in h.double().reshape(n * d)]
    inv_rms = 1.0 / math.sqrt(sum(v * v for v in flat) / len(flat) + norm_eps)
    fnd = fn.double()
    s = [float(scale[0])] * n + [float(scale[1])] * n + [float(scale[2])] * (n * n)
    logits = []
    for j in range((2 + n) * n):
        mix = sum(float(fnd[j, c]) * flat[c] for c in range(n * d)) * inv_rms
        logits.append(float(base[j]) + mix * s[j])
    pre = [_sigmoid(v) + hc_eps for v in logits[:n]]
    post = [2 * _sigmoid(v) for v in logits[n : 2 * n]]
    comb = []
    for i in range(n):  # softmax over each row, + eps
        row = logits[2 * n + i * n : 2 * n + (i + 1) * n]
        top = max(row)
        e = [math.exp(v - top) for v in row]
        comb.append([v / sum(e) + hc_eps for v in e])

    def normalise_columns():
        for o in range(n):
            col = sum(comb[i][o] for i in range(n)) + hc_eps
            for i in range(n):
                comb[i][o] /= col

    def normalise_rows():
        for i in range(n):
            row = sum(comb[i]) + hc_eps
            comb[i] = [v / row for v in comb[i]]

    normalise_columns()
    for _ in range(iters - 1):
        normalise_rows()
        normalise_columns()
    return (
        torch.tensor(pre, dtype=torch.float64),
        torch.tensor(post, dtype=torch.float64),
        torch.tensor(comb, dtype=torch.float64),
    )


def _inputs(gen, b, t, n, d, dtype=torch.float32):
    h = (torch.randn(b, t, n, d, generator=gen) * 2).to(dtype)
    fn = torch.randn((2 + n) * n, n * d, generator=gen) * 0.2
    base = torch.randn((2 + n) * n, generator=gen) * 0.5
    scale = torch.rand(3, generator=gen) + 0.5
    return h, fn, base, scale


# ---------------------------------------------------------------- hc_mixes


@pytest.mark.parametrize("iters", [1, 2, 20])
@pytest.mark.parametrize("n, d", [(4, 8), (2, 5)])
def test_hc_mixes_matches_loop(iters, n, d):
    gen = torch.Generator().manual_seed(iters * 10 + n)
    h, fn, base, scale = _inputs(gen, 2, 3, n, d)
    pre, post, comb = OPS.hc_mixes(h, fn, base, scale, 1e-6, 1e-6, iters)
    assert pre.shape == (2, 3, n) and post.shape == (2, 3, n) and comb.shape == (2, 3, n, n)
    assert pre.dtype == post.dtype == comb.dtype == torch.float32
    for b in range(2):
        for t in range(3):
            want_pre, want_post, want_comb = _loop_mixes(h[b, t], fn, base, scale, 1e-6, 1e-6, iters)
            torch.testing.assert_close(pre[b, t].double(), want_pre, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(post[b, t].double(), want_post, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(comb[b, t].double(), want_comb, rtol=1e-5, atol=1e-6)


def test_hc_mixes_large_eps_distinguishes_placement():
    # with a big hc_eps the places eps is added (after softmax, in each denominator) matter
    gen = torch.Generator().manual_seed(1)
    h, fn, base, scale = _inputs(gen, 1, 2, 4, 6)
    pre, post, comb = OPS.hc_mixes(h, fn, base, scale, 1e-3, 0.1, 5)
    for t in range(2):
        want_pre, want_post, want_comb = _loop_mixes(h[0, t], fn, base, scale, 1e-3, 0.1, 5)
        torch.testing.assert_close(pre[0, t].double(), want_pre, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(post[0, t].double(), want_post, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(comb[0, t].double(), want_comb, rtol=1e-5, atol=1e-6)


def test_hc_mixes_comb_is_doubly_stochastic_after_many_iterations():
    gen = torch.Generator().manual_seed(2)
    h, fn, base, scale = _inputs(gen, 2, 4, 4, 16)
    _, _, comb = OPS.hc_mixes(h, fn, base, scale, 1e-20, 1e-6, 20)
    cols, rows = comb.sum(-2), comb.sum(-1)
    torch.testing.assert_close(cols, torch.ones_like(cols), rtol=0, atol=1e-5)
    torch.testing.assert_close(rows, torch.ones_like(rows), rtol=0, atol=1e-3)
    assert (comb > 0).all()


def test_hc_mixes_ranges_and_bf16_streams():
    gen = torch.Generator().manual_seed(3)
    h, fn, base, scale = _inputs(gen, 1, 3, 4, 8, dtype=torch.bfloat16)
    pre, post, comb = OPS.hc_mixes(h, fn, base, scale, 1e-20, 1e-6, 20)
    assert pre.dtype == torch.float32
    assert ((pre > 1e-6) & (pre <= 1 + 1e-6)).all() and ((post > 0) & (post < 2)).all()
    for t in range(3):
        want_pre, want_post, want_comb = _loop_mixes(h[0, t].float(), fn, base, scale, 1e-20, 1e-6, 20)
        torch.testing.assert_close(pre[0, t].double(), want_pre, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(comb[0, t].double(), want_comb, rtol=1e-5, atol=1e-6)


def test_hc_mixes_scale_groups():
    # fn = 0 leaves only base: scale must not matter; base alone fixes pre/post/comb
    n, d = 4, 3
    h = torch.randn(1, 1, n, d)
    base = torch.zeros((2 + n) * n)
    base[:n] = torch.tensor([0.0, 1.0, -1.0, 2.0])
    pre, post, comb = OPS.hc_mixes(
        h, torch.zeros((2 + n) * n, n * d), base, torch.tensor([9.0, 9.0, 9.0]), 1e-20, 0.0, 3
    )
    torch.testing.assert_close(pre[0, 0], torch.sigmoid(base[:n]))
    torch.testing.assert_close(post[0, 0], torch.ones(n))
    torch.testing.assert_close(comb[0, 0], torch.full((n, n), 1 / n))
    # with fn non-zero only on the post rows, only s1 scales them
    fn = torch.zeros((2 + n) * n, n * d)
    fn[n : 2 * n, 0] = 1.0
    h = torch.ones(1, 1, n, d)  # rms 1, mix = 1 on the post rows
    _, post, _ = OPS.hc_mixes(h, fn, torch.zeros((2 + n) * n), torch.tensor([5.0, 0.5, 7.0]), 1e-20, 0.0, 1)
    torch.testing.assert_close(post[0, 0], 2 * torch.sigmoid(torch.full((n,), 0.5)))


# ---------------------------------------------------------------- collapse / expand


def _loop_collapse(h, pre):
    b_, t_, n, d = h.shape
    out = torch.zeros(b_, t_, d, dtype=torch.float64)
    for b in range(b_):
        for t in range(t_):
            for i in range(n):
                out[b, t] += float(pre[b, t, i]) * h[b, t, i].double()
    return out


def _loop_expand(out, h, post, comb):
    b_, t_, n, d = h.shape
    res = torch.zeros(b_, t_, n, d, dtype=torch.float64)
    for b in range(b_):
        for t in range(t_):
            for o in range(n):
                res[b, t, o] = float(post[b, t, o]) * out[b, t].double()
                for i in range(n):
                    res[b, t, o] += float(comb[b, t, i, o]) * h[b, t, i].double()
    return res


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_collapse_matches_loop(dtype):
    gen = torch.Generator().manual_seed(4)
    h = torch.randn(2, 3, 4, 16, generator=gen).to(dtype)
    pre = torch.rand(2, 3, 4, generator=gen)
    got = OPS.hc_collapse(h, pre)
    assert got.shape == (2, 3, 16) and got.dtype == dtype
    want = _loop_collapse(h, pre)
    tol = 1e-5 if dtype == torch.float32 else 2**-8
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    if dtype == torch.bfloat16:  # float32 accumulation, one rounding
        assert (got == want.to(dtype)).float().mean().item() > 0.98


def test_hc_collapse_one_hot_selects_stream():
    h = torch.randn(1, 2, 4, 8)
    pre = torch.zeros(1, 2, 4)
    pre[0, 0, 0] = 1.0
    pre[0, 1, 3] = 1.0
    got = OPS.hc_collapse(h, pre)
    assert torch.equal(got[0, 0], h[0, 0, 0]) and torch.equal(got[0, 1], h[0, 1, 3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_expand_matches_loop(dtype):
    gen = torch.Generator().manual_seed(5)
    h = torch.randn(2, 3, 4, 16, generator=gen).to(dtype)
    out = torch.randn(2, 3, 16, generator=gen).to(dtype)
    post = torch.rand(2, 3, 4, generator=gen) * 2
    comb = torch.rand(2, 3, 4, 4, generator=gen)
    got = OPS.hc_expand(out, h, post, comb)
    assert got.shape == (2, 3, 4, 16) and got.dtype == dtype
    want = _loop_expand(out, h, post, comb)
    tol = 1e-5 if dtype == torch.float32 else 2**-8
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


def test_hc_expand_comb_orientation():
    # comb[i, o] moves input stream i to output stream o (not the transpose)
    n, d = 3, 2
    h = torch.arange(n * d, dtype=torch.float32).view(1, 1, n, d) + 1
    comb = torch.zeros(1, 1, n, n)
    comb[0, 0, 0, 2] = 1.0  # stream 0 -> output 2
    comb[0, 0, 1, 0] = 1.0  # stream 1 -> output 0
    comb[0, 0, 2, 1] = 1.0  # stream 2 -> output 1
    got = OPS.hc_expand(torch.zeros(1, 1, d), h, torch.zeros(1, 1, n), comb)
    assert torch.equal(got[0, 0], h[0, 0, [1, 2, 0]])


@settings(max_examples=15, deadline=None)
@given(b=st.integers(1, 2), t=st.integers(1, 3), n=st.integers(1, 4), d=st.integers(1, 9), seed=st.integers(0, 2**16))
def test_hc_collapse_expand_property(b, t, n, d, seed):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(b, t, n, d, generator=gen)
    out = torch.randn(b, t, d, generator=gen)
    pre, post = torch.rand(b, t, n, generator=gen), torch.rand(b, t, n, generator=gen)
    comb = torch.rand(b, t, n, n, generator=gen)
    torch.testing.assert_close(OPS.hc_collapse(h, pre).double(), _loop_collapse(h, pre), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        OPS.hc_expand(out, h, post, comb).double(), _loop_expand(out, h, post, comb), rtol=1e-5, atol=1e-5
    )
