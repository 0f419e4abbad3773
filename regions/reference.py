"""The pure-torch reference: the regions composed layer by layer, in eager mode.

It owns its state buffers (a slot and the blocks its positions need per
sequence), runs prompts as decode-shaped chunks, then one token per step, and
is driven by the scheduler the bundle runtime uses (`stepper`; `runtime.schedule.decode`).
Every later stage (compiled bundles, other targets) is held to what this
produces.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import Tensor

from deepinfer.bundles.manifest import DECODE
from deepinfer.errors import ConfigError
from deepinfer.regions.attention import _Attention
from deepinfer.regions.base import engram_table_specs
from deepinfer.regions.checkpoint import Checkpoint, load_region
from deepinfer.regions.config import CONFIG_FILE, V41Config, load_config
from deepinfer.regions.drafting import DSparkDrafter, EagerCapture, draft_forward
from deepinfer.regions.dspark import PREFIX, draft_regions, eager_invoke, features_ring
from deepinfer.regions.engram_hash import EngramHasher
from deepinfer.regions.engram_map import checked_token_map
from deepinfer.regions.hf_tokenizer import TokenizersTokenizer
from deepinfer.regions.plan import make_head, make_layer_regions
from deepinfer.regions.prefix import SlotState
from deepinfer.regions.spans import ImageEmbeds
from deepinfer.regions.state import PAGED, allocate, state_layout
from deepinfer.regions.step import DTYPES, Embedding, EngramRows, plan_layers, run_layers
from deepinfer.regions.stepper import Allocator, Capture, Row, make_batch
from deepinfer.regions.tokenizer import TOKENIZER_FILE, for_checkpoint
from deepinfer.regions.vision import VisionTower

REFERENCE_BLOCK_SIZE = 16


class ReferenceModel:
    """A V4.1 checkpoint as eager regions.

    dtype: "bf16" (as released) or "fp32". ties: how the indexer's top-k breaks
    ties between equal scores: "nemo" (torch.topk over the sequence's own width,
    as NeMo AutoModel's forward does) or "lowest" (lowest index first, what
    compiled bundles do: static shapes admit no per-sequence width).
    `tokenizer` is the checkpoint's (`tokenizer.json` where it has one, else byte-level);
    engram hashes go through its compressed token map, as a bundle's do.
    """

    def __init__(self, checkpoint: str | Path, *, dtype: str = "bf16", cache_quant: bool = True, ties: str = "nemo"):
        self.path = Path(checkpoint)
        self.config: V41Config = load_config(self.path)
        c = self.config.text
        self.tokenizer = for_checkpoint(self.path, self.config)
        token_map = None  # engram's compressed token map, checked before any weight is read
        if c.engram_layer_ids and isinstance(self.tokenizer, TokenizersTokenizer):
            token_map = checked_token_map(
                self.tokenizer.backend, c, self.path / TOKENIZER_FILE, self.path / CONFIG_FILE
            )
        self.hasher = EngramHasher(c, token_map) if c.engram_layer_ids else None
        self.dtype = DTYPES[dtype]
        self.cache_quant = cache_quant
        self.plans = plan_layers(c)
        ckpt = Checkpoint(self.path)
        self.layers = []
        for p in self.plans:
            with torch.device("meta"):  # shapes only: load_region gives each buffer its tensor
                regions = make_layer_regions(c, p, self.dtype, cache_quant)
            attn = regions["attn"]
            assert isinstance(attn, _Attention)
            attn.ties = ties
            for region in regions.values():
                load_region(ckpt, region, f"layers.{p.layer}.")
            self.layers.append(regions)
        with torch.device("meta"):
            self.head = make_head(c, self.dtype)
        load_region(ckpt, self.head, "")
        self.embed = Embedding(ckpt.get("embed.weight", "BF16", (c.vocab_size, c.hidden_size)), c.hc_mult, self.dtype)
        self.engram = (
            EngramRows.of(c, {s.name: ckpt.load_spec("", s) for s in engram_table_specs(c)}, str(self.path))
            if c.engram_layer_ids
            else None
        )
        self._vision: VisionTower | None = None

    def invoke(self, layer: int, slot: str, *inputs, method: str = DECODE):
        region = self.head if slot == "head" else self.layers[layer][slot]
        out = getattr(region, method)(*inputs)
        return out if isinstance(out, tuple) else (out,)

    @property
    def vision(self) -> VisionTower:
        """The host-side vision tower (loaded on first use; a ConfigError without one)."""
        if self._vision is None:
            self._vision = VisionTower(self.config, Checkpoint(self.path).get, self.dtype, str(self.path / CONFIG_FILE))
        return self._vision

    def stepper(
        self, prompts: list[list[int]], max_new_tokens: int, chunk: int | None = None, slack: int = 0
    ) -> EagerSteps:
        """The reference as a `Stepper` for these prompts (the scheduler drives it: `runtime.schedule.decode`).

        Prompts run as decode-shaped chunks of `chunk` tokens (default: the longest prompt in one
        chunk), then one token per step; its pools hold every prompt and `max_new_tokens` more, its
        per-slot rings `slack` rows more (room for verify steps of up to `slack` drafts)."""
        return EagerSteps(self, prompts, max_new_tokens, chunk, slack)

    def dspark(self) -> DSparkDrafter:
        """The checkpoint's DSpark draft (`mtp.*`) as eager regions, drafting for this model."""
        c = self.config.text
        if not c.has_draft:
            raise ConfigError(
                f"{self.path / CONFIG_FILE}: text_config.num_nextn_predict_layers is 0: the checkpoint "
                "has no DSpark draft (mtp.* tensors); speculative decoding needs one"
            )
        stages = self.draft_stages()
        invoke = eager_invoke(stages, self.head)
        capture = EagerCapture(c, stages[0]["capture"], self.dtype, features_ring(c))

        def forward(batches):
            return [draft_forward(c, invoke, self.embed, capture.rings(), b) for b in batches]

        return DSparkDrafter(c, invoke, forward, capture)

    def draft_stages(self) -> list[dict]:
        """The draft's stages (`regions.dspark.draft_regions`) with the checkpoint's `mtp.*` weights."""
        ckpt = Checkpoint(self.path)
        stages = draft_regions(self.config.text, self.dtype, self.cache_quant)
        for stage, regions in enumerate(stages):
            for region in regions.values():
                load_region(ckpt, region, PREFIX.format(stage=stage))
        return stages


