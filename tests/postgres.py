"""Throwaway PostgreSQL clusters and real ``prefect server`` processes for tests and benchmarks.

    with postgres_cluster() as db_url:               # postgresql+asyncpg://postgres@127.0.0.1:PORT/prefect
        with prefect_server(db_url) as api_url:      # http://127.0.0.1:PORT/api, backed by that database
            summary = run_flow_subprocess(api_url, "flows.training:train", overrides=[...])
    with prefect_server() as api_url: ...            # the same on SQLite, in a temporary PREFECT_HOME

The cluster is PostgreSQL from the Debian package ``postgresql`` (binaries in
``/usr/lib/postgresql/<version>/bin``; ``PG_BIN`` overrides). ``initdb`` writes into a fresh
temporary folder, the server listens on a free loopback port (and a Unix socket in that
folder, never ``/var/run/postgresql``), authentication is ``trust`` (loopback only), and a
database ``prefect`` is created; on exit the cluster is stopped and its folder removed.
PostgreSQL refuses to run as root: as root, every PostgreSQL binary runs as the ``postgres``
system user the Debian package creates (``runuser -u postgres --``), and the folder is
chowned to it; as any other user the binaries run as that user. Without the binaries (or,
as root, without a ``postgres`` user) the helpers raise :class:`PostgresUnavailable`, which
tests turn into a skip with the reason.

Flows run by :func:`run_flow_subprocess` go to the given server through a fresh process
with ``PREFECT_API_URL`` set: in a process that has already talked to another server,
``temporary_settings`` re-points flow runs and logs but not Prefect's process-wide events
worker, and task-run states travel as events (see tests/test_postgres.py).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Iterator

from tests.helpers import free_port

ROOT = Path(__file__).resolve().parents[1]

# Durability of a scratch database: no fsync at all. ``--durable`` in bench/overhead.py keeps
# fsync and only relaxes commit flushing, like the SQLite server's WAL + synchronous=NORMAL.
SCRATCH_SETTINGS = {"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off"}


class PostgresUnavailable(RuntimeError):
    """No PostgreSQL binaries here (or no unprivileged user to run them): skip, do not fail."""


def pg_bindir() -> Path:
    """The folder holding ``initdb`` and ``pg_ctl``: ``$PG_BIN``, ``pg_config --bindir``, or the
    newest ``/usr/lib/postgresql/*/bin`` (Debian keeps them off PATH)."""
    candidates = [os.environ.get("PG_BIN", "")]
    if shutil.which("pg_config"):
        out = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True)
        candidates.append(out.stdout.strip())
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(Path(p).parent.name) if Path(p).parent.name.isdigit() else 0)
    candidates += reversed(versions)
    for folder in filter(None, candidates):
        if (Path(folder) / "initdb").is_file() and (Path(folder) / "pg_ctl").is_file():
            return Path(folder)
    raise PostgresUnavailable("PostgreSQL binaries not found (install the Debian package `postgresql`, or set PG_BIN)")


def _as_db_user() -> tuple[list[str], str | None]:
    """(command prefix, user to own the data folder): PostgreSQL will not run as root."""
    if os.geteuid() != 0:
        return [], None
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        raise PostgresUnavailable("running as root and there is no `postgres` user to run PostgreSQL as") from None
    runuser = shutil.which("runuser") or "/usr/sbin/runuser"
    return [runuser, "-u", "postgres", "--"], "postgres"


class PostgresCluster:
    """One ``initdb``'d cluster in a temporary folder; ``start()`` / ``stop()`` (also a context manager)."""

    def __init__(self, database: str = "prefect", settings: dict[str, str] | None = None):
        self.bindir = pg_bindir()
        self.prefix, self.owner = _as_db_user()
        self.database = database
        self.settings = dict(SCRATCH_SETTINGS if settings is None else settings)
        self.folder: Path | None = None
        self.port: int | None = None
        self.started = False

    @property
    def url(self) -> str:
        """SQLAlchemy URL for Prefect: ``PREFECT_API_DATABASE_CONNECTION_URL``."""
        return f"postgresql+asyncpg://postgres@127.0.0.1:{self.port}/{self.database}"

    @property
    def log_path(self) -> Path:
        return self.folder / "postgres.log"

    def _run(self, *args: str, timeout: float = 60) -> None:
        cmd = [*self.prefix, str(self.bindir / args[0]), *args[1:]]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=self.folder)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout}{done.stderr}\n{self.log_tail()}")

    def start(self, attempts: int = 3) -> "PostgresCluster":
        self.folder = Path(tempfile.mkdtemp(prefix="yattflow-pg-"))  # short: the socket path must fit 107 bytes
        if self.owner:
            shutil.chown(self.folder, self.owner, self.owner)
        try:
            self._run("initdb", "-D", str(self.folder / "data"), "-U", "postgres", "--auth=trust", "--no-sync",
                      "-E", "UTF8", "--locale=C.UTF-8", "--no-instructions")
            for attempt in range(attempts):  # a free port can be taken between choosing and binding
                self.port = free_port()
                options = [f"-p {self.port}", "-c listen_addresses=127.0.0.1", f"-k {self.folder}",
                           *(f"-c {k}={v}" for k, v in self.settings.items())]
                try:
                    self._run("pg_ctl", "-D", str(self.folder / "data"), "-l", str(self.log_path), "-w", "-t", "60",
                              "-o", " ".join(options), "start", timeout=90)
                    break
                except RuntimeError:
                    if attempt == attempts - 1:
                        raise
            self.started = True
            self._run("createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", self.database)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.folder is None:
            return
        if self.started:
            try:
                self._run("pg_ctl", "-D", str(self.folder / "data"), "-m", "fast", "-w", "-t", "30", "stop", timeout=60)
            except (RuntimeError, subprocess.TimeoutExpired):
                self._run("pg_ctl", "-D", str(self.folder / "data"), "-m", "immediate", "-w", "stop", timeout=60)
            self.started = False
        shutil.rmtree(self.folder, ignore_errors=True)
        self.folder = None

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except (OSError, TypeError):
            return ""

    def __enter__(self) -> "PostgresCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@contextlib.contextmanager
def postgres_cluster(database: str = "prefect", settings: dict[str, str] | None = None) -> Iterator[str]:
    """A running throwaway cluster; yields its ``postgresql+asyncpg://`` URL."""
    with PostgresCluster(database, settings) as cluster:
        yield cluster.url


# --------------------------------------------------------------------------- prefect server


def server_env(home: Path, database_url: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API_")}  # no client URL, no inherited DB
    # Log the SQLite lock errors it answers 503 to (Prefect 3.8 hides them by default; each one
    # sends the client into a ~2 s back-off): the server log then shows what the time went on.
    env.update(PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_SERVER_LOG_RETRYABLE_ERRORS="true")
    if database_url:
        env["PREFECT_API_DATABASE_CONNECTION_URL"] = database_url
    return env


class PrefectServer:
    """``prefect server start`` on a free loopback port, in its own process group.

    ``database_url``: ``PREFECT_API_DATABASE_CONNECTION_URL`` (e.g. a :class:`PostgresCluster`'s
    ``url``); None: Prefect's default SQLite database in ``home``. ``home`` is ``PREFECT_HOME``
    (a temporary folder, removed on stop, unless given); its ``server.log`` has the output.
    ``env``: more server settings (``PREFECT_SERVER_...``)."""

    def __init__(self, database_url: str | None = None, home: str | Path | None = None, ui: bool = False,
                 env: dict[str, str] | None = None, host: str = "127.0.0.1"):
        self.database_url, self.ui, self.env, self.host = database_url, ui, env or {}, host
        self._made_home = home is None
        self.home = Path(tempfile.mkdtemp(prefix="yattflow-prefect-")) if home is None else Path(home)
        self.port: int | None = None
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/api"

    @property
    def log_path(self) -> Path:
        return self.home / "server.log"

    def start(self, timeout: float = 120) -> "PrefectServer":
        self.home.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        cmd = [sys.executable, "-m", "prefect", "server", "start", "--host", self.host, "--port", str(self.port),
               "--ui" if self.ui else "--no-ui"]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, env=server_env(self.home, self.database_url) | self.env, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            try:
                urllib.request.urlopen(f"{self.url}/health", timeout=2)
                return self
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    tail = self.log_path.read_text(errors="replace")[-3000:]
                    self.stop()
                    raise RuntimeError(f"prefect server did not start (exit code {self.proc.poll()}):\n{tail}") from None
                time.sleep(0.3)

    def stop(self) -> None:
        if self.proc is not None:
            _stop_group(self.proc)
            self.proc = None
        if self._made_home:
            shutil.rmtree(self.home, ignore_errors=True)

    def __enter__(self) -> "PrefectServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@contextlib.contextmanager
def prefect_server(database_url: str | None = None, home: str | Path | None = None, ui: bool = False) -> Iterator[str]:
    """A running :class:`PrefectServer`; yields its API URL (``http://127.0.0.1:PORT/api``)."""
    with PrefectServer(database_url, home, ui) as server:
        yield server.url


def _stop_group(proc: subprocess.Popen, timeout: float = 15) -> None:
    """Stop the server and anything it started (its own session/process group, by id)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # stragglers of the group (the leader may be gone already)
    proc.wait()


# --------------------------------------------------------------------------- flows, elsewhere

_RUNNER = """
import asyncio, importlib, inspect, json, sys
module, _, name = sys.argv[1].partition(":")
fn = getattr(importlib.import_module(module), name)
result = fn(**json.loads(sys.argv[2]))
if inspect.isawaitable(result):
    result = asyncio.run(result)
with open(sys.argv[3], "w") as f:
    json.dump(result, f, default=str)
"""


def run_flow_subprocess(api_url: str, target: str, timeout: float = 1800, env: dict[str, str] | None = None,
                        log_path: str | Path | None = None, prefix: list[str] | None = None, **kwargs) -> object:
    """Call the flow ``module:function`` with ``kwargs`` in a fresh Python process whose
    ``PREFECT_API_URL`` is ``api_url``; returns its (JSON) result. ``log_path`` keeps the
    process's output; ``prefix`` wraps the command (e.g. a profiler). Raises with the
    output's tail if the flow fails."""
    with tempfile.TemporaryDirectory(prefix="yattflow-flow-") as tmp:
        out = Path(tmp) / "result.json"
        log = Path(log_path) if log_path else Path(tmp) / "output.log"
        child_env = {**os.environ, **(env or {}), "PREFECT_API_URL": api_url,
                     "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
        child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), child_env.get("PYTHONPATH")]))
        cmd = [*(prefix or []), sys.executable, "-c", _RUNNER, target, json.dumps(kwargs), str(out)]
        with open(log, "wb") as f:
            done = subprocess.run(cmd, cwd=ROOT, env=child_env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(f"{target} failed ({done.returncode}):\n{log.read_text(errors='replace')[-6000:]}")
        return json.loads(out.read_text())
