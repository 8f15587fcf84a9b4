"""The command line's pre-flight: every check of a run's input that needs no server, host or device, in
the command's own process before the Prefect server or any engine host starts (design invariant 5).

``yattflow train`` and ``yattflow evaluate`` call ``check`` right after the config loads: the storage root
is reachable, then ``engines.host.validation.preflight`` (the reward rule and the environment and tools
imported, their signatures, docstrings and type hints, the tool call format against the policy's chat
template, the environment built, reset and stepped once; the model folders and their config.json
against the layout the run asks of them; every prompt: schema, UTF-8, length, ids, answers, images by
bytes and pixels). A refusal is ``Refused``: the CLI prints ``yattflow: <message>`` (one line, the file
and the field) and exits 2; the traceback goes to the command's log file only.

``yattflow demo`` builds the models first (prepare), so its train flow runs the pre-flight itself,
before it starts its hosts (``before_hosts``). A run whose input passed here skips the same checks on
its first engine host (``passed``); a run started another way (a deployment, ``train()`` called from
Python) has them on the host as before, before any engine loads.

The checks load torch and transformers (a model's config, its tokenizer and chat template): they run in a
child process (``python -m flows.preflight``), so that the command's own process, the run's controller, never
holds them. ``run`` is the checks themselves, in this process (the tests call it directly).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Callable

_passed: set[str] = set()  # fingerprints of the configs whose input passed in this process
_command: str | None = None  # this process is a command's (its name): its flows may run the pre-flight, before any host


class Refused(Exception):
    """The pre-flight refused the input (``exit_code`` 2), could not run (1) or was stopped (130, Ctrl-C);
    the message is the line to print."""

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code


def fingerprint(config) -> str:
    return hashlib.sha256(config.model_dump_json().encode()).hexdigest()


def passed(config) -> bool:
    """Whether ``config``'s input passed the pre-flight in this process, with its hosts on this
    machine (deployed hosts check their devices and files themselves)."""
    return config.hosts.launch == "local" and fingerprint(config) in _passed


def check(command: str, config, overrides: list[str] | None = None, checkpoint: str | None = None, model: str | None = None,
          config_file: str | None = None, meanwhile: Callable[[], None] | None = None) -> None:
    """The command's pre-flight (train, evaluate: its ``--checkpoint`` or ``--model`` folder; the others have none here),
    in a child process, or ``Refused``. ``meanwhile`` runs here while the child checks (the command's own imports:
    the child's are torch and transformers, seconds of one core each)."""
    global _command
    _command = command
    if command in ("train", "evaluate"):
        _in_child({"command": command, "config": config.model_dump(mode="json"), "overrides": overrides,
                   "checkpoint": checkpoint, "model": model, "config_file": config_file}, meanwhile)


def _in_child(job: dict, meanwhile: Callable[[], None] | None = None) -> None:
    """``_check(**job)`` in a fresh ``python -m flows.preflight``, ``meanwhile()`` here as it runs; its refusal
    raised here, the fingerprints of what passed kept here."""
    child = subprocess.Popen([sys.executable, "-m", "flows.preflight"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        with contextlib.suppress(BrokenPipeError), child.stdin:  # the job, whole (the child reads to its end first)
            child.stdin.write(json.dumps(job))  # (a child gone at once answers nothing: said below)
        if meanwhile is not None:
            meanwhile()
        out = child.stdout.read()
        child.wait()
    except KeyboardInterrupt:  # Ctrl-C while it checks (a long dataset): nothing started, nothing written
        raise Refused(f"{job['command']} stopped while checking the input, before anything started", 130) from None
    finally:  # (stopped, or meanwhile failed: the child goes too)
        if child.poll() is None:
            child.kill()
        child.wait()
        child.stdout.close()
    try:
        answer = json.loads(out.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        raise Refused(f"{job['command']}: the pre-flight check of the input ended with code {child.returncode} "
                      f"and no answer", 1) from None
    if "refused" in answer:
        raise Refused(answer["refused"], answer["exit_code"])
    _passed.update(answer["passed"])


def _check(command: str, config, overrides: list[str] | None = None, checkpoint: str | None = None, model: str | None = None,
           config_file: str | None = None, resolved: bool = False) -> None:
    """The pre-flight of ``check``, in this process (``resolved``: ``config`` is already the one the flow runs)."""
    from engines.config import ConfigError
    from engines.host.validation import InputError  # (imports torch: only here, when a check runs)

    try:
        with _into_log(command, config):  # the checks' warnings and log lines: the log file's, not the console's
            if command == "evaluate" and not resolved:  # the config the evaluate flow will load
                from flows.evaluate import evaluation_target, model_target, pick_checkpoint

                if model is not None:  # any model folder: the config given
                    config = model_target(config_file, overrides or [], model)[0]
                else:  # the run's stored config, with the overrides
                    config = evaluation_target(pick_checkpoint(config, checkpoint), overrides or [])[0]
            run(config)
    except (InputError, ConfigError) as e:
        _log(command, config, e)
        raise Refused(" ".join(str(e).split())) from None
    except KeyboardInterrupt:  # Ctrl-C while it checks (a long dataset): nothing started, nothing written
        raise Refused(f"{command} stopped while checking the input, before anything started", 130) from None
    except Exception as e:  # noqa: BLE001 - a check that could not run: the command stops, saying so in a line
        log = _log(command, config, e)
        raise Refused(f"{command}: the pre-flight check of the input failed: {type(e).__name__}: "
                      f"{' '.join(str(e).split())} (traceback: {log})", 1) from None


def run(config) -> None:
    """The checks (``engines.host.validation.preflight``) after the storage root's reachability;
    ``InputError`` naming the file and field."""
    from engines.host.validation import InputError as Error, preflight
    from storage import objectstore

    try:
        objectstore.check_reachable(config.uri(""))
    except objectstore.StorageError as e:
        raise Error(str(e)) from e
    preflight(config)
    _passed.add(fingerprint(config))


def before_hosts(config) -> None:
    """A flow of a command (``yattflow demo``'s train, after prepare) runs the pre-flight (in a child process)
    before it starts its hosts, unless the command ran it already; in any other process (a deployment's flow
    run, a worker's) the first engine host checks the input (the flow's process never reads sample data)."""
    if _command and config.hosts.launch == "local" and not passed(config):
        from engines.config import ConfigError

        try:
            _in_child({"command": _command, "config": config.model_dump(mode="json"), "resolved": True})
        except Refused as e:  # the flow fails on it: the command's last line names the input (flows/stops.py)
            if e.exit_code == 130:
                raise KeyboardInterrupt from None
            raise (ConfigError if e.exit_code == 2 else RuntimeError)(str(e)) from None


@contextlib.contextmanager
def _into_log(command: str, config):
    """Python warnings (transformers' about a model's config, say) and log records (a chat template
    that is not append-only) of the checks go to the command's log file, as the run's do later."""
    import logging

    root = logging.getLogger()
    try:
        handler: logging.Handler = logging.FileHandler(_log_path(command, config), encoding="utf-8", delay=True)
    except OSError:  # no log file where the storage root is not a writable folder (the check says so)
        handler = logging.NullHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s | %(levelname)-7s | %(name)s - %(message)s"))
    root.addHandler(handler)
    logging.captureWarnings(True)
    try:
        yield
    finally:
        logging.captureWarnings(False)
        root.removeHandler(handler)
        handler.close()


def _log_path(command: str, config) -> Path:
    from flows.console import log_path

    path = log_path(config.storage.root, config.name, command)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _log(command: str, config, error: BaseException) -> Path | None:
    """The error's traceback, appended to the command's log file (``flows.console.log_path``)."""
    try:
        path = _log_path(command, config)
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"yattflow {command}: the pre-flight check refused the input\n"
                    + "".join(traceback.format_exception(error)))
        return path
    except Exception:  # noqa: BLE001 - the line on the console is what matters
        return None


def _child() -> None:
    """``python -m flows.preflight``: a job of ``_in_child`` on stdin; on stdout, as the last line, what passed or
    the refusal."""
    from engines.config import RunConfig

    job = json.loads(sys.stdin.read())
    job["config"] = RunConfig.model_validate(job["config"])
    try:
        _check(**job)
    except Refused as e:
        print(json.dumps({"refused": str(e), "exit_code": e.exit_code}), flush=True)
        return
    print(json.dumps({"passed": sorted(_passed)}), flush=True)


if __name__ == "__main__":
    _child()
