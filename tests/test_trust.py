"""Signed bundles and cache entries: Ed25519 over the manifest (which holds every file's digest),
verified before anything else of a bundle is read; keys as openssl writes them."""

from __future__ import annotations

import dataclasses
import json
import shlex
import shutil
import subprocess
import sys

import pytest
from click.testing import CliRunner

from deepinfer.bundles import layout, manifest_io
from deepinfer.bundles import manifest as mf
from deepinfer.bundles.signing import TrustError, keygen, load_private_key, load_public_key, sign_file, verify_bytes
from deepinfer.compiler import pipeline
from deepinfer.compiler.cache.keys import Key
from deepinfer.compiler.cache.local import Cache
from deepinfer.runtime.cli import main as run_main


@pytest.fixture
def keys(tmp_path):
    """(private, public) key objects of a fresh pair, and their paths."""
    priv, pub = tmp_path / "k.pem", tmp_path / "k.pem.pub"
    keygen(priv, pub)
    return load_private_key(priv), load_public_key(pub), priv, pub


@pytest.fixture
def other_public(tmp_path):
    keygen(tmp_path / "o.pem", tmp_path / "o.pub")
    return load_public_key(tmp_path / "o.pub")


def test_keygen_writes_a_private_key_only_its_owner_reads(keys):
    _, _, priv, pub = keys
    assert priv.stat().st_mode & 0o077 == 0
    assert pub.read_text().startswith("-----BEGIN PUBLIC KEY-----")
    with pytest.raises(TrustError, match="exists; not overwriting"):
        keygen(priv, pub)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_openssl_keys_sign_and_verify(tmp_path):
    priv, pub, rsa = tmp_path / "ed.pem", tmp_path / "ed.pub", tmp_path / "rsa.pem"
    subprocess.run(["openssl", "genpkey", "-algorithm", "ed25519", "-out", str(priv)], check=True, timeout=60)
    subprocess.run(["openssl", "pkey", "-in", str(priv), "-pubout", "-out", str(pub)], check=True, timeout=60)
    data, record = tmp_path / "data", tmp_path / "data.sig"
    data.write_bytes(b"manifest bytes")
    sign_file(data, load_private_key(priv), record)
    verify_bytes(b"manifest bytes", record, load_public_key(pub))
    with pytest.raises(TrustError, match="does not verify"):
        verify_bytes(b"manifest bytez", record, load_public_key(pub))
    subprocess.run(
        ["openssl", "genpkey", "-algorithm", "rsa", "-pkeyopt", "rsa_keygen_bits:1024", "-out", str(rsa)],
        check=True,
        timeout=60,
    )
    with pytest.raises(TrustError, match="not an Ed25519 private key"):
        load_private_key(rsa)


def test_a_bad_key_file_is_one_line(tmp_path):
    bad = tmp_path / "bad.pem"
    bad.write_text("not a key")
    with pytest.raises(TrustError, match=r"bad\.pem: not a readable PEM public key") as e:
        load_public_key(bad)
    assert "\n" not in str(e.value)


def test_compile_signs_the_manifest_it_publishes(tmp_path, tiny_ckpt, keys, other_public, monkeypatch):
    from deepinfer.compiler.config import load_compile_config

    def write_manifest(config, hlo_only, run, timed):
        (run.staging / layout.MANIFEST_FILE).write_text('{"format_version": 1}')
        return pipeline.Built(executables=0)

    monkeypatch.setattr(pipeline, "build", write_manifest)
    toml = tmp_path / "model.toml"
    toml.write_text(f'[model]\ncheckpoint = "{tiny_ckpt}"\n[target]\nexecutable = "exported"\n')
    private, public, _, _ = keys
    out = pipeline.compile_bundle(load_compile_config(toml), tmp_path / "b", sign=private, log=lambda m: None).bundle
    raw = (out / layout.MANIFEST_FILE).read_bytes()
    verify_bytes(raw, out / layout.SIGNATURE_FILE, public)
    with pytest.raises(TrustError, match="does not verify with the trusted key"):
        verify_bytes(raw, out / layout.SIGNATURE_FILE, other_public)
    with pytest.raises(TrustError, match="does not verify"):
        verify_bytes(raw.replace(b"1", b"2"), out / layout.SIGNATURE_FILE, public)


