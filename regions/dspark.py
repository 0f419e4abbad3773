"""DSpark, the release's speculative draft (`mtp.0` .. `mtp.{k-1}`), as regions.

What the draft reads: for a sequence whose last committed token (the anchor) is at
position a, the target's features at positions [a - window, a) (the residual streams
at the attention input of each `dspark_target_layer_ids` layer, after its engram,
collapsed with the `pre` that attention site uses; concatenated over those layers,
[C, L * D]), the anchor's embedding and `dspark_block_size` - 1 embeddings of the noise
token, at positions a .. a + block - 1. What it produces: for each of the block's
positions i, logits over the vocabulary for the token at a + i + 1 (the target's frozen
head over the last stage's normalized state, plus the Markov transition head's bias for
the token before it) and a confidence logit.

Stages: stage 0 first projects the features (`main_proj`, `main_norm`) into the context
every stage attends to. Each stage is a sliding-window-only attention site (its queries
are the block; its keys the projected context rotated at the context's positions, and the
block itself, every block position seeing the whole block), then an MoE site with the
draft's own routed experts (`dspark_n_routed_experts`, `dspark_num_experts_per_tok`),
hyper-connected as the target's layers are. The last stage owns `norm`, the Markov head
(`markov_head.embed`, `markov_head.head`, rank `dspark_markov_rank`) and the confidence
head (`confidence_head.proj`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor
from torch.nn import functional as F

from deepinfer.bundles.manifest import DECODE, PROJECT
from deepinfer.bundles.topology import Topology
from deepinfer.kernels.cachequant import maybe_quant
from deepinfer.kernels.rope import apply_rope
from deepinfer.regions.attention import _Attention
from deepinfer.regions.base import Region, WeightSpec, fp8_specs
from deepinfer.regions.config import TextConfig, draft_moe_config
from deepinfer.regions.drafting import run_draft_stages
from deepinfer.regions.moe import MoE
from deepinfer.regions.paging import gather_rows, ring_update
from deepinfer.regions.state import Geometry, InputSpec
from deepinfer.regions.step import Embedding
from deepinfer.regions.topology import attention_share, head_rows

if TYPE_CHECKING:
    from deepinfer.regions.head import Head

ops = torch.ops.deepinfer

PREFIX = "mtp.{stage}."


def features_ring(c: TextConfig) -> int:
    """Rows of a features ring: the window a draft reads and the block a verify step may write past
    its committed positions (a rejected position's row holds nothing a later draft reads)."""
    return c.sliding_window + c.dspark_block_size


class DraftCapture(Region):
    """What the draft reads of the target, written by the target's step: at each of the draft's target
    layers, the streams its attention site reads, collapsed with that site's `pre`, into the layer's
    features ring [S, R, D] (row position % R) of each row's slot. It runs on the device beside the
    layer (no weights): the features never visit the host."""

    kind = "dspark_capture"

    def __init__(self, c: TextConfig, *, dtype: torch.dtype):
        super().__init__([], dtype)
        self.c = c

    def output_names(self) -> list[str]:
        return ["written"]

    def input_specs(self, B: int, T: int, g: Geometry) -> list[InputSpec]:
        c = self.c
        return [
            InputSpec("h", (B, T, c.hc_mult, c.hidden_size), self.dtype, "activation"),
            InputSpec("pre", (B, T, c.hc_mult), torch.float32, "activation"),
            InputSpec("positions", (B, T), torch.int64, "step"),
            InputSpec("slots", (B,), torch.int64, "step"),
            InputSpec("features", (g.slots, features_ring(c), c.hidden_size), self.dtype, "state"),
        ]

    def decode(self, h: Tensor, pre: Tensor, positions: Tensor, slots: Tensor, features: Tensor) -> Tensor:
        """-> the positions written [B] (a graph output; the ring is written in place)."""
        rows = features.index_select(0, slots)  # [B, R, D]
        buf = torch.cat((rows, ops.hc_collapse(h, pre).to(features.dtype)), 1)
        last = positions.amax(dim=1, keepdim=True)  # -1 for a padding row: it keeps its ring
        features.index_copy_(0, slots, ring_update(rows, buf, positions[:, :1], last))
        return (positions >= 0).sum(1)


class DraftContext(Region):
    """Stage 0's projection of the target features: each row's window before its anchor, gathered from
    the L features rings of its slot -> context [B, C, D]."""

    kind = "dspark_context"

    def __init__(self, c: TextConfig, *, dtype: torch.dtype):
        D, L = c.hidden_size, len(c.dspark_target_layer_ids)
        super().__init__(
            [*fp8_specs("main_proj", "main_proj", D, L * D), WeightSpec("main_norm", "main_norm.weight", (D,), "BF16")],
            dtype,
        )
        self.c = c

    def output_names(self) -> list[str]:
        return ["context"]

    def input_specs(self, B: int, T: int, g: Geometry) -> list[InputSpec]:
        c = self.c
        rings = [
            InputSpec(f"features{i}", (g.slots, features_ring(c), c.hidden_size), self.dtype, "state")
            for i in range(len(c.dspark_target_layer_ids))
        ]
        return [
            InputSpec("context_positions", (B, T), torch.int64, "step"),
            InputSpec("slots", (B,), torch.int64, "step"),
            *rings,
        ]

    def decode(self, context_positions: Tensor, slots: Tensor, *rings: Tensor) -> Tensor:
        """context_positions [B, C] (-1: before the sequence; its row is ignored by the attention),
        slots [B], the rings [S, R, D] of the L target layers -> context [B, C, D]."""
        rows = [gather_rows(ring.index_select(0, slots), context_positions.remainder(ring.shape[1])) for ring in rings]
        return self.project(torch.cat(rows, -1))

    def project(self, features: Tensor) -> Tensor:
        """features [B, C, L*D] -> context [B, C, D]."""
        x = ops.blockquant_gemm(features, self.main_proj, self.main_proj_s, self.fp8)
        return ops.rmsnorm(x, self.main_norm, self.c.rms_norm_eps)


class DraftMoE(MoE):
    """A draft stage's MoE site: the target's MoE region over the draft's own routed experts (its own
    kind, so its executables and weight stacks are the draft's)."""

    kind = "dspark_moe"


class DraftAttention(_Attention):
    """A draft stage's attention site: the block's queries over the projected target context (its
    window before the anchor) and the whole block. Laid out as the target's window attention: with a
    token group of several ranks the heads one rank computes (regions/topology.attention_share at
    ratio 0), its output a partial sum over the token group (`_finish`)."""

    kind = "dspark_attn"

    def __init__(self, c: TextConfig, *, dtype: torch.dtype, cache_quant: bool, topo: Topology = Topology()):
        share = attention_share(c, topo, 0) if topo.group_size > 1 else None
        super().__init__(c, [], dtype=dtype, cache_quant=cache_quant, share=share)
        self.tp, self.cp = topo.tp, topo.cp

    def input_specs(self, B: int, T: int, g: Geometry) -> list[InputSpec]:
        c, W = self.c, self.c.sliding_window
        return [
            InputSpec("h", (B, T, c.hc_mult, c.hidden_size), self.dtype, "activation"),
            InputSpec("pre", (B, T, c.hc_mult), torch.float32, "activation"),
            InputSpec("context", (B, W, c.hidden_size), self.dtype, "activation"),
            InputSpec("context_positions", (B, W), torch.int64, "step"),
            InputSpec("positions", (B, T), torch.int64, "step"),
        ]

    def decode(self, h: Tensor, pre: Tensor, context: Tensor, context_positions: Tensor, positions: Tensor):
        """h [B, P, n, D], pre [B, P, n], context [B, C, D] at context_positions [B, C] (-1: empty),
        positions [B, P] -> (h, pre)."""
        x, mix = self._site_input(h, pre)
        angles = self._angles(positions)
        q, _, kv = self._project(x, angles)  # kv [B, P, hd]
        eps = self.c.rms_norm_eps
        ctx = ops.rmsnorm(ops.blockquant_gemm(context, self.wkv, self.wkv_s, self.fp8), self.kv_norm, eps)
        ctx = maybe_quant(apply_rope(ctx, self._angles(context_positions)), "fp8", self.cache_quant)
        B, P = positions.shape
        keys = torch.cat((ctx, kv), 1).unsqueeze(1).expand(B, P, -1, -1)  # [B, P, C + P, hd]
        valid = torch.cat((context_positions >= 0, positions >= 0), 1).unsqueeze(1).expand(B, P, -1)
        return self._finish(self._attend(q, keys, valid, angles), h, mix)


class DraftHead(Region):
    """The last stage's heads: normalized state [B, P, D], the Markov transition logits [B, P, V] of
    each position's previous token, and the confidence logit [B, P] (float32).

    With the target's head split by vocabulary over a token group of `group` ranks, the Markov head's
    output rows are split the same way (`rows` of them, regions/topology.head_rows; zeros past the
    vocabulary): this rank's transition logits are its slice, beside its slice of the target head's,
    and with several ranks (`world`) the block's tokens are chosen per slice on every rank (`pick`,
    regions/picking.py; a slice is the whole vocabulary where a token group is one rank). The Markov
    embedding (indexed by the previous token) stays whole."""

    kind = "dspark_head"

    def __init__(self, c: TextConfig, *, dtype: torch.dtype, rows: int | None = None, group: int = 1, world: int = 1):
        D, V, R = c.hidden_size, c.vocab_size, c.dspark_markov_rank
        rows = V if rows is None else rows
        super().__init__(
            [
                WeightSpec("norm", "norm.weight", (D,), "BF16"),
                WeightSpec("markov_embed", "markov_head.embed.weight", (V, R), "BF16"),
                WeightSpec("markov_head", "markov_head.head.weight", (rows, R), "BF16"),
                WeightSpec("confidence", "confidence_head.proj.weight", (1, D + R), "F32"),
            ],
            dtype,
        )
        self.c, self.rows, self.group, self.world = c, rows, group, world

    def output_names(self) -> list[str]:
        return ["normalized", "transition", "confidence"]

    def input_specs(self, B: int, T: int, g: Geometry) -> list[InputSpec]:
        c = self.c
        return [
            InputSpec("h", (B, T, c.hc_mult, c.hidden_size), self.dtype, "activation"),
            InputSpec("pre", (B, T, c.hc_mult), torch.float32, "activation"),
            InputSpec("previous", (B, T), torch.int64, "step"),
        ]

    def methods(self) -> tuple[str, ...]:
        """A draft step runs `normalize` (then the target head's `project` of its vocabulary rows) and,
        with one rank, `tokens`; with several, `pick` once per block position on every rank (and
        `chain`, only where the full draft logits are asked for: tests, debugging)."""
        return ("normalize", "tokens") if self.world == 1 else ("normalize", "pick", "chain")

    def decode(self, h: Tensor, pre: Tensor, previous: Tensor):
        """The block's heads as NeMo computes them (teacher-forced `previous` [B, P]): normalized,
        transition [B, P, V] and confidence [B, P]."""
        normalized = self.normalize(h, pre)
        embedding = self.markov_embed[previous].to(self.dtype)  # [B, P, R]
        transition = F.linear(embedding, self.markov_head.to(self.dtype))
        confidence = F.linear(torch.cat((normalized.float(), embedding.float()), -1), self.confidence)
        return normalized, transition, confidence.squeeze(-1)

    def gathered(self, rows: int) -> dict[str, int]:
        """A draft step of `rows` rows reads the Markov embedding's row of each one's previous token."""
        return {"markov_embed": rows}

    def normalize_inputs(self, B: int, T: int, g: Geometry) -> list[InputSpec]:
        return self.input_specs(B, T, g)[:2]

    def normalize_outputs(self) -> list[str]:
        return ["normalized"]

    def normalize(self, h: Tensor, pre: Tensor) -> Tensor:
        """The last stage's streams -> the normalized state [B, P, D] the target head projects."""
        return ops.rmsnorm(ops.hc_collapse(h, pre), self.norm, self.c.rms_norm_eps)

    def tokens_inputs(self, B: int, T: int, g: Geometry) -> list[InputSpec]:
        return [
            InputSpec("base", (B, T, self.c.vocab_size), torch.float32, "activation"),
            InputSpec("anchor", (B,), torch.int64, "step"),
        ]

    def tokens_outputs(self) -> list[str]:
        return ["drafts", "logits"]

    def tokens(self, base: Tensor, anchor: Tensor) -> tuple[Tensor, Tensor]:
        """The block drafted greedily: base [B, P, V] (the target head's logits of `normalize`), the
        anchor tokens [B] -> drafts [B, P] int64 and the logits [B, P, V] each was the argmax of:
        position i's are base i plus the Markov transition of the token before it (the anchor, then
        the drafts), so the positions run in order, in one graph."""
        previous, drafts, logits = anchor, [], []
        for i in range(base.shape[1]):
            row = base[:, i] + self._transition(previous)  # [B, V]
            previous = row.argmax(-1)  # the lowest index among equal scores
            drafts.append(previous)
            logits.append(row)
        return torch.stack(drafts, 1), torch.stack(logits, 1)

    def pick_inputs(self, B: int, T: int, g: Geometry) -> list[InputSpec]:
        return [
            InputSpec("base", (B, T, self.rows), torch.float32, "activation"),
            InputSpec("previous", (B,), torch.int64, "step", high=self.c.vocab_size),
            InputSpec("position", (B,), torch.int64, "step", high=T),
        ]

    def pick_outputs(self) -> list[str]:
        return ["value", "index"]

    def pick(self, base: Tensor, previous: Tensor, position: Tensor) -> tuple[Tensor, Tensor]:
        """One block position's choice on this rank's vocabulary slice: base [B, P, rows] (this rank's
        rows of the target head's logits of `normalize`), the token before the position [B] (the
        anchor, then the chosen drafts) and the position [B] -> this slice's best (value [B] float32,
        its global vocabulary index [B] int64; the lowest among equal values). The padding rows past
        the vocabulary score -inf and carry indices past it, so they never win a merge
        (`regions.picking.merge_picks`). On cpu the runtime loops over the positions on the host, the
        ranks' (value, index) pairs all-gathered between calls; on trn2 that loop, its all-gathers in
        the graph, runs inside the draft step's one executable (compiler/draft_layers.py)."""
        B = base.shape[0]
        at = position.view(B, 1, 1).expand(B, 1, self.rows)
        row = base.gather(1, at).squeeze(1) + self._transition(previous)  # [B, rows]
        first = (self.rank % self.group) * self.rows
        index = first + torch.arange(self.rows, device=base.device)  # [rows] global vocabulary indices
        row = row.masked_fill(index >= self.c.vocab_size, float("-inf"))
        best = row.argmax(-1)  # the lowest index among equal scores
        return row.gather(1, best.unsqueeze(1)).squeeze(1), first + best

    def chain_inputs(self, B: int, T: int, g: Geometry) -> list[InputSpec]:
        return [
            InputSpec("base", (B, T, self.rows), torch.float32, "activation"),
            InputSpec("previous", (B, T), torch.int64, "step", high=self.c.vocab_size),
        ]

    def chain_outputs(self) -> list[str]:
        return ["logits"]

    def chain(self, base: Tensor, previous: Tensor) -> Tensor:
        """This rank's slice of the block's draft logits [B, P, rows] float32, the chosen tokens known
        (previous [B, P]: the anchor, then the drafts): base plus each position's Markov transition, as
        `pick` scored them. Only for callers that ask for the full draft logits (gathered after it)."""
        return base + self._transition(previous)

    def _transition(self, previous: Tensor) -> Tensor:
        """The Markov head's logits of the tokens `previous` [...] -> [..., rows] float32 (this rank's rows)."""
        embedding = self.markov_embed[previous].to(self.dtype)  # [..., R]
        return F.linear(embedding, self.markov_head.to(self.dtype)).float()


def draft_regions(
    c: TextConfig, dtype: torch.dtype, cache_quant: bool, topo: Topology = Topology()
) -> list[dict[str, Region]]:
    """Each stage's regions by slot (`capture` and `context` on stage 0, `attn`, `moe`, `head` on the
    last), shaped for one rank of `topo` as the target's layers are (`regions.plan.make_layer_regions`):
    the MoE's routed experts (the draft's own) divided over the ep ranks and its shared expert sliced,
    the attention's heads over the tp ranks, the Markov head's output rows over the token group as the
    target head's vocabulary; the capture, context projection and the rest of the heads whole on every
    rank."""
    stages = []
    for stage in range(c.num_nextn_predict_layers):
        regions = {
            "attn": DraftAttention(c, dtype=dtype, cache_quant=cache_quant, topo=topo),
            "moe": DraftMoE(draft_moe_config(c), dtype=dtype, topo=topo),
        }
        if stage == 0:  # the capture runs in the target's steps; stage 0 holds its binding
            regions = {"capture": DraftCapture(c, dtype=dtype), "context": DraftContext(c, dtype=dtype), **regions}
        if stage == c.num_nextn_predict_layers - 1:
            regions["head"] = DraftHead(
                c, dtype=dtype, rows=head_rows(c, topo), group=topo.group_size, world=topo.world
            )
        stages.append(regions)
    return stages


def draft_specs(c: TextConfig) -> list[tuple[str, WeightSpec]]:
    """(stage prefix, weight spec) of every `mtp.*` checkpoint tensor, in stage order (what the tiny
    checkpoint generator draws, in this order)."""
    with torch.device("meta"):
        return [
            (PREFIX.format(stage=stage), s)
            for stage, regions in enumerate(draft_regions(c, torch.float32, True))
            for region in regions.values()
            for s in region.specs
        ]


def eager_invoke(stages: list[dict[str, Region]], head: Head | None):
    """invoke(stage, slot, *inputs, method=...) over eager regions (`regions.drafting`): slot `project`
    is the target's `head`, whose `project` the draft's logits go through."""

    def invoke(stage: int, slot: str, *inputs, method: str = DECODE):
        if slot == PROJECT:
            assert head is not None, "a draft whose logits go through the target head is given the head"
            out = head.project(*inputs)
        else:
            out = getattr(stages[stage][slot], method)(*inputs)
        return out if isinstance(out, tuple) else (out,)

    return invoke


def run_stages(
    stages: list[dict[str, Region]],
    c: TextConfig,
    embed: Embedding,
    features: Tensor,
    context_positions: Tensor,
    block_tokens: Tensor,
    positions: Tensor,
) -> tuple[Tensor, Tensor]:
    """One draft block through every stage, eagerly -> the last stage's streams h [B, P, n, D] and pre
    [B, P, n] (what `DraftHead` reads).

    embed is the target's (`regions.step.Embedding`); features [B, C, L*D] at context_positions [B, C]
    (-1: empty); block_tokens [B, P] (the anchor, then noise tokens) at positions [B, P]."""
    h, pre = embed(block_tokens)
    region = stages[0]["context"]
    assert isinstance(region, DraftContext)
    context = region.project(features.to(embed.dtype))
    return run_draft_stages(eager_invoke(stages, None), len(stages), h, pre, context, context_positions, positions)
