"""The bundle on disk: manifest round trip and version, validation, no partial bundle after a failure."""

from __future__ import annotations

import json
import re
import shutil

import pytest

import deepinfer.compiler.executables as executables
import deepinfer.compiler.pipeline as pipeline
from deepinfer.bundles import layout, manifest_io
from deepinfer.bundles import manifest as mf
from deepinfer.bundles.manifest import BundleError
from deepinfer.compiler.config import load_compile_config
from deepinfer.errors import ConfigError


@pytest.fixture
def bundle_copy(exported_bundle, tmp_path):
    """A private copy of the session's exported bundle, free to damage."""
    return shutil.copytree(exported_bundle, tmp_path / "bundle")


def manifest_text(bundle) -> str:
    return (bundle / layout.MANIFEST_FILE).read_text()


def edit_manifest(bundle, edit) -> None:
    data = json.loads(manifest_text(bundle))
    edit(data)
    (bundle / layout.MANIFEST_FILE).write_text(json.dumps(data))


def bundle_error(fn, *args, **kwargs) -> str:
    with pytest.raises(BundleError) as e:
        fn(*args, **kwargs)
    return str(e.value)


# --- manifest ---


def test_format_version_is_the_first_key(exported_bundle):
    text = manifest_text(exported_bundle)
    assert re.match(rf'\{{\s*"format_version": {mf.FORMAT_VERSION},', text), text[:40]
    assert next(iter(json.loads(text))) == "format_version"
    assert manifest_io.read(exported_bundle).format_version == mf.FORMAT_VERSION in mf.SUPPORTED_VERSIONS


def test_manifest_round_trip(exported_bundle, bundle_copy):
    m = manifest_io.read(exported_bundle)
    assert manifest_io.dumps(m) == manifest_text(exported_bundle)  # the file is what dumps writes
    assert manifest_io.parse(json.loads(manifest_io.dumps(m)), "round trip") == m
    # a reader takes format_version wherever it stands; dumps puts it first
    data = manifest_io.to_json(m)
    moved = {k: v for k, v in data.items() if k != "format_version"} | {"format_version": data["format_version"]}
    (bundle_copy / layout.MANIFEST_FILE).write_text(json.dumps(moved))
    assert manifest_io.read(bundle_copy) == m
    assert next(iter(json.loads(manifest_io.dumps(manifest_io.read(bundle_copy))))) == "format_version"
    manifest_io.check_files(bundle_copy, manifest_io.read(bundle_copy))


@pytest.mark.parametrize("version", [mf.FORMAT_VERSION + 1, 0, "1", None], ids=["newer", "zero", "string", "null"])
def test_unknown_format_version_is_refused_first(bundle_copy, version):
    def edit(data):
        data["format_version"] = version
        del data["regions"]  # checked first: the version is the complaint, not this

    edit_manifest(bundle_copy, edit)
    message = bundle_error(manifest_io.read, bundle_copy)
    assert message.startswith(f"{bundle_copy / layout.MANIFEST_FILE}: format_version {version!r} is not supported")
    assert "recompile" in message


def test_missing_format_version_is_refused(bundle_copy):
    edit_manifest(bundle_copy, lambda data: data.pop("format_version"))
    assert "format_version None is not supported" in bundle_error(manifest_io.read, bundle_copy)


def test_missing_required_key(bundle_copy):
    edit_manifest(bundle_copy, lambda data: data.pop("layers"))
    assert bundle_error(manifest_io.read, bundle_copy).endswith("manifest lacks layers")


def _set(path: list, value):
    """An edit that sets data[path...] = value."""

    def edit(data):
        node = data
        for part in path[:-1]:
            node = node[part]
        node[path[-1]] = value

    return edit


