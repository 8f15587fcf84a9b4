"""The Prefect events a run emits, and the guard that watches its steps.

    yattflow.step.completed        each step, with its figures (reward, accuracy, kept/dropped, KL, ...)
    yattflow.checkpoint.committed  a checkpoint is whole and resumable: its step, URI and policy version
    yattflow.guard.tripped         a step outside the run's ``guard`` bounds, and which
    yattflow.run.healed            the run restarted its engine hosts after a failure and resumes
    yattflow.run.finished          the run trained its last step: held-out before and after, final model
    yattflow.evaluation.completed  the evaluate flow scored a checkpoint (flows/evaluate.py)

An event's resource is the run's top flow run (``prefect.flow-run.<id>``: the UI lists the events on
that run's page, and an automation's cancel-flow-run action finds the run from the event) labelled
with the run's name (``yattflow.run``), storage (``yattflow.run.uri``) and whether it has a held-out
set (``yattflow.run.heldout``: yes/no; the evaluate trigger matches yes). A resumed run is a new flow
run with the same ``yattflow.run``. Step numbers are 0-based, as in checkpoint names.

Prefect's triggers match event names and labels, not numbers: so the run itself holds its figures
against ``guard`` (``guard_trips``) and says so in ``yattflow.guard.tripped``; what happens then is the
server's automations' choice (deployments/automations.yaml). Emitting is a queue put: Prefect's
events worker sends on its own thread (the cost: docs/deployments.md#events).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

from engines.config import ConfigError, RunConfig
from flows.metrics import StepMetrics

STEP_COMPLETED = "yattflow.step.completed"
CHECKPOINT_COMMITTED = "yattflow.checkpoint.committed"
GUARD_TRIPPED = "yattflow.guard.tripped"
RUN_HEALED = "yattflow.run.healed"
RUN_FINISHED = "yattflow.run.finished"
EVALUATION_COMPLETED = "yattflow.evaluation.completed"

# what a step event carries besides the trainer's figures (loss, grad_norm, entropy, KLs, ...)
STEP_FIELDS = ("step", "reward", "accuracy", "kept_groups", "dropped_groups", "waves", "samples", "prompts", "fill_rate",
               "response_tokens", "seconds", "engine_s", "policy_version", "heldout")


_TOP_RUNS: dict[str, str] = {}  # run name -> the flow run that trains (or evaluates) it in this process


@contextmanager
def all_sent(timeout_s: float = 10.0) -> Iterator[None]:
    """Every event queued in the block (ours, and the task-run states Prefect sends as events) is
    sent before it ends: before a command's last line and before an embedded server stops, so
    Prefect's exit hook has nothing left to warn about ("Still processing items") on the console."""
    try:
        yield
    finally:
        from prefect.events.worker import EventsWorker

        EventsWorker.drain_all(timeout=timeout_s)


def top_flow_run(config: RunConfig) -> None:
    """Call in the run's top flow (train, evaluate): this flow run is the resource of the run's events,
    also those emitted from its sub-flows (iterations commit checkpoints)."""
    from prefect.runtime import flow_run

    _TOP_RUNS[config.name] = flow_run.get_id()


def resource(config: RunConfig) -> dict[str, str]:
    """The run's top flow run, labelled with the run's name and storage."""
    from prefect.runtime import flow_run

    run_id = _TOP_RUNS.get(config.name) or flow_run.get_id()
    return {"prefect.resource.id": f"prefect.flow-run.{run_id}", "yattflow.run": config.name, "yattflow.run.uri": config.run_uri,
            "yattflow.run.heldout": "yes" if config.data.heldout or config.eval.sets else "no"}


def emit(config: RunConfig, event: str, payload: dict) -> None:
    """Emit ``event`` for the run with ``payload`` (non-finite numbers become null: JSON has none)."""
    from prefect.events import emit_event

    def finite(value):
        return None if isinstance(value, float) and not math.isfinite(value) else value

    emit_event(event, resource=resource(config), payload={"run": config.name} | {k: finite(v) for k, v in payload.items()})


def figures(metrics: StepMetrics) -> dict[str, float | int | None]:
    """A step's figures by name: ``STEP_FIELDS``, the trainer's, and an evaluated step's every set's as
    ``eval/<set>/<figure>`` (``eval/heldout/pass@4``)."""
    evaluated = {f"eval/{name}/{figure}": value for name, figs in metrics.evaluation.items() for figure, value in figs.items()}
    return {name: getattr(metrics, name) for name in STEP_FIELDS} | metrics.train | evaluated


def step_completed(config: RunConfig, history: list[StepMetrics]) -> None:
    """The step event of the last step of ``history``, then the guard's if the step is outside its bounds."""
    emit(config, STEP_COMPLETED, figures(history[-1]))
    reasons = guard_trips(config, history)
    if reasons:
        from prefect import get_run_logger

        get_run_logger().warning("guard tripped at step %d: %s", history[-1].step + 1, "; ".join(reasons))
        emit(config, GUARD_TRIPPED, {"step": history[-1].step, "reasons": reasons} | figures(history[-1]))


def guard_trips(config: RunConfig, history: list[StepMetrics]) -> list[str]:
    """What of the last step of ``history`` is outside ``config.guard``, a line each (none: within)."""
    guard, last = config.guard, history[-1]
    reasons = []
    before = [m.reward for m in history[-1 - guard.window:-1]]
    if guard.reward_drop is not None and before and max(before) - last.reward >= guard.reward_drop:
        reasons.append(f"reward {last.reward:.3f} is {max(before) - last.reward:.3f} below the best of the {len(before)} "
                       f"step(s) before it ({max(before):.3f}; guard.reward_drop={guard.reward_drop})")
    shown = figures(last)
    for name, bound in guard.max.items():
        value = shown.get(name)
        if value is not None and not value <= bound:  # NaN trips too
            reasons.append(f"{name} {value:.4g} is above guard.max.{name}={bound}")
    return reasons


def check_guard(config: RunConfig) -> None:
    """Every name in ``guard.max`` is a figure a step of this run reports (before any engine loads)."""
    from engines.rl.base import statistic_names

    known = [*STEP_FIELDS, *(name for name, f in StepMetrics.model_fields.items() if f.annotation in (int, float)),
             "loss", "grad_norm", "tokens", *statistic_names(config.train.algorithm)]
    unknown = sorted(set(config.guard.max) - set(known))
    if unknown:
        raise ConfigError(f"field 'guard.max': {', '.join(unknown)} is not a figure a step of train.algorithm.name="
                          f"{config.train.algorithm.name} reports; one of: {', '.join(sorted(set(known)))}")
