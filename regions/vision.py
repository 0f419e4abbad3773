"""The vision tower and aligner, host-side: images -> embeddings of their text span.

What comes from where (MODEL.md "Vision tower (host-resident)" is the spec;
NeMo AutoModel 0.7.0's `deepseek_v41/vision.py`, which reuses its V4
`deepseek_v4/vision.py`, and `deepseek_v41/processing.py` / `model.py`
settled what MODEL.md leaves open):

- tensors, shapes and dtypes, the block structure (pre-norm attention then
  SwiGLU MLP, residuals), the 2-D rotary split (half the rotary channels for
  the patch row, half for the column, split-half rotation), the aligner
  (pad to a multiple of r, merge r x r cells in unfold order, `w2(gelu(w1))`)
  and the span layout: MODEL.md.
- from NeMo: the vision RMSNorms use eps 1e-6 (not the text `rms_norm_eps`),
  normalise in fp32 and apply their fp32 weight before casting back; every
  channel of a head is rotary (rotary width = head_dim, so rows use channel
  pairs (i, i + hd/2) for i < hd/4 and columns the next hd/4), with
  `inv_freq[k] = theta^(-2k / (hd/2))`, k < hd/4, computed in fp32;
  attention is unmasked softmax(q k^T / sqrt(hd)) per head; `mlp.w1`'s first
  half is the gate (`w2(silu(gate) * up)`, no clamp); unfold order means the
  merged feature index is `c * r*r + i * r + j` (channel-major, then the row
  and column inside the cell), cells row-major, zero padding at the bottom
  and right; GELU is the exact (erf) one; linears carry biases except the
  MLP's. Every position of the span (start, features, newlines, end) counts
  as an image position: engram skips it and the MoE gate uses `bias_vl`.
  NeMo also drops an `image_pad` tensor of the release; deepinfer does too.
- image sizing and pixels: `deepinfer.regions.image`.

The tower computes in the model's activation dtype (bf16 as released; fp32
for exact comparisons) with the norms' fp32 weights as above; its output
rows are cast to that dtype, as the text embedding is.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from deepinfer.errors import ConfigError
from deepinfer.regions.config import V41Config, VisionConfig
from deepinfer.regions.image import ImageGrid, preprocess

VISION_EPS = 1e-6
DELIMITERS = ("image_start", "image_end", "image_newline")


def vision_specs(v: VisionConfig, hidden: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every checkpoint tensor of the tower, aligner and delimiters -> (shape, safetensors dtype)."""
    Vd, Vi, P, r = v.hidden_size, v.intermediate_size, v.patch_size, v.downsample_ratio
    out = {"vision.patch_embed.proj.weight": ((Vd, 3 * P * P), "BF16"), "vision.patch_embed.proj.bias": ((Vd,), "BF16")}
    for j in range(v.num_hidden_layers):
        p = f"vision.blocks.{j}."
        out.update(
            {
                p + "norm1.weight": ((Vd,), "F32"),
                p + "norm2.weight": ((Vd,), "F32"),
                p + "attn.wqkv.weight": ((3 * Vd, Vd), "BF16"),
                p + "attn.wqkv.bias": ((3 * Vd,), "BF16"),
                p + "attn.wo.weight": ((Vd, Vd), "BF16"),
                p + "attn.wo.bias": ((Vd,), "BF16"),
                p + "mlp.w1.weight": ((2 * Vi, Vd), "BF16"),
                p + "mlp.w2.weight": ((Vd, Vi), "BF16"),
            }
        )
    out["vision.norm.weight"] = ((Vd,), "F32")
    out.update(
        {
            "aligner.w1.weight": ((hidden, Vd * r * r), "BF16"),
            "aligner.w1.bias": ((hidden,), "BF16"),
            "aligner.w2.weight": ((hidden, hidden), "BF16"),
            "aligner.w2.bias": ((hidden,), "BF16"),
        }
    )
    out.update({name: ((hidden,), "BF16") for name in DELIMITERS})
    return out


