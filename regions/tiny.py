"""`deepinfer make-tiny`: a deterministic random V4.1 checkpoint in the release layout.

Same file layout, tensor names and storage dtypes as the release (config.json,
model.safetensors and its index; fp8 e4m3 weights with [32, 32] F8_E8M0 scales,
fp4 experts two a byte with per-32 F8_E8M0 scales, bf16 norms and embeddings,
f32 hyper-connection parameters, fp8 engram tables with per-row scales), at a
size that runs in milliseconds. Every layer kind is present (MODEL.md's tiny
layer plan); `layers` > 6 repeats the pattern. Weights are scaled so that
activations stay near unit RMS and greedy generation moves through many tokens.
The tokenizer is byte-level (`deepinfer.regions.tokenizer`). A tiny vision
tower (2 blocks of width 64, patch 4, 2 x 2 merge) and the DSpark draft (3
stages, `mtp.*`, 4 experts top-2, Markov rank 32, reading the last 3 layers)
come from generators of their own, drawn after the text tensors, so the text
tensors are the same bytes with or without them.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from deepinfer.errors import ConfigError
from deepinfer.quant.blockfp8 import quantize_fp8_blocks, quantize_fp8_float_scales
from deepinfer.quant.fp4 import quantize_mxfp4
from deepinfer.quant.fp8 import E4M3FN_MAX, e4m3fn_encode
from deepinfer.quant.ue8m0 import UE8M0_LUT, scale_bytes_for
from deepinfer.reader import ReadError, load_json
from deepinfer.regions.checkpoint import INDEX_FILE, SINGLE_FILE, written_checkpoint
from deepinfer.regions.config import CONFIG_FILE, parse_config
from deepinfer.regions.dspark import draft_specs
from deepinfer.regions.plan import checkpoint_specs
from deepinfer.regions.vision import vision_specs

MIN_LAYERS = 6
MAX_LAYERS = 1024  # about 0.6 GiB of checkpoint, drawn in host memory first: far past any test's need
SPACE_MARGIN = 64 << 20  # the config, the index and the file system's own
VISION_STREAM = 0x5649  # the vision tensors' generator: default_rng((seed, VISION_STREAM))
DRAFT_STREAM = 0x4D5450  # the DSpark draft's (`mtp.*`) generator: default_rng((seed, DRAFT_STREAM))
SCALES = ("ue8m0", "fp32")  # fp8 block scales: the release's, or DeepSeek-V3's float32 [128, 128]
FLOAT_SCALE_BLOCK = 128
JsonObject = dict[str, Any]  # one object of config.json, as json.dump writes it


def tiny_config(layers: int = MIN_LAYERS) -> dict:
    """The release-shaped config.json of a tiny model with `layers` layers."""
    if layers < MIN_LAYERS:
        raise ConfigError(
            f"--layers {layers}: a tiny model needs at least {MIN_LAYERS} layers to hold every layer kind"
        )
    if layers > MAX_LAYERS:
        raise ConfigError(
            f"--layers {layers}: a tiny model holds at most {MAX_LAYERS} layers (about 0.6 MiB each, drawn "
            "in memory before it is written); the released model has 40"
        )
    return {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "text_config": _text_config(layers),
        "vision_config": _vision_config(),
        "quantization_config": _quantization_config(),
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "image_token_id": 259,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


def _text_config(layers: int) -> JsonObject:
    """`text_config`: the sizes, the MoE, the attention schedule, engram and the DSpark draft, in that order."""
    text = _text_sizes(layers) | _text_moe() | _text_attention(layers) | _text_engram() | _text_draft(layers)
    text["compress_ratios"] += [0] * text["num_nextn_predict_layers"]  # the draft's stages, as released
    return text


def _text_sizes(layers: int) -> JsonObject:
    return {
        "model_type": "deepseek_v41_text",
        "vocab_size": 288,
        "hidden_size": 256,
        "num_hidden_layers": layers,
        "num_attention_heads": 8,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "qk_rope_head_dim": 16,
        "q_lora_rank": 64,
        "o_lora_rank": 32,
        "o_groups": 2,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-20,
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 16,
            "original_max_position_embeddings": 65536,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    }


def _text_moe() -> JsonObject:
    return {
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "moe_intermediate_size": 64,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "swiglu_limit": 10.0,
        "hidden_act": "silu",
    }


def _text_attention(layers: int) -> JsonObject:
    """The attention schedule: two window layers, then ratio-2 and ratio-1 layers after a kv source each
    (the same kinds at any depth), the candidate pool on the last source; the hyper-connections."""
    n2 = (layers - 2) // 2
    src2, src1 = 2, 2 + n2
    reindex = list(range(src1 + 1, layers))
    return {
        "sliding_window": 8,
        "compress_ratios": [0, 0] + [2] * n2 + [1] * (layers - 2 - n2),
        "kv_source_layer_ids": [src2, src1],
        "index_source_layer_ids": [src2, src1] + reindex,
        "index_n_heads": 4,
        "index_head_dim": 32,
        "index_topk": 6,
        "candidate_source_layer_id": src1,
        "candidate_topk_blocks": 2,
        "candidate_block_size": 4,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
    }


def _text_engram() -> JsonObject:
    return {
        "engram_layer_ids": [1],
        "engram_num_embeddings": [4096],
        "engram_max_ngram_size": 3,
        "engram_vocab_size": 1000,
        "engram_n_heads": 2,
        "engram_head_dim": 32,
        "engram_pad_token_id": 2,
        "engram_compressed_vocab_size": 288,
    }


def _text_draft(layers: int) -> JsonObject:
    return {
        "num_nextn_predict_layers": 3,
        "dspark_block_size": 5,
        "dspark_noise_token_id": 287,
        "dspark_target_layer_ids": [layers - 3, layers - 2, layers - 1],
        "dspark_markov_rank": 32,
        "dspark_n_routed_experts": 4,
        "dspark_num_experts_per_tok": 2,
    }


def _vision_config() -> JsonObject:
    return {
        "model_type": "deepseek_v41_vision",
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "patch_size": 4,
        "rope_theta": 10000.0,
        "downsample_ratio": 2,
        "max_image_tokens": 64,
        "min_pixels": 256,
        "max_wh_ratio": None,
    }


def _quantization_config() -> JsonObject:
    return {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [32, 32],
        "scale_fmt": "ue8m0",
        "expert_dtype": "fp4",
    }


def _dense_float(rng: np.random.Generator, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Values of an unquantized tensor, by what it is."""
    if name.endswith(("norm.weight", "q_weight", "k_weight")):
        return 1 + 0.1 * rng.standard_normal(shape)
    if name.endswith(("_fn",)):
        return 0.03 * rng.standard_normal(shape)
    if name.endswith("_base"):
        return 0.5 * rng.standard_normal(shape)
    if name.endswith("_scale"):
        return 1 + 0.1 * rng.standard_normal(shape)
    if name.endswith("attn_sink"):
        return rng.standard_normal(shape)
    if name.endswith(("gate.bias", "gate.bias_vl")):
        return 0.1 * rng.standard_normal(shape)
    return rng.standard_normal(shape) / np.sqrt(shape[-1])  # projections: unit output RMS