# (what is damaged, the edit, what the one-line error must say)
DAMAGE = {
    "type": (_set(["kv", "block_size"], "16"), "kv.block_size: expected int, got '16'"),
    "nested type": (_set(["regions", 3, "bucket", "batch"], 1.5), "regions[3].bucket.batch: expected int"),
    "literal": (_set(["kv", "pools", "win", "dim"], "rows"), "kv.pools.win.dim: expected one of 'blocks', 'slots'"),
    "unknown key": (_set(["kv", "colour"], "red"), "kv.colour: unknown key 'colour'"),
    "binding to no executable": (
        _set(["layers", 2, "regions", "attn", "kind"], "attn_nothing"),
        "layers[2].regions.attn.kind: no executable of kind 'attn_nothing'",
    ),
    "binding past the stack": (
        _set(["layers", 5, "regions", "moe", "index"], 6),
        "layers[5].regions.moe.index: row 6 of rank-0's moe stacks (6 rows)",
    ),
    "state past the pool": (
        _set(["layers", 0, "state", "win"], ["win", 9]),
        "layers[0].state.win: row 9 of pool 'win'",
    ),
    "state in no pool": (_set(["layers", 0, "state", "win"], ["nowhere", 0]), "unknown pool 'nowhere'"),
    "topology": (_set(["topology", "world_size"], 2), "topology: world_size 2, groups 1, dispatch False do not follow"),
    "ranks": (
        lambda data: data["weights"].update({"rank-1": data["weights"]["rank-0"]}),
        "weights: expected weights for rank-0, got rank-0, rank-1",
    ),
    "duplicate executable": (lambda data: data["regions"].append(data["regions"][0]), "is listed twice"),
    "artifact outside": (_set(["regions", 0, "artifact"], "../x.pt2"), "regions[0].artifact: path '../x.pt2' is not"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_manifest_is_one_line_naming_the_key(bundle_copy, damage):
    """read() checks types and cross-references once, before anything is loaded."""
    edit, message = DAMAGE[damage]
    edit_manifest(bundle_copy, edit)
    error = bundle_error(manifest_io.read, bundle_copy)
    assert error.startswith(f"{bundle_copy / layout.MANIFEST_FILE}: ") and "\n" not in error, error
    assert message in error, error


def test_not_a_bundle_and_corrupt_manifest(tmp_path, bundle_copy):
    assert "not a bundle" in bundle_error(manifest_io.read, tmp_path / "nothing")
    (bundle_copy / layout.MANIFEST_FILE).write_text('{"format_version": 1,')
    assert "manifest.json: is not valid JSON" in bundle_error(manifest_io.read, bundle_copy)


# --- validate ---


def test_intact_bundle_validates(exported_bundle):
    m = manifest_io.read(exported_bundle)
    manifest_io.check_files(exported_bundle, m)
    listed = set(m.files)
    on_disk = {p.relative_to(exported_bundle).as_posix() for p in exported_bundle.rglob("*") if p.is_file()}
    assert on_disk - listed == {layout.MANIFEST_FILE}  # every other file has a digest
    assert not [p for p in exported_bundle.rglob("*") if p.name.startswith(".")]


@pytest.mark.parametrize(
    "rel", ["weights/rank-0/moe.safetensors", "regions/moe.decode.b1t2.pt2", "host/embed.safetensors"]
)
def test_missing_file_is_detected(bundle_copy, rel):
    (bundle_copy / rel).unlink()
    message = bundle_error(manifest_io.check_files, bundle_copy, manifest_io.read(bundle_copy))
    assert message == f"{bundle_copy}: missing file {rel} (listed in the manifest)"


@pytest.mark.parametrize("rel", ["weights/rank-0/attn_window.safetensors", "regions/head.decode.b1t1.pt2"])
def test_altered_file_is_detected(bundle_copy, rel):
    path = bundle_copy / rel
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit, size unchanged
    path.write_bytes(bytes(data))
    m = manifest_io.read(bundle_copy)
    message = bundle_error(manifest_io.check_files, bundle_copy, m)
    assert message.startswith(f"{bundle_copy}: {rel} does not match its digest")
    manifest_io.check_files(bundle_copy, m, digests=False)  # presence alone still holds


def test_referenced_file_without_digest_is_detected(bundle_copy):
    edit_manifest(bundle_copy, lambda data: data["files"].pop("weights/rank-0/moe.safetensors"))
    message = bundle_error(manifest_io.check_files, bundle_copy, manifest_io.read(bundle_copy))
    assert "weights/rank-0/moe.safetensors is referenced but not covered by a digest" in message


@pytest.mark.parametrize("rel", ["../outside.pt2", "/etc/passwd"])
def test_path_outside_the_bundle_is_refused(bundle_copy, rel):
    edit_manifest(bundle_copy, lambda data: data["files"].update({rel: "sha256:0"}))
    assert f"{rel!r} is not inside the bundle" in bundle_error(
        manifest_io.check_files, bundle_copy, manifest_io.read(bundle_copy)
    )


# --- no partial bundle ---


def write_toml(tmp_path, ckpt):
    path = tmp_path / "model.toml"
    path.write_text(
        f'[model]\ncheckpoint = "{ckpt}"\n[target]\nexecutable = "exported"\n'
        "[buckets]\nmax_context = 32\n[kv]\nnum_blocks = 4\n"
    )
    return load_compile_config(path)


def staging_dirs(parent, name="bundle"):
    return sorted(parent.glob(f".{name}.tmp-*"))


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_failure_mid_compile_leaves_no_partial_bundle(tmp_path, tiny_ckpt, monkeypatch, error):
    """A failure after the weights are written (here: in the trace pass) removes everything it wrote."""
    seen = []

    def failing_trace(*args, **kwargs):
        [staging] = staging_dirs(tmp_path)
        seen.extend(p.relative_to(staging).as_posix() for p in staging.rglob("*.safetensors"))
        raise error("injected failure")

    monkeypatch.setattr(executables, "trace", failing_trace)
    cfg, out = write_toml(tmp_path, tiny_ckpt), tmp_path / "bundle"
    with pytest.raises(error, match="injected failure"):
        pipeline.compile_bundle(cfg, out, log=lambda msg: None, cache=None)  # traced, not fetched
    assert "weights/rank-0/moe.safetensors" in seen  # the failure was mid-compile
    assert not out.exists()
    assert staging_dirs(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.toml"]


def test_failure_with_force_keeps_the_existing_bundle(tmp_path, tiny_ckpt, monkeypatch):
    def failing_trace(*args, **kwargs):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(executables, "trace", failing_trace)
    cfg, out = write_toml(tmp_path, tiny_ckpt), tmp_path / "bundle"
    out.mkdir()
    (out / "manifest.json").write_text('{"format_version": 1}')  # what --force may replace: a bundle
    (out / "marker").write_text("the previous bundle")
    with pytest.raises(RuntimeError):
        pipeline.compile_bundle(cfg, out, force=True, log=lambda msg: None, cache=None)  # traced, not fetched
    assert (out / "marker").read_text() == "the previous bundle"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle", "model.toml"]


def test_existing_output_needs_force(tmp_path, tiny_ckpt, monkeypatch):
    monkeypatch.setattr(pipeline, "build", lambda *a: pytest.fail("a pass ran"))  # nothing may run
    cfg, out = write_toml(tmp_path, tiny_ckpt), tmp_path / "bundle"
    out.mkdir()
    with pytest.raises(
        ConfigError, match=r"exists; replace it with --force \(compile_bundle\(\.\.\., force=True\) from Python\)"
    ):
        pipeline.compile_bundle(cfg, out, log=lambda msg: None)
    assert list(out.iterdir()) == [] and staging_dirs(tmp_path) == []
