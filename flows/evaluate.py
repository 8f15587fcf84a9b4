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

Any model folder, with no run (a baseline): ``yattflow evaluate -c run.yaml --model FOLDER`` scores it on that
config's evaluation sets (``data.heldout`` and ``eval.sets``; ``eval.samples``, ``eval.temperature``) with its
rollout engine; the result goes to ``<storage root>/evaluations/<name>/<folder>.json``.

Every result has each set's figures (``evaluation``: greedy, mean@k, pass@j, maj@k: engines/evaluation.py)
and ``score``, the first set's greedy score.
"""

from __future__ import annotations

import asyncio
import time

from prefect import flow, get_run_logger
from prefect.artifacts import acreate_markdown_artifact

from engines.config import ConfigError, load_config
from flows import events, preflight
from flows.curves import percent
from flows.hosts import engine_hosts
from engines.evaluation import headline, sets_of
from flows.evaluations import describe, evaluate_sets, markdown
from flows.evaluations import lines as evaluation_lines
from flows.training import heldout_metric
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
    if not sets_of(config):
        raise ConfigError(f"{stored} + overrides: neither data.heldout nor eval.sets is set: nothing to evaluate on")
    if kind == "checkpoint" and not objectstore.exists(objectstore.join(uri, "MANIFEST.json")):
        raise ConfigError(f"{uri}: no MANIFEST.json: not a committed checkpoint (still being written, or removed by "
                          f"checkpoint.keep_last={config.checkpoint.keep_last})")
    return config, kind


def evaluation_target(checkpoint: str, overrides: list[str]):
    """(the config the evaluation runs with, "checkpoint" or "final", the checkpoint's URI): a final
    export is the policy itself (nothing to resume)."""
    uri = objectstore.normalize(checkpoint)
    config, kind = evaluation_config(uri, overrides)
    if kind == "final":
        config = config.model_copy(update={"model": config.model.model_copy(update={"policy": uri})})
    return config, kind, uri


def model_target(config_file: str | None, overrides: list[str], model: str):
    """(the config that evaluates the model folder ``model`` with no run: ``config_file`` and ``overrides`` with
    ``model.policy=model`` and the evaluation's own hosts, "model", the folder's URI)."""
    # reward.*_weight weigh a training reward; an evaluation scores with the rule (else the judge) whatever its weight,
    # so a rule named for the evaluation alone (reward.rule=..., no judge) is enough: its weight is not asked for
    config = load_config(config_file, [*OWN_HOSTS, "reward.rule_weight=1", *overrides, f"model.policy={model}"])
    if not sets_of(config):
        raise ConfigError(f"{config_file or '<defaults>'} + overrides: neither data.heldout nor eval.sets is set: nothing "
                          "to evaluate on")
    return config, "model", config.uri(model)


def _run_name() -> str:
    """``evaluate-demo-000009`` (``evaluate-demo-final``): the run and the checkpoint folder; ``evaluate-model-<folder>``."""
    from prefect.runtime import flow_run

    if flow_run.parameters.get("model"):
        return f"evaluate-model-{objectstore.normalize(flow_run.parameters['model']).rstrip('/').rsplit('/', 1)[-1]}"
    parts = objectstore.normalize(flow_run.parameters["checkpoint"]).split("/")
    return f"evaluate-{parts[-2] if parts[-1] == 'final' else parts[-3]}-{parts[-1]}"


@flow(name="evaluate", flow_run_name=_run_name)
async def evaluate(checkpoint: str | None = None, overrides: list[str] | None = None, model: str | None = None,
                   config_file: str | None = None) -> dict:
    """Score ``checkpoint`` (a committed checkpoint's URI, or a run's ``final`` export) on the run's
    evaluation sets with the run's rules or judge, and write the result beside the run's checkpoints; or
    (``model``) any model folder on the evaluation sets of ``config_file`` and ``overrides``, with no run."""
    logger, start = get_run_logger(), time.perf_counter()
    if model is not None:
        config, kind, uri = model_target(config_file, overrides or [], model)
    else:
        config, kind, uri = evaluation_target(checkpoint, overrides or [])
    events.top_flow_run(config)
    metric = heldout_metric(config)
    preflight.before_hosts(config)
    async with engine_hosts(config) as hosts:
        if not preflight.passed(config):  # (checked by the command before anything started)
            await stages.validate_inputs(config)
        setups = await asyncio.gather(*(stages.setup_engines(config, g, uri if kind == "checkpoint" else None, hosts.master)
                                        for g in range(config.dp)))
        damaged = next((s.damaged for s in setups if s.damaged), None)
        if damaged:
            raise ValueError(damaged)
        evaluation = await evaluate_sets(config, kind)
    score = headline(evaluation)
    if kind == "model":  # no run: nothing trained it
        step, version = None, None
        out = objectstore.join(config.uri("evaluations"), config.name, f"{uri.rstrip('/').rsplit('/', 1)[1]}.json")
    else:
        state = RunState.load(config.run_uri) or RunState()  # a final export: the run's last step and policy version
        step = checkpoint_step(uri) if kind == "checkpoint" else state.step
        version = setups[0].policy_version if kind == "checkpoint" else state.policy_version
        out = objectstore.join(config.run_uri, "evaluations", f"{uri.rsplit('/', 1)[1]}.json")
    first = sets_of(config)[0]
    result = {"run": config.name, "kind": kind, "checkpoint": uri, "step": step, "policy_version": version,
              "heldout": first.uri, "heldout_metric": metric, "score": score, "evaluation": evaluation, "sets": describe(config),
              "samples": config.eval.samples, "temperature": (config.eval.temperature or config.rollout.temperature)
              if config.eval.samples else None,
              "seconds": round(time.perf_counter() - start, 2), "evaluated_at": time.time(), "result": out}
    objectstore.write_json(out, result)
    what = "model" if kind == "model" else f"{kind} of step {step}"
    logger.info("run %s, %s (%s%s): held-out %s %s; written to %s", config.name, uri, what,
                "" if version is None else f", policy version {version}", metric, percent(score), out)
    for line in evaluation_lines(evaluation):
        logger.info("evaluation: %s", line)
    table = markdown({"sets": result["sets"], "samples": result["samples"], "temperature": result["temperature"]},
                     [(what, evaluation)])
    await acreate_markdown_artifact(
        key=f"{config.name}-evaluation", description=f"{config.name} {what}: {percent(score)}",
        markdown=f"# Run `{config.name}`: {what}\n\nHeld-out {metric} on `{result['heldout']}`: "
                 f"**{percent(score)}**{'' if version is None else f' (policy version {version})'}\n\n`{uri}`\n\n"
                 f"Result: `{out}`\n\n{table}")
    events.emit(config, events.EVALUATION_COMPLETED, result)
    return result
