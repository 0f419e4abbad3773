"""A prompt chunk divided by rows as one execution a layer on trn2 (issue 41, compiler/rows_layers.py).

Real HLO modules on real XLA:CPU, one replica a rank; nothing of Trn2 or neuronx-cc. Two references:
- the compile's own check (`layers.check`): the module against its ops run eagerly per rank with the
  host's collectives;
- independent of the module's op list: the cpu runtime's divided step (`regions.step.rows_steps`,
  what `[prompt] rows = "divided"` runs per region call), each rank in a thread of its own with the
  collectives its `Rows` makes done on the host between them (an exchange with bounded waits), which
  tests/ranks/test_ranks.py ties to one rank's tokens.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

pytest.importorskip("torch_mlir", reason="the trn2 lowering needs the [trn2] extra (torch-mlir)")
pytest.importorskip("jax", reason="the trn2 lowering needs the [trn2] extra (jax, jaxlib)")

from deepinfer.bundles.manifest import BEST, DECODE, HEAD_ROWS, LAYER_ROWS, ROWS_SLOT
from deepinfer.compiler import layers, rows_layers
from deepinfer.compiler.config import load_compile_config
from deepinfer.compiler.pipeline import plan
from deepinfer.compiler.spec import parse
from deepinfer.compiler.targets import hlo
from deepinfer.compiler.weights import in_format
from deepinfer.regions import micro
from deepinfer.regions.examples import example_inputs, random_weights
from deepinfer.regions.state import InputSpec
from deepinfer.regions.step import Batch, rows_steps, run_rows_fused
from deepinfer.runtime import RunOptions, generate
from deepinfer.runtime.bundle import open_bundle

from ..conftest import _compile_tiny, write_model_toml
from .conftest import Exchange, finished_copy
from .test_neuron_ranks import _collective_calls_of, _execute_bytes

pytestmark = pytest.mark.xdist_group("rows-layers")  # one worker traces the modules for all of them
WORLD = 4  # cp = ep = 4: the rows over the four ranks
WAIT_S = 120  # a rank's wait for the others at a collective
DIVIDED = '\n[prompt]\nrows = "divided"\n'


def compiled(tmp_path, ckpt):
    toml = write_model_toml(
        tmp_path,
        ckpt,
        tiny_layers=6,
        target="trn2",
        executable="neff",
        options="{ lnc = 1, optlevel = 1 }",
        tokens=(1, 8),
        num_blocks=9,
        block_size=4,
        cache_quant=False,
        parallel=(1, WORLD, WORLD),
        extra=DIVIDED,
    )
    spec = parse(load_compile_config(toml), True, lambda msg: None)
    return spec, plan(spec, lambda msg: None)


@pytest.fixture(scope="module")
def divided(tmp_path_factory, tiny_ckpt):
    """(spec, plan, modules): the tiny model's trn2 plan at cp = ep = 4 with divided rows, and every
    layer kind's `rows` module and the head's module, traced (each checked on four XLA:CPU replicas
    against its ops, `layers.check`): (layer or HEAD_ROWS, method) -> (entry, HLO module bytes)."""
    tmp = tmp_path_factory.mktemp("rows-layers")
    spec, regions = compiled(tmp, tiny_ckpt)
    exes = spec.executables(regions)
    memo: layers.Lowered = {}
    modules = {}
    for name, lk in regions.fused_modules().items():
        for exe in (e for e in exes if e.kind == name and (e.method == LAYER_ROWS or name == HEAD_ROWS)):
            out = tmp / f"{exe.name}.hlo.pb"
            entry, _, _ = layers.trace(spec, regions, lk, exe, out, lambda msg: None, memo)
            for layer in lk.layers:
                modules[(HEAD_ROWS if name == HEAD_ROWS else layer, exe.method)] = entry, out.read_bytes()
    return spec, regions, modules


@pytest.mark.slow  # each layer kind's rows module lowered, compiled for 4 XLA:CPU replicas and run
def test_each_layer_kinds_rows_module_matches_its_ops_on_four_replicas(divided):
    """Every layer kind has a `rows` executable at the prompt bucket and its decode at the decode bucket
    only; its module runs the chunk as two micro-batches, holding each one's gathers and scatters over
    the four ranks, interleaved in the order the stages need them, and on one XLA:CPU replica a rank
    equals its ops run eagerly with the host's collectives."""
    spec, regions, modules = divided
    exes = spec.executables(regions)
    for name, lk in regions.fused_kinds().items():
        assert {(e.method, e.tokens) for e in exes if e.kind == name} == {(DECODE, 1), (LAYER_ROWS, 8)}
        entry, _ = modules[(lk.layers[0], LAYER_ROWS)]
        twin = regions.kinds[dict(lk.slots)[ROWS_SLOT]].region
        want = ["reduce_scatter kv"] if "engram" in dict(lk.slots) else []
        want += ["all_gather packed"]
        want += ["all_gather ckv_pages_mine", "all_gather ikeys_pages_mine"] if "rows_write" in twin.methods() else []
        want += ["all_gather x", "all_gather weights", "all_gather experts", "reduce_scatter partial"]
        # two micro-batches of 4 rows, one a rank: each collective of the one, then the other's
        micro = [f"{c}.{j}" for c in want for j in range(2)]
        assert [f"{c.op} {c.value}" for c in entry.collectives or ()] == micro, name
        assert entry.passes == 2, name
        assert entry.check is not None and entry.check["replicas"] == WORLD
        assert 0 < entry.check["max_abs"] and entry.check["score"] <= 1e-5, (name, entry.check)
        assert entry.outputs == tuple(rows_layers.outputs(lk, regions)), name
        h = next(s for s in entry.inputs if s.name == "h")
        assert h.shape[1] == 8 // WORLD, name  # a rank's rows of the chunk


