"""``yattflow``: the command line.

In-process (on the server ``PREFECT_API_URL`` names, else on a temporary local server started for
the command and stopped after it, on Prefect's default SQLite database), with a progress display
and each run's UI page (``flows/console.py``; ``--verbose``: Prefect's log lines on the console too).
Ctrl-C or SIGTERM stop a run, saying the step it stopped at and its last checkpoint; the same
command continues it:

    yattflow sft     [-c run.yaml] [key=value ...]   supervised fine-tuning on your Parquet (or resume it)
    yattflow rm      [-c run.yaml] [key=value ...]   train a scalar reward model on preference pairs (or resume it)
    yattflow prepare [-c run.yaml] [key=value ...]   build the demo's datasets and tiny models
    yattflow train   [-c run.yaml] [key=value ...]   run (or resume) RL training
    yattflow demo    [-c run.yaml] [key=value ...]   prepare, then train, then print accuracy
    yattflow evaluate [key=value ...] [--checkpoint STEP|final|URI|--model FOLDER]   score a checkpoint (or any model) on the evaluation sets
    yattflow convert SOURCE.gguf OUTPUT              a GGUF file as a Hugging Face folder, checked against the GGUF

The Prefect way (a server, a worker on a work pool, deployments from deployments/prefect.yaml):

    yattflow server [--port 4200]                    local Prefect server + a worker per pool; Ctrl-C stops them
    yattflow stack --database-url URL [--replicas N] API replicas on PostgreSQL, Redis, services (flows/stack.py)
    yattflow deploy [--kubernetes] [--notify BLOCK]  the work pools if missing, the automations, then `prefect deploy`
    yattflow run    [-c run.yaml] [key=value ...]    a flow run of train/yattflow; prints its URL
    yattflow status [name]                           each run from storage; with a server, its flow-run state too

``deploy``, ``run`` and ``status`` (which needs none) talk to ``PREFECT_API_URL`` (environment or Prefect profile),
or to the server ``yattflow server`` starts (http://127.0.0.1:4200/api) when none is set.
"""

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


def _quiet_defaults() -> None:
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")  # nor the client's (its first-run notice took the terminal's first lines)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    _quiet_defaults()
    command = argv[0] if argv else None
    if command in PREFECT_COMMANDS:
        return PREFECT_COMMANDS[command](argv[1:])
    return _in_process(argv)


SUMMARY = {  # `yattflow --help`: what each command does, a line each
    "demo": "prepare, then train: the demo end to end, held-out accuracy before and after RL",
    "prepare": "build the demo's datasets and tiny SFT'd models (skips what exists)",
    "train": "run RL training, or resume it (the same name continues from its last checkpoint)",
    "evaluate": "score a run's checkpoint on its held-out set (default: the last one); the result beside it",
    "sft": "supervised fine-tuning on your Parquet into a new model folder (or resume it)",
    "rm": "train a scalar reward model on preference pairs (Bradley-Terry)",
    "status": "where each run stands, read from storage (no server needed)",
    "convert": "a GGUF file (llama.cpp's format) into a Hugging Face folder, its greedy answers checked",
    "server": "a local Prefect server and a process worker (the UI at http://127.0.0.1:4200)",
    "stack": "Prefect API replicas on PostgreSQL, Redis and a services process",
    "deploy": "create the work pool(s), then the deployments of deployments/prefect.yaml",
    "run": "start a flow run of the train deployment on a server; prints its URL",
}

IN_PROCESS = {
    "sft": "Supervised fine-tuning of a Hugging Face causal LM (sft.base), or of a tiny model built from scratch, on a "
           "Parquet of prompts and completions (sft.data), into a new model folder (sft.output); the same run name "
           "continues a stopped run from its last check.",
    "rm": "Train a scalar reward model (a sequence-classification head, num_labels=1) with the Bradley-Terry loss on a "
          "Parquet of preference pairs (rm.data: chosen, rejected, prompt or messages), from a Hugging Face folder "
          "(rm.base) or a tiny model from scratch, into a new model folder (rm.output) for model.reward_model; "
          "rm.demo=true builds the arithmetic demo's pairs first. The same run name continues a stopped run.",
    "prepare": "Build the demo's prompt datasets and its two tiny SFT'd models (policy and GenRM) where the config "
               "points; skips what it built before, and never writes over a folder it did not make.",
    "train": "Run RL training, or resume it: the same run name continues from its last committed checkpoint.",
    "demo": "prepare, then train, then print the held-out score before and after RL.",
    "evaluate": "Score a committed checkpoint of the run (default: its last; --checkpoint STEP, 'final' or a URI) on the "
                "run's evaluation sets (data.heldout, eval.sets: greedy, and with eval.samples mean@k, pass@k, maj@k) with "
                "their rules or the judge, on engine hosts of its own, from the run's stored config with the overrides on "
                "top; the result goes to runs/<name>/evaluations/ (the evaluate flow that deployments/prefect.yaml "
                "triggers on every committed checkpoint). --model FOLDER scores any model folder instead, with no run, on "
                "the evaluation sets of -c and the overrides (a baseline).",
}


