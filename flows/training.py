"""The training run: one Prefect flow per run, one sub-flow per RL iteration, one
sub-flow per DP group inside it.

    train ─┬─ iteration-0000 ─┬─ iteration-0000-dp-0: rollout → genrm_score → dynamic_filter (→ more waves)
           │                  │                        → train_step → sync_weights (→ checkpoint)
           │                  │    (placement.mode=partial, rollout.mode=stream: rollout_and_score → dynamic_filter per wave)
           │                  └─ iteration-0000-dp-1: (the same, concurrently; train_step is one collective)
           ├─ iteration-0001 ...

The parent flows hold the config, URIs and small metrics — never sample data. Data moves
engine host → object storage → engine host. Each stage is a task (``tasks/stages.py``) that
sends one typed request to its group's engine host and gets a typed result back; a group's step
is one ``GroupStep`` record of those results, a step's metrics one ``StepMetrics``
(``flows/metrics.py``).
"""

from __future__ import annotations

import asyncio
import time

from prefect import flow, get_run_logger
from prefect.artifacts import acreate_markdown_artifact, acreate_table_artifact
from prefect.runtime import flow_run

from engines.wire.channel import HostLost
from engines.config import RunConfig, load_config
from flows import events, pipeline, preflight
from flows.sampling import GroupSampling, plan_wave
from flows.artifacts import Curves, Progress, StepProgress, summary_markdown
from flows.curves import percent
from flows.evaluations import EvaluationLog, evaluate_sets
from flows.evaluations import read as read_evaluations
from flows.evaluations import lines as evaluation_lines
from engines.evaluation import HELDOUT, headline, set_metric, sets_of
from flows.console import shown, step_figures
from flows.hosts import engine_hosts
from flows.ledger import Checkpoint, Ledger, StepEnd, close_step, is_checkpoint_step, keep_pending
from flows.metrics import GroupStep, StageClock, StepMetrics, Wave
from flows.nodes import node_controllers, run_on_nodes
from flows.plan import GroupPlan
from flows.tracking import MetricsLog
from storage import objectstore
from storage.lease import Lease
from storage.runstate import (RunState, checkpoint_uri, config_uri, discard_uncommitted, resume_point,
                              set_aside)
from tasks import stages


