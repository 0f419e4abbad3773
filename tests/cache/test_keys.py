"""Cache keys: unambiguous, the same across processes, changed by every part, blind to log-only options."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import deepinfer.compiler.cache.artifact_keys as cached
from deepinfer.bundles.topology import Topology
from deepinfer.compiler.cache import keys
from deepinfer.compiler.cache.keys import KEYED_OPTIONS, UNKEYED_OPTIONS, Key, graph_digest
from deepinfer.compiler.config import SECTIONS, load_compile_config
from deepinfer.compiler.pipeline import cache_key, plan
from deepinfer.compiler.plan import Exe
from deepinfer.compiler.spec import Spec, parse
from deepinfer.compiler.targets import TARGETS
from deepinfer.compiler.targets.cpu import CpuTarget
from deepinfer.compiler.trace import trace
from deepinfer.regions.checkpoint import Checkpoint

from .conftest import write_toml

QUIET = dict(log=lambda msg: None)


@dataclasses.dataclass
class Build:
    """A parsed and planned model.toml, as the keys take it; `replace` swaps parts of the spec."""

    spec: Spec
    plan: object

    def replace(self, **changes) -> None:
        self.spec = dataclasses.replace(self.spec, **changes)

    @property
    def target(self):
        return self.spec.target


def trace_key(b: Build, kind: str, method: str, batch: int, tokens: int, context: int | None) -> Key:
    return cached.trace_key(b.spec, b.plan, Exe(kind, method, batch, tokens, context))


def executable_key(b: Build, kind, method, batch, tokens, context, graph: str, kernels: list[str]) -> Key:
    return cached.executable_key(b.spec, b.plan, Exe(kind, method, batch, tokens, context), graph, kernels)


def build(toml: Path) -> Build:
    spec = parse(load_compile_config(toml), False, QUIET["log"])
    return Build(spec, plan(spec, QUIET["log"]))


def test_parts_are_hashed_unambiguously():
    assert Key.of("k", "", [("a", b"bc")]).digest != Key.of("k", "", [("ab", b"c")]).digest
    assert Key.of("k", "", [("a", b"b"), ("c", b"")]).digest != Key.of("k", "", [("a", b""), ("c", b"b")]).digest
    assert Key.of("k", "", [("a", 1), ("b", 2)]).digest != Key.of("k", "", [("b", 2), ("a", 1)]).digest
    assert Key.of("k", "", [("a", 1)]).digest != Key.of("j", "", [("a", 1)]).digest
    assert Key.of("k", "x", [("a", {"y": 1, "z": 2})]).digest == Key.of("k", "y", [("a", {"z": 2, "y": 1})]).digest


KEYS_SCRIPT = """
import json, sys
from pathlib import Path
from deepinfer.compiler.cache.keys import graph_digest, kernels_reached
from deepinfer.compiler.cache import artifact_keys as cached
from deepinfer.compiler.config import load_compile_config
from deepinfer.compiler.pipeline import cache_key, parse, plan
from deepinfer.compiler.plan import Exe
from deepinfer.compiler.trace import trace
cfg = load_compile_config(sys.argv[1])
spec = parse(cfg, False, lambda m: None)
p = plan(spec, lambda m: None)
ep, _ = trace(p.kinds["head"].region, 1, 1, spec.geometry)
kernels = kernels_reached(ep)
exe = cached.executable_key(spec, p, Exe("head", "decode", 1, 1, None), graph_digest(spec.target.lower(ep)), kernels)
print(json.dumps({"bundle": cache_key(cfg, log=lambda m: None).digest, "executable": exe.digest,
                  "kernels": kernels}))
