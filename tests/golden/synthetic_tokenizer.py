"""A 288-id byte-level BPE tokenizer, built with `tokenizers`, whose vocabulary collides
under engram's normalisation.

    python tests/golden/synthetic_tokenizer.py      # rewrites tests/golden/synthetic_tokenizer/

Its ids follow the tiny checkpoint's byte tokenizer (0, 1, 2 bos, eos, pad; byte b is
b + 3; 259 the image token), so a tiny checkpoint (vocab 288) can carry it. The 26
merged tokens after the chat tokens make the collisions the compressed map must
resolve as NeMo does: case (He, he, HE), a leading space (" he"), accents (é, è, É,
café and cafe), compatibility forms (the ligature "ﬁ" and "fi", fullwidth "Ａ"),
whitespace runs and a non-breaking space (all one space), a lone combining accent
(normalises to nothing), and partial UTF-8 sequences (the first bytes of "你", "ﬁ",
"Ａ" and an emoji, undecodable alone, like the 128 bytes above 0x7f).
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "synthetic_tokenizer"
SPECIALS = {0: "<s>", 1: "</s>", 2: "<pad>", 259: "<image>", 260: "<|user|>", 261: "<|assistant|>"}
# merged tokens in merge order, as the text they stand for (each is a merge of two earlier tokens)
MERGES = [
    ("  ", " ", " "),
    ("\n\n", "\n", "\n"),
    ("\r\n", "\r", "\n"),
    ("He", "H", "e"),
    ("he", "h", "e"),
    ("HE", "H", "E"),
    (" he", " ", "he"),
    ("é", b"\xc3", b"\xa9"),
    ("è", b"\xc3", b"\xa8"),
    ("É", b"\xc3", b"\x89"),
    ("ca", "c", "a"),
    ("caf", "ca", "f"),
    ("café", "caf", "é"),
    ("cafe", "caf", "e"),
    (b"\xef\xac", b"\xef", b"\xac"),
    ("ﬁ", b"\xef\xac", b"\x81"),
    ("fi", "f", "i"),
    (b"\xe4\xbd", b"\xe4", b"\xbd"),
    ("你", b"\xe4\xbd", b"\xa0"),
    (b"\xef\xbc", b"\xef", b"\xbc"),
    ("Ａ", b"\xef\xbc", b"\xa1"),
    ("\u0301", b"\xcc", b"\x81"),
    ("\u00a0", b"\xc2", b"\xa0"),
    (b"\xf0\x9f", b"\xf0", b"\x9f"),
    (b"\xf0\x9f\x98", b"\xf0\x9f", b"\x98"),
    ("😀", b"\xf0\x9f\x98", b"\x80"),
]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}\n"
    "{% elif m['role'] == 'user' %}<|user|>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<|assistant|>{{ m['content'] }}{{ eos_token }}"
    "{% else %}{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CONFIG = {
    "add_bos_token": True,
    "add_eos_token": False,
    "bos_token": "<s>",
    "eos_token": {"content": "</s>", "special": True, "__type": "AddedToken"},
    "pad_token": "<pad>",
    "chat_template": CHAT_TEMPLATE,
    "tokenizer_class": "PreTrainedTokenizerFast",
}


def _bytes(text) -> bytes:
    return text if isinstance(text, bytes) else text.encode("utf-8")


def build():
    """The tokenizer (a `tokenizers.Tokenizer`), deterministic."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    order = sorted(alphabet, key=lambda ch: _byte_of(ch))  # the 256 byte symbols by byte value

    def symbols(data: bytes) -> str:
        return "".join(order[b] for b in data)

    vocab = {name: i for i, name in SPECIALS.items()}
    vocab.update({order[b]: b + 3 for b in range(256)})
    merges = []
    for whole, left, right in MERGES:
        merges.append((symbols(_bytes(left)), symbols(_bytes(right))))
        vocab[symbols(_bytes(whole))] = len(vocab)
    assert sorted(vocab.values()) == list(range(288)), "ids must be 0..287"
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(SPECIALS[i], special=True, normalized=False) for i in sorted(SPECIALS)])
    return tok


def _byte_of(symbol: str) -> int:
    """The byte a ByteLevel symbol stands for (GPT-2's printable mapping of the 256 bytes)."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    if ord(symbol) in printable:
        return ord(symbol)
    others = [b for b in range(256) if b not in printable]
    return others[ord(symbol) - 256]


def write(directory: Path = OUT) -> Path:
    """tokenizer.json and tokenizer_config.json into `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    build().save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(CONFIG, indent=1, ensure_ascii=False) + "\n")
    return directory


if __name__ == "__main__":
    print(f"wrote {write()}")
