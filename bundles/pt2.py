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


SERIALIZATION_ID = ".data/serialization_id"


def pin_serialization_id(path: Path) -> None:
    """Make a `.pt2` archive's bytes a function of its contents: torch's archive writer stores a
    random number in `<name>/.data/serialization_id` (used only to tag load-time logs), so two
    packages of the same program would differ. Its digits are replaced, in place and at the same
    length, by digits of a sha256 over every other record's name and CRC, and the record's CRC is
    updated where the archive keeps it (local header or data descriptor, and the central directory)."""
    import hashlib
    import struct
    import zlib

    with zipfile.ZipFile(path) as z:
        infos = z.infolist()
        start_dir = z.start_dir
    ids = [i for i in infos if i.filename.endswith(SERIALIZATION_ID) and i.compress_type == zipfile.ZIP_STORED]
    if len(ids) != 1:
        return  # not a torch archive (or an unexpected layout): left as written
    info = ids[0]
    h = hashlib.sha256()
    for i in infos:
        if i is not info:
            h.update(f"{i.filename}\0{i.CRC}\0{i.file_size}\0".encode())
    digits = str(int(h.hexdigest(), 16)).zfill(info.file_size)[-info.file_size :].encode()
    crc = zlib.crc32(digits) & 0xFFFFFFFF
    with open(path, "r+b") as f:
        f.seek(info.header_offset)
        local = f.read(30)
        assert local[:4] == b"PK\x03\x04", path
        name_len, extra_len = struct.unpack("<HH", local[26:30])
        data = info.header_offset + 30 + name_len + extra_len
        if info.flag_bits & 0x08:  # CRC in a data descriptor after the data (optional signature first)
            f.seek(data + info.file_size)
            sig = f.read(4)
            crc_at = data + info.file_size + (4 if sig == b"PK\x07\x08" else 0)
        else:
            crc_at = info.header_offset + 14
        f.seek(data)
        f.write(digits)
        f.seek(crc_at)
        f.write(struct.pack("<I", crc))
        f.seek(start_dir)
        central = f.read()
        at = 0
        while central[at : at + 4] == b"PK\x01\x02":
            n, e, c = struct.unpack("<HHH", central[at + 28 : at + 34])
            if central[at + 46 : at + 46 + n].decode() == info.filename:
                f.seek(start_dir + at + 16)
                f.write(struct.pack("<I", crc))
                break
            at += 46 + n + e + c
