"""``prefect server start``, with SQLite writes that wait their turn instead of failing.

    python -m flows.prefect_server server start --host 127.0.0.1 --port 4200

Prefect's server (3.8) opens its SQLite write transactions DEFERRED: a request that reads and
then writes fails at once with "database is locked" when another writer committed in between
(SQLite cannot move a stale read snapshot forward, and does not wait for it), the server
answers 503, and Prefect's client retries after 2 s. On a local run that happened at almost
every RL step: the next iteration's sub-flow is created (``POST /task_runs/``) just as the
server's task-run recorder writes the states of the step's last tasks. Measured on a 2-core
AMD EPYC, dp=1, the tiny test config: 2.3–3.0 s per step, of which 0.1–0.3 s in the engines;
with immediate write transactions 0.4–0.6 s, and no retries.

``BEGIN IMMEDIATE`` takes SQLite's write lock before the transaction reads, so a second writer
waits for it (the server's busy timeout is 60 s) rather than failing; Prefect's own comment in
``AioSqliteConfiguration.setup_sqlite`` names this fix. Reads outside write transactions are
untouched, and so is PostgreSQL. yattflow starts every Prefect server it runs through this
module: ``yattflow server``, and the temporary server of ``yattflow prepare | train | demo``
when no ``PREFECT_API_URL`` is set.

The rest of this module starts and stops those servers for the CLI (``flows/cli.py``): the
settings they run with, a start that waits until the server answers (one at a time per
``PREFECT_HOME``), the temporary server of an in-process command, and pointing this process's
Prefect client at a server.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import asynccontextmanager
from pathlib import Path

DEFAULT_PORT = 4200  # `yattflow server`'s, and so the UI the embedded default's links point at
PR_SET_PDEATHSIG = 1  # prctl(2): the signal a child gets when its parent dies
# Settings `yattflow server` and the temporary server start Prefect's server with (the environment
# overrides each). By default the server's task-run recorder writes every task-run event in a
# transaction of its own; batched, task states reach the database within a second. The interval
# must be a whole number of seconds: Prefect 3.8 passes int(flush_interval) to its flush loop, so
# 0.5 became a loop that never sleeps and kept one CPU core busy for the server's whole life
# (on a 2-core machine, half of what the engines had).
SERVER_SETTINGS = {"PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE": "100",
                   "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL": "1"}
# The temporary server lives for one command's own flow run, with no UI, worker or deployment
# runs: it keeps the services that record that run (the task-run recorder: every stage's state is
# in the database for a later `yattflow server` on this PREFECT_HOME; cancellation clean-up) and
# switches off the rest (the event feed, automations, schedules, ...). On a 2-core machine the
# server took 0.27 s of CPU per demo-size RL step, beside the engines; without these services
# Prefect's floor for an iteration at dp=1 went from 264 to 223 ms (docs/deployments.md).
TEMPORARY_SERVER_SETTINGS = SERVER_SETTINGS | {
    f"PREFECT_SERVER_SERVICES_{service}_ENABLED": "false"
    for service in ("EVENT_PERSISTER", "TRIGGERS", "EVENT_LOGGER", "SCHEDULER", "LATE_RUNS", "FOREMAN",
                    "PAUSE_EXPIRATIONS", "REPOSSESSOR", "DB_VACUUM", "CLEANUP_RECONCILER")}
TEMPORARY_STOP_S = 5.0  # the temporary server's time to stop on SIGINT, then it is killed


def server_process(port: int, env: dict, log, host: str = "127.0.0.1") -> subprocess.Popen:
    """``prefect server start`` with immediate SQLite write transactions (``flows/prefect_server.py``)
    on ``host:port``, its output to ``log``. It ends with this process: a parent that dies (even of
    SIGKILL) takes its server with it (Linux). Its own session: a terminal's Ctrl-C and ``timeout``'s
    SIGTERM go to a command's whole process group, and took the server away while the run still
    reported its last states (then every Prefect call retried the lost server for a minute); the
    command stops its server itself, last (``stop``)."""

    def die_with_parent() -> None:
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        except OSError:  # not Linux: the server outlives a killed parent, as Prefect's own would
            pass

    return subprocess.Popen([sys.executable, "-m", "flows.prefect_server", "server", "start", "--host", host, "--port", str(port)],
                            env=env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent,
                            start_new_session=True)


def started_server(env: dict, log_path: Path, name: str, port: int | None = None) -> tuple[subprocess.Popen, str]:
    """``server_process`` on 127.0.0.1:``port`` (None: a free one), and its API URL, once it
    answers; RuntimeError naming its log if it does not.

    One start at a time per PREFECT_HOME (an exclusive ``flock`` on a file there): a server's start
    migrates the database in PREFECT_HOME, and two first commands started together both ran the
    migration, and one failed (alembic: "expected to match one row"). The next start waits for the
    one before to answer; by then the database is migrated. (A free port is chosen after the wait,
    so that nothing else has taken it meanwhile.)"""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path.parent / "yattflow-server-start.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if port is None:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        url = f"http://127.0.0.1:{port}/api"
        # the UI asks the API at PREFECT_UI_API_URL, which otherwise names the default port 4200 whatever port it serves on
        env = {"PREFECT_UI_API_URL": url, **env}
        with open(log_path, "ab") as log:
            proc = server_process(port, env, log)
        try:
            deadline = time.time() + 120
            while not healthy(url):
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"{name} did not start; see {log_path}")
                time.sleep(0.25)
        except BaseException:
            stop(proc, name)
            raise
    return proc, url


@contextlib.contextmanager
def local_api():
    """The Prefect API for an in-process command: ``PREFECT_API_URL`` when one is set (environment or
    profile), else a temporary server on a free loopback port for this command alone (no UI; its
    log: ``$PREFECT_HOME/yattflow-temporary-server.log``)."""
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    if settings.api.url:
        yield settings.api.url
        return
    log_path = Path(settings.home) / "yattflow-temporary-server.log"
    # its UI on: the run's page is live while the command runs (flows/console.py prints the link)
    proc, url = started_server({**TEMPORARY_SERVER_SETTINGS, **os.environ}, log_path, "the temporary Prefect server")
    try:
        with use_api(url):
            try:
                yield url
            finally:  # the last log lines and events, while the server still listens
                from prefect.events.worker import EventsWorker
                from prefect.logging.handlers import APILogWorker

                APILogWorker.drain_all(timeout=5)
                EventsWorker.drain_all(timeout=5)
    finally:  # last: after the flows' last states and the hosts (flows/stops.py bounds the whole stop)
        if stop(proc, "the temporary Prefect server", TEMPORARY_STOP_S, say=False):
            with open(log_path, "a") as log:
                log.write(f"yattflow: the temporary Prefect server did not stop in {TEMPORARY_STOP_S:.0f}s; killed it\n")
        os.environ.pop("PREFECT_API_URL", None)


def use_api(url: str):
    """Point ``prefect`` subprocesses (environment) and this process's client (settings, read once
    at import: without this a client would start an ephemeral server) at ``url``."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    os.environ["PREFECT_API_URL"] = url
    return temporary_settings({PREFECT_API_URL: url})


