"""Engram's compressed token map at the release's vocabulary size.

    python bench/engram_map.py                 # 129,280 ids
    python bench/engram_map.py --ids 50000 --json

Builds a synthetic byte-level BPE tokenizer.json with `--ids` ids (the 256 byte
symbols, then random strings of 2-12 bytes drawn from ASCII words, accented Latin,
CJK and emoji, so many tokens decode to whole characters and some end mid-character)
and times what the compile does with it: loading the file, the compressed map
(one decode and one normalisation per id) and writing the map. Reports seconds and
the map's size; the compile pays this once per bundle.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def synthetic_tokenizer(n: int, path: Path, seed: int = 0) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=_byte_of)
    pieces = [
        w.encode()
        for w in (
            "the",
            "The",
            " the",
            "ing",
            " and",
            "é",
            "É",
            "ü",
            "ß",
            "你",
            "好",
            "😀",
            "ﬁ",
            "  ",
            "\n",
            " ",
            "Ａ",
            "a",
            "e",
            "x",
        )
    ]
    rng = np.random.default_rng(seed)
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    while len(vocab) < n:
        data = b"".join(pieces[k] for k in rng.integers(0, len(pieces), size=rng.integers(1, 5)))
        data = data[: rng.integers(2, 13)]
        vocab.setdefault("".join(alphabet[b] for b in data), len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(path))


def _byte_of(symbol: str) -> int:
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    if ord(symbol) in printable:
        return ord(symbol)
    return [b for b in range(256) if b not in printable][ord(symbol) - 256]


def main() -> None:
    from safetensors.numpy import save_file

    from deepinfer.regions.engram_map import compressed_token_map
    from deepinfer.regions.hf_tokenizer import read_tokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ids", type=int, default=129280)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tokenizer.json"
        synthetic_tokenizer(args.ids, path)
        start = time.perf_counter()
        tok = read_tokenizer(path)
        loaded = time.perf_counter()
        token_map, count = compressed_token_map(tok)
        mapped = time.perf_counter()
        save_file({"token_map": token_map}, str(Path(tmp) / "map.safetensors"))
        written = time.perf_counter()
        out = {
            "ids": len(token_map),
            "keys": count,
            "file_bytes": path.stat().st_size,
            "load_s": loaded - start,
            "map_s": mapped - loaded,
            "write_s": written - mapped,
            "map_bytes": (Path(tmp) / "map.safetensors").stat().st_size,
        }
    if args.json:
        print(json.dumps(out))
    else:
        print(
            f"{out['ids']} ids -> {out['keys']} keys; tokenizer.json {out['file_bytes'] / 2**20:.1f} MiB loaded in "
            f"{out['load_s']:.2f} s; map {out['map_s']:.2f} s; written {out['map_bytes'] / 2**10:.0f} KiB in "
            f"{out['write_s'] * 1e3:.1f} ms",
            file=sys.stdout,
        )


if __name__ == "__main__":
    main()
