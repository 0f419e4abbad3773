"""The divided engram's all-reduce inside its `kv` module (trn2, `layers = "regions"` with
`collectives = "graph"`): on one XLA:CPU replica a rank, every replica's keys and value are the sum of
the ranks' eager partials, float32 (no streams to cast to), and `mix` on them gives the one-rank engram.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.bundles.topology import Topology
from deepinfer.compiler.shard import shard
from deepinfer.compiler.targets import hlo
from deepinfer.compiler.targets.trn2 import Trn2Target
from deepinfer.compiler.trace import trace
from deepinfer.compiler.weights import in_format
from deepinfer.regions.checkpoint import Checkpoint, load_region
from deepinfer.regions.config import load_config
from deepinfer.regions.engram import Engram
from deepinfer.regions.examples import example_inputs
from deepinfer.regions.state import Geometry
from deepinfer.regions.topology import ENGRAM_KV, boundary_reduce

pytest.importorskip("torch_mlir")
xla_client = pytest.importorskip("jax._src.lib").xla_client

G = Geometry(slots=2, blocks=4, block_size=16, max_blocks=2)


def test_engram_all_reduce_in_the_kv_module_equals_the_host_sum(tmp_path, tiny_ckpt):
    c = load_config(tiny_ckpt).text
    topo = Topology(cp=4, ep=4)
    full = Engram(c, dtype=torch.float32)
    load_region(Checkpoint(tiny_ckpt), full, "layers.1.")
    stored = []
    for r in range(topo.world):
        region = Engram(c, dtype=torch.float32, topo=topo)
        weights = {
            s.name: shard("engram", s.name, getattr(full, s.name), c, topo, r, s.buffer_shape) for s in region.specs
        }
        stored.append({**in_format(region.specs, weights, region.fp8_format), "rank": torch.tensor(r)})
    regions = [Engram(c, dtype=torch.float32, topo=topo).with_weights(s) for s in stored]
    reduce = boundary_reduce("engram", ENGRAM_KV, topo)
    assert reduce == {"kv": [[0, 1, 2, 3]]}
    program, sig = trace(regions[0], 2, 1, G, ENGRAM_KV, dynamic=False)
    target = Trn2Target("neff", {})
    names = [s.name for s in sig.all]
    path = tmp_path / "engram.kv.hlo.pb"
    out = target.emit(target.lower(program), names, regions[0].kv_outputs(), path, reduce=reduce)
    assert out["reduced"] == reduce and out["output_specs"][0]["dtype"] == "float32"
    proto = path.read_bytes()
    assert xla_client.XlaComputation(proto).as_hlo_text().count(" all-reduce(") == 1
    rows, rows_s = example_inputs(sig.inputs, G, seed=3)
    n = len(names) - len(sig.inputs)
    flats = [[s[name] for name in names[:n]] + [rows.clone(), rows_s.clone()] for s in stored]
    got = hlo.CpuReplicas(proto, topo.world)(flats)
    with torch.no_grad():
        summed = torch.stack([r.kv(rows, rows_s) for r in regions]).sum(0)
    assert summed.abs().max() > 0
    for rank, (kv,) in enumerate(got):
        torch.testing.assert_close(kv, summed, rtol=1e-5, atol=1e-5, msg=f"rank {rank}")
    h = torch.randn(2, 1, c.hc_mult, c.hidden_size)
    mask = torch.ones(2, 1, dtype=torch.bool)
    want = full.decode(h, rows, rows_s, mask)
    torch.testing.assert_close(regions[0].mix(h, got[0][0], mask), want, rtol=1e-5, atol=1e-5)
