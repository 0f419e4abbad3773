"""A trusted bundle's files, each opened once and held as the bytes that were verified.

Under `--trust` the manifest's signature covers every file through its digest, so what runs must be
exactly what was hashed. Checking a digest by path and then opening the path again to use it leaves
a window in which the file can be replaced or rewritten. Here each listed file is:

1. opened once, component by component from the bundle's directory, never following a symlink
   (`O_NOFOLLOW` on every component): a link inside a trusted bundle is refused;
2. checked with `fstat` on that descriptor to be a regular file;
3. read through that descriptor into anonymous memory private to this process (an anonymous
   `mmap`: no file, no descriptor kept, nothing another process can write);
4. hashed from that memory.

Every later use reads that memory: weights are tensors over it (`safetensors.load_buffer`), and
an executable whose loader insists on a path is written from it into a private (0700) directory
and loaded from there (`Verified.private_copy`). Rewriting or swapping the bundle's files after
verification, in place or by rename, changes nothing that runs.

The price: a trusted load holds its bundle in anonymous memory rather than in the page cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from deepinfer.bundles.layout import is_inside

# the hook a test sets to change a bundle between its verification and its use (see `after_verify`)
TEST_HOOK_ENV = "DEEPINFER_TEST_AFTER_VERIFY"


class Verified:
    """rel path -> the verified bytes of a bundle file, in anonymous memory of this process."""

    def __init__(self, bundle: Path):
        self.bundle = bundle
        self._data: dict[str, memoryview] = {}

    def __contains__(self, rel: str) -> bool:
        return rel in self._data

    def data(self, rel: str) -> memoryview:
        """The verified bytes (writable only in the sense that the memory is this process's own:
        tensors over it are copy-on-write views of nothing else)."""
        return self._data[rel]

    @contextlib.contextmanager
    def private_copy(self, rel: str) -> Iterator[Path]:
        """The verified bytes of `rel` as a file (same name) in a new private 0700 directory, for
        loaders that take only a path; removed when the block ends."""
        with self._private([rel]) as private:
            yield private / Path(rel).name

    @contextlib.contextmanager
    def private_dir(self, folder: str) -> Iterator[Path]:
        """The verified files directly under `folder` (a tokenizer's) copied, by name, into a new
        private 0700 directory; removed when the block ends."""
        with self._private([r for r in self._data if Path(r).parent == Path(folder)]) as private:
            yield private

    @contextlib.contextmanager
    def _private(self, rels: list[str]) -> Iterator[Path]:
        private = Path(tempfile.mkdtemp(prefix="deepinfer-verified-"))  # 0700, this process's
        try:
            for rel in rels:
                fd = os.open(private / Path(rel).name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(self.data(rel))
            yield private
        finally:
            shutil.rmtree(private, ignore_errors=True)

    def add(self, rel: str, data: memoryview) -> None:
        self._data[rel] = data


def open_verified(bundle: Path, digests: dict[str, str], error: Callable[[str], Exception]) -> Verified:
    """Open, check and copy every file of `digests` (rel path -> "sha256:<hex>") as the module says;
    a file that is missing, a link, not regular or not matching its digest raises `error(message)`."""
    bundle = Path(bundle)
    verified = Verified(bundle)
    try:
        root = os.open(bundle, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise error(f"{bundle}: cannot open the bundle directory ({e.strerror})") from None
    try:
        for rel, digest in digests.items():
            if not is_inside(rel):
                raise error(f"{bundle}: manifest path {rel!r} is not inside the bundle")
            src = _open_nofollow(root, bundle, rel, error)
            try:
                data = _read_private(src)
            finally:
                os.close(src)
            if "sha256:" + hashlib.sha256(data).hexdigest() != digest:
                raise error(f"{bundle}: {rel} does not match its digest (altered or corrupt); recompile")
            verified.add(rel, data)
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


def _read_private(src: int) -> memoryview:
    """The bytes of the open file `src` (as `fstat` sized it) read into anonymous memory."""
    size = os.fstat(src).st_size
    if size == 0:
        return memoryview(b"")
    view = memoryview(mmap.mmap(-1, size))  # anonymous and private: the mapping lives with the view
    got = 0
    while got < size and (n := os.preadv(src, [view[got:]], got)):
        got += n
    return view[:got]  # shorter only if the file shrank: its digest then fails


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
