"""`deepinfer diff`: every region call of a bundle against its eager reference region."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil

import pytest
import torch
from click.testing import CliRunner

from deepinfer.bundles import manifest_io
from deepinfer.cli import main
from deepinfer.diff import diff_bundle, diff_session, table_lines
from deepinfer.regions.agreement import TOLERANCE, compare_tensors
from deepinfer.runtime import load

PROMPTS = [[0, 75, 104, 33]]  # bos "Hi!" (byte ids + 3)


class Scaled(torch.nn.Module):
    """A region executable whose first output (`h`) comes out `factor` times too large."""

    def __init__(self, inner, factor: float):
        super().__init__()
        self.inner, self.factor = inner, factor

    def forward(self, *flat):
        out = list(self.inner(*flat))
        out[0] = out[0] * self.factor
        return tuple(out)


def _example(spec) -> torch.Tensor:
    dtype = getattr(torch, spec.dtype)
    return torch.randn(spec.shape).to(dtype) if dtype.is_floating_point else torch.zeros(spec.shape, dtype=dtype)


def break_kind(bundle, kind: str, factor: float = 1.01) -> None:
    """Re-export every executable of `kind` with its `h` output scaled; digests updated (a valid bundle)."""
    m = manifest_io.read(bundle)
    for r in m.regions:
        if r.kind != kind:
            continue
        path = bundle / r.artifact
        inner = torch.export.load(str(path)).module(check_guards=False)
        ep = torch.export.export(Scaled(inner, factor), tuple(_example(s) for s in r.inputs), strict=False)
        torch.export.save(ep, str(path))
    manifest_io.write(bundle, manifest_io.stamp(bundle, m))


@pytest.fixture
def bundle_copy(exported_bundle, tmp_path):
    return shutil.copytree(exported_bundle, tmp_path / "bundle")


def test_compare_tensors_scores():
    ref = torch.tensor([1.0, -4.0, 2.0])
    assert compare_tensors("h", ref.clone(), ref).score == 0.0
    assert compare_tensors("h", ref + torch.tensor([0.0, 0.4, 0.0]), ref).score == pytest.approx(0.1)
    assert compare_tensors("h", torch.tensor([1.0, float("nan"), 2.0]), ref).score == math.inf
    nan = torch.tensor([float("nan"), 1.0])
    assert compare_tensors("h", nan.clone(), nan).score == 0.0  # NaN where the reference has NaN
    assert compare_tensors("z", torch.ones(2), torch.zeros(2)).score == math.inf
    topk = torch.tensor([[3, 1, -1, -1]])
    d = compare_tensors("topk", torch.tensor([[3, 2, -1, -1]]), topk)
    assert (d.integer, d.mismatches, d.score) == (True, 1, 0.25)


def test_every_kind_agrees(bundle_copy):
    report = diff_bundle(bundle_copy, PROMPTS, max_new_tokens=2)
    m = manifest_io.read(bundle_copy)
    kinds = report.kinds()
    assert {e.kind for e in kinds} == {r.kind for r in m.regions}  # every kind was called
    calls = {e.kind: e.calls for e in kinds}
    assert calls["head"] == 3  # the prompt in two 2-token chunks, then one decode step
    assert calls["moe"] == len(m.layers) * calls["head"]
    assert not report.failing(), "\n".join(table_lines(report))
    assert all(e.score <= TOLERANCE["fp32"] for e in report.layers)


def test_broken_executable_ranked_first(bundle_copy):
    break_kind(bundle_copy, "moe")
    result = CliRunner().invoke(
        main, ["diff", str(bundle_copy), "--prompt-ids", "0,75,104,33", "--max-new-tokens", "2", "--json"]
    )
    assert result.exit_code == 1, result.output
    report = json.loads(result.output)
    first, rest = report["kinds"][0], report["kinds"][1:]
    assert first["kind"] == "moe" and first["worst_output"] == "h"
    assert first["worst_rel_diff"] == pytest.approx(0.01, rel=1e-3)  # exactly the 1.01 scaling
    assert all(e["worst_rel_diff"] <= TOLERANCE["fp32"] for e in rest)
    assert first["worst_rel_diff"] > 100 * max(e["worst_rel_diff"] for e in rest) + 1e-6
    assert report["differ"] == ["moe"]
    assert {e["layer"] for e in report["layers"] if e["kind"] == "moe"} == set(range(6))


def test_state_write_is_checked(exported_bundle):
    """An executable that writes its window state wrongly (outputs right) is found by its state."""
    session = load(exported_bundle, verify=False)
    kind = "attn_window"
    win = [s.name for s in next(e.inputs for e in session.manifest.regions if e.kind == kind)].index("win")
    executables = dict(session.executables)
    for key, exe in session.executables.items():
        if key[0] == kind:

            def wrong(args, exe=exe):
                out = exe(args)
                args[win].add_(0.5)  # the pool view, after the executable wrote it
                return out

            executables[key] = wrong
    session = dataclasses.replace(session, executables=executables)
    report = diff_session(session, PROMPTS, max_new_tokens=1)
    worst = report.kinds()[0]
    assert (worst.kind, worst.output) == (kind, "win (state)")
    assert [e.kind for e in report.failing()] == [kind]
