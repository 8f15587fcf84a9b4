"""``yattflow status [name]``: where runs stand.

From storage, with no Prefect server needed (``storage/runstatus.py``): each run's steps trained,
its last committed checkpoint, its held-out figures, whether a live run holds its lease, and its
learning curve (``flows/curves.py``: sparklines here, a picture in ``runs/<name>/curves.svg``). When a
Prefect server answers (``PREFECT_API_URL``, or ``yattflow server``'s), the state of the flow run that
took each run's lease last goes beside it, and the latest flow runs of the train flow (deployed or
from the command line) follow, with the step each run's state.json committed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from flows import prefect_server
from flows.curves import curves_text, percent
from flows.admin import ROOT, TRAIN_DEPLOYMENT, api_url
from storage import objectstore


def status(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="yattflow status", description=(
        "Where runs stand, from storage (no Prefect server needed): steps trained, last checkpoint, held-out "
        "figures, whether a live run holds the run's lease. With a Prefect server reachable, each run's flow-run "
        "state too, and the latest runs of the train flow (from `yattflow run` or `yattflow train`)."))
    parser.add_argument("name", nargs="?", help="only this run (config `name`)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, as every command takes (storage.root=/x, name=demo)")
    parser.add_argument("-c", "--config", help="run config YAML whose storage.root to read (default: the built-in one)")
    parser.add_argument("--root", help="storage root to read (default: the config's storage.root)")
    parser.add_argument("--deployment", help=f"only flow runs of this flow/deployment (e.g. {TRAIN_DEPLOYMENT})")
    parser.add_argument("--limit", type=int, default=10, help="flow-run rows (default %(default)s)")
    args = parser.parse_intermixed_args(argv)
    if args.name and "=" in args.name:  # `yattflow status storage.root=/x`: an override, not a run name
        args.overrides, args.name = [args.name, *args.overrides], None
    from engines.config import ConfigError, load_config
    from storage.runstatus import run_statuses

    try:
        config = load_config(args.config, args.overrides)
        root = args.root or config.storage.root
        if any(o.startswith("name=") for o in args.overrides):
            args.name = config.name
    except ConfigError as e:
        print(f"yattflow status: {e}", file=sys.stderr)
        return 2
    if "://" not in root and args.root:
        root = os.path.abspath(root)  # the user's working directory; a config's is the checkout's
    os.chdir(ROOT)  # run configs and relative storage roots are relative to the checkout, as in the worker
    url = api_url()
    server = prefect_server.healthy(url)
    runs = run_statuses(root, args.name)
    states = asyncio.run(_flow_run_states(url, [r.flow_run_id for r in runs if r.flow_run_id])) if server else {}
    print(f"runs in {root} (from storage)")
    if not runs:
        print(f"  no run{f' named {args.name!r}' if args.name else ''} there")
    else:
        header = ("run", "steps", "checkpoint", "held-out", "lease") + (("flow run",) if server else ())
        rows = [(r.name, _steps(r), _checkpoint(r), _heldout(r), r.lease) + ((states.get(r.flow_run_id, "-"),) if server else ())
                for r in runs]
        _table(header, rows)
        for r in runs:
            if r.problem:
                print(f"  {r.name}: {r.problem}")
        if len(runs) == 1:
            _curve(runs[0])
            _evaluation(runs[0])
        elif any(r.points for r in runs):
            print("  (yattflow status NAME: that run's learning curve)")
    code, flow_runs = 0, 0
    if server:
        code, flow_runs = _flow_runs(url, args.deployment, args.name, args.limit)
    else:
        print(f"\nno Prefect server at {url}: flow-run states not shown (start one with `yattflow server`, "
              "or set PREFECT_API_URL)")
    if args.name and not runs and not flow_runs:  # a run asked for by name that is nowhere: exit 1
        print(f"yattflow status: no run named {args.name!r} in {root} (a run folder runs/{args.name} with a state.json or "
              f"lease.json){'' if server else ' and no Prefect server to ask for its flow runs'}", file=sys.stderr)
        return 1
    return code


def _curve(r) -> None:
    """The run's learning curve in the terminal, and where its picture is."""
    lines = curves_text(r.points, r.heldout_before, r.heldout_after)
    if not lines:
        return
    print(f"\n{r.name}: {_steps(r)} steps (picture: {objectstore.join(r.uri, 'curves.svg')})")
    for line in lines:
        print(f"  {line}")


def _evaluation(r) -> None:
    """Every evaluation set's figures, before RL and at the latest evaluation (``runs/<name>/evaluation.json``)."""
    from flows.evaluations import read, status_lines

    try:
        record = read(r.uri)
    except Exception as e:  # noqa: BLE001 - shown, not fatal
        print(f"\n{r.name}: evaluation record unreadable ({(str(e).splitlines() or [type(e).__name__])[0]})")
        return
    shown = status_lines(record)
    if not shown:
        return
    k = record.get("samples")
    print(f"\n{r.name}: evaluation sets" + (f" (greedy; {k} samples per prompt at temperature {record['temperature']:g})"
                                            if k else " (greedy)"))
    for line in shown:
        print(f"  {line}")


