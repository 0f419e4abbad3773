"""Tokenizers and engram's compressed token map.

The map and the hashes are held to NeMo AutoModel 0.7.0's own functions run on the
synthetic tokenizer of tests/golden/synthetic_tokenizer/ (the golden and how it was
made: tests/golden/nemo_engram_map.py). Expected ids elsewhere follow from how that
tokenizer was built (tests/golden/synthetic_tokenizer.py: byte b is id b + 3, the
merged tokens from 262 in MERGES order), not from the code under test.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from deepinfer.errors import ConfigError
from deepinfer.regions.config import parse_config
from deepinfer.regions.engram_hash import EngramHasher
from deepinfer.regions.engram_map import checked_token_map, compressed_token_map
from deepinfer.regions.hf_tokenizer import ChatTemplateError, TokenizersTokenizer, read_tokenizer
from deepinfer.regions.tiny import tiny_config
from deepinfer.regions.tokenizer import ByteTokenizer, for_checkpoint

GOLDEN_DIR = Path(__file__).resolve().parent.parent / "golden"
SYNTH = GOLDEN_DIR / "synthetic_tokenizer"
GOLDEN = json.loads((GOLDEN_DIR / "nemo_engram_map.json").read_text())


def _builder():
    spec = importlib.util.spec_from_file_location("synthetic_tokenizer", GOLDEN_DIR / "synthetic_tokenizer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tok() -> TokenizersTokenizer:
    return TokenizersTokenizer.from_dir(SYNTH)


def engram_config(**engram):
    """The tiny text config with the golden's engram settings (and `engram` on top)."""
    text = parse_config(tiny_config()).text
    return dataclasses.replace(
        text, **{k: tuple(v) if isinstance(v, list) else v for k, v in {**GOLDEN["engram"], **engram}.items()}
    )


# --- the compressed token map against NeMo's ------------------------------------------------------


def test_golden_is_of_this_tokenizer():
    digest = "sha256:" + hashlib.sha256((SYNTH / "tokenizer.json").read_bytes()).hexdigest()
    assert digest == GOLDEN["tokenizer_sha256"], "the golden was made from another tokenizer.json: regenerate it"


def test_map_matches_nemo(tok):
    token_map, count = compressed_token_map(tok.backend)
    assert count == GOLDEN["count"] == 246
    assert token_map.tolist() == GOLDEN["map"]


def test_map_merges_what_normalisation_merges():
    """The collisions the synthetic vocabulary was built for, read off NeMo's map."""
    m = GOLDEN["map"]
    byte = {ch: ord(ch) + 3 for ch in "aefhi "}
    merged = {text: 262 + i for i, (text, _, _) in enumerate(_builder().MERGES)}
    assert m[byte["a"]] == m[ord("A") + 3] == m[merged["Ａ"]]  # case, fullwidth
    assert m[merged["He"]] == m[merged["he"]] == m[merged["HE"]] == m[merged[" he"]]
    assert m[merged["é"]] == m[merged["è"]] == m[merged["É"]] == m[byte["e"]]  # accents
    assert m[merged["café"]] == m[merged["cafe"]] != m[merged["caf"]]
    assert m[merged["ﬁ"]] == m[merged["fi"]]  # compatibility form
    spaces = [byte[" "], ord("\t") + 3, ord("\n") + 3, merged["  "], merged["\n\n"], merged["\r\n"], merged["\u00a0"]]
    assert len({m[i] for i in spaces}) == 1  # runs and lone spaces
    partial = [0x80 + 3, 0xC3 + 3, merged[b"\xe4\xbd"], merged[b"\xf0\x9f\x98"]]
    assert len({m[i] for i in partial}) == len(partial)  # undecodable: own keys
    assert m[merged[b"\xe4\xbd"]] != m[merged["你"]]


