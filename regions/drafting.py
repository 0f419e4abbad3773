"""Drafting a DSpark block: the one loop the reference and the bundle runtime share.

`DSparkDrafter` is a `regions.stepper.Drafter` over `invoke(stage, slot, *inputs)`, the
draft's region calls (slots `context` on stage 0, `attn`, `moe`, `head` on the last,
and `project`, the target head's vocabulary projection, as stage -1): the reference
drives it with eager regions (`ReferenceModel.dspark`), the runtime with a bundle's
executables (`Session.dspark`), as `regions.step.run_layers` is driven for the target.

Its state is one layer-major pool, `features` [L, slots, W, D]: for each of the L
`dspark_target_layer_ids` and each sequence slot, the ring of the target's collapsed
attention inputs at the sequence's last W = `sliding_window` committed positions
(position p at row p % W). `observe` writes only committed positions, so a rejected
draft leaves nothing to roll back; a refed position writes the same row again. A
draft at anchor a (the last committed token, not yet fed to the target) reads the
positions [a - W, a), every one of them committed and observed by then.
"""

from __future__ import annotations

import torch
from torch import Tensor

from deepinfer.bundles.manifest import PROJECT
from deepinfer.kernels import hc as _hc  # noqa: F401  (registers the collapse op)
from deepinfer.regions.config import TextConfig
from deepinfer.regions.stepper import Captured, DraftRequest, bucket_at_least

ops = torch.ops.deepinfer


def run_draft_stages(
    invoke, stages: int, h: Tensor, pre: Tensor, features: Tensor, context_positions: Tensor, positions: Tensor
) -> tuple[Tensor, Tensor]:
    """The block's streams h [B, P, n, D], pre [B, P, n] through every stage -> the last stage's (what its
    `head` reads). features [B, C, L*D] at context_positions [B, C] (-1: empty); the block at positions [B, P]."""
    (context,) = invoke(0, "context", features)  # [B, C, D]
    no_image = torch.zeros(positions.shape, dtype=torch.bool)
    for stage in range(stages):
        h, pre = invoke(stage, "attn", h, pre, context, context_positions, positions)
        h, pre = invoke(stage, "moe", h, pre, no_image)
    return h, pre


class DSparkDrafter:
    """The DSpark draft as the scheduler drives it (a `regions.stepper.Drafter`).

    A block drafts greedily: the stages run once over the anchor and `dspark_block_size` - 1 noise
    tokens; position i's token is the argmax of the target head's logits of the last stage's
    normalized state plus the Markov transition bias of position i - 1's token (the anchor for i = 0).
    `embed` is the target's host embedding (`regions.step.Embedding`); `batch_sizes` the batch
    buckets the invoked executables were built for (None: any batch, eager regions)."""

    def __init__(self, c: TextConfig, invoke, embed, features: Tensor, batch_sizes: list[int] | None = None):
        self.c, self.invoke, self.embed = c, invoke, embed
        self.features = features  # [L, slots, W, D]
        self.batch_sizes = batch_sizes
        self.block = c.dspark_block_size
        self.capture_layers = tuple(c.dspark_target_layer_ids)

    def observe(self, slot: int, captured: Captured, row: int, start: int, keep: int) -> None:
        W = self.c.sliding_window
        if slot >= self.features.shape[1]:  # a pool the drafter owns (the reference's) grows
            more = torch.zeros_like(self.features[:, :1]).expand(-1, slot + 1 - self.features.shape[1], -1, -1)
            self.features = torch.cat((self.features, more), 1)
        first = max(start, start + keep - W)  # earlier positions would be overwritten at once
        rows = torch.arange(first, start + keep) % W
        for i, layer in enumerate(self.capture_layers):
            streams = captured[layer]
            assert streams is not None, f"the step did not capture layer {layer}"
            h, pre = streams  # [B, T, n, D], [B, T, n]
            x = ops.hc_collapse(h[row, first - start : keep], pre[row, first - start : keep])
            self.features[i, slot].index_copy_(0, rows, x.to(self.features.dtype))

    def block_logits(self, requests: list[DraftRequest]) -> tuple[Tensor, Tensor]:
        """Each request's block drafted -> (drafts [B, P] int64, the logits each was the argmax of
        [B, P, V] float32), one row per request (the padding rows of the batch bucket dropped)."""
        c, W, P = self.c, self.c.sliding_window, self.block
        n = len(requests)
        B = n if self.batch_sizes is None else bucket_at_least(self.batch_sizes, n)
        slots = torch.zeros(B, dtype=torch.int64)  # padding rows: slot 0 (scratch), anchor 0
        anchors = torch.zeros(B, dtype=torch.int64)
        block_tokens = torch.full((B, P), c.dspark_noise_token_id, dtype=torch.int64)
        for b, (_, slot, tokens, _) in enumerate(requests):
            slots[b], anchors[b], block_tokens[b, 0] = slot, len(tokens) - 1, tokens[-1]
        context_positions = anchors.unsqueeze(1) - W + torch.arange(W)  # [B, W]
        ring = self.features[:, slots.unsqueeze(1), context_positions % W]  # [L, B, W, D]
        features = ring.permute(1, 2, 0, 3).reshape(B, W, -1)  # [B, W, L*D]
        context_positions = context_positions.clamp(min=-1)
        positions = anchors.unsqueeze(1) + torch.arange(P)  # [B, P]
        h, pre = self.embed(block_tokens)
        stages = c.num_nextn_predict_layers
        h, pre = run_draft_stages(self.invoke, stages, h, pre, features, context_positions, positions)
        previous = block_tokens.clone()  # position i's previous token: the anchor, then drafts
        drafts = torch.zeros(B, P, dtype=torch.int64)
        logits = torch.zeros(B, P, c.vocab_size, dtype=torch.float32)
        base = None
        for i in range(P):
            normalized, transition, _ = self.invoke(stages - 1, "head", h, pre, previous)
            if base is None:
                (base,) = self.invoke(-1, PROJECT, normalized)  # [B, P, V]
            logits[:, i] = base[:, i] + transition[:, i].float()
            drafts[:, i] = logits[:, i].argmax(-1)
            if i + 1 < P:
                previous[:, i + 1] = drafts[:, i]
        return drafts[:n], logits[:n]

    @torch.inference_mode()
    def draft(self, requests: list[DraftRequest]) -> dict[int, list[int]]:
        drafts, _ = self.block_logits(requests)
        return {seq: drafts[b, :k].tolist() for b, (seq, _, _, k) in enumerate(requests)}