"""


def test_same_inputs_same_key_across_processes(small_toml):
    out = []
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        proc = subprocess.run(
            [sys.executable, "-c", KEYS_SCRIPT, str(small_toml)], env=env, capture_output=True, text=True, check=True
        )
        out.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert out[0] == out[1]
    assert out[0]["bundle"] == cache_key(load_compile_config(small_toml), **QUIET).digest
    assert out[0]["kernels"] == ["hc_collapse", "rmsnorm"]


EMIT_SCRIPT = """
import hashlib, sys
from pathlib import Path
from deepinfer.compiler.config import load_compile_config
from deepinfer.compiler.pipeline import parse, plan
from deepinfer.compiler.trace import trace
spec = parse(load_compile_config(sys.argv[1]), False, lambda m: None)
p = plan(spec, lambda m: None)
ep, _ = trace(p.kinds[sys.argv[2]].region, 1, 1, spec.geometry)
out = Path(sys.argv[3]) / f"{sys.argv[2]}.pt2"
spec.target.emit(spec.target.lower(ep), [], [], out)
print(hashlib.sha256(out.read_bytes()).hexdigest())
"""


def test_a_saved_program_is_the_same_bytes_in_every_process(small_toml, tmp_path):
    """An exported bundle's executables are its lowered programs as saved: two processes tracing the
    same region save the same bytes (issue 44 item 2; before, the nodes' provenance named graphs by
    their object ids and the archive held a random id, so every file differed)."""
    kind = "attn_window"
    digests = []
    for run in ("1", "2"):
        (tmp_path / run).mkdir()
        proc = subprocess.run(
            [sys.executable, "-c", EMIT_SCRIPT, str(small_toml), kind, str(tmp_path / run)],
            env=dict(os.environ, PYTHONHASHSEED=run),
            capture_output=True,
            text=True,
            check=True,
            timeout=600,
        )
        digests.append(proc.stdout.strip().splitlines()[-1])
    assert digests[0] == digests[1]
    assert (tmp_path / "1" / f"{kind}.pt2").read_bytes() == (tmp_path / "2" / f"{kind}.pt2").read_bytes()


# --- every part changes the key ---


def changed_part(base: Key, other: Key) -> list[str]:
    assert base.digest != other.digest
    a, b = base.part_hashes, other.part_hashes
    return [n for n in a if a[n] != b[n]]


@pytest.fixture(scope="module")
def planned(small_toml):
    return build(small_toml)


@pytest.fixture
def b(planned):
    """The planned small model; a test's changes to it stay in that test."""
    return Build(planned.spec, planned.plan)


EXE = dict(kind="head", method="decode", batch=1, tokens=1, context=None, graph="g" * 64, kernels=["rmsnorm"])

EXE_VARIANTS = {
    "format": lambda b, mp, kw: mp.setattr(cached, "format_part", lambda: {"bundle_format": 99, "cache": 1}),
    "graph": lambda b, mp, kw: kw.update(graph="h" * 64),
    "region": lambda b, mp, kw: kw.update(kind="moe"),  # another class, same method
    "bucket": lambda b, mp, kw: kw.update(tokens=2),
    "target": lambda b, mp, kw: mp.setattr(b.target, "options", {"cpp.simdlen": 8}),
    "toolchain": lambda b, mp, kw: mp.setattr(b.target, "toolchain", lambda: {"torch": "9.9"}),
    "kernels": lambda b, mp, kw: kw.update(kernels=["rmsnorm", "swiglu"]),
    "lowering": lambda b, mp, kw: mp.setattr(cached, "modules_digest", lambda names: {n: "x" for n in names}),
}


@pytest.mark.parametrize("part", list(EXE_VARIANTS))
def test_each_executable_key_part_changes_the_key(b, monkeypatch, part):
    base = executable_key(b, **EXE)
    assert [n for n, _ in base.parts] == list(EXE_VARIANTS)  # every part has a variant here
    kw = dict(EXE)
    EXE_VARIANTS[part](b, monkeypatch, kw)
    assert changed_part(base, executable_key(b, **kw)) == [part]


