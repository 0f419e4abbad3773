"""The `deepinfer` command: parse, resolve defaults, call one API function, print.

Errors caused by user input (`DeepinferError` and the quant input errors) are
printed on one line without a traceback, with exit status 2.
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
    prompts_from,
    prompts_with_images,
    trust_option,
    trusted_key,
    user_errors,
    write_logits,
)
from deepinfer.reader import CAP_MANIFEST, ReadError, load_json, parse_json


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
@click.option(
    "--seed",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Random seed (>= 0); the same seed gives the same bytes.",
)
@click.option(
    "--layers",
    default=6,
    show_default=True,
    help="Number of layers (>= 6; longer models repeat the pattern so every layer kind stays present).",
)
@click.option("--exist-ok", is_flag=True, help="Keep OUT when it already holds this tiny checkpoint.")
@click.option(
    "--scales",
    type=click.Choice(["ue8m0", "fp32"]),
    default="ue8m0",
    show_default=True,
    help="fp8 block scales: the release's ue8m0 on [32, 32], or DeepSeek-V3-style float32 "
    "weight_scale_inv on [128, 128] (the compile rescales those to ue8m0).",
)
@click.option(
    "--geometry",
    type=click.Choice(["tiny", "release"]),
    default="tiny",
    show_default=True,
    help="release: the released dimensions (hidden 5120, 64 heads of 512, vocab 129280, experts of "
    "2304, ...) in 7 layers holding every region kind of the release, with --experts routed "
    "experts; random valid values, no model (about 5 GB at 8 experts; --layers and --scales "
    "do not apply).",
)
@click.option(
    "--experts",
    type=click.IntRange(min=1),
    default=8,
    show_default=True,
    help="Routed experts per layer of --geometry release.",
)
@user_errors
def make_tiny_cmd(out: Path, seed: int, layers: int, exist_ok: bool, scales: str, geometry: str, experts: int):
    """Write a deterministic tiny random V4.1 checkpoint to OUT.

    The checkpoint has the release's layout (config.json, model.safetensors and
    its index; fp8 weights with [32, 32] ue8m0 scales, fp4 experts, bf16 norms)
    and every layer kind: window-only, kv sources at ratio 2 and 1, reindex,
    reuse, the candidate pool and engram, plus a tiny vision tower (2 blocks,
    patch 4, 2 x 2 merge; images via --image). Its tokenizer is byte-level
    (image token 259).
    """
    if geometry == "release":
        from deepinfer.regions.synthetic import release_geometry_config, write_synthetic

        size = write_synthetic(
            out, release_geometry_config(experts), seed=seed, log=lambda msg: click.echo(msg, err=True)
        )
        click.echo(f"wrote {out} (release geometry, 7 layers, {experts} experts, {size / 2**30:.2f} GiB, seed {seed})")
        return
    from deepinfer.regions.tiny import make_tiny

    path = make_tiny(out, seed=seed, layers=layers, exist_ok=exist_ok, scales=scales)
    click.echo(f"wrote {path} (seed {seed}, {layers} layers" + (", float32 block scales)" if scales == "fp32" else ")"))


@main.command("reference")
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
        click.echo(
            json.dumps(
                {
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
            )
        )
        if any(g.error for g in gens):
            sys.exit(1)
    else:
        echo_generations(gens, tok.decode)


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


@main.command("noise-floor")
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
    dtype, cache_quant = _floor_setting(dtype, cache_quant, cmp.floor_precision(d, d))
    floor = cmp.floor_for(d, checkpoint, dtype=dtype, cache_quant=cache_quant)
    if output:
        cmp.save_floor(floor, output)
    if as_json:
        click.echo(json.dumps(cmp.report_floor(floor)))
    else:
        click.echo("\n".join(cmp.floor_lines(floor)))
        if output:
            click.echo(f"wrote {output}")


def _floor_setting(dtype, cache_quant, recorded) -> tuple[str, bool]:
    """The floor's precision: as given, else as the dumps record, else bf16 with cache quantization."""
    rec_dtype, rec_quant = recorded
    dtype = dtype or rec_dtype or "bf16"
    cache_quant = cache_quant if cache_quant is not None else rec_quant if rec_quant is not None else True
    return dtype, cache_quant


