"""The host-side vision tower: image files, sizing, patches, the 2-D rotary embedding, the
span layout, an independent recomputation of the tower, and the golden image prompt
(tests/golden/tiny_vision_seed0.json) through the reference, the CLI and a compiled bundle."""

from __future__ import annotations

import json
import math
import struct
import zlib

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch.nn import functional as F

from deepinfer.errors import ImageError
from deepinfer.regions.config import VisionConfig
from deepinfer.regions.image import GREY, fit, plan_grid, preprocess, read_image, to_patches
from deepinfer.regions.spans import with_images
from deepinfer.regions.vision import apply_rope_2d, merge_cells, rope_2d
from deepinfer.runtime.schedule import decode_model

from ..conftest import regenerate

GOLDEN = json.loads(regenerate.VISION_GOLDEN.read_text())

TINY = VisionConfig(
    num_hidden_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    intermediate_size=128,
    patch_size=4,
    downsample_ratio=2,
    max_image_tokens=64,
    min_pixels=256,
)


@pytest.fixture(scope="module")
def ref(tiny_ckpt):
    from deepinfer.regions.reference import ReferenceModel

    return ReferenceModel(tiny_ckpt, dtype="fp32", cache_quant=False)


# --- files ---


def png_bytes(pixels: np.ndarray, color: int, filters: list[int]) -> bytes:
    """A PNG written here, with the given filter type on each row (the decoder must undo each)."""
    h, w = pixels.shape[:2]
    bpp = pixels.shape[2] if pixels.ndim == 3 else 1
    rows, prior = [], np.zeros(w * bpp, dtype=np.int64)
    for y in range(h):
        cur = pixels[y].reshape(-1).astype(np.int64)
        left = np.concatenate([np.zeros(bpp, np.int64), cur[:-bpp]])
        upleft = np.concatenate([np.zeros(bpp, np.int64), prior[:-bpp]])
        kind = filters[y % len(filters)]
        if kind == 4:
            p = left + prior - upleft
            pa, pb, pc = abs(p - left), abs(p - prior), abs(p - upleft)
            pred = np.where((pa <= pb) & (pa <= pc), left, np.where(pb <= pc, prior, upleft))
        else:
            pred = [0 * cur, left, prior, (left + prior) // 2][kind]
        rows.append(bytes([kind]) + ((cur - pred) % 256).astype(np.uint8).tobytes())
        prior = cur

    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, color, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(b"".join(rows)))
        + chunk(b"IEND", b"")
    )


def test_image_files_read_back_exactly(tmp_path):
    rng = np.random.default_rng(1)
    rgb = rng.integers(0, 256, (7, 5, 3), dtype=np.uint8)
    rgba = rng.integers(0, 256, (6, 9, 4), dtype=np.uint8)
    grey = rng.integers(0, 256, (4, 3), dtype=np.uint8)
    (tmp_path / "a.ppm").write_bytes(b"P6\n# comment\n5 7\n255\n" + rgb.tobytes())
    (tmp_path / "g.pgm").write_bytes(b"P5 3 4 255 " + grey.tobytes())
    (tmp_path / "w.ppm").write_bytes(b"P6 5 7 65535\n" + (rgb.astype(">u2") * 257).tobytes())
    (tmp_path / "a.png").write_bytes(png_bytes(rgb, 2, [0, 1, 2, 3, 4]))
    (tmp_path / "b.png").write_bytes(png_bytes(rgba, 6, [4, 3, 1]))
    np.save(tmp_path / "a.npy", rgb)
    assert np.array_equal(read_image(tmp_path / "a.ppm"), rgb)
    assert np.array_equal(read_image(tmp_path / "g.pgm"), np.repeat(grey[:, :, None], 3, 2))
    assert np.array_equal(read_image(tmp_path / "w.ppm"), rgb)
    assert np.array_equal(read_image(tmp_path / "a.png"), rgb)
    assert np.array_equal(read_image(tmp_path / "b.png"), rgba[:, :, :3])  # alpha dropped
    assert np.array_equal(read_image(tmp_path / "a.npy"), rgb)
    (tmp_path / "bad.jpg").write_bytes(b"\xff\xd8\xff")
    with pytest.raises(ImageError, match="bad.jpg: not a supported image"):
        read_image(tmp_path / "bad.jpg")
    (tmp_path / "short.ppm").write_bytes(b"P6 5 7 255\n" + rgb.tobytes()[:20])
    with pytest.raises(ImageError, match="truncated"):
        read_image(tmp_path / "short.ppm")