@flow(name="dp-group", flow_run_name="iteration-{step:04d}-dp-{group}")
async def dp_group(plan: GroupPlan, step: int, group: int, cursor: int | None, checkpoint: str | None = None,
                   written: int | None = None, sampling: dict | None = None) -> GroupStep:
    """The controller of one DP group for one step: rollout → score → filter, in waves until
    enough groups are kept, then train → sync (→ checkpoint).

    ``checkpoint``: where this step's checkpoint goes (None: not a checkpoint step); ``written``: the
    earlier step whose checkpoint the host is still writing in the background; ``sampling``: the group's
    dynamic-sampling state after the previous step (``GroupSampling``)."""
    run, s = plan.run, plan.sampling
    if cursor is None:  # overlapping steps: where this group's generation of the previous step ends (flows/pipeline.py)
        cursor, sampling = await pipeline.generation_start(run.name, step, group)
    clock = StageClock(StepProgress(run.name, step, group, wave_stages=2 if plan.together else 3,
                                    after_stages=2 + (written is not None) + (checkpoint is not None)))  # live in the UI
    state = GroupSampling.from_dict(sampling)
    have = state.carried  # groups the previous step carried over count as kept
    waves: list[Wave] = []
    for wave in range(s.max_waves):
        if wave:
            clock.progress.another_wave(wave)
        count = plan_wave(s, state, have)  # fixed, or from the keep-ratio estimate (flows/sampling.py)
        # one stage answers a wave's scored samples: partial colocation's judge beside the generator, or the streaming
        # lane's groups (the host picked which at setup: engines/host/loading.py, ``producer``)
        if plan.together:
            both = await clock("rollout_and_score", stages.rollout_and_score(run, step, group, wave, cursor, count, state.ahead), wave)
            rolled, scored = both.rollout, both.score
        else:  # full colocation: one engine after the other, each on all the group's devices
            rolled = await clock("rollout", stages.rollout(run, step, group, wave, cursor, count), wave)
            scored = await clock("genrm_score", stages.genrm_score(run, step, group, wave), wave)
        kept = await clock("dynamic_filter", stages.dynamic_filter(run, step, group, wave, s.target_groups, plan.critic,
                                                                   state.carry), wave)
        waves.append(Wave(rollout=rolled, score=scored, filter=kept))
        cursor, have, state.ahead = rolled.cursor, kept.kept, rolled.ahead
        state.observe(count, kept.new_kept, s.keep_ratio_decay)
        if kept.enough:
            break
    state.carry, state.carried = kept.carry, kept.carried_out  # into the next step (and its checkpoint)
    get_run_logger().info("dp-%d step %d: %s after %d wave(s) of %s prompts; %d kept group(s) carried over, %d dropped; "
                          "keep ratio estimate %.2f", group, step, kept.reason, len(waves),
                          "+".join(str(w.rollout.prompts) for w in waves), kept.carried_out, kept.surplus_dropped,
                          state.keep_ratio or 0.0)
    if plan.overlapped:  # overlapping steps: train in step order, when the run gives the turn (flows/pipeline.py)
        turn = await pipeline.generated_then_turn(run.name, step, group, cursor, state.to_dict())
        written = turn.step if turn else None
    trained = await clock("train_step", stages.train_step(run, step, group))
    synced = await clock("sync_weights", stages.sync_weights(run, group, plan.sync_timeout_s))
    if plan.overlapped:  # this group's generation of step + k may start (flows/pipeline.py)
        pipeline.synced(run.name, step, group)
    waited = saved = None
    if written is not None:
        # The asynchronous write of step `written`'s checkpoint has run beside this whole step
        # (rollout, scoring, training), so this normally answers at once; it comes last, where the
        # write had the most time, and before this step's own checkpoint (one write at a time).
        # The iteration commits that checkpoint once every group has waited for its write.
        waited = await clock("checkpoint_wait", stages.checkpoint_wait(run, group, written))
    if checkpoint is not None:
        saved = await clock("checkpoint", stages.checkpoint(run, group, step, checkpoint))
    await clock.progress.flush()
    return GroupStep(group=group, waves=waves, train=trained, sync=synced, checkpoint=saved, checkpoint_waited=waited,
                     sampling=state.to_dict(), stage_s=dict(clock.seconds), engine_s=clock.engine_s)


@flow(name="iteration", flow_run_name="iteration-{step:04d}")
async def iteration(config: RunConfig, step: int, cursors: list[int] | None, end: int | None = None,
                    written: Checkpoint | None = None, sampling: list[dict] | None = None) -> StepEnd:
    """One RL step: every DP group concurrently, then the commits (flows/ledger.py).

    ``cursors``, ``sampling``: where each group's data and dynamic-sampling state (carried-over groups,
    keep-ratio estimate; None: a fresh start) stand after the previous step; ``written``: an earlier
    step's asynchronous checkpoint that the hosts are still writing (this step's groups wait for it at
    their end, and it is committed here). Returns the step's metrics and where it leaves the run."""
    start = time.perf_counter()
    waiting = written.step if written else None
    plan = GroupPlan.of(config)  # what the groups' sub-flows read of the config (flows/plan.py)
    checkpoint = checkpoint_uri(config.run_uri, step) if is_checkpoint_step(config, step, end) else None
    if config.controllers.groups_per_node:  # the same sub-flows, in node controllers' processes (flows/nodes.py)
        groups = await run_on_nodes(config, plan, step, cursors, checkpoint, waiting, sampling)
    else:
        runs = [asyncio.ensure_future(dp_group(plan, step, g, (cursors or [None] * config.dp)[g], checkpoint, waiting,
                                               (sampling or [None] * config.dp)[g])) for g in range(config.dp)]
        try:
            groups = await asyncio.gather(*runs)
        except BaseException:
            for r in runs:  # a failed group fails the step: the others must not go on into hosts the run restarts
                if not r.cancelling():  # once: a second cancel cuts short its Crashed report (left Running in the UI)
                    r.cancel()
            await asyncio.gather(*runs, return_exceptions=True)  # each records its end before this step does
            raise
    shas = {g.train.params_sha for g in groups}
    if len(shas) != 1:
        raise RuntimeError(f"step {step}: DP replicas diverged (parameter fingerprints {sorted(shas)})")
    if config.rollout.overlapped:
        written = pipeline.turn_given(config.name, step)  # the checkpoint its groups waited for
    metrics = StepMetrics.of(config, step, groups, time.perf_counter() - start)
    ended = close_step(config, step, end, groups, metrics, written)
    shown = metrics.model_dump(exclude={"step_s", "train", "evaluation"})
    shown |= metrics.train  # one column per trainer figure
    await acreate_table_artifact(
        key=f"{config.name}-iteration", table=[{k: (round(v, 4) if isinstance(v, float) else v) for k, v in shown.items()}],
        description=f"{config.name} step {step}: reward {metrics.reward:.3f}, kept {metrics.kept_groups} groups",
    )
    return ended


