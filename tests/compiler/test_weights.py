"""The streaming weight pass: the same bytes as whole-tensor stacking, each checkpoint byte read
once for every rank, replicated stacks stored once, bad checkpoints refused before any output."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save

import deepinfer.compiler.stream as stream_mod
from deepinfer.bundles import layout
from deepinfer.bundles import manifest as mf
from deepinfer.compiler import pipeline
from deepinfer.compiler.cache.local import Cache
from deepinfer.compiler.config import load_compile_config
from deepinfer.compiler.plan import plan_regions
from deepinfer.compiler.shard import shard
from deepinfer.compiler.stream import stream
from deepinfer.compiler.weights import host_files, in_format, stack_files
from deepinfer.errors import CheckpointError
from deepinfer.quant.formats import FP8_E4M3
from deepinfer.quant.rescale import convert_format
from deepinfer.regions.checkpoint import Checkpoint
from deepinfer.regions.config import draft_moe_config, load_config
from deepinfer.regions.topology import expert_slice_width

from ..conftest import write_model_toml

QUIET = lambda msg: None  # noqa: E731


def planned(tmp_path, ckpt, parallel=(1, 1, 1), extra=""):
    spec = pipeline.parse(
        load_compile_config(
            write_model_toml(
                tmp_path / "toml", ckpt, executable="exported", parallel=parallel, extra=extra, num_blocks=5
            )
        ),
        False,
        QUIET,
    )
    return spec, pipeline.plan(spec, QUIET)


def whole_stacks(ckpt: Checkpoint, spec, plan, kind: str, rank: int) -> dict[str, torch.Tensor]:
    """A kind's stacks on `rank` the way a whole-tensor pass builds them: load each full source
    tensor (rescaled whole, to the recipe's format, where the checkpoint has float32 scales),
    convert a layer's fp8 weights to the recipe's format in memory, cut the rank's part (compiler/shard.py), stack
    the layers."""
    kp = plan.kinds[kind]
    layers = []
    for layer in kp.layers:
        prefix = kp.prefix(layer)  # layers.N., mtp.N. (the draft's stages), none for the head
        full = {}
        for s in kp.full_specs:
            full[s.name] = ckpt.load_spec(prefix, s, spec.recipe.fp8_format)
        layers.append(in_format(kp.full_specs, full, spec.recipe.fp8_format))
    out = {}
    for s in kp.region.specs:
        rows = []
        for tensors in layers:
            t = tensors[s.name]
            rows.append(shard(kind, s.name, t, spec.model.text, spec.topology, rank, s.buffer_shape))
        out[s.name] = torch.stack(rows)
    return out


def test_one_rank_files_are_save_file_bytes(tiny_ckpt, tmp_path):
    """With one rank every stack goes to the rank's file, byte for byte what safetensors writes for the
    stacks built whole (the pass before streaming wrote exactly that)."""
    spec, plan = planned(tmp_path, tiny_ckpt)
    ckpt = Checkpoint(tiny_ckpt)
    files, entries = stack_files(spec, plan, ckpt, tmp_path / "b")
    files += host_files(spec.model, ckpt, tmp_path / "b", spec.recipe, device_embedding=spec.device_embedding)
    report = stream(files, workers=2, chunk_bytes=4096)  # many chunks per tensor
    [stacks] = entries.values()
    for w in stacks:
        assert w.shared is None and w.path == layout.weights_path(0, w.kind)
        want = save(whole_stacks(ckpt, spec, plan, w.kind, 0))
        assert (tmp_path / "b" / w.path).read_bytes() == want, w.kind
    embed = ckpt.get("embed.weight")
    assert (tmp_path / "b" / "host/embed.safetensors").read_bytes() == save({"embed": embed.contiguous()})
    # the engram tables: host-resident, no rank's stack holds them; the checkpoint's bytes as uint8
    assert not [n for w in stacks for n in w.tensors if "table" in n]
    tables = {
        n: ckpt.get(n).view(torch.uint8)
        for codes, scales, _ in spec.model.text.engram_tables()
        for n in (codes, scales)
    }
    assert (tmp_path / "b" / "host/engram.safetensors").read_bytes() == save(tables)
    sources = {p.src.name: p.src.nbytes for f in files for t in f.tensors for p in t.pieces}
    assert report["bytes_read"] == sum(sources.values())  # every source byte once


DRAFT = '\n[speculative]\ndraft = "dspark"\n'


@pytest.mark.parametrize("parallel", [(1, 2, 2), (2, 1, 1), (1, 4, 4)], ids=["ep=cp=2", "tp=2", "ep=cp=4"])
def test_draft_stacks_are_cut_per_rank_and_shared_where_whole(tiny_ckpt, tmp_path, parallel):
    """The draft's stacks (`mtp.N.` rows) through the weight pass as the target's: its MoE's routed
    experts in each rank's file (its own 4 experts over ep), its attention's heads there over the token group, the
    Markov head's vocabulary rows over the token group, everything every rank holds whole (context
    projection, the other heads' weights, router, norms) in one shared file;
    the bytes each rank's manifest entries point at are the cut of the whole tensors (`shard`)."""
    spec, plan = planned(tmp_path, tiny_ckpt, parallel, extra=DRAFT)
    ckpt = Checkpoint(tiny_ckpt)
    files, entries = stack_files(spec, plan, ckpt, tmp_path / "b")
    report = stream(files, workers=1, chunk_bytes=1 << 12)
    sources = {(p.src.path, p.src.name): p.src.nbytes for f in files for t in f.tensors for p in t.pieces}
    assert report["bytes_read"] == sum(sources.values())
    assert any(name.startswith("mtp.") for _, name in sources)
    tp, ep = parallel[0], parallel[1]
    for rank in range(spec.topology.world):
        stacks = {w.kind: w for w in entries[layout.rank_key(rank)] if w.kind in plan.draft_kinds}
        assert list(stacks) == plan.draft_kinds
        for kind, w in stacks.items():
            own = _read(tmp_path / "b" / w.path) if w.path else {}
            common = _read(tmp_path / "b" / w.shared) if w.shared else {}
            want = whole_stacks(ckpt, spec, plan, kind, rank)
            assert own.keys() | common.keys() == want.keys() and not own.keys() & common.keys(), kind
            for name, t in want.items():
                got = common[name] if w.tensors[name].file == "shared" else own[name]
                assert tuple(got.shape) == w.tensors[name].shape == (len(plan.kinds[kind].layers), *t.shape[1:])
                assert torch.equal(got.view(torch.uint8), t.contiguous().view(torch.uint8)), (rank, kind, name)
        assert stacks["dspark_context"].path is None  # whole: shared only
        head = stacks["dspark_head"].tensors  # the Markov head's rows: the vocabulary over the token group
        assert head["markov_head"].file == "rank" and head["markov_embed"].file == head["norm"].file == "shared"
        moe, attn = stacks["dspark_moe"].tensors, stacks["dspark_attn"].tensors
        assert (moe["w1"].file == "rank") == (ep > 1) and moe["gate"].file == "shared"
        draft = draft_moe_config(spec.model.text)  # every expert, each rank its intermediate slice
        assert moe["w1"].shape[1:3] == (draft.n_routed_experts, expert_slice_width(draft, spec.topology))
        assert (attn["wq_b"].file == "rank") == (tp * parallel[2] > 1) and attn["attn_norm"].file == "shared"


@pytest.fixture(scope="module")
def float_scaled_ckpt(tmp_path_factory) -> Path:
    """The tiny model with DeepSeek-V3-style float32 [128, 128] block scales (make-tiny --scales fp32)."""
    from deepinfer.regions.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("v3") / "tiny", scales="fp32")


