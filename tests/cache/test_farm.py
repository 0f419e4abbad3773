"""deepinfer-compile --ray: the compile jobs on a real two-node Ray cluster started here (a head and
one worker node, one CPU each), against local compiles: same bytes, a killed worker retried, a job
that fails twice failing the compile in one line, and bad addresses refused in seconds."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from deepinfer.bundles.layout import CACHE_KEYS_FILE
from deepinfer.compiler import farm
from deepinfer.compiler.cache.local import Cache
from deepinfer.compiler.cli import main as compile_cli
from deepinfer.compiler.config import load_compile_config
from deepinfer.compiler.pipeline import compile_bundle

from ..conftest import CACHE_ENV, write_model_toml
from .conftest import EXECUTABLES, write_toml

NODE = {"num_cpus": 1, "object_store_memory": 80 * 2**20}
# the nodes' own AWS chain: dummy credentials for moto's S3 server (test (d)); nothing of the user's
NODE_AWS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
}


@pytest.fixture(scope="session")
def ray_cluster():
    """The address of a two-node cluster (head and worker, one CPU each), shut down after the session.
    Its processes start with `NODE_AWS` in their environment, as a node's own credentials."""
    pytest.importorskip("ray")
    import ray
    from ray.cluster_utils import Cluster

    with pytest.MonkeyPatch.context() as env:
        for name, value in NODE_AWS.items():
            env.setenv(name, value)
        cluster = Cluster(initialize_head=True, head_node_args={**NODE, "include_dashboard": False})
        try:
            cluster.add_node(**NODE)
            cluster.wait_for_nodes(timeout=60)
        except BaseException:
            cluster.shutdown()
            raise
    try:
        yield cluster.address
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="module")
def s3_endpoint():
    """moto's S3 server on a port the OS picks (tests/cache/test_remote.py's)."""
    pytest.importorskip("boto3")
    pytest.importorskip("moto.server")
    from .test_remote import Server

    server = Server()
    yield server.endpoint
    server.stop()


def manifest(bundle: Path) -> dict:
    return json.loads((bundle / "manifest.json").read_text())


def farm_compile(toml: Path, out: Path, address: str, cache_dir: Path | None, lines: list[str]):
    cache = Cache(cache_dir) if cache_dir is not None else None
    return compile_bundle(
        load_compile_config(toml), out, jobs=1, force=True, log=lines.append, cache=cache, ray=address
    )


# --- (a) the farm builds the bytes a local compile builds --------------------------------------------


FARMED = ("attn_window.decode.b4t1", "moe.decode.b4t1", "head.decode.b4t1")  # one more than the nodes


def test_farm_bundle_matches_the_local_one(ray_cluster, aoti_bundle, tiny_ckpt, tmp_path):
    """The suite's AOTInductor bundle (compiled locally, conftest.aoti_bundle) compiled again with --ray:
    a cache holding what the local compile used (its cache-keys.json) but three of its executables, so
    that the farm compiles those three (an AOTInductor compile is ~15 s). The bundle's manifest, every
    executable's digest included, is the local one; a progress line per job names its node."""
    shared = Cache(Path(os.environ[CACHE_ENV]))
    cache = Cache(tmp_path / "cache")
    used = json.loads((aoti_bundle / CACHE_KEYS_FILE).read_text())["entries"]
    for e in used:
        if not (e["kind"] == "executable" and e["identity"] in FARMED):
            shutil.copytree(shared.entry_dir(e["kind"], e["key"]), cache.entry_dir(e["kind"], e["key"]))
    toml = write_model_toml(
        tmp_path,
        tiny_ckpt,
        executable="aoti",
        batch=(4,),
        tokens=(1,),
        max_context=80,
        num_blocks=21,
        cache_quant=False,
    )
    lines: list[str] = []
    report = farm_compile(toml, tmp_path / "farm", ray_cluster, tmp_path / "cache", lines)
    assert sorted(report.compiled) == sorted(FARMED) and report.executables == EXECUTABLES
    assert manifest(report.bundle) == manifest(aoti_bundle)
    done = [line for line in lines if line.startswith("farm [") and " compiled " in line]
    assert len(done) == len(FARMED) and done[-1].startswith(f"farm [{len(FARMED)}/{len(FARMED)}]")
    assert all(" on " in line and " done " in line and " running" in line and "ETA" in line for line in done)
    stored = {e.meta["identity"] for e in Cache(tmp_path / "cache").entries(("executable",))}
    assert stored >= set(FARMED)  # the host stored what the farm built


