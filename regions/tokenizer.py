"""Tokenizers: the tiny checkpoint's byte-level one and a release's `tokenizer.json`.

`Tokenizer` is what the command-line tools use: `encode` (bos as configured, a
prompt's `<image>` markers as the image token), `decode` (special tokens
dropped), `chat` (messages through the chat template, where one ships).
`ByteTokenizer` serves the tiny checkpoint; `TokenizersTokenizer`
(`regions/hf_tokenizer.py`) a checkpoint or bundle that carries `tokenizer.json`.
`for_checkpoint` picks a checkpoint's; a bundle's is `runtime.bundle.tokenizer`.

The byte-level tokenizer: ids 0, 1, 2 are bos, eos and pad; byte b is id b + 3;
`image_token_id` (259 in the tiny config) marks image positions; ids above are
unused. Text is encoded as UTF-8 bytes after a leading bos. Engram's compressed
token map is the identity for it (nothing to normalise), so
`engram_compressed_vocab_size == vocab_size`.
"""

from __future__ import annotations

from pathlib import Path

from deepinfer.errors import ConfigError

# a checkpoint's tokenizer files (a bundle keeps them under their own names: bundles/layout.py)
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_FILES = (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, CHAT_TEMPLATE_FILE)

BYTE_OFFSET = 3
IMAGE_MARKER = "<image>"  # where a prompt's image goes (`--image`)


class Tokenizer:
    """The interface: `bos`, `eos`, `pad` ids and the methods below. `kind` is the manifest's name for it."""

    kind: str
    longest_token_bytes: int = 1  # the most bytes of text one token stands for (a bound, for length checks)
    bos: int | None  # None: the tokenizer has no such token (a tokenizer_config.json may set none)
    eos: int | None
    pad: int | None

    def encode_text(self, text: str, bos: bool) -> list[int]:
        """`text` as ids; with `bos`, the special tokens the tokenizer adds around a text."""
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`, special tokens left out."""
        raise NotImplementedError

    def token_bytes(self, token: int) -> bytes:
        """The UTF-8 bytes one token stands for (what logprobs report); by default its decoded text's,
        so a token holding part of a character gives U+FFFD's bytes."""
        return self.decode([token]).encode("utf-8")

    def takes_tools(self) -> bool:
        """Whether the chat template reads a `tools` variable (the functions a model may call)."""
        return False

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None) -> str:
        """`messages` ({"role", "content"}) as the chat template renders them; `tools` (OpenAI's
        `{"type": "function", "function": ...}` items) as its `tools` variable."""
        raise ConfigError(
            f"the {self.kind} tokenizer has no chat template (--chat needs a tokenizer_config.json "
            "or chat_template.jinja that ships one)"
        )

    def encode(self, text: str, bos: bool = True, image_token: int | None = None) -> list[int]:
        """`encode_text`; with `image_token`, each `<image>` marker becomes that one id."""
        if image_token is None:
            return self.encode_text(text, bos)
        parts = text.split(IMAGE_MARKER)
        ids = self.encode_text(parts[0], bos)
        for part in parts[1:]:
            ids = ids + [image_token] + self.encode_text(part, False)
        return ids

    def chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        image_token: int | None = None,
        tools: list | None = None,
    ) -> list[int]:
        """`messages` rendered by the chat template, then encoded without adding special tokens
        (the template writes them), as the ecosystem's `apply_chat_template` does."""
        text = self.render_chat(messages, add_generation_prompt, tools)
        return self.encode(text, bos=False, image_token=image_token)


class ByteTokenizer(Tokenizer):
    kind = "byte"
    bos: int
    eos: int
    pad: int

    def __init__(self, bos: int = 0, eos: int = 1, pad: int = 2):
        self.bos, self.eos, self.pad = bos, eos, pad

    def encode_text(self, text: str, bos: bool) -> list[int]:
        return ([self.bos] if bos else []) + [b + BYTE_OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        data = bytes(i - BYTE_OFFSET for i in ids if BYTE_OFFSET <= i < BYTE_OFFSET + 256)
        return data.decode("utf-8", errors="replace")

    def token_bytes(self, token: int) -> bytes:
        return bytes([token - BYTE_OFFSET]) if BYTE_OFFSET <= token < BYTE_OFFSET + 256 else b""


def for_checkpoint(directory: str | Path, config) -> Tokenizer:
    """The tokenizer of a checkpoint directory: its `tokenizer.json` (and `tokenizer_config.json`)
    where it has one, else the byte-level tokenizer with the ids of `config` (V41Config)."""
    directory = Path(directory)
    if (directory / TOKENIZER_FILE).exists():
        from deepinfer.regions.hf_tokenizer import TokenizersTokenizer

        return TokenizersTokenizer.from_dir(directory)
    return ByteTokenizer(config.bos_token_id, config.eos_token_id, config.pad_token_id)