TRACE_VARIANTS = {
    "format": lambda b, mp, kw: mp.setattr(cached, "format_part", lambda: {"bundle_format": 99, "cache": 1}),
    # another method with the same inputs (a method's inputs are `<method>_inputs`, `decode`'s `input_specs`)
    "region": lambda b, mp, kw: (
        mp.setattr(
            type(b.plan.kinds[kw["kind"]].region),
            "prefill_inputs",
            lambda self, B, T, g: self.input_specs(B, T, g),
            raising=False,
        ),
        kw.update(method="prefill"),
    ),
    "bucket": None,  # the signature changes with it: tested below
    "geometry": lambda b, mp, kw: b.replace(geometry=dataclasses.replace(b.spec.geometry, blocks=99)),
    "model": lambda b, mp, kw: mp.setattr(type(b.spec.model), "digest", lambda self: "other"),
    "topology": lambda b, mp, kw: b.replace(topology=Topology(cp=2)),
    "fp8": lambda b, mp, kw: mp.setattr(b.plan.kinds["head"].region, "fp8_format", "e4m3"),
    "signature": lambda b, mp, kw: mp.setattr(b.plan.kinds["head"].region, "input_specs", lambda *a: []),
    "target": lambda b, mp, kw: mp.setattr(b.target, "options", {"cpp.simdlen": 8}),
    "toolchain": lambda b, mp, kw: mp.setattr(b.target, "toolchain", lambda: {"torch": "9.9"}),
    "sources": lambda b, mp, kw: mp.setattr(cached, "graph_sources", lambda m: {"deepinfer.kernels.norm": "x"}),
}


@pytest.mark.parametrize("part", [p for p, v in TRACE_VARIANTS.items() if v])
def test_each_trace_key_part_changes_the_key(b, monkeypatch, part):
    base = trace_key(b, "head", "decode", 1, 1, None)
    assert [n for n, _ in base.parts] == list(TRACE_VARIANTS)
    kw = dict(kind="head", method="decode", batch=1, tokens=1, context=None)
    TRACE_VARIANTS[part](b, monkeypatch, kw)
    assert changed_part(base, trace_key(b, **kw)) == [part]


def test_trace_key_bucket(b):
    base = trace_key(b, "head", "decode", 1, 1, None)
    assert changed_part(base, trace_key(b, "head", "decode", 1, 2, None)) == ["bucket", "signature"]


def test_trace_key_context_bucket(b):
    """A kind built per context bucket: another bucket is another name, bucket, geometry and signature
    (its block table); the executable key sees the bucket too."""
    base = trace_key(b, "attn_source_r2", "decode", 1, 1, 32)
    other = trace_key(b, "attn_source_r2", "decode", 1, 1, 16)
    assert base.identity.endswith("b1t1c32") and other.identity.endswith("b1t1c16")
    assert changed_part(base, other) == ["bucket", "geometry", "signature"]
    exe = dict(EXE, kind="attn_source_r2", context=32)
    assert changed_part(executable_key(b, **exe), executable_key(b, **dict(exe, context=16))) == ["bucket"]


WEIGHT_VARIANTS = {
    "format": lambda b, mp: mp.setattr(cached, "format_part", lambda: {"bundle_format": 99, "cache": 1}),
    "kind": None,  # another kind has other specs: tested below
    "layout": lambda b, mp: mp.setattr(b.plan.kinds["moe"], "layers", b.plan.kinds["moe"].layers[:-1]),
    "tensors": lambda b, mp: mp.setattr(cached, "tensor_digests", lambda ckpt, names, memo: {n: "x" for n in names}),
    "recipe": lambda b, mp: b.replace(
        config=dataclasses.replace(b.spec.config, quant=dataclasses.replace(b.spec.config.quant, recipe="e4m3"))
    ),
    "sources": lambda b, mp: mp.setattr(cached, "modules_digest", lambda names: {n: "x" for n in names}),
}


@pytest.mark.parametrize("part", [p for p, v in WEIGHT_VARIANTS.items() if v])
def test_each_weights_key_part_changes_the_key(b, monkeypatch, part):
    ckpt = Checkpoint(b.spec.config.model.checkpoint)
    base = cached.weights_key(b.spec, ckpt, "moe", b.plan.kinds["moe"])
    assert [n for n, _ in base.parts] == list(WEIGHT_VARIANTS)
    WEIGHT_VARIANTS[part](b, monkeypatch)
    assert part in changed_part(base, cached.weights_key(b.spec, ckpt, "moe", b.plan.kinds["moe"]))


