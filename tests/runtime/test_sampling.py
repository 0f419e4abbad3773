"""`runtime.sampling.sample` at the edges of what the server accepts: every temperature in (0, 2] and
top_p in (0, 1], however small, samples a real token (issue 33: 1e-300 made the probabilities NaN and
killed the engine thread)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.runtime.sampling import Sampling, sample

V = 50


def logits(seed: int = 0) -> torch.Tensor:
    return torch.randn(V, generator=torch.Generator().manual_seed(seed)) * 10  # [V]


def test_tiny_temperature_is_greedy():
    x = logits()
    for t in (1e-300, 5e-324, 1e-45, 1e-30):
        assert sample(x, Sampling(temperature=t, seed=1), Sampling(temperature=t, seed=1).generator()) == int(
            x.argmax()
        )


def test_tiny_top_p_keeps_the_most_likely_token():
    x = logits(1)
    for p in (1e-300, 5e-324, 1e-9):
        s = Sampling(temperature=1.0, top_p=p, seed=3)
        assert sample(x, s, s.generator()) == int(x.argmax())


def test_tiny_values_with_bias_mask_and_top_k():
    x = logits(2)
    allowed = torch.zeros(V, dtype=torch.bool)
    allowed[[4, 9, 17]] = True
    s = Sampling(temperature=1e-300, top_p=1e-300, top_k=2, seed=0, logit_bias=((9, 100.0),))
    assert sample(x, s, s.generator(), allowed=allowed) == 9


def test_ties_at_a_tiny_temperature_draw_among_the_tied():
    x = torch.full((V,), -5.0)
    x[[3, 7]] = 2.0
    s = Sampling(temperature=1e-300, seed=5)
    g = s.generator()
    assert {sample(x, s, g) for _ in range(20)} <= {3, 7}


@settings(max_examples=60, deadline=None)
@given(
    st.floats(min_value=5e-324, max_value=2.0),
    st.floats(min_value=5e-324, max_value=1.0),
    st.integers(min_value=0, max_value=V + 5),
    st.integers(min_value=0, max_value=2**31),
    st.floats(min_value=-2, max_value=2),
)
def test_any_accepted_value_samples_a_token(temperature, top_p, top_k, seed, penalty):
    x = logits(seed % 7)
    s = Sampling(temperature, top_p, top_k, seed, presence_penalty=penalty, frequency_penalty=penalty)
    token = sample(x, s, s.generator(), generated=[1, 1, 2])
    assert 0 <= token < V
