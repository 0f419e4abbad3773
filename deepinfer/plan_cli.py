"""`deepinfer plan`: what `deepinfer-compile MODEL_TOML` would build, printed without building it.

Registered on the `deepinfer` group by `deepinfer/cli.py`.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from deepinfer.cache_cli import cache_dir_option
from deepinfer.cli_common import user_errors


@click.command("plan")
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
@click.option(
    "--fallback",
    "fallen",
    multiple=True,
    metavar="LAYER_KIND",
    help="Also show what it costs when neuronx-cc refuses this fused layer kind and the compile runs it per "
    "region (repeat for several): executions per decode step and the modelled step time, with and without.",
)
@cache_dir_option
@click.option("--no-cache", is_flag=True, help="Do not read the compile cache's trace records.")
@click.option(
    "--figures",
    "figures",
    type=click.Path(path_type=Path),
    metavar="FILE",
    help="trn2: the figures a Trn2 host measured (`deepinfer doctor` writes them; docs/trn2.md) in place "
    "of the assumed and published ones in the decode step and prompt models; each is marked measured.",
)
@user_errors
def plan_cmd(model_toml, as_json, no_scratch, kinds, fallen, cache_dir, no_cache, figures):
    """Print what `deepinfer compile MODEL_TOML` would build, reading no tensor data.

    From the checkpoint's config.json and its safetensors headers (or config.json
    alone): the layer plan, region kinds and executables per bucket, weight bytes
    per rank after sharding, the state pools, the memory budget verdict of every
    rank, the bundle's size on disk and the number of compile jobs. Nothing is
    written. Exit status 0 whether or not the ranks fit: the verdict is printed;
    2 for a bad model.toml, checkpoint or --figures file (one line naming it).

    With --figures FILE (trn2), the figures a Trn2 host measured replace the
    target's in the decode step and prompt models; each figure is marked
    measured, published or assumed, in the text and in the JSON's "figures".

    Scratch comes from the trace records of the compile cache (an earlier compile
    of the same file wrote them), else each region kind is
    traced on fake tensors at its largest bucket (about 10 s of CPU a kind at
    release dimensions).

    \b
    Example (the released Flash model at EP = CP = 64 on trn2):
      deepinfer plan examples/release/model.toml
    """
    from deepinfer.compiler.bundle_plan import plan_bundle
    from deepinfer.compiler.cache import open_cache
    from deepinfer.compiler.config import load_compile_config
    from deepinfer.compiler.step_cost import with_measured
    from deepinfer.compiler.targets.trn2_figures import load_figures

    if no_cache and cache_dir:
        raise click.UsageError("--no-cache excludes --cache-dir")
    cfg = load_compile_config(model_toml)
    measured = load_figures(figures) if figures is not None else None  # refused before the plan's work
    log = lambda msg: click.echo(msg, err=True)  # noqa: E731
    cache = None if no_cache else open_cache(cache_dir, cfg.cache.dir, log=log)
    plan = plan_bundle(cfg, scratch=not no_scratch, kinds=kinds or None, cache=cache, log=log)
    if measured is not None:
        plan = with_measured(plan, measured)
    if not fallen:
        click.echo(json.dumps(plan.to_dict(), indent=2) if as_json else "\n".join(plan.lines()))
        return
    from deepinfer.compiler import fallback_cost

    fallback_cost.check_kinds(plan, fallen)
    if as_json:
        click.echo(json.dumps({**plan.to_dict(), "fallback": fallback_cost.report(plan, fallen)}, indent=2))
    else:
        click.echo("\n".join([*plan.lines(), "", *fallback_cost.lines(plan, fallen)]))
