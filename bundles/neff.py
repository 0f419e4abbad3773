"""NEFF (Neuron Executable File Format) header: read, validate, summarize. Never written here.

Layout relied on (little-endian, packed; a 1024-byte header, then `data_size` payload bytes):

    off    type       field
    0x000  u64        package version: 1 = plain tar + SHA-256, 2 = gzip'd tar + MD5
    0x008  u64        header size (1024)
    0x010  u64        payload size in bytes as stored (compressed for package version 2)
    0x018  u64        NEFF format version, major (libnrt judges it at nrt_load)
    0x020  u64        NEFF format version, minor
    0x028  char[128]  compiler build label
    0x0A8  u32        (producer flag; 1 when the payload is gzip'd)
    0x0AC  u8[32]     payload digest (package 2: MD5 in the first 16 bytes)
    0x0CC  u8[16]     UUID
    0x0DC  char[256]  name
    0x1DC  u32        requested NeuronCore count
    0x1E0  u8[64]     NeuronCores per node
    0x220  u64        feature bits (capabilities the runtime must have)
    0x228  u32        virtual NeuronCore size = the LNC the NEFF was compiled for
    0x22C  ...        padding to 0x400
    0x400  payload    a tar archive (gzip'd for package version 2)

There is no magic number: a NEFF is recognised by its structure (package version 1 or 2,
header size 1024, a payload that fits in the file and is a tar archive).

Sources and confidence:
- AWS's own NEFF reader/writer in the KLR project (leanprover/KLR, KLR/NEFF.lean, Apache-2.0,
  "kelp" era): the 1024-byte header, the first five u64 fields, the 128-byte build label,
  the payload following the header with `data_size` its length, and the names
  packaging_version (1 = tgz+sha256, 2 = tgz+md5), uuid, name, requested_tpb_count,
  tpb_per_node. Its widths after offset 0xAC (64-byte hash, 32-byte uuid, 632-byte pad) do
  not add up to 1024 bytes, so it cannot be the exact current layout.
  https://github.com/leanprover/KLR/blob/main/KLR/NEFF.lean
- A public reverse-engineering write-up of libnrt 2.31 (`neff_header_t`, 1024 bytes, read
  from a NEFF embedded in libnrt.so) gives the offsets above from 0xAC on, including
  feature_bits at 0x220 and vnc_size (the LNC) at 0x228, package 1 = raw tar, and the
  runtime's checks (major <= 2, payload fits the file); and the feature-bit names below
  (from neuronx-cc 2.24). Single, unofficial source: the offsets from 0xAC on (uuid,
  name, feature bits, LNC) are UNCERTAIN until checked against a real neuronx-cc NEFF on a
  Neuron host. An LNC field of 0 is read as "not recorded" (`lnc` None), never guessed.
- `--enable-fast-loading-neuron-binaries` writes "an uncompressed format" (CLI reference),
  so the payload is accepted as gzip'd or plain tar whatever the package version says.
The payload digest is exposed but not verified (its exact input is not documented).
"""

from __future__ import annotations

import os
import struct
import tarfile
import uuid as uuidlib
import zlib
from dataclasses import dataclass, replace
from pathlib import Path

from deepinfer.errors import DeepinferError
from deepinfer.reader import open_regular

HEADER_SIZE = 1024
PACKAGE_VERSIONS = (1, 2)  # the packagings known today; a later one is the runtime's to judge
MAX_PACKAGE_VERSION = 255  # larger: not a package version, so not a NEFF (there is no magic number)
_LAYOUT = struct.Struct("<QQQQQ128sI32s16s256sI64sQI")  # 556 bytes, then padding
assert _LAYOUT.size == 0x22C
_GZIP_MAGIC = b"\x1f\x8b"

# feature bit -> name, as neuronx-cc 2.24 names them (reverse-engineered; see the docstring)
FEATURE_NAMES = {
    0x2: "collective_has_offset",
    0x4: "custom_ops",
    0x8: "coalesced_ccops",
    0x10: "queue_set_instances",
    0x20: "has_functions",
    0x40: "dynamic_pwp",
    0x80: "indirect_memcpy_32b_sem_wait",
    0x100: "indirect_memcpy_bound_check",
    0x200: "dma_desc_higher_dim",
    0x400: "vnc",
    0x800: "dve_perf_mode",
    0x1000: "dge",
    0x2000: "pool_rsqrt",
    0x4000: "remote_sem",
    0x8000: "dge_cast",
    0x10000: "vector_dge",
    0x20000: "embedding_stride32",
    0x100000: "sqi_no_rearm",
    0x200000: "hardware_dge",
    0x400000: "partial_sb2sb_ccop",
    0x1000000: "arch_gt_39",
    0x2000000: "large_tensor_support",
}


class NeffError(DeepinferError):
    """A file is not a NEFF, is damaged, or was compiled for another configuration."""


@dataclass(frozen=True)
class NeffHeader:
    package_version: int  # 1: plain tar + SHA-256, 2: gzip'd tar + MD5
    header_size: int
    data_size: int  # payload bytes as stored
    version_major: int
    version_minor: int
    build: str  # the compiler's build label
    digest: str  # hex; the MD5 (package 2) or SHA-256 (package 1) the header carries
    uuid: str | None  # None when the field is all zero (uncertain offset)
    name: str
    requested_cores: int
    feature_bits: int
    lnc: int | None  # None: not recorded (field 0)
    raw_size: int  # the file's size
    payload_offset: int  # where the payload starts (HEADER_SIZE)
    compressed: bool  # the payload is gzip'd

    @property
    def version(self) -> str:
        return f"{self.version_major}.{self.version_minor}"

    def feature_names(self) -> list[str]:
        return [FEATURE_NAMES.get(1 << i, f"bit{i}") for i in range(64) if self.feature_bits >> i & 1]


