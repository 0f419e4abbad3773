"""Contract tests of the Neuron runtime backend against a TEST DOUBLE of libnrt.

tests/trn2/doubles/fake_nrt.c implements the libnrt functions the binding
calls, with libnrt's signatures, over malloc'd host memory; its "models" are
small text files that declare tensor names, byte sizes and output<-input
copies, not NEFFs (bare, or inside a NEFF-shaped file from the stand-in
neuronx-cc). These tests check that runtime/neuron/libnrt.py and runtime/neuron/device.py
speak the C interface (prototypes, struct layouts, call order, status
handling, by-name binding); they prove nothing about Trn2 execution or numerics.
"""

from __future__ import annotations

import ctypes
import importlib.util
from pathlib import Path

import pytest
import torch

from deepinfer.errors import DeepinferError
from deepinfer.runtime.neuron import libnrt
from deepinfer.runtime.neuron.device import (
    DeviceTensor,
    DeviceValue,
    NeuronArgumentError,
    NeuronCore,
    NeuronExecutable,
    NeuronModel,
)
from deepinfer.runtime.neuron.libnrt import NeuronNumericalError, NeuronRuntimeError, NeuronRuntimeMissing

from .conftest import fake_model, fnv1a


def test_struct_layouts_match_the_headers():
    # nrt_tensor_info_t on LP64: char[256], enum, (pad), size_t, enum, (pad), uint32_t*, uint32_t, (pad)
    info = libnrt.NrtTensorInfo
    assert [getattr(info, f).offset for f in ("name", "usage", "size", "dtype", "shape", "ndim")] == [
        0,
        256,
        264,
        272,
        280,
        288,
    ]
    assert ctypes.sizeof(info) == 296
    assert libnrt.NrtTensorInfoArray.tensor_array.offset == 8
    assert ctypes.sizeof(libnrt.NrtVersion) == 4 * 8 + 128 + 64


def test_init_close_order_and_version(fake_nrt, tmp_path):
    core = NeuronCore(core=3)
    assert core.version == "2.99.0.0 (fake_nrt test double)"
    first = fake_nrt.lines()[0]
    assert first.startswith("nrt_init framework=1 fw_version='' fal_version='' visible_cores=3")
    with pytest.raises(NeuronArgumentError, match="already initialized"):
        NeuronCore()
    stack = DeviceTensor.allocate(core, 64, "stack")
    stack.slice(16, 16, "layer1")
    NeuronModel.load(core, fake_model(tmp_path / "m.fake", {"a": 4}, {"b": 4}, {"b": "a"}))
    fake_nrt.clear()
    core.close()
    assert fake_nrt.calls() == ["nrt_unload", "nrt_tensor_free", "nrt_tensor_free", "nrt_close"]
    frees = [line for line in fake_nrt.lines() if line.startswith("nrt_tensor_free")]
    assert frees == ["nrt_tensor_free name=layer1", "nrt_tensor_free name=stack"]  # slice first
    assert fake_nrt.lines()[-1] == "nrt_close live_tensors=0 live_models=0 live_sets=0"
    with pytest.raises(NeuronArgumentError, match="closed"):
        DeviceTensor.allocate(core, 8, "late")
    with NeuronCore() as again:  # nrt_init again after nrt_close
        assert again.vnc == 0


def test_visible_core_conflict_is_refused(fake_nrt, monkeypatch):
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "0-3")
    with pytest.raises(NeuronArgumentError, match="NEURON_RT_VISIBLE_CORES=0-3 but NeuronCore 2"):
        NeuronCore(core=2)
    assert fake_nrt.calls() == []


