"""The DeepSeek-V4.1 model config, parsed from a release's `config.json`.

The release nests the text model under `text_config`, the vision tower under
`vision_config` and the weight format under `quantization_config`. Parsing
checks every key this project uses for type and range, and the attention
schedule rules of MODEL.md (the DSpark draft's `dspark_*` keys among them, when
`num_nextn_predict_layers` > 0); other keys are kept untouched in `extra` so a
bundle can record them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from deepinfer.errors import ConfigError
from deepinfer.reader import load_json
from deepinfer.schema import Problem, Rules, build

CONFIG_FILE = "config.json"
# the quantization_config values deepinfer implements: fp8 e4m3 block weights whose scales are ue8m0
# (`X.scale`, F8_E8M0) or float32 (`X.weight_scale_inv`, DeepSeek-V3's), on the blocks of
# quant/stream_plan.SCALE_DTYPES, and fp4 experts; anything else would be read as if it were these
QUANT_VALUES = {
    "quant_method": ("fp8",),
    "activation_scheme": ("dynamic",),
    "scale_fmt": ("ue8m0",),
    "expert_dtype": ("fp4",),
    "fmt": ("e4m3",),
}
WEIGHT_BLOCKS = ((32, 32), (128, 128))
NESTED = ("text_config", "vision_config", "quantization_config")
EXTRA = Rules(unknown="extra")


@dataclass(frozen=True, kw_only=True)
class TextConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int = 1
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    max_position_embeddings: int = 1048576
    rms_norm_eps: float = 1e-20
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: dict | None = None
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int = 1
    moe_intermediate_size: int
    scoring_func: str = "sqrtsoftplus"
    topk_method: str = "noaux_tc"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    hidden_act: str = "silu"
    sliding_window: int
    compress_ratios: tuple[int, ...]
    kv_source_layer_ids: tuple[int, ...]
    index_source_layer_ids: tuple[int, ...]
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    candidate_source_layer_id: int = -1
    candidate_topk_blocks: int = 1
    candidate_block_size: int = 1
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    engram_layer_ids: tuple[int, ...] = ()
    engram_num_embeddings: tuple[int, ...] = ()
    engram_max_ngram_size: int = 4
    engram_vocab_size: int = 2
    engram_n_heads: int = 1
    engram_head_dim: int = 32
    engram_pad_token_id: int = 2
    engram_compressed_vocab_size: int = 0
    num_nextn_predict_layers: int = 0
    # the DSpark speculative draft (`mtp.0` .. `mtp.{num_nextn_predict_layers - 1}`, regions/dspark.py);
    # defaults are the release's, checked only when num_nextn_predict_layers > 0
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: tuple[int, ...] = (37, 38, 39)
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 128
    dspark_num_experts_per_tok: int = 3
    extra: dict = field(default_factory=dict)

    @property
    def has_draft(self) -> bool:
        """Whether the config describes a DSpark draft (its tensors are under `mtp.`)."""
        return self.num_nextn_predict_layers > 0

    @property
    def engram_hash_heads(self) -> int:
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads

    def engram_tables(self) -> list[tuple[str, str, int]]:
        """Per engram layer, in layer order: the checkpoint names of its table's fp8 rows
        ([rows, engram_head_dim]) and of their ue8m0 scales ([rows, engram_head_dim / 32]), and
        its row count. The names the host file keeps too (`host/engram.safetensors`)."""
        return [
            (f"layers.{layer}.engram.embed.weight", f"layers.{layer}.engram.embed.scale", rows)
            for layer, rows in zip(self.engram_layer_ids, self.engram_num_embeddings)
        ]

    def layer_kind(self, layer: int) -> str:
        """The attention kind of `layer`: window, source, reindex or reuse."""
        if self.compress_ratios[layer] == 0:
            return "window"
        if layer in self.kv_source_layer_ids:
            return "source"
        if layer in self.index_source_layer_ids:
            return "reindex"
        return "reuse"

    def kv_source_of(self, layer: int) -> int:
        """The latest kv source at or before `layer` (validated to exist)."""
        return max(s for s in self.kv_source_layer_ids if s <= layer)

    def uses_candidates(self, layer: int) -> bool:
        """Whether `layer`'s index selection is restricted to the candidate pool."""
        c = self.candidate_source_layer_id
        return 0 <= c < layer and layer in self.index_source_layer_ids


