"""The stage tasks of an RL iteration. Each reads like a sentence: ask the group's engine host to
do the stage on these URIs (one ``engines.wire.commands`` request), and return its typed result.

A task takes what it uses: the run as a ``Run`` (its name, where its outputs go, the host's lane) and
the stage's own values, which the Prefect UI shows as the task run's parameters. Only the two that
send the whole config to the hosts (``validate_inputs``, ``setup_engines``) take the ``RunConfig``."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel

from engines.wire.commands import (Checkpoint, CheckpointResult, CheckpointWait, CheckpointWaitResult, DynamicFilter,
                              DynamicFilterResult, Evaluate, EvaluateResult, ExportPolicy, ExportPolicyResult, GenRMScore,
                              GenRMScoreResult, Rollout, RolloutAndScore, RolloutAndScoreResult, RolloutResult, SetupEngines,
                              SetupEnginesResult, SyncWeights, SyncWeightsResult, TrainStep, TrainStepResult, ValidateInputs,
                              ValidateInputsResult)
from engines.config import RunConfig
from engines.wire.channel import ROLLOUT_LANE
from storage.datasets import stage_uri
from tasks._host import call_host


class Run(BaseModel):
    """What a stage task reads of its run: its name (the key of its hosts' channels), its URI (where the
    stage outputs go: ``storage.datasets.stage_uri``) and the host's channel the generation stages take
    (``lane``: the rollout lane when they overlap a train step, ``rollout.max_staleness``)."""

    name: str
    uri: str
    lane: str | None = None

    @classmethod
    def of(cls, config: RunConfig) -> "Run":
        return cls(name=config.name, uri=config.run_uri, lane=ROLLOUT_LANE if config.rollout.max_staleness else None)


# Stage outputs live in object storage; Prefect keeps states and metrics, not results.
stage = task(cache_policy=NO_CACHE, persist_result=False)


@stage(name="validate-inputs", task_run_name="validate inputs")
async def validate_inputs(config: RunConfig) -> ValidateInputsResult:
    return await call_host(config.name, 0, ValidateInputs(config=config))


@stage(name="setup-engines", task_run_name="setup engines dp={group}")
async def setup_engines(config: RunConfig, group: int, resume: str | None, master: str | None = None) -> SetupEnginesResult:
    return await call_host(config.name, group, SetupEngines(config=config, resume=resume, master=master))


@stage(name="rollout", task_run_name="rollout dp={group} wave={wave}")
async def rollout(run: Run, step: int, group: int, wave: int, cursor: int, count: int) -> RolloutResult:
    out = stage_uri(run.uri, step, "rollouts", group, wave)
    return await call_host(run.name, group, Rollout(step=step, wave=wave, cursor=cursor, count=count, out=out), run.lane)


@stage(name="genrm-score", task_run_name="genrm_score dp={group} wave={wave}")
async def genrm_score(run: Run, step: int, group: int, wave: int) -> GenRMScoreResult:
    rollouts, out = (stage_uri(run.uri, step, name, group, wave) for name in ("rollouts", "scored"))
    return await call_host(run.name, group, GenRMScore(rollouts=rollouts, out=out), run.lane)


@stage(name="rollout-and-score", task_run_name="rollout_and_score dp={group} wave={wave}")
async def rollout_and_score(run: Run, step: int, group: int, wave: int, cursor: int, count: int,
                            ahead: list[int] | None = None) -> RolloutAndScoreResult:
    """Partial colocation: the wave's rollout and its GenRM scoring at once, each finished chunk of
    samples streaming to the judge; the same outputs as ``rollout`` then ``genrm_score``.
    ``rollout.mode=stream``: the groups the host's lane has generated and scored (``ahead``: the
    prompts beyond ``cursor`` taken already)."""
    rollouts, scored = (stage_uri(run.uri, step, name, group, wave) for name in ("rollouts", "scored"))
    return await call_host(run.name, group, RolloutAndScore(step=step, wave=wave, cursor=cursor, count=count, ahead=ahead or [],
                                                            rollouts_out=rollouts, scored_out=scored), run.lane)


@stage(name="dynamic-filter", task_run_name="dynamic_filter dp={group} wave={wave}")
async def dynamic_filter(run: Run, step: int, group: int, wave: int, target_groups: int, critic: bool,
                         carry: str | None = None) -> DynamicFilterResult:
    """Keep groups from ``carry`` (the groups the previous step carried over) and waves 0..wave, up to
    ``target_groups``; the kept groups beyond it go to this step's carry-over (``critic``: the rows
    keep the value model's per-token advantages)."""
    return await call_host(run.name, group, DynamicFilter(
        step=step, scored=[stage_uri(run.uri, step, "scored", group, w) for w in range(wave + 1)],
        out=stage_uri(run.uri, step, "experience", group), target_groups=target_groups,
        carry_in=carry, carry_out=stage_uri(run.uri, step, "carry", group), critic=critic), run.lane)


@stage(name="train-step", task_run_name="train_step dp={group}")
async def train_step(run: Run, step: int, group: int) -> TrainStepResult:
    return await call_host(run.name, group, TrainStep(experience=stage_uri(run.uri, step, "experience", group), step=step))


@stage(name="sync-weights", task_run_name="sync_weights dp={group}")
async def sync_weights(run: Run, group: int, timeout_s: float) -> SyncWeightsResult:
    return await call_host(run.name, group, SyncWeights(timeout_s=timeout_s))


@stage(name="checkpoint", task_run_name="checkpoint dp={group} step={step}")
async def checkpoint(run: Run, group: int, step: int, uri: str) -> CheckpointResult:
    return await call_host(run.name, group, Checkpoint(uri=uri))


@stage(name="checkpoint-wait", task_run_name="checkpoint_wait dp={group} step={step}")
async def checkpoint_wait(run: Run, group: int, step: int) -> CheckpointWaitResult:
    """Wait for the group's background write of step ``step``'s checkpoint; its files."""
    return await call_host(run.name, group, CheckpointWait())


@stage(name="evaluate", task_run_name="evaluate {label} dp={group}")
async def evaluate(run: Run, group: int, label: str, request: Evaluate) -> EvaluateResult:
    """The group's share of ``request``'s evaluation sets (what ``label`` evaluates: before RL, a step)."""
    return await call_host(run.name, group, request)


@stage(name="export-policy", task_run_name="export policy")
async def export_policy(run: Run, uri: str) -> ExportPolicyResult:
    return await call_host(run.name, 0, ExportPolicy(uri=uri))
