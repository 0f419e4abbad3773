"""`deepinfer-compile --finish BUNDLE`: turn an HLO-stage trn2 bundle into a NEFF bundle.

An HLO-stage bundle (`deepinfer-compile --hlo-only`) holds everything but the
NEFFs: weights, state layout, and one checked HLO module per executable. Any
x86_64 Linux host with neuronx-cc can finish it (no Trn2 needed): each HLO
module is compiled in parallel jobs, the NEFF headers are read into the
manifest, the HLO modules are dropped, and the finished bundle replaces the
old one atomically (built in a temporary sibling, weights hard-linked).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
from pathlib import Path

from deepinfer.bundles import layout, manifest_io
from deepinfer.bundles import manifest as mf
from deepinfer.bundles.signing import sign_file
from deepinfer.compiler.jobs import Job, keep_failed_logs, run_jobs
from deepinfer.compiler.publish import clean_stale, make_staging, publish, stopped_by_signals
from deepinfer.compiler.targets import TARGETS
from deepinfer.compiler.targets.neuronxcc import NeuronRefused
from deepinfer.errors import DeepinferError


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def finish_bundle(bundle: str | Path, *, jobs: int = 1, log=None, sign=None) -> Path:
    """Compile every HLO module of an HLO-stage bundle into a NEFF; returns the bundle path. The
    manifest changes, so a signature of the HLO-stage bundle is dropped; `sign` (an Ed25519
    private key) signs the finished one."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    bundle = Path(bundle)
    manifest = manifest_io.read(bundle)
    manifest_io.check_files(bundle, manifest)
    if manifest.stage != "hlo":
        raise mf.BundleError(f"{bundle}: not an HLO-stage bundle (stage {manifest.stage!r}); nothing to finish")
    t = manifest.target
    target = TARGETS[t.name](t.executable, t.options)
    target.require_compiler()
    clean_stale(bundle.resolve(), log)
    with stopped_by_signals(log):  # SIGTERM or Ctrl-C: the staging directory and the workers go too
        staging = make_staging(bundle.resolve())
        try:
            shutil.copytree(bundle, staging / "b", copy_function=_link_or_copy)
            work = staging / "b"
            job_list = _jobs(manifest, target.suffix, work)

            def progress(done, total, job, seconds):
                log(f"[{done}/{total}] compiled {job.name} ({seconds:.1f} s)")

            try:
                run_jobs([j for _, _, j in job_list], jobs, progress)
            except DeepinferError as err:
                raise keep_failed_logs(_no_fallback(err, manifest), work / layout.LOGS_DIR, bundle) from None
            regions = []
            for e, neff, job in job_list:
                job.lowered.unlink()
                regions.append(
                    dataclasses.replace(e, artifact=neff, **manifest_io.executable_fields(target.describe(work / neff)))
                )
            finished = dataclasses.replace(
                manifest,
                stage="executable",
                regions=tuple(regions),
                toolchain={**manifest.toolchain, "neuronx-cc": target.toolchain()["neuronx-cc"]},
            )
            (work / layout.SIGNATURE_FILE).unlink(missing_ok=True)
            manifest_io.write(work, manifest_io.stamp(work, finished))
            if sign is not None:
                sign_file(work / layout.MANIFEST_FILE, sign, work / layout.SIGNATURE_FILE)
            publish(work, bundle, force=True)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    log(f"finished {bundle}: {len(job_list)} NEFFs")
    return bundle


def _no_fallback(err: DeepinferError, manifest: mf.Manifest) -> DeepinferError:
    """A fused layer module refused: say how to compile that layer kind per region (compiler/fallback.py),
    which finishing cannot (the HLO-stage bundle holds no region modules for it)."""
    fused = {layer.fused for layer in manifest.layers}
    if not isinstance(err, NeuronRefused) or err.region.split(".", 1)[0] not in fused:
        return err
    return err.noted("--finish does not fall back to the layer's regions: compile from model.toml where neuronx-cc is")


def _jobs(manifest: mf.Manifest, suffix: str, work: Path) -> list[tuple[mf.Executable, str, Job]]:
    """Each HLO module's compile job in the staged copy `work` -> (its entry, its NEFF's path, the job)."""
    t = manifest.target
    job_list = []
    for e in manifest.regions:
        ident = (e.kind, e.method, e.bucket.batch, e.bucket.tokens, e.bucket.context)
        neff = layout.executable_path(*ident, suffix)
        job_list.append(
            (
                e,
                neff,
                Job(
                    e.name,
                    work / e.artifact,
                    work / neff,
                    t.name,
                    t.executable,
                    t.options,
                    log=work / layout.log_path(*ident),
                ),
            )
        )
    return job_list