def _in_process(argv: list[str]) -> int:
    from engines.config import ConfigError, describe_fields, load_config

    if not argv or argv[0] not in IN_PROCESS:
        top = argparse.ArgumentParser(
            prog="yattflow", description="RLHF training where every RL iteration is a Prefect flow.",
            formatter_class=argparse.RawDescriptionHelpFormatter,
            epilog="commands (demo, prepare, train, sft, rm, status and run take -c run.yaml and key=value overrides):\n"
                   + "\n".join(f"  {name:<8} {line}" for name, line in SUMMARY.items())
                   + "\n\nEach command's own options and config fields: yattflow COMMAND --help")
        top.add_argument("command", choices=[*IN_PROCESS, *PREFECT_COMMANDS])
        top.parse_args(argv[:1])  # prints the help, or the error, and exits
    parser = argparse.ArgumentParser(
        prog=f"yattflow {argv[0]}", description=IN_PROCESS[argv[0]], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="config fields (in the YAML file, or as key=value overrides; every default is in engines/config/__init__.py):\n"
               + "\n".join(describe_fields()))
    parser.add_argument("-c", "--config", help="run config YAML (default: built-in defaults)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.lr=1e-4 dp=2")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="Prefect's task and flow log lines on the console too (they always go to the log file)")
    if argv[0] == "evaluate":
        which = parser.add_mutually_exclusive_group()
        which.add_argument("--checkpoint", help="a step number, 'final', or a checkpoint's URI or path (default: the last)")
        which.add_argument("--model", help="any model folder instead, with no run (a baseline): scored on the evaluation sets "
                           "of -c and the overrides; the result goes to <storage root>/evaluations/<name>/")
    args = parser.parse_intermixed_args(argv[1:])
    args.command = argv[0]

    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"yattflow: {e}", file=sys.stderr)
        return 2
    from flows import preflight

    try:  # every check of the input that needs no server, host or device, before any starts (flows/preflight.py)
        preflight.check(args.command, config, args.overrides, getattr(args, "checkpoint", None), getattr(args, "model", None),
                        args.config)
    except preflight.Refused as e:
        print(f"yattflow: {e}", file=sys.stderr)
        return e.exit_code
    from flows import events
    from flows.console import RunConsole, log_path, ui_of_command
    from flows.evaluate import evaluate, pick_checkpoint
    from flows.prepare import prepare
    from flows.rm import rm, summary_line
    from flows.sft import sft, stopped_line
    from flows.stops import StopSignals, cancelled_when_stopped, failed_line, stopped_when_cancelled, where_it_stopped
    from flows.training import train

    def stop_line() -> str:
        if args.command == "evaluate":
            return "yattflow evaluate: stopped; nothing was written (the training run is not touched)"
        where = stopped_line(config, args.command) if args.command in ("sft", "rm") else where_it_stopped(config)
        return f"yattflow {args.command}: {where}"

    start = time.perf_counter()
    console = RunConsole(log_path(config.storage.root, config.name, args.command), *ui_of_command(), verbose=args.verbose)
    # Ctrl-C and SIGTERM stop the command, which then ends within a bound (flows/stops.py), the server last
    stop = StopSignals(stop_line, console.log_path)
    try:
        with (stop, console, prefect_server.local_api() as api_url, events.all_sent(), cancelled_when_stopped(console),
              stopped_when_cancelled(console)):
            console.serving(api_url)  # the links point at the live server's UI until the command ends
            if args.command == "sft":
                result = sft(config_file=args.config, overrides=args.overrides)
                console.say(f"\nsft '{config.name}': {_sft_line(result)}")
            if args.command == "rm":
                console.say(f"\nrm '{config.name}': {summary_line(rm(config_file=args.config, overrides=args.overrides))}")
            if args.command in ("prepare", "demo"):
                prepare(config_file=args.config, overrides=args.overrides)
            if args.command == "evaluate":
                if args.model:  # any model folder, no run
                    target = {"model": args.model, "config_file": args.config}
                else:
                    target = {"checkpoint": pick_checkpoint(config, args.checkpoint)}
                result = asyncio.run(stop.cancellable(evaluate(overrides=args.overrides, **target)))
                console.say(f"\nevaluate '{config.name}': {_evaluation_line(result)}")
            if args.command in ("train", "demo"):
                summary = asyncio.run(stop.cancellable(train(config_file=args.config, overrides=args.overrides)))
                console.say(f"\nrun '{config.name}': {_heldout_line(summary)}; final policy: {summary['final_model']}")
    except (KeyboardInterrupt, asyncio.CancelledError):  # (asyncio.run raises the cancel of its main task)
        stop.say_last(stop_line())
        return 130
    except Exception as e:  # noqa: BLE001 - the traceback is in the log above; the cause goes last, alone
        print(f"\n{failed_line(args.command, e, config, console.log_path)}", file=sys.stderr, flush=True)
        return 1
    print(f"yattflow {args.command}: done in {time.perf_counter() - start:.0f}s")
    return 0