def check_vision(v: VisionConfig, source: str = "config.json") -> None:
    """The shapes the tower needs, as ConfigErrors naming the key."""
    if v.num_hidden_layers <= 0:
        raise ConfigError(
            f"{source}: vision_config.num_hidden_layers is {v.num_hidden_layers}: this checkpoint "
            "has no vision tower, so it cannot take images"
        )
    heads = v.num_attention_heads
    if heads <= 0 or v.hidden_size % heads or (v.hidden_size // heads) % 4:
        raise ConfigError(
            f"{source}: vision_config.num_attention_heads {heads} must divide hidden_size "
            f"{v.hidden_size} into heads whose width is a multiple of 4 (2-D rotary halves)"
        )
    for key in ("patch_size", "downsample_ratio", "intermediate_size"):
        if getattr(v, key) <= 0:
            raise ConfigError(f"{source}: vision_config.{key} must be positive, got {getattr(v, key)}")


# ----------------------------------------------------------------------------- pieces


def rope_2d(rows: int, cols: int, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos, sin [rows * cols, head_dim / 2] fp32 for row-major patches: row angles, then column angles."""
    quarter = head_dim // 4
    inv_freq = 1.0 / theta ** (torch.arange(quarter, dtype=torch.float32) * 2 / (head_dim // 2))
    r = torch.arange(rows, dtype=torch.float32).repeat_interleave(cols)  # patch row
    c = torch.arange(cols, dtype=torch.float32).repeat(rows)  # patch column
    angles = torch.cat([r[:, None] * inv_freq, c[:, None] * inv_freq], dim=-1)  # [N, hd/2]
    return angles.cos(), angles.sin()


def apply_rope_2d(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [N, H, hd]: channel i rotates with channel i + hd/2 (split halves), in fp32."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[:, None], sin[:, None]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def rms_norm(x: Tensor, weight: Tensor) -> Tensor:
    """fp32 normalisation, fp32 weight applied, then cast back."""
    xf = x.float()
    return (weight * (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + VISION_EPS))).to(x.dtype)


def merge_cells(x: Tensor, rows: int, cols: int, r: int) -> Tensor:
    """[rows * cols, C] -> [ceil(rows/r) * ceil(cols/r), C * r * r]: zero-pad, r x r cells in unfold order."""
    grid = x.view(rows, cols, -1).permute(2, 0, 1)  # [C, rows, cols]
    grid = F.pad(grid, (0, -cols % r, 0, -rows % r))
    return F.unfold(grid.unsqueeze(0), r, stride=r)[0].transpose(0, 1)


# ----------------------------------------------------------------------------- the tower


class VisionTower(nn.Module):
    """ViT + aligner + delimiters, loaded from tensors under their checkpoint names.

    `get(name, dtype, shape)` returns a checkpoint tensor, checked (a
    `Checkpoint.get`, or `tensor_getter` over a bundle's host file).
    """

    def __init__(
        self,
        config: V41Config,
        get: Callable[[str, str, tuple], Tensor],
        dtype: torch.dtype,
        source: str = "config.json",
    ):
        super().__init__()
        v = self.v = config.vision
        check_vision(v, source)
        self.hidden, self.dtype = config.text.hidden_size, dtype
        self.heads, self.head_dim = v.num_attention_heads, v.hidden_size // v.num_attention_heads
        self.weights = {}
        for name, (shape, stored) in vision_specs(v, self.hidden).items():
            t = get(name, stored, shape)
            self.weights[name] = t.float() if stored == "F32" else t.to(dtype)  # norms stay fp32

    def w(self, name: str) -> Tensor:
        return self.weights[name]

    def linear(self, x: Tensor, name: str, bias: bool = True) -> Tensor:
        return F.linear(x, self.w(name + ".weight"), self.w(name + ".bias") if bias else None)

    def encode(self, patches: Tensor, rows: int, cols: int) -> Tensor:
        """patches [rows * cols, 3, P, P] -> [rows * cols, Vd] (blocks, then the final norm)."""
        N = rows * cols
        assert patches.shape[0] == N, (patches.shape, rows, cols)
        x = self.linear(patches.flatten(1).to(self.dtype), "vision.patch_embed.proj")  # [N, Vd]
        cos, sin = rope_2d(rows, cols, self.head_dim, self.v.rope_theta)
        for j in range(self.v.num_hidden_layers):
            p = f"vision.blocks.{j}."
            q, k, v = self.linear(rms_norm(x, self.w(p + "norm1.weight")), p + "attn.wqkv").chunk(3, dim=-1)
            q, k, v = (t.reshape(N, self.heads, self.head_dim) for t in (q, k, v))  # [N, H, hd]
            q, k = apply_rope_2d(q, cos, sin), apply_rope_2d(k, cos, sin)
            o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
            x = x + self.linear(o.transpose(0, 1).reshape(N, -1), p + "attn.wo")
            gate, up = self.linear(rms_norm(x, self.w(p + "norm2.weight")), p + "mlp.w1", bias=False).chunk(2, -1)
            x = x + self.linear(F.silu(gate) * up, p + "mlp.w2", bias=False)
        return rms_norm(x, self.w("vision.norm.weight"))

    def align(self, x: Tensor, rows: int, cols: int) -> Tensor:
        """[rows * cols, Vd] -> [ceil(rows/r) * ceil(cols/r), D] text-width features, row-major."""
        cells = merge_cells(x, rows, cols, self.v.downsample_ratio)
        return self.linear(F.gelu(self.linear(cells, "aligner.w1")), "aligner.w2")

    def span(self, patches: Tensor, grid: ImageGrid) -> Tensor:
        """One image's text span [grid.tokens, D]: start, per merged row its features and a newline, end."""
        feats = self.align(self.encode(patches, grid.rows, grid.cols), grid.rows, grid.cols)
        feats = feats.to(self.dtype).view(grid.llm_rows, grid.llm_cols, self.hidden)
        newline = self.w("image_newline").expand(grid.llm_rows, 1, self.hidden)
        body = torch.cat([feats, newline], dim=1).reshape(-1, self.hidden)
        return torch.cat([self.w("image_start")[None], body, self.w("image_end")[None]])

    @torch.inference_mode()
    def embed(self, pixels: np.ndarray) -> Tensor:
        """uint8 [H, W, 3] RGB -> its span's embeddings [tokens, D]."""
        patches, grid = preprocess(pixels, self.v)
        return self.span(patches, grid)


def tensor_getter(tensors: dict[str, Tensor], where: str):
    """A `get(name, dtype, shape)` over a dict of tensors (a bundle's host file), checking both."""
    names = {"BF16": torch.bfloat16, "F32": torch.float32}

    def get(name: str, dtype: str, shape: tuple) -> Tensor:
        t = tensors.get(name)
        if t is None or t.dtype != names[dtype] or tuple(t.shape) != tuple(shape):
            got = "missing" if t is None else f"{t.dtype} {list(t.shape)}"
            raise ConfigError(f"{where}: vision tensor {name} is {got}, expected {dtype} {list(shape)}")
        return t

    return get
