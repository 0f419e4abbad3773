"""The cache's remote tier (compiler/cache/remote.py) against a real S3 endpoint: moto's server on a local port,
spoken to over HTTP by boto3 (never moto's in-process mocks)."""

from __future__ import annotations

import json
import logging
import pickle
import socket
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest
from click.testing import CliRunner

from deepinfer.bundles.signing import load_private_key, load_public_key
from deepinfer.cli import main as deepinfer
from deepinfer.compiler.cache.keys import Key
from deepinfer.compiler.cache.local import Cache
from deepinfer.compiler.cache.remote import Store, StoreError
from deepinfer.compiler.cli import main as compile_cli
from deepinfer.compiler.config import load_compile_config

from .conftest import EXECUTABLES, write_toml

boto3 = pytest.importorskip("boto3", reason="the remote tier's tests need boto3 (pip install -e '.[test]')")
moto_server = pytest.importorskip("moto.server", reason="the remote tier's tests need moto[server]")

WAIT = 30  # seconds: the most a server start or stop may take


def _bounded(fn, what: str) -> None:
    """Run `fn` in a thread and wait at most WAIT seconds for it (moto's start and stop wait unbounded)."""
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    t.join(WAIT)
    assert not t.is_alive(), f"moto server did not {what} within {WAIT} s"


class Server:
    """moto's S3 server on 127.0.0.1, on a port the OS picks (asked back from the bound socket)."""

    def __init__(self):
        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
        self.server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        _bounded(self.server.start, "start")
        host, port = self.server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"

    def stop(self) -> None:
        _bounded(self.server.stop, "stop")


@pytest.fixture(scope="session")
def s3():
    server = Server()
    yield server.endpoint
    server.stop()


@pytest.fixture(autouse=True)
def aws_env(monkeypatch, tmp_path):
    """Dummy credentials, and nothing of the user's AWS configuration."""
    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": str(tmp_path / "no-aws-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-aws-credentials"),
    }.items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "DEEPINFER_CACHE_URL"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def url(s3) -> str:
    """A fresh bucket (moto's backend is one per process: every test gets its own) and a prefix."""
    bucket = f"t-{uuid.uuid4().hex[:16]}"
    boto3.client("s3", endpoint_url=s3).create_bucket(Bucket=bucket)
    return f"s3://{bucket}/ci/cache"


@pytest.fixture
def client(s3):
    return boto3.client("s3", endpoint_url=s3)


def key(n: int, identity: str = "thing") -> Key:
    return Key.of("executable", identity, [("format", 1), ("graph", f"g{n}")])


def cache(directory: Path, url: str, endpoint: str, **kwargs) -> Cache:
    logged: list[str] = []
    c = Cache(directory, log=logged.append, remote=Store.from_url(url, endpoint), **kwargs)
    c.logged = logged  # type: ignore[attr-defined]
    return c


def listing(client, url: str) -> list[str]:
    bucket, prefix = url.removeprefix("s3://").split("/", 1)
    found = client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
    return sorted(o["Key"][len(prefix) + 1 :] for o in found)


def meta_in_store(client, url: str, k: Key) -> dict:
    bucket, prefix = url.removeprefix("s3://").split("/", 1)
    body = client.get_object(Bucket=bucket, Key=f"{prefix}/v1/executable/{k.digest}/meta.json")["Body"]
    return json.loads(body.read())


# --- the store itself ---


def test_store_from_url_and_pickle(url, s3, monkeypatch):
    store = Store.from_url(url, s3)
    assert (store.url, store.endpoint, store.bucket, store.prefix) == (url, s3, url[5:].split("/")[0], "ci/cache")
    again = pickle.loads(pickle.dumps(store))  # a compile-farm worker rebuilds it from (url, endpoint)
    assert (again.url, again.endpoint) == (url, s3) and again.get_meta("executable", key(1).digest) is None
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3)
    assert Store.from_url(url).endpoint == s3  # boto3's variable, recorded so a worker needs no env
    for bad, why in [("/tmp/cache", "expected s3://bucket/prefix"), ("s3://A_B/x", "not a valid bucket name")]:
        with pytest.raises(StoreError, match=why):
            Store.from_url(bad)
    with pytest.raises(StoreError, match="http:// or https://"):
        Store.from_url(url, "minio:9000")


