"""The stage tasks of an RL iteration. Each reads like a sentence: ask the group's engine
host to do the stage on these URIs, and return its metrics."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from storage.datasets import stage_uri
from tasks._host import call_host

# Stage outputs live in object storage; Prefect keeps states and metrics, not results.
stage = task(cache_policy=NO_CACHE, persist_result=False)


@stage(name="validate-inputs", task_run_name="validate inputs")
async def validate_inputs(run: str, config: dict) -> dict:
    return await call_host(run, 0, "validate", config=config)


@stage(name="setup-engines", task_run_name="setup engines dp={group}")
async def setup_engines(run: str, group: int, config: dict, resume: str | None, master: str | None = None) -> dict:
    return await call_host(run, group, "setup", config=config, resume=resume, master=master)


@stage(name="rollout", task_run_name="rollout dp={group} wave={wave}")
async def rollout(run: str, run_uri: str, step: int, group: int, wave: int, cursor: int, count: int) -> dict:
    out = stage_uri(run_uri, step, "rollouts", group, wave)
    return await call_host(run, group, "rollout", step=step, wave=wave, cursor=cursor, count=count, out=out) | {"uri": out}


@stage(name="genrm-score", task_run_name="genrm_score dp={group} wave={wave}")
async def genrm_score(run: str, run_uri: str, step: int, group: int, wave: int) -> dict:
    rollouts = stage_uri(run_uri, step, "rollouts", group, wave)
    out = stage_uri(run_uri, step, "scored", group, wave)
    return await call_host(run, group, "score", rollouts=rollouts, out=out) | {"uri": out}


@stage(name="rollout-and-score", task_run_name="rollout_and_score dp={group} wave={wave}")
async def rollout_and_score(run: str, run_uri: str, step: int, group: int, wave: int, cursor: int, count: int) -> dict:
    """Partial colocation: the wave's rollout and its GenRM scoring at once, each finished chunk of
    samples streaming to the judge; the same outputs as ``rollout`` then ``genrm_score``."""
    rollouts = stage_uri(run_uri, step, "rollouts", group, wave)
    scored = stage_uri(run_uri, step, "scored", group, wave)
    result = await call_host(run, group, "rollout_and_score", step=step, wave=wave, cursor=cursor, count=count,
                             rollouts_out=rollouts, scored_out=scored)
    result["rollout"]["uri"], result["score"]["uri"] = rollouts, scored
    return result


@stage(name="dynamic-filter", task_run_name="dynamic_filter dp={group} wave={wave}")
async def dynamic_filter(run: str, run_uri: str, step: int, group: int, wave: int, target_groups: int,
                         carry: str | None = None) -> dict:
    """Keep groups from ``carry`` (the groups the previous step carried over) and waves 0..wave;
    the kept groups beyond the target go to this step's carry-over."""
    scored = [stage_uri(run_uri, step, "scored", group, w) for w in range(wave + 1)]
    out = stage_uri(run_uri, step, "experience", group)
    return await call_host(run, group, "filter", scored=scored, out=out, target_groups=target_groups, step=step,
                           carry_in=carry, carry_out=stage_uri(run_uri, step, "carry", group)) | {"uri": out}


@stage(name="train-step", task_run_name="train_step dp={group}")
async def train_step(run: str, run_uri: str, step: int, group: int) -> dict:
    return await call_host(run, group, "train_step", experience=stage_uri(run_uri, step, "experience", group))


@stage(name="sync-weights", task_run_name="sync_weights dp={group}")
async def sync_weights(run: str, group: int) -> dict:
    return await call_host(run, group, "sync_weights")


@stage(name="checkpoint", task_run_name="checkpoint dp={group} step={step}")
async def checkpoint(run: str, group: int, step: int, uri: str) -> dict:
    return await call_host(run, group, "checkpoint", uri=uri)


@stage(name="checkpoint-wait", task_run_name="checkpoint_wait dp={group} step={step}")
async def checkpoint_wait(run: str, group: int, step: int) -> dict:
    """Wait for the group's background write of step ``step``'s checkpoint; its files."""
    return await call_host(run, group, "checkpoint_wait")


@stage(name="evaluate", task_run_name="evaluate {label} dp={group}")
async def evaluate(run: str, group: int, uri: str, limit: int, label: str) -> dict:
    return await call_host(run, group, "evaluate", uri=uri, limit=limit)


@stage(name="export-policy", task_run_name="export policy")
async def export_policy(run: str, uri: str) -> dict:
    return await call_host(run, 0, "export", uri=uri)
