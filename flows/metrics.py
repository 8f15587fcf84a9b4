"""What a step's flows record: a stage clock for the DP-group controller, the group's step as one
typed record of its stages' results, and the step's metrics as the iteration reports them."""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Awaitable, TypeVar

from pydantic import BaseModel

from engines.wire.commands import (EPISODE_FIGURES, CheckpointResult, CheckpointWaitResult, DynamicFilterResult,
                              GenRMScoreResult, Result, RolloutResult, SyncWeightsResult, TrainStepResult)
from engines.config import RunConfig
from flows.sampling import GroupSampling
from flows.artifacts import StepProgress

R = TypeVar("R", bound=Result)

# the stages whose seconds a step reports (``{stage}_s``) and whose device hand-overs it reports (``switch_{stage}_s``)
TIMED = ("rollout", "genrm_score", "rollout_and_score", "dynamic_filter", "train_step", "sync_weights", "checkpoint_wait", "checkpoint")
SWITCHED = ("rollout", "genrm_score", "train_step", "sync_weights")


class StageClock:
    """Times one DP group's stages as its controller waits for them (summed over waves), adds up
    the seconds its engine host spent on them, and marks each done in the group's live progress."""

    def __init__(self, progress: StepProgress):
        self.progress = progress
        self.seconds: dict[str, float] = defaultdict(float)
        self.engine_s = 0.0

    async def __call__(self, stage: str, call: Awaitable[R], wave: int | None = None) -> R:
        start = time.perf_counter()
        result = await call
        self.seconds[stage] += time.perf_counter() - start
        self.engine_s += result.host_s
        self.progress.finished(stage, wave)
        return result


class Wave(BaseModel):
    """One rollout wave of a group: its samples, their scores, the groups kept so far."""

    rollout: RolloutResult
    score: GenRMScoreResult
    filter: DynamicFilterResult


class GroupStep(BaseModel):
    """One DP group's step as its controller saw it: every stage's result, and the clock."""

    group: int
    waves: list[Wave]
    train: TrainStepResult
    sync: SyncWeightsResult
    checkpoint: CheckpointResult | None  # this step's checkpoint, on checkpoint steps
    checkpoint_waited: CheckpointWaitResult | None  # an earlier step's asynchronous write, collected
    sampling: dict  # the group's dynamic-sampling state after this step (``GroupSampling``)
    stage_s: dict[str, float]  # the clock: seconds per stage
    engine_s: float  # seconds the host spent on this group's commands; the rest is orchestration

    @property
    def kept(self) -> DynamicFilterResult:
        return self.waves[-1].filter

    def switch_s(self, stage: str) -> float:
        """Seconds the engines took to hand the devices over before ``stage``."""
        if stage == "train_step":
            return self.train.switch_s
        if stage == "sync_weights":
            return self.sync.switch_s
        return sum((w.rollout if stage == "rollout" else w.score).switch_s for w in self.waves)


