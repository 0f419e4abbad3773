"""The one scheduler: what each step holds, for batch generation, serving and speculative decoding.

A `Scheduler` drives a `Stepper` (`regions/stepper.py`: the reference's eager regions or a loaded
bundle's executables). Requests wait in a FIFO queue and join the running batch at step boundaries:
into the least loaded token group with a free row (at most `max_batch` per group) and a free slot,
and, where `reserve_whole` is set (serving), blocks for the whole request beyond what the running
sequences may still claim, so a running sequence never runs out of blocks. Without it (batch
generation) blocks are reserved step by step and a sequence that cannot get one fails alone, with
the reason in its own terms. Every step gives each running sequence its next prompt chunk (at most
`chunk` tokens) or its one decode token, so new prompts prefill interleaved with the others' decodes;
a sequence finishes on eos, on its caller's stop, after `max_tokens`, or with an error.

With `max_step_tokens` (chunked prefill with a token budget, runtime/budget.py) a step feeds at most
that many tokens: decode and verify rows first (all of them, whatever they cost), then prompt chunks
in admission order cut to what is left; a prompt left none waits for a later step. The stepper pads
a step to the smallest (batch, tokens) bucket that holds it, a mixed step's rows to its T bucket, so
the budget bounds the padded work B_bucket x T_bucket too. The greedy tokens are the unbudgeted run's.

Sampling is per request (`runtime/sampling.py`); what a request is and what it produces are its
records (`runtime/requests.py`). A request for no tokens (`max_tokens` 0) runs its prompt and ends:
prompt scoring, its logits through `on_logits`.

With a `drafter`, greedy requests decode speculatively: a sequence that has caught up feeds its
unfed token (the target's own last token) and its drafts in one verify step; the drafts the target's
argmax agrees with are kept, plus the target's own next token, so the output is the plain loop's
token for token. Every position whose token is kept is committed by that step, accepted or not the
block: the next verify step carries the new token and a full block of fresh drafts, and no token
runs through the target twice. What a rejected draft wrote is left in place (`Scheduler` says why
nothing needs restoring), so the model's per-slot rings must have room for a block (`Stepper.slack`).

With `prefix_cache` (serving), full blocks, of the prompt and of the generated tokens, are cached
under the hash chain of their tokens with the slot state at the end of the step that filled them,
and a request whose prompt starts with cached blocks (a chat's next turn: the previous answer's too)
holds them, gets that state back in its slot and prefills the rest only (regions/prefix.py,
runtime/prefix_gen.py, docs/serving.md).

`decode` is the batch policy (submit every prompt, then drain); `runtime/serving/engine.py` runs the same
scheduler on a thread for the server, `Events` reporting what it does to the server's metrics.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from deepinfer.errors import DeepinferError
from deepinfer.regions.config import V41Config
from deepinfer.regions.prefix import EVERY_STATE, SlotState, StatePolicy
from deepinfer.regions.spans import ImageEmbeds
from deepinfer.regions.stepper import Allocator, Drafter, DraftRequest, Greedy, OutOfBlocks, Row, Stepper
from deepinfer.runtime import prefix_gen
from deepinfer.runtime.budget import StepTokens, check_budget, fed_split, fit_prompt_batch, plan_step
from deepinfer.runtime.requests import Completion, Completions, Request, SpeculationStats
from deepinfer.runtime.sampling import sample


class Events:
    """What a scheduler reports as it runs; these do nothing (`runtime.serving.engine.Metrics` counts them)."""

    def stepped(self, seconds: float) -> None:
        """One batched step ran."""

    def prompt_tokens(self, n: int) -> None:
        """`n` prompt tokens were processed."""

    def token(self, request: Request, now: float) -> None:
        """`request` got a token at `now` (time.perf_counter)."""

    def drafts(self, drafted: int, accepted: int) -> None:
        """A verify step of one sequence."""

    def finished(self, request: Request, reason: str) -> None:
        """`request` ended."""

    def load(self, running: int, waiting: int, kv_blocks: int) -> None:
        """The batch after a step boundary: running sequences, waiting requests, KV blocks held."""

    def prefix_query(self, tokens: int) -> None:
        """A request's `tokens` prompt tokens were looked up in the prefix cache as it was admitted."""

    def prefix_hit(self, tokens: int) -> None:
        """A request starts with `tokens` prompt positions from the prefix cache."""

    def prefix_cache(self, blocks: int, evicted: int) -> None:
        """After a step boundary: blocks the prefix cache holds, blocks it has evicted so far."""

    def fed(self, prompt: int, decode: int, rows: int, longest: int) -> None:
        """A step fed `prompt` prompt tokens and `decode` decode tokens (unfed tokens and drafts) in
        `rows` rows, the longest `longest` tokens: the stepper pads it to the (batch, tokens) bucket
        that holds [rows, longest] (per token group)."""