@pytest.mark.parametrize(
    "parallel, recipe, scales",
    [
        ((1, 2, 1), "release", "ue8m0"),
        ((2, 1, 1), "release", "ue8m0"),
        ((2, 1, 1), "e4m3", "ue8m0"),
        ((2, 1, 1), "release", "fp32"),
        ((1, 2, 1), "e4m3", "fp32"),
        ((1, 4, 4), "release", "ue8m0"),
    ],
    ids=["ep=2", "tp=2", "tp=2-e4m3", "tp=2-fp32-scales", "ep=2-e4m3-fp32-scales", "cp=ep=4"],
)
def test_ranks_read_once_hold_their_cut_and_share_the_rest(
    tiny_ckpt, float_scaled_ckpt, tmp_path, parallel, recipe, scales
):
    """Small chunks (many per tensor; converted ones whole scale blocks each) against stacks built
    whole; a converting recipe reads every byte once too."""
    source = float_scaled_ckpt if scales == "fp32" else tiny_ckpt
    spec, plan = planned(tmp_path, source, parallel, extra=f'\n[quant]\nrecipe = "{recipe}"\n')
    ckpt = Checkpoint(source)
    files, entries = stack_files(spec, plan, ckpt, tmp_path / "b")
    report = stream(files, workers=1, chunk_bytes=1 << 12)
    sources = {(p.src.path, p.src.name): p.src.nbytes for f in files for t in f.tensors for p in t.pieces}
    assert report["bytes_read"] == sum(sources.values())  # each source byte once, for every rank
    shared = {f.path for f in files if "/weights/shared/" in f.path}
    assert shared, "replicated stacks go to shared files"
    for rank in range(spec.topology.world):
        for w in entries[layout.rank_key(rank)]:
            own = _read(tmp_path / "b" / w.path) if w.path else {}
            common = _read(tmp_path / "b" / w.shared) if w.shared else {}
            want = whole_stacks(ckpt, spec, plan, w.kind, rank)
            assert own.keys() | common.keys() == want.keys() and not own.keys() & common.keys(), w.kind
            for name in want:
                got = common[name] if w.tensors[name].file == "shared" else own[name]
                assert torch.equal(got.view(torch.uint8), want[name].contiguous().view(torch.uint8)), (
                    rank,
                    w.kind,
                    name,
                )
            if w.shared:
                assert str(tmp_path / "b" / w.shared) in shared
    # the host engram tables: once for every rank, fp8 codes in the recipe's format (each row its own
    # scale block), against quant/rescale's whole-array conversion
    stream(
        host_files(spec.model, ckpt, tmp_path / "b", spec.recipe, device_embedding=spec.device_embedding),
        workers=1,
        chunk_bytes=1 << 12,
    )
    host = _read(tmp_path / "b" / "host/engram.safetensors")
    for codes_name, scales_name, _ in spec.model.text.engram_tables():
        codes, scales = (ckpt.get(n).view(torch.uint8).numpy() for n in (codes_name, scales_name))
        if recipe == "e4m3":
            codes, scales = convert_format(codes, scales, (1, 32), FP8_E4M3)
        assert torch.equal(host[codes_name], torch.from_numpy(codes)) and torch.equal(
            host[scales_name], torch.from_numpy(scales)
        ), (recipe, codes_name)
    ep, tp, cp = parallel[1], parallel[0], parallel[2]
    moe = [w for w in entries["rank-0"] if w.kind == "moe"][0]
    assert (moe.tensors["w1"].file == "rank") == (ep > 1) and moe.tensors["gate"].file == "shared"
    attn = [w for w in entries["rank-0"] if w.kind == "attn_window"][0]  # its heads over the token group
    assert (attn.tensors["wq_b"].file == "rank") == (tp * cp > 1) and attn.tensors["attn_norm"].file == "shared"
    # the head: split by vocabulary over a token group of several ranks, each rank's rows its own file
    group = spec.topology.group_size
    heads = [next(w for w in entries[layout.rank_key(r)] if w.kind == "head") for r in range(spec.topology.world)]
    assert all((h.tensors["head"].file == "rank") == (group > 1) and h.tensors["norm"].file == "shared" for h in heads)
    if group > 1:
        assert len({h.path for h in heads}) == len(heads)
        rows = [_read(tmp_path / "b" / h.path)["head"] for h in heads]  # [1, rows, D] each
        whole = torch.cat([r[0] for r in rows])
        V = spec.model.text.vocab_size
        assert rows[0].shape[1] % 32 == 0 and whole.shape[0] > V and not whole[V:].any()
        assert torch.equal(whole[:V], ckpt.get("head.weight"))