# --- what the key sees: two explicit lists ---


def test_every_option_is_in_exactly_one_list():
    from deepinfer.compiler.cli import main

    assert not set(KEYED_OPTIONS) & set(UNKEYED_OPTIONS)
    toml_keys = {f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
    cli = {max(p.opts, key=len) for p in main.params if p.param_type_name == "option" and p.name != "help"}
    assert set(KEYED_OPTIONS) | set(UNKEYED_OPTIONS) == toml_keys | cli
    assert not set(CpuTarget.LOG_OPTIONS) - set(__import__("torch")._inductor.config.get_config_copy())


def test_the_keyed_list_is_all_the_bundle_key_sees_of_the_options(b, monkeypatch):
    """bundle_key's config part is KEYED_OPTIONS, option by option, in order: no second list of
    config fields. Dropping an option from the list drops it from the key; adding one adds it."""
    config = cached.config_part(b.spec)
    assert list(config) == list(KEYED_OPTIONS)
    assert set(cached.KEYED_VALUES) <= set(KEYED_OPTIONS)  # resolved values only for keyed options
    assert not [o for o, v in config.items() if isinstance(v, Path)]  # never a path

    def key(spec) -> str:
        return cached.bundle_key(spec, weights={}, host={}, traces={}, tokenizer={}).digest

    c = b.spec.config
    more_blocks = dataclasses.replace(b.spec, config=dataclasses.replace(c, kv=dataclasses.replace(c.kv, num_blocks=7)))
    assert key(more_blocks) != key(b.spec)
    monkeypatch.setattr(cached, "KEYED_OPTIONS", tuple(o for o in KEYED_OPTIONS if o != "kv.num_blocks"))
    assert "kv.num_blocks" not in cached.config_part(b.spec)
    assert key(more_blocks) == key(b.spec)
    monkeypatch.setattr(cached, "KEYED_OPTIONS", (*KEYED_OPTIONS, "memory.reserve_gib"))
    assert cached.config_part(b.spec)["memory.reserve_gib"] == c.memory.reserve_gib


def bundle_key(toml: Path) -> Key:
    return cache_key(load_compile_config(toml), **QUIET)


def test_unkeyed_options_do_not_change_the_key(small_toml, tmp_path, b):
    base = bundle_key(small_toml)
    ckpt = load_compile_config(small_toml).model.checkpoint
    logs = (
        "{"
        + ", ".join(
            f'"{o}" = {json.dumps("x" if o.endswith(("dir", "format")) else True)}' for o in CpuTarget.LOG_OPTIONS
        )
        + "}"
    )
    moved = write_toml(tmp_path / "elsewhere", ckpt, options=logs, extra='\n[cache]\ndir = "somewhere"\n')
    assert bundle_key(moved).digest == base.digest
    logged = build(moved)
    assert trace_key(logged, "head", "decode", 1, 1, None).digest == trace_key(b, "head", "decode", 1, 1, None).digest
    assert executable_key(logged, **EXE).digest == executable_key(b, **EXE).digest


KEYED_EDITS = {
    "model.dtype": ('dtype = "fp32"', 'dtype = "bf16"'),
    "model.cache_quant": ("cache_quant = true", "cache_quant = false"),
    "target.name": ('name = "cpu"', 'name = "cpu2"'),
    "target.executable": ('executable = "exported"', 'executable = "aoti"'),
    "target.options": ("options = {}", 'options = {"cpp.simdlen" = 8}'),
    "buckets.batch": ("batch = [1]", "batch = [1, 2]"),
    "buckets.tokens": ("tokens = [1]", "tokens = [1, 2]"),
    "buckets.max_context": ("max_context = 32", "max_context = 48"),
    "buckets.context": ("max_context = 32", "max_context = 32\ncontext = [16, 32]"),
    "buckets.prompt_batch": ("max_context = 32", "max_context = 32\nprompt_batch = [1]"),
    "kv.block_size": ("block_size = 16", "block_size = 32"),
    "kv.num_blocks": ("num_blocks = 5", "num_blocks = 6"),
}
# options with one valid value today: the key holds their value (config part)
SINGLE_VALUED: dict = {}
SECTION_EDITS = {
    "host.embedding": "[host]\nembedding = false",
    "parallel.tp": "[parallel]\ntp = 2",
    "parallel.ep": "[parallel]\nep = 2",
    "parallel.cp": "[parallel]\ncp = 2",
    "quant.recipe": '[quant]\nrecipe = "e4m3"',
    "speculative.draft": '[speculative]\ndraft = "dspark"',
}


@pytest.mark.parametrize(
    "option", [o for o in KEYED_OPTIONS if not o.startswith("model.checkpoint") and o != "model.tiny"]
)
def test_keyed_options_change_the_key(small_toml, tmp_path, monkeypatch, option):
    base = bundle_key(small_toml)
    if option in SINGLE_VALUED:
        [config] = [p for p in base.describe() if p["name"] == "config"]
        section, key = option.split(".")
        value = config["value"][section]
        assert (value[key] if isinstance(value, dict) else value) == SINGLE_VALUED[option]
        return
    if option == "--hlo-only":
        assert cache_key(load_compile_config(small_toml), hlo_only=True, **QUIET).digest != base.digest
        return
    if option == "prompt.rows":  # divided rows need cp > 1: against the same layout replicated
        ckpt, two = load_compile_config(small_toml).model.checkpoint, "[parallel]\nep = 2\ncp = 2\n"
        replicated = write_toml(tmp_path / "replicated", ckpt, extra=f"\n{two}")
        divided = write_toml(tmp_path / "divided", ckpt, extra=f'\n{two}\n[prompt]\nrows = "divided"\n')
        assert bundle_key(divided).digest != bundle_key(replicated).digest
        return
    if option in SECTION_EDITS:
        edited = write_toml(
            tmp_path / "section", load_compile_config(small_toml).model.checkpoint, extra=f"\n{SECTION_EDITS[option]}\n"
        )
        assert bundle_key(edited).digest != base.digest
        return
    monkeypatch.setitem(TARGETS, "cpu2", type("Cpu2", (CpuTarget,), {"name": "cpu2"}))
    old, new = KEYED_EDITS[option]
    text = small_toml.read_text()
    assert old in text
    edited = tmp_path / "model.toml"
    edited.write_text(text.replace(old, new, 1))
    assert bundle_key(edited).digest != base.digest


def test_checkpoint_contents_change_the_key(small_toml, tmp_path):
    """model.checkpoint and model.tiny are keyed by contents: a copy elsewhere keeps the key, another seed not."""
    import shutil

    ckpt = load_compile_config(small_toml).model.checkpoint
    copy = shutil.copytree(ckpt, tmp_path / "copy")
    base = bundle_key(small_toml).digest
    assert bundle_key(write_toml(tmp_path / "a", copy)).digest == base
    other = write_toml(tmp_path / "b", tmp_path / "seed1", extra="")
    other.write_text(other.read_text().replace("cache_quant = true", "cache_quant = true\ntiny = { seed = 1 }"))
    assert bundle_key(other).digest != base


# --- kernels ---


def test_kernel_source_closure_follows_helpers_only():
    from deepinfer.kernels import KERNELS

    gemm = keys.source_closure(KERNELS["blockquant_gemm"].reference).decode(errors="replace")
    assert "def dequant_fp8(" in gemm and "def dequant_fp4(" in gemm  # helpers in kernels/formats.py
    pool = keys.source_closure(KERNELS["compress_pool"].reference).decode(errors="replace")
    assert "def compress_pool_ref(" in pool and "def sparse_attn_ref(" not in pool  # same file, not reached


def test_a_kernel_change_reaches_only_graphs_calling_it(b, monkeypatch):
    from deepinfer.compiler.cache.keys import kernels_reached

    reached = {
        k: kernels_reached(trace(b.plan.kinds[k].region, 1, 1, b.spec.geometry)[0]) for k in ("head", "attn_source_r2")
    }
    assert "compress_pool" in reached["attn_source_r2"] and "compress_pool" not in reached["head"]
    before = {k: executable_key(b, k, "decode", 1, 1, None, "g", ks).digest for k, ks in reached.items()}
    closure = keys.source_closure
    monkeypatch.setattr(
        keys, "source_closure", lambda fn: closure(fn) + (b"# changed" if fn.__name__ == "compress_pool_ref" else b"")
    )
    after = {k: executable_key(b, k, "decode", 1, 1, None, "g", ks).digest for k, ks in reached.items()}
    assert after["head"] == before["head"] and after["attn_source_r2"] != before["attn_source_r2"]


def test_a_tensor_edited_in_place_with_size_and_mtime_restored_is_hashed_again(tmp_path):
    """As `rsync -t --inplace` or `touch -r` leave a file: same path, inode, size and mtime."""
    import torch
    from safetensors.torch import save_file

    path, memo = tmp_path / "w.safetensors", cached.Memo(tmp_path / "memo")
    save_file({"w": torch.zeros(64)}, str(path))
    before = cached._file_digests(path, memo)
    st = os.stat(path)
    for _ in range(200):  # ctime ticks at the kernel's clock granularity (<= 10 ms)
        with open(path, "r+b") as f:  # in place: one byte of the tensor's data
            f.seek(-1, os.SEEK_END)
            f.write(b"\x01")
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        if os.stat(path).st_ctime_ns != st.st_ctime_ns:
            break
        time.sleep(0.01)
    now = os.stat(path)
    assert (now.st_ino, now.st_size, now.st_mtime_ns) == (st.st_ino, st.st_size, st.st_mtime_ns)
    assert cached._file_digests(path, memo)["w"] != before["w"]


def test_an_aoti_key_names_the_threads_its_code_is_written_for(small_toml, tmp_path, monkeypatch):
    """Inductor writes the compile's thread count into an AOTInductor package (its OpenMP loops): two
    compiles at different counts give different bytes, so the count is in the key (issue 44 item 2);
    `cpp.threads` pins it whatever the host's, and an exported program does not depend on it."""
    ckpt = load_compile_config(small_toml).model.checkpoint
    aoti = write_toml(tmp_path / "aoti", ckpt, extra="")
    aoti.write_text(aoti.read_text().replace('executable = "exported"', 'executable = "aoti"'))
    pinned = write_toml(tmp_path / "pinned", ckpt, options='{"cpp.threads" = 3}')
    pinned.write_text(pinned.read_text().replace('executable = "exported"', 'executable = "aoti"'))
    keys = {}
    for threads in (1, 2):
        monkeypatch.setattr("torch.get_num_threads", lambda n=threads: n)
        keys[threads] = (bundle_key(aoti).digest, bundle_key(pinned).digest, bundle_key(small_toml).digest)
        assert TARGETS["cpu"]("aoti", {}).toolchain()["threads"] == str(threads)
        assert TARGETS["cpu"]("aoti", {"cpp.threads": 3}).toolchain()["threads"] == "3"
    assert keys[1][0] != keys[2][0]
    assert keys[1][1:] == keys[2][1:]


class _ScaledByAConstant(torch.nn.Module):
    def __init__(self, scale: float):
        super().__init__()
        self.scale = torch.tensor(scale)  # not a parameter or buffer: export lifts it as a 0-d constant

    def forward(self, x):
        return x * self.scale


def test_graph_digest_hashes_a_zero_dimensional_constant():
    """A 0-d float constant (the trn2 fused layers hold one) is hashed by its bytes: no view error."""
    x = (torch.ones(3),)
    a, b = (torch.export.export(_ScaledByAConstant(s), x) for s in (2.0, 3.0))
    assert any(t.dim() == 0 for t in a.constants.values())
    assert graph_digest(a) == graph_digest(torch.export.export(_ScaledByAConstant(2.0), x))
    assert graph_digest(a) != graph_digest(b)