def _steps(r) -> str:
    if r.trained is None:
        return "-"
    return f"{r.trained}/{r.steps}" if r.steps else str(r.trained)


def _checkpoint(r) -> str:
    if r.checkpoint_step is None:
        return "-"
    return f"step {r.checkpoint_step}" if r.checkpoint_step else "none yet"


def _heldout(r) -> str:
    if r.heldout_before is None and r.heldout_last is None:
        return "-"
    last = f" → {percent(r.heldout_last[1])} after step {r.heldout_last[0]}" if r.heldout_last else ""
    return f"{percent(r.heldout_before)} before RL{last}"


def _table(header: tuple, rows: list[tuple]) -> None:
    widths = [max(len(str(r[i])) for r in (header, *rows)) for i in range(len(header))]
    for r in (header, *rows):
        print("  ".join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip())


async def _flow_run_states(api_url: str, ids: list[str]) -> dict[str, str]:
    """``{flow run id: "Completed (train-demo)"}`` for the ids this server knows."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    if not ids:
        return {}
    with prefect_server.use_api(api_url):
        async with get_client() as client:
            runs = await client.read_flow_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=ids)))
    return {str(r.id): f"{r.state.name if r.state else '?'} ({r.name})" for r in runs}


def _flow_runs(api_url: str, deployment: str | None, name: str | None, limit: int) -> tuple[int, int]:
    """The latest flow runs of the train flow on the server, with the step each committed: (exit code, rows shown)."""
    from prefect.exceptions import ObjectNotFound

    try:
        with prefect_server.use_api(api_url):
            rows = asyncio.run(_status_rows(deployment, name, limit))
    except ObjectNotFound:
        print(f"yattflow status: no deployment {deployment} (deploy it: yattflow deploy)", file=sys.stderr)
        return 1, 0
    print(f"\nflow runs on {api_url}")
    if not rows:
        print(f"no flow runs of {deployment or 'train'}" + (f" for run '{name}'" if name else ""))
        return 0, 0
    _table(("flow run", "state", "started", "seconds", "run", "steps committed", "started by"), rows)
    return 0, len(rows)


async def _status_rows(deployment: str | None, name: str | None, limit: int) -> list[tuple]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (DeploymentFilter, DeploymentFilterId, FlowFilter, FlowFilterName,
                                                FlowRunFilter, FlowRunFilterParentTaskRunId)
    from prefect.client.schemas.sorting import FlowRunSort

    from engines.config import load_config
    from storage.runstate import RunState

    async with get_client() as client:
        if deployment:
            dep = await client.read_deployment_by_name(deployment)
            which = {"deployment_filter": DeploymentFilter(id=DeploymentFilterId(any_=[dep.id]))}
        else:  # every top-level run of the train flow: deployments' and the command line's
            which = {"flow_filter": FlowFilter(name=FlowFilterName(any_=["train"])),
                     "flow_run_filter": FlowRunFilter(parent_task_run_id=FlowRunFilterParentTaskRunId(is_null_=True))}
        runs = await client.read_flow_runs(**which, sort=FlowRunSort.EXPECTED_START_TIME_DESC, limit=max(limit * 5, 50))
        deployments = {d.id: d.name for d in await client.read_deployments()}
    rows, committed = [], {}
    for r in runs:
        params = r.parameters or {}
        try:
            config_file = params.get("config_file")
            config = load_config(ROOT / config_file if config_file else None, params.get("overrides") or [])
        except ValueError:
            run_name, step = "?", "?"
        else:
            run_name = config.name
            if config.run_uri not in committed:
                try:
                    state = RunState.load(config.run_uri)
                    committed[config.run_uri] = "-" if state is None else state.step + 1  # steps done
                except Exception:  # noqa: BLE001 - unreadable storage is shown, not fatal
                    committed[config.run_uri] = "unreadable"
            done = committed[config.run_uri]
            step = f"{done}/{config.steps}" if isinstance(done, int) else done
        if name and run_name != name:
            continue
        started = r.start_time.strftime("%Y-%m-%d %H:%M:%S") if r.start_time else "-"
        seconds = f"{r.total_run_time.total_seconds():.0f}" if r.start_time else "-"
        started_by = f"deployment {deployments.get(r.deployment_id, '?')}" if r.deployment_id else "yattflow train"
        rows.append((r.name, r.state.name if r.state else "?", started, seconds, run_name, step, started_by))
        if len(rows) >= limit:
            break
    return rows
