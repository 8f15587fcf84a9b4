"""How a command's run ends, as a person reads it: the last line after a failure (the error's own
message when it says what to change; where the run stands; the log file), where a stopped run stands,
and a run stopped on purpose marked Cancelled in the Prefect UI rather than Crashed."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import os
import signal
import threading
from pathlib import Path


@contextlib.contextmanager
def cancelled_when_stopped(console):
    """A run stopped on purpose (Ctrl-C, SIGTERM) is Cancelled in the UI, not Crashed: Prefect ends a
    flow run that a KeyboardInterrupt unwinds as Crashed; its top-level runs (the ones the console
    links) and their sub-flows are set Cancelled here, while the server still answers."""
    try:
        yield
    except (KeyboardInterrupt, asyncio.CancelledError):
        try:
            asyncio.run(_set_cancelled(list(console.runs)))
        except Exception as e:  # noqa: BLE001 - the stop line matters more than the UI's word for it
            console.say(f"(could not mark the stopped run Cancelled in the UI: {type(e).__name__}: {e})")
        raise


@contextlib.contextmanager
def stopped_when_cancelled(console, every_s: float = 2.0):
    """A run cancelled on the server (the UI's Cancel, ``prefect flow-run cancel``, an automation of
    deployments/automations.yaml) stops as on Ctrl-C. Prefect stops a cancelled flow run only where a
    worker runs it; a command's own run in this process would go on, so a thread reads the state of
    its top-level runs every ``every_s`` and, once one is Cancelling, interrupts the main thread."""
    done = threading.Event()

    def watch() -> None:
        from prefect import get_client

        with get_client(sync_client=True) as client:
            while not done.wait(every_s):
                for run_id in list(console.runs):
                    try:
                        state = client.read_flow_run(run_id).state
                    except Exception:  # noqa: BLE001 - the server busy or gone: the run itself will say so
                        continue
                    if state is not None and state.is_cancelling():
                        console.say(f"cancelled on the Prefect server ({state.message or 'no reason given'}): stopping")
                        os.kill(os.getpid(), signal.SIGINT)
                        return

    # the thread reads the API this command's context points at (settings live in a context variable)
    threading.Thread(target=contextvars.copy_context().run, args=(watch,), daemon=True, name="yattflow-cancel-watch").start()
    try:
        yield
    finally:
        done.set()


async def _set_cancelled(run_ids: list[str]) -> None:
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId
    from prefect.states import Cancelled

    async with get_client() as client:
        while run_ids:
            parents = [await client.read_flow_run(run_id) for run_id in run_ids]
            for run in parents:
                if run.state is None or not run.state.is_final() or run.state.is_crashed():
                    await client.set_flow_run_state(run.id, Cancelled(message="stopped (Ctrl-C, SIGTERM or a cancel): the "
                                                                              "same command continues it"), force=True)
            children = await client.read_flow_runs(flow_run_filter=FlowRunFilter(
                parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[run.id for run in parents])))
            run_ids = [child.id for child in children]


# Errors whose message names what is wrong and what to change (the file and field, the URI, the setting): the
# console shows the message alone. The first group is about the run's input: the same command meets it again.
INPUT_ERRORS = {"ConfigError", "InputError", "SchemaError", "ImageError", "ChatTemplateError", "RewardRuleError",
                "NotARewardModel", "MappingError", "Unsupported"}
EXPECTED_ERRORS = INPUT_ERRORS | {"StorageError", "StorageIOError", "RunStateError", "RunInUse", "SFTNotConverged",
                                  "RMNotConverged", "WouldOverwrite", "NothingToLearn", "HostsFailed"}


def _remote(error: BaseException | None) -> tuple[str | None, str | None]:
    """The type name and message of the engine-host exception behind ``error`` (engines.wire.channel.HostError), if any."""
    seen = 0
    while error is not None and seen < 10:
        if getattr(error, "remote", (None, None))[0]:
            return error.remote
        error, seen = error.__cause__ or error.__context__, seen + 1
    return None, None


def expected_error(error: BaseException) -> bool:
    return (_remote(error)[0] or type(error).__name__) in EXPECTED_ERRORS


def input_error(error: BaseException) -> bool:
    return (_remote(error)[0] or type(error).__name__) in INPUT_ERRORS


def failure_cause(error: BaseException) -> str:
    """What went wrong, in a line: an expected error's own message (an engine host's included), else
    ``Type: message`` (the last line of a message that has several)."""
    kind, message = _remote(error)
    if kind is not None:
        return message if kind in EXPECTED_ERRORS else f"{kind}: {message}"
    lines = [line for line in str(error).splitlines() if line.strip()]
    if type(error).__name__ in EXPECTED_ERRORS:
        return " ".join(line.strip() for line in lines)
    return f"{type(error).__name__}: {lines[-1].strip()}" if lines else type(error).__name__


def where_it_stopped(config, fix_first: bool = False) -> str:
    """``stopped at step N of S; last checkpoint: step M; …`` from the run's committed state (steps 1-based).
    ``fix_first``: the run stopped on its input, which the same command would meet again.

    It reads what may have just failed (a damaged state.json, storage gone): never raises, and waits for an
    object store that does not answer for ``objectstore.ON_THE_WAY_OUT_S`` at most (a run that failed on it waited long enough)."""
    again = "fix that, then run the same command" if fix_first else "run the same command"
    from storage import objectstore
    from storage.runstate import RunState

    try:
        with objectstore.retry_at_most(objectstore.ON_THE_WAY_OUT_S):
            state = RunState.load(config.run_uri)
    except objectstore.StorageError as e:  # its own message (the errors behind it lead back to the command's own)
        return f"where the run stands is unknown: {' '.join(str(e).split())}"
    except Exception as e:  # noqa: BLE001 - the command's own error is what the person needs; this only adds to it
        return f"where the run stands is unknown: {failure_cause(e)}"
    if state is None:
        return f"stopped before run '{config.name}' took its first step; {again} to start it"
    curves = objectstore.join(config.run_uri, "curves.json")
    try:  # the live curves: the steps trained after the last checkpoint
        with objectstore.retry_at_most(objectstore.ON_THE_WAY_OUT_S):
            points = objectstore.read_json(curves).get("points", []) if objectstore.exists(curves) else []
        finished = max((p["step"] + 1 for p in points), default=0)
    except Exception:  # noqa: BLE001 - without them the last checkpoint is still known
        finished = state.step + 1
    checkpoint = f"step {state.step + 1}" if state.step >= 0 else "none yet (it starts from step 1)"
    return (f"stopped at step {min(finished + 1, config.steps)} of {config.steps}; last checkpoint: {checkpoint}; "
            f"{again} to continue")


def failed_line(command: str, error: BaseException, config, log_path: Path) -> str:
    """``yattflow train: <what went wrong>; <where the run stands> (log: <file>)``."""
    from storage.lease import RunInUse
    from storage.runstate import RunStateError

    # another run holds this one: where *it* stands is not this command's to report; an
    # unreadable state.json: the error already names the checkpoints that stand
    stopped = (f"; {where_it_stopped(config, fix_first=input_error(error))}" if command in ("train", "demo")
               and not isinstance(error, (RunInUse, RunStateError)) else "")
    failed = "" if expected_error(error) else "failed: "  # an expected error's message says what to do
    return f"yattflow {command}: {failed}{failure_cause(error)}{stopped} (log: {log_path})"
