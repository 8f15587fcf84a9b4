"""``yattflow stack``: a Prefect server scaled out the way Prefect documents self-hosting at scale.

    yattflow stack --database-url postgresql+asyncpg://USER@HOST:5432/prefect [--replicas 4] [--port 4200]

Prefect's guide ("How to scale self-hosted Prefect") asks for several API server instances on one
PostgreSQL database, Redis for messaging (the ``prefect-redis`` integration: event broker and
cache, causal ordering, lease storage, docket), and the background services (scheduler, event
persister, task-run recorder, ...) in their own process. Locally that is:

- ``redis-server`` (Debian's package) on loopback, a free port, nothing written to disk;
- ``prefect server start --no-services --workers N``: N API replicas (uvicorn worker processes)
  on one port, the kernel spreading connections over them, so clients keep one ``PREFECT_API_URL``
  (Prefect refuses ``--workers`` > 1 without PostgreSQL and Redis);
- ``prefect server services start``: every background service, in one process of its own.

All three run with yattflow's server settings (``flows/prefect_server.py``) and stop together
(Ctrl-C). SQLite cannot be shared by replicas, so a PostgreSQL URL is required.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from flows import prefect_server

REDIS_SETTINGS = {  # prefect-redis, as Prefect's self-hosting guide configures it
    "PREFECT_MESSAGING_BROKER": "prefect_redis.messaging",
    "PREFECT_MESSAGING_CACHE": "prefect_redis.messaging",
    "PREFECT_SERVER_EVENTS_CAUSAL_ORDERING": "prefect_redis.ordering",
    "PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE": "prefect_redis.lease_storage",
}


_REGISTER_BLOCKS = """
import asyncio
from prefect.server.database import provide_database_interface
from prefect.server.models.block_registration import run_block_auto_registration

async def main():
    session = await provide_database_interface().session()
    async with session:
        await run_block_auto_registration(session=session)
        await session.commit()

