"""The memory budget per rank: its breakdown matches the bundle, and a bundle that would not fit is refused."""

from __future__ import annotations

import dataclasses
import json
import math
import struct

import pytest
import torch

from deepinfer.bundles import manifest as mf
from deepinfer.bundles import manifest_io
from deepinfer.compiler import budget
from deepinfer.compiler.config import load_compile_config
from deepinfer.compiler.pipeline import compile_bundle, parse, plan
from deepinfer.errors import ConfigError
from deepinfer.host import physical_memory

from ..conftest import write_model_toml

QUIET = lambda msg: None  # noqa: E731


def test_scratch_is_the_peak_of_live_intermediates():
    class Chain(torch.nn.Module):
        def forward(self, x):  # x: 1000 float32 = 4000 bytes
            a = x * 2
            b = a + 1  # a dies here: a and b live (8000)
            c = b.view(10, 100)  # a view: no memory of its own, keeps b alive
            return c * 3  # b (through c) and the output live (8000)

    ep = torch.export.export(Chain(), (torch.zeros(1000),))
    assert budget.scratch_bytes(ep) == 8000


def test_breakdown_adds_up(exported_bundle):
    """weights = the tensor bytes of the weight files; pools = what the runtime allocates; the rest as built;
    host = the tensor bytes of the host files, apart from the total."""
    from deepinfer.runtime import load

    def tensor_bytes(path):
        header = struct.unpack("<Q", path.read_bytes()[:8])[0]
        return path.stat().st_size - 8 - header

    m = manifest_io.read(exported_bundle)
    mem = m.memory["rank-0"]
    for entry in m.weights["rank-0"]:
        assert mem["weights_by_kind"][entry.kind] == tensor_bytes(exported_bundle / entry.path), entry.kind
    assert mem["host_by_file"] == {name: tensor_bytes(exported_bundle / h.path) for name, h in m.host.items()}
    assert "engram" in m.host and mem["host"] == sum(mem["host_by_file"].values())
    assert mem["weights"] == sum(mem["weights_by_kind"].values())
    session = load(exported_bundle, verify=False)
    allocated = {name: p.numel() * p.element_size() for name, p in session.pools.items()}
    assert mem["pools_by_name"] == allocated and mem["pools"] == sum(allocated.values())
    assert mem["executables"] == sum((exported_bundle / r.artifact).stat().st_size for r in m.regions)
    assert mem["scratch"] == max(r.scratch_bytes for r in m.regions) > 0
    for kind in {r.kind for r in m.regions}:
        assert mem["scratch_by_kind"][kind] == max(r.scratch_bytes for r in m.regions if r.kind == kind) > 0
    assert mem["total"] == mem["weights"] + mem["pools"] + mem["executables"] + mem["scratch"]
    assert mem["limit"] == physical_memory()  # cpu: this host's memory


def test_trn2_pools_over_hbm_refused_before_tracing(tmp_path, tiny_ckpt, monkeypatch):
    """2M KV blocks of the tiny model are ~17 GiB of pools: over one LNC=1 core's 12 GiB of HBM."""
    toml = write_model_toml(tmp_path, tiny_ckpt, target="trn2", options="{ lnc = 1 }", num_blocks=2_000_000)
    called = []
    monkeypatch.setattr("deepinfer.compiler.executables.trace", lambda *a, **k: called.append(a))
    with pytest.raises(ConfigError) as e:
        compile_bundle(load_compile_config(toml), tmp_path / "bundle", log=lambda msg: None)
    message = str(e.value)
    assert "memory.limit_gib" in message and "does not fit (weights and state pools, as planned)" in message
    assert "state pools" in message and "12.00 GiB (trn2 HBM: 12 GiB per NeuronCore x LNC 1)" in message
    assert not called, "refused before tracing"
    assert not (tmp_path / "bundle").exists() and not list(tmp_path.glob(".bundle*"))


def test_trn2_lnc2_core_has_24_gib(tmp_path, tiny_ckpt):
    spec = parse(
        load_compile_config(write_model_toml(tmp_path, tiny_ckpt, target="trn2", options="{ lnc = 2 }")), False, QUIET
    )
    assert budget.breakdown(spec, plan(spec, QUIET)).limit == 24 * budget.GiB