@pytest.mark.slow  # the head's module at the prompt bucket, its decode and its best, on 4 XLA:CPU replicas
def test_the_heads_module_gathers_the_ranks_rows_then_runs_the_head(divided):
    """After the layers, the head is one module at the prompt bucket: the rank's rows of h and pre
    all-gathered along the rows, then the head's `decode` (this rank's vocabulary slice of every row)
    or `best` (their greedy pairs); on one XLA:CPU replica a rank it equals its ops run eagerly. The
    embedding is built at a rank's share of the prompt bucket's tokens too."""
    spec, regions, modules = divided
    exes = spec.executables(regions)
    assert {(e.method, e.tokens) for e in exes if e.kind == HEAD_ROWS} == {(DECODE, 8), (BEST, 8)}
    assert {e.tokens for e in exes if e.kind == "embed"} == {1, 8, 8 // WORLD}
    for method in (DECODE, BEST):
        entry, _ = modules[(HEAD_ROWS, method)]
        assert [f"{c.op} {c.value}" for c in entry.collectives or ()] == ["all_gather h", "all_gather pre"]
        assert entry.check is not None and entry.check["replicas"] == WORLD
        assert entry.check["score"] <= 1e-5, entry.check
        h = next(s for s in entry.inputs if s.name == "h")
        out = entry.output_specs[0]
        assert h.shape[:2] == (1, 8 // WORLD) and out.shape[:2] == (1, 8), method  # every row of the chunk out


# --- the modules driven as the runtime drives them, against the cpu runtime's divided step -----------


class HostRows:
    """`regions.step.Rows` as the host computes it over the exchange (what runtime.ranks.Comm does)."""

    def __init__(self, exchange: Exchange, rank: int):
        self.exchange, self.rank = exchange, rank

    def rows(self, t):
        return torch.cat(self.exchange.all(self.rank, t), 1)

    def pages(self, *parts):
        return [torch.stack(every) for every in zip(*self.exchange.all(self.rank, parts))]

    def routes(self, x, weights, experts):
        got = self.exchange.all(self.rank, (x, weights, experts))
        return tuple(torch.cat([g[i] for g in got], 1) for i in range(3))

    def combine(self, partial):
        return self.scatter(partial, "ep combine reduce-scatter")

    def scatter(self, partial, name):
        total = torch.stack([p.float() for p in self.exchange.all(self.rank, partial)]).sum(0)
        n = total.shape[1] // WORLD
        return total[:, self.rank * n : (self.rank + 1) * n]


class TableRows:
    """The engram's looked-up table rows, fixed per engram layer and chunk column (a test double of the
    host tables: the test's hashes are each row's column in the chunk)."""

    def __init__(self, rows: list):
        self.values = rows

    def rows(self, index, hashes):
        cols = hashes[0, :, 0]
        return tuple(t[:, cols] for t in self.values[index])


class Lockstep:
    """An `invoke_layer` per rank that runs each module once for every rank on XLA:CPU replicas (each
    rank hands its arguments over the exchange; rank 0 runs them); the state outputs written back into
    the rank's state tensors, as the device's aliased pools are."""

    def __init__(self, modules: dict, weights: dict, exchange: Exchange):
        self.modules, self.weights, self.exchange = modules, weights, exchange
        self.programs: dict = {}

    def invoke_layer(self, rank: int):
        def invoke_layer(layer, values, *, slot, method, chunk):
            key = (HEAD_ROWS, method) if slot == HEAD_ROWS else (layer, LAYER_ROWS)
            entry, proto = self.modules[key]
            weights = self.weights[-1 if slot == HEAD_ROWS else layer]
            args = [
                torch.tensor(rank) if s.role == "rank" else weights[s.name] if s.role == "weight" else values[s.name]
                for s in entry.inputs
            ]
            every = self.exchange.all(rank, [a.clone() for a in args])
            if rank == 0:  # each module compiled once for the replicas
                name = (entry.kind, entry.method)
                if name not in self.programs:
                    self.programs[name] = hlo.CpuReplicas(proto, WORLD)
                results = self.programs[name](every)
            outs = self.exchange.all(rank, results if rank == 0 else None)[0][rank]
            states = entry.state_outputs or ()
            for name, out in zip(states, outs):
                values[name].copy_(out)
            return dict(zip(entry.outputs, outs[len(states) :]))

        return invoke_layer


def _stored(region, seed: int) -> dict:
    return in_format(region.specs, random_weights(region, seed), region.fp8_format)


@pytest.mark.slow  # the rows modules and the head's lowered, compiled for 4 XLA:CPU replicas, run for two chunks
def test_the_modules_run_a_chunk_as_the_cpu_runtimes_divided_step(divided):
    """Two 8-token chunks of one prompt through every layer and the head, each rank its two rows: the
    runtime's `run_rows_fused` on the rows modules and the head's module (run in lockstep on four XLA:CPU
    replicas) gives every rank its slice of every row's logits, and its window rings, partial groups and
    paged pools, as `rows_steps` does with the stages as region calls and the host's collectives (the cpu
    runtime's divided step, which tests/ranks/test_ranks.py ties to one rank's tokens)."""

    spec, regions, modules = divided
    seeds = {kind: i for i, kind in enumerate(regions.kinds)}
    per_slot = {kind: _stored(kp.region, seeds[kind]) for kind, kp in regions.kinds.items() if kp.region.specs}
    weights = {  # each layer's module's weights by input name, the head module's at -1
        layer: {
            f"{slot}.{name}": t
            for slot, (kind, _) in regions.bindings[layer].items()
            for name, t in per_slot.get(kind, {}).items()
            if name != "rank"
        }
        for layer in regions.bindings
    }
    weights[-1] = {f"head.{name}": t for name, t in per_slot["head"].items() if name != "rank"}

    specs = {
        s.name: InputSpec(s.name, tuple(s.shape), getattr(torch, s.dtype), s.role)
        for m, _ in modules.values()
        for s in m.inputs
    }
    T, n = 8, 8 // WORLD
    B = specs["h"].shape[0]
    whole = [InputSpec(name, (B, T, *specs[name].shape[2:]), specs[name].dtype, "activation") for name in ("h", "pre")]
    chunks = [example_inputs(whole, spec.geometry, seed=c) for c in range(2)]  # each chunk's h, pre
    engrams = [p for p in regions.layers if p.engram_rows]
    tables = TableRows(
        [
            tuple(example_inputs([specs["rows"], specs["rows_s"]], spec.geometry, seed=7 + i))
            for i in range(len(engrams))
        ]
    )

    def batch(c: int) -> Batch:
        positions = (c * T + torch.arange(T)).unsqueeze(0)
        return Batch(
            tokens=torch.zeros(B, T, dtype=torch.int64),
            positions=positions,
            slots=torch.ones(B, dtype=torch.int64),
            # column k on cp rank k % 4, as its local block 1 + k // 4 (regions/divided.py; 0 the scratch)
            block_table=(1 + torch.arange(specs["block_table"].shape[1]) // WORLD).unsqueeze(0),
            hashes=torch.arange(T).view(1, T, 1, 1).expand(B, T, len(engrams), 1).clone(),
            is_image=torch.zeros(B, T, dtype=torch.bool),
        )

    def states():  # every rank's zeroed state, a layer's by name
        return [
            {
                layer: {
                    s.name: torch.zeros(s.shape, dtype=getattr(torch, s.dtype))
                    for s in entry.inputs
                    if s.role == "state"
                }
                for (layer, _), (entry, _) in modules.items()
                if layer != HEAD_ROWS
            }
            for _ in range(WORLD)
        ]

    fused_states, host_states = states(), states()
    exchange = Exchange(WORLD)
    lockstep = Lockstep(modules, weights, exchange)

    def fused(rank: int) -> list:
        own = micro.micro_rows(T, WORLD, rank, 2)  # the modules run two micro-batches: a rank's rows of each
        out = []
        invoke_layer = lockstep.invoke_layer(rank)
        for c, (h_all, pre_all) in enumerate(chunks):
            mine = (h_all[:, own], pre_all[:, own])
            h, pre = run_rows_fused(regions.layers, invoke_layer, fused_states[rank], *mine, batch(c), tables, own)
            head = invoke_layer(-1, {"h": h, "pre": pre}, slot=HEAD_ROWS, method=DECODE, chunk=T)
            out.append(head["logits"])
        return out

    def host(rank: int) -> list:
        own = slice(rank * n, (rank + 1) * n)
        mine = {
            layer: {
                slot: regions.kinds[kind].region.with_weights({**per_slot[kind], "rank": torch.tensor(rank)})
                for slot, (kind, _) in regions.bindings[layer].items()
                if slot in ("rows", "moe", "engram")
            }
            for layer in regions.bindings
        }
        head = regions.kinds["head"].region.with_weights({**per_slot["head"], "rank": torch.tensor(rank)})

        def invoke(layer, slot, *inputs, method=DECODE, chunk=None, whole=True):
            if (layer, slot) == (-1, "head"):
                return (head.decode(*inputs),)
            out = getattr(mine[layer][slot], method)(*inputs)
            return tuple(out) if isinstance(out, (tuple, list)) else (out,)

        rows = HostRows(exchange, rank)
        out = []
        for c, (h, pre) in enumerate(chunks):  # as the cpu runtime's two micro-batches
            parts = micro.split(batch(c), 2)
            steps = []
            for part, cols in parts:
                own = slice(rank * n // 2, (rank + 1) * n // 2)
                streams = h[:, cols][:, own], pre[:, cols][:, own]
                steps.append(rows_steps(regions.layers, invoke, host_states[rank], *streams, part, tables, rows, own))
            out.append(micro.join(batch(c), parts, micro.drive(steps, micro.now)))
        return out

    with torch.no_grad(), ThreadPoolExecutor(WORLD) as pool:
        got = list(pool.map(fused, range(WORLD), timeout=WAIT_S * 10))
        want = list(pool.map(host, range(WORLD), timeout=WAIT_S * 10))
    for rank in range(WORLD):
        for c in range(2):
            assert got[rank][c].shape == (B, T, want[rank][c].shape[-1])
            torch.testing.assert_close(got[rank][c], want[rank][c], rtol=1e-4, atol=1e-4)
        for layer, st in host_states[rank].items():
            for name, t in st.items():
                torch.testing.assert_close(
                    fused_states[rank][layer][name], t, rtol=1e-4, atol=1e-4, msg=f"{rank} {layer} {name}"
                )
                assert t.abs().sum() > 0 or name in ("part_kv", "part_gate"), (rank, layer, name)


# --- a session on the doubles: the ranks run a divided prompt one module a layer ----------------------


@pytest.fixture(scope="module")
def rows_bundle(tmp_path_factory, tiny_ckpt) -> Path:
    """The tiny model for trn2 at cp = ep = 2 with divided prompt rows, HLO-stage (unchecked: the tests
    above run the modules), finished by the stand-in neuronx-cc (TEST DOUBLE NEFFs)."""
    built = _compile_tiny(
        tmp_path_factory,
        "trn2-rows-cp2",
        tiny_ckpt,
        executable="neff",
        tokens=[1, 8],
        target="trn2",
        options="{ lnc = 1, check = false }",  # the modules' numbers: the tests above
        hlo_only=True,
        parallel=(1, 2, 2),
        num_blocks=9,
        block_size=4,
        extra=DIVIDED,
    )
    return finished_copy(built, tmp_path_factory.mktemp("trn2-rows") / "bundle")


@pytest.mark.slow
def test_a_two_rank_session_runs_a_divided_prompt_one_module_a_layer(rows_bundle, session_env):
    """deepinfer's launcher runs both ranks on the doubles: the prompt's 8-token chunk is one execution a
    layer of its kind's `rows` NEFF (the rows' gathers and scatters inside) and one of the head's module,
    each rank's embedding at its 4 rows; the two ranks' collective calls match one for one; and between
    the chunk's first layer and the next step's, a rank writes only the step's host inputs and reads back
    its slice of the head's output: no row of the streams crosses to the host."""
    m = open_bundle(rows_bundle).manifest
    rows = {e.kind: e for e in m.regions if e.method == LAYER_ROWS}
    assert rows and all(e.holds_collectives for e in rows.values()) and len(rows) == len({la.fused for la in m.layers})
    prompt = list(range(1, 9))  # one 8-token chunk
    done = generate(rows_bundle, [prompt], RunOptions(max_new_tokens=2, collective_timeout_s=60, timeout_s=600))
    assert done[0].error is None and len(done[0].tokens) == len(prompt) + 2
    stats = done.stats
    assert stats is not None and stats.prompt.steps == 1
    assert sum(n for k, n in stats.calls.items() if k.endswith(f".{LAYER_ROWS}")) == len(m.layers)
    assert stats.calls[f"{HEAD_ROWS}.{BEST}"] == 1 and stats.calls["embed"] == stats.steps  # greedy: its pairs
    calls = {r: _collective_calls_of(session_env, r) for r in range(2)}
    assert calls[0] == calls[1]
    executes = [c for c in calls[0] if c[0] == "nrt_execute"]
    assert len(executes) == len(m.layers) * stats.steps + 1  # the chunk's head module holds collectives too
    head = next(e for e in m.regions if e.kind == HEAD_ROWS and e.method == BEST)
    pairs = next(s for s in head.output_specs or () if s.name == BEST)
    n = len(m.layers)
    stream = next(s for s in next(iter(rows.values())).inputs if s.name == "h")  # a rank's rows of h
    stream_bytes = torch.Size(stream.shape).numel() * getattr(torch, stream.dtype).itemsize
    for r in range(2):
        sampled = _execute_bytes(session_env, r)
        assert len(sampled) == 2 * n + 1  # the chunk's layers and head, the decode step's layers
        (device0, host0), (device1, host1) = sampled[0], sampled[n + 1]
        assert host1 - host0 == 4 * torch.Size(pairs.shape).numel()  # the chunk's greedy pairs alone come back
        assert device1 - device0 < stream_bytes  # the steps' host inputs; no rank's rows of h go in