ENGRAM_TABLE = "engram.embed.weight"  # a layer's engram table: per-row scales, unit rows


def _fp8_rows(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-row fp8 with one ue8m0 scale per 32 columns (engram tables)."""
    rows, cols = w.shape
    g = w.reshape(rows, cols // 32, 32)
    scales = scale_bytes_for(np.abs(g).max(-1), E4M3FN_MAX)  # [rows, cols/32]
    codes = e4m3fn_encode((g / UE8M0_LUT[scales][..., None]).astype(np.float32))
    return codes.reshape(rows, cols), scales


def _draw(rng: np.random.Generator, specs, scales: str, out: dict[str, torch.Tensor]) -> None:
    """Random values for each (prefix, spec), in order, into `out` in checkpoint storage."""
    for prefix, spec in specs:
        if spec.ckpt_dtype == "F8_E8M0":
            continue  # written with its weight
        count = spec.experts or 1
        for e in range(count):
            key = prefix + spec.key.format(e=e)
            scale_key = key.removesuffix(".weight") + ".scale"
            if spec.ckpt_dtype == "F8_E4M3":
                rows, cols = spec.shape
                w = (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)
                if spec.key == ENGRAM_TABLE:
                    w = rng.standard_normal((rows, cols)).astype(np.float32)
                    codes, s = _fp8_rows(w)
                elif scales == "fp32":
                    codes, inv = quantize_fp8_float_scales(w, FLOAT_SCALE_BLOCK)
                    out[key] = torch.from_numpy(codes).view(torch.float8_e4m3fn)
                    out[key + "_scale_inv"] = torch.from_numpy(inv)
                    continue
                else:
                    codes, s = quantize_fp8_blocks(w)
                out[key] = torch.from_numpy(codes).view(torch.float8_e4m3fn)
                out[scale_key] = torch.from_numpy(s).view(torch.float8_e8m0fnu)
            elif spec.ckpt_dtype == "I8":
                rows, half = spec.shape
                w = (rng.standard_normal((rows, half * 2)) / np.sqrt(half * 2)).astype(np.float32)
                packed, s = quantize_mxfp4(w)
                out[key] = torch.from_numpy(packed).view(torch.int8)
                out[scale_key] = torch.from_numpy(s).view(torch.float8_e8m0fnu)
            else:
                dtype = torch.bfloat16 if spec.ckpt_dtype == "BF16" else torch.float32
                values = _dense_float(rng, key, spec.shape).astype(np.float32)
                out[key] = torch.from_numpy(values).to(dtype)


def _tensors(config: dict, seed: int, scales: str = "ue8m0") -> dict[str, torch.Tensor]:
    cfg = parse_config(config)
    c = cfg.text
    rng = np.random.default_rng(seed)
    out = {
        "embed.weight": torch.from_numpy(rng.standard_normal((c.vocab_size, c.hidden_size)).astype(np.float32)).to(
            torch.bfloat16
        )
    }
    _draw(rng, checkpoint_specs(c), scales, out)
    return out


def _draft_tensors(config: dict, seed: int, scales: str) -> dict[str, torch.Tensor]:
    """The DSpark draft's `mtp.*` tensors, from their own generator (the text tensors do not move
    with or without them)."""
    c = parse_config(config).text
    out: dict[str, torch.Tensor] = {}
    if c.has_draft:
        _draw(np.random.default_rng((seed, DRAFT_STREAM)), draft_specs(c), scales, out)
    return out


def _vision_tensors(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """The vision tower, aligner and delimiters, from their own generator (the text tensors
    do not move when these change)."""
    cfg = parse_config(config)
    rng = np.random.default_rng((seed, VISION_STREAM))
    out = {}
    for name, (shape, dtype) in vision_specs(cfg.vision, cfg.text.hidden_size).items():
        if ".norm" in name:
            values = 1 + 0.1 * rng.standard_normal(shape)
        elif name.endswith(".bias"):
            values = 0.1 * rng.standard_normal(shape)
        elif name.startswith("image_"):
            values = rng.standard_normal(shape)  # like embedding rows
        else:
            values = rng.standard_normal(shape) / np.sqrt(shape[-1])
        out[name] = torch.from_numpy(values.astype(np.float32)).to(torch.bfloat16 if dtype == "BF16" else torch.float32)
    return out


def planned_bytes(config: dict) -> int:
    """The bytes of the checkpoint's tensors, from their specs (nothing drawn)."""
    cfg = parse_config(config)
    c = cfg.text
    specs = [s for _, s in checkpoint_specs(c)] + ([s for _, s in draft_specs(c)] if c.has_draft else [])
    total = c.vocab_size * c.hidden_size * 2  # the bf16 embedding
    for spec in specs:
        total += _numel(spec.shape) * spec.dtype.itemsize * (spec.experts or 1)
    for shape, dtype in vision_specs(cfg.vision, c.hidden_size).values():
        total += _numel(shape) * (2 if dtype == "BF16" else 4)
    return total


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _check_room(out_dir: Path, layers: int, need: int) -> None:
    """Refuse, before drawing anything, a checkpoint the output's file system has no room for."""
    where = out_dir.absolute().parent
    while not where.exists():
        where = where.parent
    free = shutil.disk_usage(where).free
    if need + SPACE_MARGIN > free:
        raise ConfigError(
            f"--layers {layers}: the checkpoint needs about {(need + SPACE_MARGIN) / 2**20:.0f} MiB and "
            f"{where} has {free / 2**20:.0f} MiB free; free space, choose fewer layers or another directory"
        )