# --- (b), (c) retries and failures (saved ExportedPrograms: no C++ compile) -------------------------


def test_a_worker_killed_mid_job_is_retried(ray_cluster, tiny_ckpt, tmp_path, monkeypatch):
    marker = tmp_path / "died"
    monkeypatch.setenv(farm.TEST_DIE_ONCE, str(marker))
    lines: list[str] = []
    report = farm_compile(write_toml(tmp_path, tiny_ckpt), tmp_path / "b", ray_cluster, None, lines)
    assert marker.exists()  # one worker died (os._exit) in its first job
    assert len(report.compiled) == EXECUTABLES
    assert (report.bundle / "manifest.json").is_file()
    last = [line for line in lines if line.startswith("farm [")][-1]
    assert ", 1 retried" in last, last


def test_a_job_failing_twice_fails_the_compile_in_one_line(ray_cluster, tiny_ckpt, tmp_path, monkeypatch):
    monkeypatch.setenv(farm.TEST_FAIL, "moe.")
    toml = write_toml(tmp_path, tiny_ckpt)
    out = tmp_path / "b"
    result = CliRunner().invoke(compile_cli, [str(toml), "-o", str(out), "--no-cache", "--ray", ray_cluster])
    assert result.exit_code == 2, result.output
    error = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(error) == 1, result.output
    line = error[0]
    assert "region moe (decode), bucket batch 1 x tokens 1" in line
    assert "failed twice the same way" in line and "this job fails on purpose" in line
    assert "node " in line and "(id " in line
    kept = out.parent / f"{out.name}.failed-logs" / "moe.decode.b1t1.farm.log"
    assert f"log: {kept}" in line and "attempt 2 on node" in kept.read_text()
    assert not out.exists()


class _SilentLedger:
    """A ledger whose snapshot answers after `seconds`: a head node too loaded to answer in time."""

    def snapshot(self, seconds: float = 30.0) -> dict:
        time.sleep(seconds)
        return {}


def test_a_ledger_that_does_not_answer_is_a_one_line_farm_error(ray_cluster, monkeypatch):
    import ray

    farm.connect(ray_cluster)
    monkeypatch.setattr(farm, "LEDGER_TIMEOUT_S", 1.0)
    ledger = ray.remote(num_cpus=0)(_SilentLedger).remote()
    try:
        assert ray.get(ledger.snapshot.remote(0.0), timeout=120) == {}  # the actor is up: only its answer is late
        with pytest.raises(farm.FarmError) as e:
            farm._snapshot(ray, ledger)
        assert "job ledger" in str(e.value) and "did not answer in 1 s" in str(e.value)
        assert "\n" not in str(e.value)
    finally:
        ray.kill(ledger)


# --- (d) results shared through the store ---------------------------------------------------------


