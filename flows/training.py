"""The training run: one Prefect flow per run, one sub-flow per RL iteration, one
sub-flow per DP group inside it.

    train ─┬─ iteration-0000 ─┬─ iteration-0000-dp-0: rollout → genrm_score → dynamic_filter (→ more waves)
           │                  │                        → train_step → sync_weights (→ checkpoint)
           │                  │    (placement.mode=partial: rollout_and_score → dynamic_filter per wave)
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
from engines.sampling import GroupSampling, plan_wave
from flows.config import RunConfig, load_config
from flows.artifacts import Curves, Progress, StepProgress
from flows.hosts import engine_hosts
from storage import objectstore
from storage.runstate import RunState, checkpoint_uri, commit_checkpoint, discard_uncommitted


@flow(name="dp-group", flow_run_name="iteration-{step:04d}-dp-{group}")
async def dp_group(config: RunConfig, step: int, group: int, cursor: int, end: int | None = None,
                   written: int | None = None, sampling: dict | None = None) -> dict:
    """The controller of one DP group for one step (``end``: this run stops before that step;
    ``written``: the earlier step whose checkpoint the host is still writing in the background;
    ``sampling``: the group's dynamic-sampling state after the previous step, ``GroupSampling``)."""
    run, run_uri, s = config.name, config.run_uri, config.sampling
    stages: dict[str, float] = {"rollout": 0.0, "genrm_score": 0.0, "dynamic_filter": 0.0}
    switches: dict[str, float] = {"rollout": 0.0, "genrm_score": 0.0}  # placement: device hand-over seconds per stage
    waves = []
    progress = StepProgress(run, step, group, is_checkpoint_step(config, step, end))  # live in the UI; never waited on
    state = GroupSampling.from_dict(sampling)
    carry_in, have = state.carry, state.carried  # groups the previous step carried over count as kept
    sizes = []  # prompts drawn by each wave
    for wave in range(s.max_waves):
        if wave:
            progress.another_wave(wave)
        t0 = time.perf_counter()
        count = plan_wave(s, state, have)  # fixed, or from the keep-ratio estimate (engines/sampling.py)
        if config.placement.mode == "partial":  # rollout and judge resident at once, samples streaming to the judge
            both = await tasks.rollout_and_score(run, run_uri, step, group, wave, cursor, count)
            rolled, scored = both["rollout"] | {"host_s": both["host_s"]}, both["score"] | {"host_s": 0.0}
            progress.finished("rollout", wave)
            progress.finished("genrm_score", wave)
            t2 = time.perf_counter()
            stages["rollout_and_score"] = stages.get("rollout_and_score", 0.0) + t2 - t0
        else:  # full colocation: one engine after the other, each on all the group's devices
            rolled = await tasks.rollout(run, run_uri, step, group, wave, cursor, count)
            progress.finished("rollout", wave)
            t1 = time.perf_counter()
            scored = await tasks.genrm_score(run, run_uri, step, group, wave)
            progress.finished("genrm_score", wave)
            t2 = time.perf_counter()
            stages["rollout"] += t1 - t0
            stages["genrm_score"] += t2 - t1
        cursor = rolled["cursor"]
        switches["rollout"] += rolled.get("switch_s", 0.0)
        switches["genrm_score"] += scored.get("switch_s", 0.0)
        kept = await tasks.dynamic_filter(run, run_uri, step, group, wave, s.target_groups, carry_in)
        progress.finished("dynamic_filter", wave)
        t3 = time.perf_counter()
        state.observe(count, kept["new_kept"], s.keep_ratio_decay)
        have = kept["kept"]
        stages["dynamic_filter"] += t3 - t2
        waves.append({"rollout": rolled, "score": scored, "filter": kept})
        sizes.append(count)
        if kept["enough"]:
            break
    state.carry, state.carried = kept["carry"], kept["carried_out"]  # into the next step (and its checkpoint)
    get_run_logger().info("dp-%d step %d: %s after %d wave(s) of %s prompts; %d kept group(s) carried over, %d dropped; "
                          "keep ratio estimate %.2f", group, step, kept["reason"], len(waves), "+".join(map(str, sizes)),
                          kept["carried_out"], kept["surplus_dropped"], state.keep_ratio or 0.0)
    t0 = time.perf_counter()
    trained = await tasks.train_step(run, run_uri, step, group)
    progress.finished("train_step")
    t1 = time.perf_counter()
    synced = await tasks.sync_weights(run, group)
    progress.finished("sync_weights")
    stages["train_step"] = t1 - t0
    stages["sync_weights"] = time.perf_counter() - t1
    switches["train_step"], switches["sync_weights"] = trained.get("switch_s", 0.0), synced.get("switch_s", 0.0)
    waited = saved = None
    if written is not None:
        # The asynchronous write of step `written`'s checkpoint has run beside this whole step
        # (rollout, scoring, training), so this normally answers at once; it comes last, where the
        # write had the most time, and before this step's own checkpoint (one write at a time).
        # The iteration commits that checkpoint once every group has waited for its write.
        t0 = time.perf_counter()
        waited = await tasks.checkpoint_wait(run, group, written)
        stages["checkpoint_wait"] = time.perf_counter() - t0
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
        "prompts": sum(sizes), "carried_in": kept["carried_in"], "carried_out": kept["carried_out"],
        "surplus_dropped": kept["surplus_dropped"], "sampling": state.to_dict(),
        "tokens": sum(w["rollout"]["tokens"] for w in waves),
        "rollout_engine_s": sum(w["rollout"]["seconds"] for w in waves),
        "reward_sum": sum(w["score"]["reward_mean"] * w["rollout"]["samples"] for w in waves),
        "accuracy_sum": sum((w["score"]["accuracy"] or 0.0) * w["rollout"]["samples"] for w in waves),
        "judge_agreement": waves[-1]["score"]["judge_agreement"],
        "train": trained, "sync_s": synced["seconds"], "checkpoint_files": (saved["files"] if saved else None) or [],
        "checkpoint_stall_s": saved["stall_s"] if saved else 0.0, "checkpoint_waited": waited,
        "stages": stages, "switches": switches,
        # seconds the host spent on this group's commands; the rest of the step is orchestration
        "engine_s": sum(r["host_s"] for r in (*(r for w in waves for r in w.values()), trained, synced, waited, saved) if r),
    }