@dataclass(eq=False)
class Running:
    """A request the scheduler holds: its output so far and where it is (sequence id, token group,
    tokens fed, blocks it may claim)."""

    request: Request
    out: Completion
    generator: torch.Generator | None
    seq: int = -1  # assigned at admission
    group: int = 0
    consumed: int = 0  # tokens fed to the model (committed)
    need_blocks: int = 0  # blocks admission set aside for the whole request (serving)
    keys: list[bytes] | None = None  # its fed tokens' full blocks' keys, the prompt's then more (prefix caching)


# --- speculation ----------------------------------------------------------------------------------


def draft_for(drafter: Drafter, running: list[Running], chunk: int, allocs: list[Allocator]) -> dict[int, list[int]]:
    """This step's drafts: for each plainly greedy sequence of `running` that has generated and whose unfed
    tokens leave room in a verify step of `drafter.block` + 1 tokens, as many as still fit its token
    budget and context -> drafts by sequence (only non-empty ones)."""
    requests = []
    for r in running:
        if not r.request.sampling.plain_greedy or r.request.constraint is not None:
            continue
        out, alloc = r.out, allocs[r.group]
        unfed = len(out.tokens) - r.consumed
        n = min(drafter.block + 1, chunk) - unfed
        n = min(n, r.request.max_tokens - len(out.generated) - 1, alloc.max_context - len(out.tokens))
        if out.generated and n > 0:
            requests.append(DraftRequest(r.seq, alloc.slot_of[r.seq], out.tokens, n, r.group))
    drafts = drafter.draft(requests) if requests else {}
    return {seq: d for seq, d in drafts.items() if d}


def masks_of(picking: list[Running]) -> dict[int, Tensor]:
    """The masks [V] of the constrained sequences that pick a token this step, by sequence: one call per
    grammar engine (in practice one, the server's)."""
    by_engine: dict[int, list[Running]] = {}
    for r in picking:
        assert r.request.constraint is not None  # picking holds constrained sequences only
        by_engine.setdefault(id(r.request.constraint.grammars), []).append(r)
    out: dict[int, Tensor] = {}
    for rs in by_engine.values():
        constraints = [r.request.constraint for r in rs]
        masks = constraints[0].grammars.masks(constraints)  # type: ignore[union-attr]  # constrained
        out.update({r.seq: masks[i] for i, r in enumerate(rs)})
    return out


def verify(logits: Tensor | Greedy, fed: int, drafts: list[int], caught_up: bool = True) -> tuple[list[int], int]:
    """One sequence's verify step: logits [fed + len(drafts), V] (or their `Greedy` choices) of its fed
    committed tokens then its drafts -> (the target's greedy token after each position, how many drafts
    it accepts: the longest prefix equal to its own choices; none unless the sequence had caught up)."""
    choice = logits.tokens.tolist() if isinstance(logits, Greedy) else logits.argmax(-1).tolist()
    a = 0
    while caught_up and a < len(drafts) and choice[fed - 1 + a] == drafts[a]:
        a += 1
    return choice, a


def reserve(alloc: Allocator, seq: int, positions: int, drafted: dict[int, list[int]]) -> None:
    """Blocks for `positions` and the sequence's drafts; drafts that do not fit are dropped (the step
    then fails, or not, exactly as a plain step would)."""
    try:
        alloc.reserve(seq, positions + len(drafted.get(seq, [])))
    except OutOfBlocks:
        if not drafted.pop(seq, None):
            raise
        alloc.reserve(seq, positions)


