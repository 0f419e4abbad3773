"""Detached Ed25519 signatures over a bundle's manifest.

A bundle holds native code (AOTInductor packages, NEFFs) and programs the runtime executes:
running one is running its author's code. The manifest lists every file's sha256, so a
signature over the manifest's bytes covers the whole bundle: `deepinfer-compile --sign KEY`
writes `signature.json` beside the manifest, and `deepinfer-run --trust PUBKEY` (or
`DEEPINFER_TRUST`) verifies it against the manifest bytes it then parses, before any other
file is opened, and checks every file's digest. Keys are Ed25519 in PEM, as
`openssl genpkey -algorithm ed25519` (private, PKCS#8) and `openssl pkey -pubout` (public,
SubjectPublicKeyInfo) write them, or `deepinfer keygen`. The cryptography is the
`cryptography` package's; nothing here is hand-rolled.

The same signatures cover cache entries: with a signing key, a compile signs what it stores;
with a trusted key, a compile uses only entries whose signature verifies.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from pathlib import Path

from deepinfer.errors import DeepinferError
from deepinfer.reader import CAP_SMALL, load_json, read_bytes

ALGORITHM = "ed25519"


class TrustError(DeepinferError):
    """A key that cannot be used, or a signature that does not verify."""


def _primitives():
    try:
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError:
        raise TrustError(
            "signing and verifying bundles needs the `cryptography` package (pip install cryptography)"
        ) from None
    return serialization, ed25519, InvalidSignature


def load_private_key(path: str | Path):
    serialization, ed25519, _ = _primitives()
    try:
        key = serialization.load_pem_private_key(read_bytes(path, CAP_SMALL, error=TrustError), password=None)
    except (ValueError, TypeError) as e:
        raise TrustError(f"{path}: not a readable unencrypted PEM private key ({e})") from None
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise TrustError(
            f"{path}: not an Ed25519 private key (make one with `openssl genpkey -algorithm ed25519` "
            "or `deepinfer keygen`)"
        )
    return key


def load_public_key(path: str | Path):
    serialization, ed25519, _ = _primitives()
    try:
        key = serialization.load_pem_public_key(read_bytes(path, CAP_SMALL, error=TrustError))
    except (ValueError, TypeError) as e:
        raise TrustError(f"{path}: not a readable PEM public key ({e})") from None
    if not isinstance(key, ed25519.Ed25519PublicKey):
        raise TrustError(f"{path}: not an Ed25519 public key (`openssl pkey -pubout` writes one)")
    return key


def trusted(path: str | Path | None):
    """The public key at `path` (--trust, $DEEPINFER_TRUST), or None when no key is given."""
    return None if path is None else load_public_key(path)


def key_id(public_key) -> str:
    """The first 16 hex digits of the sha256 of the raw public key: names a key in errors."""
    serialization, _, _ = _primitives()
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def sign_bytes(data: bytes, private_key) -> dict:
    """The signature record of `data`."""
    return {
        "algorithm": ALGORITHM,
        "key_id": key_id(private_key.public_key()),
        "signature": base64.b64encode(private_key.sign(data)).decode(),
    }


def verify_bytes(data: bytes, record_path: Path, public_key) -> None:
    """Check that the signature record at `record_path` signs `data` with `public_key`."""
    _, _, invalid = _primitives()
    if not record_path.exists() and not record_path.is_symlink():
        raise TrustError(
            f"{record_path}: missing; the trusted key {key_id(public_key)} requires a signature "
            "(compile with --sign KEY)"
        )
    record = load_json(record_path, CAP_SMALL, root=record_path.parent, error=TrustError)
    if (
        not isinstance(record, dict)
        or record.get("algorithm") != ALGORITHM
        or not isinstance(record.get("signature"), str)
    ):
        raise TrustError(f"{record_path}: not an {ALGORITHM} signature record")
    try:
        signature = base64.b64decode(record["signature"], validate=True)
        public_key.verify(signature, data)
    except (ValueError, invalid):
        raise TrustError(
            f"{record_path}: does not verify with the trusted key {key_id(public_key)} "
            f"(signed by {record.get('key_id', '?')}); refusing to load"
        ) from None


def sign_file(path: Path, private_key, record_path: Path) -> None:
    """Write the signature record of file `path` at `record_path`."""
    record_path.write_text(json.dumps(sign_bytes(Path(path).read_bytes(), private_key)) + "\n")


def keygen(private_path: Path, public_path: Path) -> str:
    """A new Ed25519 key pair in PEM (the private key readable by its owner only); returns its key id."""
    serialization, ed25519, _ = _primitives()
    for p in (private_path, public_path):
        if p.exists():
            raise TrustError(f"{p}: exists; not overwriting a key")
    key = ed25519.Ed25519PrivateKey.generate()
    private = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(private)
    public_path.write_bytes(
        key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    return key_id(key.public_key())
