"""The training run: one Prefect flow per run, one sub-flow per RL iteration, one
sub-flow per DP group inside it.

    train ─┬─ iteration-0000 ─┬─ iteration-0000-dp-0: rollout → genrm_score → dynamic_filter (→ more waves)
           │                  │                        → train_step → sync_weights (→ checkpoint)
           │                  └─ iteration-0000-dp-1: (the same, concurrently; train_step is one collective)
           ├─ iteration-0001 ...

The parent flows hold the config, URIs and small metrics — never sample data. Data moves
engine host → object storage → engine host.
"""

from __future__ import annotations

import asyncio
import time

from prefect import flow, get_run_logger
from prefect.artifacts import acreate_markdown_artifact, acreate_table_artifact

import tasks
from engines.host import LocalHosts
from flows.config import RunConfig, load_config
from flows.artifacts import Curves, Progress, StepProgress
from storage import objectstore
from storage.runstate import RunState, checkpoint_uri, commit_checkpoint


@flow(name="dp-group", flow_run_name="iteration-{step:04d}-dp-{group}")
async def dp_group(config: RunConfig, step: int, group: int, cursor: int, end: int | None = None) -> dict:
    """The controller of one DP group for one step (``end``: this run stops before that step)."""
    run, run_uri, s = config.name, config.run_uri, config.sampling
    stages: dict[str, float] = {"rollout": 0.0, "genrm_score": 0.0, "dynamic_filter": 0.0}
    waves = []
    progress = StepProgress(run, step, group, is_checkpoint_step(config, step, end))  # live in the UI; never waited on
    for wave in range(s.max_waves):
        if wave:
            progress.another_wave(wave)
        t0 = time.perf_counter()
        rolled = await tasks.rollout(run, run_uri, step, group, wave, cursor, s.prompts_per_wave)
        progress.finished("rollout", wave)
        cursor = rolled["cursor"]
        t1 = time.perf_counter()
        scored = await tasks.genrm_score(run, run_uri, step, group, wave)
        progress.finished("genrm_score", wave)
        t2 = time.perf_counter()
        kept = await tasks.dynamic_filter(run, run_uri, step, group, wave, s.target_groups)
        progress.finished("dynamic_filter", wave)
        t3 = time.perf_counter()
        stages["rollout"] += t1 - t0
        stages["genrm_score"] += t2 - t1
        stages["dynamic_filter"] += t3 - t2
        waves.append({"rollout": rolled, "score": scored, "filter": kept})
        if kept["enough"]:
            break
    get_run_logger().info("dp-%d step %d: %s after %d wave(s)", group, step, kept["reason"], len(waves))
    t0 = time.perf_counter()
    trained = await tasks.train_step(run, run_uri, step, group)
    progress.finished("train_step")
    t1 = time.perf_counter()
    synced = await tasks.sync_weights(run, group)
    progress.finished("sync_weights")
    stages["train_step"] = t1 - t0
    stages["sync_weights"] = time.perf_counter() - t1
    saved = None
    if is_checkpoint_step(config, step, end):
        t0 = time.perf_counter()
        saved = await tasks.checkpoint(run, group, step, checkpoint_uri(run_uri, step))
        progress.finished("checkpoint")
        stages["checkpoint"] = time.perf_counter() - t0
    samples = sum(w["rollout"]["samples"] for w in waves)
    await progress.flush()
    return {
        "group": group, "cursor": cursor, "waves": len(waves), "kept": kept["kept"], "dropped_equal": kept["dropped_equal"],
        "surplus": kept["surplus"], "reason": kept["reason"], "samples": samples,
        "tokens": sum(w["rollout"]["tokens"] for w in waves),
        "rollout_engine_s": sum(w["rollout"]["seconds"] for w in waves),
        "reward_sum": sum(w["score"]["reward_mean"] * w["rollout"]["samples"] for w in waves),
        "accuracy_sum": sum((w["score"]["accuracy"] or 0.0) * w["rollout"]["samples"] for w in waves),
        "judge_agreement": waves[-1]["score"]["judge_agreement"],
        "train": trained, "sync_s": synced["seconds"], "checkpoint_files": saved["files"] if saved else [],
        "stages": stages,
        # seconds the host spent on this group's commands; the rest of the step is orchestration
        "engine_s": sum(r["host_s"] for r in (*(r for w in waves for r in w.values()), trained, synced, saved) if r),
    }


