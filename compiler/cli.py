"""`deepinfer-compile`: parse arguments, print the resolved settings, call `compile_bundle`."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click

from deepinfer.cli import user_errors


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("model_toml", type=click.Path(dir_okay=False, path_type=Path))
@click.option("-o", "--output", type=click.Path(file_okay=False, path_type=Path),
              help="Bundle directory to write (default: build/<name of MODEL_TOML's folder>).")
@click.option("--jobs", "-j", type=int, default=1, show_default=True,
              help="Compile executables in N parallel worker processes.")
@click.option("--force", is_flag=True, help="Replace an existing bundle at the output path.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary on stdout when done.")
@user_errors
def main(model_toml: Path, output: Path | None, jobs: int, force: bool, as_json: bool):
    """Compile MODEL_TOML into a bundle: one executable per (region kind, method, bucket).

    \b
    Passes: parse config -> plan regions -> preprocess weights -> trace
    -> compile -> lay out state -> write manifest -> publish (atomic rename).
    Every layer of a kind and every rank reuse the same executables; the
    weights are inputs, stacked layer-major in the bundle.

    \b
    Example:
      deepinfer-compile examples/tiny/model.toml -o build/tiny
    """
    from deepinfer.compiler.config import load_compile_config
    from deepinfer.compiler.pipeline import compile_bundle

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(".cache/inductor").resolve()))
    cfg = load_compile_config(model_toml)
    out = output or Path("build") / model_toml.resolve().parent.name
    b, m, t = cfg.buckets, cfg.model, cfg.target
    click.echo(f"compiling {model_toml} -> {out}\n"
               f"  checkpoint {m.checkpoint} ({m.dtype}, cache_quant={str(m.cache_quant).lower()})\n"
               f"  target {t.name} ({t.executable}), buckets batch={list(b.batch)} tokens={list(b.tokens)} "
               f"max_context={b.max_context}, kv block_size={cfg.kv.block_size} num_blocks={cfg.kv.num_blocks}, "
               f"jobs={jobs}", err=True)
    path, timings = compile_bundle(cfg, out, jobs=jobs, force=force)
    total = sum(timings.values())
    click.echo(f"wrote {path} in {total:.1f} s", err=True)
    if as_json:
        manifest = json.loads((path / "manifest.json").read_text())
        click.echo(json.dumps({"bundle": str(path), "seconds": timings, "executables": len(manifest["regions"])}))


if __name__ == "__main__":
    sys.exit(main())