def test_count_mismatch_is_one_line_naming_the_key(tok):
    c = engram_config(engram_compressed_vocab_size=99092)
    with pytest.raises(
        ConfigError,
        match=r"^ckpt/config.json: text_config.engram_compressed_vocab_size is 99092, "
        r"but ckpt/tokenizer.json normalises to 246 distinct keys",
    ) as e:
        checked_token_map(tok.backend, c, "ckpt/tokenizer.json", "ckpt/config.json")
    assert "\n" not in str(e.value)


# --- the hashes: NeMo's, through the map, the pad id too -----------------------------------------


def test_hashes_match_nemo(tok):
    c = engram_config()
    token_map = checked_token_map(tok.backend, c, "tokenizer.json", "config.json")
    hasher = EngramHasher(c, token_map)
    ids = GOLDEN["ids"]
    assert (
        hasher.pad == GOLDEN["map"][GOLDEN["engram"]["engram_pad_token_id"]] != GOLDEN["engram"]["engram_pad_token_id"]
    )
    assert hasher.hashes(ids, 0, len(ids)).tolist() == GOLDEN["hashes"]
    masked = np.zeros(len(ids), dtype=bool)
    masked[GOLDEN["masked_position"]] = True
    assert hasher.hashes(ids, 0, len(ids), masked).tolist() == GOLDEN["masked_hashes"]
    # a suffix computed alone sees the same history
    assert hasher.hashes(ids, 7, len(ids) - 7).tolist() == GOLDEN["hashes"][7:]


def test_identity_hashes_differ(tok):
    """The map matters: hashing raw ids (an identity map) gives other rows for this prompt."""
    c = engram_config()
    ids = GOLDEN["ids"]
    identity = EngramHasher(c, np.arange(len(GOLDEN["map"]))).hashes(ids, 0, len(ids))
    assert (identity != np.array(GOLDEN["hashes"])).any()


def test_byte_tokenizer_keeps_the_identity_check():
    c = dataclasses.replace(parse_config(tiny_config()).text, engram_compressed_vocab_size=246)
    with pytest.raises(ConfigError, match="engram_compressed_vocab_size=246 differs from vocab_size=288"):
        EngramHasher(c)


def test_unknown_id_is_refused(tok):
    c = engram_config()
    hasher = EngramHasher(c, checked_token_map(tok.backend, c, "tokenizer.json", "config.json"))
    with pytest.raises(ValueError, match="token id 288 is outside the tokenizer's 288 ids"):
        hasher.hashes([0, 5, 288], 0, 3)


# --- encode / decode -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    ["Hello, world", "café Crème brûlée", "naïve 你好 😀🚀", "  two\tspaces\n\nand\r\n", "ﬁ Ａ\u00a0e\u0301", ""],
)
def test_round_trip(tok, text):
    ids = tok.encode(text, bos=False)
    assert tok.decode(ids) == text
    assert tok.encode(text) == [0] + ids  # add_bos_token true, add_eos_token false


def test_encode_uses_the_merges(tok):
    merged = {text: 262 + i for i, (text, _, _) in enumerate(_builder().MERGES)}
    assert tok.encode("Hello", bos=False) == [merged["He"], ord("l") + 3, ord("l") + 3, ord("o") + 3]
    assert tok.encode("café 😀", bos=False) == [merged["café"], ord(" ") + 3, merged["😀"]]


def test_special_tokens(tok):
    assert (tok.bos, tok.eos, tok.pad) == (0, 1, 2)
    assert tok.encode("<|user|>Hi</s>", bos=False) == [260, ord("H") + 3, ord("i") + 3, 1]
    assert tok.decode([0, 260, 265, 1, 259, 2]) == "He"  # special tokens dropped


def test_post_processor_decides_without_flags(tmp_path):
    """No add_bos_token / add_eos_token in the config: tokenizer.json's post-processor adds what it adds."""
    from tokenizers import processors

    backend = read_tokenizer(SYNTH / "tokenizer.json")
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 0), ("</s>", 1)]
    )
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    t = TokenizersTokenizer.from_dir(tmp_path)
    assert t.encode("hi") == [0, ord("h") + 3, ord("i") + 3, 1]
    assert t.encode("hi", bos=False) == [ord("h") + 3, ord("i") + 3]


