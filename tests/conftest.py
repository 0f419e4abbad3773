"""Shared fixtures: one tiny checkpoint per test session, tool caches kept in the project."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache"
# AOTInductor writes a large precompiled header under TMPDIR and caches under
# TORCHINDUCTOR_CACHE_DIR: keep both inside the project's ignored .cache/.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(CACHE / "inductor"))
os.environ.setdefault("TMPDIR", str(CACHE / "tmp"))
# deepinfer's artifact cache: never the user's ~/.cache (tests needing isolation pass their own).
CACHE_ENV = "DEEPINFER_CACHE_DIR"
os.environ.setdefault(CACHE_ENV, str(CACHE / "deepinfer-test"))
(CACHE / "tmp").mkdir(parents=True, exist_ok=True)
# Under pytest-xdist, the workers share the cores: each gets its share of threads (torch's
# default, one per core in every worker, oversubscribed 2 cores about 10x on reference tests:
# the fast run went from 152 s to 74 s). An OMP_NUM_THREADS the caller sets wins; results
# do not depend on the thread count (docs/testing.md).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))


def _load_regenerate():
    """tests/golden/regenerate.py (a script: the goldens, and `check_run` that holds runs to them)."""
    spec = importlib.util.spec_from_file_location("regenerate", ROOT / "tests" / "golden" / "regenerate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


regenerate = _load_regenerate()


# Fixtures that compile bundles, by group, heaviest first. A test using one is `slow` (the fast run,
# -m "not slow", skips it) and belongs to that group: with `pytest -n 2 --dist loadgroup` one worker
# runs a group's tests, so each bundle is compiled once; fixtures compile through one shared
# artifact cache, so a bundle two groups need is compiled by one worker and fetched by the other.
GROUPS = {
    "aoti_bundle": "aoti",
    # the farm's tests start a Ray cluster; one compiles aoti_bundle again on it, so they share its worker
    "ray_cluster": "aoti",
    "run_aoti_bundle": "aoti",
    "rank_bundle": "ranks",
    "started_ranks": "ranks",
    "one_rank_loaded": "ranks",
    "run_exported_bundle": "run",
    "structured_bundle": "structured",
    "exported_bundle": "exported",
    "exported_bundle_12": "exported",
    "trn2_hlo_bundle": "trn2",
    "trn2_hlo_compile": "trn2",
    "trn2_ep2_bundle": "trn2",
    "filled": "cache",
    "cache_copy": "cache",
    "e4m3_bundle": "recipes",
    "v3_bundle": "recipes",
}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(items):
    for item in items:
        params = getattr(item, "callspec", None)
        named = {v for v in params.params.values() if isinstance(v, str)} if params else set()
        used = set(getattr(item, "fixturenames", ())) | named
        groups = [g for f, g in GROUPS.items() if f in used]  # a fixture, or its name as a parameter
        if groups:
            item.add_marker(pytest.mark.slow)
            # a module may run as a group of its own (`XDIST_GROUP`): its bundles are then fetched from
            # the shared artifact cache by whichever worker comes second, and the two halves of a long
            # group run on both workers
            item.add_marker(pytest.mark.xdist_group(getattr(item.module, "XDIST_GROUP", groups[0])))


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    """The seed-0, 6-layer tiny checkpoint (generated once per session)."""
    from deepinfer.regions.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("ckpt") / "tiny")


@pytest.fixture(scope="session")
def ref_fp32(tiny_ckpt):
    from deepinfer.regions.reference import ReferenceModel

    return ReferenceModel(tiny_ckpt, dtype="fp32", cache_quant=True, ties="lowest")  # as bundles compute


# --- compiled bundles (session-scoped: an AOTInductor compile costs ~15 s per executable) ---


def write_model_toml(
    directory: Path,
    checkpoint: Path,
    *,
    tiny_layers: int | None = None,
    cache_quant: bool = True,
    target: str = "cpu",
    executable: str | None = None,
    options: str = "{}",
    batch: tuple = (1,),
    tokens: tuple = (1,),
    max_context: int = 32,
    context: tuple | None = None,
    num_blocks: int = 4,
    block_size: int = 16,
    parallel: tuple[int, int, int] = (1, 1, 1),
    extra: str = "",
    extra_buckets: str = "",
) -> Path:
    """A small fp32 model.toml for `checkpoint` in `directory` (created); returns its path.

    `tiny_layers`: generate the tiny checkpoint there when absent. Sections the defaults
    leave out (executable, context buckets, [parallel] at one rank) are not written; `extra` is appended,
    `extra_buckets` (lines) added to [buckets].
    """
    directory.mkdir(parents=True, exist_ok=True)
    model = f"tiny = {{ seed = 0, layers = {tiny_layers} }}\n" if tiny_layers else ""
    exe = f'executable = "{executable}"\n' if executable else ""
    contexts = f"context = {list(context)}\n" if context else ""
    ranks = "" if tuple(parallel) == (1, 1, 1) else "\n[parallel]\ntp = {}\nep = {}\ncp = {}\n".format(*parallel)
    path = directory / "model.toml"
    path.write_text(f"""[model]
