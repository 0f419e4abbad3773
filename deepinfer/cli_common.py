"""Click helpers the command-line tools share (deepinfer, deepinfer-compile, deepinfer-run).

Nothing here imports a tool: each CLI imports these, and the umbrella `deepinfer`
command imports the sub-CLIs, never the reverse.
"""

from __future__ import annotations

import functools
import os
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


TRUST_ENV = "DEEPINFER_TRUST"


def trust_option(fn):
    """--trust PUBKEY (or $DEEPINFER_TRUST): verify a bundle's signature before loading it."""
    return click.option(
        "--trust",
        type=click.Path(exists=True, dir_okay=False, path_type=Path),
        envvar=TRUST_ENV,
        help="Ed25519 public key (PEM) to trust: a bundle (or, compiling, a cache entry) whose "
        "signature does not verify with it is refused before anything of it is loaded "
        f"(default: ${TRUST_ENV}). Bundles and caches hold code; see the README, Trust.",
    )(fn)


def trusted_key(path: Path | None):
    """The public key of --trust, or None."""
    from deepinfer.bundles.signing import trusted

    return trusted(path)


def bundle_options(fn):
    """The options `deepinfer-run` and `deepinfer-serve` share: how the bundle is opened and loaded
    (`runtime.LoadOptions`, built by `load_settings`)."""
    options = [
        click.option(
            "--num-kv-blocks",
            type=click.IntRange(min=2),
            default=None,
            help="Size of the KV block pool, block 0 being scratch (default: the bundle's num_blocks).",
        ),
        click.option(
            "--threads",
            type=click.IntRange(min=1),
            default=None,
            help="Host threads for the executables (default: torch's; 1 is often fastest for small models "
            "on a busy machine).",
        ),
        click.option("--no-verify", is_flag=True, help="Skip the digest check of the bundle's files at load."),
        click.option(
            "--speculative",
            type=click.Choice(["dspark"]),
            default=None,
            help="Greedy requests decode speculatively with the draft compiled into the bundle ([speculative] "
            "draft in its model.toml): the same tokens as without. Single-rank bundles.",
        ),
    ]
    for option in reversed(options):
        fn = option(fn)
    return trust_option(fn)


def load_settings(num_kv_blocks, threads, no_verify, speculative, trust) -> dict:
    """The `runtime.LoadOptions` fields of `bundle_options`' values."""
    return {
        "num_kv_blocks": num_kv_blocks,
        "threads": threads,
        "verify": not no_verify,
        "speculative": speculative,
        "trust": trust,
    }


def parse_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise click.BadParameter(f"{text!r}: expected comma-separated token ids like 1,2,3") from None
    if not ids:
        raise click.BadParameter("empty --prompt-ids")
    return ids


def prompts_from(
    prompt: tuple[str, ...],
    prompt_ids: tuple[str, ...],
    vocab: int,
    tokenizer,
    image_token: int | None = None,
    chat: bool = False,
) -> list[list[int]]:
    """Token ids of each --prompt (with `chat`, one user message through the chat template) and --prompt-ids."""
    if chat:
        texts = [tokenizer.chat([{"role": "user", "content": p}], image_token=image_token) for p in prompt]
    else:
        texts = [tokenizer.encode(p, image_token=image_token) for p in prompt]
    prompts = texts + [parse_ids(p) for p in prompt_ids]
    if not prompts:
        raise click.UsageError("give at least one --prompt TEXT or --prompt-ids 1,2,3")
    for ids in prompts:
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise click.BadParameter(f"token ids {bad} outside the vocabulary [0, {vocab})")
    return prompts


def _writable_destination(ctx, param, path: Path | None) -> Path | None:
    """Check an output file's directory before the work that fills it (generation can take long)."""
    if path is None:
        return None
    parent = path.parent
    if not parent.is_dir():
        raise click.BadParameter(f"{path}: directory {parent} does not exist", ctx, param)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise click.BadParameter(f"{path}: directory {parent} is not writable", ctx, param)
    if path.is_dir():
        raise click.BadParameter(f"{path}: is a directory", ctx, param)
    return path


