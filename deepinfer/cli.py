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
    prompts_from,
    trust_option,
    trusted_key,
    user_errors,
)


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
    """The commands of their own modules (cache, compare, doctor, noise-floor, plan, reference), and
    `deepinfer compile`, `deepinfer run` and `deepinfer serve`: the sub-CLIs, under the umbrella too."""
    from deepinfer.cache_cli import cache_group
    from deepinfer.compare_cli import compare_cmd, noise_floor_cmd, reference_cmd
    from deepinfer.compiler.cli import main as compile_main
    from deepinfer.doctor_cli import doctor_cmd
    from deepinfer.plan_cli import plan_cmd
    from deepinfer.runtime.cli import main as run_main
    from deepinfer.runtime.serving.cli import main as serve_main

    main.add_command(cache_group, "cache")
    main.add_command(compare_cmd, "compare")
    main.add_command(doctor_cmd, "doctor")
    main.add_command(noise_floor_cmd, "noise-floor")
    main.add_command(plan_cmd, "plan")
    main.add_command(reference_cmd, "reference")
    main.add_command(compile_main, "compile")
    main.add_command(run_main, "run")
    main.add_command(serve_main, "serve")


_add_tools()


if __name__ == "__main__":
    main()
