"""Loading a saved ExportedProgram (`.pt2`) without unpickling anything.

`torch.export.load` reads a program's graph as JSON, but its tensors and sample inputs go
through `torch.load`, which falls back to full unpickling (`weights_only=False`) when the
safe load fails, and custom objects are unpickled outright. A `.pt2` whose sample inputs
carry a pickle payload would run that payload at load. deepinfer's executables hold no
weights, constants or objects, so a load here admits only what the safe loader takes: an
archive that asks for anything else is refused with one line, before and while it loads.
"""

from __future__ import annotations

import contextlib
import json
import os
import zipfile
from pathlib import Path

import torch

from deepinfer.errors import DeepinferError


class UnsafeArchiveError(DeepinferError):
    """A `.pt2` archive that would need unpickling to load."""


def _refuse(path, why: str) -> UnsafeArchiveError:
    return UnsafeArchiveError(
        f"{path}: {why}; deepinfer never unpickles an executable (re-export it with this deepinfer)"
    )


def _check_archive(path: Path) -> None:
    """Refuse, by its listing and payload configs, an archive whose load would unpickle."""
    from torch.export.pt2_archive.constants import CUSTOM_OBJ_FILENAME_PREFIX, OPAQUE_OBJ_FILENAME_PREFIX

    try:
        with zipfile.ZipFile(path) as z:
            for name in z.namelist():
                base = os.path.basename(name)
                if base.startswith((CUSTOM_OBJ_FILENAME_PREFIX, OPAQUE_OBJ_FILENAME_PREFIX)):
                    raise _refuse(path, f"holds a pickled object ({name})")
                if name.endswith("_config.json") and "/data/" in f"/{name}":
                    config = json.loads(z.read(name)).get("config", {})
                    pickled = [k for k, v in config.items() if isinstance(v, dict) and v.get("use_pickle")]
                    if pickled:
                        raise _refuse(path, f"stores {pickled[0]!r} pickled ({name})")
    except (zipfile.BadZipFile, ValueError, OSError) as e:
        raise UnsafeArchiveError(f"{path}: not a readable .pt2 archive ({e})") from None


@contextlib.contextmanager
def _safe_torch_load(path: Path):
    """While loading: `torch.load` only with `weights_only=True`; a call that asks for more raises."""
    real = torch.load

    def load(*args, weights_only=None, **kwargs):
        if weights_only is False:
            raise _refuse(path, "holds data the safe loader rejects (its load would unpickle it)")
        return real(*args, weights_only=True, **kwargs)

    torch.load = load
    try:
        yield
    finally:
        torch.load = real


def load_exported(path: str | Path) -> torch.export.ExportedProgram:
    """The ExportedProgram saved at `path`, loaded without unpickling (see the module)."""
    path = Path(path)
    _check_archive(path)
    with _safe_torch_load(path):
        return torch.export.load(str(path))