def test_load_reports_tensor_info_in_library_order(fake_nrt, tmp_path):
    path = fake_model(tmp_path / "m.fake", {"tokens": 16, "kv": 256}, {"logits": 40, "kv_out": 256}, {"kv_out": "kv"})
    with NeuronCore() as core:
        model = NeuronModel.load(core, path)
        assert [(i.name, i.size) for i in model.inputs] == [("tokens", 16), ("kv", 256)]
        assert [(i.name, i.size) for i in model.outputs] == [("logits", 40), ("kv_out", 256)]
        assert model.inputs[1].shape == (256,) and model.inputs[1].dtype == 0x3  # what the double reports
        load = [line for line in fake_nrt.lines() if line.startswith("nrt_load")][0]
        assert "vnc=0 vnc_count=-1" in load
        assert fake_nrt.calls()[-2:] == ["nrt_get_model_tensor_info", "nrt_free_model_tensor_info"]
        bad = tmp_path / "bad.neff"
        bad.write_bytes(b"\x00NEFF?")
        with pytest.raises(NeuronRuntimeError, match=r"nrt_load failed with NRT status 2 \(NRT_INVALID\)"):
            NeuronModel.load(core, bad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.uint8, torch.int64])
def test_write_read_round_trip(fake_nrt, dtype):
    g = torch.Generator().manual_seed(0)
    if dtype == torch.uint8:
        host = torch.arange(256, dtype=torch.uint8)[torch.randperm(256, generator=g)][:26].reshape(2, 13)
    elif dtype == torch.int64:
        host = torch.randint(-(2**62), 2**62, (2, 13), generator=g, dtype=torch.int64)
        host[0, 0], host[1, 12] = torch.iinfo(torch.int64).min, torch.iinfo(torch.int64).max
    else:
        host = torch.randn(2, 13, generator=g).to(dtype)
    with NeuronCore() as core:
        t = DeviceTensor.from_torch(core, host, "x")
        assert t.nbytes == host.numel() * host.element_size()
        assert core.lib.size(t.handle) == t.nbytes  # nrt_tensor_get_size
        back = t.to_torch(dtype, (2, 13))
        assert torch.equal(back.view(torch.uint8), host.view(torch.uint8))  # byte-exact
        with pytest.raises(NeuronArgumentError, match="'x'"):
            t.to_torch(dtype, (2, 12))
        with pytest.raises(NeuronArgumentError, match="contiguous CPU tensor"):
            t.write_from(torch.zeros(13, 2, dtype=dtype).t())


def test_slices_are_views_into_the_parent(fake_nrt):
    L, rows, cols = 4, 3, 5  # a layer-major stack [L, 3, 5] bf16
    per = rows * cols * 2
    with NeuronCore() as core:
        stack = DeviceTensor.from_torch(core, torch.zeros(L, rows, cols, dtype=torch.bfloat16), "wq")
        layer2 = stack.slice(2 * per, per, "wq[2]")
        data = torch.arange(rows * cols, dtype=torch.bfloat16).reshape(rows, cols)
        layer2.write_from(data)
        whole = stack.to_torch(torch.bfloat16, (L, rows, cols))
        assert torch.equal(whole[2], data) and not whole[[0, 1, 3]].any()
        stack.write_from(torch.ones(L, rows, cols, dtype=torch.bfloat16))  # and back through the view
        assert torch.equal(layer2.to_torch(torch.bfloat16, (rows, cols)), torch.ones(rows, cols, dtype=torch.bfloat16))
        with pytest.raises(NeuronArgumentError, match="outside tensor 'wq'"):
            stack.slice(3 * per, per + 2, "wq[3]+")
        with pytest.raises(NeuronRuntimeError, match=r"nrt_tensor_allocate_slice failed .*NRT_INVALID"):
            core.lib.allocate_slice(stack.handle, 3 * per, per + 2, "raw")  # the double checks bounds too
        with pytest.raises(NeuronArgumentError, match=r"live slices \['wq\[2\]'\]"):
            stack.free()
        layer2.free()
        stack.free()