class StepMetrics(BaseModel):
    """One RL step across every DP group: what the iteration flow reports, the run's history keeps
    and the artifacts show."""

    step: int
    reward: float  # mean over every sample drawn this step
    accuracy: float  # mean rule reward over every sample (0 without a rule)
    kept_groups: int
    dropped_groups: int  # groups with equal rewards
    waves: int  # most waves any group ran
    samples: int
    prompts: int
    # dynamic sampling: the share of the target batch filled, kept groups taken from the previous
    # step's carry-over, carried into the next step, and thrown away (older than max_carry_age)
    fill_rate: float
    carried_groups: int
    carried_over: int
    surplus_dropped: int
    stale_dropped: int = 0  # of those: more than rollout.max_staleness versions behind the trainer
    staleness: dict[int, int] = {}  # trained samples by versions behind the trainer (TensorBoard's histogram)
    keep_ratio: float | None
    # the trainer's figures: loss, grad_norm and the algorithm's statistics per trained token over
    # every group (engines.rl.loss_step.LossStep); TensorBoard, the tables and the curves iterate over it
    train: dict[str, float]
    response_tokens: float  # mean response length over every sample drawn
    # multi-turn episodes: per episode drawn, turns, tool calls, tool errors, tool seconds, and the share cut short
    episodes: dict[str, float] = {}
    rollout_tokens_per_s: float
    train_tokens_per_s: float
    train_tokens: float = 0.0  # tokens the loss read, over every group (an episode's observations not among them)
    balance_ratio: float  # max/mean of the DP groups' train tokens (1.0: even)
    seconds: float  # the iteration flow, timed inside it
    engine_s: float  # the slowest group's engine time
    overhead_s: float  # seconds - engine_s: orchestration
    engine_loads: int  # per host, this run: stays 1
    # the slowest group's seconds per stage, and its device hand-over seconds before each
    rollout_s: float
    rollout_busy_s: float = 0.0  # the slowest group's seconds generating (rollout.mode=stream: its lane's, beside the step)
    genrm_score_s: float
    rollout_and_score_s: float
    dynamic_filter_s: float
    train_step_s: float
    sync_weights_s: float
    checkpoint_wait_s: float
    checkpoint_s: float
    switch_rollout_s: float
    switch_genrm_score_s: float
    switch_train_step_s: float
    switch_sync_weights_s: float
    placement: str
    checkpoint_stall_s: float  # on the hosts: what training waited for
    policy_version: int
    params_sha: str  # the trained weights' fingerprint (equal on every replica)
    # eval.every: the held-out metric of this step's policy (policy_version), and the checkpoint
    # that holds those weights (None: not a checkpoint step)
    heldout: float | None = None
    heldout_checkpoint: str | None = None
    # eval.every's evaluation after this step: {set: {greedy, mean@k, pass@j, maj@k, prompts}} (engines/evaluation.py)
    evaluation: dict[str, dict[str, float]] = {}
    step_s: float | None = None  # the step as the train flow pays for it (set there)

    @classmethod
    def of(cls, config: RunConfig, step: int, groups: list[GroupStep], seconds: float) -> "StepMetrics":
        samples = sum(w.rollout.samples for g in groups for w in g.waves)
        engine_s = max(g.engine_s for g in groups)
        first = groups[0].train
        return cls(
            step=step,
            reward=sum(w.score.reward_mean * w.rollout.samples for g in groups for w in g.waves) / samples,
            accuracy=sum((w.score.accuracy or 0.0) * w.rollout.samples for g in groups for w in g.waves) / samples,
            kept_groups=sum(g.kept.kept for g in groups),
            dropped_groups=sum(g.kept.dropped_equal for g in groups),
            waves=max(len(g.waves) for g in groups),
            samples=samples,
            prompts=sum(w.rollout.prompts for g in groups for w in g.waves),
            fill_rate=sum(g.kept.kept for g in groups) / (config.sampling.target_groups * config.dp),
            carried_groups=sum(g.kept.carried_in for g in groups),
            carried_over=sum(g.kept.carried_out for g in groups),
            surplus_dropped=sum(g.kept.surplus_dropped for g in groups),
            stale_dropped=sum(g.kept.stale_dropped + sum(w.rollout.stale_dropped for w in g.waves) for g in groups),
            staleness={k: sum(g.train.staleness.get(k, 0) for g in groups) for k in sorted({k for g in groups for k in g.train.staleness})},
            keep_ratio=_mean([GroupSampling.from_dict(g.sampling).keep_ratio for g in groups]),
            train=train_statistics([(g.train.statistics, g.train.tokens) for g in groups]),
            response_tokens=sum(w.rollout.tokens for g in groups for w in g.waves) / samples,
            episodes={k: sum(w.rollout.episodes[k] for g in groups for w in g.waves if w.rollout.episodes) / samples
                      for k in EPISODE_FIGURES} if groups[0].waves[0].rollout.episodes else {},
            rollout_tokens_per_s=sum(w.rollout.tokens for g in groups for w in g.waves)
            / max(sum(w.rollout.seconds for g in groups for w in g.waves) / len(groups), 1e-9),
            train_tokens_per_s=sum(g.train.tokens_per_s for g in groups),
            train_tokens=sum(g.train.tokens for g in groups),
            balance_ratio=first.balance_ratio,
            seconds=seconds, engine_s=engine_s, overhead_s=seconds - engine_s,
            engine_loads=max(g.train.engine_loads for g in groups),
            **{f"{k}_s": max(g.stage_s.get(k, 0.0) for g in groups) for k in TIMED},
            **{f"switch_{k}_s": max(g.switch_s(k) for g in groups) for k in SWITCHED},
            rollout_busy_s=max(sum(w.rollout.busy_s for w in g.waves) for g in groups),
            placement=config.placement.mode,
            checkpoint_stall_s=max(g.checkpoint.stall_s if g.checkpoint else 0.0 for g in groups),
            policy_version=first.policy_version,
            params_sha=first.params_sha,
        )


REPLICATED = ("loss", "grad_norm")  # the step's own figures, equal on every group (the trainers all-reduce them)


def train_statistics(groups: list[tuple[dict[str, float], float]]) -> dict[str, float]:
    """The groups' trainer figures (statistics, tokens trained) as the step's: the replicated ones
    as they are, every other one per trained token, weighted by the groups' tokens (a group that
    trained nothing reports no statistic)."""
    names = dict.fromkeys(k for stats, _ in groups for k in stats)
    return {k: groups[0][0].get(k, 0.0) if k in REPLICATED else max(s.get(k, 0.0) for s, _ in groups) if k.endswith("_max")
            else _token_mean([(s.get(k, 0.0), t) for s, t in groups]) for k in names}


def _token_mean(values: list[tuple[float, float]]) -> float:
    """The groups' per-token figures weighted by their tokens."""
    tokens = sum(t for _, t in values)
    return sum(v * t for v, t in values) / tokens if tokens else 0.0


def _mean(values: list[float | None]) -> float | None:
    return None if any(v is None for v in values) else sum(values) / len(values)
