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

The Prefect way (a server, a worker on a work pool, deployments from deployments/prefect.yaml: flows/admin.py):

    yattflow server [--port 4200]                    local Prefect server + a worker per pool; Ctrl-C stops them
    yattflow stack --database-url URL [--replicas N] API replicas on PostgreSQL, Redis, services (flows/stack.py)
    yattflow deploy [--kubernetes] [--notify BLOCK]  the work pools if missing, the automations, then `prefect deploy`
    yattflow run    [-c run.yaml] [key=value ...]    a flow run of train/yattflow; prints its URL
    yattflow status [name]                           each run from storage; with a server, its flow-run state too

``deploy``, ``run`` and ``status`` (which needs none) talk to ``PREFECT_API_URL`` (environment or Prefect profile),
or to the server ``yattflow server`` starts (http://127.0.0.1:4200/api) when none is set.

Each command's code is imported when it runs (``COMMANDS``): ``yattflow train`` loads no torch or transformers in
this process (the engine hosts do), ``yattflow status`` no flow.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import os
import sys
import time

from flows import prefect_server


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
    if command in COMMANDS:
        module, function = COMMANDS[command]
        return getattr(importlib.import_module(module), function)(argv[1:])
    return _in_process(argv)


# ----------------------------------------------------------------- in-process commands: a flow run in this process

def _sft(args, config, stop, console) -> None:
    from flows.sft import sft

    console.say(f"\nsft '{config.name}': {_sft_line(sft(config_file=args.config, overrides=args.overrides))}")


def _rm(args, config, stop, console) -> None:
    from flows.rm import rm, summary_line

    console.say(f"\nrm '{config.name}': {summary_line(rm(config_file=args.config, overrides=args.overrides))}")


def _prepare(args, config, stop, console) -> None:
    from flows.prepare import prepare

    prepare(config_file=args.config, overrides=args.overrides)


def _train(args, config, stop, console) -> None:
    from flows.training import train

    summary = asyncio.run(stop.cancellable(train(config_file=args.config, overrides=args.overrides)))
    console.say(f"\nrun '{config.name}': {_heldout_line(summary)}; final policy: {summary['final_model']}")


def _demo(args, config, stop, console) -> None:
    _prepare(args, config, stop, console)
    _train(args, config, stop, console)


def _evaluate(args, config, stop, console) -> None:
    from flows.evaluate import evaluate, pick_checkpoint

    if args.model:  # any model folder, no run
        target = {"model": args.model, "config_file": args.config}
    else:
        target = {"checkpoint": pick_checkpoint(config, args.checkpoint)}
    result = asyncio.run(stop.cancellable(evaluate(overrides=args.overrides, **target)))
    console.say(f"\nevaluate '{config.name}': {_evaluation_line(result)}")


IN_PROCESS = {  # name → (what runs it, its --help description)
    "sft": (_sft, ("Supervised fine-tuning of a Hugging Face causal LM (sft.base), or of a tiny model built from scratch, on "
            "a Parquet of prompts and completions (sft.data), into a new model folder (sft.output); the same run name "
            "continues a stopped run from its last check.")),
    "rm": (_rm, ("Train a scalar reward model (a sequence-classification head, num_labels=1) with the Bradley-Terry loss on "
           "a Parquet of preference pairs (rm.data: chosen, rejected, prompt or messages), from a Hugging Face folder "
           "(rm.base) or a tiny model from scratch, into a new model folder (rm.output) for model.reward_model; "
           "rm.demo=true builds the arithmetic demo's pairs first. The same run name continues a stopped run.")),
    "prepare": (_prepare, ("Build the demo's prompt datasets and its two tiny SFT'd models (policy and GenRM) where the "
                "config points; skips what it built before, and never writes over a folder it did not make.")),
    "train": (_train, "Run RL training, or resume it: the same run name continues from its last committed checkpoint."),
    "demo": (_demo, "prepare, then train, then print the held-out score before and after RL."),
    "evaluate": (_evaluate, ("Score a committed checkpoint of the run (default: its last; --checkpoint STEP, 'final' or a "
                 "URI) on the run's evaluation sets (data.heldout, eval.sets: greedy, and with eval.samples mean@k, pass@k, "
                 "maj@k) with their rules or the judge, on engine hosts of its own, from the run's stored config with the "
                 "overrides on top; the result goes to runs/<name>/evaluations/ (the evaluate flow that "
                 "deployments/prefect.yaml triggers on every committed checkpoint). --model FOLDER scores any model folder "
                 "instead, with no run, on the evaluation sets of -c and the overrides (a baseline).")),
}

# ----------------------------------------------------------------- the others: Prefect administration and storage

COMMANDS = {  # name → (module, function taking argv): imported only when it runs
    "server": ("flows.admin", "server"), "deploy": ("flows.admin", "deploy"), "run": ("flows.admin", "run"),
    "stack": ("flows.stack", "stack"),  # API replicas, Redis, services
    "status": ("flows.status", "status"),  # where runs stand, with or without a server
    "convert": ("flows.convert", "main"),  # a GGUF file as a Hugging Face folder
}

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


def _in_process(argv: list[str]) -> int:
    from engines.config import ConfigError, describe_fields, load_config

    if not argv or argv[0] not in IN_PROCESS:
        top = argparse.ArgumentParser(
            prog="yattflow", description="RLHF training where every RL iteration is a Prefect flow.",
            formatter_class=argparse.RawDescriptionHelpFormatter,
            epilog="commands (demo, prepare, train, sft, rm, status and run take -c run.yaml and key=value overrides):\n"
                   + "\n".join(f"  {name:<8} {line}" for name, line in SUMMARY.items())
                   + "\n\nEach command's own options and config fields: yattflow COMMAND --help")
        top.add_argument("command", choices=[*IN_PROCESS, *COMMANDS])
        top.parse_args(argv[:1])  # prints the help, or the error, and exits
    parser = argparse.ArgumentParser(
        prog=f"yattflow {argv[0]}", description=IN_PROCESS[argv[0]][1], formatter_class=argparse.RawDescriptionHelpFormatter,
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
                        args.config, meanwhile=lambda: _import_flows(args.command))
    except preflight.Refused as e:
        print(f"yattflow: {e}", file=sys.stderr)
        return e.exit_code
    from flows import events
    from flows.console import RunConsole, log_path, ui_of_command
    from flows.stops import StopSignals, cancelled_when_stopped, failed_line, stopped_when_cancelled, where_it_stopped

    def stop_line() -> str:
        if args.command == "evaluate":
            return "yattflow evaluate: stopped; nothing was written (the training run is not touched)"
        if args.command in ("sft", "rm"):
            from flows.sft import stopped_line

            return f"yattflow {args.command}: {stopped_line(config, args.command)}"
        return f"yattflow {args.command}: {where_it_stopped(config)}"

    start = time.perf_counter()
    console = RunConsole(log_path(config.storage.root, config.name, args.command), *ui_of_command(), verbose=args.verbose)
    # Ctrl-C and SIGTERM stop the command, which then ends within a bound (flows/stops.py), the server last
    stop = StopSignals(stop_line, console.log_path)
    try:
        with (stop, console, prefect_server.local_api() as api_url, events.all_sent(), cancelled_when_stopped(console),
              stopped_when_cancelled(console)):
            console.serving(api_url)  # the links point at the live server's UI until the command ends
            IN_PROCESS[args.command][0](args, config, stop, console)
    except (KeyboardInterrupt, asyncio.CancelledError):  # (asyncio.run raises the cancel of its main task)
        stop.say_last(stop_line())
        return 130
    except Exception as e:  # noqa: BLE001 - the traceback is in the log above; the cause goes last, alone
        print(f"\n{failed_line(args.command, e, config, console.log_path)}", file=sys.stderr, flush=True)
        return 1
    print(f"yattflow {args.command}: done in {time.perf_counter() - start:.0f}s")
    return 0


def _import_flows(command: str) -> None:
    """The modules a train or evaluate command runs with, imported while its pre-flight child checks the input (Prefect's
    client and the flows: seconds of the other core)."""
    for module in ("flows.events", "flows.console", "flows.stops", {"train": "flows.training"}.get(command, "flows.evaluate")):
        importlib.import_module(module)


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


if __name__ == "__main__":
    sys.exit(main())
