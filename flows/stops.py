"""How a command's run ends, as a person reads it: the last line after a failure (the error's own
message when it says what to change; where the run stands; the log file), where a stopped run stands,
a run stopped on purpose marked Cancelled in the Prefect UI rather than Crashed, and a stop (Ctrl-C,
SIGTERM) that ends in bounded time (``StopSignals``)."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import contextvars
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import psutil

# A stopped command ends within STOP_GRACE_S + about 5 s of the signal, whatever its clean-up meets (StopSignals)
STOP_GRACE_S = 18.0  # for its own clean-up: hosts, the flows' last states, the temporary server; then it is cut short
EXIT_S = 3.0  # after its last line, for Python's own exit
SAME_STOP_S = 1.0  # a second signal this soon is the same stop: timeout(1) signals the command, then its process group
MARK_CANCELLED_S = 5.0  # to mark a stopped run's flow runs Cancelled in the UI
UNKNOWN_STOP = "yattflow: stopped; where the run stands is unknown (storage did not answer); run the same command to continue"


class StopSignals:
    """Ctrl-C and SIGTERM for one in-process command: they stop it, and it ends within
    ``grace_s`` + a few seconds, whatever its clean-up meets.

    The first signal interrupts the command as Ctrl-C does inside ``asyncio.run``: the command's main
    task (``cancellable``) is cancelled, so every flow unwinds at its next ``await`` (hosts stopped,
    lease released, the flow runs' last states reported) and ``asyncio.run`` raises CancelledError;
    outside one (a sync flow, the server's start) it raises KeyboardInterrupt. SIGTERM (what ``kill``,
    Kubernetes, Slurm and systemd send) does the same. Prefect's own SIGTERM handler (one per flow
    run, ``capture_sigterm`` in ``prefect.utilities.engine``) raises ``TerminationSignal`` wherever the
    main thread is, often inside the event loop's own code (a crash, exit 1, a traceback, no stop line),
    so Prefect gets this handler as its own (Prefect 3.8 looks the module attribute up each time a flow
    run starts; tests/test_stops.py stops runs with SIGTERM and fails if Prefect stops reading it).

    The clean-up talks to engine hosts, object storage and the Prefect server, each of which may be
    slow or gone (a loaded machine; Prefect's client retries a lost server for a minute a call). So a
    watchdog bounds it: ``grace_s`` after the first signal, at once on a second Ctrl-C, or ``EXIT_S``
    after the command's last line (``say_last``), it kills every process the command started that
    still runs (each engine host with its process group; the Prefect server last), writes
    ``last_line()`` unless the command has, and ends the process with status 130. It stays armed after
    ``with`` ends: a stopped command's process ends (Prefect's exit hooks wait on whatever server they
    had), and skips the modules' teardown at exit."""

    def __init__(self, last_line: Callable[[], str], log_path: Path | None = None, grace_s: float = STOP_GRACE_S):
        self.last_line, self.log_path, self.grace_s = last_line, log_path, grace_s
        self.first: float | None = None  # time.monotonic() of the first signal
        self._cut_short = threading.Event()  # a second Ctrl-C: the watchdog does not wait
        self._said = threading.Lock()  # held by whoever writes the last line
        self._said_at: float | None = None  # time.monotonic() of the last line
        self._task: asyncio.Task | None = None
        self._previous: dict = {}
        self._handler = self._on_signal  # one object: Prefect checks that its handler `is` the one installed

    def __enter__(self) -> "StopSignals":
        import prefect.utilities.engine as prefect_engine

        self._prefect = prefect_engine._prefect_sigterm_handler
        prefect_engine._prefect_sigterm_handler = self._handler
        self._previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._handler)
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where it is ignored (a background job)
            self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        import prefect.utilities.engine as prefect_engine

        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        prefect_engine._prefect_sigterm_handler = self._prefect

    async def cancellable(self, coro):
        """``asyncio.run(stop.cancellable(flow(...)))``: the task a signal cancels."""
        self._task = asyncio.current_task()
        try:
            return await coro
        finally:
            self._task = None

    def say_last(self, line: str) -> None:
        """The command's last line (where it stopped), after an empty one, written once: by the command
        or by the watchdog."""
        if self._said.acquire(blocking=False):
            print(f"\n{line}", file=sys.stderr, flush=True)
            self._said_at = time.monotonic()

    def _on_signal(self, signum, frame) -> None:
        now = time.monotonic()
        if self.first is not None:  # already stopping: a second Ctrl-C cuts the clean-up short
            if now - self.first > SAME_STOP_S:
                self._cut_short.set()
            return
        self.first = now
        threading.Thread(target=self._watchdog, name="yattflow-stop-watchdog", daemon=True).start()
        atexit.register(self._exit_now)
        task = self._task
        if task is not None and not task.done():  # as asyncio.run's own SIGINT handler does
            task.cancel()
            task.get_loop().call_soon_threadsafe(lambda: None)  # wake a loop that waits in select()
            return
        raise KeyboardInterrupt

    @staticmethod
    def _exit_now() -> None:
        """At exit, once stopped: skip the modules' teardown (3-7 s on a loaded 2-core machine, where no
        thread can cut it short any more)."""
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(130)

    def _watchdog(self) -> None:
        deadline = self.first + self.grace_s
        while time.monotonic() < deadline and not self._cut_short.wait(0.1):
            if self._said_at is not None:
                deadline = min(deadline, self._said_at + EXIT_S)
        killed = kill_started_processes()
        if self._said_at is None or killed:
            if self._cut_short.is_set():
                why = "a second Ctrl-C"
            elif self._said_at is None:
                why = f"its clean-up was not done {self.grace_s:.0f}s after the signal"
            else:
                why = f"still running {EXIT_S:.0f}s after its last line"
            self._note(f"stopping: {why}; killed {', '.join(killed) or 'nothing'} and ended the command")
        if self._said.acquire(blocking=False):
            line: list[str] = []  # where the run stands: from storage, which may not answer either
            reader = threading.Thread(target=lambda: line.append(self.last_line()), daemon=True)
            reader.start()
            reader.join(5)
            os.write(2, f"\n{line[0] if line else UNKNOWN_STOP}\n".encode())  # no lock to wait on
        os._exit(130)  # (the console's lines were flushed as they were printed)

    def _note(self, line: str) -> None:
        """A line for the command's log file only (the console shows the stop line alone)."""
        if self.log_path is None:
            return
        try:
            with open(self.log_path, "a", encoding="utf-8") as log:
                log.write(f"{time.strftime('%H:%M:%S')} | WARNING | yattflow - {line}\n")
        except OSError:
            pass


