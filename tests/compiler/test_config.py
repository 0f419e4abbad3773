"""model.toml errors: one test per error class, each naming the file, the key and its line.

The message format is `path:LINE: section.key: what is wrong` (one line); the
CLI prints it after `error: ` and exits with status 2.
"""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from deepinfer.compiler.cli import main as compile_cli
from deepinfer.compiler.config import load_compile_config
from deepinfer.errors import ConfigError, DeepinferError

BASE = """\
# a valid model.toml for the tiny model
[model]
checkpoint = "checkpoint"
dtype = "fp32"
cache_quant = true

[target]
name = "cpu"
executable = "exported"

[buckets]
batch = [1, 2]
tokens = [1, 4]
max_context = 32

[kv]
block_size = 16
num_blocks = 8

[parallel]
tp = 1
ep = 1
cp = 1
"""


def write(tmp_path, text: str, old: str | None = None, new: str | None = None):
    """BASE (or `text`) with `old` replaced by `new`, written to model.toml -> (path, line of `new`)."""
    if old is not None:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    path = tmp_path / "model.toml"
    path.write_text(text)
    line = next((i for i, s in enumerate(text.splitlines(), 1) if new and new.splitlines()[-1] in s), None)
    return path, line


def config_error(path) -> str:
    with pytest.raises(ConfigError) as e:
        load_compile_config(path)
    message = str(e.value)
    assert "\n" not in message, "a config error is one line"
    return message


def test_base_is_valid(tmp_path):
    path, _ = write(tmp_path, BASE)
    cfg = load_compile_config(path)
    assert cfg.model.checkpoint == tmp_path / "checkpoint"  # relative to the file
    assert cfg.buckets.shapes() == [(1, 1), (1, 4), (2, 1), (2, 4)]
    assert issubclass(ConfigError, DeepinferError)  # what the CLI turns into exit 2


