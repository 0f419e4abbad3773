"""`deepinfer-run`: a thin layer over `deepinfer.runtime.load(path).generate(...)`."""

from __future__ import annotations

import json
import time
from pathlib import Path

import click

from deepinfer.cli_common import (
    echo_generations,
    generation_options,
    image_option,
    prompts_with_images,
    trust_option,
    trusted_key,
    user_errors,
    write_logits,
)


def speculation_timing(stats, speculation, verify_tokens: int) -> dict:
    """A speculative run's tokens per target step, and its verify steps' mean time over its plain decode
    steps' (a sequence's last step, with no token left to draft for, is one; None without both)."""
    (n1, s1), (nv, sv) = stats.by_tokens.get(1, (0, 0.0)), stats.by_tokens.get(verify_tokens, (0, 0.0))
    return {
        "tokens_per_step": speculation.tokens_per_step,
        "verify_steps": speculation.verify_steps,
        "drafted": speculation.drafted,
        "accepted": speculation.accepted,
        "verify_step_ms": sv / nv * 1e3 if nv else None,
        "decode_step_ms": s1 / n1 * 1e3 if n1 else None,
        "verify_over_decode_step": sv / nv / (s1 / n1) if n1 and nv else None,
    }


def speculation_lines(t: dict, speculation) -> list[str]:
    ratio = t["verify_over_decode_step"]
    return [
        f"speculative dspark: {speculation.line()}",
        f"verify step {t['verify_step_ms']:.2f} ms over plain decode step {t['decode_step_ms']:.2f} ms: {ratio:.2f}x"
        if ratio is not None
        else "verify over plain decode step: not measured (this run had no step of each)",
    ]


def timing_lines(stats, wall: float) -> list[str]:
    lines = [f"{'region kind':<24}{'calls':>7}{'total ms':>11}{'mean us':>10}{'share':>8}"]
    for row in stats.table():
        lines.append(
            f"{row['kind']:<24}{row['calls']:>7}{row['total_ms']:>11.1f}{row['mean_us']:>10.0f}{row['share']:>8.1%}"
        )
    calls = sum(stats.calls.values()) or 1
    waste = 1 - stats.tokens / stats.padded if stats.padded else 0.0
    lines.append(
        f"{stats.steps} steps, {stats.step_seconds / max(stats.steps, 1) * 1e3:.2f} ms a step; "
        f"runtime overhead {stats.overhead / calls * 1e6:.1f} us a region call; "
        f"padding waste {waste:.1%}; wall {wall:.2f} s"
    )
    return lines


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("bundle", type=click.Path(exists=True, file_okay=False, path_type=Path))
@generation_options
@click.option(
    "--num-kv-blocks",
    type=click.IntRange(min=2),
    default=None,
    help="Size of the KV block pool, block 0 being scratch (default: the bundle's num_blocks).",
)
@click.option("--timing", is_flag=True, help="Print host time per region kind and the runtime's own overhead.")
@click.option("--no-verify", is_flag=True, help="Skip the digest check of the bundle's files at load.")
@click.option(
    "--threads",
    type=click.IntRange(min=1),
    default=None,
    help="Host threads for the executables (default: torch's; 1 is often fastest for small models on a busy machine).",
)
@click.option(
    "--speculative",
    type=click.Choice(["dspark"]),
    default=None,
    help="Speculative decoding with the draft compiled into the bundle ([speculative] draft in its "
    "model.toml): the same tokens as without; --timing adds tokens per target step and the verify "
    "step's cost over a plain decode step. Single-rank bundles.",
)
@image_option
@trust_option
@user_errors
def main(
    bundle,
    prompt,
    chat,
    prompt_ids,
    max_new_tokens,
    num_kv_blocks,
    timing,
    speculative,
    as_json,
    dump_logits,
    no_verify,
    threads,
    images,
    trust,
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
    from deepinfer.regions.tokenizer import for_bundle
    from deepinfer.runtime import open_bundle, ranks
    from deepinfer.runtime.session import load_vision, require_draft

    if threads:
        import torch

        torch.set_num_threads(threads)
    start = time.perf_counter()
    opened = open_bundle(bundle, verify=not no_verify, trust=trusted_key(trust))
    cfg = opened.config
    if speculative:
        require_draft(opened)
    tok = for_bundle(opened)
    prompts, embeds = prompts_with_images(prompt, prompt_ids, images, cfg, tok, lambda: load_vision(opened), chat)
    world, launched = opened.manifest.topology.world_size, ranks.torchrun_rank()
    if world > 1 and launched is None:  # start the ranks here: one process each
        run = ranks.generate_ranks(
            opened,
            prompts,
            max_new_tokens,
            num_kv_blocks=num_kv_blocks,
            verify=not no_verify,
            threads=threads,
            images=embeds,
            trust=str(trust) if trust else None,
        )
        gens, stats = run["gens"], run["stats"]
    else:
        session, comm = ranks.load_here(opened, launched, num_kv_blocks)
        if comm is not None and not comm.leader:
            return
        drafter = session.dspark() if speculative else None
        gens, stats = session.generate(prompts, max_new_tokens, images=embeds, drafter=drafter), session.stats
    wall = time.perf_counter() - start
    if dump_logits:
        m = opened.manifest.model
        write_logits(
            dump_logits,
            gens,
            {"source": "bundle", "dtype": m.dtype, "cache_quant": m.cache_quant, "config_hash": m.config_hash},
        )
    if as_json:
        out = {
            "outputs": [
                {
                    "prompt_ids": g.tokens[: g.prompt_len],
                    "generated_ids": g.generated,
                    "text": tok.decode(g.generated),
                    "error": g.error,
                }
                for g in gens
            ]
        }
        if timing:
            s = stats
            out["timing"] = {
                "regions": s.table(),
                "steps": s.steps,
                "step_ms": s.step_seconds / max(s.steps, 1) * 1e3,
                "overhead_us_per_call": s.overhead / max(sum(s.calls.values()), 1) * 1e6,
                "padding_waste": 1 - s.tokens / s.padded if s.padded else 0.0,
                "wall_s": wall,
            }
            if speculative:
                out["timing"]["speculation"] = speculation_timing(s, drafter.stats, cfg.text.dspark_block_size + 1)
        click.echo(json.dumps(out))
    else:
        if timing:
            click.echo("\n".join(timing_lines(stats, wall)), err=True)
            if speculative:
                t = speculation_timing(stats, drafter.stats, cfg.text.dspark_block_size + 1)
                click.echo("\n".join(speculation_lines(t, drafter.stats)), err=True)
        echo_generations(gens, tok.decode)
    if any(g.error for g in gens):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
