"""Property tests (issue 33, item 11): mutated model.toml text, config.json, checkpoint indexes,
safetensors headers and manifests each end in a value or in one of deepinfer's own errors (a
`DeepinferError`: ConfigError, BundleError, TensorFileError, ReadError, ...) with a one-line message;
never another exception. Each example runs the parse-and-validate functions on a small synthetic
input (no compile); the test on a real manifest uses the session's exported bundle (slow)."""

from __future__ import annotations

import copy
import dataclasses
import json
import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer.bundles import manifest as mf
from deepinfer.bundles import manifest_io
from deepinfer.bundles.safetensors import layout_header, read_header
from deepinfer.compiler.config import load_compile_config
from deepinfer.errors import ConfigError, DeepinferError
from deepinfer.reader import parse_json
from deepinfer.regions.checkpoint import Checkpoint
from deepinfer.regions.config import parse_config
from deepinfer.regions.tiny import tiny_config

FAST = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
EXAMPLE_TOML = Path(__file__).resolve().parents[1] / "examples" / "tiny" / "model.toml"

# --- values and mutations -----------------------------------------------------------------------------

EDGE_INTS = [0, -1, 1, 2, 31, 32, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63), 10**39, -(10**39)]
ints = st.one_of(st.sampled_from(EDGE_INTS), st.integers(-(10**39), 10**39), st.integers(-3, 300))
scalars = st.one_of(
    st.none(), st.booleans(), ints, st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12)
)
keys = st.one_of(st.text(max_size=6), st.sampled_from(["\n", "a\nb", "\x00", "\u2028", "__metadata__", "extra"]))
values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=3), max_leaves=8
)


def paths(tree, at=()) -> list[tuple]:
    """Every path into a JSON tree (the root included)."""
    out = [at]
    if isinstance(tree, dict):
        for k, v in tree.items():
            out += paths(v, at + (k,))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            out += paths(v, at + (i,))
    return out


def mutate(draw, tree):
    """`tree` with one to three edits: a value replaced, a key dropped, a key added, a list grown."""
    tree = copy.deepcopy(tree)
    for _ in range(draw(st.integers(1, 3))):
        spots = paths(tree)
        at = draw(st.sampled_from(spots))
        if not at:
            return draw(values)
        parent = tree
        for k in at[:-1]:
            parent = parent[k]
        op = draw(st.sampled_from(["replace", "drop", "add", "grow"]))
        if op == "replace" or (op == "drop" and isinstance(parent, list)):
            parent[at[-1]] = draw(values)
        elif op == "drop":
            del parent[at[-1]]
        elif op == "add" and isinstance(parent, dict):
            parent[draw(keys)] = draw(values)
        elif isinstance(parent[at[-1]], list):
            parent[at[-1]].append(draw(values))
        else:
            parent[at[-1]] = draw(values)
    return tree


def refused_in_one_line(fn, *args):
    """Run `fn`: it returns, or raises a DeepinferError whose message is one line."""
    try:
        return fn(*args)
    except DeepinferError as e:
        assert str(e).isprintable(), repr(str(e))  # no line break, no control character
        return None


# --- model.toml -------------------------------------------------------------------------------------


def toml_value(value) -> str:
    """A TOML literal of a JSON-ish value (or text that is not TOML: both are inputs)."""
    if value is None:
        return "nan"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(v)}" for k, v in value.items()) + "}"


@st.composite
def toml_texts(draw, base: str) -> str:
    lines = base.splitlines()
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(lines) - 1))
        op = draw(st.sampled_from(["value", "drop", "insert", "duplicate", "text"]))
        key = lines[i].split("=", 1)[0].strip() if "=" in lines[i] else draw(st.sampled_from(["tp", "batch", "x"]))
        if op == "value":
            lines[i] = f"{key} = {toml_value(draw(values))}"
        elif op == "drop":
            del lines[i]
        elif op == "insert":
            lines.insert(i, f"{draw(st.text(max_size=6)) or 'k'} = {toml_value(draw(values))}")
        elif op == "duplicate":
            lines.insert(i, lines[i])
        else:
            lines[i] = draw(st.text(max_size=30))
        if not lines:
            break
    return "\n".join(lines) + "\n"


