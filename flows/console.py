"""What a person sees of ``yattflow train | demo | sft | prepare``: a live progress display, and a link
to each run's page in the Prefect UI, instead of Prefect's log lines.

    train demo ━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━ 12/40 steps 0:00:25 elapsed 0:00:58 left reward 0.512, ...

The flows say what the console shows in their own log records (``logger.info(..., extra=shown(...))``):
``start`` a bar (what runs, for which run, steps done of a total), ``advance`` it (steps done, that
step's figures), ``finish`` it, or print the record's line (``note``: a held-out figure). The records go to the Prefect UI and to the command's log
file as every other one; on the console only the display shows them. Prefect's own lines (every
task's and sub-flow's start, end and "View at" link) go to the log file and the UI only, unless
``--verbose``; warnings and errors print their first line (``Brief``: no traceback; the log file has them whole), and
Prefect's repeats of a failure's exception stay in the log file. When the output is not a terminal (CI, a
file), each advance is one plain line (``train step 12/40 reward ... (demo: 0:00:25 elapsed, ~0:00:58 left)``).

Each top-level flow run's page is printed when it starts and again at the end: on the server
``PREFECT_API_URL`` names, or, with the embedded default (a temporary server on the SQLite database
in ``PREFECT_HOME``), on the server ``yattflow server`` starts on that database afterwards.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from datetime import timedelta
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from flows.curves import percent

RECORD_FIELD = "yattflow_console"  # the LogRecord attribute that carries what the console shows


def shown(kind: str, **fields) -> dict:
    """``extra`` for a log call that the console shows: ``start`` a bar (name: what runs, e.g. train or
    sft-policy; run: the run's name; done, total; say: print the record's line too), ``advance`` it (name, run, done, total, figures:
    that step's), ``finish`` it (name, run, done) and print the record's line, or only print it (``note``)."""
    return {RECORD_FIELD: {"kind": kind, **fields}}


def ui_link(ui_base: str, flow_run_id: str) -> str:
    return f"{ui_base.rstrip('/')}/runs/flow-run/{flow_run_id}"


class Brief(logging.Formatter):
    """A warning or an error on the console without ``--verbose``: its first line, no traceback; the
    log file has it in full (its handler formats the record itself: the record is not changed)."""

    WIDTH = 300  # characters of a line: a failed state's message repeats the whole error

    def __init__(self, inner: logging.Formatter | None, log_path: Path):
        super().__init__()
        self.inner, self.log_path = inner or logging.Formatter(), log_path

    def format(self, record: logging.LogRecord) -> str:
        brief = logging.makeLogRecord(record.__dict__)
        lines = record.getMessage().splitlines() or [""]
        more = len(lines) > 1 or record.exc_info is not None or len(lines[0]) > self.WIDTH
        first = lines[0] if len(lines[0]) <= self.WIDTH else lines[0][: self.WIDTH] + "…"
        brief.msg, brief.args = first + (f" (in full: {self.log_path})" if more else ""), None
        brief.exc_info = brief.exc_text = brief.stack_info = None
        return self.inner.format(brief)


# Prefect's lines that only repeat a failure's exception, which the command's last line states (or call a
# deliberate stop a crash: the command says where the run stopped, and the run is marked Cancelled)
REPEATS = ("Task run failed with exception", "Finished in state Failed", "Encountered exception during execution",
           "Crash detected!", "Finished in state Crashed", "Finished in state Cancelled")


def no_repeats(record: logging.LogRecord) -> bool:
    """The console without ``--verbose``: Prefect's repeats of an exception left to the log file."""
    return not (record.name.startswith("prefect") and record.getMessage().startswith(REPEATS))


class RunConsole(logging.Handler):
    """The console of one in-process command, from ``with`` to its end: the progress display (or
    plain lines), Prefect's console output down to warnings (unless ``verbose``), every Prefect
    record in ``log_path``, and the UI links of the top-level flow runs.

    ``ui_base``: the UI the links point at; ``serve``: the command that serves it once this one has
    ended (the embedded default), or None (a server of the user's)."""

    def __init__(self, log_path: Path, ui_base: str, serve: str | None, verbose: bool = False,
                 console: Console | None = None):
        super().__init__(level=logging.INFO)
        self.log_path, self.ui_base, self.serve, self.verbose = log_path, ui_base, serve, verbose
        self.console = console or Console()
        self.live = self.console.is_terminal
        self.runs: dict[str, str] = {}  # top-level flow run id -> its name, in the order they started
        self.bars: dict[str, dict] = {}  # label -> the bar's task id, its start, the steps done when it started
        self.progress: Progress | None = None
        self._lock = threading.RLock()
        self._restore: list = []
        self.last_said: str | None = None
        self.live_base: str | None = None  # the temporary server's UI while the command runs (``serving``)

    # ------------------------------------------------------------------ setup
    def __enter__(self) -> "RunConsole":
        from prefect.logging.handlers import PrefectConsoleHandler

        root = logging.getLogger()
        consoles = [h for h in root.handlers if isinstance(h, PrefectConsoleHandler)]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.file = logging.FileHandler(self.log_path, encoding="utf-8")
        self.file.setLevel(logging.INFO)
        if consoles and consoles[0].formatter is not None:
            self.file.setFormatter(consoles[0].formatter)  # Prefect's: flow and task run names on each line
        for handler in consoles:
            self._restore.append((handler, handler.level, handler.console, handler.formatter))
            if not self.verbose:
                handler.setLevel(logging.WARNING)
                handler.setFormatter(Brief(handler.formatter, self.log_path))
                handler.addFilter(no_repeats)
            if self.live:  # the display's console: it prints the line above itself (rich bypasses a redirected stderr)
                handler.console = self.console
        root.addHandler(self.file)
        root.addHandler(self)
        self.say(f"log: {self.log_path}" + ("" if self.verbose else " (Prefect's task and flow lines; --verbose shows them here)"))
        if self.live:
            self.progress = Progress(
                TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("steps"),
                TimeElapsedColumn(), TextColumn("elapsed"), TimeRemainingColumn(), TextColumn("left"),
                TextColumn("{task.fields[figures]}"), console=self.console, redirect_stdout=True, redirect_stderr=True)
            self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        root = logging.getLogger()
        root.removeHandler(self)
        if self.progress is not None:
            self.progress.stop()
        for handler, level, console, formatter in self._restore:
            handler.setLevel(level)
            handler.console = console
            handler.setFormatter(formatter)
            handler.removeFilter(no_repeats)
        root.removeHandler(self.file)
        self.file.close()
        self.live_base = None  # the temporary server has stopped: the links name the one that serves them later
        for run_id, name in self.runs.items():  # again, below what the run printed (unless it printed nothing)
            if self.link_line(name, run_id) != self.last_said:
                self.say(self.link_line(name, run_id))

    def say(self, line: str) -> None:
        """A line of its own, never wrapped (a link stays whole): above the display, or on stdout."""
        self.last_said = line
        if self.progress is not None:
            self.progress.console.print(line, highlight=False, markup=False, soft_wrap=True)
        else:
            print(line, flush=True)

    def serving(self, api_url: str) -> None:
        """The command's temporary Prefect server answers at ``api_url`` (the embedded default): until the
        command ends, links point at its UI; afterwards at ``ui_base``, which ``serve`` serves."""
        if self.serve is not None:
            self.live_base = api_url.removesuffix("/api")

    def link_line(self, name: str, run_id: str) -> str:
        link = ui_link(self.ui_base, run_id)
        if self.serve is None:
            return f"{name} in the Prefect UI: {link}"
        if self.live_base is not None:
            return (f"{name} in the Prefect UI: {ui_link(self.live_base, run_id)} (live while this command runs; afterwards "
                    f"{link}, served by: {self.serve})")
        return f"{name} in the Prefect UI: {link} (once this command has ended, serve it with: {self.serve})"

    # -------------------------------------------------------------- records
    def emit(self, record: logging.LogRecord) -> None:
        try:
            with self._lock:
                self._top_level_run(record)
                what = getattr(record, RECORD_FIELD, None)
                if what is not None:
                    getattr(self, f"_{what['kind']}")(what, record)
        except Exception:  # noqa: BLE001 - the console never stops a run
            self.handleError(record)

    def _top_level_run(self, record: logging.LogRecord) -> None:
        """The first record of a flow run that no task started: print its page."""
        run_id = getattr(record, "flow_run_id", None)
        if run_id is None or str(run_id) in self.runs:
            return
        from prefect.context import FlowRunContext

        context = FlowRunContext.get()
        if context is None or context.flow_run is None or str(context.flow_run.id) != str(run_id):
            return
        if context.flow_run.parent_task_run_id is None:
            self.runs[str(run_id)] = context.flow_run.name
            self.say(self.link_line(context.flow_run.name, str(run_id)))

    def _start(self, what: dict, record=None) -> None:
        label, done, total = f"{what['name']} {what['run']}", what.get("done", 0), what["total"]
        bar = self.bars.get(label)
        if self.progress is not None:
            if bar is not None:
                self.progress.remove_task(bar["task"])
            task = self.progress.add_task(label, total=total, completed=done, figures="")
        else:
            task = None
        self.bars[label] = {"task": task, "began": time.monotonic(), "first": done}
        if what.get("say"):
            self.say(record.getMessage())

    def _advance(self, what: dict, record=None) -> None:
        label, done, total, figures = f"{what['name']} {what['run']}", what["done"], what["total"], what.get("figures", "")
        if label not in self.bars:
            self._start(what | {"done": max(done - 1, 0)})
        bar = self.bars[label]
        if self.progress is not None:
            self.progress.update(bar["task"], completed=done, total=total, figures=figures)
            return
        elapsed = time.monotonic() - bar["began"]
        moved = done - bar["first"]
        left = f", ~{_clock(elapsed / moved * (total - done))} left" if moved > 0 and done < total else ""
        print(f"{what['name']} step {done}/{total} {figures} ({what['run']}: {_clock(elapsed)} elapsed{left})", flush=True)

    def _finish(self, what: dict, record: logging.LogRecord) -> None:
        """The bar full at ``done`` steps (an SFT that reached its target early), and the record's line."""
        bar = self.bars.get(f"{what['name']} {what['run']}")
        if bar is not None and self.progress is not None:
            self.progress.update(bar["task"], completed=what["done"], total=what["done"])
        self._note(what, record)

    def _note(self, what: dict, record: logging.LogRecord) -> None:
        self.say(record.getMessage())


def _clock(seconds: float) -> str:
    return str(timedelta(seconds=round(seconds)))


def log_path(storage_root: str, name: str, command: str) -> Path:
    """Where a command's Prefect records go: ``<storage root>/logs/<name>-<command>.log`` when the
    root is a local folder, else ``$PREFECT_HOME/yattflow-logs/`` (the object store is not appended to)."""
    from storage import objectstore

    root = objectstore.normalize(storage_root)
    if objectstore.is_local(root):
        folder = Path(objectstore.fs_for(root)[1]) / "logs"
    else:
        from prefect.settings import get_current_settings  # (here: a second of imports the command's pre-flight spares)

        folder = Path(get_current_settings().home) / "yattflow-logs"
    return folder / f"{name}-{command}.log"


def ui_of_command() -> tuple[str, str | None]:
    """(the UI the links point at, the command that serves it afterwards or None): the server of
    ``PREFECT_API_URL``; else the embedded default, served later by ``yattflow server`` on the same
    ``PREFECT_HOME``."""
    from prefect.settings import get_current_settings

    from flows.prefect_server import DEFAULT_PORT

    settings = get_current_settings()
    if settings.api.url:
        return settings.ui_url or settings.api.url.removesuffix("/api"), None
    home = f"PREFECT_HOME={os.environ['PREFECT_HOME']} " if os.environ.get("PREFECT_HOME") else ""
    return f"http://127.0.0.1:{DEFAULT_PORT}", f"{home}yattflow server"


def step_figures(metrics) -> str:
    """What the console shows of a step (``flows.metrics.StepMetrics``): ``reward 0.512, accuracy 48.4%, kept 3, dropped 1, 2.1s``."""
    e = metrics.episodes  # multi-turn episodes: ``2.1 turns, 1.4 calls (0.1 errors, 0.3s), 5% cut``
    turns = (f"{e['turns']:.1f} turns, {e['tool_calls']:.1f} calls ({e['tool_errors']:.1f} errors, {e['tool_s']:.2f}s), "
             f"{e['truncated']:.0%} cut, ") if e else ""
    return (f"reward {metrics.reward:.3f}, accuracy {percent(metrics.accuracy)}, kept {metrics.kept_groups}, "
            f"dropped {metrics.dropped_groups}, {turns}{metrics.step_s:.1f}s")
