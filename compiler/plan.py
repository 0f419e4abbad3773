"""Region planning: which (kind, method) each layer runs, and the executables to build.

Layers are grouped by region kind (the attention variant, engram, moe; the
head once, and the token embedding once where it runs on the device). Each
kind is traced once per bucket: per (batch, tokens), and per
context bucket too for the kinds whose shapes depend on the context (those
reading a block table: attention with compressed state). Its weights are
stacked over the layers of that kind so layer i's weights are slice `index`
of each stack.

With a draft (`[speculative] draft`), the DSpark stages (`regions/dspark.py`) are planned
the same way, shaped for one rank as the target's layers are (the MoE's experts over the ep
ranks, the attention's heads over the tp ranks): kinds `dspark_context`, `dspark_attn`,
`dspark_moe`, `dspark_head` stacked over the stages (`mtp.N.`), traced at the batch buckets
only, for the draft's step shape: a block of `dspark_block_size` positions (the context
projection: the window of `sliding_window` target positions), plus the head's `project`
method at the block (the draft's logits are the target's head).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from deepinfer.bundles.layout import executable_name
from deepinfer.bundles.manifest import (
    CAPTURE_SLOT,
    DECODE,
    DRAFT_MODULE,
    ENGRAM_ROWS_MIX,
    HEAD_ROWS,
    LAYER_ROWS,
    MOE_ROWS,
    PROJECT,
    ROWS_SLOT,
)
from deepinfer.bundles.topology import Topology
from deepinfer.regions.base import Region
from deepinfer.regions.config import TextConfig
from deepinfer.regions.plan import make_embed, make_head, make_layer_regions
from deepinfer.regions.state import reads_context
from deepinfer.regions.step import LayerPlan, plan_layers
from deepinfer.regions.topology import ENGRAM_MIX

METHOD = DECODE
DRAFT_PROJECT = PROJECT  # the target head's method the draft's logits go through


class Exe(NamedTuple):
    """One executable to build: a kind's method at a (batch, tokens) step shape and, for the kinds
    whose shapes depend on the context, a context bucket (None for the others)."""

    kind: str
    method: str
    batch: int
    tokens: int
    context: int | None

    @property
    def name(self) -> str:
        """Its name in the bundle: its file, log, cache key and messages (`attn_window.decode.b1t1`)."""
        return executable_name(self.kind, self.method, self.batch, self.tokens, self.context)


@dataclass
class KindPlan:
    kind: str
    region: Region  # a representative instance (meta weights)
    layers: list[int] = field(default_factory=list)  # layers running this kind, in stack order
    slot: str = ""  # embed | engram | attn | moe | head (draft: context, ...)
    source: str = "layers.{}."  # checkpoint prefix of a stack row (head, embed: none)
    full_specs: list = field(default_factory=list)  # the unsharded weights (as in the checkpoint)

    def prefix(self, layer: int) -> str:
        """The checkpoint prefix of stack row `layer` (a layer, a draft stage; -1: the head's, none)."""
        return "" if layer < 0 else self.source.format(layer)

    def reads_context(self, method: str = METHOD) -> bool:
        """Built per context bucket: the method's input shapes depend on the block-table width."""
        return reads_context(self.region, method)


@dataclass(frozen=True)
class LayerKind:
    """The region kinds a layer runs, in order ((slot, kind): engram, attn, moe), and its layers: one
    executable per bucket runs all of them where the target fuses layers (compiler/layers.py)."""

    name: str
    slots: tuple[tuple[str, str], ...]
    layers: tuple[int, ...]


LAYER_PREFIX = "layer_"


@dataclass
class RegionPlan:
    layers: list[LayerPlan]
    kinds: dict[str, KindPlan]
    # layer -> {slot: (kind, index in that kind's stacks)}
    bindings: dict[int, dict[str, tuple[str, int]]]
    # the draft's stages: stage -> {slot: (kind, index in that kind's stacks)}; empty without a draft
    draft: list[dict[str, tuple[str, int]]] = field(default_factory=list)
    draft_block: int = 0  # positions a draft step runs (dspark_block_size)
    draft_window: int = 0  # target positions the context projection reads (sliding_window)
    draft_targets: tuple[int, ...] = ()  # the target layers whose features the draft reads (capture)

    def fused_kinds(self) -> dict[str, LayerKind]:
        """The layer kinds by name (`layer_source_r2_engram`: the attention kind without its `attn_`,
        then the other slots but the MoE), in the order of their first layers. A layer the draft reads
        (`draft_targets`) is a capture twin of its kind (`..._capture`): the draft's capture, bound
        from stage 0's, runs inside it (compiler/layers.py)."""
        kinds: dict[str, LayerKind] = {}
        for p in self.layers:
            slots = tuple((slot, kind) for slot, (kind, _) in self.bindings[p.layer].items())
            if p.layer in self.draft_targets:
                slots += ((CAPTURE_SLOT, self.draft[0][CAPTURE_SLOT][0]),)
            own = dict(slots)
            name = LAYER_PREFIX + own["attn"].removeprefix("attn_")
            name += "".join(f"_{slot}" for slot, _ in slots if slot not in ("attn", "moe"))
            lk = kinds.get(name)
            assert lk is None or lk.slots == slots, f"layers {lk.layers[0]} and {p.layer} share {name}, not regions"
            kinds[name] = LayerKind(name, slots, (lk.layers if lk else ()) + (p.layer,))
        return kinds

    def fused_executables(
        self, shapes: list[tuple[int, int]], contexts: tuple[int, ...], gathered: int = 1, rows: int = 1
    ) -> list[Exe]:
        """The executables with one per layer kind and bucket in place of its regions' (the embedding
        first, the head and the draft's after: the draft's MoE on `gathered` token groups' rows under EP
        dispatch; its capture inside the twins), context buckets where any of its regions reads one.
        With prompt rows divided over `rows` ranks, each layer kind's `LAYER_ROWS` method too, at each
        prompt bucket, the head's module there (`HEAD_ROWS`) and the embedding at a rank's share of
        each prompt bucket's tokens (compiler/rows_layers.py)."""
        kinds = self.fused_kinds()
        fused = {kind for lk in kinds.values() for _, kind in lk.slots}
        regions = [e for e in self.executables(shapes, contexts, gathered) if e.kind not in fused]
        prompts = [(b, t) for b, t in shapes if t > 1 and t % rows == 0] if rows > 1 else []
        # with divided rows every prompt step runs the rows modules: the decode's at the decode buckets only
        decode = [s for s in shapes if s not in prompts]
        layers = [
            Exe(lk.name, method, b, t, c)
            for method, buckets in ((METHOD, decode), (LAYER_ROWS, prompts))
            for lk in kinds.values()
            for b, t in buckets
            for c in (contexts if any(self._reads_context(k) for _, k in lk.slots) else (None,))
        ]
        first = [e for e in regions if self.kinds[e.kind].slot == "embed"]
        if first and prompts:  # the embedding at a rank's rows too (it takes their tokens)
            have = {(e.batch, e.tokens) for e in first}
            own = sorted({(b, t // rows) for b, t in prompts} - have)
            first = first + [Exe(first[0].kind, METHOD, b, t, None) for b, t in own]
        # the draft step as one executable a batch bucket (compiler/draft_layers.py); its regions'
        # own executables stay for the full draft logits (tests, debugging)
        drafts = [Exe(DRAFT_MODULE, METHOD, b, self.draft_block, None) for b in sorted({b for b, _ in shapes})]
        heads = [Exe(HEAD_ROWS, METHOD, b, t, None) for b, t in prompts]
        return first + layers + [e for e in regions if e not in first] + heads + (drafts if self.draft else [])

    def draft_module(self) -> LayerKind:
        """The draft step's one executable as a kind (`DRAFT_MODULE`): the context projection, each
        stage's attention and MoE (slots `attn<s>`, `moe<s>`), the last stage's head and the target
        head's projection (slot `project`); `layers` its stages (manifest.Draft.module_binding binds them)."""
        assert self.draft, "a plan without a draft has no draft step"
        slots = [("context", self.draft[0]["context"][0])]
        for s, stage in enumerate(self.draft):
            slots += [(f"attn{s}", stage["attn"][0]), (f"moe{s}", stage["moe"][0])]
        slots += [("head", self.draft[-1]["head"][0]), (PROJECT, "head")]
        return LayerKind(DRAFT_MODULE, tuple(slots), tuple(range(len(self.draft))))

    @property
    def divided_rows(self) -> bool:
        """Whether a prompt chunk's rows are divided over the token group (the layers' `rows` twins)."""
        return any(ROWS_SLOT in slots for slots in self.bindings.values())

    def fused_modules(self) -> dict[str, LayerKind]:
        """What the fused path builds as one module each: the layer kinds, the draft step, and with
        divided prompt rows the head after the rows' gather (compiler/rows_layers.py)."""
        out = {**self.fused_kinds(), **({DRAFT_MODULE: self.draft_module()} if self.draft else {})}
        if self.divided_rows:
            out[HEAD_ROWS] = LayerKind(HEAD_ROWS, (("head", "head"),), (-1,))
        return out

    def pieces(self, lk: LayerKind, exe: Exe, gathered: int = 1) -> dict[tuple[str, str], Exe]:
        """(slot, method) -> the region executable a fused layer `exe` of kind `lk` runs it as (each
        method of each slot's kind; the MoE on `gathered` token groups' rows under EP dispatch)."""
        if lk.name == DRAFT_MODULE:
            return self._draft_pieces(lk, exe, gathered)
        if lk.name == HEAD_ROWS:
            return {("head", exe.method): Exe("head", exe.method, exe.batch, exe.tokens, None)}
        # a prompt chunk divided by rows: the MoE's and the engram's divided methods too, the MoE at the
        # chunk's batch (the rows gather along the tokens)
        divided = {"moe": MOE_ROWS, "engram": (ENGRAM_ROWS_MIX,)} if exe.method == LAYER_ROWS else {}
        gathered = 1 if divided else gathered
        out = {}
        for slot, kind in lk.slots:
            kp = self.kinds[kind]
            batch = exe.batch * (gathered if slot == "moe" else 1)
            for method in (*kp.region.methods(), *divided.get(slot, ())):
                out[(slot, method)] = Exe(
                    kind, method, batch, exe.tokens, exe.context if kp.reads_context(method) else None
                )
        return out

    def _draft_pieces(self, lk: LayerKind, exe: Exe, gathered: int) -> dict[tuple[str, str], Exe]:
        """The draft step's pieces: its regions' executables at `exe`'s batch (see `executables`)."""
        out = {(PROJECT, PROJECT): Exe("head", DRAFT_PROJECT, exe.batch, self.draft_block, None)}
        for slot, kind in lk.slots[:-1]:
            kp = self.kinds[kind]
            T = self.draft_window if kp.slot == "context" else self.draft_block
            batch = exe.batch * (gathered if kp.slot == "moe" else 1)
            out.update({(slot, m): Exe(kind, m, batch, T, None) for m in kp.region.methods()})
        return out

    def replicated_prompt_piece(self, exe: Exe) -> bool:
        """Whether `exe` is a layer's piece of a replicated prompt step (every rank every row: the
        attention's, the MoE's `decode`, the engram's `decode` and `mix`), which a fused bundle with
        divided rows never runs: its prompt steps run the layers' rows modules."""
        slot = self.kinds[exe.kind].slot
        replicated = slot in ("attn", CAPTURE_SLOT) or (
            slot in ("moe", "engram") and exe.method in (METHOD, ENGRAM_MIX)
        )
        return exe.tokens > 1 and replicated

    def _reads_context(self, kind: str) -> bool:
        kp = self.kinds[kind]
        return any(kp.reads_context(m) for m in kp.region.methods())

    @property
    def draft_kinds(self) -> list[str]:
        """The kinds the draft's stages run, in stage order (none without a draft)."""
        return list(dict.fromkeys(kind for stage in self.draft for kind, _ in stage.values()))

    def executables(
        self, shapes: list[tuple[int, int]], contexts: tuple[int, ...], gathered: int = 1, rows: int = 1
    ) -> list[Exe]:
        """The executables to build, in plan order: context is one of `contexts` for the
        kinds that read it, None for the others. With EP dispatch over `gathered` token groups
        the MoE runs on the gathered rows: its batch buckets are `gathered` times larger. With a
        prompt's rows divided over `rows` ranks (the `rows` twins: at the prompt buckets only), the
        MoE's divided methods too (`moe_in`, `moe_experts`, `moe_out`) and the engram's `rows_mix`, at
        the prompt buckets. The draft's kinds come last, one executable per batch bucket."""
        drafts = self.draft_kinds
        out = [
            Exe(k, method, b * (gathered if k == "moe" else 1), t, c)
            for k, kp in self.kinds.items()
            if k not in drafts
            for method in kp.region.methods()
            for b, t in shapes
            if kp.slot != ROWS_SLOT or t > 1
            for c in (contexts if kp.reads_context(method) else (None,))
        ]
        if rows > 1:  # the MoE's divided methods at each prompt bucket (regions/moe.py: keyed by the chunk)
            out += [Exe("moe", m, b, t, None) for m in MOE_ROWS for b, t in shapes if t > 1]
            if "engram" in self.kinds:
                out += [Exe("engram", ENGRAM_ROWS_MIX, b, t, None) for b, t in shapes if t > 1]
        if not self.draft:
            return out
        batches = sorted({b for b, _ in shapes})
        for k in drafts:
            kp = self.kinds[k]
            if kp.slot == CAPTURE_SLOT:  # runs in the target's steps: at their shapes
                out += [Exe(k, METHOD, b, t, None) for b, t in shapes]
                continue
            T = self.draft_window if kp.slot == "context" else self.draft_block
            out += [
                Exe(k, method, b * (gathered if kp.slot == "moe" else 1), T, None)
                for method in kp.region.methods()
                for b in batches
            ]
        return out + [Exe("head", DRAFT_PROJECT, b, self.draft_block, None) for b in batches]


def plan_regions(
    c: TextConfig,
    dtype: torch.dtype,
    cache_quant: bool,
    topo: Topology = Topology(),
    fp8_format: str = "e4m3fn",
    *,
    device_embedding: bool = False,
    draft: bool = False,
    divided_rows: bool = False,
) -> RegionPlan:
    """Regions shaped for one rank of `topo` (one executable set serves every rank), decoding
    fp8 weights stored in `fp8_format` (the weight recipe's). With `device_embedding` the token
    embedding is a region kind of its own (`embed`, first), its table a weight stack held whole
    by every rank; without, the runtime looks the rows up on the host. With `draft`, the DSpark
    stages too, shaped for one rank of `topo` as the target's layers are. With `divided_rows`, each
    attention kind's twin too (`regions.rows.rows_twin`, slot `rows`: its whole weights, the prompt
    chunk's stages divided by rows over the token group).

    Their weight buffers are on the meta device: shapes and dtypes, no memory (a release
    plan would otherwise allocate a real region of every kind). Whoever runs a region binds
    real tensors to it first (`deepinfer diff`, the trn2 check)."""
    with torch.device("meta"):
        p = _plan_regions(c, dtype, cache_quant, topo, device_embedding)
        if divided_rows:
            _plan_rows(p, c, dtype, cache_quant, topo)
        if draft:
            _plan_draft(p, c, dtype, cache_quant, topo)
    for kp in p.kinds.values():
        kp.region.fp8_format = fp8_format
    return p


def _plan_regions(
    c: TextConfig, dtype: torch.dtype, cache_quant: bool, topo: Topology, device_embedding: bool
) -> RegionPlan:
    layers = plan_layers(c)
    kinds: dict[str, KindPlan] = {}
    if device_embedding:
        embed = make_embed(c, dtype)
        kinds[embed.kind] = KindPlan(embed.kind, embed, layers=[-1], slot="embed", full_specs=embed.specs)
    bindings: dict[int, dict[str, tuple[str, int]]] = {}
    for p in layers:
        regions = make_layer_regions(c, p, dtype, cache_quant, topo)
        full = make_layer_regions(c, p, dtype, cache_quant) if topo.world > 1 else regions
        bindings[p.layer] = {}
        for slot, region in regions.items():
            kp = kinds.setdefault(region.kind, KindPlan(region.kind, region, slot=slot, full_specs=full[slot].specs))
            bindings[p.layer][slot] = (region.kind, len(kp.layers))
            kp.layers.append(p.layer)
    head = make_head(c, dtype, topo)  # its rank's vocabulary rows; the checkpoint's are all of them
    full_head = make_head(c, dtype).specs if topo.world > 1 else head.specs
    kinds[head.kind] = KindPlan(head.kind, head, layers=[-1], slot="head", full_specs=full_head)
    return RegionPlan(layers, kinds, bindings)


def _plan_rows(p: RegionPlan, c: TextConfig, dtype: torch.dtype, cache_quant: bool, topo: Topology) -> None:
    """Each layer's attention twin for prompt chunks divided by rows (slot `rows`)."""
    from deepinfer.regions.rows import rows_twin

    for lp in p.layers:
        whole = make_layer_regions(c, lp, dtype, cache_quant)["attn"]
        twin = rows_twin(whole, topo.group_size)
        kp = p.kinds.setdefault(twin.kind, KindPlan(twin.kind, twin, slot=ROWS_SLOT, full_specs=whole.specs))
        p.bindings[lp.layer][ROWS_SLOT] = (twin.kind, len(kp.layers))
        kp.layers.append(lp.layer)


def _plan_draft(p: RegionPlan, c: TextConfig, dtype: torch.dtype, cache_quant: bool, topo: Topology) -> None:
    from deepinfer.regions.dspark import draft_regions

    stages = draft_regions(c, dtype, cache_quant, topo)
    full = draft_regions(c, dtype, cache_quant) if topo.world > 1 else stages  # the checkpoint's shapes
    for stage, regions in enumerate(stages):
        bound = {}
        for slot, region in regions.items():
            kp = p.kinds.setdefault(
                region.kind,
                KindPlan(region.kind, region, slot=slot, full_specs=full[stage][slot].specs, source="mtp.{}."),
            )
            bound[slot] = (region.kind, len(kp.layers))
            kp.layers.append(stage)
        p.draft.append(bound)
    p.draft_block, p.draft_window = c.dspark_block_size, c.sliding_window
    p.draft_targets = tuple(c.dspark_target_layer_ids)