def draft_moe_config(c: TextConfig) -> TextConfig:
    """The text config as the DSpark draft's MoE sites see it (regions/dspark.py): the draft's routed
    experts. Here, beside the config, so that the weight pass's shards (compiler/shard.py) divide the
    draft's experts without importing the region classes."""
    return dataclasses.replace(
        c, n_routed_experts=c.dspark_n_routed_experts, num_experts_per_tok=c.dspark_num_experts_per_tok
    )


@dataclass(frozen=True, kw_only=True)
class VisionConfig:
    num_hidden_layers: int = 0
    hidden_size: int = 1024
    num_attention_heads: int = 16
    intermediate_size: int = 2816
    patch_size: int = 14
    rope_theta: float = 10000.0
    downsample_ratio: int = 3
    max_image_tokens: int = 1024
    min_pixels: int = 295936
    max_wh_ratio: float | None = None
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class QuantConfig:
    quant_method: str = "fp8"
    activation_scheme: str = "dynamic"
    weight_block_size: tuple[int, ...] = (32, 32)
    scale_fmt: str = "ue8m0"
    expert_dtype: str = "fp4"
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class V41Config:
    text: TextConfig
    vision: VisionConfig
    quant: QuantConfig
    bos_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int = 2
    image_token_id: int = 129264
    tie_word_embeddings: bool = False
    torch_dtype: str = "bfloat16"
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        """The release-shaped nested dict (what `config.json` holds)."""
        out = _flat(self)
        out["text_config"] = _flat(self.text)
        out["vision_config"] = _flat(self.vision)
        out["quantization_config"] = _flat(self.quant)
        return out

    def digest(self) -> str:
        """sha256 of the normalized config (sorted keys, no whitespace)."""
        text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()


def _flat(obj) -> dict:
    out = {}
    for f in dataclasses.fields(obj):
        if f.name in ("text", "vision", "quant", "extra"):
            continue
        value = getattr(obj, f.name)
        out[f.name] = list(value) if isinstance(value, tuple) else value
    out.update(obj.extra)
    return out


# ----------------------------------------------------------------------------- parsing


def _build(cls, data, source: str, key: tuple, **given):
    """`cls` from a config.json object; unknown keys are kept in `extra`."""
    try:
        return build(cls, data, key=key, rules=EXTRA, given=given)
    except Problem as p:
        where = p.dotted()
        raise ConfigError(f"{source}: {where + ': ' if where else ''}{p.message}") from None


def parse_config(data: dict, source: str = CONFIG_FILE) -> V41Config:
    """Parse and validate a release-shaped config dict; `source` names it in errors."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a JSON object at the top level")
    model_type = data.get("model_type")
    if model_type != "deepseek_v41":
        raise ConfigError(f"{source}: model_type is {model_type!r}, expected 'deepseek_v41'")
    if "text_config" not in data:
        raise ConfigError(f"{source}: missing required key text_config")
    top = {k: v for k, v in data.items() if k not in NESTED}
    config = _build(
        V41Config,
        top,
        source,
        (),
        text=_build(TextConfig, data["text_config"], source, ("text_config",)),
        vision=_build(VisionConfig, data.get("vision_config", {}), source, ("vision_config",)),
        quant=_build(QuantConfig, data.get("quantization_config", {}), source, ("quantization_config",)),
    )
    validate(config, source)
    validate_quant(config.quant, source)
    return config


def load_config(path: str | Path) -> V41Config:
    """Read `config.json` from a checkpoint directory (or the file itself)."""
    path = Path(path)
    if path.is_dir():
        path = path / CONFIG_FILE
    if not path.exists() and not path.is_symlink():
        raise ConfigError(f"{path}: no such file; a checkpoint directory needs {CONFIG_FILE}")
    return parse_config(load_json(path, error=ConfigError), str(path))


# ----------------------------------------------------------------------------- validation


def _require(cond: bool, source: str, key: str, message: str) -> None:
    if not cond:
        raise ConfigError(f"{source}: text_config.{key}: {message}")


def validate(config: V41Config, source: str = CONFIG_FILE) -> None:
    """Check value ranges and the attention schedule rules of MODEL.md, one part of the config at a time."""
    t = config.text
    _validate_sizes(t, source)
    _validate_routing(t, source)
    _validate_floats(t, source)
    _validate_schedule(t, source)
    _validate_candidates(t, source)
    _validate_engram(t, source)
    if t.has_draft:
        validate_draft(t, source)
    _validate_token_ids(config, source)


POSITIVE_SIZES = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "head_dim",
    "qk_rope_head_dim",
    "q_lora_rank",
    "o_lora_rank",
    "o_groups",
    "n_routed_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "sliding_window",
    "index_n_heads",
    "index_head_dim",
    "index_topk",
    "hc_mult",
    "hc_sinkhorn_iters",
)


def _validate_sizes(t: TextConfig, source: str) -> None:
    """The model's sizes: positive, one shared latent, heads in whole output groups, an even rope part."""
    for key in POSITIVE_SIZES:
        _require(getattr(t, key) > 0, source, key, f"must be a positive integer, got {getattr(t, key)}")
    _require(t.num_key_value_heads == 1, source, "num_key_value_heads", "V4.1 uses one shared latent (MQA); expected 1")
    _require(t.n_shared_experts == 1, source, "n_shared_experts", "expected 1")
    _require(
        t.num_attention_heads % t.o_groups == 0,
        source,
        "o_groups",
        f"must divide num_attention_heads={t.num_attention_heads}",
    )
    _require(
        t.qk_rope_head_dim % 2 == 0 and t.qk_rope_head_dim <= min(t.head_dim, t.index_head_dim),
        source,
        "qk_rope_head_dim",
        "must be even and at most head_dim and index_head_dim",
    )