class NothingToLearn(RuntimeError):
    """``sampling.max_empty_steps`` steps in a row kept no prompt group: every reward was equal."""


def check_empty_steps(config: RunConfig, metrics: StepMetrics, empty_steps: int) -> None:
    """Warn about a step that kept no prompt group, naming the likely causes; stop the run after
    ``sampling.max_empty_steps`` of them in a row."""
    causes = []
    if config.reward.rule and config.reward.rule_weight > 0:
        rule = f"reward.rule {config.reward.rule}"
        causes += [f"the 'answer' column of {config.data.prompts} (data.prompts) is missing or not what {rule} compares with",
                   f"{rule} returns the same value for every response"]
    if config.reward.genrm_weight > 0:
        causes.append(f"the judge ({config.model.judge}) gives every response the same verdict")
    causes.append("the task is too hard (every sample wrong) or too easy (every sample right) for the policy")
    message = (f"step {metrics.step + 1} kept no prompt group: all {metrics.dropped_groups} groups of "
               f"{config.rollout.samples_per_prompt} samples had equal rewards (mean reward {metrics.reward:.3f}), so there was "
               f"nothing to learn from ({empty_steps} such step(s) in a row). Likely causes: " + "; ".join(causes))
    limit = config.sampling.max_empty_steps
    if limit is not None and empty_steps >= limit:
        raise NothingToLearn(f"{message}. Stopped after sampling.max_empty_steps={limit} such steps; the last committed "
                             "checkpoint is kept, and the same command continues from it once the cause is fixed")
    get_run_logger().warning(message)


def heldout_metric(config: RunConfig) -> str | None:
    """What the held-out figure is: the greedy score of the first evaluation set (``data.heldout``'s, else the
    first of ``eval.sets``, named then): the mean rule reward, or without a rule the share of the judge's
    ``judge.good`` verdicts; None: no evaluation set."""
    sets = sets_of(config)
    if not sets:
        return None
    return set_metric(config, sets[0]) if sets[0].name == HELDOUT else f"{sets[0].name} {set_metric(config, sets[0])}"


async def heldout_score(config: RunConfig, label: str) -> float | None:
    """The held-out metric of the current policy (``heldout_metric``), computed in floating point."""
    return headline(await evaluate_sets(config, label))


