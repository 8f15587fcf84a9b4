"""Where each engine-host process sits: the ranks of a run laid out in DP groups.

A DP group is ``tp`` ranks, one process and one device each, that hold one copy of the policy
between them: Megatron-Core's tensor-parallel group. The run's ``dp * tp`` ranks are numbered
in Megatron-Core's order (``parallel_state``'s "tp-cp-ep-dp-pp": the tensor-parallel ranks of a
group are consecutive), so the controller, which reaches each rank over its own channel, and the
trainer's ``initialize_model_parallel`` agree on who is who. The group's first rank is its
leader: it holds the group's rollout engine and judge and answers the stages that need no
trainer (docs/parallelism.md). Pure arithmetic: the controller imports it without torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    dp: int  # data-parallel groups
    tp: int = 1  # tensor-parallel ranks in each group

    @property
    def world(self) -> int:
        """Engine-host processes of the run."""
        return self.dp * self.tp

    def group(self, rank: int) -> int:
        return rank // self.tp

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp

    def ranks(self, group: int) -> list[int]:
        """The group's ranks, its leader first."""
        return list(range(group * self.tp, (group + 1) * self.tp))

    def leader(self, group: int) -> int:
        return group * self.tp

    def name(self, rank: int) -> str:
        """``dp-1`` for a group's leader, ``dp-1.1`` for its second rank: in logs, faults and errors."""
        group, local = self.group(rank), self.tp_rank(rank)
        return f"dp-{group}" if local == 0 else f"dp-{group}.{local}"