def test_limit_gib_refuses_the_tiny_model(tmp_path, tiny_ckpt):
    toml = write_model_toml(tmp_path, tiny_ckpt, extra="\n[memory]\nlimit_gib = 0.001\n")
    with pytest.raises(ConfigError, match=r"model.toml:\d+: memory.limit_gib: the bundle does not fit") as e:
        compile_bundle(load_compile_config(toml), tmp_path / "bundle", log=lambda msg: None)
    assert "limit 1.02 MiB ([memory] limit_gib)" in str(e.value)
    assert not (tmp_path / "bundle").exists() and not list(tmp_path.glob(".bundle*"))


def test_scratch_is_checked_after_tracing(tmp_path, tiny_ckpt):
    """Weights and pools fit; the traced graphs' scratch does not."""
    toml = write_model_toml(tmp_path, tiny_ckpt, extra="\n[memory]\nlimit_gib = 0.01\nreserve_gib = 0.005\n")
    spec = parse(load_compile_config(toml), False, QUIET)
    planned = plan(spec, QUIET)
    budget.check_planned(spec, planned, QUIET)  # ~4 MiB of 5.12 MiB usable
    moe = mf.Executable(
        kind="moe",
        method="decode",
        bucket=mf.Shape(batch=1, tokens=1),
        artifact="regions/none.pt2",
        executable="exported",
        inputs=(),
        outputs=(),
        scratch_bytes=2 << 20,
    )
    head = dataclasses.replace(moe, kind="head", bucket=mf.Shape(batch=2, tokens=1), scratch_bytes=1 << 20)
    moe8 = dataclasses.replace(moe, bucket=mf.Shape(batch=8, tokens=1), scratch_bytes=(2 << 20) + 4096)
    with pytest.raises(ConfigError, match="with the traced graphs' scratch") as e:
        budget.check_traced(spec, planned, (moe, head, moe8), QUIET)
    assert "(largest graph: moe.decode.b8t1)" in str(e.value)
    assert "by kind    moe 2.00 MiB, head 1.00 MiB" in str(e.value)  # each kind's largest graph


@pytest.mark.parametrize(
    "memory, message",
    [
        ("limit_gib = 0", "memory.limit_gib: must be positive"),
        ("reserve_gib = -1", "memory.reserve_gib: must be at least 0"),
        ("limit_gib = 2\nreserve_gib = 2.0", "memory.reserve_gib: 2.0 GiB leaves nothing"),
        ('limit_gib = "big"', "memory.limit_gib: expected float"),
        ("limit = 2", "unknown key 'limit'; valid keys: limit_gib, reserve_gib"),
    ],
)
def test_memory_section_validated(tmp_path, memory, message):
    toml = write_model_toml(tmp_path, tmp_path / "ckpt", extra=f"\n[memory]\n{memory}\n")
    with pytest.raises(ConfigError, match=message):
        load_compile_config(toml)


