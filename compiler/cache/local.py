"""The local tier of the content-addressed artifact cache (and `Cache`, which reads through to the
remote tier): entries, verification, locks, listing, pruning.

    <dir>/v1/
      <kind>/<key[:2]>/<key>/...          an entry (entry.py: artifact, meta.json, signature.json)
      locks/<kind>-<key>.lock             flock: one process builds a given entry at a time
      tmp/                                entries being written (renamed into place when whole)
      files/                              memo of checkpoint tensor digests by file stat

An entry is written whole in `tmp/` (artifact first, meta.json last) and
renamed into place, so an interrupted write never leaves an entry. Every hit
re-verifies the artifact's digest on the copy it hands out: a corrupt entry is
reported, removed and treated as a miss. Entries are never modified in place;
a hit only touches meta.json's mtime (last use, for `prune`).

With a remote tier (`remote`, a `remote.Store`), a local miss reads
through the store: its entry is checked (signature under `trust`, the
artifact's digest) and installed locally by the same whole-entry rename; an
entry this process stores locally is then published to the store. A store that
fails is warned about once and left off for the rest of the process.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from deepinfer.bundles.manifest_io import sha256_file
from deepinfer.bundles.signing import TrustError, sign_bytes, verify_bytes
from deepinfer.compiler.cache.entry import (
    ARTIFACT,
    META,
    SIGNATURE,
    Entry,
    Lock,
    NoLock,
    meta_problem,
    parse_meta,
    read_meta,
)
from deepinfer.compiler.cache.keys import CACHE_VERSION, Key
from deepinfer.compiler.cache.remote import Store, StoreUnavailable
from deepinfer.compiler.kill_points import kill_point
from deepinfer.reader import CAP_MANIFEST, CAP_SMALL, ReadError, open_regular, read_bytes

ENV_DIR = "DEEPINFER_CACHE_DIR"
KINDS = ("executable", "trace", "weights", "host")


def _copy_regular(src: Path, root: Path, dest: Path) -> None:
    """Copy the regular file `src` (inside `root`) to `dest` through one descriptor."""
    fd = open_regular(src, root=root)
    with os.fdopen(fd, "rb") as f, open(dest, "wb") as out:
        shutil.copyfileobj(f, out, 1 << 22)


def _reason(e: Exception) -> str:
    """A TrustError's message without the temporary path it names."""
    return str(e).split(": ", 1)[-1]


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
class CacheUse:
    """What one process (a compile, a `deepinfer cache` command) does with its cache: everything about
    a `Cache` that changes while it is used, so that what a compile runs with (`spec.Run`) never does."""

    remote: Store | None  # the remote tier; None once it failed (warned about once), and without one
    read_only: bool = False  # the directory could not be written (warned about once)
    # what this process asked of the cache: (kind, identity or key) of each hit, miss, corrupt
    # entry removed and entry stored (what a compile built is its own report: compile_bundle's).
    # "hit" counts both tiers; "remote" the hits whose entry came from the store (installed
    # locally on the way), "published" the entries this process published to it.
    stats: dict[str, list[tuple[str, str]]] = field(
        default_factory=lambda: {k: [] for k in ("hit", "miss", "corrupt", "stored", "remote", "published")}
    )
    # every entry this process handed out or stored, (kind, key) -> identity: a bundle records
    # them (bundles/layout.CACHE_KEYS_FILE) for `deepinfer cache push/pull --bundle`
    used: dict[tuple[str, str], str] = field(default_factory=dict)
    from_store: set[tuple[str, str]] = field(default_factory=set)  # (kind, key) installed from the store

    def tiers(self) -> dict[str, int]:
        """Entries handed out from the local tier and from the store, and entries published."""
        remote = len(self.stats["remote"])
        return {"local": len(self.stats["hit"]) - remote, "store": remote, "published": len(self.stats["published"])}


def open_cache(
    directory: Path | None,
    config_dir: Path | None = None,
    *,
    log=lambda msg: None,
    remote: Store | None = None,
    sign=None,
    trust=None,
) -> Cache:
    """The cache at `resolve_dir(directory, config_dir)`, reading through `remote` (a `Store`), signing
    what it stores with `sign` and using only entries `trust` verifies."""
    return Cache(resolve_dir(directory, config_dir), log=log, sign=sign, trust=trust, remote=remote)


