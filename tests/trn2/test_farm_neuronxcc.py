"""deepinfer-compile --ray for the trn2 target: neuronx-cc jobs on a real Ray cluster started here, each
node running the neuronx-cc stand-in (tests/trn2/doubles/neuronx_cc_stub.py, a TEST DOUBLE that compiles
nothing) through a wrapper of its own, as a node has its own install.

The stand-in's NEFFs carry a random uuid in their header (neuronx-cc's do too), so two compiles of one
module differ in those 16 bytes only: "the same NEFF" below is the same bytes with the uuid masked."""

from __future__ import annotations

import json
import os
import stat
import struct
import sys
from collections import Counter
from pathlib import Path

import pytest

from deepinfer.bundles.neff import HEADER_SIZE
from deepinfer.compiler import farm
from deepinfer.compiler.config import load_compile_config
from deepinfer.compiler.farm_worker import with_message
from deepinfer.compiler.pipeline import compile_bundle
from deepinfer.compiler.targets import neuronxcc
from deepinfer.errors import DeepinferError

from ..conftest import write_model_toml
from .conftest import STAND_IN
from .doubles.neuronx_cc_stub import DEFAULT_VERSION, HEADER

NODE = {"num_cpus": 1, "object_store_memory": 80 * 2**20}
OTHER_VERSION = "2.98.0.0+0000000e"  # the stand-in's format, another (impossible) release
_BEFORE_UUID = struct.calcsize(HEADER.format[: HEADER.format.index("16s")])  # the header's fields before it
UUID = slice(_BEFORE_UUID, _BEFORE_UUID + 16)  # the uuid field's bytes in a NEFF header


def _wrapper(directory: Path, version: str) -> Path:
    """A node's neuronx-cc: the stand-in (TEST DOUBLE) reporting `version`, failing with the NCC code in
    `<directory>/fail` while that file exists (only the modules whose output name matches the regular
    expression in `<directory>/fail-match`, where that exists), and recording each call to
    `<directory>/calls.jsonl`."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "neuronx-cc"
    path.write_text(
        "#!/bin/sh\n# TEST DOUBLE: the neuronx-cc stand-in as one Ray node has it\n"
        f"export FAKE_NEURONX_CC_VERSION='{version}' FAKE_NEURONX_CC_RECORD='{directory}/calls.jsonl'\n"
        f'[ -f "{directory}/fail" ] && export FAKE_NEURONX_CC_FAIL="$(cat "{directory}/fail")"\n'
        f'[ -f "{directory}/fail-match" ] && export FAKE_NEURONX_CC_FAIL_MATCH="$(cat "{directory}/fail-match")"\n'
        f'exec "{sys.executable}" "{STAND_IN.parent / "neuronx_cc_stub.py"}" "$@"\n'
    )
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def _start(nodes: list[tuple[Path, dict]]):
    """A Ray cluster of one-CPU nodes, each started with DEEPINFER_NEURONX_CC at its own wrapper and
    its declared resources; the first is the head."""
    pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    cluster = None
    try:
        for i, (wrapper, resources) in enumerate(nodes):
            with pytest.MonkeyPatch.context() as env:
                env.setenv(neuronxcc.ENV_COMPILER, str(wrapper))
                for var in ("FAKE_NEURONX_CC_FAIL", "FAKE_NEURONX_CC_VERSION", "FAKE_NEURONX_CC_RECORD"):
                    env.delenv(var, raising=False)
                args = {**NODE, "resources": resources}
                if i == 0:
                    cluster = Cluster(initialize_head=True, head_node_args={**args, "include_dashboard": False})
                else:
                    assert cluster is not None
                    cluster.add_node(**args)
        assert cluster is not None
        cluster.wait_for_nodes(timeout=60)
    except BaseException:
        if cluster is not None:
            cluster.shutdown()
        raise
    return cluster


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    """Two nodes with the stand-in's default version and no declared resources: (address, node dirs)."""
    import ray

    root = tmp_path_factory.mktemp("farm-nodes")
    dirs = [root / "head", root / "worker"]
    cluster = _start([(_wrapper(d, DEFAULT_VERSION), {}) for d in dirs])
    try:
        yield cluster.address, dirs
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="module")
def toml(tmp_path_factory, tiny_ckpt) -> Path:
    """The tiny model for trn2 (fused layers: one module per layer kind), bucket (1, 1), no XLA:CPU check
    (the lowering tests check it; here only the jobs matter)."""
    return write_model_toml(
        tmp_path_factory.mktemp("farm-trn2"),
        tiny_ckpt,
        target="trn2",
        executable="neff",
        options="{ lnc = 1, optlevel = 1, check = false }",
    )


