"""The released dimensions end to end (issue 15 item 3): compile, run, reference and compare.

The checkpoint is `make-tiny --geometry release`'s (hidden 5120, 64 heads of 512, vocab
129,280, every region kind of the release in 7 layers) with 6 routed experts, the fewest the
release's top-6 routing admits (5.5 GiB). The bundle is exported fp32 with one bucket; its
logits must agree with the reference's within the noise floor that `deepinfer compare` measures
on this checkpoint. A two-token prompt (bos, "H") and one generated token keep the forwards
through all 7 layers to 7 (the bundle's two steps, the reference's one, the floor's four); on
2 cores the test took 193 s alone (bench/release_geometry.py times every step, AOTInductor and bf16
included, at 8 experts).
"""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from deepinfer.cli import main
from tests.conftest import write_model_toml

pytestmark = pytest.mark.slow
NEEDS_DISK = 14 << 30  # the 5.5 GiB checkpoint, the bundle's 5.5 GiB of weights, its staging


def invoke(*args: str) -> str:
    """Run `deepinfer ARGS`; its stdout (progress and notes go to stderr)."""
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    assert result.exit_code == 0, f"deepinfer {' '.join(args)}: exit {result.exit_code}\n{result.output}"
    return result.stdout


def test_release_geometry_bundle_agrees_with_the_reference(tmp_path):
    from deepinfer.regions.synthetic import release_geometry_config, write_synthetic

    free = shutil.disk_usage(tmp_path).free
    if free < NEEDS_DISK:
        pytest.skip(f"needs {NEEDS_DISK >> 30} GiB free under {tmp_path.parent}, has {free / 2**30:.1f} GiB")
    ckpt = tmp_path / "ckpt"
    write_synthetic(ckpt, release_geometry_config(experts=6), seed=0)
    toml = write_model_toml(
        tmp_path / "model", ckpt, cache_quant=False, executable="exported", max_context=64, num_blocks=5
    )
    bundle = tmp_path / "bundle"
    invoke("compile", str(toml), "-o", str(bundle), "--no-cache", "--jobs", "2")
    run, ref = tmp_path / "run.st", tmp_path / "ref.st"
    invoke("run", str(bundle), "--prompt", "H", "--max-new-tokens", "1", "--dump-logits", str(run))
    invoke(
        "reference",
        str(ckpt),
        "--prompt",
        "H",
        "--max-new-tokens",
        "1",
        "--dtype",
        "fp32",
        "--no-cache-quant",
        "--topk-ties",
        "lowest",
        "--dump-logits",
        str(ref),
    )
    report = json.loads(invoke("compare", str(run), str(ref), "--json"))
    assert report["verdict"]["within"], report
    assert report["summary"]["argmax_agreement"] == 1.0, report
    assert [p["compared"] for p in report["prompts"]] == [2], report  # bos and "H"