def test_without_boto3_one_line_names_the_extra(tmp_path, monkeypatch, tiny_ckpt):
    monkeypatch.setitem(sys.modules, "boto3", None)  # import boto3 -> ImportError
    with pytest.raises(StoreError, match=r"pip install 'deepinfer\[s3\]'"):
        Store.from_url("s3://bucket/x")
    toml = write_toml(tmp_path / "m", tiny_ckpt)
    r = CliRunner().invoke(compile_cli, [str(toml), "-o", str(tmp_path / "b"), "--cache-url", "s3://bucket/x"])
    assert r.exit_code == 2 and r.output.strip().splitlines() == [
        "error: --cache-url: an s3:// cache needs boto3, which is not installed: pip install 'deepinfer[s3]'"
    ]


# --- the cache with a remote tier ---


def test_two_machines_share_entries_through_the_store(tmp_path, url, s3, client):
    a = cache(tmp_path / "a", url, s3)
    keys = [key(n, f"exe{n}") for n in range(3)]
    for n, k in enumerate(keys):
        a.put_bytes("executable", k, f"artifact {n}".encode())
    assert len(a.stats["published"]) == 3 and a.tiers() == {"local": 0, "store": 0, "published": 3}
    objects = [n for n in listing(client, url) if n.startswith("v1/objects/")]
    metas = [n for n in listing(client, url) if n.endswith("/meta.json")]
    assert len(objects) == 3 and len(metas) == 3

    b = cache(tmp_path / "b", url, s3)  # another machine: empty local directory, same store
    assert b.get_bytes("executable", keys[0]) == b"artifact 0"
    assert (
        b.get_file("executable", keys[1], tmp_path / "out" / "x") and (tmp_path / "out/x").read_bytes() == b"artifact 1"
    )
    assert b.lookup("executable", keys[2]) is not None  # installed locally on the way
    assert b.get_bytes("executable", keys[2]) == b"artifact 2"
    assert b.tiers() == {"local": 0, "store": 3, "published": 0} and b.stats["miss"] == []
    assert b.get_bytes("executable", keys[0]) == b"artifact 0"  # now from its own disk
    assert b.tiers()["local"] == 1 and b.logged == []
    assert b.get_bytes("executable", key(9)) is None and b.stats["miss"] == [("executable", "thing")]


