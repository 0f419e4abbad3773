"""Contract tests of the trn2 runtime path against TEST DOUBLES; they prove nothing about Trn2 numerics.

The tiny HLO-stage bundle is finished by the stand-in neuronx-cc (doubles/neuronx-cc),
whose "NEFFs" carry only a description of each HLO module's interface (the tensor names
the module stamps, neff_input_names / neff_output_names, listed in lexical order as
libnrt lists them; byte sizes; must-alias entries as copies), and is run by
`deepinfer.runtime.load` over the libnrt double (doubles/fake_nrt.c), which zero-fills
every output it does not copy from an input. The logits are therefore zeros: these
tests check plumbing only (what is loaded, allocated, sliced, bound, copied between
host and device, and freed, and how often), read from the double's call log.
"""

from __future__ import annotations

import io
import json
import re
import shutil
import tarfile
from collections import Counter
from pathlib import Path

import pytest

from deepinfer.bundles import layout, neff
from deepinfer.bundles.manifest import BundleError
from deepinfer.runtime import RunOptions, generate, load
from deepinfer.runtime.neuron.device import NeuronCore

from .conftest import finished_copy

DOUBLES = Path(__file__).resolve().parent / "doubles"
ITEMSIZE = {"float32": 4, "bfloat16": 2, "int64": 8, "int32": 4, "uint8": 1, "bool": 1}


@pytest.fixture(scope="module")
def finished(trn2_hlo_bundle, tmp_path_factory) -> Path:
    """A copy of the tiny HLO-stage bundle finished by the stand-in neuronx-cc (TEST DOUBLE NEFFs)."""
    return finished_copy(trn2_hlo_bundle, tmp_path_factory.mktemp("session") / "bundle")


@pytest.fixture
def nrt(fake_nrt, monkeypatch):
    """The libnrt double, with the placement's process-wide LNC setting undone after the test."""
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "")
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG")
    return fake_nrt


def manifest(bundle: Path) -> dict:
    return json.loads((bundle / layout.MANIFEST_FILE).read_text())


def fake_model_of(path: Path) -> str:
    """The fake-model text the stand-in put in a NEFF's (plain tar) payload."""
    header = neff.read_header(path)
    assert not header.compressed
    payload = path.read_bytes()[header.payload_offset : header.payload_offset + header.data_size]
    with tarfile.open(fileobj=io.BytesIO(payload)) as tar:
        return tar.extractfile("fake-model.txt").read().decode()


def nbytes(spec: dict) -> int:
    n = ITEMSIZE[spec["dtype"]]
    for d in spec["shape"]:
        n *= d
    return n


def field(line: str, key: str) -> str:
    return re.search(rf"\b{key}=(\S+)", line).group(1)


def executions(lines: list[str]) -> list[tuple[list, list, str]]:
    """(input bindings, output bindings, the execute line) per nrt_execute; a binding is
    (NEFF tensor name, device tensor name). NeuronModel.execute fills the input set, then
    the output set, then executes."""
    sets, out = [], []
    for line in lines:
        if line.startswith("nrt_allocate_tensor_set"):
            sets.append([])
        elif line.startswith("nrt_add_tensor_to_tensor_set"):
            sets[-1].append((field(line, "name"), field(line, "tensor")))
        elif line.startswith("nrt_execute"):
            out.append((sets[-2], sets[-1], line))
    return out


def test_stand_in_neffs_describe_the_manifest_interface(finished):
    """Each NEFF's fake model (read by the stand-in from the HLO module) has the manifest's
    inputs and outputs by name, in libnrt's lexical order, with their byte sizes, and copies
    exactly its (must-)aliases."""
    m = manifest(finished)
    assert m["stage"] == "executable"
    for e in m["regions"]:
        lines = fake_model_of(finished / e["artifact"]).splitlines()
        assert lines[0] == "FAKE_NRT_MODEL 1" and lines[-1] == "end"
        assert [ln for ln in lines if ln.startswith("input ")] == [
            f"input {s['name']} {nbytes(s)}" for s in sorted(e["inputs"], key=lambda s: s["name"])
        ], e["kind"]
        assert [ln for ln in lines if ln.startswith("output ")] == [
            f"output out_{s['name']} {nbytes(s)}" for s in sorted(e["output_specs"], key=lambda s: s["name"])
        ], e["kind"]
        assert sorted(ln for ln in lines if ln.startswith("copy ")) == sorted(
            f"copy out_{e['output_specs'][int(j)]['name']} {e['inputs'][i]['name']}" for j, i in e["aliases"].items()
        ), e["kind"]
        assert len(e["aliases"]) == len(e["state_outputs"])


