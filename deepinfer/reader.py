"""One reader for every file and body deepinfer parses (manifests, safetensors headers, indexes,
`config.json`, tokenizer files, signatures, cache metas, digest memos, HTTP bodies).

Whatever the input, a parse ends in the parsed value or in one typed error whose message is one line
naming the file (or body) and, where there is one, the key:

- `read_bytes` opens a file once, checks with `fstat` (on the same descriptor it reads) that it is a
  regular file under a size cap before reading a byte, and reads at most the cap: `/dev/zero`, a FIFO
  or a directory is refused, not read without bound. With `root`, the path (after its symlinks) must
  stay inside `root`: a symlink inside a bundle may point only to a regular file inside the bundle.
- `parse_json` decodes strict UTF-8 (naming the byte offset), refuses nesting deeper than
  `MAX_DEPTH`, integers of more than `MAX_INT_DIGITS` digits, `NaN`/`Infinity` (not JSON), and a key
  that appears twice in one object (a safetensors header naming one tensor twice would otherwise
  silently use the second).

The errors are `ReadError` unless the caller passes `error=` (a callable from the message to the
exception to raise: `BundleError`, `ConfigError`, ...), so each caller keeps its own error type and
the CLI's one-line, rc 2 handling of `DeepinferError`.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from deepinfer.errors import DeepinferError

MAX_DEPTH = 64  # deepest JSON nesting any deepinfer file or body needs is under 10
MAX_INT_DIGITS = 40  # the largest integer any file holds is a byte offset or size (< 2**64, 20 digits)
MIB = 1 << 20
# size caps, by what is read (the caller may pass its own)
CAP_SMALL = 4 * MIB  # config.json, signature.json, a cache meta or memo, a tokenizer_config.json
CAP_MANIFEST = 256 * MIB  # a release manifest lists every executable of every region (~10 MB at 40 layers)
CAP_TOKENIZER = 256 * MIB  # tokenizer.json of a large vocabulary (~10-30 MB)

Raise = Callable[[str], Exception]


class ReadError(DeepinferError, ValueError):
    """A file or body is not one deepinfer will parse: not a regular file, too large, outside its
    bundle, not UTF-8, not JSON, nested too deep, an absurd integer, a duplicate key."""


def read_bytes(
    path: str | os.PathLike, cap: int = CAP_SMALL, *, root: Path | None = None, error: Raise = ReadError
) -> bytes:
    """The bytes of the regular file `path`, at most `cap` of them, read through one descriptor."""
    fd = open_regular(path, cap, root=root, error=error)
    with os.fdopen(fd, "rb") as f:
        data = f.read(cap + 1)
    if len(data) > cap:  # grew after fstat
        raise error(f"{path}: larger than {cap} bytes; refusing to read it")
    return data


def open_regular(
    path: str | os.PathLike, cap: int | None = None, *, root: Path | None = None, error: Raise = ReadError
) -> int:
    """A read-only descriptor of `path`, checked on that descriptor to be a regular file (and under
    `cap` bytes); with `root`, `path` must resolve inside `root`. The caller owns the descriptor."""
    p = Path(path)
    if root is not None:
        try:
            real = p.resolve(strict=True)
        except (OSError, RuntimeError) as e:  # a missing target, a symlink loop
            raise error(f"{path}: cannot be resolved ({_reason(e)})") from None
        top = Path(root).resolve()
        if real != top and top not in real.parents:
            raise error(f"{path}: is a link to {real}, outside {root}; a bundle's files must lie inside it")
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise error(f"{path}: no such file") from None
    except OSError as e:
        raise error(f"{path}: cannot be opened ({_reason(e)})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{path}: is not a regular file ({_kind(st.st_mode)}); refusing to read it")
        if cap is not None and st.st_size > cap:
            raise error(f"{path}: is {st.st_size} bytes, over the {cap}-byte limit for this file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def load_json(
    path: str | os.PathLike, cap: int = CAP_SMALL, *, root: Path | None = None, error: Raise = ReadError
) -> Any:
    """`parse_json` of `read_bytes(path, cap)`."""
    return parse_json(read_bytes(path, cap, root=root, error=error), str(path), error=error)


def parse_json(data: bytes | str, where: str, *, error: Raise = ReadError, max_depth: int = MAX_DEPTH) -> Any:
    """The JSON value of `data` (from `where`, a file or a body's name), within the limits above."""
    if isinstance(data, bytes):
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise error(f"{where}: is not valid UTF-8 (byte {e.start}: {data[e.start : e.start + 1]!r})") from None
    else:
        text = data
    depth = nesting(text)
    if depth > max_depth:
        raise error(f"{where}: JSON nested {depth} deep; the limit is {max_depth}")
    try:
        return json.loads(
            text,
            parse_int=_int(where, error),
            parse_constant=_constant(where, error),
            object_pairs_hook=_unique(where, error),
        )
    except json.JSONDecodeError as e:
        raise error(f"{where}: is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except RecursionError:  # unreachable below max_depth; kept so that no input can escape as a traceback
        raise error(f"{where}: JSON nested too deep") from None


def nesting(text: str) -> int:
    """The deepest bracket nesting of JSON text, not counting brackets inside strings: an upper bound
    of the parsed value's depth, found without recursion, in one linear scan."""
    depth = deepest = 0
    for m in _TOKEN.finditer(text):
        c = m.group()
        if c in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in "]}":
            depth -= 1
    return deepest


_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]', re.S)  # a whole string, or a bracket


def _int(where: str, error: Raise) -> Callable[[str], int]:
    def parse(s: str) -> int:
        if len(s.lstrip("-")) > MAX_INT_DIGITS:
            raise error(f"{where}: an integer of {len(s.lstrip('-'))} digits; the limit is {MAX_INT_DIGITS}")
        return int(s)

    return parse


def _constant(where: str, error: Raise) -> Callable[[str], Any]:
    def parse(s: str) -> Any:
        raise error(f"{where}: {s} is not a JSON number")

    return parse


def _unique(where: str, error: Raise) -> Callable[[list[tuple[str, Any]]], dict]:
    def build(pairs: list[tuple[str, Any]]) -> dict:
        out = dict(pairs)
        if len(out) != len(pairs):
            seen: set[str] = set()
            for k, _ in pairs:
                if k in seen:
                    raise error(f"{where}: key {k!r} appears twice in one object")
                seen.add(k)
        return out

    return build


def _reason(e: BaseException) -> str:
    return e.strerror if isinstance(e, OSError) and e.strerror else str(e) or type(e).__name__


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"
