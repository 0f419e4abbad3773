"""`deepinfer reference`, `deepinfer noise-floor` and `deepinfer compare`: the pure-torch reference
and the comparison of logit dumps against its noise floor (`deepinfer/compare.py` judges).

Registered on the `deepinfer` group by `deepinfer/cli.py`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from deepinfer.cli_common import (
    echo_generations,
    generation_options,
    image_option,
    prompts_with_images,
    user_errors,
    write_logits,
)


@click.command("reference")
@click.argument("checkpoint", type=click.Path(exists=True, file_okay=False, path_type=Path))
@generation_options
@click.option(
    "--chunk",
    type=int,
    default=None,
    help="Prompt chunk size in tokens (default: each prompt in one chunk; 1 feeds it token by token).",
)
@click.option(
    "--dtype",
    type=click.Choice(["bf16", "fp32"]),
    default="bf16",
    show_default=True,
    help="Activation dtype (bf16 as released; fp32 for exact comparisons).",
)
@click.option(
    "--cache-quant/--no-cache-quant",
    default=True,
    show_default=True,
    help="Quantize cached KV and indexer keys/queries as the release does (off for exact comparisons).",
)
@click.option(
    "--topk-ties",
    type=click.Choice(["nemo", "lowest"]),
    default="nemo",
    show_default=True,
    help="Indexer top-k among equal scores: as NeMo AutoModel's forward (torch.topk over the "
    "sequence's width), or lowest index first (what compiled bundles do).",
)
@click.option(
    "--speculative",
    type=click.Choice(["dspark"]),
    default=None,
    help="Speculative decoding with the checkpoint's DSpark draft (mtp.*), run eagerly beside the "
    "target: the same tokens; prints tokens per target step.",
)
@image_option
@user_errors
def reference_cmd(
    checkpoint,
    prompt,
    chat,
    prompt_ids,
    max_new_tokens,
    chunk,
    dtype,
    cache_quant,
    topk_ties,
    speculative,
    as_json,
    dump_logits,
    images,
):
    """Generate greedily with the pure-torch reference model.

    The reference composes the same regions the compiler traces, layer by layer
    in eager torch, with its own state buffers. It is the oracle every bundle
    is held to. Text goes through the checkpoint's tokenizer.json where it has
    one, else the tiny model's byte-level tokenizer.

    \b
    Example (an image at the prompt's <image> marker):
      deepinfer reference tiny/ --image cat.ppm --prompt "<image>What is this?"
    """
    from deepinfer.regions.reference import ReferenceModel
    from deepinfer.runtime.schedule import decode_model

    model = ReferenceModel(checkpoint, dtype=dtype, cache_quant=cache_quant, ties=topk_ties)
    cfg, tok = model.config, model.tokenizer
    prompts, embeds = prompts_with_images(prompt, prompt_ids, images, cfg, tok, lambda: model.vision, chat)
    drafter = model.dspark() if speculative else None
    gens = decode_model(model, prompts, max_new_tokens, chunk=chunk, images=embeds, drafter=drafter)
    if drafter is not None:
        click.echo(f"speculative dspark: {gens.speculation.line()}", err=True)
    if dump_logits:
        write_logits(
            dump_logits,
            gens,
            {
                "source": "reference",
                "dtype": dtype,
                "cache_quant": cache_quant,
                "config_hash": cfg.digest(),
                "checkpoint": checkpoint.resolve(),
            },
        )
    if as_json:
        click.echo(json.dumps(_reference_json(gens, tok, dtype, cache_quant)))
        if any(g.error for g in gens):
            sys.exit(1)
    else:
        echo_generations(gens, tok.decode)


def _reference_json(gens, tok, dtype: str, cache_quant: bool) -> dict:
    return {
        "dtype": dtype,
        "cache_quant": cache_quant,
        "outputs": [
            {
                "prompt_ids": g.tokens[: g.prompt_len],
                "generated_ids": g.generated,
                "text": tok.decode(g.generated),
                "error": g.error,
            }
            for g in gens
        ],
    }


# --- deepinfer compare / noise-floor ---


def floor_options(fn):
    """How `deepinfer noise-floor` and `deepinfer compare` measure the floor."""
    options = [
        click.option(
            "--dtype",
            type=click.Choice(["fp32", "bf16"]),
            default=None,
            help="Precision of the runs compared: fp32 floors summation order only (prompt chunk "
            "widths 1 and 3); bf16 also bf16 against fp32 activations. [default: the dumps' "
            "own (bf16 if either ran in bf16), else bf16]",
        ),
        click.option(
            "--cache-quant/--no-cache-quant",
            default=None,
            help="Quantize the reference's cached KV as the runs compared did. [default: as the dumps record, else on]",
        ),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


@click.command("noise-floor")
@click.argument("checkpoint", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("dump", type=click.Path(dir_okay=False, path_type=Path))
@floor_options
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Save the floor as JSON, for `deepinfer compare --floor FILE`.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the floor as JSON instead of text.")
@user_errors
def noise_floor_cmd(checkpoint, dump, dtype, cache_quant, output, as_json):
    """Measure how far the reference drifts from itself on DUMP's tokens.

    The pure-torch reference of CHECKPOINT is teacher-forced on every token
    sequence of DUMP (a --dump-logits file), once in fp32 in one chunk and
    once per perturbation (other prompt chunk widths; with --dtype bf16 also
    bf16 activations). The floor is the worst cosine, relative error and
    argmax agreement over the perturbations.
    """
    from deepinfer import compare as cmp

    d = cmp.load_dump(dump)
    dtype, cache_quant = cmp.floor_setting(dtype, cache_quant, cmp.floor_precision(d, d))
    note = lambda msg: click.echo(msg, err=True)  # noqa: E731
    floor = cmp.floor_for(d, checkpoint, dtype=dtype, cache_quant=cache_quant, note=note)
    if output:
        cmp.save_floor(floor, output)
    if as_json:
        click.echo(json.dumps(cmp.report_floor(floor)))
    else:
        click.echo("\n".join(cmp.floor_lines(floor)))
        if output:
            click.echo(f"wrote {output}")


@click.command("compare")
@click.argument("a", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("b", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--noise-floor",
    "checkpoint",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="Measure the noise floor with this checkpoint's reference on A's tokens [default: the "
    "checkpoint a reference dump records, when it is here].",
)
@click.option(
    "--floor",
    "floor_file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Reuse a floor saved by `deepinfer noise-floor -o` (its --dtype and cache quant apply).",
)
@click.option("--no-floor", is_flag=True, help="Print the metrics only, without a floor or a verdict.")
@floor_options
@click.option(
    "--margin",
    type=float,
    default=4.0,
    show_default=True,
    help="Within noise means worst rel err <= MARGIN x the floor's (at least 1e-6).",
)
@click.option("--per-step", is_flag=True, help="Also print one row per position.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@user_errors
def compare_cmd(a, b, checkpoint, floor_file, no_floor, dtype, cache_quant, margin, per_step, as_json):
    """Compare the logit dumps A and B (--dump-logits files) position by position.

    For each position both computed from the same tokens: cosine similarity,
    relative error ||A - B|| / ||B|| (give the reference as B) and argmax
    agreement; then a summary per prompt. Rows after greedy generation
    diverges saw different tokens and are not compared.

    The verdict is "within noise" when the worst rel err is at most MARGIN
    times the noise floor's and the argmax agreement is at least the floor's.
    The floor is measured at the dumps' own precision (both fp32: summation
    order only; either bf16: bf16 too) with the checkpoint given by
    --noise-floor, else the one a `deepinfer reference` dump records; or read
    from --floor FILE. Dumps that record different models are refused.

    \b
    Exit status: 0 within noise (or --no-floor), 1 outside noise,
    2 unreadable or mismatched input, or no floor to judge by.

    \b
    Example:
      deepinfer reference tiny/ --prompt Hi --dtype fp32 --topk-ties lowest --dump-logits ref.st
      deepinfer-run build/tiny --prompt Hi --dump-logits run.st
      deepinfer compare run.st ref.st            # floor: fp32, from tiny/ (recorded in ref.st)
    """
    from deepinfer import compare as cmp

    if sum(map(bool, (checkpoint, floor_file, no_floor))) > 1:
        raise click.UsageError("give one of --noise-floor CKPT, --floor FILE and --no-floor")
    da, db = cmp.load_dump(a), cmp.load_dump(b)
    cmp.same_model(da, db)
    result = cmp.compare(da, db)
    floor = verdict = None
    if floor_file:
        floor = cmp.load_floor(floor_file)
        if floor.tokens != cmp.floor_tokens(da):
            click.echo(f"note: {floor_file} was measured on other tokens than {a}", err=True)
    elif not no_floor:
        note = lambda msg: click.echo(msg, err=True)  # noqa: E731
        floor = cmp.judging_floor(da, db, checkpoint=checkpoint, dtype=dtype, cache_quant=cache_quant, note=note)
    if floor is not None:
        verdict = cmp.verdict(result, floor, margin)
    if as_json:
        click.echo(json.dumps(cmp.report_json(result, floor, verdict, per_step=per_step)))
    else:
        click.echo("\n".join(cmp.judged_lines(result, floor, verdict, per_step=per_step)))
    if verdict is not None and not verdict.within:
        sys.exit(1)
