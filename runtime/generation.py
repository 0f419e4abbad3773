"""Batch generation on a loaded bundle: the one scheduler (`runtime.schedule.decode`) driving an executor.

`generate_loaded` joins the two halves of a run: the executor's `Steps` (what a step runs, timed into
this run's `Stats`) and the scheduler's batch policy (submit every prompt, then step until all have
finished, at most `options.max_step_tokens` tokens a step), with the bundle's compiled draft when
`options.speculative` asks for it. `runtime.generate`
and the ranks' leader call it; a follower rank runs what the leader sends (`Executor.follow`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepinfer.regions.stepper import Drafter
from deepinfer.runtime.executor import Executor, OnCall, Stats
from deepinfer.runtime.options import RunOptions
from deepinfer.runtime.requests import Completions
from deepinfer.runtime.schedule import decode


def generate_loaded(
    executor: Executor,
    prompts: Sequence[list[int]],
    options: RunOptions,
    *,
    on_call: OnCall | None = None,
    drafter: Drafter | None = None,
) -> Completions:
    """Batch generation on a loaded executor (the leader's, with several ranks: its followers run
    what it sends until this ends them) -> the completions, with this run's `stats` and speculation
    counts. `on_call` wraps every region call (`deepinfer diff`); `drafter` drafts instead of the
    bundle's own (`options.speculative`): the test doubles of `regions/speculative.py`."""
    stats = Stats()
    try:
        with torch.inference_mode():
            if drafter is None and options.speculative:
                drafter = executor.dspark(stats)
            outs = decode(
                executor.steps(stats, on_call),
                prompts,
                options.max_new_tokens,
                eos=executor.config.eos_token_id,
                images=options.images,
                drafter=drafter,
                keep_logits=options.keep_logits,
                max_step_tokens=options.max_step_tokens,
            )
    finally:
        if executor.comm is not None:
            executor.comm.step(None)
    outs.stats = stats
    return outs