def test_execute_copies_as_declared(fake_nrt, tmp_path):
    path = fake_model(tmp_path / "m.fake", {"a": 8, "b": 16}, {"y": 16, "z": 8}, {"y": "b", "z": "a"})
    with NeuronCore() as core:
        model = NeuronModel.load(core, path)
        a = DeviceTensor.from_torch(core, torch.tensor([1, -2], dtype=torch.int32), "a")
        b = DeviceTensor.from_torch(core, torch.tensor([5, 6], dtype=torch.int64), "b")
        y, z = DeviceTensor.allocate(core, 16, "y"), DeviceTensor.allocate(core, 8, "z")
        fake_nrt.clear()
        model.execute([a, b], [y, z])
        assert torch.equal(y.to_torch(torch.int64, (2,)), torch.tensor([5, 6]))
        assert torch.equal(z.to_torch(torch.int32, (2,)), torch.tensor([1, -2], dtype=torch.int32))
        adds = [line.split()[1] for line in fake_nrt.lines() if line.startswith("nrt_add_tensor_to_tensor_set")]
        assert adds == ["name=a", "name=b", "name=y", "name=z"]
        assert fake_nrt.calls().count("nrt_destroy_tensor_set") == 2


def test_size_mismatch_names_the_tensor(fake_nrt, tmp_path):
    path = fake_model(tmp_path / "m.fake", {"a": 8, "b": 16}, {"y": 16}, {"y": "b"})
    with NeuronCore() as core:
        model = NeuronModel.load(core, path)
        a, b, y = (DeviceTensor.allocate(core, n, name) for n, name in ((8, "a"), (12, "b"), (16, "y")))
        with pytest.raises(
            NeuronArgumentError,
            match=r"input 'b' is bound to DeviceTensor\('b', 12 bytes\), "
            r"the model expects 16 bytes",
        ):
            model.execute([a, b], [y])
        with pytest.raises(NeuronArgumentError, match=r"1 inputs given, the model takes 2: \['a', 'b'\]"):
            model.execute([a], [y])
        assert "nrt_execute" not in fake_nrt.calls()


def test_failing_status_names_the_function(fake_nrt, tmp_path, monkeypatch):
    path = fake_model(tmp_path / "m.fake", {"a": 8}, {"y": 8}, {"y": "a"})
    with NeuronCore() as core:
        model = NeuronModel.load(core, path)
        a, y = DeviceTensor.allocate(core, 8, "a"), DeviceTensor.allocate(core, 8, "y")
        monkeypatch.setenv("FAKE_NRT_FAIL", "nrt_execute=1004")
        with pytest.raises(
            NeuronRuntimeError,
            match=r"nrt_execute failed with NRT status 1004 "
            r"\(NRT_EXEC_COMPLETED_WITH_ERR\)",
        ) as e:
            model.execute([a], [y])
        assert (e.value.function, e.value.status) == ("nrt_execute", 1004)
        assert fake_nrt.calls()[-2:] == ["nrt_destroy_tensor_set", "nrt_destroy_tensor_set"]  # sets still freed
        monkeypatch.setenv("FAKE_NRT_FAIL", "nrt_tensor_write=77")
        with pytest.raises(
            NeuronRuntimeError,
            match=r"nrt_tensor_write failed with NRT status 77 "
            r"\(unknown status\): tensor 'a'",
        ):
            a.write_from(torch.zeros(2, dtype=torch.float32))
    monkeypatch.setenv("FAKE_NRT_FAIL", "nrt_init=9")
    with pytest.raises(NeuronRuntimeError, match=r"nrt_init failed .*NRT_LOAD_NOT_ENOUGH_NC"):
        NeuronCore()
    assert NeuronCore._active is None


def test_missing_library_is_one_clear_line(monkeypatch, tmp_path, empty_library):
    missing = tmp_path / "no" / "libnrt.so.1"
    monkeypatch.setenv("DEEPINFER_LIBNRT", str(missing))
    with pytest.raises(NeuronRuntimeMissing) as e:
        NeuronCore()
    message = str(e.value)
    assert isinstance(e.value, DeepinferError) and "\n" not in message
    assert str(missing) in message and "aws-neuronx-runtime-lib" in message and "DEEPINFER_LIBNRT" in message
    monkeypatch.setenv("DEEPINFER_LIBNRT", str(empty_library))
    with pytest.raises(NeuronRuntimeMissing, match="does not export nrt_init"):
        libnrt.open_library()