def healthy(api_url: str) -> bool:
    try:
        urllib.request.urlopen(f"{api_url}/health", timeout=2)
        return True
    except OSError:
        return False


def stop(proc: subprocess.Popen, name: str, timeout: float = 20, say: bool = True) -> bool:
    """SIGINT first (a Prefect worker exits promptly on it, not on SIGTERM), then SIGKILL (a server with
    its process group); True when it had to be killed (``say``: saying so on stderr)."""
    if proc.poll() is not None:
        return False
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=timeout)
        return False
    except subprocess.TimeoutExpired:
        if say:
            print(f"yattflow: {name} did not stop in {timeout:.0f}s; killing it", file=sys.stderr)
        with contextlib.suppress(OSError):
            if os.getpgid(proc.pid) == proc.pid:
                os.killpg(proc.pid, signal.SIGKILL)
        proc.kill()
        proc.wait()
        return True



def immediate_sqlite_writes() -> None:
    """Open every SQLite write transaction of this process's Prefect server with BEGIN IMMEDIATE."""
    from prefect.server.database.configurations import SQLITE_BEGIN_MODE, AioSqliteConfiguration

    @asynccontextmanager
    async def begin_transaction(self, session, with_for_update: bool = False):
        token = SQLITE_BEGIN_MODE.set("IMMEDIATE")
        try:
            async with session.begin() as transaction:
                yield transaction
        finally:
            SQLITE_BEGIN_MODE.reset(token)

    AioSqliteConfiguration.begin_transaction = begin_transaction


def main() -> None:
    immediate_sqlite_writes()
    from prefect.cli import app

    sys.argv[0] = "prefect"
    app()


if __name__ == "__main__":
    main()
