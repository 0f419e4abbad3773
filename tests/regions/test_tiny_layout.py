"""The tiny checkpoint against MODEL.md's tables (names, shapes, dtypes), written out here."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

# MODEL.md "Checkpoint tensors": per-layer name -> (shape formula, dtype)
FP8 = "F8_E4M3"


def ceil32(x):
    return -(-x // 32)


def expected_tensors(cfg: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    t = cfg["text_config"]
    D, H, hd, q = t["hidden_size"], t["num_attention_heads"], t["head_dim"], t["q_lora_rank"]
    G, R, I, E, n = t["o_groups"], t["o_lora_rank"], t["moe_intermediate_size"], t["n_routed_experts"], t["hc_mult"]
    Hi, di = t["index_n_heads"], t["index_head_dim"]
    V = t["vocab_size"]
    out = {"embed.weight": ((V, D), "BF16"), "norm.weight": ((D,), "BF16"), "head.weight": ((V, D), "F32")}

    def fp8(name, rows, cols):
        out[name + ".weight"] = ((rows, cols), FP8)
        out[name + ".scale"] = ((ceil32(rows), ceil32(cols)), "F8_E8M0")

    def block(p, E):
        """A layer's (or a draft stage's) attention and MoE sites."""
        out[p + "attn_norm.weight"] = ((D,), "BF16")
        out[p + "ffn_norm.weight"] = ((D,), "BF16")
        for site in ("attn", "ffn"):
            out[p + f"hc_{site}_fn"] = (((2 + n) * n, n * D), "F32")
            out[p + f"hc_{site}_base"] = (((2 + n) * n,), "F32")
            out[p + f"hc_{site}_scale"] = ((3,), "F32")
        fp8(p + "attn.wq_a", q, D)
        out[p + "attn.q_norm.weight"] = ((q,), "BF16")
        fp8(p + "attn.wq_b", H * hd, q)
        fp8(p + "attn.wkv", hd, D)
        out[p + "attn.kv_norm.weight"] = ((hd,), "BF16")
        fp8(p + "attn.wo_a", G * R, H * hd // G)
        fp8(p + "attn.wo_b", D, G * R)
        out[p + "attn.attn_sink"] = ((H,), "F32")
        out[p + "ffn.gate.weight"] = ((E, D), "BF16")
        out[p + "ffn.gate.bias"] = ((E,), "F32")
        out[p + "ffn.gate.bias_vl"] = ((E,), "F32")
        for e in range(E):
            for w, (rows, cols) in (("w1", (I, D)), ("w3", (I, D)), ("w2", (D, I))):
                out[p + f"ffn.experts.{e}.{w}.weight"] = ((rows, cols // 2), "I8")
                out[p + f"ffn.experts.{e}.{w}.scale"] = ((rows, cols // 32), "F8_E8M0")
        fp8(p + "ffn.shared_experts.w1", I, D)
        fp8(p + "ffn.shared_experts.w3", I, D)
        fp8(p + "ffn.shared_experts.w2", D, I)

    # the DSpark draft (NeMo AutoModel's DeepseekV41DSparkModel under its released names)
    stages = t.get("num_nextn_predict_layers", 0)
    for k in range(stages):
        p = f"mtp.{k}."
        block(p, t["dspark_n_routed_experts"])
        if k == 0:
            fp8(p + "main_proj", D, D * len(t["dspark_target_layer_ids"]))
            out[p + "main_norm.weight"] = ((D,), "BF16")
        if k == stages - 1:
            Rm = t["dspark_markov_rank"]
            out[p + "norm.weight"] = ((D,), "BF16")
            out[p + "markov_head.embed.weight"] = out[p + "markov_head.head.weight"] = ((V, Rm), "BF16")
            out[p + "confidence_head.proj.weight"] = ((1, D + Rm), "F32")
    for L in range(t["num_hidden_layers"]):
        p = f"layers.{L}."
        block(p, E)
        ratio = t["compress_ratios"][L]
        if L in t["kv_source_layer_ids"]:
            out[p + "attn.compressor.wkv.weight"] = ((hd, D), "F32")
            if ratio > 1:
                out[p + "attn.compressor.wgate.weight"] = ((hd, D), "F32")
            out[p + "attn.compressor.norm.weight"] = ((hd,), "BF16")
            out[p + "attn.indexer.wk.weight"] = ((di, hd), "BF16")
            out[p + "attn.indexer.k_norm.weight"] = ((di,), "BF16")
        if L in t["index_source_layer_ids"]:
            fp8(p + "attn.indexer.wq_b", Hi * di, q)
            out[p + "attn.indexer.weights_proj.weight"] = ((Hi, D), "BF16")
        if L in t["engram_layer_ids"]:
            rows = t["engram_num_embeddings"][t["engram_layer_ids"].index(L)]
            ehd = t["engram_head_dim"]
            heads = (t["engram_max_ngram_size"] - 1) * t["engram_n_heads"]
            out[p + "engram.embed.weight"] = ((rows, ehd), FP8)
            out[p + "engram.embed.scale"] = ((rows, ehd // 32), "F8_E8M0")
            fp8(p + "engram.wkv", (n + 1) * D, heads * ehd)
            out[p + "engram.q_weight"] = ((n, D), "BF16")
            out[p + "engram.k_weight"] = ((n, D), "BF16")
    # MODEL.md "Vision tower (host-resident)": bf16 unless noted, norms f32
    v = cfg["vision_config"]
    Vd, Vi, P, r = v["hidden_size"], v["intermediate_size"], v["patch_size"], v["downsample_ratio"]
    if v["num_hidden_layers"]:
        out["vision.patch_embed.proj.weight"] = ((Vd, 3 * P * P), "BF16")
        out["vision.patch_embed.proj.bias"] = ((Vd,), "BF16")
        for j in range(v["num_hidden_layers"]):
            p = f"vision.blocks.{j}."
            out[p + "norm1.weight"] = out[p + "norm2.weight"] = ((Vd,), "F32")
            out[p + "attn.wqkv.weight"], out[p + "attn.wqkv.bias"] = ((3 * Vd, Vd), "BF16"), ((3 * Vd,), "BF16")
            out[p + "attn.wo.weight"], out[p + "attn.wo.bias"] = ((Vd, Vd), "BF16"), ((Vd,), "BF16")
            out[p + "mlp.w1.weight"], out[p + "mlp.w2.weight"] = ((2 * Vi, Vd), "BF16"), ((Vd, Vi), "BF16")
        out["vision.norm.weight"] = ((Vd,), "F32")
        out["aligner.w1.weight"], out["aligner.w1.bias"] = ((D, Vd * r * r), "BF16"), ((D,), "BF16")
        out["aligner.w2.weight"], out["aligner.w2.bias"] = ((D, D), "BF16"), ((D,), "BF16")
        for name in ("image_start", "image_end", "image_newline"):
            out[name] = ((D,), "BF16")
    return out


def read_layout(path):
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        header = json.loads(
            open(path / "model.safetensors", "rb").read(
                8 + int.from_bytes(open(path / "model.safetensors", "rb").read(8), "little")
            )[8:]
        )
        names = set(f.keys())
    return {k: (tuple(v["shape"]), v["dtype"]) for k, v in header.items() if k != "__metadata__"}, names


def test_every_tensor_matches_model_md(tiny_ckpt):
    cfg = json.loads((tiny_ckpt / "config.json").read_text())
    layout, names = read_layout(tiny_ckpt)
    expected = expected_tensors(cfg)
    assert set(layout) == set(expected), (sorted(set(layout) ^ set(expected)))[:10]
    wrong = {k: (layout[k], expected[k]) for k in expected if layout[k] != expected[k]}
    assert not wrong
    assert names == set(expected)
    index = json.loads((tiny_ckpt / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(expected)


def test_config_is_release_shaped_and_tiny_plan(tiny_ckpt):
    cfg = json.loads((tiny_ckpt / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v41"
    assert set(cfg) >= {"text_config", "vision_config", "quantization_config", "image_token_id"}
    t = cfg["text_config"]
    assert t["compress_ratios"] == [0, 0, 2, 2, 1, 1, 0, 0, 0]  # three draft stages, window-only
    assert t["num_nextn_predict_layers"] == 3 and t["dspark_target_layer_ids"] == [3, 4, 5]
    assert t["kv_source_layer_ids"] == [2, 4] and t["index_source_layer_ids"] == [2, 4, 5]
    assert t["candidate_source_layer_id"] == 4 and t["engram_layer_ids"] == [1]
    v = cfg["vision_config"]
    assert (v["num_hidden_layers"], v["hidden_size"], v["patch_size"], v["downsample_ratio"]) == (2, 64, 4, 2)
    assert cfg["image_token_id"] == 259
    assert t["engram_compressed_vocab_size"] == t["vocab_size"]
    assert cfg["quantization_config"]["weight_block_size"] == [32, 32]


def test_scales_follow_release_rule(tiny_ckpt):
    """fp8 blocks: scale = pow2ceil(amax / 448), so every block's max code is in (224, 448]."""
    with safe_open(str(tiny_ckpt / "model.safetensors"), "pt") as f:
        w = f.get_tensor("layers.0.attn.wq_a.weight").float()
        s = f.get_tensor("layers.0.attn.wq_a.scale").float()
        assert w.abs().max() <= 448
        blocks = w.unflatten(0, (-1, 32)).unflatten(2, (-1, 32)).abs().amax((1, 3))
        assert (blocks >= 224).all() and s.shape == blocks.shape
        e = f.get_tensor("layers.0.ffn.experts.3.w2.weight").view(torch.uint8)
        assert e.dtype == torch.uint8 and (e.int() & 0x77).any()  # both nibbles used