def is_checkpoint_step(config: RunConfig, step: int, end: int | None = None) -> bool:
    """Every ``checkpoint.every`` steps, and at the last step of this run (so the next run resumes there)."""
    return (step + 1) % config.checkpoint.every == 0 or step == (config.steps if end is None else end) - 1


@flow(name="iteration", flow_run_name="iteration-{step:04d}")
async def iteration(config: RunConfig, step: int, cursors: list[int], end: int | None = None) -> dict:
    """One RL step: every DP group concurrently, then commit the checkpoint if one was written."""
    start = time.perf_counter()
    groups = await asyncio.gather(*(dp_group(config, step, g, cursors[g], end) for g in range(config.dp)))
    shas = {g["train"]["params_sha"] for g in groups}
    if len(shas) != 1:
        raise RuntimeError(f"step {step}: DP replicas diverged (parameter fingerprints {sorted(shas)})")
    samples = sum(g["samples"] for g in groups)
    seconds = time.perf_counter() - start
    metrics = {
        "step": step,
        "reward": sum(g["reward_sum"] for g in groups) / samples,
        "accuracy": sum(g["accuracy_sum"] for g in groups) / samples,
        "kept_groups": sum(g["kept"] for g in groups),
        "dropped_groups": sum(g["dropped_equal"] for g in groups),
        "waves": max(g["waves"] for g in groups),
        "samples": samples,
        "loss": groups[0]["train"]["loss"],
        "rollout_tokens_per_s": sum(g["tokens"] for g in groups) / max(sum(g["rollout_engine_s"] for g in groups) / len(groups), 1e-9),
        "train_tokens_per_s": sum(g["train"]["tokens_per_s"] for g in groups),
        "seconds": seconds,
        "engine_s": max(g["engine_s"] for g in groups),
        "overhead_s": seconds - max(g["engine_s"] for g in groups),
        "engine_loads": max(g["train"]["engine_loads"] for g in groups),  # per host, this run: stays 1
        **{f"{k}_s": max(g["stages"].get(k, 0.0) for g in groups) for k in ("rollout", "genrm_score", "dynamic_filter", "train_step", "sync_weights", "checkpoint")},
        "cursors": [g["cursor"] for g in groups],
        "policy_version": groups[0]["train"]["policy_version"],
        "checkpoint_files": [f for g in groups for f in g["checkpoint_files"]],
    }
    if metrics["checkpoint_files"]:
        state = RunState.load(config.run_uri)
        state.step, state.cursors, state.policy_version = step, metrics["cursors"], metrics["policy_version"]
        state.checkpoint = checkpoint_uri(config.run_uri, step)
        commit_checkpoint(config.run_uri, state, metrics["checkpoint_files"], config.checkpoint.keep_last)
    await acreate_table_artifact(
        key=f"{config.name}-iteration",
        table=[{k: (round(v, 4) if isinstance(v, float) else v) for k, v in metrics.items() if k not in ("cursors", "checkpoint_files")}],
        description=f"{config.name} step {step}: reward {metrics['reward']:.3f}, kept {metrics['kept_groups']} groups",
    )
    return metrics


async def heldout_accuracy(config: RunConfig, label: str) -> float | None:
    if config.data.heldout is None or config.reward.rule is None:
        return None
    uri = config.uri(config.data.heldout)
    parts = await asyncio.gather(*(tasks.evaluate(config.name, g, uri, config.data.heldout_limit, label) for g in range(config.dp)))
    total = sum(p["total"] for p in parts)
    return sum(p["correct"] for p in parts) / total if total else None


def run_label(prefix: str):
    """A flow-run name from the run config the flow was called with (e.g. ``train-demo``)."""

    def name() -> str:
        from prefect.runtime import flow_run

        params = flow_run.parameters
        try:
            return f"{prefix}-{load_config(params.get('config_file'), params.get('overrides') or []).name}"
        except ValueError:
            return f"{prefix}-invalid-config"

    return name


