"""The draft step as one execution (trn2's fused path, issue 42): the DSpark draft's regions and every
collective between them in one module a batch bucket, as compiler/layers.py builds a layer's.

Per region call, a draft step is the context projection, each stage's attention and MoE, the last
stage's normalize, the target head's projection and the block's choice: 10 executions at one rank,
and with the head split by vocabulary over several ranks 9 + P (a `pick` a block position), with the
ranks' collectives on the host between them. The module (`manifest.DRAFT_MODULE`, planned by
`RegionPlan.draft_module`, slots `context`, `attn<s>`, `moe<s>`, `head`, `project`) runs them in order
(`ops`):

    context: the features rings of the target layers the draft reads -> the window's context rows
    each stage s: attention (its heads divided over the token group as the target's window
        attention's: its partial streams all-reduced over the token group) -> MoE (compiler/layers.py `moe_ops`: the ep all-reduce, or EP dispatch's
        all-gather of every rank's rows and reduce-scatter of the partials)
    the last stage's head `normalize` -> the target head's `project`: this rank's vocabulary slice of
        the block's logits [B, P, rows]
    one rank: the head's `tokens` (the Markov chain over the block in one call) -> drafts [B, P]
    several: P times: the head's `pick` on this rank's slice -> one all-gather over every rank of the
        packed (value, index) pairs [B, 2] -> each group's winners, this group's the next `previous`
        (regions/picking.py's glue) -> drafts [groups, B, P]: every group's block on every rank, as
        the host loop (`picking.pick_block`) gives it

So the draft's logits never leave the device: a rank's host gets its drafts, 8 bytes a position a row
each. The module's inputs are the block's embedded streams (h, pre: the bundle embeds on the host), its
positions, the context's positions and slots, the features rings (the target's fused layers write them,
`..._capture`), `is_image` (the MoE's: false), the anchor tokens and the first block position.

The compile checks it on XLA:CPU against the same ops run eagerly (`layers.check`), as a layer's.
"""

from __future__ import annotations

import torch

from deepinfer.bundles.manifest import DECODE, PROJECT
from deepinfer.bundles.topology import Topology
from deepinfer.compiler.layers import Glue, Op, Run, _groups, moe_ops
from deepinfer.compiler.plan import RegionPlan
from deepinfer.compiler.targets.hlo import Collective

OUTPUT = "drafts"  # the module's one output: [B, P] at one rank, [groups, B, P] with several


def ops(plan: RegionPlan, topo: Topology, dtype: torch.dtype) -> list[Op]:
    """What the draft step runs on a rank of `topo`, in order."""
    out: list[Op] = [Run("context", DECODE)]
    for s in range(len(plan.draft)):
        out.append(Run(f"attn{s}", DECODE))
        if topo.group_size > 1:  # its heads divided over the token group: the partial streams summed
            out.append(Collective("all_reduce", "h", "h", _groups(topo.token_groups()), to=dtype))
        out += moe_ops(f"moe{s}", topo, dtype)
    out += [
        Run("head", "normalize"),
        Run(PROJECT, PROJECT, inputs=(("x", "normalized"),), outputs=(("logits", "base"),)),
    ]
    if topo.world == 1:  # the whole vocabulary here: the chain in one call
        return out + [Run("head", "tokens", outputs=(("logits", "block_logits"),))]
    world = _groups([list(range(topo.world))])
    for i in range(plan.draft_block):
        out += [
            Run("head", "pick", inputs=(("previous", "anchor"),) if i == 0 else ()),
            Glue("pack_pick", ("value", "index"), ("pair",)),
            Collective("all_gather", "pair", "pairs", world, stack=True),
            Glue("merge_pairs", ("pairs", "rank"), (f"winners{i}", "previous")),
        ]
        if i + 1 < plan.draft_block:
            out.append(Glue("next_position", ("position",), ("position",)))
    return out + [Glue("stack_drafts", tuple(f"winners{i}" for i in range(plan.draft_block)), (OUTPUT,))]
