"""Streaming driver over small multi-file checkpoints."""

import os

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from deepinfer.errors import TensorFileError
from deepinfer.quant.blockfp8 import quantize_fp8_blocks
from deepinfer.quant.errors import QuantInputError
from deepinfer.quant.fp4 import quantize_mxfp4
from deepinfer.quant.pack import LAYOUT_I16_PAIRS, LAYOUT_I32_MN_MAJOR, LAYOUT_U8, unpack_i16_pairs, unpack_i32_mn_major
from deepinfer.quant.rescale import convert_format, rescale_fp32, rescale_ue8m0
from deepinfer.quant.stream import StreamRecipe, process_checkpoint

F8, E8 = torch.float8_e4m3fn, torch.float8_e8m0fnu


def _t(a, dtype=None):
    t = torch.from_numpy(np.ascontiguousarray(a))
    return t.view(dtype) if dtype is not None else t


def _fp8(rng, shape, block=32):
    w = (rng.standard_normal(shape) * np.exp2(rng.integers(-10, 3, size=shape))).astype(np.float32)
    return quantize_fp8_blocks(w, block)


@pytest.fixture
def ckpt(tmp_path):
    """Two shards: ue8m0 fp8 weights (one with its scale in the other shard), a V3
    fp32-scaled weight, a per-row scaled engram table, fp4 experts, bf16 and f32."""
    rng = np.random.default_rng(0)
    src = {}
    src["l0.wq.weight"], src["l0.wq.scale"] = _fp8(rng, (200, 300))
    src["l0.wo.weight"], src["l0.wo.scale"] = _fp8(rng, (64, 96))
    src["v3.weight"], v3s = _fp8(rng, (260, 140), 128)
    src["v3.weight_scale_inv"] = np.exp2(rng.uniform(-12, -4, size=(3, 2))).astype(np.float32)
    c, s = quantize_fp8_blocks(rng.standard_normal((50, 64)).astype(np.float32), 32)
    src["engram.embed.weight"] = c
    src["engram.embed.scale"] = np.repeat(s, 32, axis=0)[:50]  # per-row [50, 2]
    src["e.0.w1.weight"], src["e.0.w1.scale"] = quantize_mxfp4(rng.standard_normal((64, 64)).astype(np.float32))
    kinds = {
        "l0.wq.weight": F8,
        "l0.wq.scale": E8,
        "l0.wo.weight": F8,
        "l0.wo.scale": E8,
        "v3.weight": F8,
        "engram.embed.weight": F8,
        "engram.embed.scale": E8,
        "e.0.w1.scale": E8,
    }
    tens = {k: _t(v, kinds.get(k)) for k, v in src.items()}
    tens["e.0.w1.weight"] = tens["e.0.w1.weight"].view(torch.int8)
    tens["norm.weight"] = torch.randn(77).to(torch.bfloat16)
    tens["hc_fn"] = torch.randn(24, 40)
    first = {"l0.wq.weight", "l0.wo.scale", "v3.weight", "v3.weight_scale_inv", "norm.weight"}
    save_file({k: v for k, v in tens.items() if k in first}, str(tmp_path / "a.safetensors"))
    save_file({k: v for k, v in tens.items() if k not in first}, str(tmp_path / "b.safetensors"))
    return tmp_path, src, tens


def _load(out_dir):
    res = {}
    for name in ("a.safetensors", "b.safetensors"):
        with safe_open(str(out_dir / name), "pt") as f:
            for k in f.keys():
                res[k] = f.get_tensor(k)
    return res


def _u8(t):
    return t.contiguous().view(torch.uint8).numpy() if t.element_size() == 1 else t.numpy()


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("fmt,dst", [("e4m3fn", 128), ("e4m3", None), ("e4m3", (1, 128))])
def test_outputs_match_in_memory_functions(ckpt, workers, fmt, dst):
    root, src, tens = ckpt
    rep = process_checkpoint(
        str(root), str(root / "out"), StreamRecipe(dst_block=dst, fp8_format=fmt, chunk_bytes=5000), workers=workers
    )
    out = _load(root / "out")
    assert set(out) == set(tens) - {"v3.weight_scale_inv"} | {"v3.scale"}
    for name in ("l0.wq", "l0.wo"):
        if dst is None:
            want = convert_format(src[f"{name}.weight"], src[f"{name}.scale"], 32, fmt)
        else:
            want = rescale_ue8m0(src[f"{name}.weight"], src[f"{name}.scale"], 32, dst, fmt)
        assert np.array_equal(_u8(out[f"{name}.weight"]), want[0])
        assert np.array_equal(_u8(out[f"{name}.scale"]), want[1])
    want = rescale_fp32(src["v3.weight"], src["v3.weight_scale_inv"], 128, dst or 128, fmt)
    assert np.array_equal(_u8(out["v3.weight"]), want[0]) and np.array_equal(_u8(out["v3.scale"]), want[1])
    want = convert_format(src["engram.embed.weight"], src["engram.embed.scale"], (1, 32), fmt)
    assert np.array_equal(_u8(out["engram.embed.weight"]), want[0])
    for k in ("e.0.w1.weight", "e.0.w1.scale", "norm.weight", "hc_fn"):
        assert torch.equal(out[k].view(torch.uint8), tens[k].contiguous().view(torch.uint8))
    assert rep.tensors["l0.wq.weight"]["fp8_format"] == fmt
    assert out["l0.wq.weight"].dtype == (F8 if fmt == "e4m3fn" else torch.uint8)
    assert not [p for p in os.listdir(root / "out") if ".tmp-" in p]