@pytest.fixture
def host(stub, monkeypatch):
    """The host's neuronx-cc: the stand-in itself (conftest `stub`), with the default version."""
    monkeypatch.delenv(farm.TEST_FAIL, raising=False)
    return stub


def _compile(toml: Path, out: Path, ray: str | None, lines: list[str]):
    return compile_bundle(load_compile_config(toml), out, jobs=1, force=True, log=lines.append, cache=None, ray=ray)


def _calls(directory: Path, name: str = "calls.jsonl") -> list[dict]:
    """The compile calls a stand-in recorded in `directory / name`."""
    path = directory / name
    lines = path.read_text().splitlines() if path.is_file() else []
    return [c for c in map(json.loads, lines) if c["argv"][:1] == ["compile"]]


def _masked(neff: bytes) -> bytes:
    assert len(neff) > HEADER_SIZE
    return neff[: UUID.start] + bytes(16) + neff[UUID.stop :]


def _without_run_facts(manifest: dict) -> dict:
    """A manifest without what differs between two neuronx-cc runs of one module: each NEFF's digest
    and its header's uuid, and the digests of the compiler's logs (they name the paths it ran in)."""
    for region in manifest["regions"]:
        region.pop("digest")
        region["neff"].pop("uuid")
    manifest["files"] = {path: "" if path.endswith((".neff", ".log")) else d for path, d in manifest["files"].items()}
    return manifest


@pytest.mark.slow  # lowers the tiny model's modules and starts Ray nodes
def test_the_farm_runs_neuronx_cc_on_the_nodes_and_lands_what_a_local_compile_lands(
    nodes, toml, host, tmp_path, monkeypatch
):
    """Every NEFF job runs the stand-in on a node (its call recorded there, none on the host); each NEFF
    and its log come back into the bundle, and the bundle is the local compile's (but for the uuids)."""
    address, dirs = nodes
    local = _compile(toml, tmp_path / "local", None, [])
    record = Path(os.environ["FAKE_NEURONX_CC_RECORD"])  # the host's stand-in
    record.unlink()
    lines: list[str] = []
    farmed = _compile(toml, tmp_path / "farm", address, lines)
    assert sorted(farmed.compiled) == sorted(local.compiled) and len(local.compiled) >= 5
    on_nodes = [c for d in dirs for c in _calls(d)]
    assert len(on_nodes) == len(local.compiled)  # each job once, on a node
    assert not _calls(record.parent, record.name)  # none on the host
    neffs = sorted((local.bundle / "regions").glob("*.neff"))
    assert len(neffs) == len(local.compiled)
    for neff in neffs:
        theirs = (farmed.bundle / "regions" / neff.name).read_bytes()
        assert _masked(theirs) == _masked(neff.read_bytes()), neff.name
    logs = sorted(p.name for p in (farmed.bundle / "logs").rglob("*.log"))
    assert logs == sorted(p.name for p in (local.bundle / "logs").rglob("*.log")) and logs
    manifests = [json.loads((b.bundle / "manifest.json").read_text()) for b in (local, farmed)]
    assert _without_run_facts(manifests[0]) == _without_run_facts(manifests[1])
    done = [line for line in lines if line.startswith("farm [") and " compiled " in line]
    assert len(done) == len(local.compiled)
    assert [line for line in lines if line.startswith("farm: toolchain checked on 2 node(s)")]


@pytest.mark.slow  # lowers the tiny model's modules and starts Ray nodes
def test_a_node_with_another_neuronx_cc_is_refused_before_any_job(nodes, toml, host, tmp_path, monkeypatch):
    """The host's compile expects another version than the nodes have: one line naming each node and
    both versions, before any job runs; no bundle."""
    address, dirs = nodes
    before = sum(len(_calls(d)) for d in dirs)
    monkeypatch.setenv("FAKE_NEURONX_CC_VERSION", OTHER_VERSION)  # the host's stand-in
    neuronxcc._VERSIONS.clear()
    with pytest.raises(farm.FarmError) as info:
        _compile(toml, tmp_path / "b", address, [])
    message = str(info.value)
    assert "\n" not in message
    assert message.count(f"has neuronx-cc {DEFAULT_VERSION} where the host's compile expects {OTHER_VERSION}") == 2
    assert message.count("node ") == 2 and "(id " in message
    assert "neuronx_cc:" in message  # how to send the jobs only where the version is
    assert sum(len(_calls(d)) for d in dirs) == before  # no job ran
    assert not (tmp_path / "b").exists()