def read_header(path: Path) -> NeffHeader:
    """The header of the NEFF at `path`, after checking it is structurally a NEFF."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        raise NeffError(f"{path}: no such NEFF file")
    with os.fdopen(open_regular(path, error=NeffError), "rb") as f:  # no FIFO, device or directory
        raw = f.read(HEADER_SIZE)
        raw_size = f.seek(0, 2)
        header = _parse(path, raw, raw_size)
        compressed = _check_payload(path, f, header)
    return replace(header, compressed=compressed)


def _parse(path: Path, raw: bytes, raw_size: int) -> NeffHeader:
    if raw_size < HEADER_SIZE:
        raise NeffError(f"{path}: truncated NEFF ({raw_size} bytes; a NEFF starts with a {HEADER_SIZE}-byte header)")
    (pkg, header_size, data_size, major, minor, build, _flag, digest, uuid, name, cores, _per_node, features, vnc) = (
        _LAYOUT.unpack_from(raw)
    )
    if pkg == 0 or pkg > MAX_PACKAGE_VERSION:
        raise NeffError(
            f"{path}: not a NEFF (package version {pkg} at byte 0, expected a small positive "
            f"number: {' or '.join(map(str, PACKAGE_VERSIONS))} today)"
        )
    if header_size != HEADER_SIZE:
        raise NeffError(f"{path}: not a NEFF (header size field {header_size}, expected {HEADER_SIZE})")
    available = raw_size - HEADER_SIZE
    if data_size == 0 or data_size > available:
        raise NeffError(
            f"{path}: damaged NEFF (header says {data_size} payload bytes, the file has "
            f"{available} after the header); recompile or copy it again"
        )
    return NeffHeader(
        package_version=pkg,
        header_size=header_size,
        data_size=data_size,
        version_major=major,
        version_minor=minor,
        build=_text(build),
        digest=(digest[:16] if pkg == 2 else digest).hex(),
        uuid=str(uuidlib.UUID(bytes=uuid)) if any(uuid) else None,
        name=_text(name),
        requested_cores=cores,
        feature_bits=features,
        lnc=vnc or None,
        raw_size=raw_size,
        payload_offset=HEADER_SIZE,
        compressed=False,
    )


def _check_payload(path: Path, f, header: NeffHeader) -> bool:
    """The payload must open as a tar archive with at least one member (first member only:
    walking a multi-GB payload is the runtime's job). Returns whether it is gzip'd."""
    f.seek(header.payload_offset)
    compressed = f.read(2) == _GZIP_MAGIC
    f.seek(header.payload_offset)
    kind = "gzip'd tar" if compressed else "tar"
    try:
        with tarfile.open(fileobj=f, mode="r|gz" if compressed else "r|") as tar:
            first = tar.next()
    except (tarfile.TarError, EOFError, OSError, zlib.error) as e:
        raise NeffError(
            f"{path}: damaged NEFF (payload at byte {header.payload_offset} is not a readable {kind} archive: {e})"
        ) from None
    if first is None:
        raise NeffError(f"{path}: damaged NEFF (payload is an empty {kind} archive)")
    return compressed


def _text(field: bytes) -> str:
    return field.split(b"\0", 1)[0].decode("utf-8", errors="replace")


def check_loadable(header: NeffHeader, *, lnc: int, path: str | Path, recorded: dict | None = None) -> None:
    """Refuse a NEFF this bundle/runtime cannot load: compiled for another LNC, or not the NEFF
    the manifest recorded (`recorded`: its `summary`). A NEFF whose LNC field is 0 (not recorded)
    passes the LNC check: it cannot be judged here. Its format and package versions are the
    runtime's to judge: nrt_load answers NRT_UNSUPPORTED_NEFF_VERSION for one it does not read
    (runtime/neuron/libnrt.Libnrt.load names the runtime's version then); a table of versions kept here
    would refuse NEFFs a newer runtime loads."""
    if header.lnc is not None and header.lnc != lnc:
        raise NeffError(
            f"{path}: compiled for LNC {header.lnc}, this bundle/runtime is configured for "
            f"LNC {lnc}; recompile with lnc = {lnc} or run with "
            f"NEURON_LOGICAL_NC_CONFIG={header.lnc}"
        )
    if recorded:
        actual = summary(header)
        for key in ("version", "lnc", "uuid"):
            if key in recorded and recorded[key] != actual[key]:
                raise NeffError(
                    f"{path}: {key} {actual[key]!r} differs from the manifest's "
                    f"{recorded[key]!r}; the file was replaced after compiling, recompile"
                )


def output_name(name: str) -> str:
    """The NEFF tensor name of output `name` (the manifest's output spec name). Inputs keep their
    manifest names; outputs get their own so that no input and output share a name (`win` is both)."""
    return f"out_{name}"


def summary(header: NeffHeader) -> dict:
    """JSON-serializable facts for the bundle manifest."""
    return {
        "version": header.version,
        "package_version": header.package_version,
        "lnc": header.lnc,
        "features": header.feature_bits,
        "feature_names": header.feature_names(),
        "uuid": header.uuid,
        "name": header.name,
        "build": header.build,
    }