# (test id, old text, new text, `section.key` named, fragments the message must hold)
CASES = [
    (
        "unknown_key",
        'dtype = "fp32"',
        'dtype = "fp32"\ncolour = "red"',
        "model.colour",
        ["unknown key", "checkpoint, dtype, cache_quant, tiny"],
    ),
    (
        "unknown_key_nested",
        'dtype = "fp32"',
        "tiny = { seed = 0, layer = 6 }",
        "model.tiny",
        ["unknown key 'layer'", "seed, layers"],
    ),
    ("wrong_type_int", "max_context = 32", 'max_context = "32"', "buckets.max_context", ["expected int", "'32'"]),
    ("wrong_type_list", "batch = [1, 2]", "batch = 2", "buckets.batch", ["expected a list of integers", "2"]),
    ("wrong_type_bool", "cache_quant = true", 'cache_quant = "yes"', "model.cache_quant", ["expected bool"]),
    ("dtype", 'dtype = "fp32"', 'dtype = "fp16"', "model.dtype", ["'fp16'", "fp32, bf16"]),
    ("tokens_without_1", "tokens = [1, 4]", "tokens = [2, 4]", "buckets.tokens", ["must include 1"]),
    (
        "max_context_below_tokens",
        "max_context = 32",
        "max_context = 2",
        "buckets.max_context",
        ["largest tokens bucket (4)"],
    ),
    (
        "context_type",
        "max_context = 32",
        "max_context = 32\ncontext = 16",
        "buckets.context",
        ["expected a list of integers"],
    ),
    (
        "context_not_ascending",
        "max_context = 32",
        "max_context = 32\ncontext = [32, 16]",
        "buckets.context",
        ["ascending", "got [32, 16]"],
    ),
    (
        "context_repeated",
        "max_context = 32",
        "max_context = 32\ncontext = [16, 16, 32]",
        "buckets.context",
        ["ascending", "got [16, 16, 32]"],
    ),
    (
        "context_last_not_max",
        "max_context = 32",
        "max_context = 32\ncontext = [16]",
        "buckets.context",
        ["the last equal to max_context (32)", "got [16]"],
    ),
    (
        "context_not_block_multiple",
        "max_context = 32",
        "max_context = 32\ncontext = [8, 32]",
        "buckets.context",
        ["a multiple of [kv] block_size (16)", "got [8, 32]"],
    ),
    ("context_empty", "max_context = 32", "max_context = 32\ncontext = []", "buckets.context", ["got []"]),
    ("num_blocks_too_small", "num_blocks = 8", "num_blocks = 4", "kv.num_blocks", ["4 blocks", "need at least 5"]),
    ("unknown_target", 'name = "cpu"', 'name = "trn3"', "target.name", ["'trn3'", "valid: cpu"]),
    (
        "executable_not_built_by_target",
        'executable = "exported"',
        'executable = "neff"',
        "target.executable",
        ["'neff'", "aoti, exported"],
    ),
    (
        "inductor_option_unknown",
        'executable = "exported"',
        'executable = "aoti"\noptions = { "cpp.simd_len" = 8 }',
        "target.options",
        ["unknown Inductor option 'cpp.simd_len'"],
    ),
    (
        "inductor_option_type",
        'executable = "exported"',
        'executable = "aoti"\noptions = { "cpp.simdlen" = "8" }',
        "target.options",
        ["Inductor option 'cpp.simdlen' = \"8\" is a TOML string", "expects int | None"],
    ),
    (
        "inductor_option_bool_for_int",
        'executable = "exported"',
        'executable = "aoti"\noptions = { "cpp.threads" = true }',
        "target.options",
        ["'cpp.threads' = true is a TOML boolean", "expects int"],
    ),
    ("parallel_tp", "tp = 1", "tp = 0", "parallel.tp", ["must be at least 1"]),
    ("parallel_ep", "ep = 1", "ep = -2", "parallel.ep", ["must be at least 1"]),
    ("parallel_cp", "cp = 1", "cp = true", "parallel.cp", ["expected int"]),
    (
        "speculative_unknown_draft",
        "cp = 1",
        'cp = 1\n\n[speculative]\ndraft = "eagle"',
        "speculative.draft",
        ["'eagle'", "valid: dspark"],
    ),
    (
        "prompt_batch_not_a_batch_bucket",
        "max_context = 32",
        "max_context = 32\nprompt_batch = [4]",
        "buckets.prompt_batch",
        ["distinct values of [buckets] batch [1, 2]", "got [4]"],
    ),
    (
        "prompt_batch_with_a_draft",
        "[buckets]",
        '[speculative]\ndraft = "dspark"\n\n[buckets]\nprompt_batch = [1]',
        "buckets.prompt_batch",
        ["verify steps"],
    ),
    (
        "prompt_rows_unknown",
        "cp = 1",
        'cp = 1\n\n[prompt]\nrows = "halved"',
        "prompt.rows",
        ["'halved'", "replicated, divided"],
    ),
    (
        "prompt_rows_one_rank",
        "cp = 1",
        'cp = 1\n\n[prompt]\nrows = "divided"',
        "prompt.rows",
        ["cp > 1, tp = 1 and ep = cp", "got tp = 1, ep = 1, cp = 1"],
    ),
    (
        "prompt_rows_bucket",
        "ep = 1\ncp = 1",
        'ep = 3\ncp = 3\n\n[prompt]\nrows = "divided"',
        "prompt.rows",
        ["a multiple of cp = 3", "[4] are not"],
    ),
]