@pytest.mark.parametrize("layers", [7, 10])
def test_longer_variants_keep_every_kind(tmp_path, layers):
    from deepinfer.regions.config import load_config
    from deepinfer.regions.step import plan_layers
    from deepinfer.regions.tiny import make_tiny

    path = make_tiny(tmp_path / "t", layers=layers)
    c = load_config(path).text
    plans = plan_layers(c)
    kinds = {(p.attn, p.ratio, p.candidate_source, p.uses_candidates) for p in plans}
    assert {
        ("window", 0, False, False),
        ("source", 2, False, False),
        ("source", 1, True, False),
        ("reuse", 2, False, False),
        ("reindex", 1, False, True),
    } <= kinds
    assert any(p.engram_rows for p in plans)
    layout, _ = read_layout(path)
    assert set(layout) == set(expected_tensors(json.loads((path / "config.json").read_text())))


def test_deterministic(tmp_path):
    from deepinfer.regions.tiny import make_tiny

    a = make_tiny(tmp_path / "a", seed=3)
    b = make_tiny(tmp_path / "b", seed=3)
    c = make_tiny(tmp_path / "c", seed=4)
    read = lambda p: (p / "model.safetensors").read_bytes()  # noqa: E731
    assert read(a) == read(b) and read(a) != read(c)


