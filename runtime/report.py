"""What `deepinfer-run --timing` prints: host time per region kind, steps, the tokens the steps fed
(prompt and decode) and the rows they computed padded to their buckets, and speculation's figures."""

from __future__ import annotations

from deepinfer.runtime.budget import StepTokens
from deepinfer.runtime.executor import Stats
from deepinfer.runtime.requests import SpeculationStats


def timing(stats: Stats, wall: float, steps: StepTokens | None = None) -> dict:
    """The run's timing as `--json` prints it. `fed_tokens` and `padded_rows` are the executor's (this
    rank's token group: real positions, and the B_bucket x T_bucket rows computed); `steps` (the
    scheduler's, where it ran in this process) splits what was fed into prompt and decode tokens
    and gives the largest step."""
    calls = sum(stats.calls.values())
    figures = {
        "regions": stats.table(),
        "steps": stats.steps,
        "step_ms": stats.step_seconds / max(stats.steps, 1) * 1e3,
        "overhead_us_per_call": stats.overhead / max(calls, 1) * 1e6,
        "padding_waste": 1 - stats.tokens / stats.padded if stats.padded else 0.0,
        "fed_tokens": stats.tokens,
        "padded_rows": stats.padded,
        "wall_s": wall,
    }
    if steps is not None:
        figures |= {"prompt_tokens": steps.prompt, "decode_tokens": steps.decode, "largest_step_tokens": steps.largest}
    return figures


def timing_lines(stats: Stats, wall: float, steps: StepTokens | None = None) -> list[str]:
    lines = [f"{'region kind':<24}{'calls':>7}{'total ms':>11}{'mean us':>10}{'share':>8}"]
    for row in stats.table():
        lines.append(
            f"{row['kind']:<24}{row['calls']:>7}{row['total_ms']:>11.1f}{row['mean_us']:>10.0f}{row['share']:>8.1%}"
        )
    t = timing(stats, wall)
    lines.append(
        f"{stats.steps} steps, {t['step_ms']:.2f} ms a step; "
        f"runtime overhead {t['overhead_us_per_call']:.1f} us a region call; "
        f"padding waste {t['padding_waste']:.1%}; wall {wall:.2f} s"
    )
    fed = f"fed tokens {stats.tokens}"
    if steps is not None:
        fed += f" ({steps.prompt} prompt, {steps.decode} decode; at most {steps.largest} a step)"
    lines.append(f"{fed}; padded rows {stats.padded} (each step's batch x tokens bucket)")
    return lines


def speculation_timing(stats: Stats, speculation: SpeculationStats, verify_tokens: int) -> dict:
    """A speculative run's tokens per target step, drafts accepted and wasted (drafted, then rejected) per
    verify step, and its verify steps' mean time over its plain decode steps' (a sequence's last step,
    with no token left to draft for, is one; None without both)."""
    (n1, s1), (nv, sv) = stats.by_tokens.get(1, (0, 0.0)), stats.by_tokens.get(verify_tokens, (0, 0.0))
    return {
        "tokens_per_step": speculation.tokens_per_step,
        "accepted_per_step": speculation.accepted_per_step,
        "wasted_per_step": speculation.wasted_per_step,
        "verify_steps": speculation.verify_steps,
        "drafted": speculation.drafted,
        "accepted": speculation.accepted,
        "verify_step_ms": sv / nv * 1e3 if nv else None,
        "decode_step_ms": s1 / n1 * 1e3 if n1 else None,
        "verify_over_decode_step": sv / nv / (s1 / n1) if n1 and nv else None,
    }


def speculation_lines(t: dict, speculation: SpeculationStats) -> list[str]:
    ratio = t["verify_over_decode_step"]
    return [
        f"speculative dspark: {speculation.line()}",
        f"verify step {t['verify_step_ms']:.2f} ms over plain decode step {t['decode_step_ms']:.2f} ms: {ratio:.2f}x"
        if ratio is not None
        else "verify over plain decode step: not measured (this run had no step of each)",
    ]
