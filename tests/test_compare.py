"""`deepinfer compare`: per-position metrics, dump validation, the noise floor and the verdict."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from deepinfer import compare as cmp
from deepinfer.cli import main
from deepinfer.cli_common import write_logits
from deepinfer.errors import CompareError
from deepinfer.runtime.requests import Completion
from deepinfer.runtime.schedule import decode_model

V = 40


def fake_gens(seed: int = 0, lengths=(6, 4), new: int = 3) -> list[Completion]:
    """Greedy-consistent generations over random logits: generated tokens are the previous row's argmax."""
    g = torch.Generator().manual_seed(seed)
    gens = []
    for n in lengths:
        tokens = torch.randint(0, V, (n,), generator=g).tolist()
        logits = []
        for _ in range(n + new - 1):
            logits.append(torch.randn(V, generator=g))
            if len(logits) >= n:
                tokens.append(int(logits[-1].argmax()))
        gens.append(Completion(tokens, n, logits))
    return gens


def dump(tmp_path, name: str, gens) -> cmp.Dump:
    path = tmp_path / name
    write_logits(path, gens)
    return cmp.load_dump(path)


FLOOR = cmp.Floor(
    "ckpt", "fp32", True, [], [{"name": "fp32 chunk 1", "cosine": 1.0, "rel": 2e-6, "argmax": 1.0, "flips": []}]
)


def test_identical_dumps_are_within_noise(tmp_path):
    a, b = dump(tmp_path, "a.st", fake_gens()), dump(tmp_path, "b.st", fake_gens())
    c = cmp.compare(a, b)
    assert [p.compared for p in c.prompts] == [8, 6]
    assert c.worst_cosine == pytest.approx(1.0) and c.worst_rel == 0.0 and c.argmax_agreement == 1.0
    assert [p.first_divergent for p in c.prompts] == [None, None]
    v = cmp.verdict(c, FLOOR)
    assert v.within and v.rel_limit == pytest.approx(cmp.MARGIN * 2e-6)


def test_perturbed_position_is_reported_and_outside_noise(tmp_path):
    gens = fake_gens()
    row = gens[1].logits[2]  # prompt 1, position 2 (inside the prompt: tokens unchanged)
    top, low = int(row.argmax()), int(row.argmin())
    row[top], row[low] = row[low].clone(), row[top].clone()
    c = cmp.compare(dump(tmp_path, "a.st", gens), dump(tmp_path, "b.st", fake_gens()))
    p0, p1 = c.prompts
    assert p0.worst_rel == 0.0 and p0.first_divergent is None
    assert p1.first_divergent == 2 and p1.agree == p1.compared - 1
    assert p1.rel.index(p1.worst_rel) == 2 and p1.worst_rel > 0.1 and p1.worst_cosine < 0.99
    assert not cmp.verdict(c, FLOOR).within
    lines = cmp.table_lines(c, per_step=True)
    assert sum("<- differs" in line for line in lines) == 1
    assert lines[-1].startswith("summary: ") and "argmax agreement 0.9286 over 14 positions" in lines[-1]


def test_small_noise_within_margin_larger_outside(tmp_path):
    gens = fake_gens()
    gens[0].logits[1] = gens[0].logits[1] * (1 + 3e-6)  # rel err 3e-6 <= 4 x 2e-6
    c = cmp.compare(dump(tmp_path, "a.st", gens), dump(tmp_path, "b.st", fake_gens()))
    assert c.worst_rel == pytest.approx(3e-6, rel=2e-2) and c.argmax_agreement == 1.0
    assert cmp.verdict(c, FLOOR).within and not cmp.verdict(c, FLOOR, margin=1.0).within


def test_greedy_divergence_stops_the_comparison(tmp_path):
    """B picks another token at the first generated position: later rows saw other tokens and are skipped."""
    a_gens, b_gens = fake_gens(), fake_gens()
    g = b_gens[0]
    row = g.logits[g.prompt_len - 1]
    second = int(row.topk(2).indices[1])
    row[second] = row.max() + 1  # B's greedy choice changes
    g.tokens[g.prompt_len] = second
    c = cmp.compare(dump(tmp_path, "a.st", a_gens), dump(tmp_path, "b.st", b_gens))
    p = c.prompts[0]
    assert p.tokens_diverge_at == g.prompt_len and p.compared == g.prompt_len
    assert p.first_divergent == g.prompt_len - 1


