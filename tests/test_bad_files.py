"""Every file deepinfer parses, damaged as a hostile user or a careless operator would damage it
(issue 33, "What broke"): one line naming the file (and the key), exit status 2 from the CLIs, never
a traceback, a hang or an unbounded read. The cache heals: a corrupt entry or memo is a miss,
reported once and rewritten (tests/test_bad_cache.py)."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
from click.testing import CliRunner

from deepinfer.bundles.safetensors import read_header
from deepinfer.cli import main as deepinfer
from deepinfer.errors import DeepinferError, TensorFileError
from deepinfer.runtime.cli import main as deepinfer_run

DEEP = "[" * 100_000 + "]" * 100_000  # a RecursionError in json.loads, before the reader
HUGE = "1" * 5000  # a ValueError in int() (Python's 4300-digit limit), before the reader
TOML = """[model]
checkpoint = "{checkpoint}"
dtype = "fp32"

[target]
name = "cpu"
executable = "exported"

[buckets]
batch = [1]
tokens = [1]
max_context = 32

[kv]
block_size = 16
num_blocks = 8
"""


def one_line(result, path: Path | str, *words: str) -> str:
    """The CLI failed with exit status 2 and one line naming `path` (and each of `words`)."""
    out = result.output
    assert result.exit_code == 2, (result.exit_code, out, result.exception)
    assert out.count("\n") == 1 and out.startswith("error: "), out
    assert str(path) in out and all(w in out for w in words), out
    return out


def plan(toml: Path):
    return CliRunner().invoke(deepinfer, ["plan", str(toml), "--no-scratch", "--no-cache"])


@pytest.fixture
def ckpt(tmp_path, tiny_ckpt) -> Path:
    """A copy of the tiny checkpoint (config.json, index, shard) and a model.toml naming it."""
    out = shutil.copytree(tiny_ckpt, tmp_path / "ckpt")
    (tmp_path / "model.toml").write_text(TOML.format(checkpoint=out))
    return out


# --- safetensors headers ---------------------------------------------------------------------------


def safetensors(path: Path, header: str | bytes, data: int = 16) -> Path:
    raw = header.encode() if isinstance(header, str) else header
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(data))
    return path


W = '"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}'
HEADERS = {
    "nested deep": ('{"w": ' + DEEP + "}", "nested"),
    "nested deep in __metadata__": ('{"__metadata__": {"a": ' + DEEP + "}, " + W + "}", "nested"),
    "5000-digit offset": ('{"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, ' + HUGE + "]}}", "5000 digits"),
    "a tensor named twice": ("{" + W + ", " + W + "}", "'w' appears twice"),
    "__metadata__ not flat": ('{"__metadata__": {"a": {"b": "c"}}, ' + W + "}", "__metadata__"),
    "__metadata__ a list": ('{"__metadata__": [1], ' + W + "}", "__metadata__"),
    "a dimension of 2**64": (
        '{"w": {"dtype": "F32", "shape": [18446744073709551616], "data_offsets": [0, 16]}}',
        "shape",
    ),
    "a dtype that is a list": ('{"w": {"dtype": [1], "shape": [4], "data_offsets": [0, 16]}}', "dtype"),
    "not UTF-8": (b'{"w\xff": 1}', "UTF-8"),
}


@pytest.mark.parametrize("case", HEADERS)
def test_bad_safetensors_header_is_one_line(tmp_path, case):
    header, words = HEADERS[case]
    path = safetensors(tmp_path / "t.safetensors", header)
    with pytest.raises(TensorFileError) as e:
        read_header(str(path))
    assert str(path) in str(e.value) and words in str(e.value) and "\n" not in str(e.value)


def test_bad_header_through_the_cli(ckpt):
    (ckpt / "model.safetensors.index.json").unlink()
    shard = safetensors(ckpt / "model.safetensors", "{" + W + ", " + W + "}")
    one_line(plan(ckpt.parent / "model.toml"), shard, "appears twice")


@pytest.mark.parametrize("target", ["/dev/zero", "loop"])
def test_a_shard_that_is_a_device_or_a_symlink_loop(tmp_path, target):
    path = tmp_path / "t.safetensors"
    path.symlink_to(target if target.startswith("/") else path)
    with pytest.raises(TensorFileError) as e:
        read_header(str(path))
    assert str(path) in str(e.value) and "\n" not in str(e.value)


# --- checkpoint index, config.json, quantization_config --------------------------------------------


def edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def test_index_entry_naming_a_missing_file(ckpt):
    index = ckpt / "model.safetensors.index.json"
    edit_json(index, lambda d: d["weight_map"].update({"embed.weight": "gone.safetensors"}))
    one_line(plan(ckpt.parent / "model.toml"), index, "weight_map['embed.weight']", "no such file")


def test_index_entry_naming_a_directory(ckpt):
    index = ckpt / "model.safetensors.index.json"
    (ckpt / "sub").mkdir()
    edit_json(index, lambda d: d["weight_map"].update({"embed.weight": "sub"}))
    one_line(plan(ckpt.parent / "model.toml"), index, "weight_map['embed.weight']", "a directory")


def test_symlink_loop_in_a_checkpoint(ckpt):
    shard = ckpt / "model.safetensors"
    shard.unlink()
    shard.symlink_to(ckpt / "loop.safetensors")
    (ckpt / "loop.safetensors").symlink_to(shard)
    one_line(plan(ckpt.parent / "model.toml"), ckpt / "model.safetensors.index.json", "model.safetensors")


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json"])
def test_symlink_loop_for_the_checkpoint_json(ckpt, name):
    (ckpt / name).unlink()
    (ckpt / name).symlink_to(ckpt / name)
    one_line(plan(ckpt.parent / "model.toml"), ckpt / name)


@pytest.mark.parametrize(
    "name, text, words",
    [
        ("config.json", '{"model_type": "deepseek_v41", "text_config": ' + DEEP + "}", "nested"),
        ("config.json", '{"model_type": "deepseek_v41", "bos_token_id": ' + HUGE + "}", "5000 digits"),
        ("config.json", b'{"model_type": "deepseek_v41\xc3\x28"}', "UTF-8"),
        ("config.json", '{"model_type": "deepseek_v41", "model_type": "x"}', "appears twice"),
        ("model.safetensors.index.json", '{"weight_map": ' + DEEP + "}", "nested"),
        ("model.safetensors.index.json", '{"metadata": {"total_size": ' + HUGE + "}}", "5000 digits"),
        ("model.safetensors.index.json", "[1]", "weight_map"),
    ],
    ids=[
        "config-deep",
        "config-5000-digits",
        "config-not-utf8",
        "config-dup-key",
        "index-deep",
        "index-5000-digits",
        "index-list",
    ],
)
def test_damaged_checkpoint_json_is_one_line(ckpt, name, text, words):
    path = ckpt / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    one_line(plan(ckpt.parent / "model.toml"), path, words)


@pytest.mark.parametrize(
    "key, value",
    [
        ("weight_block_size", [0, 0]),
        ("weight_block_size", [64, 64]),
        ("scale_fmt", "e5m2"),
        ("quant_method", "awq"),
        ("fmt", "e5m2"),
        ("activation_scheme", "static"),
        ("expert_dtype", "int4"),
    ],
)
def test_quantization_config_value_not_implemented(ckpt, key, value):
    edit_json(ckpt / "config.json", lambda d: d["quantization_config"].update({key: value}))
    one_line(plan(ckpt.parent / "model.toml"), ckpt / "config.json", f"quantization_config.{key}", "not implemented")


# --- model.toml ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, words",
    [
        ("[kv]\nblock_size = " + HUGE + "\n", "not valid TOML"),
        ("[kv]\nblock_size = 0x" + "f" * 5000 + "\n", "kv.block_size: an integer outside"),
        ("[kv]\nblock_size = 9223372036854775808\n", "kv.block_size"),
        ("[model]\nx = " + "[" * 5000 + "]" * 5000 + "\n", "not valid TOML"),
        ("[model]\nx = " + "{a=" * 2000 + "1" + "}" * 2000 + "\n", "not valid TOML"),
        ('[model]\ncheckpoint = "a\\u0000b"\n', "model.checkpoint"),
        ('["a\\nb"]\nx = 1\n', "unknown section"),
        ("[model]\ncheckpoint = 'x'\n# caf\xe9\n".encode("latin-1"), "not UTF-8"),
    ],
    ids=[
        "5000-digits",
        "5000-hex-digits",
        "2**63",
        "deep-arrays",
        "deep-tables",
        "nul-in-path",
        "newline-in-key",
        "latin-1",
    ],
)
def test_damaged_model_toml_is_one_line(tmp_path, text, words):
    path = tmp_path / "model.toml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    one_line(plan(path), path, words)


def test_model_toml_that_is_dev_zero(tmp_path):
    path = tmp_path / "model.toml"
    path.symlink_to("/dev/zero")
    one_line(plan(path), path, "not a regular file")


# --- bundles: manifest.json, signature.json, links ---------------------------------------------------


@pytest.fixture
def keys(tmp_path):
    from deepinfer.bundles.signing import keygen

    keygen(tmp_path / "key.pem", tmp_path / "key.pub")
    return tmp_path / "key.pem", tmp_path / "key.pub"


def run(bundle: Path, *extra: str):
    return CliRunner().invoke(deepinfer_run, [str(bundle), "--prompt-ids", "0", *extra])


@pytest.mark.parametrize(
    "text, words",
    [
        ('{"format_version": 2, "regions": ' + DEEP + "}", "nested"),
        ('{"format_version": ' + HUGE + "}", "5000 digits"),
        ('{"format_version": 2, "format_version": 2}', "appears twice"),
        ('{"format_version": NaN}', "NaN"),
        (b'{"format_version": 2, "\xff": 1}', "UTF-8"),
    ],
    ids=["deep", "5000-digits", "dup-key", "nan", "not-utf8"],
)
@pytest.mark.parametrize("trusted", [False, True])
def test_damaged_manifest_is_one_line(tmp_path, keys, text, words, trusted):
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    path = bundle / "manifest.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    if trusted:  # a valid signature of the damaged bytes: the parse still refuses them
        from deepinfer.bundles.signing import load_private_key, sign_file

        sign_file(path, load_private_key(keys[0]), bundle / "signature.json")
    one_line(run(bundle, *(["--trust", str(keys[1])] if trusted else [])), path, words)


@pytest.mark.parametrize("trusted", [False, True])
def test_manifest_that_is_dev_zero_is_refused_before_reading(tmp_path, keys, trusted):
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "manifest.json").symlink_to("/dev/zero")
    out = one_line(run(bundle, *(["--trust", str(keys[1])] if trusted else [])), bundle / "manifest.json")
    assert "/dev/zero" in out and "signature" not in out


def test_manifest_linking_outside_the_bundle(tmp_path):
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (tmp_path / "elsewhere.json").write_text('{"format_version": 2}')
    (bundle / "manifest.json").symlink_to(tmp_path / "elsewhere.json")
    one_line(run(bundle), bundle / "manifest.json", "outside")


@pytest.mark.parametrize(
    "text, words",
    [('{"algorithm": ' + DEEP + "}", "nested"), ("/dev/zero", "/dev/zero"), ('{"a": ' + HUGE + "}", "digits")],
    ids=["deep", "dev-zero", "5000-digits"],
)
def test_damaged_signature_is_one_line(tmp_path, keys, text, words):
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "manifest.json").write_text('{"format_version": 2}')
    signature = bundle / "signature.json"
    if text.startswith("/"):
        signature.symlink_to(text)
    else:
        signature.write_text(text)
    one_line(run(bundle, "--trust", str(keys[1])), signature, words)


# --- tokenizer files -------------------------------------------------------------------------------

SYNTH = Path(__file__).resolve().parent / "golden" / "synthetic_tokenizer"


@pytest.mark.parametrize(
    "name, damage, words",
    [
        ("tokenizer_config.json", '{"bos_token": ' + DEEP + "}", "nested"),
        ("tokenizer_config.json", '{"model_max_length": ' + HUGE + "}", "5000 digits"),
        ("tokenizer_config.json", b'{"bos_token": "\xff"}', "UTF-8"),
        ("tokenizer.json", "/dev/zero", "not a regular file"),
        ("tokenizer.json", b"\xff\xfe", "UTF-8"),
        ("chat_template.jinja", "/dev/zero", "not a regular file"),
    ],
    ids=["config-deep", "config-5000-digits", "config-not-utf8", "json-dev-zero", "json-not-utf8", "jinja-dev-zero"],
)
def test_damaged_tokenizer_files(tmp_path, name, damage, words):
    from deepinfer.regions.hf_tokenizer import TokenizersTokenizer

    directory = shutil.copytree(SYNTH, tmp_path / "tok")
    path = directory / name
    path.unlink(missing_ok=True)
    if name == "chat_template.jinja":  # read only where tokenizer_config.json holds no template
        (directory / "tokenizer_config.json").unlink()
    if damage == "/dev/zero":
        path.symlink_to(damage)
    else:
        path.write_bytes(damage if isinstance(damage, bytes) else damage.encode())
    with pytest.raises(DeepinferError) as e:
        TokenizersTokenizer.from_dir(directory)
    assert str(path) in str(e.value) and words in str(e.value) and "\n" not in str(e.value)


def test_bundle_tokenizer_link_outside_the_bundle(tmp_path):
    from deepinfer.regions.hf_tokenizer import TokenizersTokenizer

    bundle = tmp_path / "bundle"
    (bundle / "tokenizer").mkdir(parents=True)
    os.symlink(SYNTH / "tokenizer.json", bundle / "tokenizer" / "tokenizer.json")
    with pytest.raises(DeepinferError, match="outside"):
        TokenizersTokenizer.from_dir(bundle / "tokenizer", root=bundle)


@pytest.mark.parametrize(
    "text", ['{"config": ' + DEEP + "}", "[1]", '{"config": [1]}'], ids=["deep", "list", "config-list"]
)
def test_damaged_pt2_payload_config(tmp_path, text):
    import zipfile

    from deepinfer.bundles.pt2 import _check_archive

    path = tmp_path / "x.pt2"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("x/data/weights/model_weights_config.json", text)
    with pytest.raises(DeepinferError) as e:
        _check_archive(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)