def test_executable_adapter_resident_host_and_aliased_state(fake_nrt, tmp_path):
    # libnrt's order differs from the call order on purpose: binding is by name
    path = fake_model(
        tmp_path / "m.fake",
        {"x": 16, "state": 16, "w": 24},
        {"out_new_state": 16, "out_y": 24},
        {"out_y": "w", "out_new_state": "x"},
    )
    signature = [{"name": "w", "role": "weight"}, {"name": "x", "role": "input"}, {"name": "state", "role": "state"}]
    out_specs = [("y", (2, 3), torch.float32), ("new_state", (4,), torch.float32)]
    with NeuronCore() as core:
        exe = NeuronExecutable(path, core, signature, out_specs, aliases={"1": 2})
        w = torch.arange(6, dtype=torch.float32).reshape(2, 3)
        weights = DeviceTensor.from_torch(core, w, "w")
        state = DeviceTensor.from_torch(core, torch.zeros(4), "state")
        for step in range(2):
            x = torch.full((4,), float(step + 1))
            y, new_state = exe([weights, x, state])
            assert torch.equal(y, w)  # resident weights reached the model
            assert new_state is state  # aliased: bound in place, not read back
            assert torch.equal(state.to_torch(torch.float32, (4,)), x)
        allocs = [line for line in fake_nrt.lines() if line.startswith("nrt_tensor_allocate ")]
        assert sum("name=in:x" in line for line in allocs) == 1  # one staging buffer, reused
        assert not any("name=in:w" in line or "name=in:state" in line for line in allocs)
        with pytest.raises(NeuronArgumentError, match="aliases input 'state', which must be a resident"):
            exe([weights, x, torch.zeros(4)])
        with pytest.raises(NeuronArgumentError, match=r"output 'y' declared \(2, 2\)"):
            NeuronExecutable(path, core, signature, [("y", (2, 2), torch.float32), out_specs[1]], {1: 2})
        with pytest.raises(NeuronArgumentError, match=r"unknown \['v'\], unbound \['w'\]"):
            NeuronExecutable(path, core, ["v", "x", "state"], out_specs, {1: 2})
        exe.close()
        weights.free()
        state.free()
        fake_nrt.clear()
    assert fake_nrt.calls() == ["nrt_close"]  # failed constructions and close() released everything
    assert fake_nrt.lines()[-1] == "nrt_close live_tensors=0 live_models=0 live_sets=0"


def test_executable_binds_by_name_whatever_libnrt_lists(fake_nrt, tmp_path):
    """12 inputs, listed by libnrt in lexical order (input0, input1, input10, input11, input2, ...):
    each is bound by its name to the tensor of that name, so the data reach the right inputs."""
    names = [f"input{k}" for k in range(12)]
    path = fake_model(
        tmp_path / "m.fake",
        {n: 8 for n in sorted(names)},
        {f"out_y{k}": 8 for k in (2, 10)},
        {"out_y2": "input2", "out_y10": "input10"},
    )
    with NeuronCore() as core:
        exe = NeuronExecutable(path, core, names, [("y2", (2,), torch.float32), ("y10", (2,), torch.float32)])
        assert [i.name for i in exe.model.inputs][:4] == ["input0", "input1", "input10", "input11"]
        y2, y10 = exe([torch.full((2,), float(k)) for k in range(12)])
        assert y2.tolist() == [2.0, 2.0] and y10.tolist() == [10.0, 10.0]
        adds = [line.split()[1:3] for line in fake_nrt.lines() if line.startswith("nrt_add_tensor_to_tensor_set")]
        assert ["name=input10", "tensor=in:input10"] in adds and ["name=input2", "tensor=in:input2"] in adds
        exe.close()
        # a NEFF whose tensors do not carry our names is refused, never bound by position or order
        bad = fake_model(tmp_path / "bad.fake", {"input0": 24, "input1": 16}, {"output0": 16}, {})
        with pytest.raises(
            NeuronArgumentError,
            match=r"input names \['w', 'x'\] do not match .* must carry the "
            r"manifest's names",
        ):
            NeuronExecutable(bad, core, ["w", "x"], [("y", (4,), torch.float32)])
    assert fake_nrt.lines()[-1] == "nrt_close live_tensors=0 live_models=0 live_sets=0"