def base_toml(checkpoint: Path) -> str:
    text = EXAMPLE_TOML.read_text().replace('checkpoint = "checkpoint"', f'checkpoint = "{checkpoint}"')
    return "\n".join(line for line in text.splitlines() if not line.startswith("tiny"))


@FAST
@given(data=st.data())
def test_mutated_model_toml(tmp_path, data):
    path = tmp_path / "model.toml"
    text = data.draw(toml_texts(base_toml(tmp_path / "ckpt")))
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    refused_in_one_line(load_compile_config, path)


def test_the_unmutated_model_toml_loads(tmp_path):
    path = tmp_path / "model.toml"
    path.write_text(base_toml(tmp_path / "ckpt"))
    assert load_compile_config(path).kv.block_size == 16


# --- config.json -------------------------------------------------------------------------------------


def parse_config_text(text: str):
    return parse_config(parse_json(text, "config.json", error=ConfigError), "config.json")


@FAST
@given(data=st.data())
def test_mutated_config_json(data):
    text = json.dumps(mutate(data.draw, tiny_config()))
    refused_in_one_line(parse_config_text, text)


def test_the_unmutated_config_json_parses():
    assert parse_config_text(json.dumps(tiny_config())).quant.weight_block_size == (32, 32)


# --- safetensors headers and indexes -------------------------------------------------------------------


def header_dict() -> dict:
    raw, _ = layout_header([("a", "F32", (2, 3), 24), ("b", "BF16", (4,), 8), ("c", "U8", (), 1)], {"format": "pt"})
    return json.loads(raw[8:])


@st.composite
def header_bytes(draw) -> bytes:
    kind = draw(st.sampled_from(["tree", "text", "raw"]))
    if kind == "raw":
        return draw(st.binary(max_size=64))
    text = json.dumps(mutate(draw, header_dict()))
    if kind == "text":  # a character changed, dropped or doubled
        i = draw(st.integers(0, len(text) - 1))
        text = text[:i] + draw(st.text(max_size=2)) + text[i + 1 :]
    return text.encode("utf-8", "surrogatepass")


@FAST
@given(data=st.data())
def test_mutated_safetensors_header(tmp_path, data):
    raw = data.draw(header_bytes())
    length = data.draw(st.one_of(st.just(len(raw)), st.integers(0, 2**64 - 1)))
    path = tmp_path / "t.safetensors"
    path.write_bytes(struct.pack("<Q", length) + raw + bytes(data.draw(st.integers(0, 40))))
    for with_data in (True, False):
        refused_in_one_line(lambda d=with_data: read_header(str(path), data=d))


@FAST
@given(data=st.data())
def test_mutated_index(tmp_path, data):
    ckpt = tmp_path / "ckpt"
    if not ckpt.exists():
        ckpt.mkdir()
        raw, _ = layout_header([("a", "F32", (2,), 8)], {})
        (ckpt / "model-1.safetensors").write_bytes(raw + bytes(8))
        (ckpt / "dir").mkdir()
    index = {"metadata": {"total_size": 8}, "weight_map": {"a": "model-1.safetensors"}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(mutate(data.draw, index)))
    got = refused_in_one_line(Checkpoint, ckpt)
    if got is not None:
        for name in got.names():
            refused_in_one_line(got.info, name)


# --- manifests ---------------------------------------------------------------------------------------


@FAST
@given(data=st.data())
def test_synthetic_manifest(data):
    """Every field of the manifest present with an arbitrary value: parse or BundleError."""
    fields = [f.name for f in dataclasses.fields(mf.Manifest)]
    manifest = {"format_version": 2} | {f: data.draw(values) for f in fields if f != "format_version"}
    manifest = mutate(data.draw, manifest)
    refused_in_one_line(manifest_io.parse, manifest, "manifest.json")


@pytest.fixture(scope="module")
def real_manifest(exported_bundle) -> dict:
    return json.loads((Path(exported_bundle) / "manifest.json").read_text())


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_mutated_real_manifest(real_manifest, data):
    refused_in_one_line(manifest_io.parse, mutate(data.draw, real_manifest), "manifest.json")