class Cache:
    """A cache that cannot be written (full disk, read-only directory, a file in the way) is
    used read-only with one warning: it never fails a compile.

    With `sign` (an Ed25519 private key), every entry stored gets a signature of its meta.json
    (which holds the artifact's digest); with `trust` (a public key), an entry is used only when
    that signature verifies, and is otherwise removed and rebuilt (`bundles.signing`).

    With `remote` (a `Store`), a local miss asks the store and an entry stored locally is published
    to it (`remote.py`; docs/cache.md, The remote store).

    Its settings (directory, log, keys, store URL) are fixed when it is made; what using it changes
    (the store turned off, read-only, what was hit, missed, stored and used) is its `use`."""

    def __init__(self, directory: Path, log=lambda msg: None, *, sign=None, trust=None, remote: Store | None = None):
        self.dir = Path(directory)
        self.root = self.dir / f"v{CACHE_VERSION}"
        self.log = log
        self.sign, self.trust = sign, trust
        self.remote_url = remote.url if remote is not None else None  # kept when the store goes off
        self.use = CacheUse(remote=remote)  # all that changes while the cache is used

    @property
    def remote(self) -> Store | None:
        """The remote tier, while it answers (None once it failed, and without one)."""
        return self.use.remote

    @property
    def read_only(self) -> bool:
        return self.use.read_only

    @property
    def stats(self) -> dict[str, list[tuple[str, str]]]:
        return self.use.stats

    @property
    def used(self) -> dict[tuple[str, str], str]:
        return self.use.used

    def tiers(self) -> dict[str, int]:
        return self.use.tiers()

    def _store_failed(self, e: Exception) -> None:
        """Turn the store off for the rest of the process, with one warning naming it and why."""
        if self.use.remote is not None:
            self.use.remote = None
            self.log(f"warning: cache store {e}; this compile goes on with the local cache only")

    def _cannot_write(self, e: OSError) -> None:
        """Stop writing to the cache, with one warning naming the directory and why."""
        if not self.use.read_only:
            self.use.read_only = True
            self.log(
                f"warning: cache {self.dir}: cannot write ({e.strerror or e}); this compile goes on "
                "without storing to the cache"
            )

    # --- paths ---
    def entry_dir(self, kind: str, key: str) -> Path:
        return self.root / kind / key[:2] / key

    def lock(self, kind: str, key: Key | str, blocking: bool = True) -> Lock | NoLock:
        digest = key.digest if isinstance(key, Key) else key
        if not self.read_only:
            try:
                return Lock(self.root / "locks" / f"{kind}-{digest}.lock", blocking)
            except OSError as e:
                self._cannot_write(e)
        return NoLock()

    # --- reading ---
    def lookup(self, kind: str, key: Key | str) -> Entry | None:
        """The entry if present and whole (not verified: `get_*` verify what they hand out)."""
        digest = key.digest if isinstance(key, Key) else key
        path = self.entry_dir(kind, digest)
        try:
            raw, meta = read_meta(path / META)
        except ReadError as e:
            if path.exists() or path.is_symlink():
                self._corrupt(Entry(kind, digest, path, {}), f"unreadable meta.json: {_reason(e)}")
            elif self.remote is not None and self._fetch(kind, digest):
                return self.lookup(kind, digest)
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
        problem = meta_problem(meta, kind, digest)
        if problem is not None or not (path / ARTIFACT).is_file():
            self._corrupt(Entry(kind, digest, path, {}), problem or "incomplete entry")
            return None
        assert isinstance(meta, dict)
        return Entry(kind, digest, path, meta)

    def get_file(self, kind: str, key: Key | str, dest: Path) -> bool:
        """Copy the entry's artifact to `dest` and verify the copy; False on a miss."""
        entry = self.lookup(kind, key)
        if entry is None:
            return self._miss(kind, key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
        try:
            _copy_regular(entry.artifact, entry.path, tmp)
        except ReadError as e:
            tmp.unlink(missing_ok=True)
            self._corrupt(entry, _reason(e))
            return self._miss(kind, key)
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
        try:
            data = read_bytes(entry.artifact, CAP_MANIFEST, root=entry.path)
        except ReadError as e:
            self._corrupt(entry, _reason(e))
            self._miss(kind, key)
            return None
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
        what = (entry.kind, entry.meta.get("identity", entry.key))
        self.stats["hit"].append(what)
        self.used[(entry.kind, entry.key)] = what[1]
        if (entry.kind, entry.key) in self.use.from_store:
            self.use.from_store.discard((entry.kind, entry.key))
            self.stats["remote"].append(what)
        return True

    def _miss(self, kind: str, key: Key | str) -> bool:
        self.stats["miss"].append((kind, key.identity if isinstance(key, Key) else key))
        return False

    def reject(self, kind: str, key: Key, why: str) -> None:
        """An entry handed out whose contents turned out unusable (a trace record of the wrong
        shape): reported once, removed, and so rebuilt as a miss."""
        self._corrupt(Entry(kind, key.digest, self.entry_dir(kind, key.digest), {"identity": key.identity}), why)

    def _corrupt(self, entry: Entry, why: str) -> None:
        self.log(
            f"warning: cache: {entry.kind} entry {entry.key[:16]} ({entry.meta.get('identity', '?')}) is corrupt "
            f"({why}); removing it, it will be rebuilt"
        )
        self.stats["corrupt"].append((entry.kind, entry.key))
        self.remove(entry.path)

    # --- the remote tier ---
    def _fetch(self, kind: str, digest: str, strict: bool = False) -> bool:
        """Install the store's entry for (kind, digest) in the local tier; True when it is there now.
        The store failing turns it off with one warning (a compile goes on), or with `strict` (a
        `deepinfer cache` command, for which the store is the point) raises StoreUnavailable.
        An entry the trusted key did not sign is left alone (it may be another signer's, and a
        reader with the wrong key must not empty a shared store); a corrupt one is taken out of the
        store, so that the rebuilt entry's conditional create can succeed."""
        store = self.remote
        if store is None or self.read_only:
            return False
        try:
            got = store.get_meta(kind, digest)
            if got is None:
                return False
            raw, signature = got
            meta = parse_meta(raw, kind, digest)
            if meta is None:
                self._remote_corrupt(kind, digest, {}, "unreadable meta.json", drop_object=False)
                return False
            tmp = self._tmp(kind, digest)
            try:
                if signature is not None:
                    _fsync_write(tmp / SIGNATURE, signature)
                if self.trust is not None:
                    try:
                        verify_bytes(raw, tmp / SIGNATURE, self.trust)
                    except TrustError as e:
                        self.log(
                            f"cache: {kind} entry {digest[:16]} ({meta.get('identity', '?')}) in {store.url} "
                            f"is not signed by the trusted key ({_reason(e)}); not using it (left in the store)"
                        )
                        return False
                if not store.get_object(meta["digest"], tmp / ARTIFACT):
                    self._remote_corrupt(kind, digest, meta, "its object is missing", drop_object=False)
                    return False
                if sha256_file(tmp / ARTIFACT) != meta["digest"]:
                    self._remote_corrupt(kind, digest, meta, "digest mismatch", drop_object=True)
                    return False
                _fsync_write(tmp / META, raw)
                if self._install(kind, digest, tmp):
                    self.use.from_store.add((kind, digest))
                return True
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        except StoreUnavailable as e:
            if strict:
                raise
            self._store_failed(e)
        except OSError as e:
            self._cannot_write(e)
        return False

    def _remote_corrupt(self, kind: str, digest: str, meta: dict, why: str, *, drop_object: bool) -> None:
        """Report a corrupt store entry once and delete its meta.json (and its object, when the
        object's bytes do not match its name): it is a miss, rebuilt and republished."""
        store = self.remote
        assert store is not None
        self.log(
            f"cache: {kind} entry {digest[:16]} ({meta.get('identity', '?')}) in {store.url} is corrupt "
            f"({why}); removing it from the store, it will be rebuilt and republished"
        )
        self.stats["corrupt"].append((kind, digest))
        store.delete_meta(kind, digest)
        if drop_object:
            store.delete_object(meta["digest"])

    def publish(self, kind: str, digest: str, strict: bool = False) -> bool:
        """Publish the local entry (kind, digest) to the store; True when this call created it there
        (False: no store, the entry is gone, or another publisher was first). The store failing is
        as in `_fetch`: one warning, or StoreUnavailable with `strict`."""
        store = self.remote
        if store is None:
            return False
        path = self.entry_dir(kind, digest)
        try:
            raw, meta = read_meta(path / META)
            signature = read_bytes(path / SIGNATURE, CAP_SMALL, root=path) if (path / SIGNATURE).exists() else None
            if not store.publish(kind, digest, path / ARTIFACT, raw, signature):
                return False
        except StoreUnavailable as e:
            if strict:
                raise
            self._store_failed(e)
            return False
        except (OSError, ReadError):  # removed meanwhile (prune, verify): nothing to publish
            return False
        self.stats["published"].append((kind, meta.get("identity", digest) if isinstance(meta, dict) else digest))
        return True

    def push(self, wanted: set[tuple[str, str]] | None = None) -> tuple[int, int]:
        """Publish the intact local entries (all, or the (kind, key) pairs of `wanted`) to the store:
        (published, already there or corrupt here). The store failing raises StoreUnavailable: a
        command that copies to the store stops there (a compile's publishes warn and go on)."""
        published = skipped = 0
        for e in self.entries():
            if wanted is not None and (e.kind, e.key) not in wanted:
                continue
            if (
                e.meta.get("key") == e.key
                and sha256_file(e.artifact) == e.meta.get("digest")
                and self.publish(e.kind, e.key, strict=True)
            ):
                published += 1
            else:
                skipped += 1
        return published, skipped

    def pull(self, wanted: set[tuple[str, str]] | None = None) -> tuple[int, int]:
        """Install the store's entries (all, or the (kind, key) pairs of `wanted`) locally:
        (installed, already here or refused). The store failing raises StoreUnavailable, as in `push`."""
        store = self.remote
        if store is None:
            return 0, 0
        listed = {(e.kind, e.key) for e in store.entries(KINDS)}
        installed = skipped = 0
        for kind, key in sorted(listed if wanted is None else listed & wanted):
            if self.entry_dir(kind, key).exists() or not self._fetch(kind, key, strict=True):
                skipped += 1
            else:
                installed += 1
        return installed, skipped

    # --- writing ---
    def put_file(self, kind: str, key: Key, src: Path) -> None:
        self._put(kind, key, lambda dst: shutil.copyfile(src, dst))

    def put_bytes(self, kind: str, key: Key, data: bytes) -> None:
        self._put(kind, key, lambda dst: _fsync_write(dst, data))

    def _put(self, kind: str, key: Key, write) -> None:
        """Write the entry whole in tmp/, then rename it into place (an intact entry already
        there, written by another compile, is kept). A write that fails makes the cache read-only."""
        self.used[(kind, key.digest)] = key.identity
        if self.read_only:
            return
        try:
            self._write_entry(kind, key, write)
        except OSError as e:
            self._cannot_write(e)

    def _tmp(self, kind: str, digest: str) -> Path:
        (self.root / "tmp").mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f"{kind}-{digest[:16]}-", dir=self.root / "tmp"))

    def _install(self, kind: str, digest: str, tmp: Path) -> bool:
        """Rename the whole entry `tmp` into place; False where an intact one is already there."""
        final = self.entry_dir(kind, digest)
        final.parent.mkdir(parents=True, exist_ok=True)
        if final.exists() and self.lookup(kind, digest) is not None:
            return False  # another compile stored it first
        try:
            os.replace(tmp, final)
        except OSError:  # appeared meanwhile (non-empty dir)
            return False
        return True

    def _write_entry(self, kind: str, key: Key, write) -> None:
        tmp = self._tmp(kind, key.digest)
        try:
            write(tmp / ARTIFACT)
            with open(tmp / ARTIFACT, "rb") as f:
                os.fsync(f.fileno())
            kill_point("entry")
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
            if not self._install(kind, key.digest, tmp):
                return
            self.stats["stored"].append((kind, key.identity))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        self.publish(kind, key.digest)

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
                    data = read_meta(meta)[1]
                except ReadError:
                    data = {}
                if meta_problem(data, kind, meta.parent.name) is not None:
                    data = {}  # listed (verify and prune see it) with nothing read from it
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
            meta = read_meta(found[0] / META)[1]
        except ReadError:
            meta = {}
        kind = found[0].parent.parent.name
        return Entry(kind, found[0].name, found[0], meta if meta_problem(meta, kind, found[0].name) is None else {})

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
