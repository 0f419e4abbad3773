"""`deepinfer-run`: parse arguments, then `deepinfer.runtime.generate`."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

import click
from click.core import ParameterSource

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
from deepinfer.errors import DeepinferError

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
    max_context = b.manifest.buckets.max_context
    tok = tokenizer(b)
    check_texts(prompt, max_context, tok.longest_token_bytes)
    prompts, embeds = prompts_with_images(prompt, prompt_ids, images, b.config, tok, lambda: load_vision(b), chat)
    given = click.get_current_context().get_parameter_source("max_new_tokens") != ParameterSource.DEFAULT
    options = RunOptions(
        **settings,
        max_new_tokens=tokens_to_generate([len(p) for p in prompts], max_new_tokens, given, max_context),
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


class ContextError(DeepinferError, ValueError):
    """A prompt, or a prompt and --max-new-tokens, that cannot fit the bundle's max_context."""


def check_texts(texts: tuple[str, ...], max_context: int, longest_token_bytes: int) -> None:
    """Refuse a --prompt text no tokenization could fit in `max_context` tokens, before tokenizing it:
    more characters than the server's bound (`runtime.serving.params`: max_context times the bytes
    the tokenizer's longest token stands for, times its slack); a character is at least a byte."""
    from deepinfer.runtime.serving.params import TEXT_SLACK

    limit = max_context * longest_token_bytes * TEXT_SLACK
    for i, text in enumerate(texts):
        if len(text) > limit:
            raise ContextError(
                f"--prompt {i}: the text has {len(text)} characters; no text over {limit} bytes fits the "
                f"bundle's max_context of {max_context} tokens"
            )


def tokens_to_generate(prompt_lens: list[int], max_new_tokens: int, given: bool, max_context: int) -> int:
    """The tokens each prompt generates, checked against the bundle's context before anything is loaded.

    A sequence holds its prompt and every generated token but the last (the server's
    `Engine.positions`). A prompt longer than max_context is refused; so is a --max-new-tokens the
    user gave that a prompt leaves no room for, as vLLM's and OpenAI's servers refuse prompt plus
    max_tokens beyond the context. The default (16) is cut to what the longest prompt leaves, with a
    note on stderr. Prompts are numbered as the output numbers them (--prompt first, then --prompt-ids)."""
    for i, n in enumerate(prompt_lens):
        if n > max_context:
            raise ContextError(f"prompt {i} has {n} tokens, more than the bundle's max_context ({max_context})")
    room = max_context - max(prompt_lens) + 1  # at least 1: every prompt fits
    if max_new_tokens <= room:
        return max_new_tokens
    if given:
        i = prompt_lens.index(max(prompt_lens))
        raise ContextError(
            f"--max-new-tokens {max_new_tokens}: prompt {i} ({prompt_lens[i]} tokens) leaves room for {room} "
            f"(the bundle's max_context is {max_context} positions: the prompt and every generated token "
            "but the last); lower --max-new-tokens or shorten the prompt"
        )
    click.echo(
        f"note: generating {room} tokens per prompt, what the bundle's max_context ({max_context}) leaves after "
        f"the longest prompt ({max(prompt_lens)} tokens); --max-new-tokens defaults to {max_new_tokens}",
        err=True,
    )
    return room


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