def test_engram_tables_are_host_bytes_at_release_scale(tmp_path):
    """The release config planned for trn2 at EP = CP = 64 (config.json only: no tensor is read):
    the engram tables count as host bytes, every row and scale of both, and no rank's device
    weights hold them; the token embedding is a device weight on trn2, whole on every rank (vocab
    129280 x hidden 5120 bf16, 1.23 GiB), and no host file; what is left fits a rank's 24 GiB."""
    from deepinfer.regions.synthetic import release_config

    ckpt = tmp_path / "release"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(release_config()))
    toml = write_model_toml(
        tmp_path,
        ckpt,
        target="trn2",
        options="{ lnc = 2 }",
        parallel=(1, 64, 64),
        batch=[1, 64],
        tokens=[1],
        max_context=1024,
        num_blocks=4097,
    )
    spec = parse(load_compile_config(toml), True, QUIET)
    p = plan(spec, QUIET)
    d = budget.breakdown(spec, p)
    rows = (384006168, 384016682)  # MODEL.md: engram_num_embeddings
    assert d.host["engram"] == sum(r * (256 + 256 // 32) for r in rows)
    biggest = max(math.prod(s.buffer_shape) for kp in p.kinds.values() for s in kp.region.specs)
    assert biggest < min(rows) * 256
    assert d.weights["embed"] == 129280 * 5120 * 2 and "embed" not in d.host
    assert sum(d.weights.values()) < 14 * budget.GiB and d.total <= d.usable
    assert "engram" in d.to_dict()["host_by_file"] and d.to_dict()["total"] == d.total


def test_moe_scratch_is_bounded_by_a_few_tiles_in_both_forms():
    """One rank of the release at EP = 64 (a 36-column slice of each of 384 experts, hidden 5120),
    traced and lowered for cpu at 1 and 64 rows: the gathered form (1 row: 6 slices) decodes only the
    routed slices, a few MiB; the tiled form (64 rows x top-6 = 384 assignments, in `tiles_bound` tiles
    of `moe_tile` rows) holds its tiles' gathered w1 and w3 codes and rows and decodes them in row
    tiles, within a few tiles beside those (gathering 6 whole experts' float32 weights per row was
    810 MiB a row). The grouped form it replaced held 4 tiles: it decoded the stacks in place."""
    from deepinfer.bundles.topology import Topology
    from deepinfer.compiler.targets.cpu import CpuTarget
    from deepinfer.compiler.trace import trace
    from deepinfer.kernels.linear import EXPERT_TILE_BYTES
    from deepinfer.regions.config import parse_config
    from deepinfer.regions.moe import MoE
    from deepinfer.regions.state import Geometry
    from deepinfer.regions.synthetic import synthetic_config
    from deepinfer.regions.topology import moe_tile

    c = parse_config(synthetic_config(experts=384)).text
    with torch.device("meta"):
        region = MoE(c, dtype=torch.bfloat16, topo=Topology(ep=64))
    assert region.w1.shape == (384, 36, 2560) and region.w2.shape == (384, 5120, 18)
    assert region.w2_s.shape == (384, 5120, 2)  # the 32-blocks a 36-column slice spans
    scratch = {}
    for rows in (1, 64):
        ep, _ = trace(region, rows, 1, Geometry(slots=2, blocks=2, block_size=16, max_blocks=1))
        scratch[rows] = budget.scratch_bytes(CpuTarget().lower(ep))
    one_slice, one_expert = 3 * 36 * 5120 * 4, 3 * 2304 * 5120 * 4  # w1, w3, w2 in float32
    assert scratch[1] <= 3 * 6 * one_slice < one_expert
    tiles, tile = region.gathered(64)["w1"], moe_tile(64, 6, 384)
    assert (tiles, tile) == (384, 8)
    codes = tiles * sum(math.prod(region.w(n).shape[1:]) for n in ("w1", "w1_s", "w3", "w3_s"))  # gathered, u8
    assert scratch[64] <= codes + tiles * tile * 5120 * 2 + 4 * EXPERT_TILE_BYTES


def test_paged_pools_hold_their_cp_ranks_share_of_the_blocks():
    """num_blocks counts a token group's blocks; each cp rank holds (num_blocks - 1) / cp of them and
    its own scratch block 0; at cp = 1, all of them (what the runtime allocates: test_breakdown_adds_up)."""
    from deepinfer.regions.state import Geometry, blocks_per_rank

    assert [blocks_per_rank(n, 1) for n in (2, 4, 21, 65537)] == [2, 4, 21, 65537]
    assert (blocks_per_rank(65537, 64), blocks_per_rank(4097, 64), blocks_per_rank(9, 4)) == (1025, 65, 3)
    with pytest.raises(ConfigError, match=r"8 blocks .* cp = 2 .*nearest valid: 7 or 9$"):
        blocks_per_rank(8, 2)
    pool = mf.Pool(state="ckv", dtype="bfloat16", dim="blocks", entry_shape=(8, 4), layers=(2, 3))
    win = dataclasses.replace(pool, state="win", dim="slots")
    g = Geometry(slots=3, blocks=65537, block_size=16, max_blocks=1)
    assert budget.pools_by_name({"ckv": pool, "win": win}, g) == {"ckv": 2 * 65537 * 64, "win": 2 * 3 * 64}
    assert budget.pools_by_name({"ckv": pool, "win": win}, g, cp=64) == {"ckv": 2 * 1025 * 64, "win": 2 * 3 * 64}
    assert budget.divided(pool, 64) and not budget.divided(pool, 1) and not budget.divided(win, 64)