def test_byte_tokenizer_unchanged():
    t = ByteTokenizer()
    assert t.encode("Hé") == [0, 72 + 3, 0xC3 + 3, 0xA9 + 3]
    assert t.encode("a<image>b", image_token=259) == [0, 97 + 3, 259, 98 + 3]
    assert t.decode([0, 75, 3 + 0xC3, 3 + 0xA9, 1]) == "Hé"


def test_image_marker(tok):
    assert tok.encode("<image>Hi", image_token=259) == [0, 259, ord("H") + 3, ord("i") + 3]


# --- chat template ---------------------------------------------------------------------------------

MESSAGES = [
    {"role": "system", "content": "Be terse."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello"},
    {"role": "user", "content": "Bye"},
]


def test_chat_template_renders(tok):
    assert tok.render_chat(MESSAGES) == "<s>Be terse.\n<|user|>Hi<|assistant|>Hello</s><|user|>Bye<|assistant|>"
    assert tok.render_chat(MESSAGES[:2], add_generation_prompt=False) == "<s>Be terse.\n<|user|>Hi"


def test_chat_ids_have_one_bos(tok):
    ids = tok.chat([{"role": "user", "content": "Hi"}])
    assert ids == [0, 260, ord("H") + 3, ord("i") + 3, 261]


def test_chat_template_raise_exception_is_one_line(tok):
    with pytest.raises(ChatTemplateError, match="chat template: unknown role tool$"):
        tok.render_chat([{"role": "tool", "content": "x"}])


def test_chat_template_is_sandboxed(tmp_path):
    shutil.copy(SYNTH / "tokenizer.json", tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": "{{ messages.__class__.__mro__[1].__subclasses__() }}"})
    )
    with pytest.raises(ChatTemplateError, match="unsafe"):
        TokenizersTokenizer.from_dir(tmp_path).render_chat(MESSAGES)


def test_chat_template_file_and_tojson(tmp_path):
    shutil.copy(SYNTH / "tokenizer.json", tmp_path)
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['content'] | tojson }}{% if loop.first %}{% break %}{% endif %}{% endfor %}"
    )
    t = TokenizersTokenizer.from_dir(tmp_path)
    assert t.render_chat([{"role": "user", "content": "café"}, {"role": "user", "content": "x"}]) == '"café"'
    assert t.bos is None and t.encode("hi") == [ord("h") + 3, ord("i") + 3]  # no config, no post-processor


def test_no_chat_template_is_one_line():
    with pytest.raises(ConfigError, match="the byte tokenizer has no chat template"):
        ByteTokenizer().chat([{"role": "user", "content": "Hi"}])


# --- bad files -------------------------------------------------------------------------------------


def test_damaged_tokenizer_json_is_one_line(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": ')
    with pytest.raises(ConfigError, match=r"tokenizer.json: not a readable tokenizer.json") as e:
        for_checkpoint(tmp_path, None)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "config, message",
    [
        ({"bos_token": "<bos>"}, "bos_token: '<bos>' is not a token of"),
        ({"eos_token": 7}, "eos_token: expected a token string"),
        ({"add_bos_token": True}, "add_bos_token is true but bos_token is not set"),
        ({"chat_template": 3}, "chat_template: expected a template string"),
    ],
)
def test_bad_tokenizer_config_names_the_key(tmp_path, config, message):
    shutil.copy(SYNTH / "tokenizer.json", tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=f"tokenizer_config.json: {message}"):
        TokenizersTokenizer.from_dir(tmp_path)


def test_synthetic_tokenizer_is_rebuilt_identically(tmp_path):
    """The committed files are what the builder writes (same tokens, merges and config)."""
    _builder().write(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert json.loads((tmp_path / name).read_text()) == json.loads((SYNTH / name).read_text()), name