@main.command("compare")
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
    from deepinfer.errors import CompareError

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
        checkpoint = checkpoint or cmp.recorded_checkpoint(da, db)
        if checkpoint is None:
            raise CompareError(
                f"no noise floor to judge {a} against {b}: give --noise-floor CKPT or --floor FILE "
                "(neither dump records a checkpoint found here), or --no-floor for the metrics alone"
            )
        dtype, cache_quant = _floor_setting(dtype, cache_quant, cmp.floor_precision(da, db))
        click.echo(
            f"measuring the noise floor with {checkpoint} ({dtype}, cache quant {'on' if cache_quant else 'off'})",
            err=True,
        )
        floor = cmp.floor_for(da, checkpoint, dtype=dtype, cache_quant=cache_quant)
    if floor is not None:
        verdict = cmp.verdict(result, floor, margin)
    if as_json:
        click.echo(json.dumps(cmp.report_json(result, floor, verdict, per_step=per_step)))
    else:
        lines = cmp.table_lines(result, per_step=per_step)
        if floor is not None:
            lines += cmp.floor_lines(floor) + [cmp.verdict_line(verdict)]
        else:
            lines.append("verdict: none (--no-floor)")
        click.echo("\n".join(lines))
    if verdict is not None and not verdict.within:
        sys.exit(1)


@main.command("diff")
@click.argument("bundle", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--prompt", multiple=True, help="Prompt text (the bundle's tokenizer). Repeat for a batch.")
@click.option("--prompt-ids", multiple=True, help="Prompt as token ids, e.g. 0,72,101. Repeat for a batch.")
@click.option("--max-new-tokens", default=4, show_default=True, help="Tokens to generate per prompt.")
@click.option(
    "--tolerance",
    type=float,
    default=None,
    help="Worst score a kind may have [default: 1e-4 for fp32 bundles, 2e-2 for bf16].",
)
@click.option("--per-layer", is_flag=True, help="One row per (kind, layer) instead of one per kind.")
@click.option(
    "--num-kv-blocks",
    type=click.IntRange(min=2),
    default=None,
    help="Size of the KV block pool, block 0 being scratch (default: the bundle's).",
)
@click.option("--no-verify", is_flag=True, help="Skip the digest check of the bundle's files at load.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table.")
@trust_option
@user_errors
def diff_cmd(
    bundle, prompt, prompt_ids, max_new_tokens, tolerance, per_layer, num_kv_blocks, no_verify, as_json, trust
):
    """Rank BUNDLE's region kinds by how far they are from their pure-torch reference.

    Generates greedily on the prompts; every region call's inputs are copied
    before the executable runs, and the eager reference region of that kind
    (this bundle's config, that layer's weights from the bundle's stacks) is
    run on the copies. Outputs and written state are compared: floats by
    max |exe - ref| / max |ref|, integers (top-k) by the fraction that differ.
    The run continues with the executable's outputs, so differences do not
    compound and the worst kind is the culprit.

    \b
    Exit status: 0 every kind within --tolerance, 1 some kind differs,
    2 unreadable bundle or bad input.

    \b
    Example:
      deepinfer diff build/tiny --prompt "Hello" --per-layer
    """
    from deepinfer import diff
    from deepinfer.runtime import open_bundle
    from deepinfer.runtime.bundle import tokenizer

    opened = open_bundle(bundle, verify=not no_verify, trust=trusted_key(trust))
    prompts = prompts_from(prompt, prompt_ids, opened.config.text.vocab_size, tokenizer(opened))
    report = diff.diff_bundle(opened, prompts, max_new_tokens, tolerance=tolerance, num_kv_blocks=num_kv_blocks)
    if as_json:
        click.echo(json.dumps(diff.report_json(report)))
    else:
        click.echo("\n".join(diff.table_lines(report, per_layer=per_layer)))
    if report.failing():
        sys.exit(1)


# --- deepinfer cache ---

UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
AGES = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_amount(text: str, units: dict, what: str, example: str) -> float:
    import re

    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]?)[bB]?\s*", text)
    if not m or m.group(2).lower() not in units:
        raise click.BadParameter(f"{text!r}: expected a {what} like {example}")
    return float(m.group(1)) * units[m.group(2).lower()]


def open_cache(cache_dir: Path | None):
    from deepinfer.compiler.cache import Cache, resolve_dir

    return Cache(resolve_dir(cache_dir, None), log=lambda msg: click.echo(msg, err=True))


cache_dir_option = click.option(
    "--cache-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Cache directory (default: $DEEPINFER_CACHE_DIR, else ~/.cache/deepinfer).",
)


