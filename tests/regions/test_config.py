"""config.json parsing: release shape, types, and the attention schedule rules."""

from __future__ import annotations

import copy
import json

import pytest

from deepinfer.errors import ConfigError
from deepinfer.regions.config import load_config, parse_config
from deepinfer.regions.tiny import tiny_config

RELEASED_TEXT = {  # MODEL.md's released (Flash) values
    "vocab_size": 129280,
    "hidden_size": 5120,
    "num_hidden_layers": 40,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 1280,
    "o_lora_rank": 1024,
    "o_groups": 8,
    "max_position_embeddings": 1048576,
    "rms_norm_eps": 1e-20,
    "rope_theta": 10000,
    "compress_rope_theta": 160000,
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": 65536,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "n_routed_experts": 384,
    "num_experts_per_tok": 6,
    "n_shared_experts": 1,
    "moe_intermediate_size": 2304,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "hidden_act": "silu",
    "sliding_window": 128,
    "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0] * 3,
    "kv_source_layer_ids": [2, 8, 14, 20],
    "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
    "index_n_heads": 32,
    "index_head_dim": 128,
    "index_topk": 512,
    "candidate_source_layer_id": 20,
    "candidate_topk_blocks": 2048,
    "candidate_block_size": 8,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "engram_layer_ids": [1, 14],
    "engram_num_embeddings": [384006168, 384016682],
    "engram_max_ngram_size": 4,
    "engram_vocab_size": 16000000,
    "engram_n_heads": 8,
    "engram_head_dim": 256,
    "engram_pad_token_id": 2,
    "engram_compressed_vocab_size": 99092,
    "num_nextn_predict_layers": 3,
    "dspark_block_size": 5,
}


def released() -> dict:
    return {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "text_config": dict(RELEASED_TEXT, model_type="deepseek_v41_text"),
        "vision_config": {"model_type": "deepseek_v41_vision", "num_hidden_layers": 32},
        "quantization_config": {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "weight_block_size": [32, 32],
            "scale_fmt": "ue8m0",
            "expert_dtype": "fp4",
        },
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "image_token_id": 129264,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


def test_released_config_parses_with_its_plan():
    from deepinfer.regions.step import plan_layers

    cfg = parse_config(released())
    t = cfg.text
    assert t.hidden_size == 5120 and t.compress_ratios[20] == 1 and t.engram_hash_heads == 24
    assert cfg.quant.weight_block_size == (32, 32) and cfg.vision.num_hidden_layers == 32
    assert t.extra["model_type"] == "deepseek_v41_text"  # unknown keys kept, not dropped
    assert t.dspark_block_size == 5 and t.dspark_target_layer_ids == (37, 38, 39) and t.has_draft
    kinds = {p.layer: p.attn for p in plan_layers(t)}
    assert [kinds[i] for i in (0, 1, 2, 3, 8, 20, 21, 24, 25)] == [
        "window",
        "window",
        "source",
        "reuse",
        "source",
        "source",
        "reuse",
        "reindex",
        "reuse",
    ]
    plans = plan_layers(t)
    assert plans[24].uses_candidates and plans[20].candidate_source and not plans[14].uses_candidates
    assert plans[23].kv_source == 20 and plans[19].kv_source == 14


def test_roundtrip_and_digest():
    a = parse_config(released())
    b = parse_config(a.to_dict())
    assert a == b and a.digest() == b.digest()
    changed = released()
    changed["text_config"]["index_topk"] = 256
    assert parse_config(changed).digest() != a.digest()


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d["text_config"].update(hidden_size="5120"), "text_config.hidden_size: expected int"),
        (lambda d: d["text_config"].pop("head_dim"), "missing required key(s) head_dim"),
        (lambda d: d.update(model_type="llama"), "expected 'deepseek_v41'"),
        (lambda d: d["text_config"].update(kv_source_layer_ids=[2, 8, 14, 21]), "kv source must also be an index"),
        (lambda d: d["text_config"].update(index_source_layer_ids=[1, 2, 8, 14, 20]), "layer 1 has compress ratio 0"),
        (
            lambda d: d["text_config"].update(kv_source_layer_ids=[8, 14, 20], index_source_layer_ids=[8, 14, 20]),
            "layer 2 (ratio 2) needs an earlier",
        ),
        (lambda d: d["text_config"].update(o_groups=7), "o_groups"),
        (lambda d: d["text_config"].update(candidate_source_layer_id=24), "must be a kv source"),
        (lambda d: d["text_config"].update(engram_num_embeddings=[5]), "one row count per"),
        (lambda d: d["text_config"].update(compress_ratios=[0, 0]), "needs one per layer"),
        (lambda d: d.update(image_token_id=10**7), "outside the vocabulary"),
        (lambda d: d["text_config"].update(dspark_target_layer_ids=[38, 37]), "dspark_target_layer_ids: must be"),
        (lambda d: d["text_config"].update(dspark_target_layer_ids=[39, 40]), "got .39, 40."),
        (lambda d: d["text_config"].update(dspark_markov_rank=0), "dspark_markov_rank: must be a positive"),
        (lambda d: d["text_config"].update(dspark_num_experts_per_tok=200), "must not exceed dspark_n_routed"),
        (lambda d: d["text_config"].update(dspark_noise_token_id=129280), "dspark_noise_token_id: 129280 is outside"),
        (lambda d: d["text_config"].update(compress_ratios=[0, 0] + [2] * 18 + [1] * 21), "sliding-window only"),
    ],
)
def test_bad_configs_name_the_key(mutate, message):
    d = copy.deepcopy(released())
    mutate(d)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_config(d, "ckpt/config.json")


def test_load_config_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"config.json: is not valid JSON"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(tiny_config()))
    assert load_config(tmp_path).text.num_hidden_layers == 6
