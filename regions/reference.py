"""The pure-torch reference: the regions composed layer by layer, in eager mode.

It owns its state buffers (a slot and a contiguous run of blocks per
sequence), runs prompts as decode-shaped chunks, then one token per step, and
samples greedily. Every later stage (compiled bundles, other targets) is held
to what this produces.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from deepinfer.regions.checkpoint import Checkpoint, load_region
from deepinfer.regions.config import CONFIG_FILE, V41Config, load_config
from deepinfer.regions.engram_hash import EngramHasher
from deepinfer.regions.head import Embedding
from deepinfer.regions.plan import make_head, make_layer_regions, plan_layers
from deepinfer.regions.state import allocate, state_layout
from deepinfer.regions.vision import ImageEmbeds, VisionTower, engram_masks, step_images

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
REFERENCE_BLOCK_SIZE = 16


@dataclass
class Batch:
    """One step's inputs: T tokens for each of B sequences (-1 positions are padding)."""

    tokens: Tensor          # [B, T] int64
    positions: Tensor       # [B, T] int64
    slots: Tensor           # [B] int64
    block_table: Tensor     # [B, MB] int64
    hashes: Tensor | None   # [B, T, engram_layers, hash_heads] int64
    is_image: Tensor        # [B, T] bool
    image_rows: Tensor | None = None    # [B, T, D]: the embeddings of image positions (vision tower)


@dataclass
class Generation:
    tokens: list[int]                       # prompt then generated
    prompt_len: int
    logits: list[Tensor] = field(default_factory=list)   # one [V] row per processed position
    error: str | None = None                             # why the request stopped early (runtime)

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]


def run_layers(plans, invoke, states, h, pre, batch: Batch) -> Tensor:
    """h, pre through every layer's regions and the head -> logits [B, T, V].

    `invoke(layer, slot, *inputs)` runs one region call (`slot`: engram, attn,
    moe; the head is layer -1, slot "head") and returns its outputs;
    `states[layer]` holds the layer's state views by name. This is the one
    wiring of region inputs, shared by the reference and the bundle runtime.
    """
    topk = cand = None
    engram_index = 0
    token_mask = (batch.positions >= 0) & ~batch.is_image
    common = (batch.positions, batch.slots, batch.block_table)
    for p in plans:
        st = states[p.layer]
        if p.engram_rows:
            (h,) = invoke(p.layer, "engram", h, batch.hashes[:, :, engram_index], token_mask)
            engram_index += 1
        if p.attn == "window":
            h, pre = invoke(p.layer, "attn", h, pre, batch.positions, batch.slots, st["win"])
        elif p.attn == "source":
            parts = (st["part_kv"], st["part_gate"]) if p.ratio > 1 else ()
            out = invoke(p.layer, "attn", h, pre, *common, st["win"], st["ckv"], st["ikeys"], *parts)
            h, pre, topk = out[:3]
            cand = out[3] if p.candidate_source else cand
        elif p.attn == "reindex":
            extra = (cand,) if p.uses_candidates else ()
            h, pre, topk = invoke(p.layer, "attn", h, pre, *common, st["win"], st["ckv"], st["ikeys"], *extra)
        else:
            h, pre = invoke(p.layer, "attn", h, pre, *common, st["win"], st["ckv"], topk)
        h, pre = invoke(p.layer, "moe", h, pre, batch.is_image)
    (logits,) = invoke(-1, "head", h, pre)
    return logits


