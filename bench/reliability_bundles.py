"""bench/reliability.py's bundle and cache surfaces: a bundle's files mutated under deepinfer-run
(with --trust for signature.json), a cache's meta.json and digest memo under deepinfer-compile and
`deepinfer cache`."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from reliability_files import SPECIALS, Case, header_mutations, json_mutations, judge_cli, run_cli, special


def copy_bundle(src: Path, dst: Path) -> Path:
    """A bundle copy: small files copied, large ones hard-linked (a mutated file is replaced, never edited)."""
    for f in src.rglob("*"):
        rel = dst / f.relative_to(src)
        if f.is_dir():
            rel.mkdir(parents=True, exist_ok=True)
        else:
            rel.parent.mkdir(parents=True, exist_ok=True)
            os.link(f, rel)
    return dst


def public_key(work: Path) -> Path:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    pem = (
        Ed25519PrivateKey.generate()
        .public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    (work / "trusted.pub").write_bytes(pem)
    return work / "trusted.pub"


def bundle_cases(bundle: Path, work: Path, run_main) -> Iterator[Case]:
    manifest = json.loads((bundle / "manifest.json").read_text())
    weights = sorted((bundle / "weights").rglob("*.safetensors"))[0].relative_to(bundle).as_posix()
    region = sorted((bundle / "regions").iterdir())[0].relative_to(bundle).as_posix()
    fields = [("format_version",), ("kv", "num_blocks"), ("buckets", "max_context"), ("model", "dtype")]
    cases = [(f"manifest.json {n}", "manifest.json", m, []) for n, m in json_mutations(manifest, fields)]
    raw = (bundle / weights).read_bytes()
    cases += [(f"weights {n}", weights, lambda p, d=d: p.write_bytes(d), []) for n, d in header_mutations(raw)]
    key = public_key(work)
    sig = {"algorithm": "ed25519", "signature": "AAAA", "public_key": "AAAA"}
    cases += [
        (f"signature.json {n}", "signature.json", m, ["--trust", str(key)])
        for n, m in json_mutations(sig, [("signature",)])
    ]
    for kind in ("devzero", "fifo", "loop"):
        cases.append((f"weights file as {kind}", weights, lambda p, kind=kind: special(p, kind), []))
        cases.append((f"executable as {kind}", region, lambda p, kind=kind: special(p, kind), []))
    cases.append(("weights file -> outside the bundle", weights, _outside, []))
    for i, (name, file, mutate, extra) in enumerate(cases):
        d = copy_bundle(bundle, work / "bundles" / str(i))
        target = d / file
        if target.exists() or target.is_symlink():
            target.unlink()
            if file != "signature.json" and not name.startswith(("weights file", "executable as")):
                shutil.copyfile(bundle / file, target)
        mutate(target)
        args = [str(d), "--prompt-ids", "0,5,9", "--max-new-tokens", "1", "--threads", "1", *extra]
        yield judge_cli("bundle", name, run_cli(run_main, args))
        shutil.rmtree(d, ignore_errors=True)


def _outside(p: Path) -> None:
    p.symlink_to("/etc/hostname")


def cache_cases(cache: Path, toml: Path, work: Path, compile_main, deepinfer_main) -> Iterator[Case]:
    """Each case on a copy of `cache` (hard links; the mutated file replaced)."""
    root = cache / "v1"
    entry = sorted((root / "trace").glob("*/*"))[0].relative_to(cache)
    memo = sorted((root / "files").glob("*.json"))[0].relative_to(cache)
    meta = json.loads((cache / entry / "meta.json").read_text())
    cases = [
        (f"meta.json {n}", entry / "meta.json", m, "verify") for n, m in json_mutations(meta, [("key",), ("digest",)])
    ]
    cases += [(f"meta.json {n} (compile)", entry / "meta.json", m, "compile") for n, m in json_mutations(meta, [])][:6]
    memo_data = json.loads((cache / memo).read_text())
    cases += [(f"memo {n}", memo, m, "key") for n, m in json_mutations(memo_data, [])]
    cases.append(("memo {}", memo, lambda p: p.write_text("{}"), "key"))
    cases.append(("memo of wrong digests", memo, lambda p: p.write_text(json.dumps({k: 1 for k in memo_data})), "key"))
    for i, (name, rel, mutate, how) in enumerate(cases):
        d = copy_bundle(cache, work / "caches" / str(i))
        (d / rel).unlink()
        mutate(d / rel)
        if how == "verify":
            verified = run_cli(deepinfer_main, ["cache", "verify", "--cache-dir", str(d)])
            yield judge_cli("cache", f"{name} (cache verify)", verified, answers=(0, 1))
            yield judge_cli(
                "cache", f"{name} (cache ls)", run_cli(deepinfer_main, ["cache", "ls", "--cache-dir", str(d)])
            )
        elif how == "key":
            yield judge_cli(
                "cache", name, run_cli(compile_main, [str(toml), "--print-cache-key", "--cache-dir", str(d)])
            )
        else:
            out = work / "caches" / f"out{i}"
            yield judge_cli("cache", name, run_cli(compile_main, [str(toml), "-o", str(out), "--cache-dir", str(d)]))
            shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(d, ignore_errors=True)


__all__ = ["SPECIALS", "bundle_cases", "cache_cases"]