def test_cache_entries_are_used_only_when_signed_by_the_trusted_key(tmp_path, keys, other_public):
    private, public, _, _ = keys
    key = Key.of("trace", "a trace", [("part", "value")])
    Cache(tmp_path / "signed", sign=private).put_bytes("trace", key, b"record")
    Cache(tmp_path / "unsigned").put_bytes("trace", key, b"record")
    assert Cache(tmp_path / "signed", trust=public).get_bytes("trace", key) == b"record"
    for directory, trust in (("signed", other_public), ("unsigned", public)):
        logged = []
        cache = Cache(tmp_path / directory, trust=trust, log=logged.append)
        assert cache.get_bytes("trace", key) is None
        assert "not signed by the trusted key" in logged[0]
        assert cache.lookup("trace", key) is None  # removed: the next compile rebuilds it


# --- a compiled bundle, signed (the exported group's bundle, copied) ---


@pytest.fixture
def signed_bundle(exported_bundle, tmp_path, keys):
    bundle = shutil.copytree(exported_bundle, tmp_path / "bundle")
    sign_file(bundle / layout.MANIFEST_FILE, keys[0], bundle / layout.SIGNATURE_FILE)
    return bundle


def _run(bundle, *args, env=None):
    return CliRunner().invoke(run_main, [str(bundle), "--prompt-ids", "0,72", "--max-new-tokens", "2", *args], env=env)


def test_run_refuses_before_loading_anything(signed_bundle, keys, tmp_path, monkeypatch):
    from deepinfer.runtime import backends

    def never(*args, **kwargs):
        raise AssertionError("an executable was loaded")

    monkeypatch.setattr(backends.ExportedExecutable, "__init__", never)
    manifest = signed_bundle / layout.MANIFEST_FILE
    data = json.loads(manifest.read_text())
    data["model"]["cache_quant"] = not data["model"]["cache_quant"]  # an edit the digests do not see
    manifest.write_text(manifest_io.dumps(manifest_io.parse(data, str(manifest))))
    unsigned = shutil.copytree(signed_bundle, tmp_path / "unsigned")
    (unsigned / layout.SIGNATURE_FILE).unlink()
    for bundle, why in ((signed_bundle, "does not verify with the trusted key"), (unsigned, "missing")):
        r = _run(bundle, "--trust", str(keys[3]))
        assert r.exit_code == 2 and why in r.output, r.output
        assert r.output.count("\n") == 1
    r = _run(signed_bundle, "--trust", str(keys[3]), "--no-verify")
    assert r.exit_code == 2 and "drop --no-verify" in r.output


# --- what runs is what was verified (bundles/verified.py), and executables match their entries ---


def _heads(m: mf.Manifest) -> tuple[str, str]:
    """Two of the head's executables whose call shapes differ (buckets)."""
    heads = [e for e in m.regions if (e.kind, e.method) == ("head", mf.DECODE)]
    assert heads[0].inputs != heads[-1].inputs
    return heads[0].artifact, heads[-1].artifact


SWAP = """
import os, shutil, sys
bundle, weights, exe, other = os.environ["DEEPINFER_BUNDLE"], *sys.argv[1:]
with open(os.path.join(bundle, weights), "r+b") as f:  # in place: every data byte rewritten
    n = int.from_bytes(f.read(8), "little")
    size = f.seek(0, 2) - 8 - n
    f.seek(8 + n)
    f.write(bytes((i * 131 + 7) % 251 for i in range(size)))
shutil.copy(os.path.join(bundle, other), os.path.join(bundle, exe) + ".new")
os.replace(os.path.join(bundle, exe) + ".new", os.path.join(bundle, exe))  # another bucket's program
"""


