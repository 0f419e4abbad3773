"""The compile's tokenizer pass: the checkpoint's tokenizer files and engram's token map into the bundle.

A checkpoint with `tokenizer.json` gets its tokenizer files copied to `tokenizer/`
(each a host entry of the manifest, digested like every file), so `deepinfer-run`
needs only the bundle. With engram layers, the compressed token map
(`regions/engram_map.py`) is computed here, once, its key count held to
`engram_compressed_vocab_size`, and written to `host/engram_token_map.safetensors`
(int32 [tokenizer ids]) for the runtime's host-side hashing. A checkpoint without
`tokenizer.json` keeps the byte-level tokenizer: nothing is written.
"""

from __future__ import annotations

import hashlib
import shutil
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from deepinfer.bundles import layout
from deepinfer.bundles.manifest import HostFile
from deepinfer.errors import ConfigError
from deepinfer.reader import CAP_TOKENIZER, read_bytes
from deepinfer.regions.config import CONFIG_FILE, V41Config
from deepinfer.regions.engram_map import checked_token_map
from deepinfer.regions.hf_tokenizer import TokenizersTokenizer

MAP_TENSOR = "token_map"


def tokenizer_files(checkpoint: Path) -> list[str]:
    """The tokenizer files of `checkpoint` a bundle carries (none without tokenizer.json)."""
    if not (checkpoint / layout.TOKENIZER_FILE).is_file():
        return []
    return [name for name in layout.TOKENIZER_FILES if (checkpoint / name).is_file()]


def tokenizer_digests(checkpoint: Path) -> dict[str, str]:
    """name -> sha256 of each tokenizer file (a part of the bundle's cache key)."""
    return {
        name: hashlib.sha256(read_bytes(checkpoint / name, CAP_TOKENIZER, error=ConfigError)).hexdigest()
        for name in tokenizer_files(checkpoint)
    }


def bundle_tokenizer(model: V41Config, checkpoint: Path, staging: Path, log) -> dict[str, HostFile]:
    """Copy the tokenizer files and write the engram token map into `staging`; their host entries."""
    names = tokenizer_files(checkpoint)
    if not names:
        return {}
    tokenizer = TokenizersTokenizer.from_dir(checkpoint)  # refuses a damaged file before anything is copied
    entries = {}
    (staging / layout.TOKENIZER_DIR).mkdir()
    for name in names:
        entries[name] = HostFile(path=layout.tokenizer_path(name))
        shutil.copyfile(checkpoint / name, staging / entries[name].path)
    if model.text.engram_layer_ids:
        start = time.perf_counter()
        token_map = checked_token_map(
            tokenizer.backend, model.text, checkpoint / layout.TOKENIZER_FILE, checkpoint / CONFIG_FILE
        )
        entry = HostFile(path=layout.host_path(layout.HOST_ENGRAM_MAP_FILE), tensor=MAP_TENSOR)
        (staging / layout.HOST_DIR).mkdir(exist_ok=True)
        save_file({MAP_TENSOR: np.ascontiguousarray(token_map)}, str(staging / entry.path))
        entries["engram_token_map"] = entry
        log(
            f"engram token map: {len(token_map)} ids -> {model.text.engram_compressed_vocab_size} keys "
            f"({time.perf_counter() - start:.1f} s)"
        )
    log(f"tokenizer: {', '.join(names)} copied")
    return entries
