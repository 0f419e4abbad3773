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
import os
import typing
import zipfile
from pathlib import Path

import torch

from deepinfer.errors import DeepinferError
from deepinfer.reader import CAP_SMALL, parse_json


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
                    if z.getinfo(name).file_size > CAP_SMALL:
                        raise ValueError(f"{name} is over {CAP_SMALL} bytes")
                    data = parse_json(z.read(name), name)
                    config = data.get("config", {}) if isinstance(data, dict) else None
                    if not isinstance(config, dict):
                        raise ValueError(f"{name} holds no config object")
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


# torch's deserializer resolves a schema dataclass's type hints (`typing.get_type_hints`, which evaluates
# every annotation string) again for every graph node, argument and tensor it reads: most of a small
# program's load. The schema does not change in a process, so each class's hints are resolved once.
_SCHEMA_HINTS: dict[type, dict[str, object]] = {}


class _HintsOnce:
    """`typing` as torch's deserializer sees it while loading: the schema's type hints memoized."""

    def __init__(self, schema: dict):
        self.schema = schema

    def __getattr__(self, name: str):  # the rest of `typing`, kept here once looked up
        value = getattr(typing, name)
        setattr(self, name, value)
        return value

    def get_type_hints(self, cls, globalns=None, localns=None, include_extras=False):
        if globalns is not self.schema or localns is not None or include_extras:
            return typing.get_type_hints(cls, globalns, localns, include_extras)
        hints = _SCHEMA_HINTS.get(cls)
        if hints is None:
            hints = _SCHEMA_HINTS[cls] = typing.get_type_hints(cls, globalns)
        return hints


@contextlib.contextmanager
def _schema_hints_once():
    """While loading: torch's deserializer gets each schema class's type hints from `_SCHEMA_HINTS`."""
    from torch._export.serde import schema, serialize

    real = serialize.typing
    serialize.typing = _HintsOnce(vars(schema))
    try:
        yield
    finally:
        serialize.typing = real


def load_exported(path: str | Path) -> torch.export.ExportedProgram:
    """The ExportedProgram saved at `path`, loaded without unpickling (see the module)."""
    path = Path(path)
    _check_archive(path)
    with _safe_torch_load(path), _schema_hints_once():
        return torch.export.load(str(path))


SERIALIZATION_ID = ".data/serialization_id"
COMPILE_CMD = b"\n// Compile cmd\n"  # AOTInductor appends the g++ commands to its cached sources


def normalize_package(path: Path) -> None:
    """Make an AOTInductor package's bytes a function of the program, the toolchain and the paths it
    was compiled under, not of the compile's history: (1) AOTInductor appends its compile and link
    commands to the generated C++ in its cache each time it compiles it, so a source compiled before
    carries them twice; the package's copies are cut before the first. (2) torch's archive writer
    stores a random number in `<name>/.data/serialization_id` (it only tags load-time logs); its
    digits become those of a sha256 over every other record. The archive is rewritten beside, stored
    uncompressed as torch writes it, and renamed into place."""
    import hashlib

    with zipfile.ZipFile(path) as z:
        records = [(i.filename, z.read(i)) for i in z.infolist()]
    out = [
        (name, data[: data.index(COMPILE_CMD)] if name.endswith(".cpp") and COMPILE_CMD in data else data)
        for name, data in records
    ]
    h = hashlib.sha256()
    for name, data in out:
        if not name.endswith(SERIALIZATION_ID):
            h.update(f"{name}\0{len(data)}\0".encode() + hashlib.sha256(data).digest())
    tmp = path.with_name(f".{path.name}.normalized-{os.getpid()}")
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED) as z:
        for name, data in out:
            pinned = str(int(h.hexdigest(), 16)).zfill(len(data))[-len(data) :].encode()
            z.writestr(
                zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0)),
                pinned if name.endswith(SERIALIZATION_ID) else data,
            )
    os.replace(tmp, path)


def save_exported(ep: torch.export.ExportedProgram, path: Path) -> None:
    """Save `ep` as bytes that are a function of the program alone: its nodes' provenance
    (`meta["from_node"]`, which the archive's graph JSON carries) names each graph it came through by
    the graph's Python object id, which differs in every process; the ids are renumbered in the
    order the nodes first name them, and the archive is normalized as a package is
    (`normalize_package`: its random serialization id pinned)."""
    ids: dict[int, int] = {}
    seen: set[int] = set()  # sources that nodes share are renumbered once

    def renumber(sources: list) -> None:
        for source in sources:
            if id(source) in seen:
                continue
            seen.add(id(source))
            info = source.node_info
            if info is not None:
                info.graph_id = ids.setdefault(info.graph_id, len(ids))
            source._dict = None  # its cached dict held the old id
            renumber(source.from_node)

    for module in ep.graph_module.modules():
        if isinstance(module, torch.fx.GraphModule):
            for node in module.graph.nodes:
                renumber(node.meta.get("from_node", []))
    torch.export.save(ep, str(path))
    normalize_package(path)