@flow(name="train", flow_run_name=run_label("train"))
async def train(config_file: str | None = None, overrides: list[str] | None = None) -> dict:
    """A whole RL run. Running the same run name again resumes from its last committed checkpoint."""
    logger = get_run_logger()
    config = load_config(config_file, overrides or [])
    run_uri = config.run_uri
    objectstore.check_reachable(config.uri(""))
    state = RunState.load(run_uri)
    if state is not None and len(state.cursors) != config.dp:
        raise ValueError(f"{run_uri}/state.json: run was started with dp={len(state.cursors)}, config has dp={config.dp}")
    first = state.step + 1 if state else 0
    # steps_per_run: each run (a schedule firing again) continues the training by that many steps
    end = config.steps if config.steps_per_run is None else min(config.steps, first + config.steps_per_run)
    if first >= config.steps:
        logger.info("run %s already finished %d/%d steps", config.name, first, config.steps)
    elif end < config.steps:
        logger.info("run %s: steps %d to %d of %d in this run (steps_per_run=%d)", config.name, first, end - 1, config.steps, config.steps_per_run)
    history = []
    with LocalHosts(config.name, config.dp, config.threads_per_host, config.host_timeout_s):
        await tasks.validate_inputs(config.name, config.model_dump())
        resume = state.checkpoint if state else None
        await asyncio.gather(*(tasks.setup_engines(config.name, g, config.model_dump(), resume) for g in range(config.dp)))
        if state is None:
            state = RunState(cursors=[0] * config.dp)
            state.heldout_before = await heldout_accuracy(config, "before")
            state.save(run_uri)  # step -1, no checkpoint: a resume starts from the beginning
            logger.info("held-out accuracy before RL: %s", _pct(state.heldout_before))
        cursors = state.cursors
        run_progress = Progress(f"{config.name}-progress", config.steps, done=first).start(f"{config.name}: {first} of {config.steps} steps done")
        curves = Curves(config.name, run_uri, config.steps, first, state.heldout_before)
        for step in range(first, end):
            metrics = await iteration(config, step, cursors, end)
            cursors = metrics["cursors"]
            history.append(metrics)
            run_progress.advance(f"{config.name}: {step + 1} of {config.steps} steps done; step {step}: reward "
                                 f"{metrics['reward']:.3f}, rollout accuracy {_pct(metrics['accuracy'])}")
            curves.add(metrics)
            logger.info(
                "step %d/%d reward %.3f accuracy %.3f kept %d dropped %d waves %d (%.1fs, %.1fs in engines)", step + 1, config.steps,
                metrics["reward"], metrics["accuracy"], metrics["kept_groups"], metrics["dropped_groups"], metrics["waves"],
                metrics["seconds"], metrics["engine_s"],
            )
        after = await heldout_accuracy(config, "after")
        final_uri = objectstore.join(run_uri, "final")
        await tasks.export_policy(config.name, final_uri)
    before = (RunState.load(run_uri) or state).heldout_before
    summary = {"run": config.name, "steps": config.steps, "heldout_before": before, "heldout_after": after,
               "final_model": final_uri, "history": [{k: v for k, v in m.items() if k != "checkpoint_files"} for m in history]}
    await acreate_markdown_artifact(key=f"{config.name}-summary", markdown=_summary_markdown(summary),
                                    description=f"{config.name}: held-out accuracy {_pct(before)} → {_pct(after)}")
    curves.finish(after)
    await asyncio.gather(curves.flush(), run_progress.flush())
    logger.info("held-out accuracy: before RL %s, after RL %s", _pct(before), _pct(after))
    return summary


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _summary_markdown(summary: dict) -> str:
    lines = [f"# Run `{summary['run']}`", "",
             f"Held-out exact-match accuracy: **{_pct(summary['heldout_before'])} → {_pct(summary['heldout_after'])}**", "",
             "| step | reward | accuracy | kept | dropped | waves | seconds |", "|---|---|---|---|---|---|---|"]
    for m in summary["history"]:
        lines.append(f"| {m['step']} | {m['reward']:.3f} | {m['accuracy']:.3f} | {m['kept_groups']} | {m['dropped_groups']} | {m['waves']} | {m['seconds']:.2f} |")
    return "\n".join(lines)
