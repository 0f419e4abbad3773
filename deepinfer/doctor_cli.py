"""`deepinfer doctor`: parse, run the stages (deepinfer/doctor.py), print their lines or the JSON report."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from deepinfer.cli_common import user_errors
from deepinfer.doctor import DEFAULT_FIGURES, EXIT_FAILED, EXIT_OK, STAGES, Doctor, default_work, report_json, run


@click.command("doctor")
@click.option(
    "--json", "as_json", is_flag=True, help="Print the whole report as one JSON object (stage lines go to stderr)."
)
@click.option(
    "--bundle",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="A trn2 bundle to check this host against: its neuronx-cc version, target, LNC, ranks vs cores.",
)
@click.option(
    "--work",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where the tiny bundle, probe NEFFs, logs and XLA:CPU references go "
    "[default: $XDG_CACHE_HOME/deepinfer/doctor, else ~/.cache/deepinfer/doctor].",
)
@click.option(
    "--figures-out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=Path(DEFAULT_FIGURES),
    show_default=True,
    help="The measured figures file (for `deepinfer plan --figures`), written when measurements pass.",
)
@click.option("--runs", type=click.IntRange(min=3), default=20, show_default=True, help="Timed runs per median.")
@click.option(
    "--hbm-mib", type=click.IntRange(min=1), default=256, show_default=True, help="MiB the HBM read probe reads."
)
@click.option(
    "--only",
    type=click.Choice(STAGES[1:]),
    multiple=True,
    help="Run only this device stage (repeatable; toolchain always runs), e.g. to rerun the one that failed.",
)
@user_errors
def doctor_cmd(
    as_json: bool, bundle: Path | None, work: Path | None, figures_out: Path, runs: int, hbm_mib: int, only: tuple
):
    """Check this host for trn2 bundles, stage by stage, one line each: PASS|FAIL|SKIP <stage>: <reason>.

    \b
    toolchain     neuronx-cc and libnrt versions, devices, NeuronCores, LNC (and --bundle's needs)
    modules       a tiny trn2 bundle by neuronx-cc: one module of each kind on a NeuronCore vs XLA:CPU
    collectives   two-rank all-reduce / all-gather NEFFs (nrt_load_collectives) vs XLA:CPU
    measurements  launch overhead, collective latency by payload, HBM read, host round trip and link;
                  written to --figures-out

    Without the Neuron SDK or a device each stage SKIPs saying what is missing.

    \b
    Exit status: 0 no stage FAILs, 1 a stage FAILs, 2 bad input (an unreadable --bundle).

    \b
    Example (on a Trn2 host; send doctor.json back):
      deepinfer doctor --json > doctor.json
    """
    if bundle is not None:
        from deepinfer.bundles import manifest_io

        manifest_io.read(bundle)  # unreadable: one line, exit 2, before any stage runs
    doctor = Doctor(
        work=(work or default_work()).resolve(),
        bundle=bundle,
        hbm_bytes=hbm_mib << 20,
        runs=runs,
        figures_out=figures_out.resolve(),
        only=tuple(only),
    )
    run(doctor, echo=(lambda line: click.echo(line, err=True)) if as_json else click.echo)
    if as_json:
        click.echo(json.dumps(report_json(doctor, doctor.figures_out if doctor.figures else None)))
    sys.exit(EXIT_FAILED if doctor.failing() else EXIT_OK)
