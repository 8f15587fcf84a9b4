"""Where each engine-host process sits: the ranks of a run laid out in DP groups.

A DP group is ``tp x ep x pp x fsdp`` ranks, one process and one device each, that hold one copy
of the policy between them: with the Megatron trainer ``pp`` pipeline stages, each a run of its
layers (the first the embedding, the last the output layer), each stage's layers split over
``tp`` tensor-parallel ranks, a mixture's experts over ``ep`` expert-parallel ranks; with the
torch trainer ``fsdp`` ranks over which FSDP2 shards every parameter (each training its share of
the group's rows). The run's ``dp x`` group-size ranks are numbered in the order Megatron-Core's
``parallel_state`` is told to use ("tp-cp-ep-pp-dp", engines/backends/megatron/model.py): a
group's ranks are consecutive, tensor-parallel ranks innermost, then expert-parallel ones, then
stages. So the controller, which reaches each rank over its own channel, and the trainer agree on
who is who, and a group placed on consecutive devices keeps
its TP traffic, the heaviest, on the nearest ones. The group's first rank (stage 0, TP rank 0) is
its leader: it answers the stages that need no trainer. The rollout engines and the judges have a
layout of their own in the group (ChatLearn's strategy per model): ``rollout`` replicas, each over
``rollout_tp`` consecutive ranks (vLLM's tensor parallelism; the replica's engine is held by its
first rank, from the leader on), which split a wave's chunks between them; the same for the judge
(docs/parallelism.md). Pure arithmetic: the controller imports it without torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    dp: int  # data-parallel groups
    tp: int = 1  # tensor-parallel ranks in each pipeline stage
    pp: int = 1  # pipeline stages in each group
    fsdp: int = 1  # ranks the torch trainer shards the policy over (FSDP2) in each group
    rollout: int = 1  # rollout-engine replicas in each group (rollout.replicas) ...
    rollout_tp: int = 1  # ... each over this many ranks (rollout.tensor_parallel)
    judge: int = 1  # judge replicas in each group (judge.replicas) ...
    judge_tp: int = 1  # ... each over this many ranks (judge.tensor_parallel)
    ep: int = 1  # expert-parallel ranks in each pipeline stage (a mixture's experts split between them)

    @property
    def size(self) -> int:
        """Ranks in each group."""
        return self.tp * self.ep * self.pp * self.fsdp

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
        return self.local(rank) // (self.tp * self.ep) % self.pp

    def ranks(self, group: int) -> list[int]:
        """The group's ranks, its leader first."""
        return list(range(group * self.size, (group + 1) * self.size))

    def serving(self, role: str) -> list[int]:
        """The places in a group (``local``) of the ranks that carry out a stage whose ``Request.ranks``
        is ``role``: "all", "leader", or the first rank of each replica of "rollout" or "judge"."""
        if role in ("rollout", "judge"):
            replicas, tp = (self.rollout, self.rollout_tp) if role == "rollout" else (self.judge, self.judge_tp)
            return [r * tp for r in range(replicas)]
        return list(range(self.size)) if role == "all" else [0]

    def leader(self, group: int) -> int:
        return group * self.size

    def name(self, rank: int) -> str:
        """``dp-1`` for a group's leader, ``dp-1.1`` for its second rank: in logs, faults and errors."""
        group, local = self.group(rank), self.local(rank)
        return f"dp-{group}" if local == 0 else f"dp-{group}.{local}"
