"""Where a bundle is assembled and how it replaces what is at its output path.

A bundle is built in a staging sibling of its output directory and renamed into place whole.
`--force` replaces only what deepinfer made: an existing bundle (a directory holding a
deepinfer manifest) or an empty directory; anything else at the output path is refused, and
so is an output inside the checkpoint directory (or one holding it), because the replaced
directory is deleted.

A staging directory is named `.<out>.tmp-<host>-<pid>-<random>` (a replaced bundle waits in
`.<out>.old-<host>-<pid>-<random>` until the new one is in place), so the next compile into
the same parent, whatever its output, removes the ones a killed compile left: those of this host
whose process is gone. A live process's directories, and other hosts', are never touched. A
compile stopped by SIGTERM or SIGINT (`stopped_by_signals`) removes its own before it exits.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

from deepinfer.bundles import layout
from deepinfer.errors import ConfigError
from deepinfer.reader import CAP_MANIFEST, ReadError, load_json

STAGING, TRASH = "tmp", "old"


def _host() -> str:
    """This host's name as it may appear in a file name (no dashes: they separate the fields)."""
    return "".join(ch if ch.isalnum() else "_" for ch in socket.gethostname()) or "host"


def _prefix(out: Path, what: str) -> str:
    return f".{out.name}.{what}-"


def _owned_prefix(out: Path, what: str) -> str:
    return f"{_prefix(out, what)}{_host()}-{os.getpid()}-"


def is_bundle(path: Path) -> bool:
    """A directory holding a deepinfer manifest (a JSON object with a format version)."""
    manifest = path / layout.MANIFEST_FILE
    try:
        data = load_json(manifest, CAP_MANIFEST, root=path)
    except ReadError:
        return False
    return isinstance(data, dict) and "format_version" in data


def _within(a: Path, b: Path) -> bool:
    """a is b or inside it (both resolved)."""
    return a == b or b in a.parents


def check_output(out: Path, force: bool, checkpoint: Path | None = None) -> None:
    """Refuse, before any work, an output path that the compile may not write or replace."""
    if checkpoint is not None:
        o, c = out.resolve(), Path(checkpoint).resolve()
        if _within(o, c):
            raise ConfigError(f"{out}: inside the checkpoint directory {checkpoint}; write the bundle elsewhere")
        if _within(c, o):
            raise ConfigError(f"{out}: holds the checkpoint directory {checkpoint}; write the bundle elsewhere")
    if not out.exists() and not out.is_symlink():
        return
    if not force:
        raise ConfigError(f"{out}: exists; replace it with --force (compile_bundle(..., force=True) from Python)")
    if out.is_symlink() or not out.is_dir():
        raise ConfigError(f"{out}: exists and is not a directory; --force replaces only a bundle or an empty directory")
    if not is_bundle(out) and any(out.iterdir()):
        raise ConfigError(
            f"{out}: not a deepinfer bundle (no {layout.MANIFEST_FILE} with a format_version) and not "
            f"empty; --force replaces only a bundle or an empty directory"
        )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _stale_name(host: str) -> re.Pattern[str]:
    """The name of any output's staging or replaced-bundle directory made on `host`: its pid in group 1."""
    return re.compile(rf"\..+\.(?:{STAGING}|{TRASH})-{re.escape(host)}-(\d+)-[^-]+")


def clean_stale(out: Path, log=lambda msg: None) -> list[Path]:
    """Remove the staging and replaced-bundle directories in `out`'s parent (of any output) left by
    compiles on this host whose process is gone; returns what was removed."""
    removed: list[Path] = []
    pattern = _stale_name(_host())
    if not out.parent.is_dir():
        return removed
    for path in sorted(out.parent.iterdir()):
        match = pattern.fullmatch(path.name)
        if match is None or not path.is_dir() or path.is_symlink() or _alive(int(match[1])):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
        log(f"removed {path} (left by process {match[1]}, which is gone)")
    return removed


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
STOP_GRACE_S = 30.0  # after a stop signal: how long the cleanup may take before the backstop ends it


@contextlib.contextmanager
def stopped_by_signals(log=lambda msg: None, staging: Path | None = None) -> Iterator[None]:
    """While a compile runs, a stop signal takes its staging directory and worker processes with it.

    SIGTERM ends the compile at once: the workers (`multiprocessing.active_children`) are killed,
    `staging` removed and the process exits with 128 + 15, as a kill -9 would but with nothing left
    behind (what the artifact cache holds survives a kill -9 at any point: tests/compiler/test_faults.py).
    It does not raise: an exception raised from a signal handler inside a finalizer or an at-fork hook
    is printed and ignored by Python, and the compile would go on. SIGINT (Ctrl-C) raises
    KeyboardInterrupt as Python does, for notebooks and callers that catch it, and the compile's own
    cleanup runs; should that exception be lost, the same hard stop follows STOP_GRACE_S later. Forked
    workers, which inherit the handler, take the default action. Handlers the caller installed are
    kept, and so is everything off the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    owner = os.getpid()
    backstops: list[threading.Timer] = []

    def stop(signum: int, frame: object) -> None:
        if os.getpid() != owner:  # a forked worker: end as it would have without this handler
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        for s in STOP_SIGNALS:  # a second signal does not interrupt the cleanup
            signal.signal(s, signal.SIG_IGN)
        log(
            f"{signal.Signals(signum).name}: stopping the compile; removing its staging directory, nothing is published"
        )
        if signum != signal.SIGINT:
            _hard_stop(signum, staging)
        backstop = threading.Timer(STOP_GRACE_S, _hard_stop, (signum, staging))
        backstop.daemon = True
        backstop.start()
        backstops.append(backstop)
        raise KeyboardInterrupt

    for s in STOP_SIGNALS:
        if previous[s] in (signal.SIG_DFL, signal.default_int_handler):
            signal.signal(s, stop)
    try:
        yield
    finally:
        for backstop in backstops:  # the compile ended (the interrupt reached the caller)
            backstop.cancel()
        for s in STOP_SIGNALS:
            signal.signal(s, previous[s])


def _hard_stop(signum: int, staging: Path | None) -> None:
    """End the compile now: its workers killed, its staging directory removed, exit 128 + signum."""
    for child in multiprocessing.active_children():
        child.kill()
    if staging is not None:
        shutil.rmtree(staging, ignore_errors=True)
    sys.stderr.flush()
    os._exit(128 + signum)


def make_staging(out: Path, what: str = STAGING) -> Path:
    """A new staging directory beside `out`, named for this process."""
    out.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=_owned_prefix(out, what), dir=out.parent))


def publish(staging: Path, out: Path, force: bool) -> None:
    """Rename the finished bundle into place. With `force`, what is at `out` must pass
    `check_output` again (it may have changed during the compile); it is moved aside, the new
    bundle renamed in, and the old one deleted."""
    if out.exists() or out.is_symlink():
        check_output(out, force)
        trash = make_staging(out, TRASH)
        os.replace(out, trash / out.name)
        os.replace(staging, out)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(staging, out)
