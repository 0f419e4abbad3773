"""The token budget of a step (chunked prefill, as vLLM's `max_num_batched_tokens`): how many tokens
each running sequence feeds in the scheduler's next step (`runtime/schedule.py`, `max_step_tokens`).

The policy, in order:
1. Decode rows first: every sequence that has fed its prompt feeds its unfed token and, with a
   drafter, its drafts (a verify row: the unfed token plus its drafts). Each costs the tokens it
   feeds, and they all run even where together they exceed the budget: a running sequence gets a
   token every step however long the prompts prefilling beside it, and a step always makes progress.
2. Then the prompt chunks of running sequences, in admission order: each is cut to what is left of
   the budget, to the stepper's `chunk` (the largest tokens bucket) and to the rest of its prompt.
   With prefix caching a chunk that reaches a block edge then ends at the last edge it reaches, as
   without a budget (the slot state at that edge is kept with the cached blocks); a chunk the budget
   cuts short of every edge runs as cut, and its blocks are cached at the next edge a later chunk
   ends on (a prefix cache match falls back to the last block that kept a state: regions/prefix.py).
   A prompt left no tokens waits for a later step in its place: the prompts admitted before it go
   first (FIFO), so none starves; with no decode row the first prompt gets at least one token.
No budget (None): every prompt feeds its whole chunk each step, decodes beside it.
3. Where the stepper's prompt steps take fewer sequences than its decode steps (a bundle compiled
   with `[buckets] prompt_batch`), a step that cannot hold every planned row at a prompt bucket
   alternates: a step of the decode rows, then one of the first prompt chunks (`fit_prompt_batch`).

The stepper runs a step at the smallest (batch, tokens) bucket that holds it: B_bucket >= its rows,
T_bucket >= its longest row (`runtime.executor.Steps.run`). Rows of a mixed step are padded to the
step's T bucket (a decode row beside a prompt chunk computes T_bucket rows), so the budget bounds the
padded work too: B_bucket x T_bucket with T_bucket at most the bucket of min(budget, chunk) (or of
the longest verify row). What trades: a small budget keeps the time between tokens of running
sequences short and bounds a step's size, at the price of a long prompt's time to first token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from deepinfer.errors import DeepinferError

if TYPE_CHECKING:  # the scheduler's record of a request; schedule.py imports this module
    from deepinfer.runtime.schedule import Running


class BudgetError(DeepinferError, ValueError):
    """A step token budget too small to make progress (under 1, or under a verify row of the drafter)."""


def check_budget(max_step_tokens: int | None, draft_block: int | None = None) -> None:
    """Refuse a budget a step cannot work within: at least 1 token, and with a drafter of `draft_block`
    tokens at least its verify row (draft_block + 1)."""
    if max_step_tokens is None:
        return
    if isinstance(max_step_tokens, bool) or not isinstance(max_step_tokens, int) or max_step_tokens < 1:
        raise BudgetError(f"max_step_tokens must be a whole number of tokens, at least 1 (got {max_step_tokens!r})")
    if draft_block is not None and max_step_tokens < draft_block + 1:
        raise BudgetError(
            f"max_step_tokens {max_step_tokens} is smaller than a speculative verify row ({draft_block} drafts and "
            f"the unfed token): give at least {draft_block + 1}, or decode without --speculative"
        )


@dataclass
class StepTokens:
    """A run's token budget a step (`limit`, None: none) and what its steps fed: prompt tokens, decode
    tokens (unfed tokens and drafts), and the most tokens one step fed; `padded` rows come from the
    stepper (`runtime.executor.Stats.padded`)."""

    limit: int | None = None
    prompt_turn: bool = False  # `fit_prompt_batch`: whether the next step that cannot hold every row prefills
    steps: int = 0
    prompt: int = 0
    decode: int = 0
    largest: int = 0  # tokens of the step that fed the most

    def record(self, prompt: int, decode: int) -> None:
        self.steps += 1
        self.prompt, self.decode = self.prompt + prompt, self.decode + decode
        self.largest = max(self.largest, prompt + decode)

    @property
    def fed(self) -> int:
        return self.prompt + self.decode


def plan_step(
    running: Sequence[Running],
    drafted: dict[int, list[int]],
    max_step_tokens: int | None,
    chunk_of: Callable[[Running, int | None], int],
) -> dict[int, int]:
    """The committed tokens each of `running` (in admission order) feeds this step, by sequence (its
    drafts come on top): decode rows first, then prompt chunks within what is left (see the module's
    policy); `chunk_of(r, limit)` is the scheduler's chunk of `r` cut to `limit` tokens (None: no cut).
    A prompt that waits gets 0."""
    decoding = [r for r in running if r.consumed >= r.out.prompt_len]
    plan = {r.seq: chunk_of(r, None) for r in decoding}
    left = None
    if max_step_tokens is not None:
        left = max_step_tokens - sum(n + len(drafted.get(seq, [])) for seq, n in plan.items())
    for r in running:
        if r.consumed >= r.out.prompt_len:
            continue
        if left is not None and left <= 0:
            plan[r.seq] = 0
            continue
        plan[r.seq] = n = chunk_of(r, left)
        if left is not None:
            left -= n
    return plan


def fit_prompt_batch(
    plan: dict[int, int], running: Sequence[Running], drafted: dict[int, list[int]], prompt_batch: int, fed: StepTokens
) -> dict[int, int]:
    """`plan` held to a stepper whose prompt buckets take fewer sequences than its decode steps
    (`prompt_batch` a token group: a bundle compiled with `[buckets] prompt_batch`). A step that feeds a
    row of more than one token (a prompt chunk) runs at a prompt bucket, so it holds at most
    `prompt_batch` rows a group. Where the planned rows do not fit so, steps alternate (`fed.prompt_turn`):
    a decode turn feeds the rows of one token and the prompt chunks wait; a prompt turn feeds, in
    each group, its first `prompt_batch` prompt chunks (admission order), then rows of one token up to
    `prompt_batch`, and the others wait. A decode turn with nothing to feed is a prompt turn, so a
    step always makes progress and neither kind starves."""
    fed_rows = [r for r in running if plan.get(r.seq, 0) > 0]
    wide = {r.seq for r in fed_rows if plan[r.seq] + len(drafted.get(r.seq, [])) > 1}
    groups: dict[int, list[Running]] = {}
    for r in fed_rows:
        groups.setdefault(r.group, []).append(r)
    if not wide or all(len(rows) <= prompt_batch for rows in groups.values()):
        return plan
    narrow = {seq: 0 if seq in wide else n for seq, n in plan.items()}
    if not fed.prompt_turn and any(narrow.values()):
        fed.prompt_turn = True
        return narrow
    fed.prompt_turn = False
    out = dict.fromkeys(plan, 0)
    for rows in groups.values():
        for r in sorted(rows, key=lambda r: r.seq not in wide)[:prompt_batch]:  # stable: admission order
            out[r.seq] = plan[r.seq]
    return out


def fed_split(start: int, n: int, prompt_len: int) -> tuple[int, int]:
    """A row of `n` tokens from position `start`: (prompt tokens, decode tokens) it feeds."""
    prompt = max(0, min(start + n, prompt_len) - start)
    return prompt, n - prompt
