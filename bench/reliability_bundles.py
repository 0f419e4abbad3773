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
    yield from context_cases(bundle, run_main)


def doctor_cases(bundle: Path, work: Path, deepinfer_main) -> Iterator[Case]:
    """`deepinfer doctor --bundle` on a bundle whose manifest.json is mutated (the only file it reads):
    refused (rc 2, one line) before any stage runs, or a verdict about the host (rc 0, or rc 1: a FAIL
    line names what does not fit); never a traceback."""
    manifest = json.loads((bundle / "manifest.json").read_text())
    fields = [("format_version",), ("target", "name"), ("topology", "lnc"), ("toolchain",)]
    cases = [(f"doctor: manifest.json {n}", m) for n, m in json_mutations(manifest, fields)]
    cases += [(f"doctor: manifest.json as {kind}", lambda p, kind=kind: special(p, kind)) for kind in ("fifo", "loop")]
    for i, (name, mutate) in enumerate(cases):
        d = copy_bundle(bundle, work / "doctor-bundles" / str(i))
        (d / "manifest.json").unlink()
        shutil.copyfile(bundle / "manifest.json", d / "manifest.json")
        mutate(d / "manifest.json")
        args = ["doctor", "--bundle", str(d), "--work", str(work / "doctor-work"), "--figures-out", str(d / "f.json")]
        yield judge_cli("bundle", name, run_cli(deepinfer_main, args), answers=(0, 1))
        shutil.rmtree(d, ignore_errors=True)


def context_cases(bundle: Path, run_main) -> Iterator[Case]:
    """What cannot fit the bundle's max_context under deepinfer-run: refused (rc 2, one line) before
    the load, never run to the context and answered rc 1 (issue 44)."""
    max_context = json.loads((bundle / "manifest.json").read_text())["buckets"]["max_context"]
    cases = [
        ("--max-new-tokens 10**12", ["--prompt-ids", "0,5,9", "--max-new-tokens", str(10**12)]),
        (
            "--max-new-tokens beyond what the prompt leaves",
            ["--prompt-ids", "0,5,9", "--max-new-tokens", str(max_context)],
        ),
        ("a prompt of 100k characters", ["--prompt", "x" * 100_000]),
        ("a prompt of max_context + 1 ids", ["--prompt-ids", ",".join(["5"] * (max_context + 1))]),
    ]
    for name, args in cases:
        yield judge_cli("bundle", name, run_cli(run_main, [str(bundle), "--threads", "1", *args]), answers=())


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
    yield from missing_dir_cases(work, deepinfer_main)
    yield from store_cases(work, deepinfer_main)


CACHE_COMMANDS = (["ls"], ["verify"], ["prune", "--max-age", "1d"])


def missing_dir_cases(work: Path, deepinfer_main) -> Iterator[Case]:
    """`deepinfer cache ls/verify/prune` on a directory that is not there: refused, not "0 entries"."""
    for command in CACHE_COMMANDS:
        got = run_cli(deepinfer_main, ["cache", *command, "--cache-dir", str(work / "no-such-cache")])
        yield judge_cli("cache", f"cache {command[0]} on a missing directory", got, answers=())


BARE_404 = """
import http.server
class Answer(http.server.BaseHTTPRequestHandler):
    def answer(self):
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()
    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = answer
    def log_message(self, *args):
        pass
server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answer)
print(server.server_address[1], flush=True)
server.serve_forever()
"""


def store_cases(work: Path, deepinfer_main) -> Iterator[Case]:
    """Every `deepinfer cache ... --url` against an endpoint that is not S3 (a plain HTTP server in its
    own process answering a bare 404 to everything): refused in one line, never a botocore traceback."""
    import subprocess
    import sys
    import threading

    from deepinfer.compiler.cache.keys import Key
    from deepinfer.compiler.cache.local import Cache

    local = work / "store-local"
    Cache(local).put_bytes("executable", Key.of("executable", "x", [("format", 1)]), b"x")  # push has one
    env = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    proc = subprocess.Popen([sys.executable, "-c", BARE_404], stdout=subprocess.PIPE, text=True)
    port: list[str] = []
    reader = threading.Thread(target=lambda: port.append(proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
    reader.start()
    reader.join(30)
    try:
        if not port or not port[0].strip().isdigit():
            yield Case("cache", "store answering bare 404s", False, "the 404 server did not start in 30 s")
            return
        store = ["--cache-dir", str(local), "--url", "s3://bkt/p", "--endpoint", f"http://127.0.0.1:{port[0].strip()}"]
        for command in [*CACHE_COMMANDS, ["pull"], ["push"], ["explain", "0" * 8, "1" * 8]]:
            got = run_cli(deepinfer_main, ["cache", *command, *store])
            yield judge_cli("cache", f"cache {command[0]} --url on a bare-404 endpoint", got, answers=())
    finally:
        proc.kill()
        proc.wait(30)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


__all__ = ["SPECIALS", "bundle_cases", "cache_cases", "doctor_cases"]