def test_workers_publish_to_the_store_and_the_host_reads_through(
    ray_cluster, s3_endpoint, tiny_ckpt, tmp_path, monkeypatch
):
    """With a remote store, workers publish each executable and return no bytes: the host's local
    cache gets every one by read-through (verified against the store's digest)."""
    import uuid

    import boto3

    from deepinfer.compiler.cache.remote import Store

    for name, value in NODE_AWS.items():
        monkeypatch.setenv(name, value)
    bucket = f"farm-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=bucket)
    cache = Cache(tmp_path / "host-cache", remote=Store.from_url(f"s3://{bucket}/ci", s3_endpoint))
    report = compile_bundle(
        load_compile_config(write_toml(tmp_path, tiny_ckpt)),
        tmp_path / "b",
        force=True,
        log=lambda msg: None,
        cache=cache,
        ray=ray_cluster,
    )
    assert len(report.compiled) == EXECUTABLES
    from_store = [what for kind, what in cache.stats["remote"] if kind == "executable"]
    assert sorted(from_store) == sorted(report.compiled)  # every one read through, none sent back by Ray
    listed = boto3.client("s3", endpoint_url=s3_endpoint).list_objects_v2(Bucket=bucket, Prefix="ci/v1/executable/")
    assert len([o for o in listed.get("Contents", []) if o["Key"].endswith("/meta.json")]) == EXECUTABLES


# --- reproducible AOTInductor packages (bundles/pt2.normalize_package) -------------------------------


def _package(path: Path, serialization_id: bytes, appended: int) -> Path:
    """An archive shaped like an AOTInductor package: a wrapper source that AOTInductor appended its
    compile commands to `appended` times (once per compile of the cached source), and an id."""
    import zipfile

    source = b"// generated\nint main() {}\n" + b"\n// Compile cmd\n// g++ /some/cache/x.cpp\n" * appended
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("m/data/aotinductor/model/x.wrapper.cpp", source)
        z.writestr("m/data/aotinductor/model/x.wrapper.so", b"\x7fELF")
        z.writestr("m/.data/serialization_id", serialization_id)
    return path


def test_packages_of_one_program_normalize_to_the_same_bytes(tmp_path):
    from deepinfer.bundles.pt2 import normalize_package

    cold = _package(tmp_path / "cold.pt2", b"1374611803619092859015197142673977563787", appended=1)
    warm = _package(tmp_path / "warm.pt2", b"0221294188887077102404789295173985261463", appended=2)
    other = tmp_path / "other.pt2"
    with zipfile.ZipFile(other, "w") as z:
        z.writestr("m/data/aotinductor/model/x.wrapper.so", b"\x7fELF another")
        z.writestr("m/.data/serialization_id", b"0221294188887077102404789295173985261463")
    for p in (cold, warm, other):
        normalize_package(p)
    assert cold.read_bytes() == warm.read_bytes() != other.read_bytes()
    with zipfile.ZipFile(cold) as z:
        assert z.testzip() is None
        assert z.read("m/data/aotinductor/model/x.wrapper.cpp") == b"// generated\nint main() {}\n"
        assert len(z.read("m/.data/serialization_id")) == 40
    before = cold.read_bytes()
    normalize_package(cold)
    assert cold.read_bytes() == before  # idempotent


# --- the address -----------------------------------------------------------------------------------


def test_an_address_nothing_answers_fails_in_seconds(tiny_ckpt, tmp_path):
    """A port bound here but never listened on: refused at once (and held, so no one else takes it)."""
    pytest.importorskip("ray")
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{held.getsockname()[1]}"
        toml = write_toml(tmp_path, tiny_ckpt)
        start = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "deepinfer.compiler.cli", str(toml), "-o", str(tmp_path / "b"), "--ray", address],
            capture_output=True,
            text=True,
            timeout=120,
            env=dict(os.environ, RAY_ADDRESS=""),
        )
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"--ray {address}: cannot reach it" in errors[0], proc.stderr
    assert "ray start --head" in errors[0]
    assert time.perf_counter() - start < 60 + farm.CONNECT_TIMEOUT_S
    assert not (tmp_path / "b").exists()


def test_a_malformed_address_is_named():
    pytest.importorskip("ray")
    with pytest.raises(farm.FarmError, match=r"--ray nowhere: expected auto or HOST:PORT"):
        farm.connect("nowhere")


def test_without_ray_the_flag_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    with pytest.raises(farm.FarmError, match=r"pip install 'deepinfer\[farm\]'"):
        farm.connect("auto")