def test_hostile_image_files_are_bounded(tmp_path, monkeypatch):
    """Bytes read and declared dimensions are bounded before decoding; a short IHDR is one line."""
    from deepinfer.regions import image

    def ihdr_png(width, height, ihdr_len=13):
        body = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)[:ihdr_len]
        idat = zlib.compress(bytes(1 << 20))  # inflates to 1 MiB: never all of it
        return (
            b"\x89PNG\r\n\x1a\n"
            + struct.pack(">I", len(body))
            + b"IHDR"
            + body
            + b"\0" * 4
            + struct.pack(">I", len(idat))
            + b"IDAT"
            + idat
            + b"\0" * 4
        )

    (tmp_path / "huge.png").write_bytes(ihdr_png(20000, 20000))
    with pytest.raises(ImageError, match=r"huge\.png: image declares 20000 x 20000 pixels, more than 64 Mpixel"):
        read_image(tmp_path / "huge.png")
    (tmp_path / "short.png").write_bytes(ihdr_png(4, 4, ihdr_len=9))
    with pytest.raises(ImageError, match="IHDR of 9 bytes, expected 13"):
        read_image(tmp_path / "short.png")
    (tmp_path / "big.ppm").write_bytes(b"P6 20000 20000 255\n")
    with pytest.raises(ImageError, match="declares 20000 x 20000"):
        read_image(tmp_path / "big.ppm")
    (tmp_path / "bomb.png").write_bytes(ihdr_png(2, 2))  # 1 MiB of zeros for 2 x 2 pixels
    assert read_image(tmp_path / "bomb.png").shape == (2, 2, 3)
    monkeypatch.setattr(image, "MAX_FILE_BYTES", 1 << 16)
    with pytest.raises(ImageError, match="zero: more than 65,536 bytes; not read further"):
        read_image("/dev/zero")  # an endless file is not read to its end


# --- sizing and patches ---


@pytest.mark.parametrize(
    "h, w, rows, cols", [(20, 28, 5, 7), (12, 24, 3, 6), (16, 24, 4, 6), (4, 64, 1, 16), (10, 10, 4, 4), (18, 30, 5, 8)]
)
def test_grid_and_span_layout(h, w, rows, cols):
    """Patch grid, merged grid ceil(rows/2) x ceil(cols/2), and the span: start, rows of
    features each followed by a newline, end."""
    g = plan_grid(w, h, TINY)
    assert (g.rows, g.cols) == (rows, cols)
    assert (g.llm_rows, g.llm_cols) == (math.ceil(rows / 2), math.ceil(cols / 2))
    assert g.tokens == g.llm_rows * (g.llm_cols + 1) + 2 <= TINY.max_image_tokens
    D = 4
    start, end, newline = torch.full((D,), -1.0), torch.full((D,), -2.0), torch.full((D,), -3.0)
    feats = torch.arange(1, g.llm_rows * g.llm_cols + 1, dtype=torch.float32)[:, None].expand(-1, D)
    body = torch.cat([feats.view(g.llm_rows, g.llm_cols, D), newline.expand(g.llm_rows, 1, D)], 1).view(-1, D)
    span = torch.cat([start[None], body, end[None]])
    ids, emb = with_images([0, 75, 259, 80], [span], 259, bos=0)
    assert ids == [0, 75] + [259] * g.tokens + [80]
    assert emb.mask.tolist() == [False, False] + [True] * g.tokens + [False]
    layout = emb.embeds[emb.mask][:, 0].tolist()
    want = (
        [-1.0]
        + sum(([float(1 + r * g.llm_cols + c) for c in range(g.llm_cols)] + [-3.0] for r in range(g.llm_rows)), [])
        + [-2.0]
    )
    assert layout == want