def test_text_tensors_do_not_depend_on_the_vision_tower(tmp_path, monkeypatch):
    """The vision tensors come from their own generator: without them the text tensors are the same bytes."""
    from deepinfer.regions import tiny

    a = tiny.make_tiny(tmp_path / "a")
    monkeypatch.setattr(tiny, "_vision_tensors", lambda config, seed: {})
    b = tiny.make_tiny(tmp_path / "b")
    with safe_open(str(a / "model.safetensors"), "pt") as fa, safe_open(str(b / "model.safetensors"), "pt") as fb:
        assert set(fb.keys()) < set(fa.keys())
        for name in fb.keys():
            assert fa.get_tensor(name).view(-1).view(torch.uint8).equal(fb.get_tensor(name).view(-1).view(torch.uint8))


def test_text_tensors_do_not_depend_on_the_draft(tmp_path):
    """The DSpark draft comes from its own generator: without it the text tensors are the same bytes."""
    from deepinfer.regions.tiny import make_tiny

    a = make_tiny(tmp_path / "a")
    b = make_tiny(tmp_path / "b", draft=False)
    with safe_open(str(a / "model.safetensors"), "pt") as fa, safe_open(str(b / "model.safetensors"), "pt") as fb:
        assert {k for k in fa.keys() if not k.startswith("mtp.")} == set(fb.keys())
        for name in fb.keys():
            assert fa.get_tensor(name).view(-1).view(torch.uint8).equal(fb.get_tensor(name).view(-1).view(torch.uint8))