def test_outputs_stay_on_the_device_between_calls(fake_nrt, tmp_path):
    """Outputs not named as host outputs come back as DeviceValues: passed to the next call they are
    bound as they are (no read, no write); a value its producer has overwritten, or an executable's
    own output fed back to it, is refused."""
    a = fake_model(tmp_path / "a.fake", {"x": 8}, {"out_h": 8}, {"out_h": "x"})
    b = fake_model(tmp_path / "b.fake", {"h": 8}, {"out_logits": 8}, {"out_logits": "h"})
    with NeuronCore() as core:
        first = NeuronExecutable(a, core, ["x"], [("h", (2,), torch.float32)], host_outputs=())
        head = NeuronExecutable(b, core, ["h"], [("logits", (2,), torch.float32)], host_outputs=("logits",))
        fake_nrt.clear()
        (h,) = first([torch.tensor([1.0, 2.0])])
        assert isinstance(h, DeviceValue) and h.shape == (2,)
        (logits,) = head([h])
        assert logits.tolist() == [1.0, 2.0]
        reads = [line for line in fake_nrt.lines() if line.startswith("nrt_tensor_read")]
        writes = [line for line in fake_nrt.lines() if line.startswith("nrt_tensor_write")]
        assert [field_of(r, "name") for r in reads] == ["out:logits"] and [field_of(w, "name") for w in writes] == [
            "in:x"
        ]
        first([torch.tensor([1.0, 2.0])])  # equal host input: not written again
        assert sum(line.startswith("nrt_tensor_write") for line in fake_nrt.lines()) == 1
        with pytest.raises(NeuronArgumentError, match="was overwritten by a later call"):
            head([h])
        (h2,) = first([torch.tensor([3.0, 4.0])])
        with pytest.raises(NeuronArgumentError, match="this executable's own output buffer"):
            first([h2])
        assert h2.to_torch().tolist() == [3.0, 4.0]
        first.close()
        head.close()
    assert fake_nrt.lines()[-1] == "nrt_close live_tensors=0 live_models=0 live_sets=0"


def field_of(line: str, key: str) -> str:
    return next(part.split("=", 1)[1] for part in line.split() if part.startswith(f"{key}="))


# every NRT_STATUS of nrt_status.h (aws-neuron-sdk src/libnrt/include/nrt/nrt_status.h), typed here from the header
NRT_STATUS_H = {
    "NRT_SUCCESS": 0,
    "NRT_FAILURE": 1,
    "NRT_INVALID": 2,
    "NRT_INVALID_HANDLE": 3,
    "NRT_RESOURCE": 4,
    "NRT_TIMEOUT": 5,
    "NRT_HW_ERROR": 6,
    "NRT_QUEUE_FULL": 7,
    "NRT_LOAD_NOT_ENOUGH_NC": 9,
    "NRT_UNSUPPORTED_NEFF_VERSION": 10,
    "NRT_FAIL_HOST_MEM_ALLOC": 11,
    "NRT_UNINITIALIZED": 13,
    "NRT_CLOSED": 14,
    "NRT_QUEUE_EMPTY": 15,
    "NRT_EXEC_UNIT_DISABLED": 101,
    "NRT_EXEC_BAD_INPUT": 1002,
    "NRT_EXEC_COMPLETED_WITH_NUM_ERR": 1003,
    "NRT_EXEC_COMPLETED_WITH_ERR": 1004,
    "NRT_EXEC_NC_BUSY": 1005,
    "NRT_EXEC_OOB": 1006,
    "NRT_COLL_PENDING": 1100,
    "NRT_EXEC_HW_ERR_COLLECTIVES": 1200,
    "NRT_EXEC_HW_ERR_HBM_UE": 1201,
    "NRT_EXEC_HW_ERR_NC_UE": 1202,
    "NRT_EXEC_HW_ERR_DMA_ABORT": 1203,
    "NRT_EXEC_SW_NQ_OVERFLOW": 1204,
    "NRT_EXEC_HW_ERR_REPAIRABLE_HBM_UE": 1205,
    "NRT_NETWORK_PROXY_FAILURE": 1206,
}