class ReferenceModel:
    """A V4.1 checkpoint as eager regions.

    dtype: "bf16" (as released) or "fp32". ties: how the indexer's top-k breaks
    ties between equal scores: "nemo" (torch.topk over the sequence's own width,
    as NeMo AutoModel's forward does) or "lowest" (lowest index first, what
    compiled bundles do: static shapes admit no per-sequence width).
    """

    def __init__(self, checkpoint: str | Path, *, dtype: str = "bf16", cache_quant: bool = True,
                 ties: str = "nemo"):
        self.path = Path(checkpoint)
        self.config: V41Config = load_config(self.path)
        c = self.config.text
        self.dtype = DTYPES[dtype]
        self.plans = plan_layers(c)
        ckpt = Checkpoint(self.path)
        self.layers = []
        for p in self.plans:
            regions = make_layer_regions(c, p, self.dtype, cache_quant)
            regions["attn"].ties = ties
            for region in regions.values():
                load_region(ckpt, region, f"layers.{p.layer}.")
            self.layers.append(regions)
        self.head = make_head(c, self.dtype)
        load_region(ckpt, self.head, "")
        self.embed = Embedding(ckpt.get("embed.weight", "BF16", (c.vocab_size, c.hidden_size)),
                               c.hc_mult, self.dtype)
        self.hasher = EngramHasher(c) if c.engram_layer_ids else None
        self._vision: VisionTower | None = None

    def invoke(self, layer: int, slot: str, *inputs):
        region = self.head if slot == "head" else self.layers[layer][slot]
        out = region.decode(*inputs)
        return out if isinstance(out, tuple) else (out,)

    @property
    def vision(self) -> VisionTower:
        """The host-side vision tower (loaded on first use; a ConfigError without one)."""
        if self._vision is None:
            self._vision = VisionTower(self.config, Checkpoint(self.path).get, self.dtype,
                                       str(self.path / CONFIG_FILE))
        return self._vision

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, *, chunk: int | None = None,
                 eos: int | None = None, images: list[ImageEmbeds | None] | None = None) -> list[Generation]:
        """Greedy generation for a batch of token-id prompts.

        Prompts run as decode-shaped chunks of `chunk` tokens (default: the
        longest prompt in one chunk), then one token per step. `images[b]`
        (from `vision.with_images`) marks prompt b's image positions and
        holds the rows that replace their embeddings.
        """
        c = self.config.text
        eos = self.config.eos_token_id if eos is None else eos
        B = len(prompts)
        longest = max(len(p) for p in prompts)
        chunk = chunk or longest
        bs = REFERENCE_BLOCK_SIZE
        per_seq = -(-(longest + max_new_tokens) // bs)
        layout = state_layout(c, self.plans, slots=B + 1, blocks=B * per_seq + 1, block_size=bs,
                              dtype=self.dtype)
        states = allocate(layout)
        for p in self.plans:              # reuse / reindex layers read their source's pages
            if p.attn in ("reuse", "reindex"):
                states[p.layer].update({k: states[p.kv_source][k] for k in ("ckv", "ikeys")})
        table = 1 + torch.arange(B * per_seq).view(B, per_seq)
        gens = [Generation(list(p), len(p)) for p in prompts]
        done = [max_new_tokens == 0] * B
        consumed = [0] * B                      # positions already processed per sequence
        while not all(done):
            todo = [0 if done[b] else min(chunk, len(gens[b].tokens) - consumed[b]) for b in range(B)]
            T = max(todo)
            tokens = torch.full((B, T), self.config.pad_token_id, dtype=torch.int64)
            positions = torch.full((B, T), -1, dtype=torch.int64)
            for b in range(B):
                ids = gens[b].tokens[consumed[b]: consumed[b] + todo[b]]
                tokens[b, :todo[b]] = torch.tensor(ids, dtype=torch.int64)
                positions[b, :todo[b]] = torch.arange(consumed[b], consumed[b] + todo[b])
            active = torch.tensor([t > 0 for t in todo])
            is_image, image_rows = step_images(images, list(zip(consumed, todo)), T, self.dtype)
            batch = Batch(tokens, positions,
                          slots=torch.where(active, torch.arange(1, B + 1), 0),
                          block_table=torch.where(active.unsqueeze(1), table, 0),
                          hashes=None if self.hasher is None else torch.from_numpy(
                              self.hasher.step([g.tokens for g in gens], positions.numpy(),
                                               engram_masks(images, list(range(B))))),
                          is_image=is_image, image_rows=image_rows)
            h, pre = self.embed(tokens, is_image, image_rows)
            logits = run_layers(self.plans, self.invoke, states, h, pre, batch)
            for b in range(B):
                if not todo[b]:
                    continue
                g = gens[b]
                g.logits.extend(logits[b, :todo[b]].float().clone())
                consumed[b] += todo[b]
                if consumed[b] == len(g.tokens):          # caught up: sample the next token
                    nxt = int(torch.argmax(logits[b, todo[b] - 1]))
                    g.tokens.append(nxt)
                    if nxt == eos or len(g.generated) >= max_new_tokens:
                        done[b] = True
        return gens