def test_images_without_marker_follow_bos_and_counts_must_match():
    span = torch.ones(5, 2)
    ids, emb = with_images([0, 75, 76], [span, 2 * span], 259, bos=0)
    assert ids == [0] + [259] * 10 + [75, 76]
    assert emb.embeds[1:6].eq(1).all() and emb.embeds[6:11].eq(2).all() and not emb.mask[11:].any()
    with pytest.raises(ImageError, match="1 image placeholder"):
        with_images([0, 259, 75], [span, span], 259, bos=0)


def test_sizing_rules():
    # small images scale up to min_pixels (256): 8 x 8 -> 16 x 16
    assert (plan_grid(8, 8, TINY).height, plan_grid(8, 8, TINY).width) == (16, 16)
    # over the 64-token budget: the largest grid of the same aspect that fits
    g = plan_grid(400, 300, TINY)
    assert g.tokens <= 64 and g.width / g.height == pytest.approx(4 / 3, rel=0.15)
    assert plan_grid(2000, 10, TINY).tokens <= 64
    with pytest.raises(ImageError, match="must be positive"):
        plan_grid(0, 4, TINY)


def test_fit_pads_with_grey_centred_and_keeps_exact_sizes():
    px = np.full((8, 16, 3), 200, dtype=np.uint8)
    g = plan_grid(16, 8, TINY)  # 128 pixels < 256: scaled to 22 x 11 -> 24 x 12
    out = fit(px, g, TINY)
    assert out.shape == (g.height, g.width, 3) == (12, 24, 3)
    # 16 x 8 fitted into 24 x 12 keeps 2:1 exactly: no band
    assert (out == 200).all()
    g2 = plan_grid(10, 40, TINY)  # tall: 10 -> 12 columns, a grey column each side
    out2 = fit(np.full((40, 10, 3), 200, dtype=np.uint8), g2, TINY)
    assert out2.shape == (40, 12, 3)
    assert (out2[:, [0, 11]] == GREY).all() and (out2[:, 1:11] == 200).all()
    exact = regenerate.gradient_image()
    assert np.array_equal(fit(exact, plan_grid(28, 20, TINY), TINY), exact)  # no resampling at grid size


def test_patches_are_row_major_and_normalised():
    px = regenerate.gradient_image()
    patches, g = preprocess(px, TINY)
    assert patches.shape == (g.rows * g.cols, 3, 4, 4) and patches.dtype == torch.float32
    k = 2 * g.cols + 5  # patch row 2, column 5
    want = torch.from_numpy(px[8:12, 20:24].astype(np.float32)).permute(2, 0, 1) / 255 * 2 - 1
    assert torch.allclose(patches[k], want, atol=1e-6)
    assert patches.min() >= -1 and patches.max() <= 1
    grey = to_patches(np.full((4, 4, 3), GREY, np.uint8), plan_grid(4, 4, VisionConfig(patch_size=4, min_pixels=16)), 4)
    assert torch.allclose(grey, torch.full_like(grey, (GREY / 255 - 0.5) / 0.5))


# --- the tower's pieces ---


