"""Every path inside a bundle. Nothing else in deepinfer spells one.

    bundle/
      manifest.json                          the bundle's description (format_version first)
      regions/<kind>.<method>.b<B>t<T>.pt2   one executable per (kind, method, bucket)
      weights/rank-<R>/<kind>.safetensors    a kind's weights, stacked layer-major
      host/embed.safetensors                 host-resident tensors (token embedding)
      host/vision.safetensors                the vision tower, aligner and image delimiters (checkpoint names)
      logs/                                  per-executable compiler logs (targets that write them)
"""

from __future__ import annotations

from pathlib import PurePosixPath

MANIFEST_FILE = "manifest.json"
REGIONS_DIR = "regions"
WEIGHTS_DIR = "weights"
HOST_DIR = "host"
LOGS_DIR = "logs"
EXECUTABLE_FORMAT = "{kind}.{method}.b{batch}t{tokens}{suffix}"
WEIGHTS_FORMAT = "rank-{rank}/{kind}.safetensors"
HOST_EMBED_FILE = "embed.safetensors"
HOST_VISION_FILE = "vision.safetensors"


def executable_path(kind: str, method: str, batch: int, tokens: int, suffix: str) -> str:
    return str(PurePosixPath(REGIONS_DIR) / EXECUTABLE_FORMAT.format(
        kind=kind, method=method, batch=batch, tokens=tokens, suffix=suffix))


def weights_path(rank: int, kind: str) -> str:
    return str(PurePosixPath(WEIGHTS_DIR) / WEIGHTS_FORMAT.format(rank=rank, kind=kind))


def host_path(name: str) -> str:
    return str(PurePosixPath(HOST_DIR) / name)


def log_path(kind: str, method: str, batch: int, tokens: int) -> str:
    return str(PurePosixPath(LOGS_DIR) / EXECUTABLE_FORMAT.format(
        kind=kind, method=method, batch=batch, tokens=tokens, suffix=".log"))


def is_inside(rel: str) -> bool:
    """A manifest path must be relative and stay inside the bundle."""
    p = PurePosixPath(rel)
    return not p.is_absolute() and ".." not in p.parts and rel != ""