def test_every_status_is_named():
    assert libnrt.STATUS_NAMES == {v: k for k, v in NRT_STATUS_H.items()}


def test_statuses_of_execute_and_load(fake_nrt, tmp_path, monkeypatch):
    """A status reads as its name and the runtime's own words (nrt_get_status_as_str); "completed with
    NaN" is an error of its own kind, never a result; a NEFF version the runtime refuses names the
    runtime's version (deepinfer keeps no version table of its own)."""
    path = fake_model(tmp_path / "m.fake", {"x": 8}, {"out_y": 8}, {"out_y": "x"})
    with NeuronCore() as core:
        exe = NeuronExecutable(path, core, ["x"], [("y", (2,), torch.float32)])
        monkeypatch.setenv("FAKE_NRT_FAIL", "nrt_execute=1003")
        with pytest.raises(NeuronNumericalError) as err:
            exe([torch.zeros(2)])
        assert (
            "NRT status 1003 (NRT_EXEC_COMPLETED_WITH_NUM_ERR, fake_nrt: execution completed with numerical "
            "errors (NaN))"
            in str(err.value)
            and str(path) in str(err.value)
        )
        monkeypatch.setenv("FAKE_NRT_FAIL", "nrt_execute=1206")
        with pytest.raises(NeuronRuntimeError, match=r"NRT status 1206 \(NRT_NETWORK_PROXY_FAILURE\)") as err:
            exe([torch.zeros(2)])
        assert not isinstance(err.value, NeuronNumericalError)
        monkeypatch.setenv("FAKE_NRT_FAIL", "nrt_load=10")
        with pytest.raises(NeuronRuntimeError) as err:
            NeuronModel.load(core, path)
        message = str(err.value)
        assert "\n" not in message and str(path) in message and "NRT_UNSUPPORTED_NEFF_VERSION" in message
        assert "libnrt 2.99.0.0 (fake_nrt test double) does not load this NEFF's format" in message
        monkeypatch.delenv("FAKE_NRT_FAIL")
        exe.close()


def test_load_finds_the_model_inside_a_neff_shaped_blob(fake_nrt, tmp_path):
    spec = importlib.util.spec_from_file_location(
        "neuronx_cc_stub", Path(__file__).resolve().parent / "doubles" / "neuronx_cc_stub.py"
    )
    stub = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stub)
    text = "FAKE_NRT_MODEL 1\ninput input0 8\noutput output0 8\ncopy output0 input0\nend\n"
    (tmp_path / "m.neff").write_bytes(stub.neff_bytes("m", lnc=1, compressed=True, model=text))
    (tmp_path / "gz.neff").write_bytes(stub.neff_bytes("gz", lnc=1, compressed=True))  # no model, gzip'd
    (tmp_path / "open.neff").write_bytes(
        stub.neff_bytes("open", lnc=1, compressed=False, model=text.replace("end\n", ""))
    )  # no end line
    with NeuronCore() as core:
        model = NeuronModel.load(core, tmp_path / "m.neff")
        assert [(i.name, i.size) for i in model.inputs + model.outputs] == [("input0", 8), ("output0", 8)]
        assert [line for line in fake_nrt.lines() if line.startswith("nrt_load")][0].endswith("source=neff -> 0")
        with pytest.raises(NeuronRuntimeError, match="NRT_INVALID"):
            NeuronModel.load(core, tmp_path / "gz.neff")
        assert "NEFF without a fake model" in fake_nrt.lines()[-1]
        with pytest.raises(NeuronRuntimeError, match="NRT_INVALID"):
            NeuronModel.load(core, tmp_path / "open.neff")
        assert "not a fake model" in fake_nrt.lines()[-1]