def store_options(required: bool):
    """--url and --endpoint: the remote tier (compiler/store.py) a `deepinfer cache` command works on."""

    def add(fn):
        fn = click.option(
            "--endpoint",
            metavar="URL",
            help="S3-compatible server of --url, e.g. http://minio:9000 (default: $AWS_ENDPOINT_URL, else AWS).",
        )(fn)
        return click.option(
            "--url",
            metavar="s3://BUCKET/PREFIX",
            envvar="DEEPINFER_CACHE_URL" if required else None,
            help="The cache's remote tier"
            + (" (default: $DEEPINFER_CACHE_URL)." if required else ": work on it instead of the local directory."),
        )(fn)

    return add


def open_store(url: str | None, endpoint: str | None):
    from deepinfer.compiler.store import Store

    return None if url is None else Store.from_url(url, endpoint, log=lambda msg: click.echo(msg, err=True))


def _explainable(meta, ref: str) -> dict:
    """A cache entry's meta.json value checked for what `cache explain` reads (CacheError if not)."""
    from deepinfer.compiler.cache import CacheError

    parts = meta.get("parts", []) if isinstance(meta, dict) else None
    if not (
        isinstance(meta, dict)
        and all(isinstance(meta.get(k, ""), str) for k in ("kind", "identity", "key"))
        and isinstance(parts, list)
        and all(
            isinstance(p, dict) and isinstance(p.get("name"), str) and isinstance(p.get("hash"), str) for p in parts
        )
    ):
        raise CacheError(f"{ref}: not a cache entry's meta.json (kind, identity, key, parts of name and hash)")
    return meta


def bundle_keys(bundle: Path) -> set[tuple[str, str]]:
    """The (kind, key) pairs a bundle records it was built from (bundles/layout.CACHE_KEYS_FILE)."""
    from deepinfer.bundles.layout import CACHE_KEYS_FILE
    from deepinfer.compiler.cache import CacheError

    path = bundle / CACHE_KEYS_FILE
    if not path.exists() and not path.is_symlink():
        raise CacheError(
            f"{path}: missing; the bundle was compiled without a cache, or by a deepinfer "
            "that did not record its cache keys (recompile it with a cache)"
        )
    data = load_json(path, CAP_MANIFEST, root=bundle, error=CacheError)
    entries = data.get("entries") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not all(
        isinstance(e, dict) and isinstance(e.get("kind"), str) and isinstance(e.get("key"), str) for e in entries
    ):
        raise CacheError(f'{path}: expected {{"entries": [{{"kind": str, "key": str}}, ...]}}')
    return {(e["kind"], e["key"]) for e in entries}


