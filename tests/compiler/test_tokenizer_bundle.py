"""The tokenizer in the bundle: copied files, engram's token map, the checks, and the tools using them.

Fast tests call the tokenizer pass directly on a directory holding the tiny config and the
synthetic tokenizer (tests/golden/synthetic_tokenizer); the slow ones use the 12-layer exported
bundle, whose checkpoint carries that tokenizer (tests/conftest.py `with_synthetic_tokenizer`).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from click.testing import CliRunner

import deepinfer.compiler.pipeline as pipeline
from deepinfer.bundles import layout, manifest_io
from deepinfer.bundles.manifest import BundleError
from deepinfer.bundles.safetensors import load_mmap
from deepinfer.compiler.config import load_compile_config
from deepinfer.compiler.tokenizer import bundle_tokenizer, tokenizer_digests
from deepinfer.errors import ConfigError
from deepinfer.regions.config import load_config
from deepinfer.regions.tiny import tiny_config

from ..conftest import ROOT, SYNTHETIC_TOKENIZER, with_synthetic_tokenizer, write_model_toml

GOLDEN = json.loads((ROOT / "tests" / "golden" / "nemo_engram_map.json").read_text())


@pytest.fixture
def ckpt(tmp_path):
    """A checkpoint directory with the tiny config and the synthetic tokenizer (no tensors)."""
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(tiny_config()))
    return with_synthetic_tokenizer(d)


def test_tokenizer_pass_writes_files_and_map(ckpt, tmp_path):
    staging = tmp_path / "staging"
    staging.mkdir()
    entries = bundle_tokenizer(load_config(ckpt), ckpt, staging, log=lambda msg: None)
    assert sorted(entries) == ["engram_token_map", "tokenizer.json", "tokenizer_config.json"]
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert entries[name].path == f"tokenizer/{name}"
        assert (staging / entries[name].path).read_bytes() == (SYNTHETIC_TOKENIZER / name).read_bytes()
    m = entries["engram_token_map"]
    assert m.path == "host/engram_token_map.safetensors"
    stored = load_mmap(staging / m.path)[m.tensor]
    assert str(stored.dtype) == "torch.int32" and stored.tolist() == GOLDEN["map"]


def test_byte_checkpoint_writes_nothing(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny_config()))
    staging = tmp_path / "staging"
    staging.mkdir()
    assert bundle_tokenizer(load_config(tmp_path), tmp_path, staging, log=lambda msg: None) == {}
    assert list(staging.iterdir()) == [] and tokenizer_digests(tmp_path) == {}


def test_tokenizer_digests_are_a_key_part(ckpt):
    before = tokenizer_digests(ckpt)
    assert sorted(before) == ["tokenizer.json", "tokenizer_config.json"]
    config = json.loads((ckpt / "tokenizer_config.json").read_text())
    (ckpt / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": False}))
    after = tokenizer_digests(ckpt)
    assert after["tokenizer.json"] == before["tokenizer.json"]
    assert after["tokenizer_config.json"] != before["tokenizer_config.json"]


def test_count_mismatch_fails_the_compile_first(ckpt, tmp_path):
    """A config whose engram_compressed_vocab_size the tokenizer does not give is refused before any
    weight is read (this checkpoint has none), in one line naming config.json and the key; no bundle."""
    config = json.loads((ckpt / "config.json").read_text())
    config["text_config"]["engram_compressed_vocab_size"] = 99092
    (ckpt / "config.json").write_text(json.dumps(config))
    toml = write_model_toml(tmp_path / "toml", ckpt)
    out = tmp_path / "bundle"
    with pytest.raises(ConfigError) as e:
        pipeline.compile_bundle(load_compile_config(toml), out, log=lambda msg: None)
    message = str(e.value)
    assert message.startswith(f"{ckpt / 'config.json'}: text_config.engram_compressed_vocab_size is 99092, ")
    assert "246 distinct keys" in message and "\n" not in message
    assert not out.exists() and not list(tmp_path.glob(".bundle.tmp-*"))


def test_damaged_tokenizer_fails_the_compile_in_one_line(ckpt, tmp_path):
    (ckpt / "tokenizer.json").write_text("{ not json")
    toml = write_model_toml(tmp_path / "toml", ckpt)
    with pytest.raises(ConfigError, match=r"tokenizer.json: not a readable tokenizer.json") as e:
        pipeline.compile_bundle(load_compile_config(toml), tmp_path / "bundle", log=lambda msg: None)
    assert "\n" not in str(e.value)


# --- the compiled bundle (slow) ---------------------------------------------------------------------


def test_bundle_records_its_tokenizer(exported_bundle_12, exported_bundle):
    m = manifest_io.read(exported_bundle_12)
    assert m.model.tokenizer == "tokenizers"
    for name in ("tokenizer.json", "tokenizer_config.json", "engram_token_map"):
        assert (
            m.files[m.host[name].path]
            == m.host[name].digest
            == manifest_io.sha256_file(exported_bundle_12 / m.host[name].path)
        )
    stored = load_mmap(exported_bundle_12 / m.host["engram_token_map"].path)["token_map"]
    assert stored.tolist() == GOLDEN["map"]
    byte = manifest_io.read(exported_bundle)
    assert byte.model.tokenizer == "byte" and sorted(byte.host) == ["embed", "engram", "vision"]


@pytest.fixture
def bundle12_copy(exported_bundle_12, tmp_path):
    return shutil.copytree(exported_bundle_12, tmp_path / "bundle")


def test_missing_or_altered_tokenizer_is_refused(bundle12_copy):
    from deepinfer.runtime import open_bundle
    from deepinfer.runtime.bundle import tokenizer

    path = bundle12_copy / "tokenizer" / "tokenizer.json"
    text = path.read_text()
    path.write_text(text.replace('"<|user|>"', '"<|usr|>"'))
    with pytest.raises(BundleError, match=r"tokenizer/tokenizer.json does not match its digest"):
        open_bundle(bundle12_copy)
    path.write_text(text[:100])  # without the digest check: one line from the reader
    with pytest.raises(ConfigError, match=r"tokenizer/tokenizer.json: not a readable tokenizer.json"):
        tokenizer(open_bundle(bundle12_copy, verify=False))
    path.unlink()
    with pytest.raises(BundleError, match=r"missing file tokenizer/tokenizer.json"):
        open_bundle(bundle12_copy, verify=False)


@pytest.mark.parametrize("drop", ["tokenizer.json", "engram_token_map"])
def test_manifest_without_tokenizer_entries_is_refused(bundle12_copy, drop):
    data = json.loads((bundle12_copy / layout.MANIFEST_FILE).read_text())
    del data["host"][drop]
    with pytest.raises(BundleError, match=r"manifest.json: host: (lacks tokenizer.json|an engram_token_map goes)"):
        manifest_io.parse(data, str(bundle12_copy / layout.MANIFEST_FILE))


def test_run_chat_through_the_bundle_matches_the_reference(exported_bundle_12, tiny12_ckpt, tmp_path):
    """deepinfer-run --chat: the prompt is the chat template's ids, and the logits agree with the
    reference on the same checkpoint (both hash through the compressed map); hashing raw ids
    instead moves the reference's logits well past that agreement."""
    import torch

    from deepinfer.regions.engram_hash import EngramHasher
    from deepinfer.regions.reference import ReferenceModel
    from deepinfer.runtime.cli import main
    from deepinfer.runtime.schedule import decode_model

    dump = tmp_path / "run.safetensors"
    result = CliRunner().invoke(
        main,
        [
            str(exported_bundle_12),
            "--chat",
            "--prompt",
            "Hé",
            "--max-new-tokens",
            "3",
            "--json",
            "--dump-logits",
            str(dump),
        ],
    )
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)["outputs"][0]
    assert out["prompt_ids"] == [0, 260, ord("H") + 3, 262 + 7, 261]  # <s><|user|>H é<|assistant|>
    run = load_mmap(dump)
    ref = ReferenceModel(tiny12_ckpt, dtype="fp32", cache_quant=True, ties="lowest")
    tokens = run["tokens"].tolist()[:-1]  # teacher-forced, fed as the bundle was
    logits = torch.stack(decode_model(ref, [tokens], 1, chunk=1)[0].logits)
    assert logits.shape == run["logits"].shape
    scale = logits.abs().max()
    close = float((run["logits"] - logits).abs().max() / scale)
    assert close < 1e-4
    ref.hasher = EngramHasher(ref.config.text, np.arange(288))  # raw ids: the identity map
    raw = torch.stack(decode_model(ref, [tokens], 1, chunk=1)[0].logits)
    assert float((raw - logits).abs().max() / scale) > 100 * max(close, 1e-6)


def test_chat_without_template_is_one_line(exported_bundle):
    from deepinfer.runtime.cli import main

    result = CliRunner().invoke(main, [str(exported_bundle), "--chat", "--prompt", "Hi"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        "error: the byte tokenizer has no chat template (--chat needs a tokenizer_config.json or "
        "chat_template.jinja that ships one)"
    ]
