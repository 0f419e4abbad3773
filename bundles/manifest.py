"""The bundle manifest: schema, format version, digests, validation.

`format_version` is written first and checked first: a reader refuses any
version it does not know before it looks at anything else. Every file of a
bundle is listed in `files` with its sha256; `validate` checks every path is
inside the bundle, every file exists and every digest matches.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from deepinfer.bundles.layout import MANIFEST_FILE, is_inside
from deepinfer.errors import DeepinferError

FORMAT_VERSION = 1
SUPPORTED_VERSIONS = (1,)
REQUIRED_KEYS = ("format_version", "deepinfer_version", "toolchain", "target", "topology", "model",
                 "buckets", "kv", "regions", "layers", "weights", "host", "files")


class BundleError(DeepinferError):
    """A bundle is damaged, incomplete, or cannot be run here."""


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return "sha256:" + h.hexdigest()


def file_digests(bundle: Path) -> dict[str, str]:
    """Every file under `bundle` (the manifest excepted) by relative path -> sha256."""
    return {p.relative_to(bundle).as_posix(): sha256_file(p) for p in sorted(Path(bundle).rglob("*"))
            if p.is_file() and p.name != MANIFEST_FILE}


def stamp_digests(bundle: Path, manifest: dict) -> None:
    """Cover every file of `bundle` in `manifest["files"]`, and give each region artifact,
    weight stack and host tensor file its digest from there (each file hashed once)."""
    files = manifest["files"] = file_digests(bundle)
    entries = [*manifest["regions"], *(w for rank in manifest["weights"].values() for w in rank),
               *manifest["host"].values()]
    for e in entries:
        e["digest"] = files[e["artifact"] if "artifact" in e else e["path"]]


def dumps(manifest: dict) -> str:
    """JSON text with `format_version` as the first key."""
    ordered = {"format_version": manifest["format_version"]}
    ordered.update((k, v) for k, v in manifest.items() if k != "format_version")
    return json.dumps(ordered, indent=1, sort_keys=False) + "\n"


def read(bundle: Path) -> dict:
    """Load and check the manifest's version and keys (not the files: see `validate`)."""
    path = Path(bundle) / MANIFEST_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise BundleError(f"{bundle}: not a bundle (no {MANIFEST_FILE})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise BundleError(f"{path}: corrupt manifest ({e.msg} at line {e.lineno})") from None
    version = data.get("format_version") if isinstance(data, dict) else None
    if version not in SUPPORTED_VERSIONS:
        raise BundleError(f"{path}: format_version {version!r} is not supported by this deepinfer "
                          f"(reads {', '.join(map(str, SUPPORTED_VERSIONS))}); recompile the bundle "
                          "or use the deepinfer that wrote it")
    missing = [k for k in REQUIRED_KEYS if k not in data]
    if missing:
        raise BundleError(f"{path}: manifest lacks {', '.join(missing)}")
    return data


def validate(bundle: Path, manifest: dict, *, digests: bool = True) -> None:
    """Every listed file inside the bundle, present, with its digest; every referenced file listed."""
    bundle = Path(bundle)
    files = manifest["files"]
    for rel, digest in files.items():
        if not is_inside(rel):
            raise BundleError(f"{bundle}: manifest path {rel!r} is not inside the bundle")
        path = bundle / rel
        if not path.is_file():
            raise BundleError(f"{bundle}: missing file {rel} (listed in the manifest)")
        if digests and sha256_file(path) != digest:
            raise BundleError(f"{bundle}: {rel} does not match its digest (altered or corrupt); recompile")
    referenced = [r["artifact"] for r in manifest["regions"]]
    referenced += [w["path"] for rank in manifest["weights"].values() for w in rank]
    referenced += [h["path"] for h in manifest["host"].values()]
    unlisted = [r for r in referenced if r not in files]
    if unlisted:
        raise BundleError(f"{bundle}: {unlisted[0]} is referenced but not covered by a digest")