def evaluated(logger, config: RunConfig, when: str, evaluation: dict) -> None:
    """Every set's figures as a line each, where there is more than the headline (``heldout_metric``) to say."""
    if len(evaluation) > 1 or config.eval.samples:
        for line in evaluation_lines(evaluation):
            logger.info("evaluation %s: %s", when, line, extra=shown("note"))


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
    """A whole RL run. Running the same run name again resumes from its last committed checkpoint.

    The run holds the lease on its name while it trains (one writer per run: ``storage/lease.py``).
    When an engine host dies or a stage hangs, it restarts its hosts and resumes from the last
    committed checkpoint, up to ``retries.run`` times."""
    logger = get_run_logger()
    config = load_config(config_file, overrides or [])
    events.check_guard(config)
    objectstore.check_reachable(config.uri(""))
    preflight.before_hosts(config)  # `yattflow demo`: its input checked after prepare, before the lease and the hosts
    events.top_flow_run(config)
    lease = Lease(config.run_uri, config.run.lease_s, flow_run.get_id())
    try:
        await asyncio.to_thread(lease.acquire, config.run.on_conflict == "wait", logger.info)
    except asyncio.CancelledError:  # stopped (Ctrl-C, SIGTERM) while waiting for another run: so is the waiting thread
        lease.release()
        raise
    logger.info("run %s: lease taken (%s)", config.name, lease.uri)
    history: list[StepMetrics] = []  # every step trained, over the attempts (a step redone replaces its first try)
    try:
        for attempt in range(config.retries.run + 1):
            try:
                return await _attempt(config, history)
            except HostsFailed as e:
                if attempt == config.retries.run:
                    raise e.__cause__ from None
                state = RunState.load(config.run_uri)
                resumes = state.step + 1 if state and state.step >= 0 else 0
                events.emit(config, events.RUN_HEALED, {"attempt": attempt + 1, "error": str(e), "resumes_at_step": resumes})
                logger.warning("attempt %d of %d failed: %s. Restarting the engine hosts and resuming from %s (retries.run=%d)",
                               attempt + 1, config.retries.run + 1, e,
                               f"the checkpoint of step {state.step + 1}" if state and state.step >= 0 else "the start",
                               config.retries.run)
    finally:
        lease.release()


class HostsFailed(RuntimeError):
    """An engine host died or a stage hung (``HostLost``): restarting the hosts heals the run."""


async def _attempt(config: RunConfig, history: list[StepMetrics]) -> dict:
    """Start the hosts, resume from the committed state, train to the end of this run, export."""
    logger, run_uri = get_run_logger(), config.run_uri
    # state.json rebuilt from the newest intact manifest, rolled forward to one committed after it, or its
    # checkpoint set aside for the one before: each said as a warning; nothing committed is deleted
    state = resume_point(run_uri, logger.warning)
    if state is not None and len(state.cursors) != config.dp:
        raise ValueError(f"{run_uri}/state.json: run was started with dp={len(state.cursors)}, config has dp={config.dp}")
    for uri in discard_uncommitted(run_uri, state):  # a crash mid-write (no manifest)
        logger.info("removed %s: a checkpoint that was never committed", uri)
    metric = heldout_metric(config)
    # hosts: local subprocesses, or flow runs on a GPU pool (flows/hosts.py); node controllers: flows/nodes.py
    async with engine_hosts(config) as hosts, node_controllers(config, hosts):
        try:
            state = await _setup(hosts, config, state)
            first = state.step + 1 if state else 0
            history[:] = [m for m in history if m.step < first]
            # steps_per_run: each run (a schedule firing again) continues the training by that many steps
            end = config.steps if config.steps_per_run is None else min(config.steps, first + config.steps_per_run)
            if first >= config.steps:
                logger.info("run %s already finished %d/%d steps", config.name, first, config.steps, extra=shown("note"))
            elif end < config.steps:
                logger.info("run %s: steps %d to %d of %d in this run (steps_per_run=%d)", config.name, first, end - 1,
                            config.steps, config.steps_per_run, extra=shown("note"))
            after, final_uri, state = await _train_on(hosts, config, state, first, end, history)
        except Exception as e:
            lost = await hosts.lost()
            if lost or _host_lost(e):
                raise HostsFailed(f"engine host(s) {', '.join(lost)} died" if lost else str(e).splitlines()[-1]) from e
            raise
    before = (RunState.load(run_uri) or state).heldout_before
    summary = {"run": config.name, "steps": config.steps, "heldout_metric": metric, "heldout_before": before, "heldout_after": after,
               "final_model": final_uri, "evaluation": read_evaluations(run_uri),  # every set: before, every eval.every, after
               "history": [m.model_dump() for m in history]}
    await acreate_markdown_artifact(key=f"{config.name}-summary", markdown=summary_markdown(summary),
                                    description=f"{config.name}: held-out {metric or 'evaluation off'}: {percent(before)} → {percent(after)}")
    events.emit(config, events.RUN_FINISHED, {"steps_done": max(first, end), "steps": config.steps,
                                              "heldout_metric": metric, "heldout_before": before, "heldout_after": after,
                                              "evaluation_before": summary["evaluation"].get("before"),
                                              "evaluation_after": summary["evaluation"].get("after"),
                                              "final_model": final_uri})
    if metric:
        logger.info("held-out %s: before RL %s, after RL %s", metric, percent(before), percent(after))
    return summary


