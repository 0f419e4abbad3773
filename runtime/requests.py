"""What the scheduler takes and gives back: a `Request`, its `Completion`, a batch's `Completions`.

A request carries its prompt, its token budget, how it samples (`runtime.sampling.Sampling`), an
optional grammar (`Constraint`) and the callbacks the scheduler runs on its thread; its completion is
filled in as it runs. `Completions` are a batch's, in prompt order, with what the run measured: the
verify steps' counts (`SpeculationStats`) and, for a bundle, the executor's `Stats`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from torch import Tensor

from deepinfer.regions.spans import ImageEmbeds
from deepinfer.runtime.budget import StepTokens
from deepinfer.runtime.executor import Stats
from deepinfer.runtime.sampling import GREEDY, Sampling


class Masks(Protocol):
    """What computes the masks of a batch's constraints (`runtime.serving.grammars.Grammars`)."""

    def masks(self, constraints: list) -> Tensor:
        """The tokens each constraint allows next: bool [len(constraints), V]."""
        ...


class Constraint(Protocol):
    """A grammar a request's generated tokens follow (`runtime.serving.grammars.Constraint`): its `grammars`
    mask the logits of every step that picks its next token (one call for the batch's constraints of
    one `grammars`); `accept(token) -> complete?` advances it over the token picked."""

    @property
    def grammars(self) -> Masks: ...

    def accept(self, token: int) -> bool: ...

    def error(self) -> str | None: ...


@dataclass(eq=False)
class Request:
    """One sequence to generate. `on_token(id) -> stop?`, `on_finish(reason, error)` and `on_logits`
    run on the scheduler's thread; `cancelled` (set from any thread) drops it at the next step
    boundary. `on_logits(p, rows)`: rows [n, V] (float32) of positions p .. p + n - 1 fed for good
    by a step, row i predicting the token at p + i + 1; called before that step's tokens are emitted.
    `max_tokens` 0: the prompt runs, nothing is generated (finish reason length). A `constraint`
    limits each pick to the tokens its grammar allows (never drafted); once the grammar is complete
    the request ends (finish reason stop)."""

    prompt: list[int]
    max_tokens: int
    on_token: Callable[[int], bool] | None = None
    on_finish: Callable[[str, str | None], None] | None = None
    sampling: Sampling = GREEDY
    image: ImageEmbeds | None = None  # the prompt's image positions and their rows
    keep_logits: bool = False  # record one [V] row per processed position (--dump-logits, compare)
    on_logits: Callable[[int, Tensor], None] | None = None
    constraint: Constraint | None = None
    cancelled: bool = False

    @property
    def argmax_only(self) -> bool:
        """Whether its steps need each row's greedy token only, no logits (`Stepper.run`'s `greedy`,
        a step of such requests alone): plainly greedy (temperature 0, no bias or penalty),
        unconstrained (no grammar's mask), neither keeping its logits (`--dump-logits`, compare) nor
        handed them (`on_logits`: the server's logprobs)."""
        return (
            self.sampling.plain_greedy and self.constraint is None and not self.keep_logits and self.on_logits is None
        )


@dataclass(eq=False)
class Completion:
    """What a request produced: its prompt then generated tokens, and why it ended (`finish_reason`:
    stop, length, cancelled or error; `error` says why an error stopped it early)."""

    tokens: list[int]
    prompt_len: int
    logits: list[Tensor] = field(default_factory=list)
    error: str | None = None
    finish_reason: str | None = None
    cached_tokens: int = 0  # prompt positions a prefix cache hit spared (their KV was shared)

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]


@dataclass
class SpeculationStats:
    """What a drafter's verify steps gave, counted per sequence and step (a verify step: one
    sequence's row of a step that carried drafts)."""

    verify_steps: int = 0
    drafted: int = 0
    accepted: int = 0

    def record(self, drafted: int, accepted: int) -> None:
        self.verify_steps += 1
        self.drafted += drafted
        self.accepted += accepted

    @property
    def tokens_per_step(self) -> float:
        """Tokens a verify step commits: the accepted drafts and the target's own next token."""
        return (self.accepted + self.verify_steps) / max(1, self.verify_steps)

    @property
    def accepted_per_step(self) -> float:
        """Drafts a verify step accepts."""
        return self.accepted / max(1, self.verify_steps)

    @property
    def wasted_per_step(self) -> float:
        """Drafts a verify step runs through the target and rejects (drafted - accepted)."""
        return (self.drafted - self.accepted) / max(1, self.verify_steps)

    def line(self) -> str:
        return (
            f"{self.verify_steps} verify steps, {self.accepted} of {self.drafted} drafted tokens accepted, "
            f"{self.tokens_per_step:.2f} tokens per step ({self.accepted_per_step:.2f} drafts accepted, "
            f"{self.wasted_per_step:.2f} wasted)"
        )


class Completions(list[Completion]):
    """The completions of a batch, in prompt order, with what the run measured: `speculation` (the
    verify steps' counts), `steps` (the scheduler's tokens fed, prompt and decode; runtime/budget.py) and,
    for a bundle, `stats` (the executor's: time per region kind and step); for runs over ranks started
    here, `sent` ({rank: {collective: bytes}}), `seconds` (the leader's {collective: seconds}) and
    `pools` ({rank: {state pool: bytes allocated}})."""

    def __init__(
        self,
        items: Iterable[Completion] = (),
        *,
        speculation: SpeculationStats | None = None,
        stats: Stats | None = None,
        sent: dict[int, dict[str, int]] | None = None,
        seconds: dict[str, float] | None = None,
        pools: dict[int, dict[str, int]] | None = None,
        steps: StepTokens | None = None,
    ):
        super().__init__(items)
        self.speculation = speculation or SpeculationStats()
        self.stats = stats
        self.sent, self.seconds, self.pools = sent or {}, seconds or {}, pools or {}
        self.steps = steps  # None where the scheduler ran in another process (ranks started here)
