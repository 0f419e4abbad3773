"""Engram's compressed token map: tokenizer ids -> ids of their normalised strings.

The released contract (NeMo AutoModel 0.7.0, `deepseek_v41/engram.py`): every id of
the tokenizer (added tokens included) is decoded on its own, special tokens kept.
A string holding U+FFFD (a partial UTF-8 sequence: the id is a lone byte or an
unfinished character) is keyed by the token's own string. Any other string is
normalised by the `tokenizers` sequence NFKC, NFD, StripAccents, Lowercase, runs
of `[ \\t\\r\\n]` to one space, then Strip, except that a string that is then a
lone space stays one space (a private-use sentinel carries it through Strip);
an empty result falls back to the decoded string itself. Distinct keys are
numbered in order of first appearance, and that count must equal the config's
`engram_compressed_vocab_size`: the hash multipliers are drawn below a bound
that depends on it.

Cost at release scale (129,280 ids, `bench/engram_map.py`): 1.5 to 3.7 s on a shared
2-core machine (about half of it decoding; `decode_batch` is no faster); the map is computed once at
compile time and stored in the bundle as int32 (505 KiB).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from deepinfer.errors import ConfigError
from deepinfer.regions.config import TextConfig

LONE_SPACE = "\ue000"  # private use: survives Strip, then becomes the space again
REPLACEMENT = "\ufffd"  # what a decoder yields for bytes that are no complete character


def _normalizer():
    from tokenizers import Regex, normalizers

    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), LONE_SPACE),
            normalizers.Strip(),
            normalizers.Replace(LONE_SPACE, " "),
        ]
    )


def compressed_token_map(tokenizer) -> tuple[np.ndarray, int]:
    """(int32 [ids] map, number of distinct keys) for a `tokenizers.Tokenizer`."""
    size = tokenizer.get_vocab_size(with_added_tokens=True)  # transformers' len(tokenizer)
    normalizer = _normalizer()
    numbers: dict[str, int] = {}
    out = np.empty(size, dtype=np.int32)
    for i in range(size):
        text = tokenizer.decode([i], skip_special_tokens=False)
        if REPLACEMENT in text:
            key = tokenizer.id_to_token(i)
        else:
            key = normalizer.normalize_str(text) or text
        out[i] = numbers.setdefault(key, len(numbers))
    return out, len(numbers)


def checked_token_map(tokenizer, c: TextConfig, tokenizer_file: str | Path, config_file: str | Path) -> np.ndarray:
    """The map of `tokenizer`, its key count held to `engram_compressed_vocab_size` and its
    length to the model's vocabulary (ConfigError naming the file and key otherwise)."""
    token_map, count = compressed_token_map(tokenizer)
    if count != c.engram_compressed_vocab_size:
        raise ConfigError(
            f"{config_file}: text_config.engram_compressed_vocab_size is {c.engram_compressed_vocab_size}, but "
            f"{tokenizer_file} normalises to {count} distinct keys (the engram hashes need the tokenizer the "
            "model was trained with)"
        )
    if len(token_map) > c.vocab_size:
        raise ConfigError(
            f"{config_file}: text_config.vocab_size is {c.vocab_size}, but {tokenizer_file} has {len(token_map)} ids"
        )
    if not 0 <= c.engram_pad_token_id < len(token_map):
        raise ConfigError(
            f"{config_file}: text_config.engram_pad_token_id {c.engram_pad_token_id} is outside "
            f"the {len(token_map)} ids of {tokenizer_file}"
        )
    return token_map