def kill_started_processes(server_stop_s: float = 2.0) -> list[str]:
    """SIGKILL every process this one started that still runs, each engine host with its process group
    (its engines' processes); the Prefect server it started (``flows/prefect_server.py``) last, after
    ``server_stop_s`` to stop on SIGINT. Returns what it stopped, as ``engines.host (pid 123)``."""
    children = psutil.Process().children()
    servers = [p for p in children if "flows.prefect_server" in _cmdline(p)]
    others = [p for p in children if p not in servers]
    others += [c for p in others for c in _descendants(p)]
    stopped = [f"{_cmdline(p).split(' -m ')[-1].split(' ')[0]} (pid {p.pid})" for p in others + servers]
    for p in others:
        _kill(p)
    for s in servers:
        with contextlib.suppress(psutil.Error):
            s.send_signal(signal.SIGINT)
    psutil.wait_procs(servers, timeout=server_stop_s)
    for s in servers:
        _kill(s)
    return stopped


def _kill(p: psutil.Process) -> None:
    """SIGKILL ``p``, with its process group where it leads one (engine hosts, the Prefect server)."""
    try:
        if os.getpgid(p.pid) == p.pid:
            os.killpg(p.pid, signal.SIGKILL)
        else:
            os.kill(p.pid, signal.SIGKILL)
    except OSError:  # gone already
        pass


def _cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:  # gone meanwhile
        return ""


def _descendants(p: psutil.Process) -> list[psutil.Process]:
    try:
        return p.children(recursive=True)
    except psutil.Error:  # gone meanwhile
        return []


@contextlib.contextmanager
def cancelled_when_stopped(console):
    """A run stopped on purpose (Ctrl-C, SIGTERM) is Cancelled in the UI, not Crashed: Prefect ends a
    flow run that a KeyboardInterrupt unwinds as Crashed; its top-level runs (the ones the console
    links) and their sub-flows are set Cancelled here, while the server still answers."""
    try:
        yield
    except (KeyboardInterrupt, asyncio.CancelledError):
        try:  # bounded: a server too slow for it leaves the runs Crashed (a stop is bounded: StopSignals)
            asyncio.run(asyncio.wait_for(_set_cancelled(list(console.runs)), MARK_CANCELLED_S))
        except Exception as e:  # noqa: BLE001 - the stop line matters more than the UI's word for it (log file only)
            logging.getLogger("yattflow").info("could not mark the stopped run Cancelled in the UI: %s: %s",
                                               type(e).__name__, e)
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
                        os.kill(os.getpid(), signal.SIGTERM)  # as a stop (SIGINT may be ignored: a background job)
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
                "RuleTimeout", "EnvError", "NotARewardModel", "MappingError", "Unsupported"}
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