def transfers(lines: list[str]) -> list[dict]:
    """Per step (each ends with the head's logits read back): the tensors written host->device and
    read device->host, with their bytes, from the double's log."""
    steps, cur = [], {"to_device": [], "to_host": []}
    for line in lines:
        if line.startswith(("nrt_tensor_write", "nrt_tensor_read")):
            way = "to_device" if line.startswith("nrt_tensor_write") else "to_host"
            cur[way].append((field(line, "name"), int(field(line, "size"))))
            if way == "to_host" and field(line, "name") == "out:logits":
                steps.append(cur)
                cur = {"to_device": [], "to_host": []}
    return steps


def test_generate_through_the_doubles(finished, nrt):
    m = manifest(finished)
    session = load(finished)
    gens = generate(session, [[1, 5, 9]], RunOptions(max_new_tokens=2, keep_logits=True))
    steps, vocab, stats = gens.stats.steps, session.config.text.vocab_size, gens.stats
    session.close()
    lines = nrt.lines()
    calls = Counter(nrt.calls())

    # shapes and plumbing only: the double zero-fills the head's logits, so argmax picks token 0
    (g,) = gens
    assert g.error is None and len(g.tokens) == 3 + 2
    assert len(g.logits) == 4 and all(t.shape == (vocab,) and not t.any() for t in g.logits)
    assert steps == 4  # bucket tokens = 1: 3 prompt steps, then 1 decode step

    # one runtime, one load per executable (not per layer), all of them stand-in NEFFs
    assert calls["nrt_init"] == 1 and calls["nrt_close"] == 1
    loads = [ln for ln in lines if ln.startswith("nrt_load")]
    assert len(loads) == len(m["regions"]) == 8  # the embedding, six layer kinds (fused), the head
    assert all(ln.endswith("source=neff -> 0") for ln in loads)
    assert sorted(int(field(ln, "size")) for ln in loads) == sorted(
        (finished / e["artifact"]).stat().st_size for e in m["regions"]
    )
    assert calls["nrt_unload"] == 8

    # resident allocations: one per weight stack and per pool; an input buffer per host input name (shared
    # by the executables) and the outputs once per executable
    allocs = [field(ln, "name") for ln in lines if ln.startswith("nrt_tensor_allocate ")]
    stacks = [f"{w['kind']}.{name}" for w in m["weights"]["rank-0"] for name in w["tensors"]]
    pools = [f"pool.{name}" for name in m["kv"]["pools"]]
    assert sorted(a for a in allocs if not a.startswith(("in:", "out:"))) == sorted(stacks + pools)
    host_inputs = {s["name"] for e in m["regions"] for s in e["inputs"] if s["role"] in ("step", "rank")}
    assert sorted(a for a in allocs if a.startswith("in:")) == sorted(f"in:{n}" for n in host_inputs)
    assert sum(a.startswith("out:") for a in allocs) == sum(
        len(e["output_specs"]) - len(e["aliases"]) for e in m["regions"]
    )

    # every layer's weights and state are slices of the stacks and pools (no copies): a fused layer's
    # weight input <slot>.<name> is the row of its slot's stack the layer binds
    signature = {e["kind"]: e["inputs"] for e in m["regions"]}
    views = {}  # (executable kind, its input) -> the slice bound, per call in a step's order
    order = [("embed", m["embed"], None)] + [(l["fused"], None, l) for l in m["layers"]] + [("head", m["head"], None)]
    for kind, place, layer in order:
        for s in signature[kind]:
            if s["role"] != "weight":
                continue
            if layer is None:
                views.setdefault(kind, []).append(f"{place['kind']}.{s['name']}[{place['index']}]")
            else:
                slot, name = s["name"].split(".", 1)
                b = layer["regions"][slot]
                views.setdefault(kind, []).append(f"{b['kind']}.{name}[{b['index']}]")
    weight_views = [v for kind in views for v in views[kind]]
    state_views = [f"pool.{pool}[{index}]" for layer in m["layers"] for pool, index in layer["state"].values()]
    slices = [field(ln, "name") for ln in lines if ln.startswith("nrt_tensor_allocate_slice")]
    assert Counter(slices) == Counter(weight_views + state_views)

    # calls: the embedding, one per layer (its regions and their collectives in one NEFF) and the head,
    # once per step
    per_step = len(m["layers"]) + 2
    runs = executions(lines)
    assert calls["nrt_execute"] == len(runs) == per_step * steps == sum(stats.calls.values())

    # binding by name: each NEFF tensor (named by the HLO module, listed by libnrt in lexical order) gets
    # the manifest's tensor of that name, and state pools are aliased (the pool slice bound as an input is
    # also the output of the same name, written in place); activations and carries come from the
    # previous call's output buffer, on the device
    entries = {e["kind"]: e for e in m["regions"]}
    pool_state = {name: pool["state"] for name, pool in m["kv"]["pools"].items()}
    bound_state = set()
    for n, (ins, outs, line) in enumerate(runs):
        kind = order[n % per_step][0]
        e = entries[kind]
        weights = iter(views[kind])
        bound_in, bound_out = dict(ins), dict(outs)
        assert [n for n, _ in ins] == [s["name"] for s in sorted(e["inputs"], key=lambda s: s["name"])]
        assert sorted(bound_out) == sorted(f"out_{s['name']}" for s in e["output_specs"])
        for s in e["inputs"]:
            t = bound_in[s["name"]]
            if s["role"] == "weight":
                assert t == next(weights), (kind, s["name"], t)
            elif s["role"] == "state":
                assert pool_state[t[len("pool.") : t.index("[")]] == s["name"], (kind, s["name"], t)
                bound_state.add(t)
            elif s["role"] in ("activation", "carry"):
                assert t in (f"out:{s['name']}", f"in:{s['name']}"), (kind, s["name"], t)
            else:
                assert t == f"in:{s['name']}", (kind, s["name"], t)
        for k, s in enumerate(e["output_specs"]):
            alias = e["aliases"].get(str(k))
            want = bound_in[e["inputs"][alias]["name"]] if alias is not None else f"out:{s['name']}"
            assert bound_out[f"out_{s['name']}"] == want, (kind, s["name"])
        assert int(field(line, "in_place")) == int(field(line, "copies")) == len(e["aliases"])
    assert bound_state == set(state_views)

    # host <-> device per step (item 7): the streams h and pre, the selected indices and the candidate
    # pool stay on the device between region calls, and the embedding is a region: the host writes
    # the token ids and the step's other inputs (each once a step, and only when it changed), never
    # a stream, and reads back the logits alone
    per_name = {s["name"]: nbytes(s) for e in m["regions"] for s in e["inputs"] if s["role"] == "step"}
    assert {s["name"]: s["role"] for s in entries["embed"]["inputs"] if s["role"] != "weight"} == {
        "rank": "rank",
        "tokens": "step",
        "is_image": "step",
        "image_rows": "step",
    }
    logits = nbytes(next(s for s in entries["head"]["output_specs"] if s["name"] == "logits"))
    per_step_io = transfers(lines)
    assert len(per_step_io) == steps
    for io_ in per_step_io:
        assert not {"in:h", "in:pre"} & {n for n, _ in io_["to_device"]}, io_["to_device"]
    for io_ in per_step_io[1:]:  # the first step also writes the weights and pools
        assert io_["to_host"] == [("out:logits", logits)]
        written = [n.removeprefix("in:") for n, _ in io_["to_device"]]
        assert len(written) == len(set(written)) and set(written) <= set(per_name), written
        assert sum(b for _, b in io_["to_device"]) <= sum(per_name.values())
    # the decode step (token 0 after the prompt's 9, at position 3): its id, its position and those of
    # its engram rows that changed go in, at most 148 bytes (the fixture's: 144, its rows' scales are
    # the last step's); the host lookup wrote h [1, 1, 4, 256] float32 instead of the id: 4,236 bytes
    # a step (docs/trn2.md)
    decode = per_step_io[-1]
    engram = {s["name"]: nbytes(s) for s in entries["layer_window_engram"]["inputs"] if s["name"] in ("rows", "rows_s")}
    changing = {"in:tokens": 8, "in:positions": 8, "in:rows": engram["rows"], "in:rows_s": engram["rows_s"]}
    written = dict(decode["to_device"])
    assert {"in:tokens", "in:positions"} <= set(written) and written.items() <= changing.items(), written
    assert sum(written.values()) <= sum(changing.values()) == 148
    assert sum(b for _, b in decode["to_host"]) == logits == vocab * 4
    assert not any(n.startswith("out:") and n != "out:logits" for io_ in per_step_io for n, _ in io_["to_host"])

    # everything released before nrt_close
    assert calls["nrt_allocate_tensor_set"] == calls["nrt_destroy_tensor_set"] == 2 * len(runs)
    assert calls["nrt_tensor_free"] == len(allocs) + len(slices)
    assert not any("MISUSE" in ln for ln in lines)
    assert lines[-1] == "nrt_close live_tensors=0 live_models=0 live_sets=0"
    assert NeuronCore._active is None


