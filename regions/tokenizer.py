"""The tiny checkpoint's byte-level tokenizer.

ids 0, 1, 2 are bos, eos and pad; byte b is id b + 3; `image_token_id` (259 in
the tiny config) marks image positions (a prompt's `<image>` marker becomes
it when images are given); ids above are unused. Text is encoded
as UTF-8 bytes after a leading bos. Engram's compressed token map is the
identity for this tokenizer (nothing to normalise), so
`engram_compressed_vocab_size == vocab_size`.
"""

from __future__ import annotations

BYTE_OFFSET = 3
IMAGE_MARKER = "<image>"      # where a prompt's image goes (`--image`)


class ByteTokenizer:
    def __init__(self, bos: int = 0, eos: int = 1, pad: int = 2):
        self.bos, self.eos, self.pad = bos, eos, pad

    def encode(self, text: str, bos: bool = True, image_token: int | None = None) -> list[int]:
        """UTF-8 bytes after a leading bos; with `image_token`, each `<image>` marker becomes that one id."""
        if image_token is not None:
            parts = [self.encode(part, bos=False) for part in text.split(IMAGE_MARKER)]
            ids = parts[0]
            for part in parts[1:]:
                ids = ids + [image_token] + part
            return ([self.bos] if bos else []) + ids
        return ([self.bos] if bos else []) + [b + BYTE_OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        data = bytes(i - BYTE_OFFSET for i in ids if BYTE_OFFSET <= i < BYTE_OFFSET + 256)
        return data.decode("utf-8", errors="replace")
