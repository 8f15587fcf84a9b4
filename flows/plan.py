"""What a DP group's sub-flow reads of the run's config: the ``dp-group`` flow run's parameter.

The ``iteration`` flow holds the whole ``RunConfig`` (it commits checkpoints, books metrics, starts
node controllers); each ``dp-group`` sub-flow and its stage tasks take only the few fields they use,
so the Prefect UI shows those as their parameters, the server stores a few hundred bytes per flow
run instead of the whole config, and Prefect has less to walk for every task it submits.
"""

from __future__ import annotations

from pydantic import BaseModel

from engines.config import RunConfig
from engines.config.sections import SamplingConfig
from tasks.stages import Run


class GroupPlan(BaseModel):
    """How every DP group of a run does its step (the same for each group and step)."""

    run: Run  # its name, its URI, the host's lane for the generation stages
    sampling: SamplingConfig  # waves, the target of kept groups, the keep-ratio estimate
    together: bool  # one stage answers a wave's scored samples (placement.mode=partial, rollout.mode=stream)
    overlapped: bool  # steps overlap: train in step order, when the run gives the turn (flows/pipeline.py)
    critic: bool  # the algorithm trains a value model: its per-token advantages travel with the rows
    sync_timeout_s: float  # rollout.sync_timeout_s

    @classmethod
    def of(cls, config: RunConfig) -> "GroupPlan":
        return cls(run=Run.of(config), sampling=config.sampling,
                   together=config.placement.mode == "partial" or config.rollout.mode == "stream",
                   overlapped=config.rollout.overlapped, critic=config.train.algorithm.needs.critic,
                   sync_timeout_s=config.rollout.sync_timeout_s)