async def _setup(hosts, config: RunConfig, state: RunState | None) -> RunState | None:
    """Check the inputs, then load every group's engines, resuming from ``state``'s checkpoint. The hosts
    check its files against its manifest before they load anything: a damaged one (``damaged`` in their
    answer) is set aside and the newest intact one before it taken instead (``set_aside``, which says so).
    Returns the state the engines resumed from."""
    if not preflight.passed(config):  # (the command checked them before the server and the hosts started)
        await stages.validate_inputs(config)
    while True:
        resume = state.checkpoint if state else None
        setups = await asyncio.gather(*(stages.setup_engines(config, g, resume, hosts.master) for g in range(config.dp)))
        damaged = next((s.damaged for s in setups if s.damaged), None)
        if damaged is None:
            return state
        state = set_aside(config.run_uri, state, damaged.removeprefix(f"{resume}: "), get_run_logger().warning)


def _host_lost(error: BaseException | None) -> bool:
    """Whether ``error`` or an error it came from is a ``HostLost`` (a task's or a sub-flow's failure wraps it)."""
    while error is not None:
        if isinstance(error, HostLost):
            return True
        error = error.__cause__ or error.__context__
    return False


async def _train_on(hosts, config: RunConfig, state: RunState | None, first: int, end: int,
                    history: list[StepMetrics]) -> tuple[float | None, str, RunState]:
    """On hosts whose engines are loaded (resumed from ``state``): train, export the policy."""
    logger, run_uri, metric = get_run_logger(), config.run_uri, heldout_metric(config)
    # inputs checked, engines loaded: the run's config as it trains, what an evaluation of its checkpoints loads (flows/evaluate.py)
    objectstore.write_json(config_uri(run_uri), config.model_dump(mode="json"))
    record = EvaluationLog(config, first)  # every set's figures: runs/<name>/evaluation.json (flows/evaluations.py)
    if state is None:
        state = RunState(cursors=[0] * config.dp)
        before = await evaluate_sets(config, "before")
        state.heldout_before = headline(before)
        state.save(run_uri)  # step -1, no checkpoint: a resume starts from the beginning
        record.record("before", before)
        if metric:
            logger.info("held-out %s before RL: %s", metric, percent(state.heldout_before), extra=shown("note"))
            evaluated(logger, config, "before RL", before)
        else:
            logger.info("held-out evaluation: off (data.heldout and eval.sets are not set)")
    run_progress = Progress(f"{config.name}-progress", config.steps, done=first).start(f"{config.name}: {first} of {config.steps} steps done")
    curves = Curves(config.name, run_uri, config.steps, first, state.heldout_before, metric)
    tracking = MetricsLog(config, first, metric)  # TensorBoard (and MLflow) curves
    logger.info("run %s: %d of %d steps done%s", config.name, first, config.steps, "; continuing" if first else "",
                extra=shown("start", name="train", run=config.name, done=first, total=config.steps, say=first > 0))
    try:
        if first == 0:
            tracking.heldout(0, state.heldout_before)
            tracking.evaluation(0, record.before)
        after = await _steps(config, state, first, end, history, run_progress, curves, tracking, record)
    except BaseException:
        tracking.close(failed=True)
        raise
    tracking.close()
    final_uri = objectstore.join(run_uri, "final")
    await stages.export_policy(stages.Run.of(config), final_uri)
    curves.finish(after)
    await asyncio.gather(curves.flush(), run_progress.flush())
    return after, final_uri, state


