"""A real Prefect server on a real PostgreSQL database (SQLite locks under concurrent
sub-flows: 16 groups spent 31-95 s retrying "database is locked", PostgreSQL 2.3 s; production runs set ``PREFECT_API_DATABASE_CONNECTION_URL``).

The training runs in a fresh process pointed at the PostgreSQL-backed server
(``tests/postgres.py: run_flow_subprocess``): this test process has already reported the
``prepared`` flow to the session's SQLite server, and ``temporary_settings`` would re-point
flow runs but not Prefect's process-wide events worker, which carries task-run states.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.helpers import TINY, assert_steps_completed, read_run_tree
from tests import postgres as pg


@pytest.fixture(scope="module")
def pg_server():
    """(API URL, database URL) of a ``prefect server`` backed by a throwaway PostgreSQL cluster."""
    try:
        cluster = pg.PostgresCluster().start()
    except pg.PostgresUnavailable as e:
        pytest.skip(str(e))
    try:
        with pg.prefect_server(cluster.url) as api_url:
            yield api_url, cluster.url
    finally:
        cluster.stop()


async def _flow_runs_in_database(database_url: str) -> dict[str, str]:
    """Straight from PostgreSQL, not through Prefect: {flow-run name: state type}."""
    import asyncpg

    conn = await asyncpg.connect(database_url.replace("postgresql+asyncpg://", "postgresql://"))
    try:
        return {r["name"]: r["state_type"] for r in await conn.fetch("SELECT name, state_type FROM flow_run")}
    finally:
        await conn.close()


def test_training_on_a_postgresql_backed_server(prepared, prefect_server, pg_server):
    """Two RL steps, DP=2, reported to a PostgreSQL-backed server: the run, both iterations,
    all four DP-group sub-flows and every stage task are COMPLETED there — and only there."""
    api_url, database_url = pg_server
    summary = pg.run_flow_subprocess(api_url, "flows.training:train", timeout=600,
                                  overrides=TINY + [f"storage.root={prepared}", "name=pgtest", "steps=2", "dp=2"])
    assert [m["step"] for m in summary["history"]] == [0, 1]
    assert all(0 < m["engine_s"] < m["seconds"] and m["overhead_s"] > 0 for m in summary["history"])

    groups = [f"iteration-{s:04d}-dp-{g}" for s in (0, 1) for g in (0, 1)]
    deadline = time.monotonic() + 30  # task runs are recorded from events, a moment after the flow ends
    while True:
        tree = asyncio.run(read_run_tree("pgtest", api_url))
        tasks_done = all(tree.get(g, (None, {}))[1] and set(tree[g][1].values()) == {"COMPLETED"} for g in groups)
        if tasks_done or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert tree["train-pgtest"][0] == "COMPLETED"
    assert_steps_completed(tree, steps=(0, 1), groups=(0, 1))
    assert "checkpoint dp=0 step=1" in tree["iteration-0001-dp-0"][1]  # the last step checkpoints

    # The rows are in PostgreSQL itself ...
    rows = asyncio.run(_flow_runs_in_database(database_url))
    assert {name: rows.get(name) for name in ["train-pgtest", "iteration-0000", "iteration-0001", *groups]} == \
        {name: "COMPLETED" for name in ["train-pgtest", "iteration-0000", "iteration-0001", *groups]}
    # ... and nothing of this run reached the session's SQLite server.
    assert asyncio.run(read_run_tree("pgtest", prefect_server)) == {}
