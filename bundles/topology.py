"""Ranks: tensor (tp), expert (ep) and context (cp) parallel degrees and the sizes they imply.

    world = max(tp * cp, ep) processes, one per NeuronCore (or CPU process)
    rank  = group * (tp * cp) + cp_rank * tp + tp_rank

Tokens are replicated inside a group of tp * cp ranks; groups serve different
sequences. What each rank holds of a model: regions/topology.py.

`Topology` is the one spelling of the degrees: model.toml's `[parallel]` section is parsed
into it (compiler/config.py), the compiler plans and shards with it, and the manifest's
`Ranks` records it with the sizes it implies (`Ranks.of(topology, lnc)`, `Ranks.topology`).
"""

from __future__ import annotations

from dataclasses import dataclass


def partitions(groups, world: int) -> bool:
    """Whether replica `groups` (equal sizes) split ranks 0 .. world - 1, each rank in one group."""
    return len({len(g) for g in groups}) == 1 and sorted(r for g in groups for r in g) == list(range(world))


@dataclass(frozen=True, kw_only=True)
class Topology:
    tp: int = 1
    ep: int = 1
    cp: int = 1

    @property
    def group_size(self) -> int:
        """Ranks that share a token stream."""
        return self.tp * self.cp

    @property
    def world(self) -> int:
        return max(self.group_size, self.ep)

    @property
    def groups(self) -> int:
        """Token groups (independent sequence sets)."""
        return self.world // self.group_size

    @property
    def dispatch(self) -> bool:
        """True when the EP group spans token groups (all-gather + reduce-scatter)."""
        return self.ep > 1 and self.groups > 1

    def group_of(self, rank: int) -> int:
        return rank // self.group_size

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp

    def tp_groups(self) -> list[list[int]]:
        """The ranks of each tp group (a token group's ranks at one cp rank), every group in rank order."""
        return [
            [g * self.group_size + c * self.tp + t for t in range(self.tp)]
            for g in range(self.groups)
            for c in range(self.cp)
        ]

    def cp_groups(self) -> list[list[int]]:
        """The ranks of each cp group (a token group's ranks at one tp rank: they divide its context)."""
        return [
            [g * self.group_size + c * self.tp + t for c in range(self.cp)]
            for g in range(self.groups)
            for t in range(self.tp)
        ]

    def token_groups(self) -> list[list[int]]:
        """The ranks of each token group (tp * cp ranks that share a token stream), in rank order."""
        return [list(range(g * self.group_size, (g + 1) * self.group_size)) for g in range(self.groups)]

    def to_dict(self) -> dict[str, int]:
        """The degrees and the sizes they imply, as the manifest's `Ranks` records them."""
        return {"tp": self.tp, "ep": self.ep, "cp": self.cp, "world_size": self.world, "groups": self.groups}
