"""A bundle replaced (renamed over, as `deepinfer-compile --force` does) while it loads is refused,
never run as a mix of two bundles' files."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from deepinfer.bundles.manifest import BundleError
from deepinfer.runtime import bundle as rb
from deepinfer.runtime import loading as rs


def _bundle(path):
    manifest = SimpleNamespace(topology=SimpleNamespace(world_size=1))
    return rb.Bundle(path, manifest, config=None, identity=rb._identity(path))


def _replace(path):
    new = path.with_name(path.name + ".new")
    new.mkdir()
    old = path.with_name(path.name + ".old")
    os.replace(path, old)
    os.replace(new, path)


def test_load_refuses_a_bundle_replaced_while_loading(tmp_path, monkeypatch):
    path = tmp_path / "bundle"
    path.mkdir()
    bundle = _bundle(path)
    monkeypatch.setattr(rs, "_load", lambda b, *args: _replace(b.path))  # the swap lands mid-load
    with pytest.raises(BundleError, match="replaced while it was being loaded"):
        rs.load(bundle)


def test_load_accepts_an_unchanged_bundle(tmp_path, monkeypatch):
    path = tmp_path / "bundle"
    path.mkdir()
    monkeypatch.setattr(rs, "_load", lambda b, *args: "loaded")
    assert rs.load(_bundle(path)) == "loaded"
