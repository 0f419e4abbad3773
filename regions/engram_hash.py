"""Host-side n-gram hashes that address the engram tables.

For engram layer `l` (its index `li` among `engram_layer_ids`), position p and
n-gram size m in 2..max_ngram: tokens at shifts 0..max_ngram-1 (the pad id
before the sequence start, or once any earlier shift crossed a masked token)
are multiplied by the layer's odd multipliers (numpy `default_rng(10007 * l)`),
XOR-folded, and for each of `engram_n_heads` heads reduced `mod prime + offset`.
Primes are consecutive primes above `engram_vocab_size - 1`, distinct across all
layers and sizes; offsets are the running sums of a layer's primes.

Token ids go through the engram compressed token map first, the pad id too (as
NeMo AutoModel does): the map a `tokenizers` tokenizer's bundle carries
(`regions/engram_map.py`), or the identity for the byte-level tokenizer (nothing
to normalise), which requires `engram_compressed_vocab_size == vocab_size`.
"""

from __future__ import annotations

import math

import numpy as np

from deepinfer.errors import ConfigError
from deepinfer.regions.config import TextConfig


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


class EngramHasher:
    """`token_map` (int [tokenizer ids]): the compressed token map, None for the identity."""

    def __init__(self, c: TextConfig, token_map: np.ndarray | None = None):
        if token_map is None and c.engram_layer_ids and c.engram_compressed_vocab_size != c.vocab_size:
            raise ConfigError(
                f"config.json: text_config.engram_compressed_vocab_size={c.engram_compressed_vocab_size} differs "
                f"from vocab_size={c.vocab_size}: the byte-level tokenizer hashes through the identity map; a "
                "model with a compressed vocabulary needs its tokenizer.json beside config.json"
            )
        self.token_map = None if token_map is None else np.asarray(token_map, dtype=np.int64)
        self.max_ngram = c.engram_max_ngram_size
        self.heads = c.engram_n_heads
        self.pad = c.engram_pad_token_id if self.token_map is None else int(self.token_map[c.engram_pad_token_id])
        bound = max(1, (np.iinfo(np.int64).max // max(c.engram_compressed_vocab_size, 1)) // 2)
        seen: set[int] = set()
        self.primes, self.offsets, self.multipliers = [], [], []
        for layer, rows in zip(c.engram_layer_ids, c.engram_num_embeddings):
            primes = []
            for _ in range(self.max_ngram - 1):
                p = c.engram_vocab_size - 1
                for _ in range(self.heads):
                    p += 1
                    while not _is_prime(p) or p in seen:
                        p += 1
                    seen.add(p)
                    primes.append(p)
            if sum(primes) > rows:
                raise ConfigError(
                    f"config.json: text_config.engram_num_embeddings: layer {layer} needs "
                    f"{sum(primes)} rows for its hash buckets, has {rows}"
                )
            rng = np.random.default_rng(10007 * layer)
            self.primes.append(np.array(primes, dtype=np.int64))
            self.offsets.append(np.cumsum([0] + primes[:-1]).astype(np.int64))
            self.multipliers.append(rng.integers(0, bound, size=self.max_ngram, dtype=np.int64) * 2 + 1)

    def compress(self, ids: np.ndarray) -> np.ndarray:
        """Token ids -> compressed ids (a ValueError for an id the tokenizer does not have, as NeMo)."""
        if self.token_map is None:
            return ids
        if ids.size and (ids.min() < 0 or ids.max() >= len(self.token_map)):
            bad = ids[(ids < 0) | (ids >= len(self.token_map))][0]
            raise ValueError(
                f"token id {bad} is outside the tokenizer's {len(self.token_map)} ids: "
                "the engram token map has no entry for it"
            )
        return self.token_map[ids]

    def hashes(self, ids: np.ndarray, start: int, count: int, masked: np.ndarray | None = None) -> np.ndarray:
        """Rows for positions start..start+count-1 of one sequence -> int64 [count, layers, hash_heads].

        ids: the sequence's token ids up to at least start+count-1; masked (bool,
        same length, optional): positions (image tokens) that block the n-grams.
        """
        ids = self.compress(np.asarray(ids, dtype=np.int64)[: start + count])
        pos = np.arange(start, start + count)
        blocked = np.zeros(count, dtype=bool)
        columns = []
        for shift in range(self.max_ngram):
            src = pos - shift
            ok = src >= 0
            tok = ids[np.maximum(src, 0)]
            blocked |= ~ok
            if masked is not None:
                blocked |= np.asarray(masked, dtype=bool)[np.maximum(src, 0)] & ok
            columns.append(np.where(blocked, self.pad, tok))
        tokens = np.stack(columns, axis=-1)  # [count, max_ngram]
        out = []
        for primes, offsets, mult in zip(self.primes, self.offsets, self.multipliers):
            products = tokens * mult  # [count, max_ngram]
            rolling, heads = products[:, 0], []
            for shift in range(1, self.max_ngram):
                rolling = rolling ^ products[:, shift]
                p = primes[(shift - 1) * self.heads : shift * self.heads]
                heads.append(rolling[:, None] % p)
            out.append(np.concatenate(heads, axis=-1) + offsets)
        return np.stack(out, axis=1)

    def step(self, histories: list, positions, masks: list | None = None) -> np.ndarray:
        """Rows for a [B, T] step -> int64 [B, T, layers, hash_heads] (0 at padding).

        histories[b]: sequence b's ids up to its last position in the step;
        positions: [B, T] (valid positions first and consecutive, -1 padding);
        masks[b] (optional, may be shorter than the history or None): image positions.
        """
        positions = np.asarray(positions)
        B, T = positions.shape
        out = np.zeros((B, T, len(self.primes), self.heads * (self.max_ngram - 1)), dtype=np.int64)
        for b in range(B):
            n = int((positions[b] >= 0).sum())
            if n:
                m = masks[b] if masks is not None and b < len(masks) else None
                if m is not None:  # generated tokens (beyond the prompt) are text
                    m = np.pad(np.asarray(m, dtype=bool), (0, max(0, len(histories[b]) - len(m))))
                out[b, :n] = self.hashes(histories[b], int(positions[b, 0]), n, m)
        return out
