"""A trusted bundle's files, each opened once and hashed as it is streamed to where it is used.

Under `--trust` the manifest's signature covers every file through its digest, so what runs must be
exactly what was hashed. Checking a digest by path and then opening the path again to use it leaves
a window in which the file can be replaced or rewritten. Here each file a process uses is:

1. opened once, component by component from the bundle's directory, never following a symlink
   (`O_NOFOLLOW` on every component): a link inside a trusted bundle is refused;
2. checked with `fstat` on that descriptor to be a regular file;
3. read through that descriptor, `CHUNK_BYTES` at a time, straight into where it is used, each piece
   hashed from there as it arrives (no second pass, no second copy):
   - a weights file (`.safetensors`) into anonymous memory private to this process (an anonymous
     `mmap`: no file, no descriptor kept, nothing another process can write), which is the
     storage of its tensors (`safetensors.load_buffer`): a host rank's weights are those bytes;
   - any other file (an executable, a tokenizer's files), whose loader insists on a path, through
     one buffer of `CHUNK_BYTES` into a file of a private (0700) directory of this process, from
     which it is loaded (`Verified.private_copy`, `private_dir`): nothing of it stays in memory.
4. checked against its digest when the whole file has arrived; a mismatch is refused before anything
   of the file is used.

Rewriting or swapping the bundle's files after verification, in place or by rename, changes nothing
that runs. A rank verifies only the files it uses (`files_for_rank`): its own weight files, those
every rank shares, the host files and executables, never another rank's weights. What a trusted
load holds beyond a plain one: its weights in anonymous memory rather than the page cache (the
same bytes a host rank's tensors hold either way), and one streaming buffer.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import mmap
import os
import shutil
import stat
import tempfile
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from deepinfer.bundles.layout import is_inside

# the hook a test sets to change a bundle between its verification and its use (see `after_verify`)
TEST_HOOK_ENV = "DEEPINFER_TEST_AFTER_VERIFY"


CHUNK_BYTES = 8 << 20  # what a file is read (and hashed) by at a time; the one buffer of a streamed file
IN_MEMORY = (".safetensors",)  # files used as memory (tensors over their bytes); the rest are streamed to files


class Verified:
    """rel path -> the verified bytes of a bundle file: in anonymous memory of this process (weights)
    or in a file of its private directory (everything else)."""

    def __init__(self, bundle: Path):
        self.bundle = bundle
        self._data: dict[str, memoryview] = {}
        self._files: dict[str, Path] = {}
        self._store = Path(tempfile.mkdtemp(prefix="deepinfer-verified-"))  # 0700, this process's
        self._cleanup = weakref.finalize(self, shutil.rmtree, self._store, True)
        self.buffer_bytes = 0  # the largest buffer a streamed file went through (tests: at most CHUNK_BYTES)

    def __contains__(self, rel: str) -> bool:
        return rel in self._data or rel in self._files

    def data(self, rel: str) -> memoryview:
        """The verified bytes of a weights file (writable only in the sense that the memory is this
        process's own: tensors over it are copy-on-write views of nothing else)."""
        return self._data[rel]

    def held_bytes(self) -> int:
        """Bytes of the bundle this process holds in anonymous memory: its weights files'."""
        return sum(v.nbytes for v in self._data.values())

    @contextlib.contextmanager
    def open(self, rel: str) -> Iterator[BinaryIO]:
        """The verified bytes of any file, to read."""
        if rel in self._data:
            yield io.BytesIO(self._data[rel])
        else:
            with open(self._files[rel], "rb") as f:
                yield f

    @contextlib.contextmanager
    def private_copy(self, rel: str) -> Iterator[Path]:
        """The verified bytes of `rel` as a file (same name) in a new private 0700 directory, for
        loaders that take only a path; removed when the block ends."""
        with self._private([rel]) as private:
            yield private / Path(rel).name

    @contextlib.contextmanager
    def private_dir(self, folder: str) -> Iterator[Path]:
        """The verified files directly under `folder` (a tokenizer's), by name, in a new private 0700
        directory; removed when the block ends."""
        with self._private([r for r in (*self._data, *self._files) if Path(r).parent == Path(folder)]) as private:
            yield private

    @contextlib.contextmanager
    def _private(self, rels: list[str]) -> Iterator[Path]:
        private = Path(tempfile.mkdtemp(prefix="deepinfer-verified-", dir=self._store))
        try:
            for rel in rels:
                if rel in self._files:  # a link to the streamed file: no copy (a copy where links fail)
                    try:
                        os.link(self._files[rel], private / Path(rel).name)
                    except OSError:
                        shutil.copyfile(self._files[rel], private / Path(rel).name)
                    continue
                fd = os.open(private / Path(rel).name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(self._data[rel])
            yield private
        finally:
            shutil.rmtree(private, ignore_errors=True)

    def close(self) -> None:
        """Remove the streamed files (also done when this object is collected)."""
        self._cleanup()

    def add(self, rel: str, src: int, digest: str, error: Callable[[str], Exception]) -> None:
        """Stream the open file `src` to where `rel` is used, hashing it on the way; refuse it (nothing
        of it kept) unless it matches `digest`."""
        if rel.endswith(IN_MEMORY):
            data, got = _read_private(src)
            if "sha256:" + got == digest:
                self._data[rel] = data
        else:
            path, got = self._stream_to_file(rel, src, error)
            if "sha256:" + got == digest:
                self._files[rel] = path
            else:
                path.unlink()
        if "sha256:" + got != digest:
            raise error(f"{self.bundle}: {rel} does not match its digest (altered or corrupt); recompile")

    def _stream_to_file(self, rel: str, src: int, error: Callable[[str], Exception]) -> tuple[Path, str]:
        """Copy `src` through one buffer of CHUNK_BYTES into a new file of the private store, hashing
        what is written -> (the file, the hex digest)."""
        sha = hashlib.sha256()
        buffer = memoryview(bytearray(CHUNK_BYTES))
        self.buffer_bytes = max(self.buffer_bytes, buffer.nbytes)
        name = ""
        try:
            fd, name = tempfile.mkstemp(prefix=Path(rel).name + ".", dir=self._store)
            with os.fdopen(fd, "wb") as out:
                while n := os.readv(src, [buffer]):
                    sha.update(buffer[:n])
                    out.write(buffer[:n])
        except OSError as e:  # the private store's disk (TMPDIR) full or read-only
            if name:
                os.unlink(name)
            raise error(
                f"{self.bundle}: {rel}: cannot copy it into a private directory in {self._store.parent} "
                f"({e.strerror}); free space there or point TMPDIR elsewhere"
            ) from None
        return Path(name), sha.hexdigest()


def open_verified(bundle: Path, digests: dict[str, str], error: Callable[[str], Exception]) -> Verified:
    """Open, stream and check every file of `digests` (rel path -> "sha256:<hex>") as the module says;
    a file that is missing, a link, not regular or not matching its digest raises `error(message)`."""
    bundle = Path(bundle)
    verified = Verified(bundle)
    try:
        root = os.open(bundle, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        verified.close()
        raise error(f"{bundle}: cannot open the bundle directory ({e.strerror})") from None
    try:
        for rel, digest in digests.items():
            if not is_inside(rel):
                raise error(f"{bundle}: manifest path {rel!r} is not inside the bundle")
            src = _open_nofollow(root, bundle, rel, error)
            try:
                verified.add(rel, src, digest, error)
            finally:
                os.close(src)
    except BaseException:
        verified.close()
        raise
    finally:
        os.close(root)
    return verified


def _open_nofollow(root: int, bundle: Path, rel: str, error: Callable[[str], Exception]) -> int:
    """A descriptor of `rel` under the directory `root`, opened without following any symlink and
    checked with fstat to be a regular file."""
    parts = rel.split("/")
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    at, opened = root, []
    try:
        for part in parts[:-1]:
            at = os.open(part, flags | os.O_DIRECTORY, dir_fd=at)
            opened.append(at)
        fd = os.open(parts[-1], flags | os.O_NONBLOCK, dir_fd=at)
    except FileNotFoundError:
        raise error(f"{bundle}: missing file {rel} (listed in the manifest)") from None
    except OSError as e:  # ELOOP: a symlink; ENOTDIR: a link or file where a directory should be
        raise error(
            f"{bundle}: {rel} cannot be opened without following links ({e.strerror}); a trusted "
            "bundle's files must be regular files inside it"
        ) from None
    finally:
        for d in opened:
            os.close(d)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise error(f"{bundle}: {rel} is not a regular file; a trusted bundle holds regular files only")
    os.set_blocking(fd, True)
    return fd


def _read_private(src: int) -> tuple[memoryview, str]:
    """The bytes of the open file `src` (as `fstat` sized it) read into anonymous memory, CHUNK_BYTES
    at a time, each piece hashed from that memory as it arrives -> (the bytes, their hex digest)."""
    sha = hashlib.sha256()
    size = os.fstat(src).st_size
    if size == 0:
        return memoryview(b""), sha.hexdigest()
    view = memoryview(mmap.mmap(-1, size))  # anonymous and private: the mapping lives with the view
    got = 0
    while got < size and (n := os.preadv(src, [view[got : min(size, got + CHUNK_BYTES)]], got)):
        sha.update(view[got : got + n])
        got += n
    return view[:got], sha.hexdigest()  # shorter only if the file shrank: its digest then fails


def after_verify(bundle: Path) -> None:
    """Run the test hook `$DEEPINFER_TEST_AFTER_VERIFY` (a shell command; `$DEEPINFER_BUNDLE` is the
    bundle's path), if set: between a bundle's verification and its first use, a test changes its
    files there to show that the change has no effect. Not for production use."""
    command = os.environ.get(TEST_HOOK_ENV)
    if command:
        import subprocess

        subprocess.run(
            command, shell=True, check=True, env={**os.environ, "DEEPINFER_BUNDLE": str(bundle)}, timeout=120
        )