@main.command("plan")
@click.argument("model_toml", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@click.option(
    "--no-scratch",
    is_flag=True,
    help="Do not trace the regions for their scratch (seconds instead of about a minute at release "
    "dimensions); the memory verdict then counts weights and state pools only.",
)
@click.option(
    "--scratch-of",
    "kinds",
    multiple=True,
    metavar="KIND",
    help="Trace only this region kind (repeat for several), e.g. moe.",
)
@cache_dir_option
@click.option("--no-cache", is_flag=True, help="Do not read the compile cache's trace records.")
@user_errors
def plan_cmd(model_toml, as_json, no_scratch, kinds, cache_dir, no_cache):
    """Print what `deepinfer compile MODEL_TOML` would build, reading no tensor data.

    From the checkpoint's config.json and its safetensors headers (or config.json
    alone): the layer plan, region kinds and executables per bucket, weight bytes
    per rank after sharding, the state pools, the memory budget verdict of every
    rank, the bundle's size on disk and the number of compile jobs. Nothing is
    written. Exit status 0 whether or not the ranks fit: the verdict is printed.

    Scratch comes from the trace records of the compile cache (an earlier compile
    of the same file wrote them), else each region kind is
    traced on fake tensors at its largest bucket (about 10 s of CPU a kind at
    release dimensions).

    \b
    Example (the released Flash model at EP = CP = 64 on trn2):
      deepinfer plan examples/release/model.toml
    """
    from deepinfer.compiler.bundle_plan import plan_bundle
    from deepinfer.compiler.cache import Cache, resolve_dir
    from deepinfer.compiler.config import load_compile_config

    if no_cache and cache_dir:
        raise click.UsageError("--no-cache excludes --cache-dir")
    cfg = load_compile_config(model_toml)
    log = lambda msg: click.echo(msg, err=True)  # noqa: E731
    cache = None if no_cache else Cache(resolve_dir(cache_dir, cfg.cache.dir), log=log)
    plan = plan_bundle(cfg, scratch=not no_scratch, kinds=kinds or None, cache=cache, log=log)
    click.echo(json.dumps(plan.to_dict(), indent=2) if as_json else "\n".join(plan.lines()))


@main.group("cache")
def cache_group():
    """Inspect and maintain the artifact cache deepinfer-compile reads and writes."""


@cache_group.command("ls")
@cache_dir_option
@store_options(required=False)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per entry, one a line.")
@user_errors
def cache_ls(cache_dir, url, endpoint, as_json):
    """List the cache's entries: kind, key, what it builds, size, last use
    (with --url, the store's: kind, key, what it builds, artifact size, when published).

    \b
    Examples:
      deepinfer cache ls
      deepinfer cache ls --url s3://ci-cache/deepinfer --json
    """
    import time

    store = open_store(url, endpoint)
    if store is not None:
        _store_ls(store, as_json)
        return
    cache = open_cache(cache_dir)
    entries = cache.entries()
    total = 0
    for e in sorted(entries, key=lambda e: (e.kind, e.meta.get("identity", ""))):
        size = cache.size(e)
        total += size
        if as_json:
            click.echo(
                json.dumps(
                    {
                        "kind": e.kind,
                        "key": e.key,
                        "identity": e.meta.get("identity"),
                        "size": size,
                        "last_used": e.last_used,
                    }
                )
            )
        else:
            age = (time.time() - e.last_used) / 3600
            click.echo(
                f"{e.kind:<10} {e.key[:16]}  {e.meta.get('identity', '?'):<32} {size / 1e6:9.2f} MB  "
                f"used {age:.1f} h ago"
            )
    if not as_json:
        click.echo(f"{len(entries)} entries, {total / 1e6:.2f} MB in {cache.dir}")


def _store_ls(store, as_json: bool) -> None:
    import time

    from deepinfer.compiler.cache import KINDS

    listed = list(store.entries(KINDS))
    total = 0
    for e in listed:
        got = store.get_meta(e.kind, e.key)
        try:
            meta = parse_json(got[0], f"{e.kind} {e.key} meta.json") if got else {}
        except ReadError:
            meta = {}
        size = meta.get("size", 0) if isinstance(meta, dict) else 0
        total += size
        ident = meta.get("identity") if isinstance(meta, dict) else None
        if as_json:
            row = {"kind": e.kind, "key": e.key, "identity": ident, "size": size, "published": e.last_modified}
            click.echo(json.dumps(row))
        else:
            age = (time.time() - e.last_modified) / 3600
            click.echo(f"{e.kind:<10} {e.key[:16]}  {ident or '?':<32} {size / 1e6:9.2f} MB  published {age:.1f} h ago")
    if not as_json:
        click.echo(f"{len(listed)} entries, {total / 1e6:.2f} MB in {store.url}")


@cache_group.command("prune")
@cache_dir_option
@store_options(required=False)
@click.option("--max-size", help="Keep at most this much, least recently used removed first (e.g. 2G, 500M).")
@click.option("--max-age", help="Remove entries not used for this long (e.g. 7d, 12h).")
@user_errors
def cache_prune(cache_dir, url, endpoint, max_size, max_age):
    """Remove entries unused for --max-age, then the least recently used beyond --max-size.

    With --url, prune the store instead: entries published more than --max-age ago (the
    store keeps no last use; --max-size is for the local directory only), then the
    objects no entry names any more.

    \b
    Examples:
      deepinfer cache prune --max-size 5G --max-age 14d
      deepinfer cache prune --url s3://ci-cache/deepinfer --max-age 30d
    """
    if max_size is None and max_age is None:
        raise click.UsageError("give --max-size and/or --max-age")
    if url and max_size:
        raise click.UsageError("--max-size is for the local directory; prune the store (--url) by --max-age")
    size = parse_amount(max_size, UNITS, "size", "2G or 500M") if max_size else None
    age = parse_amount(max_age, AGES, "duration", "7d or 12h") if max_age else None
    store = open_store(url, endpoint)
    if store is not None:
        import time

        from deepinfer.compiler.cache import KINDS

        assert age is not None
        gone = store.prune(KINDS, age, time.time())
        for e in gone:
            click.echo(f"removed {e.kind} {e.key[:16]} from {store.url}")
        click.echo(f"removed {len(gone)} entries; {len(list(store.entries(KINDS)))} left in {store.url}")
        return
    cache = open_cache(cache_dir)
    removed = cache.prune(max_size=size, max_age=age)
    for e in removed:
        click.echo(f"removed {e.kind} {e.key[:16]} {e.meta.get('identity', '?')}")
    click.echo(f"removed {len(removed)} entries; {len(cache.entries())} left in {cache.dir}")


@cache_group.command("verify")
@cache_dir_option
@store_options(required=False)
@user_errors
def cache_verify(cache_dir, url, endpoint):
    """Re-hash every entry; remove corrupt ones (exit status 1 if any were found).

    With --url, verify the store: every entry's object is downloaded and re-hashed; a corrupt
    entry's meta.json is deleted (and its object, where its bytes do not match its name).

    \b
    Examples:
      deepinfer cache verify
      deepinfer cache verify --url s3://ci-cache/deepinfer
    """
    store = open_store(url, endpoint)
    if store is not None:
        import tempfile

        from deepinfer.compiler.cache import KINDS

        with tempfile.TemporaryDirectory() as scratch:
            n, bad = store.verify(KINDS, Path(scratch))
        for e, why in bad:
            click.echo(f"corrupt {e.kind} {e.key[:16]}: {why} (removed from the store)")
        click.echo(f"{n - len(bad)} of {n} entries intact in {store.url}")
        sys.exit(1 if bad else 0)
    cache = open_cache(cache_dir)
    n = len(cache.entries())
    bad = cache.verify()
    for e, why in bad:
        click.echo(f"corrupt {e.kind} {e.key[:16]} {e.meta.get('identity', '?')}: {why} (removed)")
    click.echo(f"{n - len(bad)} of {n} entries intact in {cache.dir}")
    if bad:
        sys.exit(1)


@cache_group.command("explain")
@click.argument("key_a")
@click.argument("key_b")
@cache_dir_option
@store_options(required=False)
@user_errors
def cache_explain(key_a, key_b, cache_dir, url, endpoint):
    """Compare two cache keys part by part (keys, unique key prefixes, or meta.json paths);
    with --url, a key not in the local directory is looked up in the store.

    \b
    Examples:
      deepinfer cache explain 3f2a9c01 7be41d55
      deepinfer cache explain 3f2a9c01 7be41d55 --url s3://ci-cache/deepinfer
    """
    from deepinfer.compiler.cache import KINDS, CacheError

    cache = open_cache(cache_dir)
    store = open_store(url, endpoint)

    def meta(ref: str) -> dict:
        if Path(ref).is_file():
            return _explainable(load_json(Path(ref), error=CacheError), ref)
        entry = cache.find(ref)
        if entry is not None:
            return _explainable(entry.meta, ref)
        found = store.find(ref, KINDS) if store is not None else None
        if found is None:
            where = f"{cache.dir}" + (f" or {store.url}" if store is not None else "")
            raise CacheError(
                f"{ref}: no single entry with this key in {where} (give 8+ characters "
                "of a key from `deepinfer cache ls`, or a meta.json path)"
            )
        return _explainable(found[1], ref)

    a, b = meta(key_a), meta(key_b)
    click.echo(f"A {a.get('kind')} {a.get('identity')} {a.get('key', '')[:16]}")
    click.echo(f"B {b.get('kind')} {b.get('identity')} {b.get('key', '')[:16]}")
    pa = {p["name"]: p for p in a.get("parts", [])}
    pb = {p["name"]: p for p in b.get("parts", [])}
    names = list(pa) + [n for n in pb if n not in pa]
    for name in names:
        ha, hb = pa.get(name, {}).get("hash", "-"), pb.get(name, {}).get("hash", "-")
        click.echo(f"  {name:<10} {ha[:16]:<16} {hb[:16]:<16} {'same' if ha == hb else 'DIFFERS'}")
        va, vb = pa.get(name, {}).get("value"), pb.get(name, {}).get("value")
        if ha != hb and isinstance(va, dict) and isinstance(vb, dict):
            for k in sorted(set(va) | set(vb)):
                if va.get(k) != vb.get(k):
                    click.echo(f"    {k}: {va.get(k)!r} -> {vb.get(k)!r}")


def _copy_options(fn):
    fn = click.option(
        "--bundle",
        type=click.Path(exists=True, file_okay=False, path_type=Path),
        help="Only the entries this bundle was built from (its cache-keys.json).",
    )(fn)
    fn = store_options(required=True)(fn)
    return cache_dir_option(fn)


def _cache_with_store(cache_dir, url, endpoint, **kwargs):
    from deepinfer.compiler.cache import Cache, resolve_dir

    if url is None:
        raise click.UsageError("give --url s3://BUCKET/PREFIX (or set $DEEPINFER_CACHE_URL)")
    log = lambda msg: click.echo(msg, err=True)  # noqa: E731
    return Cache(resolve_dir(cache_dir, None), log=log, remote=open_store(url, endpoint), **kwargs)


@cache_group.command("push")
@_copy_options
@user_errors
def cache_push(cache_dir, url, endpoint, bundle):
    """Publish the local directory's intact entries (all, or a bundle's) to the store; entries
    the store already has are left as they are. A compile with --cache-url publishes what it
    builds itself: push is for entries built without it.

    \b
    Examples:
      deepinfer cache push --url s3://ci-cache/deepinfer
      deepinfer cache push --bundle build/tiny --url s3://ci-cache/deepinfer --endpoint http://minio:9000
    """
    cache = _cache_with_store(cache_dir, url, endpoint)
    wanted = bundle_keys(bundle) if bundle else None
    published, skipped = cache.push(wanted)
    if cache.remote is None:
        sys.exit(1)
    click.echo(f"published {published} entries to {cache.remote_url}; {skipped} already there (or corrupt here)")


@cache_group.command("pull")
@_copy_options
@trust_option
@user_errors
def cache_pull(cache_dir, url, endpoint, bundle, trust):
    """Install the store's entries (all, or a bundle's) in the local directory, each checked as a
    compile checks it (its digest; its signature under --trust). Before going offline, or to
    warm a runner's disk once for many compiles.

    \b
    Examples:
      deepinfer cache pull --url s3://ci-cache/deepinfer
      deepinfer cache pull --bundle build/tiny --url s3://ci-cache/deepinfer --trust ci.pem.pub
    """
    cache = _cache_with_store(cache_dir, url, endpoint, trust=trusted_key(trust))
    wanted = bundle_keys(bundle) if bundle else None
    installed, skipped = cache.pull(wanted)
    if cache.remote is None:
        sys.exit(1)
    click.echo(
        f"pulled {installed} entries from {cache.remote_url} into {cache.dir}; {skipped} already here or refused"
    )
    if wanted is not None and installed + skipped < len(wanted):
        click.echo(f"{len(wanted) - installed - skipped} of the bundle's {len(wanted)} entries are not in the store")


@main.command("keygen")
@click.argument("private_key", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("public_key", type=click.Path(dir_okay=False, path_type=Path), required=False)
@user_errors
def keygen_cmd(private_key: Path, public_key: Path | None):
    """Make an Ed25519 key pair for signing bundles: PRIVATE_KEY (PEM, mode 0600) and PUBLIC_KEY
    (PEM; default: PRIVATE_KEY with .pub appended). The same keys as `openssl genpkey -algorithm
    ed25519` and `openssl pkey -pubout` make.

    \b
    Example:
      deepinfer keygen ci-signing.pem                     # and ci-signing.pem.pub
      deepinfer-compile model.toml -o build/m --sign ci-signing.pem
      deepinfer-run build/m --trust ci-signing.pem.pub --prompt "Hello"
    """
    from deepinfer.bundles.signing import keygen

    public_key = public_key or private_key.with_name(private_key.name + ".pub")
    kid = keygen(private_key, public_key)
    click.echo(f"wrote {private_key} (private, keep it secret) and {public_key} (public); key id {kid}")


def _add_tools() -> None:
    """`deepinfer compile`, `deepinfer run` and `deepinfer serve`: the sub-CLIs, under the umbrella too."""
    from deepinfer.compiler.cli import main as compile_main
    from deepinfer.runtime.cli import main as run_main
    from deepinfer.runtime.serving.cli import main as serve_main

    main.add_command(compile_main, "compile")
    main.add_command(run_main, "run")
    main.add_command(serve_main, "serve")


_add_tools()


if __name__ == "__main__":
    main()