@pytest.mark.parametrize("old, new, name, fragments", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_config_error_names_file_key_and_line(tmp_path, old, new, name, fragments):
    path, line = write(tmp_path, BASE, old, new)
    message = config_error(path)
    assert message.startswith(f"{path}:{line}: {name}: "), message
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def test_prompt_batch_leaves_out_the_wide_buckets_of_other_batches(tmp_path):
    """[buckets] prompt_batch = [1]: steps of more than one token only at batch 1; decode at every batch."""
    path, _ = write(tmp_path, BASE)
    assert load_compile_config(path).buckets.shapes() == [(1, 1), (1, 4), (2, 1), (2, 4)]
    path, _ = write(tmp_path, BASE, "max_context = 32", "max_context = 32\nprompt_batch = [1]")
    assert load_compile_config(path).buckets.shapes() == [(1, 1), (1, 4), (2, 1)]


def test_context_buckets_default_to_max_context(tmp_path):
    path, _ = write(tmp_path, BASE)
    assert load_compile_config(path).buckets.context == (32,)
    path, _ = write(tmp_path, BASE, "max_context = 32", "max_context = 48\ncontext = [16, 32, 48]")
    assert load_compile_config(path).buckets.context == (16, 32, 48)


def test_unknown_section(tmp_path):
    path, line = write(tmp_path, BASE + "\n[extra]\nx = 1\n", "[extra]", "[extra]")
    message = config_error(path)
    assert message.startswith(f"{path}:{line}: [extra]: unknown section"), message
    assert "model, target, buckets, kv, parallel, quant, host, cache" in message


def test_missing_model_section(tmp_path):
    path, _ = write(
        tmp_path,
        BASE.split("[target]")[0]
        .replace("[model]", "[cache]")
        .replace('checkpoint = "checkpoint"\ndtype = "fp32"\ncache_quant = true', 'dir = "c"'),
    )
    assert config_error(path) == f"{path}: missing required section [model]"


def test_invalid_toml_syntax(tmp_path):
    path, line = write(tmp_path, BASE, "tp = 1", "tp = = 1")
    message = config_error(path)
    assert message.startswith(f"{path}:{line}: not valid TOML"), message
    assert f"line {line}" in message, message


def test_missing_file(tmp_path):
    path = tmp_path / "nope.toml"
    assert config_error(path) == f"{path}: no such file"


def test_block_size_not_multiple_of_compress_ratios(tmp_path, tiny_ckpt, monkeypatch):
    """The tiny model compresses at ratios 1 and 2: block_size 15 is refused before anything is traced."""
    import deepinfer.compiler.executables as executables
    import deepinfer.compiler.pipeline as pipeline

    def traced(*args, **kwargs):
        raise AssertionError("traced a region before kv.block_size was checked against the compress ratios")

    monkeypatch.setattr(executables, "trace", traced)
    text = BASE.replace('"checkpoint"', f'"{tiny_ckpt}"')
    path, line = write(tmp_path, text, "block_size = 16", "block_size = 15")
    cfg = load_compile_config(path)  # the ratios are the checkpoint's: known once it is read
    out = tmp_path / "bundle"
    with pytest.raises(ConfigError) as e:
        pipeline.compile_bundle(cfg, out, log=lambda msg: None)
    message = str(e.value)
    assert message.startswith(f"{path}:{line}: kv.block_size: "), message
    assert "15" in message and "[1, 2]" in message, message
    assert not out.exists()


# --- the CLI: one line, exit status 2, nothing written ---


def run_cli(*args):
    return CliRunner().invoke(compile_cli, [str(a) for a in args])


@pytest.mark.parametrize(
    "old, new, name",
    [
        ("num_blocks = 8", "num_blocks = 4", "kv.num_blocks"),
        ('dtype = "fp32"', 'dtpe = "fp32"', "model.dtpe"),
    ],
    ids=["impossible_value", "unknown_key"],
)
def test_cli_prints_config_error_on_one_line(tmp_path, old, new, name):
    path, line = write(tmp_path, BASE, old, new)
    out = tmp_path / "bundle"
    result = run_cli(path, "-o", out)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert lines == [f"error: {config_error(path)}"]
    assert lines[0].startswith(f"error: {path}:{line}: {name}: ")
    assert "Traceback" not in result.output and result.stdout == ""
    assert not out.exists()


def test_cli_missing_file(tmp_path):
    result = run_cli(tmp_path / "nope.toml", "-o", tmp_path / "bundle")
    assert result.exit_code == 2
    assert result.stderr.strip() == f"error: {tmp_path / 'nope.toml'}: no such file"


def test_draft_of_a_checkpoint_without_one_is_refused(tmp_path):
    """[speculative] draft = "dspark" over a checkpoint without mtp.* (num_nextn_predict_layers 0): one
    line naming the file, the key and its line; nothing written."""
    from deepinfer.regions.tiny import make_tiny

    nodraft = make_tiny(tmp_path / "nodraft", draft=False)
    text = BASE.replace('"checkpoint"', f'"{nodraft}"')
    path, line = write(tmp_path, text, "cp = 1", 'cp = 1\n\n[speculative]\ndraft = "dspark"')
    out = tmp_path / "bundle"
    result = run_cli(path, "-o", out)
    assert result.exit_code == 2, result.output
    errors = [s for s in result.stderr.splitlines() if s.startswith("error:")]  # after the resolved settings
    assert len(errors) == 1 and errors[0].startswith(f"error: {path}:{line}: speculative.draft: "), errors
    assert "no DSpark draft" in errors[0] and "num_nextn_predict_layers is 0" in errors[0]
    assert "Traceback" not in result.output
    assert not out.exists()


@pytest.mark.parametrize(
    "cp, max_context, nearest",
    [(2, 32, "7 or 9"), (4, 32, "5 or 9"), (4, 48, "9")],
    ids=["cp=2", "cp=4", "cp=4-long"],
)
def test_num_blocks_divides_over_cp(tmp_path, tiny_ckpt, cp, max_context, nearest):
    """[kv] num_blocks counts a token group's blocks, its paged pools divided block-wise over the cp
    ranks: 8 (7 usable beside scratch block 0) is refused at cp = 2 and 4, naming the nearest valid
    counts that still hold two sequences of max_context (48 positions: at least 7 blocks)."""
    from deepinfer.compiler.spec import parse

    text = BASE.replace('"checkpoint"', f'"{tiny_ckpt}"').replace("cp = 1", f"cp = {cp}")
    path, _ = write(tmp_path, text, "max_context = 32", f"max_context = {max_context}")
    line = text.splitlines().index("num_blocks = 8") + 1
    with pytest.raises(ConfigError) as e:
        parse(load_compile_config(path), False, lambda msg: None)
    message = str(e.value)
    assert message.startswith(f"{path}:{line}: kv.num_blocks: 8 blocks do not divide over [parallel] cp = {cp}")
    assert message.endswith(f"nearest valid: {nearest}") and "\n" not in message, message


@pytest.mark.parametrize(
    "parallel, refused",
    [
        ((2, 1, 1), None),
        ((1, 2, 2), None),
        ((1, 4, 4), None),
        ((2, 8, 4), "ep = 8 does not divide the DSpark draft's 4 routed experts (dspark_n_routed_experts)"),
        ((1, 2, 1), None),
    ],
    ids=["tp=2", "ep=cp=2", "ep=cp=4", "tp=2,ep=8,cp=4", "ep=2-dispatch"],
)
def test_draft_is_compiled_over_ranks(tmp_path, tiny_ckpt, parallel, refused):
    """A draft is no longer refused past one rank: it is laid out as the target (issue 30). What cannot
    divide it is refused in one line at [parallel] ep: the tiny draft's 4 experts over 8 ranks (the
    target's 8 divide; tp = 2 x cp = 4, as the tiny indexer's 128 query rows cannot divide over cp = 8); the same layout without the draft is accepted. EP dispatch (ep = 2 over two token
    groups) is accepted: the draft's MoE runs on the groups' gathered rows as the target's does."""
    from deepinfer.compiler.spec import parse

    tp, ep, cp = parallel
    text = BASE.replace('"checkpoint"', f'"{tiny_ckpt}"').replace("num_blocks = 8", "num_blocks = 9")
    text = text.replace("tp = 1\nep = 1\ncp = 1", f"tp = {tp}\nep = {ep}\ncp = {cp}")
    path, _ = write(tmp_path, text + '\n[speculative]\ndraft = "dspark"\n')
    config = load_compile_config(path)  # [speculative] with [parallel] past one rank: no refusal here
    assert config.speculative.draft == "dspark" and config.parallel.world == max(tp * cp, ep)
    line = text.splitlines().index(f"ep = {ep}") + 1
    if refused is None:
        spec = parse(config, False, lambda msg: None)
        assert spec.draft and spec.topology == config.parallel
        return
    with pytest.raises(ConfigError) as e:
        parse(config, False, lambda msg: None)
    message = str(e.value)
    assert message.startswith(f"{path}:{line}: parallel.ep: {refused}") and "\n" not in message, message
    path, _ = write(tmp_path, text)  # the target alone divides over these ranks
    assert parse(load_compile_config(path), False, lambda msg: None).topology == config.parallel


def test_inductor_options_of_their_declared_type_pass(tmp_path):
    """Options typed as torch._inductor.config declares them are kept as written (int | None, int, bool, str)."""
    options = '{ "cpp.simdlen" = 8, "cpp.threads" = 2, max_autotune = false, "trace.debug_dir" = "d" }'
    path, _ = write(tmp_path, BASE, 'executable = "exported"', f'executable = "aoti"\noptions = {options}')
    cfg = load_compile_config(path)
    assert cfg.target.options == {"cpp.simdlen": 8, "cpp.threads": 2, "max_autotune": False, "trace.debug_dir": "d"}