def test_concurrent_publishers_leave_one_whole_entry(tmp_path, url, s3, client):
    k, n = key(1), 6
    start = threading.Barrier(n, timeout=WAIT)
    caches = [cache(tmp_path / f"m{i}", url, s3) for i in range(n)]

    def publish(i: int) -> None:
        start.wait()
        caches[i].put_bytes("executable", k, f"not bit-identical {i}".encode() * 1000)

    threads = [threading.Thread(target=publish, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    assert not any(t.is_alive() for t in threads)
    assert sum(len(c.stats["published"]) for c in caches) == 1  # the others' conditional create: 412
    assert all(c.logged == [] for c in caches)  # losing the race is not an error
    meta = meta_in_store(client, url, k)
    bucket, prefix = url.removeprefix("s3://").split("/", 1)
    obj = client.get_object(Bucket=bucket, Key=f"{prefix}/v1/objects/{meta['digest'][7:]}")["Body"].read()
    import hashlib

    assert "sha256:" + hashlib.sha256(obj).hexdigest() == meta["digest"]
    reader = cache(tmp_path / "reader", url, s3)
    assert reader.get_bytes("executable", k) == obj and reader.tiers()["store"] == 1


@pytest.mark.parametrize("rebuilt", ["same bytes", "other bytes"])
def test_altered_object_is_refused_rebuilt_and_republished(tmp_path, url, s3, client, rebuilt):
    k = key(1)
    cache(tmp_path / "a", url, s3).put_bytes("executable", k, b"good bytes")
    bucket, prefix = url.removeprefix("s3://").split("/", 1)
    name = f"{prefix}/v1/objects/{meta_in_store(client, url, k)['digest'][7:]}"
    client.put_object(Bucket=bucket, Key=name, Body=b"evil bytes")  # altered in the store

    b = cache(tmp_path / "b", url, s3)
    assert b.get_bytes("executable", k) is None
    assert len(b.logged) == 1 and "is corrupt (digest mismatch)" in b.logged[0] and url in b.logged[0]
    assert b.stats["corrupt"] == [("executable", k.digest)] and b.lookup("executable", k) is None
    assert listing(client, url) == []  # its meta and the altered object are gone from the store
    b.put_bytes("executable", k, b"good bytes" if rebuilt == "same bytes" else b"rebuilt bytes")
    assert len(b.stats["published"]) == 1  # the conditional create succeeds: the bad meta was removed
    c = cache(tmp_path / "c", url, s3)
    assert c.get_bytes("executable", k) == (b"good bytes" if rebuilt == "same bytes" else b"rebuilt bytes")
    assert c.logged == [] and len(b.logged) == 1  # reported once


def test_entry_signed_by_another_key_is_not_used_under_trust(tmp_path, url, s3, client):
    for name in ("ours", "theirs"):
        r = CliRunner().invoke(deepinfer, ["keygen", str(tmp_path / f"{name}.pem")])
        assert r.exit_code == 0, r.output
    ours, theirs = (load_private_key(tmp_path / f"{n}.pem") for n in ("ours", "theirs"))
    k = key(1)
    cache(tmp_path / "a", url, s3, sign=theirs).put_bytes("executable", k, b"theirs")
    trusting = cache(tmp_path / "b", url, s3, sign=ours, trust=load_public_key(tmp_path / "ours.pem.pub"))
    assert trusting.get_bytes("executable", k) is None
    assert len(trusting.logged) == 1 and "not signed by the trusted key" in trusting.logged[0]
    assert "left in the store" in trusting.logged[0]
    assert any(n.endswith("/meta.json") for n in listing(client, url))  # not deleted: someone else's entry
    trusting.put_bytes("executable", k, b"ours")  # rebuilt locally; the store keeps the first publisher's
    assert trusting.stats["published"] == [] and trusting.get_bytes("executable", k) == b"ours"
    other = cache(tmp_path / "c", url, s3, trust=load_public_key(tmp_path / "theirs.pem.pub"))
    assert other.get_bytes("executable", k) == b"theirs"  # its signer's readers still use it
    unsigned = key(2)
    cache(tmp_path / "d", url, s3).put_bytes("executable", unsigned, b"unsigned")
    assert trusting.get_bytes("executable", unsigned) is None and "not signed" in trusting.logged[-1]


def test_store_going_away_warns_once_and_the_cache_goes_on(tmp_path):
    private = Server()  # this test's own server, stopped halfway
    url = f"s3://t-{uuid.uuid4().hex[:16]}/x"
    boto3.client("s3", endpoint_url=private.endpoint).create_bucket(Bucket=url[5:].split("/")[0])
    c = cache(tmp_path / "a", url, private.endpoint)
    c.put_bytes("executable", key(1), b"one")
    assert len(c.stats["published"]) == 1
    private.stop()
    c.put_bytes("executable", key(2), b"two")
    c.put_bytes("executable", key(3), b"three")
    assert c.get_bytes("executable", key(4)) is None
    assert len(c.logged) == 1 and c.logged[0].startswith(f"warning: cache store {url}: ")
    assert "local cache only" in c.logged[0] and c.remote is None
    assert [i for _, i in c.stats["stored"]] == ["thing"] * 3 and c.get_bytes("executable", key(3)) == b"three"


def test_missing_bucket_is_one_warning(tmp_path, s3):
    c = cache(tmp_path / "a", f"s3://t-{uuid.uuid4().hex[:16]}/x", s3)
    assert c.get_bytes("executable", key(1)) is None
    c.put_bytes("executable", key(1), b"x")
    assert len(c.logged) == 1 and "NoSuchBucket" in c.logged[0] and c.get_bytes("executable", key(1)) == b"x"


# --- deepinfer cache push / pull / ls / verify / prune --url ---


def test_cache_push_pull_ls_verify_prune_round_trip(tmp_path, url, s3, client):
    local = Cache(tmp_path / "a")
    for n in range(3):
        local.put_bytes("executable", key(n, f"exe{n}"), f"artifact {n}".encode())
    run = CliRunner().invoke
    store = ["--url", url, "--endpoint", s3]
    r = run(deepinfer, ["cache", "push", "--cache-dir", str(tmp_path / "a"), *store])
    assert r.exit_code == 0 and f"published 3 entries to {url}; 0 already there" in r.output, r.output
    r = run(deepinfer, ["cache", "push", "--cache-dir", str(tmp_path / "a"), *store])
    assert "published 0 entries" in r.output and "3 already there" in r.output
    r = run(deepinfer, ["cache", "ls", "--json", *store])
    rows = [json.loads(line) for line in r.output.splitlines()]
    assert sorted(row["identity"] for row in rows) == ["exe0", "exe1", "exe2"] and rows[0]["size"] == 10
    r = run(deepinfer, ["cache", "pull", "--cache-dir", str(tmp_path / "b"), *store])
    assert r.exit_code == 0 and "pulled 3 entries" in r.output, r.output
    assert Cache(tmp_path / "b").get_bytes("executable", key(1, "exe1")) == b"artifact 1"
    r = run(deepinfer, ["cache", "verify", *store])
    assert r.exit_code == 0 and f"3 of 3 entries intact in {url}" in r.output
    bucket, prefix = url.removeprefix("s3://").split("/", 1)
    name = f"{prefix}/v1/objects/{meta_in_store(client, url, key(0, 'exe0'))['digest'][7:]}"
    client.put_object(Bucket=bucket, Key=name, Body=b"flipped")
    r = run(deepinfer, ["cache", "verify", *store])
    assert r.exit_code == 1 and "digest mismatch (removed from the store)" in r.output and "2 of 3" in r.output
    r = run(deepinfer, ["cache", "prune", "--max-age", "1d", *store])
    assert r.exit_code == 0 and "removed 0 entries; 2 left" in r.output
    r = run(deepinfer, ["cache", "prune", "--max-age", "0s", *store])
    assert "removed 2 entries; 0 left" in r.output and listing(client, url) == []
    r = run(deepinfer, ["cache", "prune", "--max-size", "1G", *store])
    assert r.exit_code == 2 and "--max-size is for the local directory" in r.output
    r = run(deepinfer, ["cache", "push", "--cache-dir", str(tmp_path / "a")])
    assert r.exit_code == 2 and "give --url" in r.output


# --- a store that fails: one line naming the URL, a non-zero exit, whatever the command ---

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


@pytest.fixture(scope="module")
def bare_404():
    """A plain HTTP server (not S3) answering every request with a bare 404, no body: its endpoint."""
    proc = subprocess.Popen([sys.executable, "-c", BARE_404], stdout=subprocess.PIPE, text=True)
    port: list[str] = []
    reader = threading.Thread(target=lambda: port.append(proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
    reader.start()
    reader.join(WAIT)
    try:
        assert port and port[0].strip().isdigit(), f"the 404 server did not start within {WAIT} s"
        yield f"http://127.0.0.1:{port[0].strip()}"
    finally:
        proc.kill()
        proc.wait(WAIT)


COMMANDS = [["ls"], ["pull"], ["push"], ["verify"], ["prune", "--max-age", "1d"], ["explain", "0" * 8, "1" * 8]]


def cache_cli(*args: str) -> subprocess.CompletedProcess:
    """The real `deepinfer cache` in its own process (the environment is the test's: aws_env)."""
    return subprocess.run(
        [sys.executable, "-m", "deepinfer", "cache", *args], capture_output=True, text=True, timeout=120
    )


def one_line_error(r: subprocess.CompletedProcess) -> str:
    lines = (r.stdout + r.stderr).strip().splitlines()
    assert r.returncode != 0 and len(lines) == 1 and lines[0].startswith("error: "), (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    return lines[0]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_an_endpoint_answering_bare_404s_is_one_line(tmp_path, bare_404, command):
    """Every `deepinfer cache ... --url` against a server that is not S3 (a bare 404 to everything,
    no S3 error document): one line naming the URL, the bucket and the endpoint, exit 2 (it was a
    botocore traceback, the ClientError of code "404" taken for a missing key outside lookups)."""
    Cache(tmp_path / "a").put_bytes("executable", key(1), b"one")  # push has an entry to publish
    r = cache_cli(*command, "--cache-dir", str(tmp_path / "a"), "--url", "s3://bkt/p", "--endpoint", bare_404)
    line = one_line_error(r)
    assert r.returncode == 2 and line.startswith("error: s3://bkt/p: ") and "HTTP 404" in line, line
    assert "'bkt'" in line and bare_404 in line, line


def test_a_compile_against_a_bare_404_endpoint_warns_once_and_goes_on(tmp_path, bare_404):
    """A compile's cache (lookups miss, the publish's upload fails) against the same server: one
    warning in the compile's terms and the local entry kept (the upload's ClientError of code "404"
    escaped Cache.publish as a traceback)."""
    c = cache(tmp_path / "a", "s3://bkt/p", bare_404)
    assert c.get_bytes("executable", key(1)) is None
    c.put_bytes("executable", key(1), b"one")
    assert len(c.logged) == 1 and c.logged[0].startswith("warning: cache store s3://bkt/p: put object: HTTP 404")
    assert "this compile goes on with the local cache only" in c.logged[0] and c.remote is None
    assert c.get_bytes("executable", key(1)) == b"one"


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_no_credentials_or_no_bucket_is_one_line_in_the_commands_terms(tmp_path, s3, monkeypatch, command):
    """Without credentials, and against moto's server with a bucket that does not exist: one line naming
    the URL and what is wrong, exit 2, and nothing of a compile's fallback (push and pull said "this
    compile goes on with the local cache only" and exited 1)."""
    Cache(tmp_path / "a").put_bytes("executable", key(1), b"one")
    where = ["--cache-dir", str(tmp_path / "a")]
    missing = f"t-{uuid.uuid4().hex[:16]}"
    r = cache_cli(*command, *where, "--url", f"s3://{missing}/p", "--endpoint", s3)
    line = one_line_error(r)
    assert r.returncode == 2 and line.startswith(f"error: s3://{missing}/p: ") and "NoSuchBucket" in line, line
    assert f"no bucket {missing!r} at {s3}" in line and "compile" not in line, line
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance-role lookup (it waits on a timeout)
    r = cache_cli(*command, *where, "--url", "s3://bkt/p", "--endpoint", s3)
    line = one_line_error(r)
    assert r.returncode == 2 and line.startswith("error: s3://bkt/p: ") and "no AWS credentials" in line, line
    assert "compile" not in line, line


# --- configuration ---


def test_cache_url_precedence_and_config_errors(tmp_path, tiny_ckpt, monkeypatch):
    from deepinfer.compiler.cache.remote import open_store
    from deepinfer.errors import ConfigError

    toml = write_toml(
        tmp_path / "m", tiny_ckpt, extra='[cache]\nurl = "s3://from-toml/p"\nendpoint = "http://toml:9000"\n'
    )
    c = load_compile_config(toml).cache
    assert (c.url, c.endpoint) == ("s3://from-toml/p", "http://toml:9000")
    assert open_store(None, None, c.url, c.endpoint, print).url == "s3://from-toml/p"
    monkeypatch.setenv("DEEPINFER_CACHE_URL", "s3://from-env/p")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://env:9000")
    s = open_store(None, None, c.url, c.endpoint, print)
    assert (s.url, s.endpoint) == ("s3://from-env/p", "http://env:9000")
    s = open_store("s3://from-flag/p", "http://flag:9000", c.url, c.endpoint, print)
    assert (s.url, s.endpoint) == ("s3://from-flag/p", "http://flag:9000")
    monkeypatch.setenv("DEEPINFER_CACHE_URL", "gs://wrong")
    with pytest.raises(StoreError, match=r"^\$DEEPINFER_CACHE_URL: cache URL 'gs://wrong': expected s3://"):
        open_store(None, None, c.url, c.endpoint, print)
    for extra, where in [
        ('[cache]\nurl = "/tmp/x"\n', r"cache\.url: '/tmp/x': expected s3://bucket/prefix"),
        ('[cache]\nurl = "s3://bkt/p"\nendpoint = "minio"\n', r"cache\.endpoint: 'minio': expected an http://"),
        (
            '[cache]\nurl = "s3://bkt/p"\naws_secret_access_key = "x"\n',
            r"cache\.aws_secret_access_key: credentials are never",
        ),
        ('[cache]\naccess_key = "x"\n', r"cache\.access_key: credentials are never read from model\.toml"),
        ('[cache]\nbucket = "x"\n', r"cache\.bucket: .*dir, url, endpoint"),
    ]:
        bad = write_toml(tmp_path / f"bad{len(where)}", tiny_ckpt, extra=extra)
        with pytest.raises(ConfigError, match=rf"^{bad}:\d+: {where}"):
            load_compile_config(bad)
    r = CliRunner().invoke(compile_cli, [str(toml), "--no-cache", "--cache-url", "s3://bucket/x"])
    assert r.exit_code == 2 and "--no-cache excludes" in r.output


# --- end to end (compiles: slow) ---


@pytest.mark.slow
def test_second_machine_compiles_nothing(filled, small_toml, tmp_path, url, s3):
    """The filled cache pushed to the store (a build machine's); a compile on an empty local directory
    takes every entry from the store and compiles nothing, and its bundle records the entries used."""
    cache_dir, bundle, _ = filled
    store = ["--url", url, "--endpoint", s3]
    r = CliRunner().invoke(deepinfer, ["cache", "push", "--cache-dir", str(cache_dir), *store])
    assert r.exit_code == 0, r.output
    pushed = int(r.output.split("published ")[1].split()[0])
    args = [str(small_toml), "-o", str(tmp_path / "b"), "--cache-dir", str(tmp_path / "empty"), "--json"]
    r = CliRunner().invoke(compile_cli, [*args, "--cache-url", url, "--cache-endpoint", s3, "--require-cache"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert report["compiled"] == [] and report["executables"] == EXECUTABLES
    assert report["store"] == url and report["tiers"] == {"local": 0, "store": pushed, "published": 0}
    assert f"0 of {EXECUTABLES} executables compiled" in r.stderr and f"{pushed} from {url}" in r.stderr
    keys = json.loads((tmp_path / "b" / "cache-keys.json").read_text())["entries"]
    assert len(keys) == pushed
    r = CliRunner().invoke(
        deepinfer, ["cache", "pull", "--bundle", str(tmp_path / "b"), "--cache-dir", str(tmp_path / "c"), *store]
    )
    assert r.exit_code == 0 and f"pulled {pushed} entries" in r.output, r.output


@pytest.mark.slow
def test_dead_store_warns_once_and_the_compile_succeeds(cache_copy, small_toml, tmp_path):
    """A store nobody answers at (a bound port that does not listen: no race for it): one warning,
    the executables the local cache lacks are compiled, exit 0."""
    for kind in ("executable", "trace"):
        for entry in (cache_copy / "v1" / kind).glob("*/*"):
            for f in entry.iterdir():
                f.unlink()
            entry.rmdir()
    with socket.socket() as dead:
        dead.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{dead.getsockname()[1]}"
        args = [str(small_toml), "-o", str(tmp_path / "b"), "--cache-dir", str(cache_copy), "--json"]
        r = CliRunner().invoke(compile_cli, [*args, "--cache-url", "s3://gone/x", "--cache-endpoint", endpoint])
    assert r.exit_code == 0, r.output
    warnings = [line for line in r.stderr.splitlines() if "warning: cache store" in line]
    assert len(warnings) == 1 and "s3://gone/x" in warnings[0], r.stderr
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(report["compiled"]) == EXECUTABLES and report["tiers"]["published"] == 0
