"""``yattflow server | deploy | run``: Prefect administration (flows/cli.py's table dispatches here): a local
server with a worker per pool, the work pools, automations and deployments of deployments/, and a flow run of
a deployment. ``deploy`` and ``run`` talk to ``PREFECT_API_URL`` (environment or Prefect profile), or to the
server ``yattflow server`` starts (http://127.0.0.1:4200/api) when none is set."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from flows import prefect_server

ROOT = Path(__file__).resolve().parent.parent  # the checkout: deployments run from here
PREFECT_FILE = ROOT / "deployments" / "prefect.yaml"
PROCESS_POOL, EVAL_POOL, K8S_POOL = "yattflow-process", "yattflow-eval", "yattflow-k8s"
POOL_TEMPLATES = {PROCESS_POOL: ("process", ROOT / "deployments" / "process-gpu.json"),
                  EVAL_POOL: ("process", ROOT / "deployments" / "process-gpu.json"),
                  K8S_POOL: ("kubernetes", ROOT / "deployments" / "kubernetes-gpu.json")}
AUTOMATIONS_FILE = ROOT / "deployments" / "automations.yaml"
TRAIN_DEPLOYMENT = "train/yattflow"
DEFAULT_PORT = prefect_server.DEFAULT_PORT



def api_url() -> str:
    """``PREFECT_API_URL`` from the environment or the active profile, else the local default."""
    from prefect.settings import get_current_settings

    return get_current_settings().api.url or f"http://127.0.0.1:{DEFAULT_PORT}/api"


def reachable_api(command: str) -> str | None:
    """The API URL when a server answers there; else None, after saying so."""
    url = api_url()
    if prefect_server.healthy(url):
        return url
    print(f"yattflow {command}: no Prefect server at {url} (start one with `yattflow server`, or set PREFECT_API_URL)",
          file=sys.stderr)
    return None


async def ensure_pool(name: str) -> bool:
    """Create work pool ``name`` from its base job template in deployments/ unless it exists;
    True when it was created."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound

    kind, template = POOL_TEMPLATES[name]
    async with get_client() as client:
        try:
            await client.read_work_pool(name)
            return False
        except ObjectNotFound:
            pass
        await client.create_work_pool(WorkPoolCreate(
            name=name, type=kind, base_job_template=json.loads(template.read_text()),
            description=f"yattflow ({template.relative_to(ROOT)})",
        ))
        return True


async def ensure_automations(notify: str | None = None) -> list[str]:
    """Create the automations of deployments/automations.yaml, replacing those of the same names;
    with ``notify`` (a notification block, 'type/name') each also sends a notification."""
    import yaml
    from prefect.blocks.core import Block
    from prefect.client.orchestration import get_client
    from prefect.events.actions import SendNotification
    from prefect.events.schemas.automations import AutomationCore

    automations = [AutomationCore.model_validate(a) for a in yaml.safe_load(AUTOMATIONS_FILE.read_text())["automations"]]
    if notify:
        try:
            block = await Block.aload(notify)
        except (ValueError, KeyError) as e:
            raise ValueError(f"--notify {notify}: no such notification block ('type/name', e.g. slack-webhook/oncall): {e}") from None
        for automation in automations:
            automation.actions.append(SendNotification(
                block_document_id=block._block_document_id, subject=f"yattflow: {automation.name}",
                body="{{ automation.description }} {{ event.payload if event else '' }}"))
    async with get_client() as client:
        for automation in automations:
            for old in await client.read_automations_by_name(automation.name):
                await client.delete_automation(old.id)
            await client.create_automation(automation)
    return [a.name for a in automations]


