"""bench/release_modules.py's model holds every layer kind of the release (issue 43 item 5).

The bench lowers one fused trn2 module per release layer kind at the released dimensions; these
tests keep its 8-layer model covering the release's kinds with the release's regions and weight
shapes (planning only, no tensor), and its refusal of a kind the release does not have.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from tests.conftest import ROOT

BENCH = ROOT / "bench"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH))  # the bench imports bench/common.py as `common`
    try:
        spec = importlib.util.spec_from_file_location("release_modules", BENCH / "release_modules.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCH))


def test_the_bench_model_holds_every_release_layer_kind(bench):
    import torch

    from deepinfer.compiler.plan import plan_regions
    from deepinfer.regions.config import parse_config
    from deepinfer.regions.synthetic import release_config

    kinds = bench.release_kinds(8)
    assert kinds == list(plan_regions(parse_config(release_config()).text, torch.bfloat16, True).fused_kinds())
    assert "layer_source_r2_engram" in kinds and len(kinds) == 8


def test_the_seven_layer_geometry_lacks_a_kind_and_is_refused(bench, monkeypatch):
    from deepinfer.regions.synthetic import release_geometry_config

    monkeypatch.setattr(bench, "config", release_geometry_config)
    with pytest.raises(SystemExit) as err:
        bench.release_kinds(8)
    assert "no layer kind layer_source_r2_engram" in str(err.value)


def test_an_unknown_kind_is_refused_in_one_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(BENCH / "release_modules.py"), "--workdir", str(tmp_path / "w"), "--kinds", "layer_nope"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .endswith(
            "--kinds: not a release layer kind: layer_nope (the kinds: layer_window, layer_window_engram, "
            "layer_source_r2, layer_reuse_r2, layer_source_r2_engram, layer_source_r1_cand, layer_reuse_r1, "
            "layer_reindex_r1_cand)"
        )
    )
    assert not (tmp_path / "w").exists()  # refused before anything is written