def complex_rope(x: torch.Tensor, row: int, col: int, theta: float) -> torch.Tensor:
    """The rotation written independently: channel pair (i, i + hd/2) as one complex number,
    turned by row * f_i (i < hd/4) or col * f_(i - hd/4), f_k = theta^(-4k / hd)."""
    hd = x.shape[-1]
    z = torch.complex(x[..., : hd // 2].double(), x[..., hd // 2 :].double())
    k = torch.arange(hd // 2) % (hd // 4)
    pos = torch.where(torch.arange(hd // 2) < hd // 4, row, col).double()
    z = z * torch.polar(torch.ones(hd // 2, dtype=torch.float64), pos * theta ** (-4.0 * k / hd))
    return torch.cat([z.real, z.imag], -1)


def test_rope_2d_rotates_rows_and_columns():
    rows, cols, hd, theta = 3, 5, 16, 10000.0
    cos, sin = rope_2d(rows, cols, hd, theta)
    x = torch.randn(rows * cols, 2, hd, generator=torch.Generator().manual_seed(0))
    out = apply_rope_2d(x, cos, sin)
    for n in range(rows * cols):
        r, c = divmod(n, cols)
        assert torch.allclose(out[n].double(), complex_rope(x[n], r, c, theta), atol=1e-5)
    assert torch.equal(out[0], x[0])  # (0, 0): no rotation
    # half the channels see only the row, the other half only the column
    q = x[:1].expand(rows * cols, -1, -1)
    rot = apply_rope_2d(q, cos, sin).view(rows, cols, 2, hd)
    row_ch = torch.cat([torch.arange(hd // 4), hd // 2 + torch.arange(hd // 4)])
    col_ch = torch.cat([hd // 4 + torch.arange(hd // 4), 3 * hd // 4 + torch.arange(hd // 4)])
    assert torch.allclose(rot[:, :, :, row_ch], rot[:, :1, :, row_ch].expand(-1, cols, -1, -1))
    assert torch.allclose(rot[:, :, :, col_ch], rot[:1, :, :, col_ch].expand(rows, -1, -1, -1))
    # scores depend only on the relative offset
    qk = torch.randn(2, 1, hd, generator=torch.Generator().manual_seed(1))

    def score(a, b):
        (ra, ca), (rb, cb) = a, b
        return float(complex_rope(qk[0, 0], ra, ca, theta) @ complex_rope(qk[1, 0], rb, cb, theta))

    assert score((0, 1), (2, 3)) == pytest.approx(score((5, 7), (7, 9)), abs=1e-9)


def test_merge_cells_is_unfold_order_with_zero_padding():
    rows, cols, C, r = 5, 7, 3, 2
    x = torch.randn(rows * cols, C, generator=torch.Generator().manual_seed(2))
    out = merge_cells(x, rows, cols, r)
    grid = x.view(rows, cols, C)
    want = torch.zeros(3 * 4, C * r * r)
    for i in range(3):
        for j in range(4):
            for c in range(C):
                for a in range(r):
                    for b in range(r):
                        if i * r + a < rows and j * r + b < cols:
                            want[i * 4 + j, c * r * r + a * r + b] = grid[i * r + a, j * r + b, c]
    assert torch.equal(out, want)


def naive_span(ckpt, image: np.ndarray) -> torch.Tensor:
    """The tiny tower recomputed from the checkpoint in float64 with loops and explicit softmax."""
    from deepinfer.regions.checkpoint import Checkpoint
    from deepinfer.regions.config import load_config

    cfg = load_config(ckpt)
    v, ck = cfg.vision, Checkpoint(ckpt)

    def t(name):
        return ck.get(name).double()

    def lin(x, name, bias=True):
        return x @ t(name + ".weight").T + (t(name + ".bias") if bias else 0)

    def norm(x, name):
        return x / (x.square().mean(-1, keepdim=True) + 1e-6).sqrt() * t(name)

    patches, g = preprocess(image, v)
    x = lin(patches.reshape(len(patches), -1).double(), "vision.patch_embed.proj")
    H, hd = v.num_attention_heads, v.hidden_size // v.num_attention_heads
    pos = [divmod(n, g.cols) for n in range(g.rows * g.cols)]
    for j in range(v.num_hidden_layers):
        p = f"vision.blocks.{j}."
        q, k, val = lin(norm(x, p + "norm1.weight"), p + "attn.wqkv").split(v.hidden_size, -1)
        heads = []
        for h in range(H):
            sl = slice(h * hd, (h + 1) * hd)
            qr = torch.stack([complex_rope(q[n, sl], r, c, v.rope_theta) for n, (r, c) in enumerate(pos)])
            kr = torch.stack([complex_rope(k[n, sl], r, c, v.rope_theta) for n, (r, c) in enumerate(pos)])
            heads.append(torch.softmax(qr @ kr.T / math.sqrt(hd), -1) @ val[:, sl])
        x = x + lin(torch.cat(heads, -1), p + "attn.wo")
        gu = lin(norm(x, p + "norm2.weight"), p + "mlp.w1", bias=False)
        gate, up = gu[:, : v.intermediate_size], gu[:, v.intermediate_size :]
        x = x + lin(gate * torch.sigmoid(gate) * up, p + "mlp.w2", bias=False)
    x = norm(x, "vision.norm.weight")
    feats = lin(F.gelu(lin(merge_cells(x, g.rows, g.cols, v.downsample_ratio), "aligner.w1")), "aligner.w2")
    out = [t("image_start")]
    for i in range(g.llm_rows):
        out += list(feats[i * g.llm_cols : (i + 1) * g.llm_cols]) + [t("image_newline")]
    return torch.stack(out + [t("image_end")])


def test_tower_matches_an_independent_computation(ref, tiny_ckpt):
    image = regenerate.gradient_image()
    span = ref.vision.embed(image)
    want = naive_span(tiny_ckpt, image)
    assert span.shape == want.shape == (17, ref.config.text.hidden_size)
    assert torch.allclose(span.double(), want, atol=1e-4, rtol=1e-4)


def test_bf16_tower_stays_close_to_fp32(tiny_ckpt, ref):
    from deepinfer.regions.reference import ReferenceModel

    image = regenerate.gradient_image()
    bf = ReferenceModel(tiny_ckpt, dtype="bf16").vision.embed(image)
    assert bf.dtype == torch.bfloat16
    fp = ref.vision.embed(image)
    assert (bf.float() - fp).norm() / fp.norm() < 0.03


# --- the golden image prompt ---


def test_span_and_tokens_match_golden(ref):
    placed = regenerate.image_prompts(ref)
    rows = placed[0][1].embeds[placed[0][1].mask].double()
    got = [[float(r.mean()), float(r.square().mean().sqrt())] for r in rows]
    assert np.allclose(got, GOLDEN["span"], atol=1e-5)
    gens = decode_model(ref, [ids for ids, _ in placed], GOLDEN["max_new_tokens"], images=[e for _, e in placed])
    tolerance = GOLDEN["noise"]["fp32-noquant"]["tolerance"]
    assert tolerance == 1e-4
    for g, want in zip(gens, GOLDEN["modes"]["fp32-noquant"], strict=True):
        regenerate.check_run(g.tokens, g.logits, want, tolerance)


def test_golden_is_not_degenerate_and_the_image_matters(ref):
    for runs in GOLDEN["modes"].values():
        for run in runs:
            assert len(set(run["generated_ids"])) >= 3, run
    first = GOLDEN["modes"]["fp32-noquant"][0]
    assert first["prompt_ids"] == [0] + [259] * 17 + [75, 108]  # bos, the 17-position span, "Hi"
    assert decode_model(ref, [[0, 75, 108]], GOLDEN["max_new_tokens"])[0].generated != first["generated_ids"]


def test_image_positions_reach_engram_and_moe_as_image(ref):
    """Every span position is an image position: engram's token mask is off there and the MoE
    gets is_image (so it selects with bias_vl); text positions are untouched."""
    ((ids, emb),) = regenerate.image_prompts(ref, ["<image>Hi"])
    seen = {}
    invoke = ref.invoke

    def spy(layer, slot, *inputs):
        if slot == "moe":
            seen.setdefault("moe", inputs[2].clone())
        if slot == "engram":
            seen.setdefault("engram", inputs[3].clone())  # decode(h, rows, rows_s, token_mask)
        return invoke(layer, slot, *inputs)

    ref.invoke = spy
    try:
        decode_model(ref, [ids], 1, images=[emb])
    finally:
        del ref.invoke
    assert seen["moe"][0].tolist() == emb.mask.tolist()
    assert seen["engram"][0].tolist() == (~emb.mask).tolist()


def test_reference_cli_with_an_image(tiny_ckpt, tmp_path):
    from click.testing import CliRunner

    from deepinfer.cli import main

    image = regenerate.gradient_image()
    path = tmp_path / "grad.ppm"
    path.write_bytes(b"P6 28 20 255\n" + image.tobytes())
    want = GOLDEN["modes"]["fp32-noquant"]
    args = [
        "reference",
        str(tiny_ckpt),
        "--dtype",
        "fp32",
        "--no-cache-quant",
        "--json",
        "--image",
        str(path),
        "--max-new-tokens",
        str(GOLDEN["max_new_tokens"]),
    ]
    for run in want:
        args += ["--prompt", run["prompt"]]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    outputs = json.loads(res.output)["outputs"]
    assert [o["generated_ids"] for o in outputs] == [r["generated_ids"] for r in want]
    res = CliRunner().invoke(main, ["reference", str(tiny_ckpt), "--image", str(path), "--prompt", "<image><image>"])
    assert res.exit_code == 2 and "2 image placeholder(s)" in res.output and "1 image(s)" in res.output


# --- the bundle: the tower is host-side, so the text bundle takes images as compiled ---


def test_bundle_carries_the_tower_and_reproduces_the_reference(exported_bundle, tiny_ckpt, tmp_path, monkeypatch):
    from click.testing import CliRunner

    import deepinfer.runtime.ranks
    from deepinfer.bundles import manifest_io
    from deepinfer.regions.reference import ReferenceModel
    from deepinfer.runtime import RunOptions, generate, load
    from deepinfer.runtime.bundle import load_vision
    from deepinfer.runtime.cli import main as run_main

    m = manifest_io.read(exported_bundle)
    host = m.host["vision"]
    assert host.path == "host/vision.safetensors" and host.digest == m.files[host.path]
    session = load(exported_bundle)
    assert session.manifest.model.cache_quant and session.manifest.model.dtype == "fp32"
    ref = ReferenceModel(tiny_ckpt, dtype="fp32", cache_quant=True, ties="lowest")
    image = regenerate.gradient_image()
    assert torch.equal(load_vision(session.bundle).embed(image), ref.vision.embed(image))
    want = GOLDEN["modes"]["fp32-quant-lowest"]
    ((ids, emb),) = regenerate.image_prompts(ref, [want[1]["prompt"]])  # the API (prompt 0: the CLI below)
    options = RunOptions(max_new_tokens=GOLDEN["max_new_tokens"], images=(emb,), keep_logits=True)
    g = generate(session, [ids], options)[0]
    tolerance = GOLDEN["noise"]["fp32-quant-lowest"]["tolerance"]
    assert g.error is None
    regenerate.check_run(g.tokens, g.logits, want[1], tolerance)
    path = tmp_path / "grad.npy"
    np.save(path, image)
    monkeypatch.setattr(deepinfer.runtime.ranks, "load", lambda *args, **kwargs: session)  # loaded once (~10 s)
    res = CliRunner().invoke(
        run_main,
        [
            str(exported_bundle),
            "--json",
            "--image",
            str(path),
            "--prompt",
            want[0]["prompt"],
            "--max-new-tokens",
            str(GOLDEN["max_new_tokens"]),
            "--dump-logits",
            str(tmp_path / "run.st"),
        ],
    )
    assert res.exit_code == 0, res.output
    dumped = load_file(str(tmp_path / "run.st"))
    assert (
        json.loads(res.output)["outputs"][0]["generated_ids"] == dumped["tokens"].tolist()[len(want[0]["prompt_ids"]) :]
    )
    regenerate.check_run(dumped["tokens"].tolist(), list(dumped["logits"]), want[0], tolerance)