class EagerSteps:
    """The reference as the scheduler drives it: every prompt in one batch, row b always prompt b
    (finished prompts stay as padding rows), pools sized for the longest sequence, per-slot rings
    `slack` rows beyond the window and ratios (the most drafts a verify step may carry)."""

    groups = 1

    def __init__(
        self,
        model: ReferenceModel,
        prompts: list[list[int]],
        max_new_tokens: int,
        chunk: int | None,
        slack: int = 0,
    ):
        self.model = model
        self.slack = slack
        self.max_batch = len(prompts)
        longest = max(len(p) for p in prompts)
        self.chunk = chunk or longest
        per_seq = -(-(longest + max_new_tokens) // REFERENCE_BLOCK_SIZE)
        self.geometry = (self.max_batch + 1, self.max_batch * per_seq + 1, per_seq)  # slots, blocks, table width
        slots, blocks, _ = self.geometry
        self.states = allocate(
            state_layout(
                model.config.text,
                model.plans,
                slots=slots,
                blocks=blocks,
                block_size=REFERENCE_BLOCK_SIZE,
                dtype=model.dtype,
                slack=slack,
            )
        )
        for p in model.plans:  # reuse / reindex layers read their source's pages
            if p.attn in ("reuse", "reindex") and p.kv_source is not None:
                self.states[p.layer].update({k: self.states[p.kv_source][k] for k in ("ckv", "ikeys")})

    def allocator(self) -> Allocator:
        slots, blocks, width = self.geometry
        return Allocator(slots, blocks, REFERENCE_BLOCK_SIZE, width)

    def save_slot(self, group: int, slot: int) -> SlotState:
        """A copy of `slot`'s rows of every per-slot view, keyed `<layer>/<view>`."""
        return {
            f"{layer}/{name}": t[slot].clone()
            for layer, views in self.states.items()
            for name, t in views.items()
            if name not in PAGED
        }

    def load_slot(self, group: int, slot: int, state: SlotState) -> None:
        for key, rows in state.items():
            layer, name = key.split("/", 1)
            self.states[int(layer)][name][slot].copy_(rows)

    def forget_slot(self, group: int, state: SlotState) -> None:
        """Nothing to do: the copy is the state itself, gone with the cache's reference."""

    def run(
        self,
        rows_by_group: list[list[Row]],
        allocs: list[Allocator],
        histories: Mapping[int, Sequence[int]],
        images: Mapping[int, ImageEmbeds | None],
        capture: Capture | None = None,
        last_only: bool = False,
        greedy: bool = False,  # the logits whatever: one process holds them whole
    ) -> list[Tensor]:
        m, (rows,) = self.model, rows_by_group
        T = max(len(ids) for _, ids, _ in rows)
        batch = make_batch(
            rows,
            [seq for seq, _, _ in rows],
            self.max_batch,
            T,
            blocks=self.geometry[2],
            alloc=allocs[0],
            histories=histories,
            images=images,
            hasher=m.hasher,
            pad=m.config.pad_token_id,
            dtype=m.dtype,
            last_only=last_only,
        )
        h, pre = m.embed(batch.tokens, batch.is_image, batch.image_rows)
        logits = run_layers(m.plans, m.invoke, self.states, h, pre, batch, m.engram, capture)
        return [logits[[seq for seq, _, _ in rows]]]
