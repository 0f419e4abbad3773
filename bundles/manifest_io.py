"""Reading and writing a bundle's `manifest.json` (the records are `bundles/manifest.py`'s).

`read` loads a bundle's manifest and `parse` its JSON value: `format_version` first, then every
value's type (`schema.build`), then ranges and cross-references (`manifest_checks.check`).
`check_files` then checks the files themselves (present, digests match). `dumps` writes exactly
the keys the dataclasses hold, `format_version` first; `stamp` gives a manifest the digests of
every file of its bundle.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import typing
from pathlib import Path

from deepinfer.bundles.layout import MANIFEST_FILE, SIGNATURE_FILE, is_inside
from deepinfer.bundles.manifest import SUPPORTED_VERSIONS, BundleError, Executable, Manifest
from deepinfer.bundles.manifest_checks import check
from deepinfer.reader import CAP_MANIFEST, parse_json, read_bytes
from deepinfer.schema import Problem, Rules, build, coerce, dump


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return "sha256:" + h.hexdigest()


def file_digests(bundle: Path) -> dict[str, str]:
    """Every file under `bundle` (the manifest and its signature excepted) by relative path -> sha256."""
    top = {MANIFEST_FILE, SIGNATURE_FILE}
    return {
        p.relative_to(bundle).as_posix(): sha256_file(p)
        for p in sorted(Path(bundle).rglob("*"))
        if p.is_file() and not (p.parent == Path(bundle) and p.name in top)
    }


def stamp(bundle: Path, m: Manifest) -> Manifest:
    """`m` covering every file of `bundle` (each hashed once)."""
    return m.with_digests(file_digests(bundle))


def to_json(part) -> dict:
    """A manifest (or any part of one) as its JSON value."""
    return dump(part)


def parse_executable(data, where: str) -> Executable:
    """One executable entry from its JSON value (a cached trace record holds one)."""
    try:
        return build(Executable, data)
    except Problem as p:
        raise BundleError(f"{where}: {p.dotted()}: {p.message}") from None


def executable_fields(extra: dict) -> dict:
    """Fields a target adds to an executable (as JSON values) -> the typed values `Executable` holds."""
    hints = typing.get_type_hints(Executable)
    return {k: coerce(v, hints[k], (k,), Rules()) for k, v in extra.items()}


def dumps(m: Manifest) -> str:
    """JSON text with `format_version` as the first key."""
    return json.dumps(to_json(m), indent=1) + "\n"


def write(bundle: Path, m: Manifest) -> Path:
    path = Path(bundle) / MANIFEST_FILE
    path.write_text(dumps(m))
    return path


def parse(data, where: str) -> Manifest:
    """A manifest from its JSON value: version first, then types, then cross-references."""
    version = data.get("format_version") if isinstance(data, dict) else None
    if version not in SUPPORTED_VERSIONS or isinstance(version, bool):
        raise BundleError(
            f"{where}: format_version {version!r} is not supported by this deepinfer "
            f"(reads {', '.join(map(str, SUPPORTED_VERSIONS))}); recompile the bundle "
            "or use the deepinfer that wrote it"
        )
    missing = [
        f.name
        for f in dataclasses.fields(Manifest)
        if f.name not in data and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise BundleError(f"{where}: manifest lacks {', '.join(missing)}")
    try:
        m = build(Manifest, data)
        check(m)
    except Problem as p:
        raise BundleError(f"{where}: {p.dotted()}: {p.message}") from None
    return m


def read(bundle: Path, *, trust=None) -> Manifest:
    """Load and check a bundle's manifest (not the files: see `check_files`). With `trust` (an
    Ed25519 public key, `bundles.signing`), the bytes read are first verified against the bundle's
    signature, and those same bytes are parsed."""
    path = Path(bundle) / MANIFEST_FILE
    if not path.exists() and not path.is_symlink():
        raise BundleError(f"{bundle}: not a bundle (no {MANIFEST_FILE})")
    raw = read_bytes(path, CAP_MANIFEST, root=Path(bundle), error=BundleError)
    if trust is not None:
        from deepinfer.bundles.signing import verify_bytes

        verify_bytes(raw, Path(bundle) / SIGNATURE_FILE, trust)
    data = parse_json(raw, str(path), error=BundleError)
    return parse(data, str(path))


def check_files(bundle: Path, m: Manifest, *, digests: bool = True) -> None:
    """Every listed file inside the bundle, present, with its digest; every referenced file listed."""
    bundle = Path(bundle)
    for rel, digest in m.files.items():
        if not is_inside(rel):
            raise BundleError(f"{bundle}: manifest path {rel!r} is not inside the bundle")
        path = bundle / rel
        if not path.is_file():
            raise BundleError(f"{bundle}: missing file {rel} (listed in the manifest)")
        if digests and sha256_file(path) != digest:
            raise BundleError(f"{bundle}: {rel} does not match its digest (altered or corrupt); recompile")
    unlisted = [r for r in m.referenced() if r not in m.files]
    if unlisted:
        raise BundleError(f"{bundle}: {unlisted[0]} is referenced but not covered by a digest")