def test_floor_argmax_bar_covers_the_compared_positions():
    """Flips late in a sequence do not count against a comparison that stopped before them."""
    floor = cmp.Floor(
        "ckpt",
        "bf16",
        True,
        [[5, 6, 7, 8], [1, 2]],
        [
            {"name": "fp32 chunk 1", "cosine": 1.0, "rel": 1e-6, "argmax": 1.0, "flips": [[], []]},
            {"name": "bf16", "cosine": 0.9, "rel": 0.1, "argmax": 4 / 6, "flips": [[3], [1]]},
        ],
    )
    assert floor.argmax_over([[5, 6, 7, 8], [1, 2]]) == pytest.approx(4 / 6)
    assert floor.argmax_over([[5, 6, 7], [1, 2]]) == pytest.approx(4 / 5)
    assert floor.argmax_over([[5, 6], [1]]) == 1.0
    assert floor.argmax_over([[5, 9], [1]]) == floor.argmax  # other tokens: the whole floor's


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda gens: gens.pop(), "has 2 prompts but"),
        (lambda gens: gens[0].tokens.__setitem__(1, (gens[0].tokens[1] + 1) % V), "different prompts"),
        (
            lambda gens: [g.logits.__setitem__(slice(None), [x[:-1] for x in g.logits]) for g in gens],
            f"logits over {V} tokens but",
        ),
    ],
)
def test_mismatched_dumps_are_a_clean_error(tmp_path, edit, message):
    gens = fake_gens()
    edit(gens)
    a, b = dump(tmp_path, "a.st", fake_gens()), dump(tmp_path, "b.st", gens)
    with pytest.raises(CompareError, match=message):
        cmp.compare(a, b)
    r = CliRunner().invoke(main, ["compare", str(a.path), str(b.path)])
    assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
    assert r.output.startswith("error: ") and str(a.path) in r.output and message in r.output


def test_unreadable_inputs_name_the_file(tmp_path):
    a = dump(tmp_path, "a.st", fake_gens()).path
    junk = tmp_path / "junk.st"
    junk.write_bytes(b"not safetensors")
    for args, text in [
        ([a, tmp_path / "missing.st"], "missing.st: no such file"),
        ([a, junk], "junk.st: not a safetensors logit dump"),
        ([a, a, "--floor", junk], "junk.st: not a noise-floor JSON file"),
    ]:
        r = CliRunner().invoke(main, ["compare", *map(str, args)])
        assert r.exit_code == 2 and r.output.count("\n") == 1 and text in r.output, r.output


# --- the measured floor, on the tiny checkpoint ---


@pytest.fixture(scope="module")
def ref_dump(tmp_path_factory, ref_fp32) -> cmp.Dump:
    gens = decode_model(ref_fp32, [[0, 72, 105, 33]], 3)  # 6 logits rows
    path = tmp_path_factory.mktemp("compare") / "ref.st"
    write_logits(path, gens)
    return cmp.load_dump(path)


@pytest.fixture(scope="module")
def floor(ref_dump, tiny_ckpt) -> cmp.Floor:
    return cmp.floor_for(ref_dump, tiny_ckpt, dtype="bf16")


def test_floor_is_small_for_fp32_and_larger_for_bf16(floor, ref_dump):
    by = {p["name"]: p for p in floor.perturbations}
    assert list(by) == list(cmp.PERTURBATIONS) and floor.tokens == cmp.floor_tokens(ref_dump)
    fp32 = [by[n] for n in cmp.FLOOR_DTYPES["fp32"]]
    assert all(0 <= p["rel"] < 1e-2 and p["cosine"] > 0.9999 and p["argmax"] == 1.0 for p in fp32), fp32
    assert by["bf16"]["rel"] > max(p["rel"] for p in fp32)
    assert floor.rel == by["bf16"]["rel"] > 0


def test_floor_round_trips_and_checks_its_format(floor, tmp_path):
    path = tmp_path / "floor.json"
    cmp.save_floor(floor, path)
    assert json.loads(path.read_text())["format"] == cmp.FLOOR_FORMAT
    assert cmp.load_floor(path) == floor
    path.write_text(json.dumps({**json.loads(path.read_text()), "format": "other/9"}))
    with pytest.raises(CompareError, match="format 'other/9'"):
        cmp.load_floor(path)


def test_cli_compare_json_end_to_end(floor, ref_dump, tiny_ckpt, tmp_path):
    floor_file = tmp_path / "floor.json"
    cmp.save_floor(floor, floor_file)
    runner = CliRunner()
    r = runner.invoke(
        main, ["compare", str(ref_dump.path), str(ref_dump.path), "--floor", str(floor_file), "--json", "--per-step"]
    )
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["verdict"]["within"] and out["verdict"]["text"] == "within noise"
    assert out["summary"] == {"worst_cosine": 1.0, "worst_rel": 0.0, "argmax_agreement": 1.0, "first_divergent": [None]}
    assert len(out["prompts"][0]["steps"]) == 6 and out["floor"]["rel"] == floor.rel

    logits = [x.clone() for x in ref_dump.logits[0]]  # swap position 4's top two logits
    i, j = logits[4].topk(2).indices.tolist()
    logits[4][i], logits[4][j] = logits[4][j].clone(), logits[4][i].clone()
    bad = tmp_path / "bad.st"
    write_logits(bad, [Completion(ref_dump.tokens[0], 4, logits)])
    # a floor that flips an argmax itself (bf16 often does on the tiny model; not on every CPU, so the
    # floor is written here): one flip at the same position is within it
    flipping = cmp.Floor(
        floor.checkpoint,
        "bf16",
        True,
        floor.tokens,
        [{"name": "bf16", "cosine": 0.99, "rel": 0.1, "argmax": 5 / 6, "flips": [[4]]}],
    )
    cmp.save_floor(flipping, floor_file)
    r = runner.invoke(main, ["compare", str(bad), str(ref_dump.path), "--floor", str(floor_file)])
    assert r.exit_code == 0 and "verdict: within noise" in r.output, r.output
    # the fp32 floor (summation order only) flips none, and its rel err is ~1e-6
    r = runner.invoke(
        main, ["compare", str(bad), str(ref_dump.path), "--noise-floor", str(tiny_ckpt), "--dtype", "fp32", "--json"]
    )
    assert r.exit_code == 1, r.output
    out = json.loads(r.stdout)
    assert not out["verdict"]["within"] and out["summary"]["first_divergent"] == [4]
    assert out["floor"]["dtype"] == "fp32" and out["floor"]["argmax"] == 1.0 and out["floor"]["rel"] < 1e-2


