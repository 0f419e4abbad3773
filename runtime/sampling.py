"""How a request picks its tokens: its `Sampling` settings and `sample`, one position at a time.

Greedy (argmax) at temperature 0, else top-k, then top-p, then a draw from the request's own seeded
generator; a logit bias and presence and frequency penalties (over the tokens the request generated
so far) adjust the logits first, in float32, before the temperature. The scheduler
(`runtime/schedule.py`) calls `sample` for every sequence that picks a token after a step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Sampling:
    """How a request picks its tokens: temperature 0 is greedy; top_k 0 and top_p 1 keep every token.
    `logit_bias` ((token id, value) pairs) is added to the logits; a token generated c times so far
    loses c * frequency_penalty + (c > 0) * presence_penalty (OpenAI's definitions)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    @property
    def adjusts(self) -> bool:
        """Whether the logits are changed before the pick (a bias or a penalty)."""
        return bool(self.logit_bias) or self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def plain_greedy(self) -> bool:
        """The argmax of the model's own logits (what speculative decoding verifies against)."""
        return self.temperature == 0 and not self.adjusts

    def generator(self) -> torch.Generator | None:
        if self.temperature == 0:
            return None
        g = torch.Generator()
        if self.seed is None:
            g.seed()
        else:
            g.manual_seed(self.seed)
        return g


GREEDY = Sampling()


def adjusted(logits: Tensor, s: Sampling, generated: Sequence[int]) -> Tensor:
    """One position's logits [V] in float32 with `s`'s bias and penalties over `generated` applied."""
    x = logits.float().clone()
    if s.logit_bias:
        ids, values = zip(*s.logit_bias)
        x.index_add_(0, torch.tensor(ids, dtype=torch.int64), torch.tensor(values, dtype=torch.float32))
    if generated and (s.presence_penalty or s.frequency_penalty):
        counts = torch.bincount(torch.tensor(generated, dtype=torch.int64), minlength=x.numel()).float()
        x -= counts * s.frequency_penalty + (counts > 0).float() * s.presence_penalty
    return x


def sample(
    logits: Tensor,
    s: Sampling,
    generator: torch.Generator | None,
    generated: Sequence[int] = (),
    allowed: Tensor | None = None,
) -> int:
    """The next token from one position's logits [V], `generated` the request's tokens so far; with
    `allowed` (bool [V], a grammar's mask) only among those tokens, masked after the bias and penalties.

    Safe for every temperature in (0, 2] and top_p in (0, 1], however small: the logits, in float64,
    are shifted so that their largest is 0 before the temperature divides them (nothing overflows to
    +inf; a temperature so small that every other logit underflows to -inf is greedy), top-p compares
    log probability mass and always keeps the most likely token, and the draw is from probabilities
    whose largest is at least 1 / V (never all zero, never NaN)."""
    if s.plain_greedy and allowed is None:
        return int(torch.argmax(logits))
    x = adjusted(logits, s, generated) if s.adjusts else logits.float()
    if allowed is not None:
        x = x.masked_fill(~allowed, float("-inf"))
    top = int(torch.argmax(x))
    if s.temperature == 0 or not math.isfinite(float(x[top])):
        return top  # greedy, or nothing finite to draw from (the scheduler refuses non-finite logits first)
    z = (x.double() - float(x[top])) / s.temperature  # [V] <= 0: 0 at the top, -inf where masked or underflowed
    if 0 < s.top_k < z.numel():
        kth = torch.topk(z, s.top_k).values[-1]
        z = z.masked_fill(z < kth, float("-inf"))
    if s.top_p < 1.0:
        order = torch.argsort(z, descending=True)
        mass = torch.logcumsumexp(torch.log_softmax(z[order], -1), -1)  # log of the mass up to each rank
        above = torch.cat([mass.new_full((1,), float("-inf")), mass[:-1]])  # of the tokens ranked above
        z[order[above >= math.log(s.top_p)]] = float("-inf")  # the smallest prefix reaching top_p stays
    return int(torch.multinomial(torch.softmax(z, -1), 1, generator=generator))