checkpoint = "{checkpoint}"
{model}dtype = "fp32"
cache_quant = {str(cache_quant).lower()}

[target]
name = "{target}"
{exe}options = {options}

[buckets]
batch = {list(batch)}
tokens = {list(tokens)}
max_context = {max_context}
{contexts}{extra_buckets}
[kv]
block_size = {block_size}
num_blocks = {num_blocks}
{ranks}{extra}""")
    return path


def _compile_tiny(
    tmp_path_factory,
    name: str,
    checkpoint: Path,
    *,
    executable: str,
    tokens: list[int],
    layers: int = 6,
    batch: tuple = (1,),
    max_context: int = 32,
    context: tuple | None = None,
    num_blocks: int = 4,
    block_size: int = 16,
    cache_quant: bool = True,
    target: str = "cpu",
    options: str = "{}",
    hlo_only: bool = False,
    parallel: tuple[int, int, int] = (1, 1, 1),
    extra: str = "",
    extra_buckets: str = "",
) -> Path:
    """Write a small model.toml for `checkpoint` and compile it; returns the bundle directory.

    `checkpoint` that does not exist yet is generated by the compiler (`tiny = {layers = N}`).
    """
    from deepinfer.compiler.cache.local import Cache
    from deepinfer.compiler.config import load_compile_config
    from deepinfer.compiler.pipeline import compile_bundle

    root = tmp_path_factory.mktemp(name)
    toml = write_model_toml(
        root,
        checkpoint,
        tiny_layers=layers,
        cache_quant=cache_quant,
        target=target,
        executable=executable,
        options=options,
        batch=batch,
        tokens=tokens,
        max_context=max_context,
        context=context,
        num_blocks=num_blocks,
        block_size=block_size,
        parallel=parallel,
        extra=extra,
        extra_buckets=extra_buckets,
    )
    return compile_bundle(
        load_compile_config(toml),
        root / "bundle",
        jobs=2,
        log=lambda msg: None,
        hlo_only=hlo_only,
        cache=Cache(Path(os.environ[CACHE_ENV])),
    ).bundle


@pytest.fixture(scope="session")
def aoti_bundle(tmp_path_factory, tiny_ckpt) -> Path:
    """The 6-layer tiny model as AOTInductor packages, bucket batch 4 x tokens 1 (8 executables).

    The one AOTInductor bundle of the suite (compile and runtime tests share it): room for
    the golden prompts (73 positions) at batch 4; one prompt runs padded to the batch of 4
    (the exported bundles cover several batch buckets; each AOTInductor executable costs
    ~15 s of C++ compile). Without cache quantization: it feeds
    prompts one token a step, and with quantization one last-bit difference from the
    golden's one-chunk prompt can cross an fp8 rounding boundary and change later tokens
    (measured); the exported bundle covers cache quantization.
    """
    return _compile_tiny(
        tmp_path_factory,
        "aoti",
        tiny_ckpt,
        executable="aoti",
        tokens=[1],
        batch=(4,),
        max_context=80,
        num_blocks=21,
        cache_quant=False,
    )


@pytest.fixture(scope="session")
def exported_bundle(tmp_path_factory, tiny_ckpt) -> Path:
    """The 6-layer tiny model as saved ExportedPrograms, buckets (1, 1) and (1, 2)."""
    return _compile_tiny(tmp_path_factory, "exported6", tiny_ckpt, executable="exported", tokens=[1, 2])


SYNTHETIC_TOKENIZER = ROOT / "tests" / "golden" / "synthetic_tokenizer"


def with_synthetic_tokenizer(ckpt: Path) -> Path:
    """Give a tiny checkpoint the synthetic tokenizer of tests/golden/ (288 ids, the tiny vocabulary's
    layout) and the engram_compressed_vocab_size it normalises to (NeMo's count, from the golden)."""
    import json
    import shutil

    from deepinfer.bundles.layout import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE

    for name in (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE):
        shutil.copyfile(SYNTHETIC_TOKENIZER / name, ckpt / name)
    count = json.loads((ROOT / "tests" / "golden" / "nemo_engram_map.json").read_text())["count"]
    config = json.loads((ckpt / "config.json").read_text())
    config["text_config"]["engram_compressed_vocab_size"] = count
    (ckpt / "config.json").write_text(json.dumps(config, indent=1))
    return ckpt


@pytest.fixture(scope="session")
def tiny12_ckpt(tmp_path_factory) -> Path:
    """A 12-layer tiny checkpoint carrying the synthetic tokenizer (`with_synthetic_tokenizer`)."""
    from deepinfer.regions.tiny import make_tiny

    return with_synthetic_tokenizer(make_tiny(tmp_path_factory.mktemp("ckpt12") / "tiny12", layers=12))


@pytest.fixture(scope="session")
def exported_bundle_12(tmp_path_factory, tiny12_ckpt) -> Path:
    """`tiny12_ckpt` as saved ExportedPrograms, bucket (1, 1) only: 12 layers, and a release-style
    tokenizer with engram's compressed token map in the bundle."""
    return _compile_tiny(tmp_path_factory, "exported12", tiny12_ckpt, executable="exported", tokens=[1], layers=12)


@pytest.fixture(scope="session")
def trn2_hlo_compile(tmp_path_factory, tiny_ckpt) -> tuple[Path, str]:
    """The 6-layer tiny model for trn2 as an HLO-stage bundle, bucket (1, 1), built by
    `deepinfer-compile --hlo-only --json` (the shared artifact cache): every region kind lowered
    to HLO and checked on XLA:CPU against its reference region (9 HLO modules). Returns the
    bundle and what the command printed (its progress and summary lines, then the JSON)."""
    from click.testing import CliRunner

    from deepinfer.compiler.cli import main

    root = tmp_path_factory.mktemp("trn2")
    toml = write_model_toml(
        root, tiny_ckpt, tiny_layers=6, target="trn2", executable="neff", options="{ lnc = 1, optlevel = 1 }"
    )
    result = CliRunner().invoke(
        main,
        [
            str(toml),
            "-o",
            str(root / "bundle"),
            "--jobs",
            "2",
            "--hlo-only",
            "--json",
            "--cache-dir",
            os.environ[CACHE_ENV],
        ],
    )
    assert result.exit_code == 0, result.output
    return root / "bundle", result.output


@pytest.fixture(scope="session")
def trn2_hlo_bundle(trn2_hlo_compile) -> Path:
    """The tiny trn2 HLO-stage bundle of `trn2_hlo_compile`."""
    return trn2_hlo_compile[0]


@pytest.fixture(scope="session")
def trn2_ep2_bundle(tmp_path_factory, tiny_ckpt) -> Path:
    """The tiny model for trn2 at ep = 2 (EP dispatch, two ranks), HLO-stage: each layer one module
    holding its dispatch collectives (compiler/layers.py), checked on two XLA:CPU replicas."""
    return _compile_tiny(
        tmp_path_factory,
        "trn2-fused-ep2",
        tiny_ckpt,
        executable="neff",
        tokens=[1],
        target="trn2",
        options="{ lnc = 1 }",
        hlo_only=True,
        parallel=(1, 2, 1),
    )


# the layouts the speculative rank tests run (tests/ranks/test_speculative_ranks.py): compiled with the
# checkpoint's DSpark draft and a batch bucket of 2 (two sequences a token group), their blocks for it
SPECULATIVE_LAYOUTS = ((1, 2, 1), (1, 4, 4), (2, 4, 2))


@pytest.fixture(scope="session")
def rank_bundle(tmp_path_factory, tiny_ckpt):
    """(tp, ep, cp) -> the tiny model compiled for that topology as saved ExportedPrograms
    (buckets batch 1, tokens {1, 8}, and 4 with divided rows: an 8-token chunk's micro-batches
    (regions/micro.py); no cache quantization, so token comparisons are exact; blocks of
    4 positions, contexts of 48 and 160, 40 usable blocks: a prompt of 33 blocks, 8 on each of 4 cp
    ranks, fits). The `SPECULATIVE_LAYOUTS` also hold the DSpark draft, at batch buckets {1, 2} with 80
    usable blocks. `rows` "divided": a prompt chunk's rows divided over the token group ([prompt] rows)."""
    built: dict[tuple, Path] = {}

    def get(tp: int = 1, ep: int = 1, cp: int = 1, rows: str = "replicated") -> Path:
        key = (tp, ep, cp)
        speculative = key in SPECULATIVE_LAYOUTS and rows == "replicated"  # divided rows: no draft yet
        extra = '\n[speculative]\ndraft = "dspark"\n' if speculative else ""
        if rows != "replicated":
            extra += f'\n[prompt]\nrows = "{rows}"\n'
        if (*key, rows) not in built:
            built[(*key, rows)] = _compile_tiny(
                tmp_path_factory,
                f"ranks{tp}{ep}{cp}{rows[0]}",
                tiny_ckpt,
                executable="exported",
                batch=(1, 2) if speculative else (1,),
                tokens=[1, 4, 8] if rows == "divided" else [1, 8],  # divided: 8-token chunks as two micro-batches
                max_context=160,
                context=(48, 160),
                num_blocks=81 if speculative else 41,
                block_size=4,
                cache_quant=False,
                parallel=key,
                extra=extra,
            )
        return built[(*key, rows)]

    return get


@pytest.fixture(scope="session")
def one_rank_loaded(rank_bundle):
    """The one-rank `rank_bundle()` loaded once in this process (`runtime.load`): the reference the rank
    tests hold their runs to (generating on a loaded executor many times is `runtime.generate`'s own)."""
    from deepinfer.runtime import load

    executor = load(rank_bundle())
    yield executor
    executor.close()


@pytest.fixture(scope="session")
def started_ranks(rank_bundle):
    """(tp, ep, cp) -> that `rank_bundle`'s processes started and loaded once (runtime/launch.py, one
    thread a rank), shared by every rank test that only generates on them; ended at the session's end.
    Tests of how ranks start, serve, fail or are killed start their own."""
    from deepinfer.runtime import LoadOptions, open_bundle
    from deepinfer.runtime.launch import Ranks, start

    started: dict[tuple, Ranks] = {}

    def get(tp: int = 1, ep: int = 1, cp: int = 1, rows: str = "replicated") -> Ranks:
        key = (tp, ep, cp, rows)
        if key not in started:
            started[key] = start(open_bundle(rank_bundle(*key)), LoadOptions(threads=1))
        return started[key]

    yield get
    for ranks in started.values():
        ranks.close()
