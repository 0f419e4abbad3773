"""Synthetic checkpoints with the release's per-layer tensor shapes, any size.

For measuring what grows with the release (weight-pass throughput and memory, bundle
bytes, trace memory) without its 475 GiB: the released text dimensions (hidden 5120,
moe_intermediate 2304, 64 heads of 512, the real attention, indexer and engram
widths), with fewer layers, routed experts and engram rows. The layer pattern is the
tiny model's (every layer kind present, `regions/tiny.py`); every other text key is
the release's value (MODEL.md).

Values are random but valid in their formats (`regions/examples.stored_values`),
so the files can be compiled and run; they are no model. Files are written one
tensor at a time, in chunks (`CHUNK_BYTES`), at their final offsets: memory stays
bounded at any size. One file per layer plus one for the rest, with the index the
release ships.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from deepinfer.bundles.safetensors import layout_header, pwrite
from deepinfer.regions.checkpoint import written_checkpoint
from deepinfer.regions.config import parse_config
from deepinfer.regions.dspark import draft_specs
from deepinfer.regions.examples import ITEMSIZE, stored_values
from deepinfer.regions.plan import checkpoint_specs
from deepinfer.regions.tiny import tiny_config

CHUNK_BYTES = 32 << 20
# the released text dimensions (MODEL.md); layer ids, expert and engram row counts are chosen
RELEASE_DIMS = {
    "vocab_size": 129280,
    "hidden_size": 5120,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 1280,
    "o_lora_rank": 1024,
    "o_groups": 8,
    "max_position_embeddings": 1048576,
    "num_experts_per_tok": 6,
    "moe_intermediate_size": 2304,
    "sliding_window": 128,
    "index_n_heads": 32,
    "index_head_dim": 128,
    "index_topk": 512,
    "candidate_topk_blocks": 2048,
    "candidate_block_size": 8,
    "engram_max_ngram_size": 4,
    "engram_vocab_size": 16000000,
    "engram_n_heads": 8,
    "engram_head_dim": 256,
    "engram_compressed_vocab_size": 99092,
}


def synthetic_config(layers: int = 6, experts: int = 8, engram_rows: int = 65536) -> dict:
    """config.json of a release-dimension model with `layers` layers and `experts` routed experts."""
    config = tiny_config(layers)
    text = config["text_config"]
    text.update(
        RELEASE_DIMS,
        n_routed_experts=experts,
        num_experts_per_tok=min(RELEASE_DIMS["num_experts_per_tok"], experts),
        engram_num_embeddings=[engram_rows] * len(text["engram_layer_ids"]),
        num_nextn_predict_layers=0,
    )  # no DSpark draft (`mtp.*`) is written
    config["vision_config"] = {"model_type": "deepseek_v41_vision", "num_hidden_layers": 0}
    config["image_token_id"] = 129264
    config["generator"] = {
        "name": "deepinfer synthetic",
        "layers": layers,
        "experts": experts,
        "engram_rows": engram_rows,
    }
    return config


def release_geometry_config(experts: int = 8, engram_rows: int = 65536) -> dict:
    """config.json of a 7-layer model at the released dimensions whose layers are every region kind
    of the release: window-only (0, 1; engram on 1), the ratio-2 kv source (2) and a ratio-2 reuse
    layer (3), the ratio-1 kv and candidate source (4), a reindex layer (5) and a ratio-1 reuse
    layer (6, as the release's 21-23, which the tiny pattern lacks). Its tokenizer is byte-level,
    so engram's token map is the identity (`engram_compressed_vocab_size` = `vocab_size`), and the
    engram hash modulus is small enough for `engram_rows` (the release's 16M needs 384M rows, 98 GB
    per table; every tensor dimension stays the release's)."""
    config = synthetic_config(layers=7, experts=experts, engram_rows=engram_rows)
    text = config["text_config"]
    text.update(
        compress_ratios=[0, 0, 2, 2, 1, 1, 1],
        kv_source_layer_ids=[2, 4],
        index_source_layer_ids=[2, 4, 5],
        candidate_source_layer_id=4,
        engram_compressed_vocab_size=text["vocab_size"],
        engram_vocab_size=engram_rows // (2 * text["engram_n_heads"] * (text["engram_max_ngram_size"] - 1)),
    )
    config["generator"]["geometry"] = "release"
    return config


# the released layer schedule, expert and engram row counts and vision tower (MODEL.md)
RELEASE_SCHEDULE = {
    "num_hidden_layers": 40,
    "n_routed_experts": 384,
    "num_experts_per_tok": 6,
    "compress_ratios": [0, 0] + [2] * 18 + [1] * 20,
    "kv_source_layer_ids": [2, 8, 14, 20],
    "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
    "candidate_source_layer_id": 20,
    "engram_layer_ids": [1, 14],
    "engram_num_embeddings": [384006168, 384016682],
    "engram_pad_token_id": 2,
}
RELEASE_VISION = {
    "model_type": "deepseek_v41_vision",
    "num_hidden_layers": 32,
    "hidden_size": 1024,
    "num_attention_heads": 16,
    "intermediate_size": 2816,
    "patch_size": 14,
    "rope_theta": 10000.0,
    "downsample_ratio": 3,
    "max_image_tokens": 1024,
    "min_pixels": 295936,
    "max_wh_ratio": None,
}


def release_config() -> dict:
    """config.json of the release itself (its 40 layers, 384 experts, engram tables and vision tower):
    for planning and budgets only, far too large to write."""
    config = synthetic_config(layers=40, experts=384)
    config["text_config"].update(RELEASE_SCHEDULE)
    config["vision_config"] = dict(RELEASE_VISION)
    del config["generator"]  # nothing writes its tensors
    return config


def checkpoint_tensors(config: dict) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, safetensors dtype, shape) of every tensor the model's regions read, in layer order,
    then the DSpark draft's `mtp.*` (when the config has one) and the vision tower's (when it has
    one): what a compile reads of a checkpoint."""
    model = parse_config(config)
    c = model.text
    out: list[tuple[str, str, tuple[int, ...]]] = [("embed.weight", "BF16", (c.vocab_size, c.hidden_size))]
    for prefix, spec in checkpoint_specs(c) + (draft_specs(c) if c.has_draft else []):
        for e in range(spec.experts or 1):
            out.append((prefix + spec.key.format(e=e), spec.ckpt_dtype, spec.shape))
    if model.vision.num_hidden_layers > 0:
        from deepinfer.regions.vision import vision_specs

        out += [(name, dtype, shape) for name, (shape, dtype) in vision_specs(model.vision, c.hidden_size).items()]
    return out


def _file_of(name: str) -> str:
    layer = name.split(".")[1] if name.startswith("layers.") else None
    return f"model-layer-{int(layer):03d}.safetensors" if layer is not None else "model-rest.safetensors"


def checkpoint_bytes(config: dict) -> int:
    return sum(math.prod(s) * ITEMSIZE[d] for _, d, s in checkpoint_tensors(config))


def write_synthetic(out_dir: str | Path, config: dict, *, seed: int = 0, log=lambda msg: None) -> int:
    """Write the checkpoint of `config` to `out_dir` (atomically); returns its tensor bytes."""
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir}: exists and is not empty")
    tensors = checkpoint_tensors(config)
    by_file: dict[str, list] = {}
    for name, dtype, shape in tensors:
        by_file.setdefault(_file_of(name), []).append((name, dtype, shape, math.prod(shape) * ITEMSIZE[dtype]))
    rng = np.random.default_rng(seed)
    total = sum(e[3] for entries in by_file.values() for e in entries)
    done = 0
    with written_checkpoint(out_dir, config, {name: _file_of(name) for name, _, _ in tensors}, total) as tmp:
        for fname, entries in by_file.items():
            header, offsets = layout_header([(n, d, s, b) for n, d, s, b in entries], {"format": "pt"})
            path = str(tmp / fname)
            with open(path, "wb") as f:
                f.write(header)
                f.truncate(len(header) + sum(e[3] for e in entries))
            for name, dtype, _, nbytes in entries:
                step = CHUNK_BYTES - CHUNK_BYTES % ITEMSIZE[dtype]
                for a in range(0, nbytes, step):
                    n = min(step, nbytes - a)
                    pwrite(path, offsets[name] + a, stored_values(rng, name, dtype, n // ITEMSIZE[dtype]))
            done += sum(e[3] for e in entries)
            log(f"synthetic checkpoint: {fname} written ({done / 2**30:.2f} GiB so far)")
    return total
