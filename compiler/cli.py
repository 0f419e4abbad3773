"""`deepinfer-compile`: parse arguments, resolve defaults, call `compile_bundle` (or `cache_key`, or
`finish_bundle`); `compile_bundle` reports the resolved settings and the summary through the log."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from deepinfer.cli_common import trust_option, trusted_key, user_errors

HELP = """Compile MODEL_TOML into a bundle: one executable per (region kind, method, bucket).

\b
Passes: parse config -> copy tokenizer -> plan regions -> check memory budget -> preprocess
weights (per rank) -> trace (and lower) -> check memory budget with scratch
-> compile -> lay out state -> record cache keys -> write manifest -> publish (atomic rename).
Every layer of a kind and every rank reuse the same executables; the
weights are inputs, stacked layer-major in the bundle.

\b
On trn2, each region is lowered to an XLA HLO module, run on XLA:CPU against
its reference region, and compiled by neuronx-cc into a NEFF. Without
neuronx-cc, --hlo-only writes the bundle up to the NEFFs, and
`deepinfer-compile --finish BUNDLE` completes it where neuronx-cc is.

\b
Examples:
  deepinfer-compile examples/tiny/model.toml -o build/tiny
  deepinfer-compile examples/tiny/model_trn2.toml -o build/tiny-trn2 --hlo-only
  deepinfer-compile --finish build/tiny-trn2 --jobs 8
  deepinfer-compile model.toml -o build/m --cache-url s3://ci-cache/deepinfer --sign ci.pem
  deepinfer-compile model.toml -o build/m --cache-url s3://ci-cache/deepinfer --require-cache --trust ci.pem.pub
