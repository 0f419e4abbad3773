"""A manifest is validated as a schema, with its cross-references, before anything is loaded
(issue 16, class 4): types, ranges, paths, and the layer table against the model config."""

from __future__ import annotations

import json
import shutil

import pytest

from deepinfer.bundles import manifest as mf
from deepinfer.runtime import backends
from deepinfer.runtime.loading import load


def _moe_swap(m):
    a, b = m["layers"][0]["regions"]["moe"], m["layers"][1]["regions"]["moe"]
    a["index"], b["index"] = b["index"], a["index"]


EDITS = {
    "files is a list": (lambda m: m.update(files=list(m["files"])), "files: expected a table"),
    "region without artifact": (lambda m: m["regions"][0].pop("artifact"), "regions[0]: missing required key"),
    "swapped layer weights": (_moe_swap, "layers[0].regions.moe.index is 1; layer 0 is number 0 of kind moe"),
    "layer kind edited": (
        lambda m: m["layers"][2].update(attn="window"),
        "layers[2].attn is 'window'; the model config gives layer 2 'source'",
    ),
    "2 PB of blocks": (lambda m: m["kv"].update(num_blocks=10**12), "more than this host's"),
    "vision outside": (
        lambda m: m["host"]["vision"].update(path="../../../etc/passwd"),
        "host.vision.path: path '../../../etc/passwd' is not inside the bundle",
    ),
}


@pytest.mark.parametrize("case", EDITS)
def test_edited_manifests_are_refused_before_loading(exported_bundle, tmp_path, monkeypatch, case):
    edit, message = EDITS[case]
    bundle = shutil.copytree(exported_bundle, tmp_path / "bundle")
    path = bundle / "manifest.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))

    def never(*args, **kwargs):
        raise AssertionError("an executable was loaded")

    monkeypatch.setattr(backends.ExportedExecutable, "__init__", never)
    with pytest.raises(mf.BundleError) as e:
        load(bundle)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_manifest_that_is_a_directory(tmp_path):
    (tmp_path / "manifest.json").mkdir()
    with pytest.raises(mf.BundleError, match=r"manifest.json: is not a regular file \(a directory\)"):
        load(tmp_path)
