"""Full and unwritable disks (issue 16, class 8): the output's is one line naming the directory
and the space needed, before or while writing, with nothing left behind; a cache that cannot be
written degrades to no cache with one warning."""

from __future__ import annotations

import errno
import shutil
from collections import namedtuple

import pytest

from deepinfer.compiler import pipeline, stream
from deepinfer.compiler.cache.keys import Key
from deepinfer.compiler.cache.local import Cache
from deepinfer.compiler.config import load_compile_config
from deepinfer.errors import ConfigError


@pytest.fixture
def cfg(tmp_path, tiny_ckpt):
    (tmp_path / "model.toml").write_text(f'[model]\ncheckpoint = "{tiny_ckpt}"\n[target]\nexecutable = "exported"\n')
    return load_compile_config(tmp_path / "model.toml")


def test_no_room_for_the_weights_is_refused_before_writing(tmp_path, cfg, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 30, (1 << 30) - (5 << 20), 5 << 20))
    with pytest.raises(ConfigError, match=r"0\.00 GiB free, the bundle needs about 1\.\d\d GiB") as e:
        pipeline.compile_bundle(cfg, tmp_path / "out", log=lambda m: None, cache=None)
    assert str(e.value).startswith(str(tmp_path)) and "\n" not in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.toml"]


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_a_disk_that_refuses_a_write_is_one_line(tmp_path, cfg, monkeypatch, code):
    def refused(path, offset, data):
        raise OSError(code, {errno.ENOSPC: "No space left on device", errno.EROFS: "Read-only file system"}[code], path)

    monkeypatch.setattr(stream, "pwrite", refused)
    with pytest.raises(ConfigError, match="while writing the bundle for .*out; nothing was published") as e:
        pipeline.compile_bundle(cfg, tmp_path / "out", log=lambda m: None, cache=None)  # written, not fetched
    assert "\n" not in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.toml"]


def test_an_unwritable_cache_degrades_to_no_cache(tmp_path):
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the cache directory would be")
    logged = []
    cache = Cache(blocker, log=logged.append)
    key = Key.of("trace", "a trace", [("part", 1)])
    with cache.lock("trace", key) as lock:
        assert lock.held
        cache.put_bytes("trace", key, b"record")
    cache.put_bytes("trace", key, b"again")
    assert cache.get_bytes("trace", key) is None
    assert cache.read_only and len(logged) == 1
    assert logged[0].startswith(f"warning: cache {blocker}: cannot write") and "without storing" in logged[0]