def test_cli_noise_floor_measures_and_saves(ref_dump, tiny_ckpt, tmp_path):
    out = tmp_path / "fp32.json"
    r = CliRunner().invoke(main, ["noise-floor", str(tiny_ckpt), str(ref_dump.path), "--dtype", "fp32", "-o", str(out)])
    assert r.exit_code == 0, r.output
    floor = cmp.load_floor(out)
    assert [p["name"] for p in floor.perturbations] == cmp.FLOOR_DTYPES["fp32"] and floor.rel < 1e-2
    assert "fp32 chunk 3" in r.output and f"wrote {out}" in r.output
    runs = len(cmp.FLOOR_DTYPES["fp32"]) + 1  # each run says so as it starts (issue 44: no minute of silence)
    assert [f"noise floor: run {i}/{runs}" in r.stderr for i in range(1, runs + 1)] == [True] * runs


def test_cli_margin_default_is_the_modules():
    opt = next(p for p in main.commands["compare"].params if p.name == "margin")
    assert opt.default == cmp.MARGIN


# --- dumps say what produced them: the floor follows their precision, other models are refused ---


def test_floor_follows_the_dumps_precision(tmp_path):
    fp32 = {"dtype": "fp32", "cache_quant": True}
    a, b = tmp_path / "a.st", tmp_path / "b.st"
    write_logits(a, fake_gens(), {**fp32, "source": "bundle"})
    write_logits(b, fake_gens(), {**fp32, "source": "reference"})
    da, db = cmp.load_dump(a), cmp.load_dump(b)
    assert (da.dtype, da.cache_quant) == ("fp32", True)
    assert cmp.floor_precision(da, db) == ("fp32", True)  # not bf16: the runs were fp32
    write_logits(b, fake_gens(), {"dtype": "bf16", "cache_quant": False})
    assert cmp.floor_precision(da, cmp.load_dump(b)) == ("bf16", True)
    write_logits(b, fake_gens())  # an old dump says nothing
    assert cmp.floor_precision(da, cmp.load_dump(b)) == (None, True)


def test_dumps_of_different_models_are_refused(tmp_path):
    a, b = tmp_path / "a.st", tmp_path / "b.st"
    write_logits(a, fake_gens(), {"config_hash": "1" * 64})
    write_logits(b, fake_gens(), {"config_hash": "2" * 64})
    r = CliRunner().invoke(main, ["compare", str(a), str(b), "--no-floor"])
    assert r.exit_code == 2 and r.output.count("\n") == 1 and "not the same model" in r.output, r.output


def test_no_floor_is_not_a_silent_pass(tmp_path):
    """Without a floor there is no verdict: an error, unless the metrics alone are asked for."""
    other = fake_gens()
    other[0].logits[1] = other[0].logits[1] * 3  # inside the prompt: same tokens
    a, b = dump(tmp_path, "a.st", fake_gens()).path, dump(tmp_path, "b.st", other).path
    r = CliRunner().invoke(main, ["compare", str(a), str(b)])
    assert r.exit_code == 2 and "no noise floor" in r.output and r.output.count("\n") == 1, r.output
    r = CliRunner().invoke(main, ["compare", str(a), str(b), "--no-floor"])
    assert r.exit_code == 0 and "verdict: none" in r.output, r.output


def test_reference_dump_records_its_checkpoint_and_precision(tiny_ckpt, tmp_path):
    """`deepinfer reference --dump-logits` records what made it; compare measures the floor from that."""
    ref = tmp_path / "ref.st"
    r = CliRunner().invoke(
        main,
        [
            "reference",
            str(tiny_ckpt),
            "--prompt-ids",
            "0,72,105,33",
            "--max-new-tokens",
            "2",
            "--dtype",
            "fp32",
            "--topk-ties",
            "lowest",
            "--dump-logits",
            str(ref),
        ],
    )
    assert r.exit_code == 0, r.output
    d = cmp.load_dump(ref)
    assert d.meta["source"] == "reference" and d.dtype == "fp32" and Path(d.meta["checkpoint"]) == tiny_ckpt.resolve()
    r = CliRunner().invoke(main, ["compare", str(ref), str(ref), "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["floor"]["dtype"] == "fp32" and out["verdict"]["within"]
    assert out["floor"]["rel"] < 1e-3  # summation order only, not bf16 (rel ~0.5 on this model)