@pytest.mark.parametrize("layout", [LAYOUT_U8, LAYOUT_I32_MN_MAJOR, LAYOUT_I16_PAIRS])
def test_scale_layouts(ckpt, layout):
    root, src, _ = ckpt
    rep = process_checkpoint(
        str(root), str(root / "out"), StreamRecipe(dst_block=32, scale_layout=layout, chunk_bytes=3000), workers=2
    )
    got = _u8(_load(root / "out")["l0.wq.scale"])
    want = rescale_ue8m0(src["l0.wq.weight"], src["l0.wq.scale"], 32, 32)[1]
    unpack = {
        LAYOUT_U8: lambda g: g,
        LAYOUT_I16_PAIRS: lambda g: unpack_i16_pairs(g, want.shape[1]),
        LAYOUT_I32_MN_MAJOR: lambda g: unpack_i32_mn_major(g, *want.shape),
    }[layout]
    assert np.array_equal(unpack(got), want)
    assert rep.tensors["l0.wq.scale"]["layout"] == layout


def test_row_scale_layout_for_per_row_weights(ckpt):
    root, src, _ = ckpt
    rep = process_checkpoint(
        str(root), str(root / "out"), StreamRecipe(scale_layout=LAYOUT_I32_MN_MAJOR, row_scale_layout=LAYOUT_I16_PAIRS)
    )
    out = _load(root / "out")
    assert rep.tensors["engram.embed.scale"]["layout"] == LAYOUT_I16_PAIRS
    assert rep.tensors["l0.wq.scale"]["layout"] == LAYOUT_I32_MN_MAJOR
    assert np.array_equal(unpack_i16_pairs(out["engram.embed.scale"].numpy(), 2), src["engram.embed.scale"])


def _write(path, tensors):
    save_file(tensors, str(path))
    return path


def test_truncated_file_names_file_and_tensor(tmp_path):
    p = _write(tmp_path / "x.safetensors", {"a": torch.ones(10, 10), "b": torch.ones(100, 10)})
    data = p.read_bytes()
    p.write_bytes(data[:-100])
    with pytest.raises(TensorFileError, match=r"x\.safetensors, tensor 'b': file is truncated"):
        process_checkpoint(str(p), str(tmp_path / "out"))
    p.write_bytes(data[:5])
    with pytest.raises(TensorFileError, match="no header length"):
        process_checkpoint(str(p), str(tmp_path / "out"))


def test_corrupt_header(tmp_path):
    p = tmp_path / "x.safetensors"
    p.write_bytes((20).to_bytes(8, "little") + b"{not json at all!!!!" + b"\0" * 10)
    with pytest.raises(TensorFileError, match="not valid JSON"):
        process_checkpoint(str(p), str(tmp_path / "out"))


def test_unexpected_dtypes_and_missing_scale(tmp_path):
    w = _t(np.zeros((64, 64), np.uint8), F8)
    p = _write(tmp_path / "s.safetensors", {"m.weight": w, "m.scale": torch.zeros(2, 2, dtype=torch.int32)})
    with pytest.raises(TensorFileError, match=r"tensor 'm.scale': unexpected dtype I32.*F8_E8M0 or F32"):
        process_checkpoint(str(p), str(tmp_path / "out"))
    p = _write(tmp_path / "s.safetensors", {"m.weight": w})
    with pytest.raises(TensorFileError, match=r"tensor 'm.weight': fp8 weight has no scale"):
        process_checkpoint(str(p), str(tmp_path / "out"))
    p = _write(tmp_path / "s.safetensors", {"m.weight": w, "m.scale": _t(np.zeros((3, 2), np.uint8), E8)})
    with pytest.raises(TensorFileError, match=r"scale shape \[3, 2\] does not fit"):
        process_checkpoint(str(p), str(tmp_path / "out"))
    raw = bytearray(p.read_bytes())
    raw[raw.index(b"F8_E4M3")] = ord("X")
    p.write_bytes(bytes(raw))
    with pytest.raises(TensorFileError, match=r"unexpected dtype 'X8_E4M3'"):
        process_checkpoint(str(p), str(tmp_path / "out"))


