"""A cache entry on disk, its lock, and reading what records the cache's keys: meta.json and a bundle's
cache-keys.json.

<kind>/<key[:2]>/<key>/artifact          the cached file (executable, weights, trace record)
<kind>/<key[:2]>/<key>/meta.json         key, identity, parts and their hashes, digest, size
<kind>/<key[:2]>/<key>/signature.json    with a signing key: Ed25519 over meta.json
"""

from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deepinfer.bundles.layout import CACHE_KEYS_FILE
from deepinfer.errors import DeepinferError
from deepinfer.reader import CAP_MANIFEST, CAP_SMALL, ReadError, load_json, parse_json, read_bytes

ARTIFACT = "artifact"
META = "meta.json"
SIGNATURE = "signature.json"


class CacheError(DeepinferError):
    """A cache miss under --require-cache, or a bad cache setting."""


@dataclass
class Entry:
    kind: str
    key: str
    path: Path
    meta: dict

    @property
    def artifact(self) -> Path:
        return self.path / ARTIFACT

    @property
    def last_used(self) -> float:
        return (self.path / META).stat().st_mtime


class Lock:
    """An exclusive flock on one entry's lock file (released on close or process death)."""

    def __init__(self, path: Path, blocking: bool):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
            self.held = True
        except BlockingIOError:
            self.held = False
            os.close(self.fd)

    def release(self) -> None:
        if self.held:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.held = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


class NoLock:
    """What `Cache.lock` hands out when the cache cannot be written: nothing to hold."""

    held = True

    def release(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


def parse_meta(raw: bytes, kind: str, digest: str, where: str = META) -> dict | None:
    """An entry's meta.json, or None where it is not one for (kind, digest): unreadable, or a
    value of the wrong type (it names the entry, holds its artifact's digest and size)."""
    try:
        meta = parse_json(raw, where)
    except ReadError:
        return None
    return meta if meta_problem(meta, kind, digest) is None else None


def meta_problem(meta, kind: str, digest: str) -> str | None:
    """What is wrong with the parsed meta.json of entry (kind, digest), or None."""
    if not isinstance(meta, dict):
        return "meta.json is not a JSON object"
    if meta.get("key") != digest or meta.get("kind") != kind:
        return "meta.json names another entry"
    d, size = meta.get("digest"), meta.get("size")
    if not isinstance(d, str) or not d.startswith("sha256:"):
        return "meta.json has no sha256 digest"
    if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 0):
        return "meta.json's size is not a byte count"
    parts = meta.get("parts", [])
    if not isinstance(meta.get("identity", ""), str) or not (
        isinstance(parts, list)
        and all(
            isinstance(p, dict) and isinstance(p.get("name"), str) and isinstance(p.get("hash"), str) for p in parts
        )
    ):
        return "meta.json's identity or parts are of the wrong type"
    return None


def read_meta(path: Path) -> tuple[bytes, Any]:
    """The bytes and JSON value of an entry's meta.json at `path` (a regular file inside its entry,
    under a size cap: a link to /dev/zero is refused before a byte is read). ReadError otherwise."""
    raw = read_bytes(path, CAP_SMALL, root=path.parent)
    return raw, parse_json(raw, str(path))


def explainable(meta, ref: str) -> dict:
    """A cache entry's meta.json value checked for what `deepinfer cache explain` reads (CacheError if not)."""
    parts = meta.get("parts", []) if isinstance(meta, dict) else None
    if not (
        isinstance(meta, dict)
        and all(isinstance(meta.get(k, ""), str) for k in ("kind", "identity", "key"))
        and isinstance(parts, list)
        and all(
            isinstance(p, dict) and isinstance(p.get("name"), str) and isinstance(p.get("hash"), str) for p in parts
        )
    ):
        raise CacheError(f"{ref}: not a cache entry's meta.json (kind, identity, key, parts of name and hash)")
    return meta


def bundle_keys(bundle: Path) -> set[tuple[str, str]]:
    """The (kind, key) pairs a bundle records it was built from (bundles/layout.CACHE_KEYS_FILE)."""
    path = bundle / CACHE_KEYS_FILE
    if not path.exists() and not path.is_symlink():
        raise CacheError(
            f"{path}: missing; the bundle was compiled without a cache, or by a deepinfer "
            "that did not record its cache keys (recompile it with a cache)"
        )
    data = load_json(path, CAP_MANIFEST, root=bundle, error=CacheError)
    entries = data.get("entries") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not all(
        isinstance(e, dict) and isinstance(e.get("kind"), str) and isinstance(e.get("key"), str) for e in entries
    ):
        raise CacheError(f'{path}: expected {{"entries": [{{"kind": str, "key": str}}, ...]}}')
    return {(e["kind"], e["key"]) for e in entries}
