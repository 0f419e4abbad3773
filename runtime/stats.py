"""What a run measured on a rank (`Stats`): host time per region kind and per step, the tokens the steps
fed and the rows they computed, padded to their buckets; and for the prompt steps the rows each
execution took (`PromptRows`), whole and counted by the work a rank does (bench/ranks.py's
`prompt_rows_per_rank_over_chunk`)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch

from deepinfer.bundles import manifest as mf
from deepinfer.regions.step import Batch
from deepinfer.regions.topology import ENGRAM_KV

# The executions whose weights are a rank's column slice of the token group's (the group named: "ep"
# or the token group): each row's multiply-adds there are divided over the group, whatever rows they
# take. A prompt divided by rows gathers every row to them (the MoE's experts; the engram's kv on the
# rows every rank looks up); the head is the vocabulary's slice. Every other execution counts its rows
# whole, the stages whose work each rank repeats included (the pooling of `rows_write`).
SLICED = {("moe", mf.MOE_EXPERTS): "ep", ("engram", ENGRAM_KV): "group", ("head", mf.DECODE): "group"}


@dataclass
class PromptRows:
    """The steps at a tokens bucket above one (prompt chunks; verify steps too, with a draft): their
    real tokens, and the rows their executions took (a region, stage or fused layer each)."""

    steps: int = 0
    tokens: int = 0
    executions: float = 0.0  # call sites: a micro-batch's execution counts 1 / micro-batches
    rows: int = 0
    work: float = 0.0  # the rows again, a sliced execution's at its share (`SLICED`)

    def record(self, shape: torch.Size, passes: int, share: float) -> None:
        self.executions += 1 / passes
        self.rows += shape[0] * shape[1]
        self.work += shape[0] * shape[1] * share

    @property
    def rows_over_chunk(self) -> float:
        """The rows an execution takes per prompt step over the real tokens of a prompt step (1 where
        every rank computes every row of a chunk, plus the chunks' padding; 0 before a prompt step)."""
        return self._over_chunk(self.rows)

    @property
    def share_over_chunk(self) -> float:
        """`rows_over_chunk` with each row of a sliced execution counted at the rank's share of it
        (`SLICED`): the rows' work a rank does per execution over a chunk's real tokens. 1 / d plus
        padding where a token group of d ranks computes each row once between them, whatever takes
        every row by columns (the MoE's experts behind the dispatch's gather)."""
        return self._over_chunk(self.work)

    def _over_chunk(self, rows: float) -> float:
        if not self.executions or not self.tokens:
            return 0.0
        return (rows / self.executions) / (self.tokens / self.steps)


@dataclass
class Stats:
    """What a run measured on this rank: host time per region kind and per step."""

    calls: dict = field(default_factory=lambda: defaultdict(int))
    seconds: dict = field(default_factory=lambda: defaultdict(float))  # host time in the executable
    overhead: float = 0.0  # runtime time around region calls (argument lists, lookups)
    steps: int = 0
    step_seconds: float = 0.0
    by_tokens: dict = field(default_factory=dict)  # tokens bucket -> [steps, seconds] (picklable: ranks send it)
    tokens: int = 0  # real tokens processed
    padded: int = 0  # token slots computed (incl. padding)
    prompt: PromptRows = field(default_factory=PromptRows)

    def table(self) -> list[dict]:
        total = sum(self.seconds.values()) or 1.0
        return [
            {
                "kind": k,
                "calls": self.calls[k],
                "total_ms": self.seconds[k] * 1e3,
                "mean_us": self.seconds[k] / self.calls[k] * 1e6,
                "share": self.seconds[k] / total,
            }
            for k in sorted(self.seconds, key=lambda k: -self.seconds[k])
        ]

    def record_step(self, batch: Batch, seconds: float) -> None:
        self.step_seconds += seconds
        self.steps += 1
        shape = self.by_tokens.setdefault(batch.tokens.shape[1], [0, 0.0])
        shape[0] += 1
        shape[1] += seconds
        self.padded += batch.tokens.numel()
        real = int((batch.positions >= 0).sum())
        self.tokens += real
        if batch.tokens.shape[1] > 1:
            self.prompt.steps += 1
            self.prompt.tokens += real

    def record_rows(
        self, shape: torch.Size, step_tokens: int | None = None, passes: int = 1, share: float = 1.0
    ) -> None:
        """One execution whose leading dims are `shape` [B, T], of a step of `step_tokens` tokens a
        sequence (T unless given) run as `passes` micro-batches: counted where the step's tokens are
        more than 1 (a prompt step; its head may take one row a sequence), as 1 / `passes` of an
        execution, so that a call site of the step counts once whatever its micro-batches. `share`:
        the part of each row's multiply-adds this rank does there (1 / d for a column slice over d
        ranks: `SLICED`)."""
        if (step_tokens or shape[1]) > 1:
            self.prompt.record(shape, passes, share)
