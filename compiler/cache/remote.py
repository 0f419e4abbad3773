"""The remote tier of the artifact cache: an S3 bucket (or any S3-compatible endpoint) behind the
local directory of `local.py`.

    s3://<bucket>/<prefix>/v1/
      objects/<sha256>                 an artifact, named by the sha256 of its bytes
      <kind>/<key>/meta.json           the entry: the local meta.json's bytes, whose `digest` names
                                       its object; with --sign, the signature record rides on the
                                       same object (user metadata `signature`)

An entry exists when its meta.json exists. Publishing writes the object (skipped when one of that
name is there), then meta.json with `If-None-Match: *`: the first publisher of a key wins, a later
one gets 412 and does nothing. Artifacts are content-addressed, so two publishers of one key whose
bytes differ (compiles need not be bit-identical) each upload their own object, and the meta that
wins names its own publisher's bytes. The signature is not a separate object: a second publisher
overwriting a separate signature.json between the first's signature and meta writes would leave a
meta with a signature that does not verify; on the meta object itself it is written in the same
request. There are no lock objects: a key two machines miss together is built by both, and one
entry survives.

boto3 is imported on first use (`pip install 'deepinfer[s3]'`); credentials come from the standard
AWS chain (environment, ~/.aws, an instance or task role), never from model.toml. A Store is
rebuilt in another process from `(url, endpoint)` alone: pickling it sends only those.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from deepinfer.compiler.cache.keys import CACHE_VERSION
from deepinfer.errors import DeepinferError
from deepinfer.reader import ReadError, parse_json

ENV_URL = "DEEPINFER_CACHE_URL"
ENV_ENDPOINT = "AWS_ENDPOINT_URL"  # boto3's own variable
META = "meta.json"
OBJECTS = "objects"
SIGNATURE_HEADER = "signature"  # S3 user metadata (x-amz-meta-signature) of meta.json
INSTALL_HINT = "pip install 'deepinfer[s3]'"
NO_CREDENTIALS = (
    "no AWS credentials found ($AWS_ACCESS_KEY_ID and $AWS_SECRET_ACCESS_KEY, $AWS_PROFILE, "
    "~/.aws/credentials, or an instance or task role)"
)
URL_FORMAT = re.compile(r"s3://([a-z0-9][a-z0-9.\-]{1,61}[a-z0-9])(/.*)?")


class StoreError(DeepinferError):
    """A bad --cache-url or endpoint, or no boto3: the user's to fix."""


class StoreUnavailable(DeepinferError):
    """The store could not be reached or refused a request: a compile goes on without it (`Cache`);
    `deepinfer cache ... --url` stops with it."""

    def __init__(self, store: Store, why: str):
        super().__init__(f"{store.url}: {why}")
        self.why = why


@dataclass(frozen=True)
class RemoteEntry:
    kind: str
    key: str
    last_modified: float  # meta.json's, seconds since the epoch (prune's age)
    size: int  # meta.json's bytes (the artifact's size is in its meta)


def _boto3():
    try:
        import boto3
        import botocore.config
    except ImportError:
        raise StoreError(f"an s3:// cache needs boto3, which is not installed: {INSTALL_HINT}") from None
    return boto3, botocore.config


def resolve_url(cli_url: str | None, config_url: str | None) -> str | None:
    """--cache-url > $DEEPINFER_CACHE_URL > model.toml [cache] url (None: no remote tier)."""
    return cli_url or os.environ.get(ENV_URL) or config_url


def resolve_endpoint(cli_endpoint: str | None, config_endpoint: str | None) -> str | None:
    """--cache-endpoint > $AWS_ENDPOINT_URL > model.toml [cache] endpoint (None: AWS itself)."""
    return cli_endpoint or os.environ.get(ENV_ENDPOINT) or config_endpoint


def open_store(
    cli_url: str | None,
    cli_endpoint: str | None,
    config_url: str | None,
    config_endpoint: str | None,
    log: Callable[[str], None],
) -> Store | None:
    """The store a compile uses (None: none), by `resolve_url` and `resolve_endpoint`; a bad URL or a
    missing boto3 is a StoreError naming where the URL came from."""
    url = resolve_url(cli_url, config_url)
    if url is None:
        return None
    where = "--cache-url" if cli_url else f"${ENV_URL}" if os.environ.get(ENV_URL) else "[cache] url"
    try:
        return Store.from_url(url, resolve_endpoint(cli_endpoint, config_endpoint), log)
    except StoreError as e:
        raise StoreError(f"{where}: {e}") from None


