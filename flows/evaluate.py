"""Evaluation as its own flow: score a checkpoint (or a final export) on the run's held-out set.

    evaluate ─┬─ setup engines dp=0..   (the run's engines, resumed from the checkpoint)
              └─ evaluate dp=0..        (greedy decoding, scored by the run's rule or judge)

The run's config comes from the run's folder (``runs/<name>/config.json``, written by each training
run), with ``overrides`` on top (e.g. ``dp=1``, ``data.heldout=data/other``); engine hosts are this
flow's own local processes, on whatever machine runs it. The training run is not touched: no lease,
no write but ``runs/<name>/evaluations/<checkpoint>.json``, the result, also shown as an artifact
(``<name>-evaluation``) and emitted as ``yattflow.evaluation.completed``.

Deployed as ``evaluate/evaluate`` on its own work pool (deployments/prefect.yaml) with a trigger on
``yattflow.checkpoint.committed``: each checkpoint of a run is evaluated while training goes on.
By hand: ``yattflow evaluate [key=value ...] [--checkpoint URI]`` (the run's last one by default).
"""

from __future__ import annotations

import asyncio
import time

from prefect import flow, get_run_logger
from prefect.artifacts import acreate_markdown_artifact

from engines.config import ConfigError, load_config
from flows import events
from flows.curves import percent
from flows.hosts import engine_hosts
from flows.training import heldout_metric, heldout_score
from storage import objectstore
from storage.runstate import RunState, checkpoint_step, checkpoint_uri, config_uri
from tasks import stages

# the evaluation's own hosts, on the machine that runs it (overrides may change any of these)
OWN_HOSTS = ["hosts.launch=local", "hosts.devices=null", "controllers.groups_per_node=null", "rollout.max_staleness=0"]


def run_of(uri: str) -> tuple[str, str]:
    """(the run folder, what ``uri`` is in it: "checkpoint" or "final") of a checkpoint folder
    (``runs/<name>/checkpoints/<step>``) or a final export (``runs/<name>/final``)."""
    uri = objectstore.normalize(uri)
    parent, name = uri.rsplit("/", 1)
    if name == "final":
        return parent, "final"
    run, folder = parent.rsplit("/", 1)
    if folder == "checkpoints" and checkpoint_step(uri) is not None:
        return run, "checkpoint"
    raise ConfigError(f"{uri}: not a checkpoint (runs/<name>/checkpoints/<step>) or a final export (runs/<name>/final)")


def pick_checkpoint(config, given: str | None) -> str:
    """What ``yattflow evaluate`` scores: ``given`` (a URI or path, a step number, or "final"), by
    default the run's last committed checkpoint."""
    if given is None:
        state = RunState.load(config.run_uri)
        if state is None or state.checkpoint is None:
            raise ConfigError(f"run '{config.name}' ({config.run_uri}) has no committed checkpoint yet: name one with --checkpoint")
        return state.checkpoint
    if given == "final":
        return objectstore.join(config.run_uri, "final")
    return checkpoint_uri(config.run_uri, int(given)) if given.isdigit() else objectstore.normalize(given)


def evaluation_config(uri: str, overrides: list[str]):
    """The run's config for evaluating ``uri``, its storage root where the run folder is."""
    run, kind = run_of(uri)
    stored = config_uri(run)
    if not objectstore.exists(stored):
        raise ConfigError(f"{stored}: no run config there (each training run writes it; a run older than that: train it once more)")
    root = run.rsplit("/runs/", 1)[0]
    config = load_config(overrides=[f"storage.root={root}", *OWN_HOSTS, *overrides], tree=objectstore.read_json(stored),
                         source=stored)
    if config.data.heldout is None:
        raise ConfigError(f"{stored} + overrides: data.heldout is not set: nothing to evaluate on")
    if kind == "checkpoint" and not objectstore.exists(objectstore.join(uri, "MANIFEST.json")):
        raise ConfigError(f"{uri}: no MANIFEST.json: not a committed checkpoint (still being written, or removed by "
                          f"checkpoint.keep_last={config.checkpoint.keep_last})")
    return config, kind


def _run_name() -> str:
    """``evaluate-demo-000009`` (``evaluate-demo-final``): the run and the checkpoint folder."""
    from prefect.runtime import flow_run

    parts = objectstore.normalize(flow_run.parameters["checkpoint"]).split("/")
    return f"evaluate-{parts[-2] if parts[-1] == 'final' else parts[-3]}-{parts[-1]}"


@flow(name="evaluate", flow_run_name=_run_name)
async def evaluate(checkpoint: str, overrides: list[str] | None = None) -> dict:
    """Score ``checkpoint`` (a committed checkpoint's URI, or a run's ``final`` export) on the run's
    held-out set with the run's rule or judge; write the result beside the run's checkpoints."""
    logger, start = get_run_logger(), time.perf_counter()
    uri = objectstore.normalize(checkpoint)
    config, kind = evaluation_config(uri, overrides or [])
    events.top_flow_run(config)
    metric = heldout_metric(config)
    if kind == "final":  # a Hugging Face folder: the policy itself, nothing to resume
        config = config.model_copy(update={"model": config.model.model_copy(update={"policy": uri})})
    async with engine_hosts(config) as hosts:
        await stages.validate_inputs(config)
        setups = await asyncio.gather(*(stages.setup_engines(config, g, uri if kind == "checkpoint" else None, hosts.master)
                                        for g in range(config.dp)))
        score = await heldout_score(config, kind)
    state = RunState.load(config.run_uri) or RunState()  # a final export: the run's last step and policy version
    step = checkpoint_step(uri) if kind == "checkpoint" else state.step
    version = setups[0].policy_version if kind == "checkpoint" else state.policy_version
    out = objectstore.join(config.run_uri, "evaluations", f"{uri.rsplit('/', 1)[1]}.json")
    result = {"run": config.name, "checkpoint": uri, "step": step, "policy_version": version,
              "heldout": config.uri(config.data.heldout), "heldout_metric": metric, "score": score,
              "seconds": round(time.perf_counter() - start, 2), "evaluated_at": time.time(), "result": out}
    objectstore.write_json(out, result)
    logger.info("run %s, %s (step %s, policy version %d): held-out %s %s; written to %s", config.name, uri, step,
                result["policy_version"], metric, percent(score), out)
    await acreate_markdown_artifact(
        key=f"{config.name}-evaluation", description=f"{config.name} step {step}: {percent(score)}",
        markdown=f"# Run `{config.name}`: {kind} of step {step}\n\nHeld-out {metric} on `{result['heldout']}`: "
                 f"**{percent(score)}** (policy version {result['policy_version']})\n\n`{uri}`\n\nResult: `{out}`")
    events.emit(config, events.EVALUATION_COMPLETED, result)
    return result