def is_checkpoint_step(config: RunConfig, step: int, end: int | None = None) -> bool:
    """Every ``checkpoint.every`` steps, and at the last step of this run (so the next run resumes there)."""
    return (step + 1) % config.checkpoint.every == 0 or step == (config.steps if end is None else end) - 1


@flow(name="iteration", flow_run_name="iteration-{step:04d}")
async def iteration(config: RunConfig, step: int, cursors: list[int], end: int | None = None, written: dict | None = None,
                    sampling: list[dict] | None = None) -> dict:
    """One RL step: every DP group concurrently, then commit the checkpoints that are written.

    ``sampling``: each group's dynamic-sampling state after the previous step (carried-over groups,
    keep-ratio estimate; None: a fresh start); this step's is returned as ``sampling`` and goes
    into this step's checkpoint with the cursors.

    ``written``: an earlier step's asynchronous checkpoint (``pending_checkpoint`` of that
    iteration's metrics) that the hosts are still writing; this step's groups wait for it at
    their end and it is committed here. A checkpoint written asynchronously in this step is
    returned as ``pending_checkpoint`` for the next iteration (or ``finish_checkpoint``); a
    synchronous one is committed here."""
    start = time.perf_counter()
    waiting = written["step"] if written else None
    groups = await asyncio.gather(*(dp_group(config, step, g, cursors[g], end, waiting, (sampling or [None] * config.dp)[g])
                                    for g in range(config.dp)))
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
        "prompts": sum(g["prompts"] for g in groups),
        # dynamic sampling: the share of the target batch filled, kept groups taken from the previous
        # step's carry-over, carried into the next step, and thrown away (older than max_carry_age)
        "fill_rate": sum(g["kept"] for g in groups) / (config.sampling.target_groups * config.dp),
        "carried_groups": sum(g["carried_in"] for g in groups),
        "carried_over": sum(g["carried_out"] for g in groups),
        "surplus_dropped": sum(g["surplus_dropped"] for g in groups),
        "keep_ratio": _mean([GroupSampling.from_dict(g["sampling"]).keep_ratio for g in groups]),
        "loss": groups[0]["train"]["loss"],
        "rollout_tokens_per_s": sum(g["tokens"] for g in groups) / max(sum(g["rollout_engine_s"] for g in groups) / len(groups), 1e-9),
        "train_tokens_per_s": sum(g["train"]["tokens_per_s"] for g in groups),
        "balance_ratio": groups[0]["train"]["balance_ratio"],  # max/mean of the DP groups' train tokens (1.0: even)
        "seconds": seconds,
        "engine_s": max(g["engine_s"] for g in groups),
        "overhead_s": seconds - max(g["engine_s"] for g in groups),
        "engine_loads": max(g["train"]["engine_loads"] for g in groups),  # per host, this run: stays 1
        **{f"{k}_s": max(g["stages"].get(k, 0.0) for g in groups)
           for k in ("rollout", "genrm_score", "rollout_and_score", "dynamic_filter", "train_step", "sync_weights",
                     "checkpoint_wait", "checkpoint")},
        # placement: seconds engines took to hand the devices over before each stage (sleep/wake; 0 where nothing moves)
        **{f"switch_{k}_s": max(g["switches"].get(k, 0.0) for g in groups)
           for k in ("rollout", "genrm_score", "train_step", "sync_weights")},
        "placement": config.placement.mode,
        "checkpoint_stall_s": max(g["checkpoint_stall_s"] for g in groups),  # on the hosts: what training waited for
        "cursors": [g["cursor"] for g in groups],
        "sampling": [g["sampling"] for g in groups],
        "policy_version": groups[0]["train"]["policy_version"],
        "params_sha": groups[0]["train"]["params_sha"],  # the trained weights' fingerprint (equal on every replica)
        "checkpoint_files": [f for g in groups for f in g["checkpoint_files"]],
    }
    if written is not None:
        commit(config, written, waited_files(written, [g["checkpoint_waited"] for g in groups]))
    if is_checkpoint_step(config, step, end):
        checkpoint = {"step": step, "uri": checkpoint_uri(config.run_uri, step), "cursors": metrics["cursors"],
                      "sampling": metrics["sampling"], "policy_version": metrics["policy_version"]}
        if config.checkpoint.asynchronous:
            metrics["pending_checkpoint"] = checkpoint
        else:
            commit(config, checkpoint, metrics["checkpoint_files"])
    await acreate_table_artifact(
        key=f"{config.name}-iteration",
        table=[{k: (round(v, 4) if isinstance(v, float) else v) for k, v in metrics.items()
                if k not in ("cursors", "sampling", "checkpoint_files", "pending_checkpoint")}],
        description=f"{config.name} step {step}: reward {metrics['reward']:.3f}, kept {metrics['kept_groups']} groups",
    )
    return metrics