def check_url(url: str) -> str | None:
    """Why `url` is not an s3://bucket[/prefix] URL, or None."""
    if not url.startswith("s3://"):
        return f"{url!r}: expected s3://bucket/prefix (only S3 and S3-compatible stores are supported)"
    if not URL_FORMAT.fullmatch(url):
        return f"{url!r}: not a valid bucket name (3-63 lower-case letters, digits, '.' and '-')"
    return None


def check_endpoint(endpoint: str) -> str | None:
    if not re.fullmatch(r"https?://[^\s/]+(/\S*)?", endpoint):
        return f"{endpoint!r}: expected an http:// or https:// URL, e.g. http://localhost:9000"
    return None


class Store:
    """One S3 bucket and prefix. Each method either does what it says or raises StoreUnavailable
    (network, credentials, permissions, a missing bucket); `Cache` turns that into one warning."""

    def __init__(self, bucket: str, prefix: str, endpoint: str | None, log: Callable[[str], None]):
        self.bucket, self.prefix, self.endpoint, self.log = bucket, prefix.strip("/"), endpoint, log
        self.root = "/".join(p for p in (self.prefix, f"v{CACHE_VERSION}") if p)
        self._client = None
        self._client_lock = threading.Lock()

    @classmethod
    def from_url(cls, url: str, endpoint: str | None = None, log: Callable[[str], None] = lambda msg: None) -> Store:
        """`s3://bucket/prefix`; `endpoint` (an S3-compatible server) else $AWS_ENDPOINT_URL, else AWS.
        Raises StoreError naming the URL when it is malformed or boto3 is missing."""
        why = check_url(url)
        if why:
            raise StoreError(f"cache URL {why}")
        endpoint = endpoint or os.environ.get(ENV_ENDPOINT) or None
        if endpoint is not None and check_endpoint(endpoint):
            raise StoreError(f"cache endpoint {check_endpoint(endpoint)}")
        _boto3()  # fail now, in one line, rather than at the first miss
        m = URL_FORMAT.fullmatch(url)
        assert m is not None
        return cls(m.group(1), m.group(2) or "", endpoint, log)

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    def __reduce__(self):
        return (Store.from_url, (self.url, self.endpoint))

    def __repr__(self) -> str:
        return f"Store({self.url!r}, endpoint={self.endpoint!r})"

    # --- names ---
    def meta_name(self, kind: str, key: str) -> str:
        return f"{self.root}/{kind}/{key}/{META}"

    def object_name(self, digest: str) -> str:
        """`digest`: "sha256:<hex>" as meta.json records it, or the hex alone."""
        return f"{self.root}/{OBJECTS}/{digest.removeprefix('sha256:')}"

    # --- the client ---
    @property
    def client(self):
        with self._client_lock:
            if self._client is None:
                boto3, config = _boto3()
                self._client = boto3.session.Session().client(
                    "s3",
                    endpoint_url=self.endpoint,
                    config=config.Config(
                        connect_timeout=5, read_timeout=60, retries={"max_attempts": 2, "mode": "standard"}
                    ),
                )
            return self._client

    def _call(self, what: str, fn: Callable, expected: tuple[str, ...] = (), **kwargs):
        """Run one client call; a ClientError whose code is in `expected` (the answers the caller
        handles: a missing key, a lost conditional create) is raised as it is, every other error
        becomes StoreUnavailable. A listing or an upload expects none: a bare 404 there (an endpoint
        that is not S3, or a bucket a proxy hides) is the store failing, not an empty store."""
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

        try:
            return fn(**kwargs)
        except ClientError as e:
            if _code(e) in expected:
                raise
            raise StoreUnavailable(self, f"{what}: {self._client_error(e)}") from None
        except NoCredentialsError:
            raise StoreUnavailable(self, f"{what}: {NO_CREDENTIALS}") from None
        except BotoCoreError as e:
            raise StoreUnavailable(self, f"{what}: {e}") from None

    def _client_error(self, e) -> str:
        """What an S3 error answer says, naming the bucket and the endpoint where it helps."""
        err = e.response.get("Error", {})
        code, message = str(err.get("Code", "?")), err.get("Message", "")
        where = self.endpoint or "AWS S3"
        if code.isdigit():  # an HTTP status with no S3 error document in the answer
            return f"HTTP {code} {message} from {where} with no S3 error code (an S3 endpoint with a bucket {self.bucket!r}?)"
        if code == "NoSuchBucket":
            return f"NoSuchBucket: there is no bucket {self.bucket!r} at {where} ({message})"
        return f"{code} ({message})"

    # --- reading ---
    def get_meta(self, kind: str, key: str) -> tuple[bytes, bytes | None] | None:
        """meta.json's bytes and the signature record (bytes), or None where there is no entry."""
        from botocore.exceptions import ClientError

        try:
            r = self._call(
                "get meta.json", self.client.get_object, _MISSING, Bucket=self.bucket, Key=self.meta_name(kind, key)
            )
        except ClientError as e:
            if _code(e) in _MISSING:
                return None
            raise
        signature = r.get("Metadata", {}).get(SIGNATURE_HEADER)
        return r["Body"].read(), signature.encode() if signature else None

    def get_object(self, digest: str, dest: Path) -> bool:
        """Download the object named `digest` to `dest`; False where it is missing."""
        from botocore.exceptions import ClientError

        try:
            r = self._call(
                "get object", self.client.get_object, _MISSING, Bucket=self.bucket, Key=self.object_name(digest)
            )
        except ClientError as e:
            if _code(e) in _MISSING:
                return False
            raise
        with open(dest, "wb") as f:
            for chunk in iter(lambda: r["Body"].read(1 << 20), b""):
                f.write(chunk)
        return True

    def has_object(self, digest: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            self._call(
                "head object", self.client.head_object, _MISSING, Bucket=self.bucket, Key=self.object_name(digest)
            )
        except ClientError as e:
            if _code(e) in _MISSING:
                return False
            raise
        return True

    def entries(self, kinds: tuple[str, ...]) -> Iterator[RemoteEntry]:
        """Every entry (a meta.json) of `kinds`, listed (nothing downloaded)."""
        paginator = self.client.get_paginator("list_objects_v2")
        for kind in kinds:
            prefix = f"{self.root}/{kind}/"
            pages = self._call("list", lambda p=prefix: list(paginator.paginate(Bucket=self.bucket, Prefix=p)))
            for page in pages:
                for obj in page.get("Contents", []):
                    parts = obj["Key"][len(self.root) + 1 :].split("/")
                    if len(parts) == 3 and parts[2] == META:
                        yield RemoteEntry(kind, parts[1], obj["LastModified"].timestamp(), obj["Size"])

    def objects(self) -> Iterator[tuple[str, float]]:
        """Every object: (its sha256, LastModified in seconds since the epoch)."""
        paginator = self.client.get_paginator("list_objects_v2")
        prefix = f"{self.root}/{OBJECTS}/"
        for page in self._call("list", lambda: list(paginator.paginate(Bucket=self.bucket, Prefix=prefix))):
            for obj in page.get("Contents", []):
                yield obj["Key"][len(prefix) :], obj["LastModified"].timestamp()

    def listing(self, kinds: tuple[str, ...]) -> list[tuple[RemoteEntry, str | None, int]]:
        """Every entry with the identity and artifact size its meta.json records (None and 0 where it
        cannot be read), for `deepinfer cache ls --url`."""
        out = []
        for e in self.entries(kinds):
            got = self.get_meta(e.kind, e.key)
            try:
                meta = parse_json(got[0], f"{e.kind} {e.key} meta.json") if got else {}
            except ReadError:
                meta = {}
            size = meta.get("size", 0) if isinstance(meta, dict) else 0
            out.append((e, meta.get("identity") if isinstance(meta, dict) else None, size))
        return out

    def find(self, ref: str, kinds: tuple[str, ...]) -> tuple[RemoteEntry, dict] | None:
        """The entry whose key is `ref` or starts with it (8+ characters, unique) and its meta."""
        found = [e for e in self.entries(kinds) if len(ref) >= 8 and e.key.startswith(ref)]
        got = self.get_meta(found[0].kind, found[0].key) if len(found) == 1 else None
        if not got:
            return None
        try:
            meta = parse_json(got[0], f"{self.meta_name(found[0].kind, found[0].key)} in {self.url}")
        except ReadError:
            meta = None
        return found[0], meta if isinstance(meta, dict) else {}

    # --- maintenance (deepinfer cache verify / prune --url) ---
    def verify(self, kinds: tuple[str, ...], scratch: Path) -> tuple[int, list[tuple[RemoteEntry, str]]]:
        """Download and re-hash every entry's object (in `scratch`); delete the meta.json of each
        corrupt entry, and the object too where its bytes do not match its name. (entries, bad)."""
        from deepinfer.bundles.manifest_io import sha256_file

        listed, bad = list(self.entries(kinds)), []
        for e in listed:
            got = self.get_meta(e.kind, e.key)
            if got is None:  # removed since listed
                continue
            try:
                meta = parse_json(got[0], META)
                digest = meta["digest"] if meta.get("key") == e.key else None
            except (ValueError, TypeError, KeyError, AttributeError):
                digest = None
            tmp = scratch / e.key
            if digest is None:
                why = "unreadable or mismatched meta.json"
            elif not self.get_object(digest, tmp):
                why = "missing object"
            elif sha256_file(tmp) != digest:
                why = "digest mismatch"
                self.delete_object(digest)
            else:
                why = ""
            tmp.unlink(missing_ok=True)
            if why:
                bad.append((e, why))
                self.delete_meta(e.kind, e.key)
        return len(listed), bad

    def prune(self, kinds: tuple[str, ...], max_age: float, now: float) -> list[RemoteEntry]:
        """Delete entries published more than `max_age` seconds ago (the store keeps no last use),
        then objects no remaining entry names that are older than `max_age` too (a younger one may
        belong to a publish in progress, whose meta.json is not written yet)."""
        removed = []
        for e in list(self.entries(kinds)):
            if now - e.last_modified > max_age:
                self.delete_meta(e.kind, e.key)
                removed.append(e)
        named = set()
        for e in self.entries(kinds):
            got = self.get_meta(e.kind, e.key)
            try:
                named.add(parse_json(got[0], META)["digest"].removeprefix("sha256:") if got else "")
            except (ValueError, TypeError, KeyError, AttributeError):
                pass
        for digest, modified in list(self.objects()):
            if digest not in named and now - modified > max_age:
                self.delete_object(digest)
        return removed

    # --- writing ---
    def publish(self, kind: str, key: str, artifact: Path, raw_meta: bytes, signature: bytes | None) -> bool:
        """Upload the artifact (unless its object is there), then create meta.json if absent.
        True: published; False: another publisher's meta.json was there first (nothing to do)."""
        from botocore.exceptions import ClientError

        digest = parse_json(raw_meta, META)["digest"]
        if not self.has_object(digest):
            with open(artifact, "rb") as f:
                self._call(
                    "put object", self.client.put_object, Bucket=self.bucket, Key=self.object_name(digest), Body=f
                )
        extra = {"Metadata": {SIGNATURE_HEADER: signature.decode().strip()}} if signature else {}
        try:
            self._call(
                "put meta.json",
                self.client.put_object,
                _TAKEN,
                Bucket=self.bucket,
                Key=self.meta_name(kind, key),
                Body=raw_meta,
                IfNoneMatch="*",
                ContentType="application/json",
                **extra,
            )
        except ClientError as e:
            if _code(e) in _TAKEN:
                return False
            raise
        return True

    def delete_meta(self, kind: str, key: str) -> None:
        self._call("delete meta.json", self.client.delete_object, Bucket=self.bucket, Key=self.meta_name(kind, key))

    def delete_object(self, digest: str) -> None:
        self._call("delete object", self.client.delete_object, Bucket=self.bucket, Key=self.object_name(digest))


_MISSING = ("NoSuchKey", "404", "NotFound")
_TAKEN = ("PreconditionFailed", "412", "ConditionalRequestConflict", "409")


def _code(e) -> str:
    return str(e.response.get("Error", {}).get("Code", ""))
