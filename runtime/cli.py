"""`deepinfer-run`: parse arguments, then `deepinfer.runtime.generate`."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

import click

from deepinfer.cli_common import (
    bundle_options,
    echo_generations,
    generation_options,
    image_option,
    load_settings,
    prompts_with_images,
    user_errors,
    write_logits,
)

STEP_TOKENS_HELP = (
    "Tokens one step feeds at most, over every running sequence (chunked prefill with a token budget, as "
    "vLLM's max_num_batched_tokens): decode rows (with --speculative, a verify row: the unfed token and its "
    "drafts) all run first, then prompt chunks in arrival order cut to what is left; a prompt left none waits "
    "a step. Smaller: running sequences get their next token sooner (time between tokens) and a step stays "
    "small, while a long prompt takes more steps to its first token. The same greedy tokens whatever the "
    "budget. At least 1 (and a verify row, the draft block + 1, with --speculative). Default: none "
    "(every prompt feeds its whole chunk, the largest tokens bucket, each step)."
)

if TYPE_CHECKING:  # the runtime loads only once a command runs
    from deepinfer.regions.tokenizer import Tokenizer
    from deepinfer.runtime.requests import Completions


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("bundle", type=click.Path(exists=True, file_okay=False, path_type=Path))
@generation_options
@click.option(
    "--timing",
    is_flag=True,
    help="Print host time per region kind and the runtime's own overhead; with --speculative, tokens per "
    "target step and the verify step's cost over a plain decode step.",
)
@click.option(
    "--max-step-tokens",
    type=click.IntRange(min=1),
    default=None,
    metavar="N",
    help=STEP_TOKENS_HELP,
)
@bundle_options
@image_option
@user_errors
def main(
    bundle, prompt, chat, prompt_ids, max_new_tokens, as_json, dump_logits, timing, images, max_step_tokens, **load
):
    """Load BUNDLE (validated: format version, digests, target) and generate greedily.

    Text goes through the bundle's tokenizer (the checkpoint's tokenizer.json, copied at
    compile time, or the tiny model's byte-level one); --chat renders each prompt as a
    user message through its chat template. Prompts run as decode-shaped chunks through
    the bucket executables, then one token per step; several prompts batch into the
    decode batch buckets.
    A multi-rank bundle ([parallel] tp/ep/cp) starts one process per rank here
    (gloo), or runs as one rank under torchrun (torchrun --nproc-per-node N
    $(which deepinfer-run) BUNDLE ...): rank 0 schedules and prints.

    \b
    Example:
      deepinfer-run build/tiny --prompt "Hello, world" --max-new-tokens 32 --timing
      deepinfer-run build/release --chat --prompt "What is a mixture of experts?"
      deepinfer-run build/tiny --image cat.ppm --prompt "<image>What is this?"   # tower runs on the host
    """
    from deepinfer.runtime import RunOptions, generate
    from deepinfer.runtime.api import opened
    from deepinfer.runtime.budget import check_budget
    from deepinfer.runtime.bundle import load_vision, tokenizer

    start = time.perf_counter()
    settings = load_settings(**load)
    b = opened(bundle, RunOptions(**settings))
    check_budget(max_step_tokens, b.config.text.dspark_block_size if settings["speculative"] else None)
    tok = tokenizer(b)
    prompts, embeds = prompts_with_images(prompt, prompt_ids, images, b.config, tok, lambda: load_vision(b), chat)
    options = RunOptions(
        **settings,
        max_new_tokens=max_new_tokens,
        images=tuple(embeds) if embeds else None,
        keep_logits=dump_logits is not None,
        max_step_tokens=max_step_tokens,
    )
    outs = generate(b, prompts, options)
    if not outs:  # a follower rank under torchrun: rank 0 prints
        return
    wall = time.perf_counter() - start
    if dump_logits:
        m = b.manifest.model
        meta = {"source": "bundle", "dtype": m.dtype, "cache_quant": m.cache_quant, "config_hash": m.config_hash}
        write_logits(dump_logits, outs, meta)
    timings = _timings(outs, wall, b.config.text.dspark_block_size + 1, options.speculative) if timing else None
    if as_json:
        _echo_json(outs, tok, timings)
    else:
        if timings is not None:
            click.echo("\n".join(timings[1]), err=True)
        echo_generations(outs, tok.decode)
    if any(o.error for o in outs):
        raise SystemExit(1)


def _timings(outs: Completions, wall: float, verify_tokens: int, speculative: bool) -> tuple[dict, list[str]]:
    """--timing: the run's timing as --json prints it, and as lines (with --speculative, speculation's
    figures: tokens per target step and the verify step's cost over a plain decode step)."""
    from deepinfer.runtime.report import speculation_lines, speculation_timing, timing, timing_lines

    stats = outs.stats
    assert stats is not None, "a bundle's run records its stats"
    figures, lines = timing(stats, wall, outs.steps), timing_lines(stats, wall, outs.steps)
    if speculative:
        figures["speculation"] = speculation_timing(stats, outs.speculation, verify_tokens)
        lines += speculation_lines(figures["speculation"], outs.speculation)
    return figures, lines


def _echo_json(outs: Completions, tok: Tokenizer, timings: tuple[dict, list[str]] | None) -> None:
    out: dict = {
        "outputs": [
            {
                "prompt_ids": o.tokens[: o.prompt_len],
                "generated_ids": o.generated,
                "text": tok.decode(o.generated),
                "error": o.error,
            }
            for o in outs
        ]
    }
    if timings is not None:
        out["timing"] = timings[0]
    click.echo(json.dumps(out))


if __name__ == "__main__":
    main()