asyncio.run(main())
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Stack:
    """Redis, N API replicas and the services process; ``start()`` / ``stop()`` (a context manager too)."""

    def __init__(self, database_url: str, replicas: int = 2, port: int | None = None, home: str | Path | None = None,
                 settings: dict | None = None):
        if not database_url.startswith("postgresql"):
            raise ValueError(f"yattflow stack: --database-url must be a PostgreSQL URL (postgresql+asyncpg://...): API replicas "
                             f"cannot share SQLite; got {database_url.split('://')[0]}://...")
        self.database_url, self.replicas, self.port = database_url, replicas, port
        self.home = Path(home) if home else Path(tempfile.mkdtemp(prefix="yattflow-stack-"))
        self.settings = settings or {}
        self.procs: list[tuple[subprocess.Popen, str]] = []
        self.redis_dir: str | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    def env(self, redis_port: int) -> dict:
        return {**prefect_server.SERVER_SETTINGS, **os.environ, **REDIS_SETTINGS, **self.settings,
                "PREFECT_HOME": str(self.home), "PREFECT_API_DATABASE_CONNECTION_URL": self.database_url,
                "PREFECT_REDIS_MESSAGING_HOST": "127.0.0.1", "PREFECT_REDIS_MESSAGING_PORT": str(redis_port),
                "PREFECT_SERVER_DOCKET_URL": f"redis://127.0.0.1:{redis_port}/1",
                "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_API_URL": self.url}

    def _spawn(self, cmd: list[str], env: dict, name: str) -> subprocess.Popen:
        log = open(self.home / f"{name}.log", "ab")
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.procs.append((proc, name))
        return proc

    def start(self, timeout: float = 180) -> "Stack":
        redis = shutil.which("redis-server") or "/usr/bin/redis-server"
        if not Path(redis).exists():
            raise RuntimeError("yattflow stack needs redis-server (Debian: apt-get install redis-server; `make system`)")
        self.home.mkdir(parents=True, exist_ok=True)
        self.port = self.port or _free_port()
        redis_port, self.redis_dir = _free_port(), tempfile.mkdtemp(prefix="yattflow-redis-")
        try:
            self._spawn([redis, "--bind", "127.0.0.1", "--port", str(redis_port), "--save", "", "--appendonly", "no",
                         "--dir", self.redis_dir, "--protected-mode", "yes"], dict(os.environ), "redis")
            _wait_port(redis_port, self.procs[-1][0], timeout, self.home / "redis.log")
            env = self.env(redis_port)
            prefect = [sys.executable, "-m", "flows.prefect_server", "server"]
            # Migrate once, before any replica starts: replicas that each migrate a fresh database at start race
            # (one failed with a duplicate pg_type, "Application startup failed"), as Prefect's guide warns.
            migrate = subprocess.run([*prefect, "database", "upgrade", "--yes"], env=env, capture_output=True, text=True,
                                     timeout=timeout)
            if migrate.returncode != 0:
                raise RuntimeError(f"prefect server database upgrade failed:\n{migrate.stdout[-2000:]}{migrate.stderr[-2000:]}")
            # The same for the block types every replica registers at start (they raced on uq_block_type__slug):
            # once, here, as the server's startup does it; then the replicas skip both.
            register = subprocess.run([sys.executable, "-c", _REGISTER_BLOCKS], env=env, capture_output=True, text=True,
                                      timeout=timeout)
            if register.returncode != 0:
                raise RuntimeError(f"registering Prefect's block types failed:\n{register.stderr[-2000:]}")
            env["PREFECT_API_DATABASE_MIGRATE_ON_START"] = "false"
            env["PREFECT_SERVER_REGISTER_BLOCKS_ON_START"] = "false"
            api = self._spawn([*prefect, "start", "--host", "127.0.0.1", "--port", str(self.port), "--no-services",
                               "--no-ui", "--workers", str(self.replicas)], env, "api")
            deadline = time.monotonic() + timeout
            while not prefect_server.healthy(self.url):
                if api.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the Prefect API replicas did not start; see {self.home / 'api.log'}:\n"
                                       + (self.home / "api.log").read_text(errors="replace")[-3000:])
                time.sleep(0.3)
            self._spawn([*prefect, "services", "start"], env, "services")
        except BaseException:
            self.stop()
            raise
        return self

    def alive(self) -> list[str]:
        return [name for p, name in self.procs if p.poll() is None]

    def stop(self) -> None:
        for proc, name in reversed(self.procs):  # the services and the API before Redis, which they use
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGINT)
                    proc.wait(timeout=20)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # stragglers of its group (uvicorn's worker processes)
            except ProcessLookupError:
                pass
            proc.wait()
        self.procs = []
        if self.redis_dir:
            shutil.rmtree(self.redis_dir, ignore_errors=True)

    def __enter__(self) -> "Stack":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _wait_port(port: int, proc: subprocess.Popen, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{log.stem} did not start; see {log}:\n{log.read_text(errors='replace')[-2000:]}") from None
            time.sleep(0.1)


def stack(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="yattflow stack", description=__doc__.split("\n\n")[0])
    parser.add_argument("--database-url", default=os.environ.get("PREFECT_API_DATABASE_CONNECTION_URL"),
                        help="PostgreSQL URL for Prefect (default: $PREFECT_API_DATABASE_CONNECTION_URL)")
    parser.add_argument("--replicas", type=int, default=2, help="API server replicas (default %(default)s)")
    parser.add_argument("--port", type=int, default=prefect_server.DEFAULT_PORT, help="API port (default %(default)s)")
    args = parser.parse_args(argv)
    if not args.database_url:
        print("yattflow stack: give --database-url postgresql+asyncpg://... (or set PREFECT_API_DATABASE_CONNECTION_URL)",
              file=sys.stderr)
        return 2
    from prefect.settings import get_current_settings

    try:
        s = Stack(args.database_url, args.replicas, args.port, Path(get_current_settings().home) / "yattflow-stack").start()
    except (ValueError, RuntimeError) as e:
        print(e, file=sys.stderr)
        return 1
    print(f"\nPrefect API: {s.url} ({args.replicas} replicas; Redis messaging; services in their own process)\n"
          f"  logs: {s.home}/{{redis,api,services}}.log\n  in other shells: export PREFECT_API_URL={s.url}\n"
          "Ctrl-C stops the stack.\n", flush=True)
    try:
        while len(s.alive()) == len(s.procs):
            time.sleep(0.5)
        print(f"yattflow stack: {set(n for _, n in s.procs) - set(s.alive())} exited; stopping", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        s.stop()