def generation_options(fn):
    """The options `deepinfer reference` and `deepinfer-run` share: prompts, length, output."""
    options = [
        click.option("--prompt", multiple=True, help="Prompt text (the model's tokenizer). Repeat for a batch."),
        click.option(
            "--chat",
            is_flag=True,
            help="Each --prompt is one user message, rendered through the "
            "tokenizer's chat template (with a generation prompt) before encoding.",
        ),
        click.option("--prompt-ids", multiple=True, help="Prompt as token ids, e.g. 0,72,101. Repeat for a batch."),
        click.option(
            "--max-new-tokens",
            type=click.IntRange(min=1),
            default=16,
            show_default=True,
            help="Tokens to generate per prompt (at least 1).",
        ),
        click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text."),
        click.option(
            "--dump-logits",
            type=click.Path(dir_okay=False, path_type=Path),
            callback=_writable_destination,
            help="Write tokens and per-position float32 logits to this .safetensors file (its directory "
            "is checked before generating).",
        ),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


image_option = click.option(
    "--image",
    "images",
    multiple=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="An image for every prompt, run through the host-side vision tower: binary PPM/PGM (P6/P5), PNG "
    "(8-bit, non-interlaced) or .npy uint8 [H, W, 3]. It takes the place of the prompt's <image> marker "
    "(--prompt-ids: the image token id), else goes right after bos. Repeat for several images, one "
    "marker each.",
)


def prompts_with_images(prompt, prompt_ids, images, config, tokenizer, tower, chat: bool = False):
    """(token-id prompts, per-prompt image embeddings or None); `tower()` gives the vision tower,
    asked for only when there are images."""
    if not images:
        return prompts_from(prompt, prompt_ids, config.text.vocab_size, tokenizer, chat=chat), None
    from deepinfer.regions.image import read_image
    from deepinfer.regions.spans import with_images

    token = config.image_token_id
    prompts = prompts_from(prompt, prompt_ids, config.text.vocab_size, tokenizer, image_token=token, chat=chat)
    vision = tower()
    spans = [vision.embed(read_image(path)) for path in images]
    placed = [with_images(ids, spans, token, config.bos_token_id) for ids in prompts]
    return [ids for ids, _ in placed], [embeds for _, embeds in placed]


def echo_generations(gens, decode) -> None:
    """Text mode: each prompt's generated text on stdout, then, for one that stopped early (the
    context or the KV pool ran out), the reason on stderr. Exits 1 after all are printed if any
    stopped early."""
    for i, g in enumerate(gens):
        click.echo(decode(g.generated))
        if g.error is not None:
            click.echo(f"error: prompt {i}: stopped after {len(g.generated)} generated tokens: {g.error}", err=True)
    if any(g.error is not None for g in gens):
        sys.exit(1)


def write_logits(path: Path, gens, meta: dict | None = None) -> None:
    """tokens (int64, prompt then generated) and logits (float32 [positions, V]) per prompt.

    The first prompt's tensors are `tokens` and `logits`; prompt i > 0 adds `.i`. `meta` (what
    produced them: source, dtype, cache_quant, config_hash, checkpoint) goes to the file's
    metadata, where `deepinfer compare` reads it.
    """
    import torch
    from safetensors.torch import save_file

    out = {}
    for i, g in enumerate(gens):
        suffix = "" if i == 0 else f".{i}"
        out["tokens" + suffix] = torch.tensor(g.tokens, dtype=torch.int64)
        out["logits" + suffix] = torch.stack(g.logits).float().contiguous()
    tmp = path.with_name(path.name + ".tmp")
    save_file(out, str(tmp), metadata={k: str(v) for k, v in (meta or {}).items()} or None)
    tmp.replace(path)
