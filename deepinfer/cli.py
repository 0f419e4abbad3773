"""The `deepinfer` command: parse, resolve defaults, call one API function, print.

Errors caused by user input (`DeepinferError` and the quant input errors) are
printed on one line without a traceback, with exit status 2.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import click

from deepinfer.errors import DeepinferError


def user_errors(fn):
    """Turn user-input errors into a one-line message and exit status 2."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except DeepinferError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(2)
    return wrapper


def parse_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise click.BadParameter(f"{text!r}: expected comma-separated token ids like 1,2,3") from None
    if not ids:
        raise click.BadParameter("empty --prompt-ids")
    return ids


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="deepinfer")
def main():
    """deepinfer: ahead-of-time compiler toolchain for DeepSeek-V4.1-class MoE models.

    \b
    Start here:
      deepinfer make-tiny tiny/                     # a tiny random V4.1 checkpoint
      deepinfer reference tiny/ --prompt "Hello"    # generate with the pure-torch reference
    """


@main.command("make-tiny")
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--seed", default=0, show_default=True, help="Random seed; the same seed gives the same bytes.")
@click.option("--layers", default=6, show_default=True,
              help="Number of layers (>= 6; longer models repeat the pattern so every layer kind stays present).")
@click.option("--exist-ok", is_flag=True, help="Keep OUT when it already holds this tiny checkpoint.")
@user_errors
def make_tiny_cmd(out: Path, seed: int, layers: int, exist_ok: bool):
    """Write a deterministic tiny random V4.1 checkpoint to OUT.

    The checkpoint has the release's layout (config.json, model.safetensors and
    its index; fp8 weights with [32, 32] ue8m0 scales, fp4 experts, bf16 norms)
    and every layer kind: window-only, kv sources at ratio 2 and 1, reindex,
    reuse, the candidate pool and engram. Its tokenizer is byte-level.
    """
    from deepinfer.regions.tiny import make_tiny

    path = make_tiny(out, seed=seed, layers=layers, exist_ok=exist_ok)
    click.echo(f"wrote {path} (seed {seed}, {layers} layers)")


def prompts_from(prompt: tuple[str, ...], prompt_ids: tuple[str, ...], vocab: int, tokenizer) -> list[list[int]]:
    prompts = [tokenizer.encode(p) for p in prompt] + [parse_ids(p) for p in prompt_ids]
    if not prompts:
        raise click.UsageError("give at least one --prompt TEXT or --prompt-ids 1,2,3")
    for ids in prompts:
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise click.BadParameter(f"token ids {bad} outside the vocabulary [0, {vocab})")
    return prompts


def write_logits(path: Path, gens) -> None:
    """tokens (int64, prompt then generated) and logits (float32 [positions, V]) per prompt.

    The first prompt's tensors are `tokens` and `logits`; prompt i > 0 adds `.i`.
    """
    import torch
    from safetensors.torch import save_file

    out = {}
    for i, g in enumerate(gens):
        suffix = "" if i == 0 else f".{i}"
        out["tokens" + suffix] = torch.tensor(g.tokens, dtype=torch.int64)
        out["logits" + suffix] = torch.stack(g.logits).float().contiguous()
    tmp = path.with_name(path.name + ".tmp")
    save_file(out, str(tmp))
    tmp.replace(path)


@main.command("reference")
@click.argument("checkpoint", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--prompt", multiple=True, help="Prompt text (byte-level tokenizer). Repeat for a batch.")
@click.option("--prompt-ids", multiple=True, help="Prompt as token ids, e.g. 0,72,101. Repeat for a batch.")
@click.option("--max-new-tokens", default=16, show_default=True, help="Tokens to generate per prompt.")
@click.option("--chunk", type=int, default=None,
              help="Prompt chunk size in tokens (default: each prompt in one chunk; 1 feeds it token by token).")
@click.option("--dtype", type=click.Choice(["bf16", "fp32"]), default="bf16", show_default=True,
              help="Activation dtype (bf16 as released; fp32 for exact comparisons).")
@click.option("--cache-quant/--no-cache-quant", default=True, show_default=True,
              help="Quantize cached KV and indexer keys/queries as the release does (off for exact comparisons).")
@click.option("--topk-ties", type=click.Choice(["nemo", "lowest"]), default="nemo", show_default=True,
              help="Indexer top-k among equal scores: as NeMo AutoModel's forward (torch.topk over the "
                   "sequence's width), or lowest index first (what compiled bundles do).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@click.option("--dump-logits", type=click.Path(dir_okay=False, path_type=Path),
              help="Write tokens and per-position float32 logits to this .safetensors file.")
@user_errors
def reference_cmd(checkpoint, prompt, prompt_ids, max_new_tokens, chunk, dtype, cache_quant, topk_ties, as_json,
                  dump_logits):
    """Generate greedily with the pure-torch reference model.

    The reference composes the same regions the compiler traces, layer by layer
    in eager torch, with its own state buffers. It is the oracle every bundle
    is held to.
    """
    from deepinfer.regions.reference import ReferenceModel
    from deepinfer.regions.tokenizer import ByteTokenizer

    model = ReferenceModel(checkpoint, dtype=dtype, cache_quant=cache_quant, ties=topk_ties)
    cfg = model.config
    tok = ByteTokenizer(cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id)
    prompts = prompts_from(prompt, prompt_ids, cfg.text.vocab_size, tok)
    gens = model.generate(prompts, max_new_tokens, chunk=chunk)
    if dump_logits:
        write_logits(dump_logits, gens)
    if as_json:
        click.echo(json.dumps({
            "dtype": dtype, "cache_quant": cache_quant,
            "outputs": [{"prompt_ids": g.tokens[:g.prompt_len], "generated_ids": g.generated,
                         "text": tok.decode(g.generated)} for g in gens]}))
    else:
        for g in gens:
            click.echo(tok.decode(g.generated))


if __name__ == "__main__":
    main()
