"""Weight recipes end to end: the bytes each recipe writes, checked element by element against
the checkpoint with quant/'s lookup tables, and bundles that generate what the reference does.

- `e4m3` (the trn2 target's recipe): IEEE-like e4m3 codes, a block over 240 halved and its
  scale byte raised by one; decoding the written bytes gives the checkpoint's values except
  where a halved value falls below e4m3's normal range, where it rounds to the nearest subnormal.
- float32 block scales (DeepSeek-V3's `weight_scale_inv`, [128, 128]): rescaled to ue8m0 on
  [32, 32] blocks with one rounding per element.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open

from deepinfer.bundles import manifest_io
from deepinfer.compiler.plan import plan_regions
from deepinfer.compiler.weights import in_format
from deepinfer.diff import References, diff_bundle, table_lines
from deepinfer.kernels.formats import fp8_decode
from deepinfer.quant.formats import E4M3_LUT
from deepinfer.quant.fp8 import E4M3FN_LUT
from deepinfer.quant.rescale import convert_format
from deepinfer.quant.ue8m0 import UE8M0_LUT
from deepinfer.regions.checkpoint import Checkpoint
from deepinfer.regions.config import load_config, parse_config
from deepinfer.regions.examples import random_weights
from deepinfer.regions.reference import ReferenceModel
from deepinfer.regions.step import EngramRows
from deepinfer.regions.synthetic import synthetic_config
from deepinfer.regions.tiny import make_tiny
from deepinfer.runtime import RunOptions, generate, load
from deepinfer.runtime.schedule import decode_model

from ..conftest import _compile_tiny

PROMPTS = [[0, 72, 101, 108, 108, 111, 44, 32, 119], [0, 5, 9, 11, 13, 40]]
NEW = 4
SUBNORMAL_STEP = 2.0**-9  # e4m3's subnormal spacing (in units of the block scale)


def expand(scales: np.ndarray, block: tuple[int, int], shape: tuple[int, int]) -> np.ndarray:
    return np.repeat(np.repeat(scales, block[0], 0), block[1], 1)[: shape[0], : shape[1]]


def check_e4m3(codes: np.ndarray, scales: np.ndarray, new: np.ndarray, new_s: np.ndarray, block) -> int:
    """The e4m3 recipe's promise for one weight (release bytes -> written bytes); returns how many
    elements rounded (halved into e4m3's subnormal range)."""
    assert ((new & 0x7F) <= 0x77).all(), "every written code is a finite e4m3 value"
    raised = new_s.astype(int) - scales.astype(int)
    assert set(np.unique(raised)) <= {0, 1}
    old = E4M3FN_LUT[codes] * expand(UE8M0_LUT[scales], block, codes.shape)
    got = E4M3_LUT[new] * expand(UE8M0_LUT[new_s], block, codes.shape)
    halved = expand(raised, block, codes.shape) == 1
    # a block is halved exactly when it holds a magnitude the e4m3 format cannot (> 240)
    over = expand(
        np.maximum.reduceat(
            np.maximum.reduceat(np.abs(E4M3FN_LUT[codes]) > 240, np.arange(0, codes.shape[0], block[0]), 0),
            np.arange(0, codes.shape[1], block[1]),
            1,
        ),
        block,
        codes.shape,
    )
    assert np.array_equal(halved, over)
    exact = ~halved | (np.abs(E4M3FN_LUT[codes]) >= 2.0**-5)  # halved into the normal range
    assert np.array_equal(got[exact], old[exact])
    step = SUBNORMAL_STEP * expand(UE8M0_LUT[new_s], block, codes.shape)
    assert (np.abs(got - old)[~exact] <= step[~exact] / 2).all()  # round to nearest subnormal
    return int((got != old).sum())


def test_in_graph_fp8_decoders_match_quant_tables():
    """The graphs' arithmetic decoders (kernels/formats.py) against quant/'s tables, all 256 codes."""
    codes = torch.arange(256, dtype=torch.uint8)
    for fmt, lut in (("e4m3fn", E4M3FN_LUT), ("e4m3", E4M3_LUT)):
        np.testing.assert_array_equal(fp8_decode(codes, fmt).numpy(), lut, err_msg=fmt)


def test_e4m3_recipe_on_release_shaped_weights():
    """The fp8 weights of a release-dimension MoE region (its shared expert, [2304, 5120] and
    [5120, 2304]; random valid bytes), converted as the trn2 recipe writes it; its fp4 experts
    stay as stored."""
    c = parse_config(synthetic_config(layers=6, experts=8)).text
    plan = plan_regions(c, torch.float32, True)
    rounded = total = 0
    for kind in ("moe",):
        region = plan.kinds[kind].region
        weights = random_weights(region, seed=3)
        stored = in_format(region.specs, weights, "e4m3")
        pairs = fp8_pairs(region)
        converted = {x.name for pair in pairs for x in pair}
        for s in region.specs:
            if s.name not in converted:  # fp4, bf16, f32: as stored
                assert torch.equal(stored[s.name], weights[s.name]), s.name
        for s, scale in pairs:
            codes = weights[s.name].numpy()
            block = (1, 32) if scale.shape[0] == s.shape[0] else (32, 32)
            rounded += check_e4m3(
                codes, weights[scale.name].numpy(), stored[s.name].numpy(), stored[scale.name].numpy(), block
            )
            total += codes.size
    # uniform random codes: ~6 % have exponent field 0 or 1 and odd mantissa, where halving rounds
    assert total == 3 * 2304 * 5120 and rounded > 0


# --- bundles ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def e4m3_bundle(tmp_path_factory, tiny_ckpt):
    """The tiny model with the e4m3 recipe on the cpu target (exported programs, no cache quantization)."""
    return _compile_tiny(
        tmp_path_factory,
        "recipe-e4m3",
        tiny_ckpt,
        executable="exported",
        tokens=[1],
        max_context=48,
        num_blocks=8,
        cache_quant=False,
        extra='\n[quant]\nrecipe = "e4m3"\n',
    )


@pytest.fixture(scope="module")
def v3_ckpt(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("v3") / "tiny-fp32-scales", scales="fp32")


@pytest.fixture(scope="module")
def v3_bundle(tmp_path_factory, v3_ckpt):
    """The float32-scaled tiny checkpoint compiled at tp = 2: its fp8 weights cut by rows and columns."""
    return _compile_tiny(
        tmp_path_factory,
        "recipe-v3",
        v3_ckpt,
        executable="exported",
        tokens=[1],
        max_context=48,
        num_blocks=8,
        cache_quant=False,
        parallel=(2, 1, 1),
    )


def stacks(bundle, rank: int = 0) -> dict[str, dict]:
    """kind -> {"layers", "tensors": name -> tensor (this rank's, shared files included), "formats"}."""
    m = json.loads((bundle / "manifest.json").read_text())
    out = {}
    for w in m["weights"][f"rank-{rank}"]:
        files = {"rank": w.get("path"), "shared": w.get("shared")}
        arrays = {}
        for name, t in w["tensors"].items():
            with safe_open(str(bundle / files[t["file"]]), framework="pt") as f:
                arrays[name] = f.get_tensor(name)
        out[w["kind"]] = {
            "layers": w["layers"],
            "tensors": arrays,
            "formats": {n: t["format"] for n, t in w["tensors"].items()},
        }
    return out


def fp8_pairs(region):
    """(codes spec, scale spec) of a region's fp8 weights."""
    by_key = {s.key: s for s in region.specs}
    return [
        (s, by_key[s.key.removesuffix("weight") + "scale"])
        for s in region.specs
        if s.ckpt_dtype == "F8_E4M3" and not s.experts
    ]


def test_e4m3_bundle_holds_the_recipe_bytes(e4m3_bundle, tiny_ckpt):
    """The streamed weight pass writes what the in-memory conversion of each layer gives, byte
    for byte, and records the format per tensor; everything else is the checkpoint's bytes."""
    ckpt = Checkpoint(tiny_ckpt)
    plan = plan_regions(load_config(tiny_ckpt).text, torch.float32, False)
    for kind, got in stacks(e4m3_bundle).items():
        region = plan.kinds[kind].region
        assert {got["formats"][c.name] for c, _ in fp8_pairs(region)} <= {"e4m3"}
        for i, layer in enumerate(got["layers"]):
            prefix = "" if layer < 0 else f"layers.{layer}."
            release = {s.name: ckpt.load_spec(prefix, s) for s in region.specs}
            want = in_format(region.specs, release, "e4m3")
            for s in region.specs:
                rows = want[s.name].shape[0]
                assert torch.equal(got["tensors"][s.name][i][:rows], want[s.name]), (kind, layer, s.name)


def with_recipe(model: ReferenceModel, fmt: str) -> ReferenceModel:
    """The reference holding its weights as recipe `fmt` stores them (converted in memory)."""

    def convert(region):
        out = region.with_weights(in_format(region.specs, dict(region.named_buffers()), fmt))
        out.fp8_format = fmt
        return out

    model.layers = [{slot: convert(r) for slot, r in regions.items()} for regions in model.layers]
    model.head = convert(model.head)
    if model.engram is not None:  # the host tables: one ue8m0 scale per row and 32 columns
        model.engram = EngramRows(
            [
                tuple(torch.from_numpy(x) for x in convert_format(codes.numpy(), scales.numpy(), (1, 32), fmt))
                for codes, scales in model.engram.tables
            ]
        )
    return model


def test_e4m3_bundle_generates_the_reference_tokens(e4m3_bundle, tiny_ckpt):
    ref = with_recipe(ReferenceModel(tiny_ckpt, dtype="fp32", cache_quant=False, ties="lowest"), "e4m3")
    want = decode_model(ref, PROMPTS, NEW)
    got = generate(load(e4m3_bundle), PROMPTS, RunOptions(max_new_tokens=NEW, keep_logits=True))
    for g, w in zip(got, want):
        assert g.tokens == w.tokens
        torch.testing.assert_close(torch.stack(g.logits), torch.stack(w.logits), rtol=1e-4, atol=1e-4)


def test_diff_runs_e4m3_bundles_with_regions_of_their_format(e4m3_bundle):
    """`deepinfer diff` builds its reference regions for the fp8 format the manifest records (the
    graphs' decoders); bound to the recipe's bytes they agree with every executable."""
    assert {r.fp8_format for r in References(load(e4m3_bundle)).regions.values()} == {"e4m3"}
    report = diff_bundle(e4m3_bundle, PROMPTS[:1], max_new_tokens=2)
    assert {e.kind for e in report.kinds()} == {r.kind for r in manifest_io.read(e4m3_bundle).regions}
    assert not report.failing(), "\n".join(table_lines(report))


def test_float_scales_are_rescaled_to_ue8m0(v3_bundle, v3_ckpt):
    """Each rank's fp8 weights decode to the checkpoint's code x scale_inv within one e4m3fn
    rounding (half a step at the element's exponent), and equal the in-memory rescale of the
    whole tensor cut to the rank: the streamed chunks and the tp cuts put every byte in place."""
    ckpt = Checkpoint(v3_ckpt)
    c = load_config(v3_ckpt).text
    full = plan_regions(c, torch.float32, False)
    checked = 0
    for rank in (0, 1):
        for kind, got in stacks(v3_bundle, rank).items():
            region = full.kinds[kind].region
            for codes_spec, scale_spec in fp8_pairs(region):
                if "engram.embed" in codes_spec.key:
                    continue  # engram tables keep ue8m0 row scales
                for i, layer in enumerate(got["layers"]):
                    name = ("" if layer < 0 else f"layers.{layer}.") + codes_spec.key
                    codes = ckpt.get(name).view(torch.uint8).numpy()
                    inv = ckpt.get(name + "_scale_inv").numpy()
                    value = E4M3FN_LUT[codes] * expand(inv, (128, 128), codes.shape)
                    new, new_s = (got["tensors"][n][i].numpy() for n in (codes_spec.name, scale_spec.name))
                    rows, cols = _cut(value.shape, new.shape, rank)
                    decoded = E4M3FN_LUT[new] * expand(UE8M0_LUT[new_s], (32, 32), new.shape)
                    v = value[rows, cols]
                    half_step = np.maximum(
                        2.0 ** (np.floor(np.log2(np.maximum(np.abs(v), 1e-30))) - 4),
                        SUBNORMAL_STEP / 2 * expand(UE8M0_LUT[new_s], (32, 32), new.shape),
                    )
                    assert (np.abs(decoded - v) <= half_step).all(), (rank, kind, name)
                    mem_codes, mem_s = (t.numpy() for t in ckpt.rescaled(name))
                    assert np.array_equal(new, mem_codes[rows, cols]), (rank, kind, name)
                    assert np.array_equal(new_s, mem_s[_cut(mem_s.shape, new_s.shape, rank)]), (rank, kind, name)
                    checked += 1
    assert checked > 20


def _cut(full: tuple[int, int], part: tuple[int, int], rank: int) -> tuple[slice, slice]:
    """Rank `rank`'s rows or columns of a [full] weight holding [part] at tp = 2."""
    if part == full:
        return slice(None), slice(None)
    if part[0] != full[0]:
        return slice(rank * part[0], (rank + 1) * part[0]), slice(None)
    return slice(None), slice(rank * part[1], (rank + 1) * part[1])


def test_float_scaled_bundle_generates_the_reference_tokens(v3_bundle, v3_ckpt):
    """The bundle's two ranks generate what the reference does on the same checkpoint (which
    rescales the float32 scales in memory, whole tensors at a time)."""
    want = decode_model(ReferenceModel(v3_ckpt, dtype="fp32", cache_quant=False, ties="lowest"), PROMPTS, NEW)
    run = generate(v3_bundle, PROMPTS, RunOptions(max_new_tokens=NEW, keep_logits=True, threads=1))
    for g, w in zip(run, want):
        assert g.tokens == w.tokens
        torch.testing.assert_close(torch.stack(g.logits), torch.stack(w.logits), rtol=1e-4, atol=1e-4)