async def _steps(config: RunConfig, state: RunState, first: int, end: int, history: list[StepMetrics], run_progress: Progress,
                 curves: Curves, tracking: MetricsLog, record_evaluation: EvaluationLog) -> float | None:
    """Steps ``first`` to ``end - 1`` from the committed ``state``, then the commit of their last
    checkpoint; returns the held-out metric after them."""
    logger, run_uri, metric = get_run_logger(), config.run_uri, heldout_metric(config)
    ledger = Ledger.resumed(state)  # where the run stands between two steps (flows/ledger.py)
    empty_steps = 0  # steps in a row that kept no prompt group
    began = time.perf_counter()  # since the last step was recorded: with overlapping steps, the pace of the run

    async def record(ended: StepEnd) -> Checkpoint | None:
        """Book a finished step (in step order); returns its checkpoint still being written."""
        nonlocal began, empty_steps
        metrics, step = ended.metrics, ended.metrics.step
        written = ledger.advance(ended)
        if metric and config.eval.every and (step + 1) % config.eval.every == 0:
            metrics.evaluation = await evaluate_sets(config, f"step {step}")
            metrics.heldout = headline(metrics.evaluation)
            metrics.heldout_checkpoint = checkpoint_uri(run_uri, step) if is_checkpoint_step(config, step, end) else None
            record_evaluation.record(step + 1, metrics.evaluation)
        history.append(metrics)
        run_progress.advance(f"{config.name}: {step + 1} of {config.steps} steps done; step {step}: reward "
                             f"{metrics.reward:.3f}, rollout accuracy {percent(metrics.accuracy)}")
        curves.add(metrics.model_dump())
        # the step as the run pays for it: ``seconds`` is timed inside the iteration flow, so it
        # leaves out that sub-flow's own creation and state changes, and this loop's bookkeeping
        metrics.step_s, began = time.perf_counter() - began, time.perf_counter()
        logger.info(
            "step %d/%d reward %.3f accuracy %.3f kept %d dropped %d waves %d (%.1fs, %.1fs in engines)", step + 1, config.steps,
            metrics.reward, metrics.accuracy, metrics.kept_groups, metrics.dropped_groups, metrics.waves, metrics.step_s,
            metrics.engine_s, extra=shown("advance", name="train", run=config.name, done=step + 1, total=config.steps,
                                          figures=step_figures(metrics)),
        )
        if metrics.heldout is not None:
            logger.info("held-out %s after step %d (policy version %d%s): %s", metric, step + 1, metrics.policy_version,
                        f", checkpoint {metrics.heldout_checkpoint}" if metrics.heldout_checkpoint else "", percent(metrics.heldout),
                        extra=shown("note"))
            evaluated(logger, config, f"after step {step + 1}", metrics.evaluation)
        tracking.step(metrics)
        events.step_completed(config, history)
        empty_steps = empty_steps + 1 if metrics.kept_groups == 0 else 0
        if empty_steps:
            check_empty_steps(config, metrics, empty_steps)
        return written

    try:
        if config.rollout.overlapped:  # step n+1's generation overlaps step n's training (flows/pipeline.py)
            await pipeline.overlapped(
                config.name, config.rollout.max_staleness, first, end, ledger.cursors, ledger.sampling,
                lambda step, cursors, sampling: iteration(config, step, cursors, end, None, sampling), record)
        else:
            for step in range(first, end):
                began = time.perf_counter()
                await record(await iteration(config, step, ledger.cursors, end, ledger.pending, ledger.sampling))
    except Exception as e:
        if ledger.pending is not None and not _host_lost(e):  # the hosts are alive: keep what they were writing
            await keep_pending(config, ledger.pending)
        raise
    await ledger.finish(config)  # this run's last checkpoint: the next run resumes there
    last = history[-1] if history and history[-1].step == end - 1 else None
    if last is not None and last.evaluation:  # eval.every evaluated these very weights after the last step
        evaluation = last.evaluation
    else:
        evaluation = await evaluate_sets(config, "after")
        evaluated(get_run_logger(), config, "after RL", evaluation)
    record_evaluation.finish(end, evaluation)
    after = headline(evaluation)
    tracking.heldout(end, after)
    tracking.evaluation(end, evaluation)
    return after