"""


@click.command(help=HELP, context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("model_toml", type=click.Path(path_type=Path), required=False)
@click.option(
    "-o",
    "--output",
    type=click.Path(file_okay=False, path_type=Path),
    help="Bundle directory to write (default: build/<name of MODEL_TOML's folder>).",
)
@click.option(
    "--jobs", "-j", type=int, default=1, show_default=True, help="Compile executables in N parallel worker processes."
)
@click.option(
    "--force",
    is_flag=True,
    help="Replace an existing bundle (or an empty directory) at the output path; anything else there is refused.",
)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary on stdout when done.")
@click.option(
    "--cache-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Artifact cache directory (default: $DEEPINFER_CACHE_DIR, else model.toml [cache] dir, "
    "else ~/.cache/deepinfer, under $XDG_CACHE_HOME when set).",
)
@click.option(
    "--cache-url",
    metavar="s3://BUCKET/PREFIX",
    help="Remote tier of the cache, shared between machines: a local miss is looked up there, and what "
    "this compile builds is published there (default: $DEEPINFER_CACHE_URL, else model.toml [cache] url). "
    "Needs `pip install 'deepinfer[s3]'`; credentials from the AWS chain (env, ~/.aws, instance role).",
)
@click.option(
    "--cache-endpoint",
    metavar="URL",
    help="S3-compatible server of --cache-url, e.g. http://minio:9000 (default: $AWS_ENDPOINT_URL, "
    "else model.toml [cache] endpoint, else AWS).",
)
@click.option("--no-cache", is_flag=True, help="Neither read nor write the artifact cache (local or remote).")
@click.option(
    "--print-cache-key",
    is_flag=True,
    help="Print one key for the whole bundle (for CI cache systems) and exit without compiling.",
)
@click.option(
    "--require-cache",
    is_flag=True,
    help="Fail if any executable or weight stack is not in the cache (names the region and why).",
)
@click.option("-v", "--verbose", is_flag=True, help="Debug output: the hash of every part of each missed key.")
@click.option(
    "--hlo-only",
    is_flag=True,
    help="trn2: stop after lowering and checking every region; write an HLO-stage bundle "
    "that --finish completes on any host with neuronx-cc.",
)
@click.option(
    "--finish",
    "finish",
    type=click.Path(file_okay=False, path_type=Path),
    metavar="BUNDLE",
    help="Compile the HLO modules of an HLO-stage trn2 BUNDLE into NEFFs (no MODEL_TOML).",
)
@click.option(
    "--sign",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    metavar="KEY",
    help="Ed25519 private key (PEM): sign the bundle's manifest (signature.json) and the cache entries "
    "this compile stores. `deepinfer keygen` or `openssl genpkey -algorithm ed25519` makes one.",
)
@click.option(
    "--ray",
    metavar="auto|ADDRESS",
    help="Run the compile jobs as tasks on a Ray cluster: auto (the cluster this node belongs to) or the "
    "HOST:PORT `ray start --head` printed. Needs `pip install 'deepinfer[farm]'` (docs/cache.md).",
)
@click.option(
    "--figures",
    type=click.Path(path_type=Path),
    metavar="FILE",
    help="trn2: after the compile, print its decode step modelled with the figures a Trn2 host measured "
    '(`deepinfer doctor` writes them; `deepinfer plan --figures`); --json adds it as "step_cost". '
    "Figures change no executable: they are in no cache key.",
)
@trust_option
@user_errors
def main(
    model_toml: Path | None,
    output: Path | None,
    jobs: int,
    force: bool,
    as_json: bool,
    cache_dir: Path | None,
    cache_url: str | None,
    cache_endpoint: str | None,
    no_cache: bool,
    print_cache_key: bool,
    require_cache: bool,
    verbose: bool,
    hlo_only: bool,
    finish: Path | None,
    sign: Path | None,
    trust: Path | None,
    ray: str | None,
    figures: Path | None,
) -> None:
    """Parse, resolve defaults, call `compile_bundle` (or `finish_bundle`, or `cache_key`); the help is HELP."""
    from deepinfer.compiler.config import load_compile_config
    from deepinfer.compiler.pipeline import cache_key, compile_bundle

    if (model_toml is None) == (finish is None):
        raise click.UsageError("give MODEL_TOML, or --finish BUNDLE (not both)")
    if finish is not None and figures is not None:
        raise click.UsageError(
            "--figures models a compile of MODEL_TOML; --finish BUNDLE does not model (drop --figures)"
        )
    signing_key = _signing_key(sign)
    if finish is not None:
        _finish(finish, jobs, ray, signing_key)
        return
    assert model_toml is not None  # one of the two, checked above
    cfg = load_compile_config(model_toml)
    measured = _measured(cfg, figures)  # a bad file is refused before anything is built
    if no_cache and (require_cache or cache_dir or cache_url or cache_endpoint):
        raise click.UsageError("--no-cache excludes --require-cache, --cache-dir, --cache-url and --cache-endpoint")
    cache = None if no_cache else _cache(cfg, cache_dir, cache_url, cache_endpoint, signing_key, trust)
    if print_cache_key:
        click.echo(cache_key(cfg, cache=cache, log=_log, verbose=verbose, hlo_only=hlo_only).digest)
        return
    report = compile_bundle(
        cfg,
        output or Path("build") / model_toml.resolve().parent.name,
        jobs=jobs,
        force=force,
        log=_log,
        cache=cache,
        require_cache=require_cache,
        verbose=verbose,
        hlo_only=hlo_only,
        sign=signing_key,
        ray=ray,
    )
    summary = {**report.to_json(), **({} if measured is None else {"step_cost": _modelled_step(cfg, measured)})}
    if as_json:
        click.echo(json.dumps(summary))


def _measured(cfg, figures: Path | None):
    """--figures FILE, loaded and checked (None without one); a target without the step model refuses it."""
    if figures is None:
        return None
    from deepinfer.compiler.config import config_error
    from deepinfer.compiler.targets import TARGETS
    from deepinfer.compiler.targets.trn2_figures import load_figures

    measured = load_figures(figures)
    t = cfg.target
    if TARGETS[t.name](t.executable or TARGETS[t.name].EXECUTABLES[0], t.options).step_figures() is None:
        raise config_error(cfg, "target", "name", f"--figures feeds the trn2 decode step model; {t.name} has none")
    return measured


def _modelled_step(cfg, measured) -> dict | None:
    """The compiled model's decode step with the measured figures (compiler/step_cost.py), planned from
    the compile's own config (no scratch: the step model reads none); logged as `deepinfer plan` prints
    it, returned as its JSON."""
    from deepinfer.compiler import step_cost
    from deepinfer.compiler.bundle_plan import plan_bundle

    plan = step_cost.with_measured(plan_bundle(cfg, scratch=False), measured)
    for line in step_cost.lines(plan):
        _log(line)
    return step_cost.report(plan)


def _signing_key(sign: Path | None):
    """--sign's private key, loaded (None without one)."""
    if sign is None:
        return None
    from deepinfer.bundles.signing import load_private_key

    return load_private_key(sign)


def _finish(bundle: Path, jobs: int, ray: str | None, signing_key) -> None:
    """--finish BUNDLE: compile an HLO-stage bundle's modules here."""
    if ray is not None:
        raise click.UsageError("--ray runs a compile's jobs on a cluster; --finish runs here (drop --ray)")
    from deepinfer.compiler.finish import finish_bundle

    finish_bundle(bundle, jobs=jobs, log=_log, sign=signing_key)


def _cache(cfg, cache_dir: Path | None, url: str | None, endpoint: str | None, signing_key, trust: Path | None):
    """The compile's cache: its directory and remote tier by the flags, then the environment, then model.toml."""
    from deepinfer.compiler.cache import default_cache

    return default_cache(
        cfg, directory=cache_dir, url=url, endpoint=endpoint, log=_log, sign=signing_key, trust=trusted_key(trust)
    )


def _log(msg: str) -> None:
    """Progress and messages: on stderr (stdout carries only --json's summary and the key)."""
    click.echo(msg, err=True)


if __name__ == "__main__":
    sys.exit(main())
