"""`deepinfer plan`: a compile's figures from config.json and safetensors headers, no tensor data read.

References independent of the plan's code: the release's layer table and tensor shapes of
MODEL.md (typed in here), the files a compile actually writes (slow), and a headers-only
checkpoint whose data section is absent (any read of tensor data fails).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from deepinfer.bundles import layout
from deepinfer.bundles.safetensors import layout_header
from deepinfer.cli import main
from deepinfer.compiler.budget import human
from deepinfer.compiler.bundle_plan import plan_bundle
from deepinfer.compiler.cache.local import Cache
from deepinfer.compiler.config import load_compile_config
from deepinfer.errors import CheckpointError, ConfigError
from deepinfer.regions.checkpoint import written_checkpoint
from deepinfer.regions.config import load_config
from deepinfer.regions.synthetic import checkpoint_tensors, synthetic_config
from deepinfer.runtime.loading import ring_slack

from ..conftest import CACHE_ENV, write_model_toml

ROOT = Path(__file__).resolve().parents[2]
RELEASE = ROOT / "examples" / "release" / "model.toml"
REPLICATED = RELEASE.parent / "model_replicated.toml"  # the release, every rank every row of a prompt chunk
GiB = 1 << 30
# MODEL.md's layer kinds at the released schedule: attention kind per layer range, engram on 1 and 14
RELEASE_KINDS = {
    "attn_window": [0, 1],
    "attn_source_r2": [2, 8, 14],
    "attn_reuse_r2": [3, 4, 5, 6, 7, 9, 10, 11, 12, 13, 15, 16, 17, 18, 19],
    "attn_source_r1_cand": [20],
    "attn_reindex_r1_cand": [24, 28, 32, 36],
    "attn_reuse_r1": [21, 22, 23, 25, 26, 27, 29, 30, 31, 33, 34, 35, 37, 38, 39],
    "engram": [1, 14],
    "moe": list(range(40)),
    "head": [-1],
}


@pytest.fixture(scope="module")
def release() -> dict:
    """`deepinfer plan examples/release/model_replicated.toml --json` (the release's prompt chunks run
    replicated: its MoE at the prompt buckets is the decode method's), the MoE traced (all kinds:
    minutes more)."""
    r = CliRunner().invoke(main, ["plan", str(REPLICATED), "--json", "--scratch-of", "moe"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_release_config_validates():
    c = load_config(RELEASE.parent)
    t = c.text
    assert (t.num_hidden_layers, t.n_routed_experts, t.hidden_size, t.vocab_size) == (40, 384, 5120, 129280)
    assert len(t.compress_ratios) == 43 and t.engram_compressed_vocab_size == 99092
    assert c.vision.num_hidden_layers == 32 and c.quant.weight_block_size == (32, 32)


def test_release_layer_plan_and_executables(release):
    d = release
    assert {k: v["layers"] for k, v in d["kinds"].items()} == {"embed": [-1], **RELEASE_KINDS}
    # trn2 fuses each layer's regions (compiler/layers.py): one executable per layer kind (its attention
    # kind and whether it has an engram) x 6 buckets (batch 1, 8 x tokens 1, 128, 512), and the embedding's
    # and the head's: its logits and its greedy pairs (`best`, picked in its graph at several ranks)
    layer_kinds = {(l["regions"]["attn"], l["engram"]) for l in d["layers"]}
    assert len(layer_kinds) == len(d["executables"]["fused_layers"]) == 8
    assert d["executables"]["count"] == d["compile_jobs"] == (len(layer_kinds) + 3) * 6
    assert d["topology"] == {"tp": 1, "ep": 64, "cp": 64, "world_size": 64, "groups": 1}
    assert d["checkpoint"]["source"].startswith("config.json only")


def test_release_weights_per_rank(release):
    """Six of the 384 experts per rank, by MODEL.md's shapes: w1, w3 [2304, 2560] I8 + [2304, 160]
    scales, w2 [5120, 1152] + [5120, 72]. The engram tables ([rows, 256] fp8 + [rows, 8] scales, both
    layers' rows) are host bytes, once for all ranks; the engram kind keeps its projections on the device."""
    d = release
    routed = 40 * 6 * (2 * (2304 * 2560 + 2304 * 160) + 5120 * 1152 + 5120 * 72)
    moe = d["kinds"]["moe"]["weights_per_rank"]
    assert routed < moe < routed + 40 * (16 << 20)  # + a shared expert slice, the router, norms per layer
    tables = (384006168 + 384016682) * (256 + 8)
    assert d["kinds"]["engram"]["weights_per_rank"] < GiB
    # the token embedding: the example's [host] embedding = false makes it the embed region's table,
    # held whole by every rank (a shared stack), no host file
    assert d["kinds"]["embed"]["weights_per_rank"] == 129280 * 5120 * 2
    assert all("embed" not in m["host_by_file"] for m in d["memory"].values())
    assert all(m["host_by_file"]["engram"] == tables for m in d["memory"].values())
    per_rank = d["weights"]["per_rank_device"]
    assert set(per_rank) == {f"rank-{r}" for r in range(64)} and len(set(per_rank.values())) == 1
    # a rank loads what its device holds: its own files and the shared ones
    assert d["weights"]["per_rank_files"]["rank-0"] == pytest.approx(per_rank["rank-0"], rel=1e-3)
    assert d["bundle"]["bytes"] == sum(d["weights"]["files"].values())
    assert 400 * GiB < d["bundle"]["bytes"] < 600 * GiB


def test_release_memory_verdict(release):
    """A verdict for each of the 64 ranks against trn2's 24 GiB at LNC 2, from its breakdown."""
    mem = release["memory"]
    assert set(mem) == {f"rank-{r}" for r in range(64)}
    for m in mem.values():
        assert m["limit"] == 24 * GiB and m["limit_source"].startswith("trn2 HBM") and m["reserve"] == 0
        assert m["total"] == m["weights"] + m["pools"] + m["scratch"] and m["executables"] is None
        assert m["scratch"] == max(release["scratch"]["by_graph"].values())
        assert m["fits"] == (m["total"] <= m["limit"])


def test_release_weights_and_pools_fit_once_engram_leaves_the_device(release):
    """The engram tables (189 GiB) are host memory: each rank's device weights and pools fit."""
    for m in release["memory"].values():
        assert m["weights"] + m["pools"] <= m["limit"] - m["reserve"]


def test_release_moe_scratch_independent_of_rows(release):
    """The MoE's scratch is a part its local experts' weights set (decoded in tiles), independent
    of the rows, plus the rows' activations: under a MiB a row (462 KiB measured), where gathering
    each row's 6 experts cost 810 MiB a row."""
    scratch = release["scratch"]
    assert set(scratch["moe_by_batch"]) == {"1", "8"}
    assert 0 < scratch["moe_fixed_bytes"] <= 256 << 20
    assert 0 < scratch["moe_bytes_per_row"] <= 1 << 20


def test_release_head_is_split_over_the_ranks(release):
    """The head (129,280 x 5,120 float32, 2.47 GiB whole) split by vocabulary over the 64 ranks of the
    one token group: 2,020 rows a rank, padded to 2,048 (64 blocks), 40 MiB and its norm per rank,
    counted so by the memory budget."""
    head = 2048 * 5120 * 4 + 5120 * 2  # its rows float32 + the final norm bf16
    assert release["weights"]["head"] == {
        "vocab": 129280,
        "ranks": 64,
        "rows_per_rank": 2048,
        "padding_rows": 64 * 2048 - 129280,
        "bytes_per_rank": head,
    }
    assert release["kinds"]["head"]["weights_per_rank"] == head
    assert all(m["weights_by_kind"]["head"] == head for m in release["memory"].values())


@pytest.mark.parametrize(
    "parallel, rows", [((1, 1, 1), 288), ((1, 1, 2), 160), ((2, 1, 2), 96), ((1, 2, 1), 288)], ids=str
)
def test_plan_counts_the_head_per_rank(tmp_path, tiny_ckpt, parallel, rows):
    """The tiny model's 288-row head: whole on one rank and on token groups of one (ep dispatch),
    else its share of the group's ranks padded to whole blocks, in the plan and its budget."""
    toml = write_model_toml(tmp_path, tiny_ckpt, parallel=parallel, num_blocks=5)  # 4 usable: divide over cp 2
    plan = plan_bundle(load_compile_config(toml), scratch=False)
    d = plan.to_dict()
    assert d["weights"]["head"]["rows_per_rank"] == rows
    assert d["kinds"]["head"]["weights_per_rank"] == rows * 256 * 4 + 256 * 2
    text = "\n".join(plan.lines())
    assert f"head: vocabulary 288 over the token group's {parallel[0] * parallel[2]} rank(s), {rows} rows each" in text


def test_release_every_rank_fits(release):
    """With the engram tables on the host and the MoE's scratch bounded by its local experts."""
    assert all(m["fits"] for m in release["memory"].values())


def test_release_moe_scratch_traced_at_two_batches(release):
    """Both batch buckets' MoE graphs are traced; the larger holds more rows' activations."""
    moe = release["scratch"]["moe_by_batch"]
    assert sorted(moe) == ["1", "8"] and moe["8"] > moe["1"] > 0
    assert set(release["scratch"]["by_graph"]) == {"moe.decode.b1t512", "moe.decode.b8t512"}


def test_plan_cli_prints_the_full_plan():
    r = CliRunner().invoke(main, ["plan", str(REPLICATED), "--no-scratch"])
    assert r.exit_code == 0, r.output
    for line in (
        "layer plan: 40 layers -> 10 region kinds",
        "10 kinds, 24 (kind, method) calls (the 5 compressed attention kinds as their divided stages, the "
        "engram as kv and mix) x 6 buckets = 144; fused (trn2): one executable a layer, 8 layer kinds, their regions and collectives "
        "inside: 66 executables; compile jobs: 66",
        "per decode step and rank: 42 device executions (1 embed, 40 layer, 1 head)",
        "head: vocabulary 129,280 over the token group's 64 rank(s), 2,048 rows each (1,792 zero rows of "
        "padding), 40.01 MiB per rank",
        "state pools (7):",
        "bundle on disk:",
        "scratch: not traced",
        "limit 24.00 GiB (trn2 HBM: 12 GiB per NeuronCore x LNC 2)",
        "decode step per rank, modelled for trn2 at LNC 2",  # compiler/step_cost.py (tests/compiler/test_step_cost.py)
        "prompt at batch 1 per rank, chunks of 512 tokens",  # compiler/prompt_cost.py (tests/compiler/test_prompt_cost.py)
    ):
        assert line in r.output, line
    assert re.search(r"memory budget per rank:\n  ranks 0-63 \(64\): (fits|DOES NOT FIT)\n", r.output)


# -- the release at the 1M context: pools divided over the cp ranks, traced on fake tensors ----------

CONTEXT_1M, BLOCKS_1M = 1 << 20, 65537  # 8 sequences x 8192 blocks of 128 positions + scratch block 0


def release_toml(tmp_path: Path, *, max_context: int, num_blocks: int, source: Path = RELEASE) -> Path:
    """examples/release/model.toml (or `source`, another of its tomls) at another context and block
    count (its checkpoint: the example's config.json)."""
    text = source.read_text()
    for old, new in (
        ('checkpoint = "."', f'checkpoint = "{RELEASE.parent}"'),
        ("max_context = 65536", f"max_context = {max_context}"),
        ("num_blocks = 4097", f"num_blocks = {num_blocks}"),
    ):
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    path = tmp_path / "model.toml"
    path.write_text(text)
    return path


def test_release_pools_divided_over_cp_at_1m_context(tmp_path):
    """65537 blocks are the token group's: each of the 64 cp ranks holds 1/64 of the 65536 usable
    ones and a scratch block of its own (1025), where every rank held all of them (25.04 GiB of
    pools a rank); the per-slot pools stay whole. Shapes by MODEL.md: blocks of 128 positions,
    head_dim 512, index_head_dim 128, bf16; layers 2, 8, 14 at ratio 2 and 20 at ratio 1."""
    toml = release_toml(tmp_path, max_context=CONTEXT_1M, num_blocks=BLOCKS_1M)
    plan = plan_bundle(load_compile_config(toml), scratch=False)
    d = plan.to_dict()
    paged = {"ckv.r2": (3, 64, 512), "ikeys.r2": (3, 64, 128), "ckv.r1": (1, 128, 512), "ikeys.r1": (1, 128, 128)}
    for name, (layers, entries, width) in paged.items():
        p = d["pools"][name]
        block = layers * entries * width * 2
        assert p["divided"] and p["blocks_per_rank"] == 65536 // 64 + 1 == 1025, name
        assert (p["bytes_undivided"], p["bytes"]) == (block * BLOCKS_1M, block * 1025), name
    for name in ("win", "part_kv.r2", "part_gate.r2"):
        p = d["pools"][name]
        assert not p["divided"] and p["blocks_per_rank"] is None and p["bytes"] == p["bytes_undivided"], name
    assert sum(p["bytes_undivided"] for p in d["pools"].values()) > 25 * GiB
    for m in d["memory"].values():
        assert m["pools_by_name"] == {name: p["bytes"] for name, p in d["pools"].items()}
        assert m["pools"] < GiB / 2
    assert "  ckv.r2           3 layers x blocks x [64, 512] bfloat16    192.19 MiB  (1025 of 65537 blocks: " in (
        "\n".join(plan.lines())
    )


def traced_in_2gib(toml: Path, kind: str) -> tuple[dict[str, int], int]:
    """`plan_bundle` of `toml` tracing `kind` in a process whose data segment is limited to 2 GiB (an
    allocation past it fails at once instead of using memory) -> (its scratch by graph, its peak RSS KiB)."""
    import subprocess
    import sys

    probe = (
        "import json, resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_DATA, (2 << 30, 2 << 30))\n"
        "from deepinfer.compiler.bundle_plan import plan_bundle\n"
        "from deepinfer.compiler.config import load_compile_config\n"
        "plan = plan_bundle(load_compile_config(sys.argv[1]), kinds=(sys.argv[2],))\n"
        "print(json.dumps(plan.scratch), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n"
    )
    r = subprocess.run([sys.executable, "-c", probe, str(toml), kind], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    scratch, rss = r.stdout.rsplit(" ", 1)
    return json.loads(scratch), int(rss)


def test_release_traced_at_1m_context_without_real_inputs(tmp_path):
    """Tracing at the 1M context allocates nothing of the traced shapes: a plan that traces the
    candidate source (one of its inputs was 16 GiB of real random data) runs within 2 GiB of data."""
    toml = release_toml(tmp_path, max_context=CONTEXT_1M, num_blocks=BLOCKS_1M, source=REPLICATED)
    traced, max_rss_kib = traced_in_2gib(toml, "attn_source_r1_cand")
    stages = ("query", "select", "attend", "output")  # the divided attention's (regions/divided.py)
    per_context = ("select", "attend")  # query and output read no paged state: one per bucket of rows
    assert list(traced) == [
        f"attn_source_r1_cand.{m}.b8t512" + ("c1048576" if m in per_context else "") for m in stages
    ]
    # planning alone (64 ranks' own attention, expert-slice and engram cuts since issue 40) peaks near 1.5 GiB
    # here; one real input of the traced shapes would be 16 GiB
    assert max_rss_kib < 3 << 20


def test_divided_rows_select_over_1m_in_tiles(tmp_path):
    """The release (prompt rows divided, one sequence a prompt step) at the 1M context: the candidate
    source's rows_attend scores a rank's 128 rows against every one of 1M entries and holds under 1 GiB
    of scratch (744 MiB traced), where scoring the whole row at once held 17 GiB (137 GiB at batch 8;
    kernels/index_select.py: trn2 scores the context in tiles beside a running top-k). Traced on fake
    tensors within 2 GiB of data."""
    toml = release_toml(tmp_path, max_context=CONTEXT_1M, num_blocks=BLOCKS_1M)
    traced, _ = traced_in_2gib(toml, "rows_attn_source_r1_cand")
    stages = [f"rows_attn_source_r1_cand.{m}.b1t8192" for m in ("rows_in", "rows_write", "rows_attend")]
    assert list(traced) == [stages[0], stages[1] + "c1048576", stages[2] + "c1048576"]
    assert 0 < traced[stages[2] + "c1048576"] < GiB


# -- a headers-only checkpoint at release dimensions ------------------------------------------------


def headers_only(out: Path, config: dict, *, change: dict | None = None) -> Path:
    """The checkpoint of `config` as safetensors files that end after their headers (no data at
    all): one file per layer and one for the rest, with the index. `change`: name -> (dtype, shape)."""
    by_file: dict[str, list] = {}
    for name, stored_dtype, stored_shape in checkpoint_tensors(config):
        dtype, shape = (change or {}).get(name, (stored_dtype, stored_shape))
        f = f"layer-{name.split('.')[1]}.safetensors" if name.startswith("layers.") else "rest.safetensors"
        size = {"F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "BF16": 2, "F32": 4}[dtype]
        by_file.setdefault(f, []).append((name, dtype, shape, math.prod(shape) * size))
    weight_map = {e[0]: f for f, entries in by_file.items() for e in entries}
    with written_checkpoint(out, config, weight_map, 0) as tmp:
        for f, entries in by_file.items():
            (tmp / f).write_bytes(layout_header(entries, {"format": "pt"})[0])
    return out


def synthetic_toml(tmp_path: Path, ckpt: Path) -> Path:
    """Six release-dimension layers with 8 experts, at EP = CP = 8 on trn2."""
    return write_model_toml(
        tmp_path / "toml",
        ckpt,
        target="trn2",
        options="{ lnc = 2 }",
        batch=(1, 4),
        tokens=(1, 8),
        max_context=256,
        num_blocks=81,  # 80 usable blocks: divided over cp = 8
        parallel=(1, 8, 8),
    )


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    return synthetic_config(layers=6, experts=8)


def test_headers_only_plan_equals_the_config_only_plan(tmp_path, synthetic, monkeypatch):
    ckpt = headers_only(tmp_path / "ckpt", synthetic)
    assert all(f.stat().st_size < 1 << 20 for f in ckpt.glob("*.safetensors"))  # headers, no data
    only = tmp_path / "config-only"
    only.mkdir()
    shutil.copy(ckpt / "config.json", only / "config.json")

    def no_data(*args, **kwargs):
        raise AssertionError("tensor data read")

    for target in (
        "deepinfer.bundles.safetensors.map_bytes",
        "deepinfer.bundles.safetensors.load_mmap",
        "deepinfer.regions.checkpoint.safe_open",
    ):
        monkeypatch.setattr(target, no_data)
    a = plan_bundle(load_compile_config(synthetic_toml(tmp_path / "a", ckpt)), scratch=False)
    b = plan_bundle(load_compile_config(synthetic_toml(tmp_path / "b", only)), scratch=False)
    assert a.checkpoint.startswith("safetensors headers of 7 file(s)") and b.checkpoint.startswith("config.json")
    da, db = a.to_dict(), b.to_dict()
    for key in ("kinds", "executables", "weights", "pools", "memory", "bundle"):
        assert da[key] == db[key], key
    # 8 experts over 8 ranks: one expert per rank and layer, by MODEL.md's fp4 shapes
    routed = 6 * (2 * (2304 * 2560 + 2304 * 160) + 5120 * 1152 + 5120 * 72)
    assert routed < da["kinds"]["moe"]["weights_per_rank"] < 2 * routed


def test_headers_checked_against_the_specs(tmp_path, synthetic):
    name = "layers.2.attn.kv_norm.weight"
    ckpt = headers_only(tmp_path / "ckpt", synthetic, change={name: ("BF16", (256,))})
    with pytest.raises(CheckpointError) as e:
        plan_bundle(load_compile_config(synthetic_toml(tmp_path, ckpt)), scratch=False)
    message = str(e.value)
    assert "\n" not in message and "layer-2.safetensors" in message and name in message
    assert "shape [256], expected [512]" in message


def test_cli_error_is_one_line(tmp_path, synthetic):
    ckpt = headers_only(tmp_path / "ckpt", synthetic, change={"layers.0.ffn.gate.weight": ("F32", (8, 5120))})
    r = CliRunner().invoke(main, ["plan", str(synthetic_toml(tmp_path, ckpt)), "--no-scratch"])
    assert r.exit_code == 2 and r.output.count("\n") == 1
    assert "layer-0.safetensors" in r.output and "layers.0.ffn.gate.weight" in r.output and "BF16" in r.output


def test_plan_needs_config_json_and_generates_nothing(tmp_path):
    toml = write_model_toml(tmp_path, tmp_path / "absent", tiny_layers=6)
    with pytest.raises(ConfigError) as e:
        plan_bundle(load_compile_config(toml))
    assert "model.checkpoint" in str(e.value) and "make-tiny" in str(e.value)
    assert not (tmp_path / "absent").exists()


def test_unknown_kind_to_trace(tmp_path, tiny_ckpt):
    with pytest.raises(ConfigError, match="no region kind 'mlp'"):
        plan_bundle(load_compile_config(write_model_toml(tmp_path, tiny_ckpt)), kinds=("mlp",))


# -- against what a compile writes (slow: the multi-rank bundle) ------------------------------------


@pytest.mark.parametrize("parallel", [(1, 4, 4), (2, 4, 2)], ids=["cp=ep=4", "tp=2xcp=2,ep=4"])
def test_plan_predicts_the_compiled_bundle(rank_bundle, parallel):
    """EP = CP = 4 and tp = 2 x cp = 2, ep = 4 (both with the draft) on the tiny model: the planned files
    are the files written, byte for byte in size; memory per rank and every graph's scratch are the
    manifest's, traced here or read from the trace records the compile left in its cache."""
    bundle = rank_bundle(*parallel)
    config = load_compile_config(bundle.parent / "model.toml")
    traced = plan_bundle(config).to_dict()
    recorded = plan_bundle(config, scratch=False, cache=Cache(Path(os.environ[CACHE_ENV]))).to_dict()
    written = {
        p.relative_to(bundle).as_posix(): p.stat().st_size
        for d in ("weights", "host")
        for p in (bundle / d).rglob("*")
        if p.is_file()
    }
    assert traced["weights"]["files"] == recorded["weights"]["files"] == written
    manifest = json.loads((bundle / "manifest.json").read_text())
    scratch = {
        layout.executable_name(
            e["kind"], e["method"], e["bucket"]["batch"], e["bucket"]["tokens"], e["bucket"].get("context")
        ): e["scratch_bytes"]
        for e in manifest["regions"]
    }
    assert recorded["scratch"]["by_graph"] == scratch and sorted(recorded["scratch"]["from_cache"]) == sorted(scratch)
    # a graph per (kind, method): 3 kinds decode and the engram's kv and mix, the 4 compressed attention kinds run divided (cp > 1) as
    # their stages (query, select, attend, output; the reuse kind query, attend and output); the MoE also at its smallest
    # batch bucket (batch buckets 1 and 2); the draft (this layout holds one): its 5 kinds' 7 methods (the
    # head's normalize, pick and chain at several ranks, regions/picking.py) and the target head's `project`
    graphs = traced["scratch"]["by_graph"]
    draft = [n for n in graphs if n.startswith("dspark_") or n.startswith("head.project.")]
    assert traced["scratch"]["from_cache"] == [] and len(draft) == 7 + 1
    assert len(graphs) - len(draft) == 3 + 2 + 3 * 4 + 3 + 1
    assert traced["scratch"]["by_graph"] == {n: scratch[n] for n in traced["scratch"]["by_graph"]}
    for plan in (traced, recorded):
        for rank, m in manifest["memory"].items():
            p = plan["memory"][rank]
            assert (p["weights_by_kind"], p["pools_by_name"], p["scratch"]) == (
                m["weights_by_kind"],
                m["pools_by_name"],
                m["scratch"],
            ), rank
        assert plan["compile_jobs"] == len(manifest["regions"])


def test_release_geometry_holds_every_region_kind_of_the_release():
    """`make-tiny --geometry release`: 7 layers at the released dimensions with the release's region
    kinds (the ratio-1 reuse layers 21-23 included), each with the release's weight shapes."""
    import torch

    from deepinfer.compiler.plan import plan_regions
    from deepinfer.regions.config import parse_config
    from deepinfer.regions.synthetic import release_config, release_geometry_config

    small, full = (
        plan_regions(parse_config(c).text, torch.bfloat16, True) for c in (release_geometry_config(8), release_config())
    )
    assert set(small.kinds) == set(full.kinds) and "attn_reuse_r1" in small.kinds
    for kind, kp in full.kinds.items():
        if kind in ("moe", "engram"):  # fewer experts and engram rows by design
            continue
        assert [s.shape for s in small.kinds[kind].region.specs] == [s.shape for s in kp.region.specs], kind


def test_release_plan_counts_a_decode_steps_executions_and_collectives(release, tmp_path):
    """Per decode step at EP = CP = 64: the embed region, one call per window layer, the divided
    stages of every compressed layer (query, select, attend, output where it selects; query, attend,
    output where it reuses), every MoE, the engram layers' kv and mix and the head; the attention
    all-reduce (its heads or output rows over the token group) and the MoE all-reduce per layer, the
    query all-gather per compressed layer, the selection all-gathers (two on the candidate source), the
    attention merges per compressed layer, the engram all-reduce per engram layer and the logits."""
    t = load_config(RELEASE.parent).text
    layers = range(t.num_hidden_layers)
    kinds = [t.layer_kind(i) for i in layers]
    attention = sum({"window": 1, "source": 4, "reindex": 4, "reuse": 3}[k] for k in kinds)
    step = release["per_decode_step"]  # trn2 fuses layers: one execution a layer (issue 29: at most 42)
    assert step["executions_by_slot"] == {"embed": 1, "layer": len(layers), "head": 1}
    assert step["executions"] == 1 + len(layers) + 1 == 42
    per_region = _plan_json(tmp_path, 'options = { lnc = 2, layers = "regions" }')["per_decode_step"]
    assert per_region["executions_by_slot"] == {
        "embed": 1,
        "attn": attention,
        "moe": len(layers),
        "engram": 2 * len(t.engram_layer_ids),  # kv, then mix: the engram all-reduce between them
        "head": 1,
    }
    assert per_region["executions"] == 1 + attention + len(layers) + 2 * len(t.engram_layer_ids) + 1 == 170
    assert per_region["collectives_by_name"] == step["collectives_by_name"]
    assert per_region["collectives_in_executables"] == 0  # per region: host collectives by default
    compressed = sum(k != "window" for k in kinds)
    selecting = sum(k in ("source", "reindex") for k in kinds)
    assert step["collectives_by_name"] == {
        "attention all-reduce": len(layers),
        "ep all-reduce": len(layers),
        "cp query all-gather": compressed,
        "cp selection all-gather": selecting + 1,
        "cp attention max all-gather": compressed,
        "cp attention all-reduce": compressed,
        "engram all-reduce": len(t.engram_layer_ids),
        "logits all-gather": 1,
    }
    assert step["collectives_in_executables"] == step["collectives"] - 1  # all but the logits' gather


def _plan_json(tmp_path, options: str) -> dict:
    """`deepinfer plan --json --no-scratch` of the release example with its [target] options replaced."""
    text = RELEASE.read_text().replace("options = { lnc = 2 }", options)
    text = text.replace('checkpoint = "."', f'checkpoint = "{RELEASE.parent.resolve()}"')
    assert options in text and str(RELEASE.parent.resolve()) in text
    toml = tmp_path / "model.toml"
    toml.write_text(text)
    r = CliRunner().invoke(main, ["plan", str(toml), "--json", "--no-scratch"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def _fp8(rows: int, cols: int) -> int:
    """Bytes of an fp8 [rows, cols] weight and its [rows/32, cols/32] ue8m0 scales (MODEL.md)."""
    return rows * cols + -(-rows // 32) * -(-cols // 32)


def test_release_plan_with_the_draft_divides_it_over_the_ranks(tmp_path):
    """`deepinfer plan` of the release with [speculative] draft = "dspark" at EP = CP = 64 (issue 30, item
    5): the draft's kinds and executables listed, every rank fits with the draft in its budget, and the
    draft's weights stated whole (7.39 GiB, what one rank held when the draft was refused past one rank)
    and per rank: 2 of its 128 experts a stage plus what every rank holds whole. References typed in
    from MODEL.md's shapes and the config's draft defaults (3 stages, 128 experts, Markov rank 256,
    target layers 37-39), not the plan's code. The draft embeds its block with the host's table:
    [host] embedding = true. Divided prompt rows are not built with a draft: the release run replicated."""
    text = REPLICATED.read_text()
    for old, new in (
        ('checkpoint = "."', f'checkpoint = "{RELEASE.parent}"'),
        ("embedding = false", "embedding = true"),
    ):
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    toml = tmp_path / "model.toml"
    toml.write_text(text + '\n[speculative]\ndraft = "dspark"\n')
    plan = plan_bundle(load_compile_config(toml), scratch=False)
    d = plan.to_dict()

    kinds = ["dspark_context", "dspark_attn", "dspark_moe", "dspark_head"]
    assert {k: d["kinds"][k]["layers"] for k in kinds} == {
        "dspark_context": [0],
        "dspark_attn": [0, 1, 2],
        "dspark_moe": [0, 1, 2],
        "dspark_head": [2],
    }
    # each draft kind built at each batch bucket (1, 8) for the draft's step: a block of 5 positions, the
    # context projection over the window of 128; and the target head's projection of the block
    draft = d["draft"]
    assert set(kinds) <= set(draft["kinds"]) and draft["stages"] == 3
    for k in kinds:
        T = 128 if k == "dspark_context" else 5
        assert all(
            any(n.startswith(f"{k}.") and n.endswith(f".b{b}t{T}") for n in draft["executables"]) for b in (1, 8)
        )
    assert {"head.project.b1t5", "head.project.b8t5"} <= set(draft["executables"])
    assert set(draft["executables"]) <= set(d["executables"]["names"])
    # fused (issue 42): the layers the draft reads (37-39) are capture twins of their kind, one execution each
    assert d["executables"]["fused_layers"]["layer_reuse_r1_capture"] == [37, 38, 39]
    assert d["per_decode_step"]["executions_by_slot"] == {"layer": 40, "head": 1}
    assert not any(n.startswith("dspark_capture.") for n in d["executables"]["names"])

    D, I, V, n, ranks = 5120, 2304, 129280, 4, 64
    expert = 2 * (I * D // 2 + I * D // 32) + D * I // 2 + D * I // 32  # w1, w3 [I, D], w2 [D, I]: fp4 + scales
    shared = 3 * _fp8(I, D)  # sw1, sw3 [I, D], sw2 [D, I]
    router = 128 * D * 2 + 2 * 128 * 4 + ((2 + n) * n * n * D + (2 + n) * n + 3) * 4 + D * 2  # gate, biases, hc, norm
    attention = (
        ((2 + n) * n * n * D + (2 + n) * n + 3) * 4  # hc_attn_*
        + D * 2  # attn_norm
        + _fp8(1280, D)  # wq_a
        + 1280 * 2  # q_norm
        + _fp8(64 * 512, 1280)  # wq_b
        + _fp8(512, D)  # wkv
        + 512 * 2  # kv_norm
        + _fp8(8 * 1024, 64 * 512 // 8)  # wo_a
        + _fp8(D, 8 * 1024)  # wo_b
        + 64 * 4  # attn_sink
    )
    context = _fp8(D, 3 * D) + D * 2  # main_proj [D, L*D], main_norm
    head = D * 2 + 2 * V * 256 * 2 + (D + 256) * 4  # norm, markov embed and head [V, R], confidence [1, D + R]
    replicated = context + head + 3 * (attention + router)
    whole = replicated + 3 * (128 * expert + shared)
    assert draft["weights_whole"] == whole
    assert round(whole / GiB, 2) == 7.39  # the figure
    per_rank = draft["weights_per_rank"]
    s = I // ranks  # 36 intermediate columns of every expert on every rank (regions/topology.expert_slice_width)
    w2_blocks = 2  # a 36-column slice at offset 36 r spans at most two 32-column scale blocks
    experts = 3 * 128 * (2 * (s * D // 2 + s * D // 32) + D * s // 2 + D * w2_blocks)  # w1, w3 rows; w2 columns
    # the Markov head's output rows split as the target head's vocabulary: 2048 rows a rank (whole 32-blocks)
    head_rank = head - V * 256 * 2 + 2048 * 256 * 2
    # the attention's heads over the token group of 64, as the target's window attention's: one head a
    # rank (wq_b's 512 rows, its sink entry), the one output group of 8 it falls in (wo_a's 1024 rows of
    # that group, its head's 512 columns; wo_b's 1024 columns of the group)
    heads = _fp8(64 * 512, 1280) + _fp8(8 * 1024, 64 * 512 // 8) + _fp8(D, 8 * 1024) + 64 * 4
    attention_rank = attention - heads + _fp8(512, 1280) + _fp8(1024, 512) + _fp8(D, 1024) + 4
    held = replicated - head + head_rank - 3 * (attention - attention_rank)
    assert held + experts <= per_rank <= held + experts + 3 * shared // 32  # + a shared expert slice
    assert per_rank == sum(v["per_rank"] for v in draft["by_kind"].values()) < GiB
    by_kind = draft["by_kind"]
    context_kind = by_kind["dspark_context"]  # whole on every rank
    assert context_kind["per_rank"] == context_kind["whole"] == d["kinds"]["dspark_context"]["weights_per_rank"]
    assert by_kind["dspark_attn"]["per_rank"] == 3 * attention_rank == d["kinds"]["dspark_attn"]["weights_per_rank"]
    assert by_kind["dspark_attn"]["whole"] == 3 * attention
    assert by_kind["dspark_head"]["per_rank"] == head_rank == d["kinds"]["dspark_head"]["weights_per_rank"]
    assert by_kind["dspark_head"]["whole"] == head
    assert by_kind["dspark_moe"]["whole"] > 50 * by_kind["dspark_moe"]["per_rank"]  # its router is whole everywhere

    # every rank holds the draft's share, counted in its budget, and fits the 24 GiB of trn2 at LNC 2
    assert set(d["memory"]) == {f"rank-{r}" for r in range(ranks)}
    for m in d["memory"].values():
        assert {k: m["weights_by_kind"][k] for k in kinds} == {k: by_kind[k]["per_rank"] for k in kinds}
        assert m["weights"] == sum(m["weights_by_kind"].values()) and m["fits"]
        assert m["limit"] == 24 * GiB and m["total"] + 8 * GiB < m["limit"]  # room for scratch and executables
    out = "\n".join(plan.lines())
    assert "draft (dspark): 3 stages, kinds " in out
    assert f"  weights {human(per_rank)} per rank (7.39 GiB whole; tp 1, ep 64): " in out
    assert f"dspark_moe {human(by_kind['dspark_moe']['per_rank'])} of 6.83 GiB" in out and "head.project.b8t5" in out


def test_a_draft_gives_the_per_slot_rings_a_block_of_slack(tmp_path, tiny_ckpt):
    """[speculative] draft: the window rings and the compressor's partial groups hold the draft's block
    (5) of rows beyond the window (8) and the ratio (2), so a rejected draft needs no copy; the paged
    pools, and every pool without a draft, keep their shapes; the budget counts the rings whole, and
    the runtime reads the slack back from the pools (`Sizes.slack`)."""
    shapes = {}
    for draft in (False, True):
        extra = '\n[speculative]\ndraft = "dspark"\n' if draft else ""
        toml = write_model_toml(tmp_path / str(draft), tiny_ckpt, tokens=(1, 6), extra=extra)
        plan = plan_bundle(load_compile_config(toml), scratch=False)
        assert plan.spec.geometry.slack == (5 if draft else 0)
        manifest = SimpleNamespace(layers=plan.regions.layers, kv=SimpleNamespace(pools=plan.pools))
        assert ring_slack(manifest, plan.spec.model.text) == plan.spec.geometry.slack
        d = plan.to_dict()
        shapes[draft] = {name: tuple(p["entry_shape"]) for name, p in d["pools"].items()}
        for m in d["memory"].values():
            assert m["pools_by_name"] == {name: p["bytes"] for name, p in d["pools"].items()}
    assert shapes[False] == {
        "win": (8, 64),
        "ckv.r2": (8, 64),
        "ikeys.r2": (8, 32),
        "part_kv.r2": (2, 64),
        "part_gate.r2": (2, 64),
        "ckv.r1": (16, 64),
        "ikeys.r1": (16, 32),
    }
    rings = {"win": (13, 64), "part_kv.r2": (7, 64), "part_gate.r2": (7, 64)}
    assert shapes[True] == {**shapes[False], **rings, "dspark_features": (13, 256)}
