"""Every path inside a bundle. Nothing else in deepinfer spells one.

bundle/
  manifest.json                          the bundle's description (format_version first)
  signature.json                         optional: an Ed25519 signature over manifest.json (--sign)
  regions/<kind>.<method>.b<B>t<T>[c<C>].pt2   one executable per (kind, method, bucket); c<C>: the
                                         context bucket of the kinds built per context
  weights/rank-<R>/<kind>.safetensors    a kind's weights one rank holds, stacked layer-major
  weights/shared/<kind>.safetensors      a kind's weights every rank holds whole, stored once
  host/embed.safetensors                 host-resident tensors (token embedding)
  host/engram.safetensors                the engram tables and their scales (checkpoint names)
  host/vision.safetensors                the vision tower, aligner and image delimiters (checkpoint names)
  host/engram_token_map.safetensors      engram's compressed token map (`tokenizers` tokenizers)
  tokenizer/tokenizer.json, ...          the checkpoint's tokenizer files, copied (where it has tokenizer.json)
  logs/                                  per-executable compiler logs (targets that write them)
  cache-keys.json                        compiled with a cache: the cache entries (kind, key, identity) the
                                         bundle was built from (`deepinfer cache push/pull --bundle`)
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

MANIFEST_FILE = "manifest.json"
SIGNATURE_FILE = "signature.json"
REGIONS_DIR = "regions"
WEIGHTS_DIR = "weights"
HOST_DIR = "host"
LOGS_DIR = "logs"
CACHE_KEYS_FILE = "cache-keys.json"
TOKENIZER_DIR = "tokenizer"
TOKENIZER_FILE = "tokenizer.json"  # the checkpoint's names, kept in the bundle
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_FILES = (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, CHAT_TEMPLATE_FILE)  # copied where present
EXECUTABLE_NAME = "{kind}.{method}.b{batch}t{tokens}"
CONTEXT_SUFFIX = "c{context}"
RANK_KEY = "rank-{rank}"
WEIGHTS_FORMAT = RANK_KEY + "/{kind}.safetensors"
SHARED_WEIGHTS_FORMAT = "shared/{kind}.safetensors"
HOST_EMBED_FILE = "embed.safetensors"
HOST_ENGRAM_FILE = "engram.safetensors"
HOST_VISION_FILE = "vision.safetensors"
HOST_ENGRAM_MAP_FILE = "engram_token_map.safetensors"


def executable_name(kind: str, method: str, batch: int, tokens: int, context: int | None) -> str:
    """An executable's name, e.g. `attn_window.decode.b1t1`, or `attn_source_r2.decode.b1t1c256` for a
    kind built per context bucket (`context` positions): its file stem, log name and cache identity."""
    name = EXECUTABLE_NAME.format(kind=kind, method=method, batch=batch, tokens=tokens)
    return name if context is None else name + CONTEXT_SUFFIX.format(context=context)


def rank_key(rank: int) -> str:
    """How the manifest names a rank's entries (weights, memory): `rank-R`."""
    return RANK_KEY.format(rank=rank)


def executable_path(kind: str, method: str, batch: int, tokens: int, context: int | None, suffix: str) -> str:
    return str(PurePosixPath(REGIONS_DIR) / (executable_name(kind, method, batch, tokens, context) + suffix))


def weights_path(rank: int, kind: str) -> str:
    return str(PurePosixPath(WEIGHTS_DIR) / WEIGHTS_FORMAT.format(rank=rank, kind=kind))


def shared_weights_path(kind: str) -> str:
    return str(PurePosixPath(WEIGHTS_DIR) / SHARED_WEIGHTS_FORMAT.format(kind=kind))


def host_path(name: str) -> str:
    return str(PurePosixPath(HOST_DIR) / name)


def tokenizer_path(name: str) -> str:
    return str(PurePosixPath(TOKENIZER_DIR) / name)


def log_path(kind: str, method: str, batch: int, tokens: int, context: int | None) -> str:
    return str(PurePosixPath(LOGS_DIR) / (executable_name(kind, method, batch, tokens, context) + ".log"))


def failed_logs(out: Path) -> Path:
    """Where a failed compile of bundle `out` leaves its compiler logs."""
    return out.parent / f"{out.name}.failed-logs"


def is_inside(rel: str) -> bool:
    """A manifest path must be relative and stay inside the bundle."""
    p = PurePosixPath(rel)
    return not p.is_absolute() and ".." not in p.parts and rel != ""