def server(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="yattflow server", description=(
        f"Start a local Prefect server on 127.0.0.1 and process workers for the {PROCESS_POOL} and {EVAL_POOL} work pools "
        "(created if missing). Ctrl-C stops them all."))
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="server port (default %(default)s)")
    parser.add_argument("--no-worker", action="store_true", help="start the server only")
    args = parser.parse_args(argv)

    from prefect.settings import get_current_settings

    ui_url = f"http://127.0.0.1:{args.port}"
    api_url = f"{ui_url}/api"
    if prefect_server.healthy(api_url):
        print(f"yattflow server: a Prefect server already answers at {api_url}", file=sys.stderr)
        return 1
    def interrupted(*_):
        raise KeyboardInterrupt

    # Ctrl-C, and SIGTERM too, stop both children (even where the shell started us with SIGINT ignored)
    signal.signal(signal.SIGINT, interrupted)
    signal.signal(signal.SIGTERM, interrupted)
    env = {**prefect_server.SERVER_SETTINGS, **os.environ, "PREFECT_API_URL": api_url}
    log_path = Path(get_current_settings().home) / "yattflow-server.log"
    procs: list[tuple[subprocess.Popen, str]] = []
    try:
        try:
            procs.append((prefect_server.started_server(env, log_path, "the Prefect server", args.port)[0], "server"))
        except RuntimeError as e:
            print(f"yattflow server: {e}", file=sys.stderr)
            return 1
        if not args.no_worker:
            for pool in (PROCESS_POOL, EVAL_POOL):  # training, and the evaluations its checkpoints trigger
                with prefect_server.use_api(api_url):
                    if asyncio.run(ensure_pool(pool)):
                        print(f"created work pool {pool} from deployments/process-gpu.json")
                worker = subprocess.Popen([sys.executable, "-m", "prefect", "worker", "start", "--pool", pool,
                                           "--type", "process"], env=env, cwd=ROOT)
                procs.append((worker, f"worker of {pool}"))
        print(f"\nPrefect UI: {ui_url}\n  server log: {log_path}\n  in other shells: export PREFECT_API_URL={api_url}"
              f"\n  then: yattflow deploy && yattflow run --deployment prepare/prepare --watch && yattflow run steps=5"
              f"\nCtrl-C stops the server and the workers.\n", flush=True)
        while all(p.poll() is None for p, _ in procs):
            time.sleep(0.5)
        for p, name in procs:
            if p.poll() is not None:
                print(f"yattflow server: the {name} exited (code {p.returncode}); stopping", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nyattflow server: stopping", flush=True)
        return 0
    finally:
        for p, name in reversed(procs):  # the worker first, while the server still answers it
            prefect_server.stop(p, name)


def deploy(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="yattflow deploy", description=(
        f"Create the {PROCESS_POOL} and {EVAL_POOL} work pools from deployments/process-gpu.json if missing and the "
        "automations of deployments/automations.yaml (replacing those of the same names), then deploy train/yattflow, "
        "engine-host/yattflow-host, prepare/prepare and evaluate/evaluate from deployments/prefect.yaml (`prefect deploy`)."))
    parser.add_argument("--kubernetes", action="store_true", help=(
        f"also create the {K8S_POOL} pool (deployments/kubernetes-gpu.json) and deploy train/yattflow-k8s and "
        "engine-host/yattflow-host-k8s "
        "(= prefect deploy --all)"))
    parser.add_argument("--notify", metavar="BLOCK", help=(
        "a notification block ('type/name', e.g. slack-webhook/oncall, made in the UI or with `prefect block create`) "
        "that each automation also notifies"))
    args = parser.parse_args(argv)
    api_url = reachable_api("deploy")
    if api_url is None:
        return 1
    with prefect_server.use_api(api_url):
        for pool in (PROCESS_POOL, EVAL_POOL, K8S_POOL) if args.kubernetes else (PROCESS_POOL, EVAL_POOL):
            if asyncio.run(ensure_pool(pool)):
                print(f"created work pool {pool} from {POOL_TEMPLATES[pool][1].relative_to(ROOT)}")
        try:
            for name in asyncio.run(ensure_automations(args.notify)):
                print(f"automation {name} (deployments/automations.yaml){' notifying ' + args.notify if args.notify else ''}")
        except ValueError as e:
            print(f"yattflow deploy: {e}", file=sys.stderr)
            return 2
    names = ["--all"] if args.kubernetes else ["--name", "yattflow", "--name", "yattflow-host", "--name", "prepare",
                                               "--name", "evaluate"]
    cmd = [sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--prefect-file", str(PREFECT_FILE), *names]
    return subprocess.run(cmd, cwd=ROOT).returncode  # from the checkout: the build step records it


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="yattflow run", description=(
        f"Start a flow run of a deployment (default {TRAIN_DEPLOYMENT}) with key=value overrides; "
        f"= prefect deployment run {TRAIN_DEPLOYMENT} --param overrides='[...]'. Prints the run's URL."))
    parser.add_argument("-c", "--config", help="run config YAML, relative to the checkout (default: the deployment's)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. steps=50 train.lr=1e-4")
    parser.add_argument("--deployment", default=TRAIN_DEPLOYMENT, help="flow/deployment name (default %(default)s)")
    parser.add_argument("--work-queue", help="work queue of the run (e.g. the queue of one GPU node)")
    parser.add_argument("--job-variable", action="append", default=[], metavar="KEY=JSON",
                        help='job variable for this run, e.g. env=\'{"CUDA_VISIBLE_DEVICES": "2,3"}\' (repeatable)')
    parser.add_argument("--watch", action="store_true", help="wait for the run to finish; exit 1 unless it completed")
    args = parser.parse_intermixed_args(argv)

    from engines.config import ConfigError, load_config

    config_file = ROOT / (args.config or "deployments/demo.yaml")  # the deployment runs in the checkout
    try:  # fail here, not in a worker, on a bad key or value
        config = load_config(config_file if config_file.exists() else None, args.overrides)
    except ConfigError as e:
        print(f"yattflow run: {e}", file=sys.stderr)
        return 2
    job_variables = {}
    for item in args.job_variable:
        key, _, raw = item.partition("=")
        try:
            job_variables[key] = json.loads(raw)
        except json.JSONDecodeError:
            job_variables[key] = raw
    parameters = {"overrides": args.overrides} | ({"config_file": args.config} if args.config else {})
    if (api_url := reachable_api("run")) is None:
        return 1
    with prefect_server.use_api(api_url):
        # the name the flow gives itself once it starts (train-demo), already in the Scheduled state
        run_name = f"{args.deployment.split('/')[0]}-{config.name}"
        return asyncio.run(_run(args.deployment, parameters, run_name, args.work_queue, job_variables, args.watch))


async def _run(name: str, parameters: dict, run_name: str, work_queue: str | None, job_variables: dict,
               watch: bool) -> int:
    from prefect.client.orchestration import get_client
    from prefect.deployments import arun_deployment
    from prefect.settings import get_current_settings

    flow_run = await arun_deployment(name, parameters=parameters, timeout=0, as_subflow=False, flow_run_name=run_name,
                                     work_queue_name=work_queue, job_variables=job_variables or None)
    print(f"flow run {flow_run.name} ({flow_run.id}) of {name}: {get_current_settings().ui_url}/runs/flow-run/{flow_run.id}",
          flush=True)
    if not watch:
        return 0
    async with get_client() as client:
        while True:
            flow_run = await client.read_flow_run(flow_run.id)
            if flow_run.state and flow_run.state.is_final():
                break
            await asyncio.sleep(2)
    print(f"flow run {flow_run.name}: {flow_run.state.name}")
    return 0 if flow_run.state.is_completed() else 1