def _read(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def _rewrite(ckpt: Path, name: str, tensor: torch.Tensor) -> None:
    """Replace one tensor of the tiny checkpoint's single file."""
    from safetensors.torch import load_file, save_file

    path = ckpt / "model.safetensors"
    tensors = load_file(str(path))
    tensors[name] = tensor
    save_file(tensors, str(path))


@pytest.mark.parametrize("damage", ["shape", "dtype", "truncated", "float-scale-shape", "float-scale-dtype"])
def test_bad_checkpoint_tensor_is_one_line_before_any_output(tiny_ckpt, float_scaled_ckpt, tmp_path, damage):
    float_scaled = damage.startswith("float")
    ckpt = shutil.copytree(float_scaled_ckpt if float_scaled else tiny_ckpt, tmp_path / "ckpt")
    name = "layers.2.attn.wq_b.weight"
    if float_scaled:
        name += "_scale_inv"
        if damage.endswith("shape"):
            _rewrite(ckpt, name, torch.ones((3, 3)))
            expected = "scale shape [3, 3] does not fit fp8 weight"
        else:
            _rewrite(ckpt, name, torch.ones(Checkpoint(ckpt).info(name)[1], dtype=torch.bfloat16))
            expected = f"tensor {name} has dtype BF16, expected F8_E8M0 or F32"
    elif damage == "shape":
        _rewrite(ckpt, name, torch.zeros((8, 8), dtype=torch.float8_e4m3fn))
        expected = f"tensor {name} has shape [8, 8]"
    elif damage == "dtype":
        _rewrite(ckpt, name, torch.zeros(Checkpoint(ckpt).info(name)[1], dtype=torch.bfloat16))
        expected = f"tensor {name} has dtype BF16, expected F8_E4M3"
    else:
        path = ckpt / "model.safetensors"
        path.write_bytes(path.read_bytes()[:-1000])
        expected = "truncated"
    toml = write_model_toml(tmp_path / "m", ckpt, executable="exported")
    with pytest.raises(CheckpointError) as e:
        pipeline.compile_bundle(load_compile_config(toml), tmp_path / "bundle", log=QUIET)
    message = str(e.value)
    assert "\n" not in message and "model.safetensors" in message and expected in message, message
    assert not (tmp_path / "bundle").exists() and not list(tmp_path.glob(".bundle*"))


def test_reference_loader_names_a_bad_float_scale(float_scaled_ckpt, tmp_path):
    """The reference's loader checks float scales as the weight pass does (it raised KeyError)."""
    ckpt = shutil.copytree(float_scaled_ckpt, tmp_path / "ckpt")
    name = "layers.2.attn.wq_b.weight_scale_inv"
    _rewrite(ckpt, name, torch.ones(Checkpoint(ckpt).info(name)[1], dtype=torch.bfloat16))
    source = Checkpoint(ckpt)
    region = plan_regions(load_config(ckpt).text, torch.float32, False).kinds["attn_source_r2"].region
    spec = next(s for s in region.specs if s.name == "wq_b")
    with pytest.raises(CheckpointError, match=f"tensor {name} has dtype BF16, expected F8_E8M0 or F32"):
        source.load_spec("layers.2.", spec)


def test_failure_mid_stream_leaves_no_bundle_and_no_cache_entry(tiny_ckpt, tmp_path, monkeypatch):
    calls = []
    real = stream_mod.run_task

    def failing(task):
        calls.append(task)
        if len(calls) == 5:
            raise RuntimeError("killed mid-stream")
        return real(task)

    monkeypatch.setattr(stream_mod, "run_task", failing)
    toml = write_model_toml(tmp_path / "m", tiny_ckpt, executable="exported")
    cache = Cache(tmp_path / "cache")
    with pytest.raises(RuntimeError, match="killed mid-stream"):
        pipeline.compile_bundle(load_compile_config(toml), tmp_path / "bundle", log=QUIET, cache=cache)
    assert len(calls) == 5
    assert not (tmp_path / "bundle").exists() and not list(tmp_path.glob(".bundle*"))
    assert [e for e in cache.entries() if e.kind in ("weights", "host")] == []


def test_progress_names_bytes_rate_and_eta():
    lines = []
    p = stream_mod.Progress(4 << 30, lines.append, every=0.0)
    p.add(1 << 30)
    p.add(3 << 30)
    assert lines[0].startswith("weights: 1.00 GiB / 4.00 GiB, ") and "/s" in lines[0]
    assert lines[-1].startswith("weights: 4.00 GiB / 4.00 GiB") and "ETA" not in lines[-1]  # done: no ETA


def test_manifest_entries_name_their_files(exported_bundle):
    m = json.loads((exported_bundle / layout.MANIFEST_FILE).read_text())
    assert m["format_version"] == mf.FORMAT_VERSION
    for w in m["weights"]["rank-0"]:
        assert w["path"] == layout.weights_path(0, w["kind"]) and "shared" not in w
        assert {t["file"] for t in w["tensors"].values()} == {"rank"}
        assert all(t["format"] for t in w["tensors"].values())
    header = struct.unpack("<Q", (exported_bundle / m["weights"]["rank-0"][0]["path"]).read_bytes()[:8])[0]
    assert header % 8 == 0


KILLED_COMPILE = """
import os, sys, time
import deepinfer.compiler.stream as stream
from deepinfer.compiler import pipeline
from deepinfer.compiler.cache.local import Cache
from deepinfer.compiler.config import load_compile_config
from deepinfer.compiler.plan import plan_regions

real, done = stream.run_task, []

def slow(task):
    done.append(real(task))
    if len(done) == 5:
        print("MID-STREAM", flush=True)
        time.sleep(600)                      # the test kills the process here
    return done[-1]

stream.run_task = slow
pipeline.compile_bundle(load_compile_config(sys.argv[1]), sys.argv[2], cache=Cache(sys.argv[3]), log=lambda m: None)
"""


def test_compile_killed_mid_weight_pass_leaves_nothing_a_later_compile_accepts(tiny_ckpt, tmp_path):
    """SIGKILL in the middle of the weight pass (no handler runs): no bundle, no cache entry, no
    lock held; the next weight pass over the same cache builds every file again, the same bytes."""
    import os
    import select
    import signal
    import subprocess
    import sys

    toml = write_model_toml(tmp_path / "m", tiny_ckpt, executable="exported")
    out, cache_dir = tmp_path / "bundle", tmp_path / "cache"
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_COMPILE, str(toml), str(out), str(cache_dir)], stdout=subprocess.PIPE, text=True
    )
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 300)
        line = proc.stdout.readline() if ready else "(no line in 300 s)"  # once, mid-stream (or EOF)
        assert line.strip() == "MID-STREAM", line
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    assert not out.exists()
    cache = Cache(cache_dir)
    assert [e for e in cache.entries() if e.kind in ("weights", "host")] == []
    spec, plan = planned(tmp_path, tiny_ckpt)
    staging = tmp_path / "again"
    staging.mkdir()
    run = pipeline.Run(staging=staging, out=staging, log=QUIET, cache=cache)
    pipeline.preprocess_weights(spec, plan, run)  # would block on a lock the dead process kept
    assert not [k for k, _ in cache.stats["hit"] if k in ("weights", "host")]
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    pipeline.preprocess_weights(spec, plan, pipeline.Run(staging=fresh, out=fresh, log=QUIET))
    files = sorted(p.relative_to(fresh) for p in fresh.rglob("*.safetensors"))
    assert files and files == sorted(p.relative_to(staging) for p in staging.rglob("*.safetensors"))
    for rel in files:
        assert (fresh / rel).read_bytes() == (staging / rel).read_bytes(), rel


def test_weight_progress_prints_sizes_in_their_unit_and_no_trivial_eta():
    """The tiny model's weight pass said '0.00 / 0.00 GiB, ETA 0 s': sizes now take their unit, and an
    ETA under a second is left out."""
    from deepinfer.compiler.stream import Progress

    lines: list[str] = []
    progress = Progress(4_047_872, lines.append)
    progress.add(4_047_872)
    assert len(lines) == 1 and lines[0].startswith("weights: 3.86 MiB / 3.86 MiB, "), lines
    assert "ETA" not in lines[0], lines