@pytest.mark.parametrize("workers", [1, 2])
def test_nan_weight_error_from_worker_and_cleanup(tmp_path, workers):
    c = np.zeros((64, 64), np.uint8)
    c[50, 7] = 0x7F
    p = _write(tmp_path / "n.safetensors", {"m.weight": _t(c, F8), "m.scale": _t(np.ones((2, 2), np.uint8), E8)})
    with pytest.raises(TensorFileError, match=r"n\.safetensors, tensor 'm.weight': .*NaN"):
        process_checkpoint(
            str(p), str(tmp_path / "out"), StreamRecipe(dst_block=64, chunk_bytes=64 * 32), workers=workers
        )
    assert os.listdir(tmp_path / "out") == []


def test_recipe_validation_and_same_dir(tmp_path):
    with pytest.raises(QuantInputError, match="scale_layout"):
        StreamRecipe(scale_layout="packed")
    with pytest.raises(QuantInputError, match="unknown fp8 format"):
        StreamRecipe(fp8_format="e5m2")
    p = _write(tmp_path / "s.safetensors", {"a": torch.ones(3)})
    with pytest.raises(QuantInputError, match="is the input file"):
        process_checkpoint(str(p), str(tmp_path))


def test_tasks_stay_within_chunk_bytes(ckpt):
    """The memory bound: no task maps more than max(chunk_bytes, one block-row slab)."""
    from deepinfer.quant.stream_plan import plan_checkpoint

    root, _, _ = ckpt
    chunk = 4096
    plan = plan_checkpoint(str(root), str(root / "out"), StreamRecipe(dst_block=128, chunk_bytes=chunk))
    files = {t.dst_path for t in plan.tasks}
    assert len(files) == 2 and plan.tasks[0].dst_path != plan.tasks[1].dst_path  # round-robin
    for t in plan.tasks:
        if t.kind == "copy":
            assert t.hi - t.lo <= chunk
        else:
            slab = np.lcm(t.job.src[0], t.job.dst[0]) * t.job.weight.row_bytes
            assert (t.hi - t.lo) * t.job.weight.row_bytes <= max(chunk, slab)
    covered = {}
    for t in plan.tasks:
        covered.setdefault(t.src.name, []).append((t.lo, t.hi))
    for name, spans in covered.items():  # tasks tile each tensor exactly
        spans.sort()
        end = spans[-1][1]
        assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        t = plan.tasks[[x.src.name for x in plan.tasks].index(name)].src
        assert end == (t.nbytes if any(x.kind == "copy" and x.src.name == name for x in plan.tasks) else t.shape[0])


def test_rescale_writes_into_given_output():
    rng = np.random.default_rng(3)
    codes, scales = _fp8(rng, (96, 200))
    out = np.zeros_like(codes)
    got, s = rescale_ue8m0(codes, scales, 32, 64, out=out, chunk_bytes=1000)
    assert got is out and np.array_equal(out, rescale_ue8m0(codes, scales, 32, 64)[0])
    with pytest.raises(QuantInputError, match="writable uint8"):
        rescale_ue8m0(codes, scales, 32, 64, out=np.zeros((2, 2), np.uint8))


def _end_the_worker(task):
    if task == 1:
        os._exit(3)  # as a worker killed by a stopped compile ends: no result, no cleanup
    return task


def test_a_dead_worker_breaks_the_pool_and_is_not_replaced():
    """A stopped compile kills the stream workers it finds and exits: a pool that forked a replacement
    in between would leave it running on alone (CI saw one print a BrokenPipeError traceback after its
    compile had ended). `unordered` fails instead, and leaves no worker behind."""
    import multiprocessing
    import threading
    from concurrent.futures.process import BrokenProcessPool

    from deepinfer.quant.stream import unordered

    raised: list[BaseException] = []

    def run():  # a pool that replaces the worker waits for the lost result forever
        try:
            list(unordered(_end_the_worker, range(8), workers=2, start_method="fork"))
        except BaseException as e:
            raised.append(e)

    before = set(multiprocessing.active_children())  # other tests' children in this process stay out
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive(), "the pool waited on after its worker died"
    assert len(raised) == 1 and isinstance(raised[0], BrokenProcessPool), raised
    assert set(multiprocessing.active_children()) - before == set()
