"""Where each engine-host process sits: the ranks of a run laid out in DP groups.

A DP group is ``tp x pp x fsdp`` ranks, one process and one device each, that hold one copy of
the policy between them: with the Megatron trainer ``pp`` pipeline stages, each a run of its
layers (the first the embedding, the last the output layer), each stage's layers split over
``tp`` tensor-parallel ranks; with the torch trainer ``fsdp`` ranks over which FSDP2 shards every
parameter (each training its share of the group's rows). The run's ``dp x`` group-size ranks are numbered in the order Megatron-Core's ``parallel_state`` is told
to use ("tp-cp-ep-pp-dp", engines/backends/megatron/model.py): a group's ranks are consecutive,
tensor-parallel ranks innermost, then stages. So the controller, which reaches each rank over its
own channel, and the trainer agree on who is who, and a group placed on consecutive devices keeps
its TP traffic, the heaviest, on the nearest ones. The group's first rank (stage 0, TP rank 0) is
its leader: it answers the stages that need no trainer. The group's first ``rollout`` ranks each hold
a rollout engine (replicas that split a wave's chunks between them), its first ``judge`` ranks a
judge (docs/parallelism.md). Pure arithmetic: the controller imports it without torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    dp: int  # data-parallel groups
    tp: int = 1  # tensor-parallel ranks in each pipeline stage
    pp: int = 1  # pipeline stages in each group
    fsdp: int = 1  # ranks the torch trainer shards the policy over (FSDP2) in each group
    rollout: int = 1  # rollout-engine replicas in each group, on its first ranks (rollout.replicas)
    judge: int = 1  # judge replicas in each group, on its first ranks (judge.replicas)

    @property
    def size(self) -> int:
        """Ranks in each group."""
        return self.tp * self.pp * self.fsdp

    @property
    def world(self) -> int:
        """Engine-host processes of the run."""
        return self.dp * self.size

    def group(self, rank: int) -> int:
        return rank // self.size

    def local(self, rank: int) -> int:
        """The rank's place in its group (0: the leader)."""
        return rank % self.size

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp

    def stage(self, rank: int) -> int:
        return self.local(rank) // self.tp % self.pp

    def ranks(self, group: int) -> list[int]:
        """The group's ranks, its leader first."""
        return list(range(group * self.size, (group + 1) * self.size))

    def serving(self, role: str) -> int:
        """How many of a group's ranks, from its leader, carry out a stage whose ``Request.ranks`` is
        ``role``: "all", "leader", or the replicas of "rollout" or "judge"."""
        return {"all": self.size, "leader": 1, "rollout": self.rollout, "judge": self.judge}[role]

    def leader(self, group: int) -> int:
        return group * self.size

    def name(self, rank: int) -> str:
        """``dp-1`` for a group's leader, ``dp-1.1`` for its second rank: in logs, faults and errors."""
        group, local = self.group(rank), self.local(rank)
        return f"dp-{group}" if local == 0 else f"dp-{group}.{local}"
