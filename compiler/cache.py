"""The content-addressed artifact cache: entries, verification, locks, listing, pruning.

    <dir>/v1/
      <kind>/<key[:2]>/<key>/artifact     the cached file (executable, weights, trace record)
      <kind>/<key[:2]>/<key>/meta.json    key, identity, parts and their hashes, digest, size
      <kind>/<key[:2]>/<key>/signature.json   with a signing key: Ed25519 over meta.json
      locks/<kind>-<key>.lock             flock: one process builds a given entry at a time
      tmp/                                entries being written (renamed into place when whole)
      files/                              memo of checkpoint tensor digests by file stat

An entry is written whole in `tmp/` (artifact first, meta.json last) and
renamed into place, so an interrupted write never leaves an entry. Every hit
re-verifies the artifact's digest on the copy it hands out: a corrupt entry is
reported, removed and treated as a miss. Entries are never modified in place;
a hit only touches meta.json's mtime (last use, for `prune`).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from deepinfer.bundles.manifest import sha256_file
from deepinfer.bundles.signing import TrustError, sign_bytes, verify_bytes
from deepinfer.compiler.keys import CACHE_VERSION, Key
from deepinfer.errors import DeepinferError

ENV_DIR = "DEEPINFER_CACHE_DIR"
ARTIFACT = "artifact"
META = "meta.json"
SIGNATURE = "signature.json"
KINDS = ("executable", "trace", "weights", "host")


class CacheError(DeepinferError):
    """A cache miss under --require-cache, or a bad cache setting."""


def default_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "deepinfer"


def resolve_dir(cli_dir: Path | None, config_dir: Path | None) -> Path:
    """--cache-dir > $DEEPINFER_CACHE_DIR > model.toml [cache] dir > the user cache dir."""
    if cli_dir is not None:
        return Path(cli_dir)
    if os.environ.get(ENV_DIR):
        return Path(os.environ[ENV_DIR])
    return Path(config_dir) if config_dir is not None else default_dir()


def _fsync_write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


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


class _NoLock:
    """What `Cache.lock` hands out when the cache cannot be written: nothing to hold."""

    held = True

    def release(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


class Cache:
    """A cache that cannot be written (full disk, read-only directory, a file in the way) is
    used read-only with one warning: it never fails a compile.

    With `sign` (an Ed25519 private key), every entry stored gets a signature of its meta.json
    (which holds the artifact's digest); with `trust` (a public key), an entry is used only when
    that signature verifies, and is otherwise removed and rebuilt (`bundles.signing`)."""

    def __init__(self, directory: Path, log=lambda msg: None, *, sign=None, trust=None):
        self.dir = Path(directory)
        self.root = self.dir / f"v{CACHE_VERSION}"
        self.log = log
        self.sign, self.trust = sign, trust
        # what this process asked of the cache: (kind, identity or key) of each hit, miss, corrupt
        # entry removed and entry stored (what a compile built is its own report: compile_bundle's)
        self.stats: dict[str, list[tuple[str, str]]] = {"hit": [], "miss": [], "corrupt": [], "stored": []}
        self.read_only = False

    def _cannot_write(self, e: OSError) -> None:
        """Stop writing to the cache, with one warning naming the directory and why."""
        if not self.read_only:
            self.read_only = True
            self.log(
                f"warning: cache {self.dir}: cannot write ({e.strerror or e}); this compile goes on "
                "without storing to the cache"
            )

    # --- paths ---
    def entry_dir(self, kind: str, key: str) -> Path:
        return self.root / kind / key[:2] / key

    def lock(self, kind: str, key: Key | str, blocking: bool = True) -> Lock | _NoLock:
        digest = key.digest if isinstance(key, Key) else key
        if not self.read_only:
            try:
                return Lock(self.root / "locks" / f"{kind}-{digest}.lock", blocking)
            except OSError as e:
                self._cannot_write(e)
        return _NoLock()

    # --- reading ---
    def lookup(self, kind: str, key: Key | str) -> Entry | None:
        """The entry if present and whole (not verified: `get_*` verify what they hand out)."""
        digest = key.digest if isinstance(key, Key) else key
        path = self.entry_dir(kind, digest)
        try:
            raw = (path / META).read_bytes()
            meta = json.loads(raw)
        except (OSError, ValueError):
            if path.exists():
                self._corrupt(Entry(kind, digest, path, {}), "unreadable meta.json")
            return None
        if self.trust is not None:
            try:
                verify_bytes(raw, path / SIGNATURE, self.trust)
            except TrustError as e:
                self._corrupt(
                    Entry(kind, digest, path, meta if isinstance(meta, dict) else {}),
                    f"not signed by the trusted key: {e}",
                )
                return None
        if not isinstance(meta, dict) or meta.get("key") != digest or not (path / ARTIFACT).is_file():
            self._corrupt(Entry(kind, digest, path, meta if isinstance(meta, dict) else {}), "incomplete entry")
            return None
        return Entry(kind, digest, path, meta)

    def get_file(self, kind: str, key: Key | str, dest: Path) -> bool:
        """Copy the entry's artifact to `dest` and verify the copy; False on a miss."""
        entry = self.lookup(kind, key)
        if entry is None:
            return self._miss(kind, key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
        try:
            shutil.copyfile(entry.artifact, tmp)
        except OSError:
            tmp.unlink(missing_ok=True)
            return self._miss(kind, key)
        if sha256_file(tmp) != entry.meta.get("digest"):
            tmp.unlink()
            self._corrupt(entry, "digest mismatch")
            return self._miss(kind, key)
        os.replace(tmp, dest)
        return self._hit(entry, key)

    def get_bytes(self, kind: str, key: Key) -> bytes | None:
        entry = self.lookup(kind, key)
        if entry is None:
            self._miss(kind, key)
            return None
        data = entry.artifact.read_bytes()
        if "sha256:" + hashlib.sha256(data).hexdigest() != entry.meta.get("digest"):
            self._corrupt(entry, "digest mismatch")
            self._miss(kind, key)
            return None
        self._hit(entry, key)
        return data

    def _hit(self, entry: Entry, key: Key | str) -> bool:
        try:
            os.utime(entry.path / META)  # last use, for prune
        except OSError:
            pass
        self.stats["hit"].append((entry.kind, entry.meta.get("identity", entry.key)))
        return True

    def _miss(self, kind: str, key: Key | str) -> bool:
        self.stats["miss"].append((kind, key.identity if isinstance(key, Key) else key))
        return False

    def _corrupt(self, entry: Entry, why: str) -> None:
        self.log(
            f"cache: {entry.kind} entry {entry.key[:16]} ({entry.meta.get('identity', '?')}) is corrupt "
            f"({why}); removing it, it will be rebuilt"
        )
        self.stats["corrupt"].append((entry.kind, entry.key))
        self.remove(entry.path)

    # --- writing ---
    def put_file(self, kind: str, key: Key, src: Path) -> None:
        self._put(kind, key, lambda dst: shutil.copyfile(src, dst))

    def put_bytes(self, kind: str, key: Key, data: bytes) -> None:
        self._put(kind, key, lambda dst: _fsync_write(dst, data))

    def _put(self, kind: str, key: Key, write) -> None:
        """Write the entry whole in tmp/, then rename it into place (an intact entry already
        there, written by another compile, is kept). A write that fails makes the cache read-only."""
        if self.read_only:
            return
        try:
            self._write_entry(kind, key, write)
        except OSError as e:
            self._cannot_write(e)

    def _write_entry(self, kind: str, key: Key, write) -> None:
        final = self.entry_dir(kind, key.digest)
        (self.root / "tmp").mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f"{kind}-{key.digest[:16]}-", dir=self.root / "tmp"))
        try:
            write(tmp / ARTIFACT)
            with open(tmp / ARTIFACT, "rb") as f:
                os.fsync(f.fileno())
            meta = {
                "cache_version": CACHE_VERSION,
                "kind": kind,
                "key": key.digest,
                "identity": key.identity,
                "digest": sha256_file(tmp / ARTIFACT),
                "size": (tmp / ARTIFACT).stat().st_size,
                "created": time.time(),
                "parts": key.describe(),
            }
            raw = (json.dumps(meta, indent=1) + "\n").encode()
            if self.sign is not None:
                _fsync_write(tmp / SIGNATURE, (json.dumps(sign_bytes(raw, self.sign)) + "\n").encode())
            _fsync_write(tmp / META, raw)
            final.parent.mkdir(parents=True, exist_ok=True)
            if final.exists() and self.lookup(kind, key.digest) is not None:
                return  # another compile stored it first
            try:
                os.replace(tmp, final)
            except OSError:  # appeared meanwhile (non-empty dir)
                return
            self.stats["stored"].append((kind, key.identity))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def remove(self, path: Path) -> None:
        """Take an entry out of its place atomically, then delete it."""
        try:
            (self.root / "tmp").mkdir(parents=True, exist_ok=True)
            trash = Path(tempfile.mkdtemp(prefix="removed-", dir=self.root / "tmp"))
        except OSError as e:
            self._cannot_write(e)
            return
        try:
            os.replace(path, trash / "entry")
        except OSError:
            pass
        shutil.rmtree(trash, ignore_errors=True)

    # --- listing, verifying, pruning ---
    def entries(self, kinds=KINDS) -> list[Entry]:
        out = []
        for kind in kinds:
            for meta in sorted((self.root / kind).glob(f"*/*/{META}")):
                try:
                    data = json.loads(meta.read_text())
                except (OSError, ValueError):
                    data = {}
                out.append(Entry(kind, meta.parent.name, meta.parent, data))
        return out

    def find(self, key: str) -> Entry | None:
        """An entry of any kind by its key (or a unique prefix of at least 8 characters)."""
        if len(key) < 8:
            return None
        found = [p for kind in KINDS for p in (self.root / kind / key[:2]).glob(f"{key}*")]
        if len(found) != 1:
            return None
        try:
            meta = json.loads((found[0] / META).read_text())
        except (OSError, ValueError):
            meta = {}
        return Entry(found[0].parent.parent.name, found[0].name, found[0], meta)

    def closest(self, kind: str, identity: str) -> Entry | None:
        """The most recently used entry of `kind` built for the same `identity` (explains a miss)."""
        same = [e for e in self.entries((kind,)) if e.meta.get("identity") == identity]
        return max(same, key=lambda e: e.last_used, default=None)

    def verify(self) -> list[tuple[Entry, str]]:
        """Re-hash every entry; remove and return the corrupt ones with the reason."""
        bad = []
        for e in self.entries():
            if e.meta.get("key") != e.key:
                why = "unreadable or mismatched meta.json"
            elif not e.artifact.is_file():
                why = "missing artifact"
            elif sha256_file(e.artifact) != e.meta.get("digest"):
                why = "digest mismatch"
            else:
                continue
            bad.append((e, why))
            self.remove(e.path)
        return bad

    def size(self, e: Entry) -> int:
        return sum(p.stat().st_size for p in e.path.iterdir() if p.is_file())

    def prune(self, max_size: int | None = None, max_age: float | None = None, now: float | None = None) -> list[Entry]:
        """Remove entries unused for `max_age` seconds, then least recently used ones until
        the total is at most `max_size` bytes; also stale tmp/ and unheld lock files."""
        now = time.time() if now is None else now
        entries = sorted(self.entries(), key=lambda e: e.last_used)
        removed = []
        if max_age is not None:
            for e in [e for e in entries if now - e.last_used > max_age]:
                removed.append(e)
                self.remove(e.path)
            entries = [e for e in entries if e not in removed]
        if max_size is not None:
            sizes = {e.key: self.size(e) for e in entries}
            total = sum(sizes.values())
            for e in entries:
                if total <= max_size:
                    break
                total -= sizes[e.key]
                removed.append(e)
                self.remove(e.path)
        if max_age is not None:
            for memo in (self.root / "files").glob("*.json"):
                if now - memo.stat().st_mtime > max_age:  # tensor digests of files not seen lately
                    memo.unlink(missing_ok=True)
        for t in (self.root / "tmp").glob("*") if (self.root / "tmp").exists() else []:
            if now - t.stat().st_mtime > 3600:  # an interrupted write from over an hour ago
                shutil.rmtree(t, ignore_errors=True)
        for lock in (self.root / "locks").glob("*.lock") if (self.root / "locks").exists() else []:
            kind, _, digest = lock.stem.partition("-")
            held = Lock(lock, blocking=False)
            if held.held and not self.entry_dir(kind, digest).exists():
                lock.unlink(missing_ok=True)
            held.release()
        return removed