# --- the loop ------------------------------------------------------------------------------------


def stop_reason(e: OutOfBlocks, out: Completion, max_context: int) -> str:
    """Why a sequence stopped, counted in the sequence's own tokens (not the chunk that hit the limit)."""
    if not e.context:
        return str(e)
    if out.prompt_len > max_context:
        return f"the prompt has {out.prompt_len} tokens, more than the bundle's max_context ({max_context})"
    return (
        f"reached the bundle's max_context ({max_context} positions: a prompt of {out.prompt_len} tokens "
        f"and {len(out.generated)} generated)"
    )


NO_SLOT = "no sequence slot (the bundle was compiled without room for a sequence)"


class SpeculationError(DeepinferError, ValueError):
    """A drafter whose verify steps the model cannot take back: more drafts than its rings' slack."""


class Scheduler:
    """Continuous batching over `stepper`: `add` queues a request (from any thread when `lock` guards
    the queue), `step` runs one step boundary on the scheduler's thread.

    With a `drafter`, a rejected draft restores nothing. A verify step writes a sequence's positions
    start .. end - 1 (end - start <= block + 1) and commits those before some P >= start + 1; the next
    step starts at P. Per-slot state (window rings, the compressor's partial groups) lives in rings of
    R = window (or ratio) + `stepper.slack` rows, position p at row p % R, so with block <= slack a
    rejected position p >= P overwrites the row of p - R <= start - window (or - ratio): older than
    anything the sequence reads from its rings again (the window before P, the group P belongs to),
    and its own row is written again by the step that feeds p before any query reads it (within a
    step, keys from its first position on come from the step itself). Paged state (compressed KV,
    index keys) likewise: an entry written for a rejected position is invisible to every query until
    the step that commits its group's last position writes it again, before it is read
    (`t < (p + 1) // ratio`); candidate pools and top-k selections are carries recomputed every step.
    The drafter's features, which the step's `capture` writes, are a ring of the same kind
    (regions/drafting.py)."""

    def __init__(
        self,
        stepper: Stepper,
        *,
        eos: int,
        reserve_whole: bool = False,
        drafter: Drafter | None = None,
        events: Events | None = None,
        lock: AbstractContextManager | None = None,
        prefix_cache: bool = False,
        prefix_states: StatePolicy = EVERY_STATE,
        max_step_tokens: int | None = None,
    ):
        check_budget(max_step_tokens, drafter.block if drafter is not None else None)
        if drafter is not None and drafter.block > stepper.slack:
            raise SpeculationError(
                f"the drafter drafts up to {drafter.block} tokens a verify step, but the model's per-slot rings "
                f"have room for {stepper.slack} (their slack): compile the bundle with [speculative] draft, "
                f"whose rings have a draft block of slack"
            )
        self.stepper, self.eos, self.reserve_whole, self.drafter = stepper, eos, reserve_whole, drafter
        self.events = events or Events()
        self.lock = lock or nullcontext()
        self.allocs = [stepper.allocator() for _ in range(stepper.groups)]
        if prefix_cache:
            prefix_gen.use_prefix_cache(stepper, self.allocs, prefix_states)
        self.waiting: deque[Running] = deque()
        self.running: dict[int, Running] = {}
        self.speculation = SpeculationStats()
        self.fed = StepTokens(limit=max_step_tokens)  # the budget (None: a prompt's whole chunk a step), the steps
        self._next_seq = 0

    @property
    def steps(self) -> int:
        """The steps run so far (each fed at least one row)."""
        return self.fed.steps

    @property
    def prefix_cache(self) -> bool:
        """Whether full blocks are cached and shared (regions/prefix.py)."""
        return self.allocs[0].cache is not None

    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting)

    def add(self, request: Request) -> Completion:
        """Queue `request` -> its output, filled in as it runs (a negative `max_tokens` is done at once)."""
        out = Completion(list(request.prompt), len(request.prompt))
        r = Running(request, out, request.sampling.generator())
        if request.max_tokens < 0:
            self._finish(r, "length")
            return out
        with self.lock:
            self.waiting.append(r)
        return out

    def fail_running(self, error: str) -> None:
        """End every running sequence with `error` (a step that raised: its state is not to be trusted)."""
        for r in list(self.running.values()):
            self._finish(r, "error", error)

    def close(self, reason: str = "cancelled", error: str | None = None) -> None:
        """End every waiting and running request (as cancelled, or with `reason` and `error`)."""
        with self.lock:
            left = list(self.waiting)
            self.waiting.clear()
        for r in left + list(self.running.values()):
            self._finish(r, reason, error)

    def step(self) -> None:
        """One step boundary: admit waiting requests, drop cancelled ones, run one batched step, emit."""
        self._admit()
        for r in [r for r in self.running.values() if r.request.cancelled]:
            self._finish(r, "cancelled")
        if self.running:
            self._run_step()
        self._report()

    def _run_step(self) -> None:
        drafted = (
            draft_for(self.drafter, list(self.running.values()), self.stepper.chunk, self.allocs)
            if self.drafter is not None
            else {}
        )
        rows_by_group: list[list[Row]] = [[] for _ in self.allocs]
        picking: list[Running] = []  # constrained sequences that pick a token after this step
        plan = plan_step(list(self.running.values()), drafted, self.fed.limit, self._chunk_of)
        narrow = getattr(self.stepper, "prompt_batch", self.stepper.max_batch)  # `Stepper.prompt_batch`
        plan = fit_prompt_batch(plan, list(self.running.values()), drafted, narrow, self.fed)
        for r in list(self.running.values()):
            n = plan[r.seq]
            if n == 0:  # a prompt that waits for room in the budget
                continue
            if r.request.constraint is not None and r.request.max_tokens > 0 and r.consumed + n == len(r.out.tokens):
                picking.append(r)
            alloc = self.allocs[r.group]
            try:
                reserve(alloc, r.seq, r.consumed + n, drafted)
            except OutOfBlocks as e:
                self._finish(r, "error", stop_reason(e, r.out, alloc.max_context))
                continue
            ids = r.out.tokens[r.consumed : r.consumed + n] + drafted.get(r.seq, [])
            rows_by_group[r.group].append((r.seq, ids, r.consumed))
        if not any(rows_by_group):
            return
        self._record_fed(rows_by_group)
        histories = {
            seq: r.out.tokens + drafted[seq] if seq in drafted else r.out.tokens for seq, r in self.running.items()
        }
        images = {seq: r.request.image for seq, r in self.running.items() if r.request.image is not None}
        capture = self.drafter.capture if self.drafter is not None else None
        allowed = masks_of([r for r in picking if r.seq in self.running])
        # each sequence samples from its last fed row: the head runs on that row alone unless a request
        # keeps or is handed every row's logits, or verifies drafts
        stepping = [self.running[seq].request for rows in rows_by_group for seq, _, _ in rows]
        last_only = not drafted and not any(q.keep_logits or q.on_logits is not None for q in stepping)
        start = time.perf_counter()
        greedy = all(q.argmax_only for q in stepping)  # no logits needed: the stepper may give choices
        out = self.stepper.run(
            rows_by_group, self.allocs, histories, images, capture, last_only=last_only, greedy=greedy
        )
        now = time.perf_counter()
        self.events.stepped(now - start)
        for rows, got in zip(rows_by_group, out):
            logits = got if isinstance(got, Greedy) else got.float()  # Greedy choices: `Request.argmax_only`
            for b, (seq, ids, first) in enumerate(rows):
                r, mine = self.running[seq], drafted.get(seq, [])
                if last_only and logits.shape[1] < len(ids):  # the stepper ran it `last_only`
                    self._commit(r, logits[b, :1], first, mine, now, allowed.get(seq), last_of=len(ids))
                else:
                    self._commit(r, logits[b, : len(ids)], first, mine, now, allowed.get(seq))

    def _record_fed(self, rows_by_group: list[list[Row]]) -> None:
        """Count a step's fed tokens, prompt and decode (`fed`, `Events.fed`)."""
        rows = [row for group in rows_by_group for row in group]
        split = [fed_split(start, len(ids), self.running[seq].out.prompt_len) for seq, ids, start in rows]
        prompt, decode = sum(p for p, _ in split), sum(d for _, d in split)
        self.fed.record(prompt, decode)
        self.events.fed(prompt, decode, len(rows), max(len(ids) for _, ids, _ in rows))

    def _commit(
        self,
        r: Running,
        logits: Tensor | Greedy,
        start: int,
        drafts: list[int],
        now: float,
        allowed: Tensor | None = None,
        last_of: int | None = None,
    ) -> None:
        """One sequence's row of a step: logits [len(ids), V] of its fed tokens (its unfed committed
        ones, then its drafts), or with `last_of` (a step run `last_only`, no drafts) [1, V] of the
        last of its `last_of` fed tokens (or their `Greedy` choices); `allowed` its constraint's mask
        [V] when it picks a token. The positions of its committed tokens and accepted drafts are fed for
        good; what the rejected drafts wrote is left in place (see `Scheduler`)."""
        out = r.out
        fed = len(logits) - len(drafts) if last_of is None else last_of  # committed tokens fed this step
        first = start if last_of is None else start + fed - 1  # the position of logits' first row
        assert last_of is None or not (drafts or r.request.keep_logits or r.request.on_logits), "every row wanted"
        caught_up = start + fed == len(out.tokens)
        choice, a = verify(logits, fed, drafts, caught_up)
        keep = fed + a  # rows whose input tokens are now committed
        if drafts:
            self.speculation.record(len(drafts), a)
            self.events.drafts(len(drafts), a)
        finite = (
            torch.isfinite(logits.values[:keep])
            if isinstance(logits, Greedy)
            else torch.isfinite(logits[:keep]).all(-1)
        )
        if not bool(finite.all()):  # emitting argmax of NaN (token 0) would hide it
            at = first + int((~finite).nonzero()[0, 0])
            self._finish(r, "error", f"non-finite logits (NaN or infinity) at position {at}, step {self.steps}")
            return
        self.events.prompt_tokens(max(0, min(start + fed, out.prompt_len) - start))
        if r.request.keep_logits and not isinstance(logits, Greedy):  # one row per position, each fed once
            out.logits.extend(logits[:keep].clone())
        if r.request.on_logits is not None and not isinstance(logits, Greedy):
            r.request.on_logits(start, logits[:keep])
        r.consumed = start + keep
        if self.prefix_cache:
            self._cache_prefix(r, drafts[:a], clean=a == len(drafts))
        if caught_up and r.request.max_tokens == 0:  # prompt scoring: the prompt has run
            self._finish(r, "length")
        elif caught_up:  # the accepted drafts, then the target's own token
            at = fed - 1 + a - (first - start)  # the row of its last committed token
            if allowed is not None and not bool(allowed.any()):
                why = r.request.constraint.error() if r.request.constraint is not None else None
                self._finish(r, "error", f"the grammar allows no token ({why or 'its matcher is stuck'})")
                return
            own = (
                choice[at]
                if drafts or isinstance(logits, Greedy)
                else sample(logits[at], r.request.sampling, r.generator, out.generated, allowed)
            )
            for token in drafts[:a] + [own]:
                if self._emit(r, token, now):
                    break

    def _emit(self, r: Running, token: int, now: float) -> bool:
        """Append `token` to `r`'s output and tell its caller -> whether `r` finished."""
        r.out.tokens.append(token)
        self.events.token(r.request, now)
        stop = r.request.on_token(token) if r.request.on_token is not None else False
        if r.request.constraint is not None:
            try:
                stop = r.request.constraint.accept(token) or stop  # a complete grammar ends the request
            except DeepinferError as e:
                self._finish(r, "error", str(e))
                return True
        if token == self.eos or stop:
            self._finish(r, "stop")
        elif len(r.out.generated) >= r.request.max_tokens:
            self._finish(r, "length")
        return r.out.finish_reason is not None

    def _admit(self) -> None:
        """Move waiting requests into the batch, first come first served, while a group has a free row,
        a free slot and (reserve_whole) blocks for the whole request beyond what its running sequences
        may still claim. A request that cannot start while nothing runs never will: it fails."""
        with self.lock:
            for r in [r for r in self.waiting if r.request.cancelled]:
                self.waiting.remove(r)
                self._finish(r, "cancelled")
            while self.waiting:
                r = self.waiting[0]
                hit, shared, state = self._match(r)
                need = self._blocks_for(r) if self.reserve_whole else 0
                g = self._group_for(need, hit, shared)
                if g is None and hit is not None:  # the group holding its prefix is full: elsewhere, uncached
                    shared, state = [], None
                    g = self._group_for(need)
                if g is None:
                    if self.running:
                        break
                    self.waiting.popleft()
                    self._finish(r, "error", self._never_fits(need))
                    continue
                self.waiting.popleft()
                r.seq, self._next_seq = self._next_seq, self._next_seq + 1
                self.allocs[g].admit(r.seq, shared)
                r.group, r.need_blocks = g, need
                self.running[r.seq] = r
                if r.keys is not None:  # it was looked up (`_match`)
                    self.events.prefix_query(len(r.request.prompt))
                if state is not None:  # a hit: its slot as the cached prefix left it; prefill from the boundary on
                    self.stepper.load_slot(g, self.allocs[g].slot_of[r.seq], state)
                    r.consumed = r.out.cached_tokens = len(shared) * self.allocs[g].block_size
                    self.events.prefix_hit(r.consumed)

    # -- prefix caching (regions/prefix.py) ------------------------------------------------------

    def _match(self, r: Running) -> tuple[int | None, list[int], SlotState | None]:
        """The token group whose cache holds the longest prefix `r` can start from, its cached blocks
        and the slot state at their end (none for a request that keeps or is handed every position's
        logits: the prompt's logprobs need every row); at least its last prompt token is left to prefill."""
        if not self.prefix_cache or r.request.keep_logits or r.request.on_logits is not None:
            return None, [], None
        bs = self.allocs[0].block_size
        if r.keys is None:
            r.keys = prefix_gen.prompt_keys(r.request.prompt, bs, r.request.image)
        return prefix_gen.best_hit(self.allocs, r.keys[: (len(r.request.prompt) - 1) // bs])

    def _chunk_of(self, r: Running, limit: int | None = None) -> int:
        """Tokens `r` feeds this step: its next prompt chunk (at most `limit` tokens: what is left of
        the step's budget) or its unfed token. With prefix caching a prompt chunk ends at the last
        block boundary it reaches, one that keeps a slot state where it can (`prefix_gen.chunk_end`),
        so the blocks are cached as it ends, with the state where one is kept (`_cache_prefix`)."""
        n = min(self.stepper.chunk, len(r.out.tokens) - r.consumed)
        if limit is not None:
            n = min(n, limit)
        if self.prefix_cache and r.consumed < r.out.prompt_len:
            n = prefix_gen.chunk_end(r.consumed, n, self.allocs[r.group])
        return n

    def _cache_prefix(self, r: Running, accepted: list[int], clean: bool) -> None:
        """After a step of `r` that fed its committed tokens and `accepted` drafts, `clean` if it left
        no rejected draft's writes: cache the full blocks it completed, prompt and generated, with
        its slot state where it ends on a block boundary (runtime/prefix_gen.py)."""
        if r.keys is not None:  # the step emits `accepted` after this
            a, seq = self.allocs[r.group], r.seq
            prefix_gen.cache_fed(
                self.stepper, a, r.group, seq, r.keys, r.out.tokens, accepted, r.consumed, clean, r.request.image
            )

    def _blocks_for(self, r: Running) -> int:
        """KV blocks a request needs: its prompt and every generated token but the last."""
        a = self.allocs[0]
        return -(-(len(r.request.prompt) + max(r.request.max_tokens, 1) - 1) // a.block_size)

    def _group_for(self, need: int, hit: int | None = None, shared: Sequence[int] = ()) -> int | None:
        """The least loaded token group that can take a request needing `need` blocks, or None (blocks
        counted per shard of the group's pool: a divided pool's cp ranks each hold their own); with a
        prefix `hit`, that group only, the request starting from its cached blocks `shared`."""
        load = [0] * len(self.allocs)
        claims = [[0] * a.shards for a in self.allocs]
        for seq, r in self.running.items():
            load[r.group] += 1
            held = self.allocs[r.group].shard_counts(r.need_blocks, start=len(self.allocs[r.group].tables[seq]))
            claims[r.group] = [c + h for c, h in zip(claims[r.group], held)]
        for g in sorted(range(len(self.allocs)), key=lambda i: load[i]) if hit is None else [hit]:
            a = self.allocs[g]
            takes = prefix_gen.hit_takes(a, shared, need) if hit is not None else a.shard_counts(need)
            room = all(a.available(s) - c >= n for s, (c, n) in enumerate(zip(claims[g], takes)))
            if load[g] < self.stepper.max_batch and a.free_slots and room:
                return g
        return None

    def _never_fits(self, need: int) -> str:
        a = self.allocs[0]
        if not a.free_slots:
            return NO_SLOT
        return f"needs {need} KV blocks of {a.block_size} positions; the pool holds {sum(map(a.available, range(a.shards)))}"

    def _finish(self, r: Running, reason: str, error: str | None = None) -> None:
        if r.out.finish_reason is not None:
            return
        r.out.finish_reason, r.out.error = reason, error
        if r.seq in self.running:
            self.allocs[r.group].release(r.seq)
            del self.running[r.seq]
        self.events.finished(r.request, reason)
        if r.request.on_finish is not None:
            r.request.on_finish(reason, error)

    def _report(self) -> None:
        self.events.load(len(self.running), len(self.waiting), sum(a.blocks_in_use() for a in self.allocs))
        caches = [a.cache for a in self.allocs if a.cache is not None]
        if caches:
            self.events.prefix_cache(sum(map(len, caches)), sum(c.evicted for c in caches))


def decode(
    stepper: Stepper,
    prompts: Sequence[list[int]],
    max_new_tokens: int,
    *,
    eos: int,
    images: Sequence[ImageEmbeds | None] | None = None,
    drafter: Drafter | None = None,
    keep_logits: bool = True,
    max_step_tokens: int | None = None,
) -> Completions:
    """Batch generation (greedy): submit every prompt, then step until all have finished. A request
    that cannot get blocks fails alone (its `error` is set); images[i]: prompt i's image positions
    and their rows. With a `drafter`, speculative decoding; with `max_step_tokens`, at most that many
    tokens a step (runtime/budget.py): the same tokens."""
    scheduler = Scheduler(stepper, eos=eos, drafter=drafter, max_step_tokens=max_step_tokens)
    outs = [
        scheduler.add(Request(list(p), max_new_tokens, image=images[i] if images else None, keep_logits=keep_logits))
        for i, p in enumerate(prompts)
    ]
    while scheduler.busy:
        scheduler.step()
    return Completions(outs, speculation=scheduler.speculation, steps=scheduler.fed)


class SteppableModel(Protocol):
    """A model that makes its own stepper for a batch (`regions.reference.ReferenceModel`)."""

    @property
    def config(self) -> V41Config: ...

    def stepper(
        self, prompts: list[list[int]], max_new_tokens: int, chunk: int | None = None, slack: int = 0
    ) -> Stepper: ...


def decode_model(
    model: SteppableModel,
    prompts: Sequence[list[int]],
    max_new_tokens: int,
    *,
    chunk: int | None = None,
    images: Sequence[ImageEmbeds | None] | None = None,
    drafter: Drafter | None = None,
    max_step_tokens: int | None = None,
) -> Completions:
    """`decode` for a model that makes its own stepper for a batch (`regions.reference.ReferenceModel`:
    `model.stepper(prompts, max_new_tokens, chunk, slack)`, its rings with room for the drafter's
    block; its eos from `model.config`): how tools and tests reach the reference."""
    with torch.inference_mode():
        steps = model.stepper(list(prompts), max_new_tokens, chunk, drafter.block if drafter is not None else 0)
        eos = model.config.eos_token_id
        return decode(
            steps, prompts, max_new_tokens, eos=eos, images=images, drafter=drafter, max_step_tokens=max_step_tokens
        )