def replace_neff(bundle: Path, entry: dict) -> None:
    """Overwrite a region's NEFF with an equivalent stand-in NEFF (same model, new uuid)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("neuronx_cc_stub", DOUBLES / "neuronx_cc_stub.py")
    stub = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stub)
    path = bundle / entry["artifact"]
    header = neff.read_header(path)
    path.write_bytes(stub.neff_bytes(header.name, header.lnc, compressed=False, model=fake_model_of(path)))


def test_replaced_neff_is_refused(finished, nrt, tmp_path):
    bundle = tmp_path / "bundle"
    shutil.copytree(finished, bundle)
    entry = next(e for e in manifest(bundle)["regions"] if e["kind"] == "layer_window")
    replace_neff(bundle, entry)
    with pytest.raises(BundleError, match=r"layer_window\.decode\.b1t1\.neff does not match its digest"):
        load(bundle)  # the digest check comes first
    with pytest.raises(neff.NeffError) as err:
        load(bundle, verify=False)  # without it, the NEFF's uuid still gives it away
    message = str(err.value)
    assert str(bundle / entry["artifact"]) in message and "\n" not in message
    assert f"differs from the manifest's {entry['neff']['uuid']!r}" in message and "replaced after compiling" in message


def test_refused_load_releases_the_core(finished, nrt, tmp_path):
    bundle = tmp_path / "bundle"
    shutil.copytree(finished, bundle)
    replace_neff(bundle, next(e for e in manifest(bundle)["regions"] if e["kind"] == "layer_window"))
    with pytest.raises(neff.NeffError):
        load(bundle, verify=False)
    assert NeuronCore._active is None
    assert nrt.lines()[-1] == "nrt_close live_tensors=0 live_models=0 live_sets=0"


def test_other_num_kv_blocks_is_refused(finished, nrt):
    blocks = manifest(finished)["kv"]["num_blocks"]
    with pytest.raises(
        BundleError,
        match=rf"compiled for exactly {blocks} KV blocks \(static shapes\); "
        rf"cannot run with {blocks + 1}",
    ):
        load(finished, num_kv_blocks=blocks + 1)
    assert nrt.calls() == []  # refused before the runtime is touched
    session = load(finished, num_kv_blocks=blocks)  # the compiled number is accepted
    session.close()
    assert nrt.lines()[-1] == "nrt_close live_tensors=0 live_models=0 live_sets=0"


def test_lnc_setting_must_match_the_bundle(finished, nrt, monkeypatch):
    """The runtime's NEURON_LOGICAL_NC_CONFIG must equal the LNC the NEFFs were compiled for (here 1):
    a different one is refused before the runtime starts, never overridden or ignored."""
    import os

    assert manifest(finished)["topology"]["lnc"] == 1
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    with pytest.raises(BundleError) as err:
        load(finished)
    message = str(err.value)
    assert "\n" not in message and str(finished) in message
    assert "NEURON_LOGICAL_NC_CONFIG=2 but the bundle's NEFFs were compiled for LNC 1" in message
    assert nrt.calls() == [] and os.environ["NEURON_LOGICAL_NC_CONFIG"] == "2"
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")
    load(finished).close()
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG")
    load(finished).close()  # unset: set to the bundle's
    assert os.environ["NEURON_LOGICAL_NC_CONFIG"] == "1"
    assert nrt.lines()[-1] == "nrt_close live_tensors=0 live_models=0 live_sets=0"
