"""The stage tasks of an RL iteration. Each reads like a sentence: ask the group's engine host to
do the stage on these URIs (one ``engines.wire.commands`` request), and return its typed result."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from engines.wire.commands import (Checkpoint, CheckpointResult, CheckpointWait, CheckpointWaitResult, DynamicFilter,
                              DynamicFilterResult, Evaluate, EvaluateResult, ExportPolicy, ExportPolicyResult, GenRMScore,
                              GenRMScoreResult, Rollout, RolloutAndScore, RolloutAndScoreResult, RolloutResult, SetupEngines,
                              SetupEnginesResult, SyncWeights, SyncWeightsResult, TrainStep, TrainStepResult, ValidateInputs,
                              ValidateInputsResult)
from engines.config import RunConfig
from engines.wire.channel import ROLLOUT_LANE
from storage.datasets import stage_uri
from tasks._host import call_host


def lane(config: RunConfig) -> str | None:
    """Rollout, scoring and filtering go over the host's rollout lane when they overlap training."""
    return ROLLOUT_LANE if config.rollout.max_staleness else None

# Stage outputs live in object storage; Prefect keeps states and metrics, not results.
stage = task(cache_policy=NO_CACHE, persist_result=False)


@stage(name="validate-inputs", task_run_name="validate inputs")
async def validate_inputs(config: RunConfig) -> ValidateInputsResult:
    return await call_host(config.name, 0, ValidateInputs(config=config))


@stage(name="setup-engines", task_run_name="setup engines dp={group}")
async def setup_engines(config: RunConfig, group: int, resume: str | None, master: str | None = None) -> SetupEnginesResult:
    return await call_host(config.name, group, SetupEngines(config=config, resume=resume, master=master))


@stage(name="rollout", task_run_name="rollout dp={group} wave={wave}")
async def rollout(config: RunConfig, step: int, group: int, wave: int, cursor: int, count: int) -> RolloutResult:
    out = stage_uri(config.run_uri, step, "rollouts", group, wave)
    return await call_host(config.name, group, Rollout(step=step, wave=wave, cursor=cursor, count=count, out=out), lane(config))


@stage(name="genrm-score", task_run_name="genrm_score dp={group} wave={wave}")
async def genrm_score(config: RunConfig, step: int, group: int, wave: int) -> GenRMScoreResult:
    rollouts, out = (stage_uri(config.run_uri, step, name, group, wave) for name in ("rollouts", "scored"))
    return await call_host(config.name, group, GenRMScore(rollouts=rollouts, out=out), lane(config))


@stage(name="rollout-and-score", task_run_name="rollout_and_score dp={group} wave={wave}")
async def rollout_and_score(config: RunConfig, step: int, group: int, wave: int, cursor: int, count: int,
                            ahead: list[int] | None = None) -> RolloutAndScoreResult:
    """Partial colocation: the wave's rollout and its GenRM scoring at once, each finished chunk of
    samples streaming to the judge; the same outputs as ``rollout`` then ``genrm_score``.
    ``rollout.mode=stream``: the groups the host's lane has generated and scored (``ahead``: the
    prompts beyond ``cursor`` taken already)."""
    rollouts, scored = (stage_uri(config.run_uri, step, name, group, wave) for name in ("rollouts", "scored"))
    return await call_host(config.name, group, RolloutAndScore(step=step, wave=wave, cursor=cursor, count=count, ahead=ahead or [],
                                                               rollouts_out=rollouts, scored_out=scored), lane(config))


@stage(name="dynamic-filter", task_run_name="dynamic_filter dp={group} wave={wave}")
async def dynamic_filter(config: RunConfig, step: int, group: int, wave: int, carry: str | None = None) -> DynamicFilterResult:
    """Keep groups from ``carry`` (the groups the previous step carried over) and waves 0..wave;
    the kept groups beyond the target go to this step's carry-over."""
    run_uri = config.run_uri
    return await call_host(config.name, group, DynamicFilter(
        step=step, scored=[stage_uri(run_uri, step, "scored", group, w) for w in range(wave + 1)],
        out=stage_uri(run_uri, step, "experience", group), target_groups=config.sampling.target_groups,
        carry_in=carry, carry_out=stage_uri(run_uri, step, "carry", group), critic=config.train.algorithm.needs.critic),
        lane(config))


@stage(name="train-step", task_run_name="train_step dp={group}")
async def train_step(config: RunConfig, step: int, group: int) -> TrainStepResult:
    return await call_host(config.name, group, TrainStep(experience=stage_uri(config.run_uri, step, "experience", group), step=step))


@stage(name="sync-weights", task_run_name="sync_weights dp={group}")
async def sync_weights(config: RunConfig, group: int) -> SyncWeightsResult:
    return await call_host(config.name, group, SyncWeights(timeout_s=config.rollout.sync_timeout_s))


@stage(name="checkpoint", task_run_name="checkpoint dp={group} step={step}")
async def checkpoint(config: RunConfig, group: int, step: int, uri: str) -> CheckpointResult:
    return await call_host(config.name, group, Checkpoint(uri=uri))


@stage(name="checkpoint-wait", task_run_name="checkpoint_wait dp={group} step={step}")
async def checkpoint_wait(config: RunConfig, group: int, step: int) -> CheckpointWaitResult:
    """Wait for the group's background write of step ``step``'s checkpoint; its files."""
    return await call_host(config.name, group, CheckpointWait())


@stage(name="evaluate", task_run_name="evaluate {label} dp={group}")
async def evaluate(config: RunConfig, group: int, label: str) -> EvaluateResult:
    from engines.evaluation import sets_of

    e = config.eval
    return await call_host(config.name, group, Evaluate(
        sets=sets_of(config), samples=e.samples, temperature=e.temperature or config.rollout.temperature,
        correct_at=e.correct_at, seed=config.seed))


@stage(name="export-policy", task_run_name="export policy")
async def export_policy(config: RunConfig, uri: str) -> ExportPolicyResult:
    return await call_host(config.name, 0, ExportPolicy(uri=uri))