def commit(config: RunConfig, checkpoint: dict, files: list[str]) -> None:
    """Commit a checkpoint whose files are all written: manifest, then state.json (its step,
    data cursors, dynamic-sampling state and policy version), then retention.

    The sampling state is the one of the checkpoint's own step (carried with it from that step's
    iteration to the one that commits it), so a resume takes exactly the groups that step carried
    over: never lost, never trained twice, their prompts behind the cursors."""
    state = RunState.load(config.run_uri)
    state.step, state.cursors, state.policy_version = checkpoint["step"], checkpoint["cursors"], checkpoint["policy_version"]
    state.sampling = checkpoint["sampling"]
    state.checkpoint = checkpoint["uri"]
    commit_checkpoint(config.run_uri, state, files, config.checkpoint.keep_last, config.checkpoint.keep_every)


def waited_files(checkpoint: dict, waited: list[dict]) -> list[str]:
    """Every group's files of ``checkpoint``, from their ``checkpoint_wait`` answers."""
    for group, w in enumerate(waited):
        if w is None or w["uri"] != checkpoint["uri"] or w["files"] is None:
            raise RuntimeError(f"dp-{group}: waited for the write of {checkpoint['uri']}, the host reports {w}")
    return [f for w in waited for f in w["files"]]


async def finish_checkpoint(config: RunConfig, checkpoint: dict | None) -> None:
    """Wait for every group's background write of ``checkpoint`` and commit it: the end of a run."""
    if checkpoint is None:
        return
    waited = await asyncio.gather(*(tasks.checkpoint_wait(config.name, g, checkpoint["step"]) for g in range(config.dp)))
    commit(config, checkpoint, waited_files(checkpoint, list(waited)))


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
    for uri in discard_uncommitted(run_uri, state):  # a crash mid-write (no manifest), or before state.json
        logger.info("removed %s: a checkpoint that was never committed", uri)
    first = state.step + 1 if state else 0
    # steps_per_run: each run (a schedule firing again) continues the training by that many steps
    end = config.steps if config.steps_per_run is None else min(config.steps, first + config.steps_per_run)
    if first >= config.steps:
        logger.info("run %s already finished %d/%d steps", config.name, first, config.steps)
    elif end < config.steps:
        logger.info("run %s: steps %d to %d of %d in this run (steps_per_run=%d)", config.name, first, end - 1, config.steps, config.steps_per_run)
    history = []
    async with engine_hosts(config) as hosts:  # local subprocesses, or flow runs on a GPU pool (flows/hosts.py)
        await tasks.validate_inputs(config.name, config.model_dump())
        resume = state.checkpoint if state else None
        await asyncio.gather(*(tasks.setup_engines(config.name, g, config.model_dump(), resume, hosts.master)
                               for g in range(config.dp)))
        if state is None:
            state = RunState(cursors=[0] * config.dp)
            state.heldout_before = await heldout_accuracy(config, "before")
            state.save(run_uri)  # step -1, no checkpoint: a resume starts from the beginning
            logger.info("held-out accuracy before RL: %s", _pct(state.heldout_before))
        cursors, sampling = state.cursors, state.sampling or None
        run_progress = Progress(f"{config.name}-progress", config.steps, done=first).start(f"{config.name}: {first} of {config.steps} steps done")
        curves = Curves(config.name, run_uri, config.steps, first, state.heldout_before)
        written = None  # the last asynchronous checkpoint, still being written (committed by the next iteration)
        for step in range(first, end):
            began = time.perf_counter()
            metrics = await iteration(config, step, cursors, end, written, sampling)
            written = metrics.pop("pending_checkpoint", None)
            cursors, sampling = metrics["cursors"], metrics["sampling"]
            history.append(metrics)
            run_progress.advance(f"{config.name}: {step + 1} of {config.steps} steps done; step {step}: reward "
                                 f"{metrics['reward']:.3f}, rollout accuracy {_pct(metrics['accuracy'])}")
            curves.add(metrics)
            # the step as the run pays for it: ``seconds`` is timed inside the iteration flow, so it
            # leaves out that sub-flow's own creation and state changes, and this loop's bookkeeping
            metrics["step_s"] = time.perf_counter() - began
            logger.info(
                "step %d/%d reward %.3f accuracy %.3f kept %d dropped %d waves %d (%.1fs, %.1fs in engines)", step + 1, config.steps,
                metrics["reward"], metrics["accuracy"], metrics["kept_groups"], metrics["dropped_groups"], metrics["waves"],
                metrics["step_s"], metrics["engine_s"],
            )
        await finish_checkpoint(config, written)  # this run's last checkpoint: the next run resumes there
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


def _mean(values: list[float | None]) -> float | None:
    return None if any(v is None for v in values) else sum(values) / len(values)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _summary_markdown(summary: dict) -> str:
    lines = [f"# Run `{summary['run']}`", "",
             f"Held-out exact-match accuracy: **{_pct(summary['heldout_before'])} → {_pct(summary['heldout_after'])}**", "",
             "| step | reward | accuracy | kept | dropped | waves | seconds |", "|---|---|---|---|---|---|---|"]
    for m in summary["history"]:
        lines.append(f"| {m['step']} | {m['reward']:.3f} | {m['accuracy']:.3f} | {m['kept_groups']} | {m['dropped_groups']} | {m['waves']} | {m['seconds']:.2f} |")
    return "\n".join(lines)