def test_run_trusts_a_signed_bundle_and_runs_what_it_verified(signed_bundle, keys, tmp_path):
    """A signed bundle runs under --trust (or $DEEPINFER_TRUST); its weights rewritten in place and an
    executable replaced between verification and use (the test hook) change nothing that runs."""
    from deepinfer.bundles.verified import TEST_HOOK_ENV

    m = manifest_io.read(signed_bundle)
    weights = m.rank_weights(0)[0].files[0]
    exe, other = _heads(m)
    script = tmp_path / "swap.py"
    script.write_text(SWAP)
    hook = {TEST_HOOK_ENV: f"{shlex.quote(sys.executable)} {script} {weights} {exe} {other}"}
    control = shutil.copytree(signed_bundle, tmp_path / "control")
    trusted = _run(signed_bundle, "--trust", str(keys[3]))
    assert trusted.exit_code == 0, trusted.output
    swapped = _run(signed_bundle, env={"DEEPINFER_TRUST": str(keys[3]), **hook})
    assert swapped.exit_code == 0, swapped.output
    assert swapped.output == trusted.output  # the same tokens: what ran is what was verified
    for rel in (weights, exe):  # the hook did swap them
        assert manifest_io.sha256_file(signed_bundle / rel) != m.files[rel]
    # without --trust the same swap takes effect after the digest check: the executable's own
    # signature then disagrees with its entry, and it is refused before any program loads
    r = _run(control, env=hook)
    assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
    assert f"{control / exe}: input 'h' shape" in r.output, r.output


def test_a_swapped_executable_is_refused_before_any_program_loads(exported_bundle, tmp_path, monkeypatch):
    from deepinfer.runtime import backends

    def never(*args, **kwargs):
        raise AssertionError("a program was loaded")

    monkeypatch.setattr(backends.ExportedExecutable, "__init__", never)
    bundle = shutil.copytree(exported_bundle, tmp_path / "bundle")
    exe, other = _heads(manifest_io.read(bundle))
    a, b = (bundle / exe).read_bytes(), (bundle / other).read_bytes()
    (bundle / exe).write_bytes(b)
    (bundle / other).write_bytes(a)
    manifest_io.write(
        bundle, manifest_io.stamp(bundle, manifest_io.read(bundle))
    )  # digests re-stamped: they cannot tell
    r = _run(bundle)
    assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
    assert f"{bundle / exe}: input 'h' shape [" in r.output and "vs manifest [" in r.output, r.output


@pytest.mark.parametrize("which", ["exported_bundle", "aoti_bundle"])
def test_manifests_record_every_executables_signature(which, request):
    """Each entry records its outputs' signature; each file states the entry's, and a file is refused in
    one line for an entry whose input or output shape differs from it."""
    from deepinfer.bundles.signatures import check_signature, read_signature

    bundle = request.getfixturevalue(which)
    m = manifest_io.read(bundle)
    assert m.format_version == 3
    for e in m.regions:
        assert [s.name for s in e.output_specs or ()] == list(e.outputs)
        assert all(s.dtype in mf.DTYPE_NAMES for s in (*e.inputs, *(e.output_specs or ())))
        sig = read_signature((bundle / e.artifact).read_bytes(), e.executable, e.artifact)
        assert sig is not None and len(sig.inputs) == len(e.inputs) and len(sig.outputs) == len(e.outputs)
        check_signature(e, sig, e.artifact)
        h = next(i for i, s in enumerate(e.inputs) if s.name == "h")
        bigger = (e.inputs[h].shape[0] * 2, *e.inputs[h].shape[1:])
        other = dataclasses.replace(
            e, inputs=e.inputs[:h] + (dataclasses.replace(e.inputs[h], shape=bigger),) + e.inputs[h + 1 :]
        )
        with pytest.raises(mf.BundleError) as err:
            check_signature(other, sig, e.artifact)
        assert str(err.value).startswith(f"{e.artifact}: input 'h' shape [{e.inputs[h].shape[0]}, ")
        assert f"vs manifest {list(bigger)}" in str(err.value) and "\n" not in str(err.value)
        # every output's shape is stated (an AOTInductor package's from its wrapper source, issue 44),
        # and an entry whose output shape differs is refused
        assert all(o.shape is not None and None not in o.shape for o in sig.outputs), (e.artifact, sig.outputs)
        first = len(e.state_outputs or ())
        specs = e.output_specs or ()
        out = specs[first]
        wrong = dataclasses.replace(out, shape=(out.shape[0] + 1, *out.shape[1:]))
        other = dataclasses.replace(e, output_specs=specs[:first] + (wrong,) + specs[first + 1 :])
        with pytest.raises(mf.BundleError, match=f"output '{out.name}' shape .* vs manifest"):
            check_signature(other, sig, e.artifact)