def test_outputs_without_a_copy_are_zero_filled(fake_nrt, tmp_path):
    path = fake_model(tmp_path / "m.fake", {"a": 8}, {"y": 8, "z": 8}, {"y": "a"})
    with NeuronCore() as core:
        model = NeuronModel.load(core, path)
        a = DeviceTensor.from_torch(core, torch.tensor([3, 4], dtype=torch.int32), "a")
        y = DeviceTensor.from_torch(core, torch.tensor([9, 9], dtype=torch.int32), "y")
        z = DeviceTensor.from_torch(core, torch.tensor([9, 9], dtype=torch.int32), "z")
        model.execute([a], [y, z])
        assert y.to_torch(torch.int32, (2,)).tolist() == [3, 4] and z.to_torch(torch.int32, (2,)).tolist() == [0, 0]


def test_a_neff_with_collectives_is_loaded_for_its_rank(fake_nrt, tmp_path, monkeypatch):
    """A NEFF that holds collectives is loaded with nrt_load_collectives as (rank, world), after the
    process's communicator is built once (nrt_build_global_comm, nrt.h's signature), with the
    rendezvous variable set; without it the load is refused before libnrt is asked, in one line.
    Executions of that model are collective calls too; a plain model's are not."""
    from deepinfer.runtime.neuron.libnrt import ENV_ROOT_COMM, NeuronCollectivesError

    model = fake_model(tmp_path / "m.fake", {"x": 8}, {"y": 8}, {"y": "x"})
    with NeuronCore() as core:
        monkeypatch.delenv(ENV_ROOT_COMM, raising=False)
        with pytest.raises(NeuronCollectivesError, match=f"{ENV_ROOT_COMM} is not set"):
            NeuronModel.load(core, model, collectives=(1, 2))
        assert not [c for c in fake_nrt.calls() if c.startswith(("nrt_load", "nrt_build_global_comm"))]
        monkeypatch.setenv(ENV_ROOT_COMM, "10.0.0.1:62182")
        with pytest.raises(NeuronCollectivesError, match="rank 2 is not one of the world's 2 ranks"):
            NeuronModel.load(core, model, collectives=(2, 2))
        loaded = NeuronModel.load(core, model, collectives=(1, 2))
        again = NeuronModel.load(core, model, collectives=(1, 2))  # the communicator is built once
        plain = NeuronModel.load(core, model)
        with pytest.raises(NeuronCollectivesError, match="already joined the collectives as rank 1 of 2"):
            NeuronModel.load(core, model, collectives=(0, 2))
        assert [i.name for i in loaded.inputs] == ["x"] and [o.name for o in loaded.outputs] == ["y"]
        x = DeviceTensor.from_torch(core, torch.tensor([1, 2], dtype=torch.int32), "x")
        y = DeviceTensor.allocate(core, 8, "y")
        loaded.execute([x], [y])
        plain.execute([x], [y])
        ident = fnv1a(model.read_bytes())
        root = "root=10.0.0.1:62182"
        collective = [ln for ln in fake_nrt.lines() if "rank=" in ln]
        assert collective == [
            f"nrt_build_global_comm vnc=0 rank=1 world=2 {root} call=1 -> 0",
            f"nrt_load_collectives rank=1 world=2 {root} model={ident} call=2 -> 0",
            f"nrt_load_collectives rank=1 world=2 {root} model={ident} call=3 -> 0",
            f"nrt_execute tensors=2 copies=1 in_place=0 to_device=8 to_host=0 rank=1 world=2 {root} model={ident} call=4 -> 0",
        ], collective
        loads = [ln.split()[0] for ln in fake_nrt.lines() if ln.startswith("nrt_load")]
        assert loads == ["nrt_load", "nrt_load_collectives", "nrt_load", "nrt_load_collectives", "nrt_load"]
        executes = [ln for ln in fake_nrt.lines() if ln.startswith("nrt_execute")]
        assert executes[-1] == "nrt_execute tensors=2 copies=1 in_place=0 to_device=8 to_host=0 -> 0"
        for m in (plain, again, loaded):
            m.unload()