def _validate_routing(t: TextConfig, source: str) -> None:
    """The MoE router: at most every routed expert per token, the scoring and activation implemented."""
    _require(
        t.num_experts_per_tok <= t.n_routed_experts,
        source,
        "num_experts_per_tok",
        f"must not exceed n_routed_experts={t.n_routed_experts}",
    )
    _require(t.scoring_func == "sqrtsoftplus", source, "scoring_func", "only 'sqrtsoftplus' is supported")
    _require(t.hidden_act == "silu", source, "hidden_act", "only 'silu' is supported")


def _validate_floats(t: TextConfig, source: str) -> None:
    for key in ("rms_norm_eps", "rope_theta", "compress_rope_theta", "hc_eps"):
        value = getattr(t, key)
        _require(math.isfinite(value) and value > 0, source, key, f"must be finite and positive, got {value}")


def _validate_schedule(t: TextConfig, source: str) -> None:
    """The attention schedule: a compress ratio per layer, sorted layer-id lists, every compressed
    layer after a kv source of its ratio."""
    n = t.num_hidden_layers
    _require(
        len(t.compress_ratios) >= n,
        source,
        "compress_ratios",
        f"has {len(t.compress_ratios)} entries, needs one per layer ({n})",
    )
    _require(all(r >= 0 for r in t.compress_ratios), source, "compress_ratios", "must be non-negative")
    for key in ("kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids"):
        ids = getattr(t, key)
        _require(
            list(ids) == sorted(set(ids)) and all(0 <= i for i in ids),
            source,
            key,
            f"must be strictly increasing non-negative layer ids, got {list(ids)}",
        )
    _require(
        set(t.kv_source_layer_ids) <= set(t.index_source_layer_ids),
        source,
        "kv_source_layer_ids",
        "every kv source must also be an index source (index_source_layer_ids)",
    )
    _validate_sources(t, source)


def _validate_sources(t: TextConfig, source: str) -> None:
    """Layers of ratio 0 are no sources; every compressed layer reads an earlier kv source of its ratio."""
    owner = None
    for layer in range(t.num_hidden_layers):
        ratio = t.compress_ratios[layer]
        if ratio == 0:
            _require(
                layer not in t.index_source_layer_ids,
                source,
                "index_source_layer_ids",
                f"layer {layer} has compress ratio 0 and cannot be a kv or index source",
            )
            continue
        if layer in t.kv_source_layer_ids:
            owner = ratio
        _require(
            owner == ratio,
            source,
            "compress_ratios",
            f"compressed layer {layer} (ratio {ratio}) needs an earlier kv source with the same ratio",
        )


