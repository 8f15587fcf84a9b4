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
"""

from __future__ import annotations

import sys
from contextlib import asynccontextmanager


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