@pytest.mark.slow  # lowers the tiny model's modules and starts Ray nodes
def test_a_refusal_on_a_node_is_the_local_jobs_error_with_its_code_and_log(nodes, toml, host, tmp_path):
    """The stand-in refuses the embedding's modules with an NCC code on every node (a region that is
    never fused, so no fallback runs): the compile raises the NeuronCompileError a local job raises (its
    NCC code, the log on the host under <out>.failed-logs/), after one attempt of each module."""
    address, dirs = nodes
    before = {d: len(_calls(d)) for d in dirs}
    for d in dirs:
        (d / "fail").write_text("NCC_IBIR297")
        (d / "fail-match").write_text(r"^embed\.")
    lines: list[str] = []
    try:
        with pytest.raises(neuronxcc.NeuronCompileError) as info:
            _compile(toml, tmp_path / "b", address, lines)
    finally:
        for d in dirs:
            (d / "fail").unlink()
            (d / "fail-match").unlink()
    message = str(info.value)
    assert "\n" not in message and ": neuronx-cc failed with NCC_IBIR297: stand-in failure" in message
    kept = tmp_path / "b.failed-logs"
    assert f"(log: {kept}/" in message and "<worker" not in message
    log = Path(message.rsplit("(log: ", 1)[1].rstrip(")"))
    assert log.is_file() and "NCC_IBIR297" in log.read_text()
    assert message.startswith("region embed.") and message.split(":")[0].removeprefix("region ") in log.name
    tried = Counter(Path(c["argv"][c["argv"].index("--output") + 1]).name for d in dirs for c in _calls(d)[before[d] :])
    assert any(name.startswith("embed.") for name in tried) and max(tried.values()) == 1, tried  # none run again
    assert [line for line in lines if "refused by the compiler on node " in line]
    assert not (tmp_path / "b").exists()


@pytest.mark.slow  # lowers the tiny model's modules and starts Ray nodes
def test_declared_resources_send_jobs_only_where_the_hosts_version_is(toml, host, tmp_path, monkeypatch):
    """Nodes that declare neuronx_cc:<version>: the jobs go only to those declaring the host's; a host
    whose version no node declares is refused in one line naming what is declared."""
    import ray

    dirs = [tmp_path / "head", tmp_path / "other"]
    cluster = _start(
        [
            (_wrapper(dirs[0], DEFAULT_VERSION), {f"neuronx_cc:{DEFAULT_VERSION}": 2}),
            (_wrapper(dirs[1], OTHER_VERSION), {f"neuronx_cc:{OTHER_VERSION}": 2}),
        ]
    )
    try:
        monkeypatch.setenv("FAKE_NEURONX_CC_VERSION", OTHER_VERSION)
        neuronxcc._VERSIONS.clear()
        report = _compile(toml, tmp_path / "b", cluster.address, [])
        assert len(_calls(dirs[1])) == len(report.compiled) and not _calls(dirs[0])
        monkeypatch.setenv("FAKE_NEURONX_CC_VERSION", "2.97.0.0+0000000f")
        neuronxcc._VERSIONS.clear()
        with pytest.raises(farm.FarmError) as info:
            _compile(toml, tmp_path / "c", cluster.address, [])
        message = str(info.value)
        assert "\n" not in message and "no node declares neuronx_cc:2.97.0.0+0000000f" in message
        assert f"neuronx_cc:{DEFAULT_VERSION} on node " in message and f"neuronx_cc:{OTHER_VERSION} on node " in message
        assert not (tmp_path / "c").exists()
    finally:
        ray.shutdown()
        cluster.shutdown()


class _Refused(DeepinferError):
    """An error whose constructor takes more than its message (as a refusal's code)."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message, code)
        self.code = code

    def __str__(self) -> str:
        return str(self.args[0])


def test_a_refusal_gets_the_hosts_log_path_and_keeps_its_type_and_fields():
    error = _Refused("region x: neuronx-cc failed with NCC_IBIR297: no (log: <worker log>)", "NCC_IBIR297")
    again = with_message(error, str(error).replace("<worker log>", "/b.failed-logs/x.log"))
    assert type(again) is _Refused and again.code == "NCC_IBIR297"
    assert str(again) == "region x: neuronx-cc failed with NCC_IBIR297: no (log: /b.failed-logs/x.log)"
    plain = with_message(neuronxcc.NeuronCompileError("region x: failed (log: a)"), "region x: failed (log: b)")
    assert type(plain) is neuronxcc.NeuronCompileError and str(plain) == "region x: failed (log: b)"