def _validate_candidates(t: TextConfig, source: str) -> None:
    """The candidate pool: disabled (-1), or the last kv source with positive block sizes."""
    c = t.candidate_source_layer_id
    _require(c >= -1, source, "candidate_source_layer_id", "must be -1 (disabled) or a layer id")
    if c < 0:
        return
    _require(c in t.kv_source_layer_ids, source, "candidate_source_layer_id", f"layer {c} must be a kv source")
    _require(
        t.candidate_block_size > 0 and t.candidate_topk_blocks > 0,
        source,
        "candidate_block_size",
        "candidate_block_size and candidate_topk_blocks must be positive",
    )
    later_sources = [s for s in t.kv_source_layer_ids if s > c]
    _require(
        not later_sources,
        source,
        "kv_source_layer_ids",
        f"kv source {later_sources} after the candidate source {c} is not supported",
    )


def _validate_engram(t: TextConfig, source: str) -> None:
    """Engram: a row count per engram layer; with engram layers, n-grams of 2 or more and a pad token."""
    _require(
        len(t.engram_layer_ids) == len(t.engram_num_embeddings),
        source,
        "engram_num_embeddings",
        "needs one row count per engram_layer_ids entry",
    )
    if not t.engram_layer_ids:
        return
    _require(t.engram_max_ngram_size >= 2, source, "engram_max_ngram_size", "must be at least 2")
    _require(
        0 <= t.engram_pad_token_id < t.vocab_size,
        source,
        "engram_pad_token_id",
        "must be a token id inside the vocabulary",
    )
    _require(
        all(r > 0 for r in t.engram_num_embeddings), source, "engram_num_embeddings", "row counts must be positive"
    )


def _validate_token_ids(config: V41Config, source: str) -> None:
    """The top level's special tokens are inside the vocabulary."""
    vocab = config.text.vocab_size
    ids = {
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
        "image_token_id": config.image_token_id,
    }
    for key, value in ids.items():
        if not 0 <= value < vocab:
            raise ConfigError(f"{source}: {key} {value} is outside the vocabulary [0, {vocab})")


def validate_draft(t: TextConfig, source: str = CONFIG_FILE) -> None:
    """The DSpark draft's keys: a positive block, target layers inside the model, a Markov head, its
    own routed experts, sliding-window-only stages (compress ratio 0 where the schedule lists them)."""
    n, k = t.num_hidden_layers, t.num_nextn_predict_layers
    for key in ("dspark_block_size", "dspark_markov_rank", "dspark_n_routed_experts", "dspark_num_experts_per_tok"):
        _require(
            getattr(t, key) > 0,
            source,
            key,
            f"must be a positive integer when num_nextn_predict_layers is {k}, got {getattr(t, key)}",
        )
    _require(
        t.dspark_num_experts_per_tok <= t.dspark_n_routed_experts,
        source,
        "dspark_num_experts_per_tok",
        f"must not exceed dspark_n_routed_experts={t.dspark_n_routed_experts}",
    )
    ids = list(t.dspark_target_layer_ids)
    _require(
        bool(ids) and ids == sorted(set(ids)) and all(0 <= i < n for i in ids),
        source,
        "dspark_target_layer_ids",
        f"must be strictly increasing layer ids in [0, {n}), got {ids}",
    )
    _require(
        0 <= t.dspark_noise_token_id < t.vocab_size,
        source,
        "dspark_noise_token_id",
        f"{t.dspark_noise_token_id} is outside the vocabulary [0, {t.vocab_size})",
    )
    stages = list(t.compress_ratios[n : n + k])
    _require(
        all(r == 0 for r in stages),
        source,
        "compress_ratios",
        f"the draft's stages (entries {n}..{n + k - 1}) must be sliding-window only (0), got {stages}",
    )


def validate_quant(q: QuantConfig, source: str = CONFIG_FILE) -> None:
    """Refuse a quantization_config value deepinfer does not implement, rather than ignore it."""
    given = {f.name: getattr(q, f.name) for f in dataclasses.fields(q) if f.name != "extra"} | q.extra
    for key, valid in QUANT_VALUES.items():
        if key in given and given[key] not in valid:
            raise ConfigError(
                f"{source}: quantization_config.{key}: {given[key]!r} is not implemented; "
                f"valid: {', '.join(map(repr, valid))}"
            )
    if q.weight_block_size not in WEIGHT_BLOCKS:
        raise ConfigError(
            f"{source}: quantization_config.weight_block_size: {list(q.weight_block_size)} is not implemented; "
            f"valid: {', '.join(str(list(b)) for b in WEIGHT_BLOCKS)}"
        )