def _heldout_line(summary: dict) -> str:
    """``held-out mean engines.demo.arithmetic:exact_match reward: 31.2% before RL → 63.2% after 40 RL steps``."""
    if summary["heldout_metric"] is None:
        return "no held-out evaluation (data.heldout is not set)"
    from flows.curves import percent

    return (f"held-out {summary['heldout_metric']}: {percent(summary['heldout_before'])} before RL → "
            f"{percent(summary['heldout_after'])} after {summary['steps']} RL steps")


def _evaluation_line(result: dict) -> str:
    """``held-out mean … reward 62.5% at step 9 (policy version 10); result: file:///…/evaluations/000009.json``, then
    every evaluation set's figures, a line each."""
    from flows.curves import percent
    from flows.evaluations import lines

    where = (f"of {result['checkpoint']}" if result.get("kind") == "model" else
             f"at step {result['step']} (policy version {result['policy_version']})")
    return "\n".join([f"held-out {result['heldout_metric']} {percent(result['score'])} {where}; result: {result['result']}",
                      *(f"  {line}" for line in lines(result.get("evaluation") or {}))])


def _sft_line(result: dict) -> str:
    """``held-out exact match 95.0% after 700 steps; model: file:///…/models/mine-sft``."""
    if result.get("skipped"):
        return f"a model is already committed at {result['uri']} (nothing trained)"
    from flows.curves import percent

    heldout = "" if result["exact_match"] is None else f"held-out exact match {percent(result['exact_match'])}, "
    return f"{heldout}loss {result['loss']:.4f} after {result['steps']} steps; model: {result['uri']}"


# --------------------------------------------------------------------------- Prefect server side


def _api_url() -> str:
    """``PREFECT_API_URL`` from the environment or the active profile, else the local default."""
    from prefect.settings import get_current_settings

    return get_current_settings().api.url or f"http://127.0.0.1:{DEFAULT_PORT}/api"


def _reachable_api(command: str) -> str | None:
    """The API URL when a server answers there; else None, after saying so."""
    url = _api_url()
    if prefect_server.healthy(url):
        return url
    print(f"yattflow {command}: no Prefect server at {url} (start one with `yattflow server`, or set PREFECT_API_URL)",
          file=sys.stderr)
    return None


async def _ensure_pool(name: str) -> bool:
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


async def _ensure_automations(notify: str | None = None) -> list[str]:
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
                    if asyncio.run(_ensure_pool(pool)):
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
    api_url = _reachable_api("deploy")
    if api_url is None:
        return 1
    with prefect_server.use_api(api_url):
        for pool in (PROCESS_POOL, EVAL_POOL, K8S_POOL) if args.kubernetes else (PROCESS_POOL, EVAL_POOL):
            if asyncio.run(_ensure_pool(pool)):
                print(f"created work pool {pool} from {POOL_TEMPLATES[pool][1].relative_to(ROOT)}")
        try:
            for name in asyncio.run(_ensure_automations(args.notify)):
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
    if (api_url := _reachable_api("run")) is None:
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


def status(argv: list[str]) -> int:
    from flows.status import status as run_status  # (flows/status.py: where runs stand, with or without a server)

    return run_status(argv)


def stack(argv: list[str]) -> int:
    from flows.stack import stack as start_stack  # (flows/stack.py: API replicas, Redis, services)

    return start_stack(argv)


def convert(argv: list[str]) -> int:
    from flows.convert import main as convert_main  # (flows/convert.py: a GGUF file as a Hugging Face folder)

    return convert_main(argv)


PREFECT_COMMANDS = {"server": server, "stack": stack, "deploy": deploy, "run": run, "status": status, "convert": convert}


if __name__ == "__main__":
    sys.exit(main())