def _is_same_tiny(path: Path, config: dict) -> bool:
    try:
        return (
            load_json(path / CONFIG_FILE) == config and (path / SINGLE_FILE).exists() and (path / INDEX_FILE).exists()
        )
    except ReadError:  # not a tiny checkpoint: make-tiny refuses to write over it
        return False


def make_tiny(
    out_dir: str | Path,
    *,
    seed: int = 0,
    layers: int = MIN_LAYERS,
    exist_ok: bool = False,
    scales: str = "ue8m0",
    draft: bool = True,
) -> Path:
    """Write the tiny checkpoint to `out_dir` (atomically: a sibling temp dir, then rename).

    `scales` "fp32" stores the fp8 block weights as DeepSeek-V3-style checkpoints do: float32
    `X.weight_scale_inv` on [128, 128] blocks instead of `X.scale` (the same float weights,
    quantized so; engram tables and fp4 experts keep their ue8m0 scales). With `exist_ok`, a
    directory that already holds a complete tiny checkpoint of the same seed, layer count and
    scales is kept as it is. Without `draft`, the checkpoint has no DSpark draft
    (`num_nextn_predict_layers` 0, no `mtp.*` tensors); the text tensors are the same bytes.
    """
    if scales not in SCALES:
        raise ConfigError(f"--scales {scales!r}: valid: {', '.join(SCALES)}")
    if seed < 0:
        raise ConfigError(f"seed {seed}: must be at least 0")
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"{out_dir}: is a file; make-tiny writes a checkpoint directory")
    config = tiny_config(layers)
    config["generator"] = {"name": "deepinfer make-tiny", "seed": seed}
    if not draft:
        config["generator"]["draft"] = False
        config["text_config"]["num_nextn_predict_layers"] = 0
    if scales == "fp32":
        config["generator"]["scales"] = scales
        q = config["quantization_config"]  # as DeepSeek-V3's config.json words it
        del q["scale_fmt"]
        q.update(fmt="e4m3", weight_block_size=[FLOAT_SCALE_BLOCK] * 2)
    if out_dir.exists() and any(out_dir.iterdir()):
        if exist_ok and _is_same_tiny(out_dir, config):
            return out_dir
        raise ConfigError(
            f"{out_dir}: exists and is not empty"
            + (" and holds a different checkpoint (seed or layers)" if exist_ok else "")
            + "; choose a new directory"
        )
    _check_room(out_dir, layers, planned_bytes(config))
    tensors = _tensors(config, seed, scales)
    tensors.update(_draft_tensors(config, seed, scales))
    tensors.update(_vision_tensors(config, seed))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with written_checkpoint(out_dir, config, dict.fromkeys(tensors, SINGLE_FILE), total) as tmp:
        # one metadata key only: safetensors writes several in random order
        save_file(tensors, str(tmp / SINGLE_FILE), metadata={"format": "pt"})
    return out_dir
