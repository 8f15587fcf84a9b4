"""``yattflow stack`` (flows/stack.py): Prefect scaled out as its self-hosting guide describes — API
replicas on one PostgreSQL, Redis messaging (prefect-redis), the services in their own process —
and a real training run against it (timing-stub engines, node controllers)."""

from __future__ import annotations

import asyncio
import shutil

import psutil
import pytest

from flows.stack import Stack
from tests.helpers import TINY, assert_steps_completed, read_run_tree
from tests.postgres import PostgresCluster, PostgresUnavailable, run_flow_subprocess

from tests.helpers import STUBS


def test_stack_refuses_sqlite():
    with pytest.raises(ValueError, match="PostgreSQL URL"):
        Stack("sqlite+aiosqlite:///prefect.db")


def test_training_on_the_scaled_out_stack(prepared, tmp_path):
    if not shutil.which("redis-server"):
        pytest.skip("redis-server is not installed (make system)")
    try:
        cluster = PostgresCluster().start()
    except PostgresUnavailable as e:
        pytest.skip(str(e))
    try:
        with Stack(cluster.url, replicas=2, home=tmp_path / "stack") as stack:
            api = next(p for p, name in stack.procs if name == "api")
            # the replicas: uvicorn's worker processes under the API's process
            assert len(psutil.Process(api.pid).children(recursive=True)) >= 2
            # a fresh process: this one's Prefect client is bound to the session's server (tests/postgres.py)
            summary = run_flow_subprocess(stack.url, "flows.training:train", timeout=300, overrides=TINY + STUBS + [
                f"storage.root={prepared}", "name=stacktest", "steps=2", "dp=2", "checkpoint.every=1",
                "controllers.groups_per_node=1", "rollout.stub_seconds_per_token=0", "train.stub_seconds_per_token=0"])
            assert [m["step"] for m in summary["history"]] == [0, 1]
            # task-run states reach the database as events: through Redis, recorded by the services process
            tree = asyncio.run(read_run_tree("stacktest", api_url=stack.url))
            assert tree["train-stacktest"][0] == "COMPLETED"
            assert_steps_completed(tree, steps=(0, 1), groups=(0, 1))
            assert sorted(stack.alive()) == ["api", "redis", "services"]
            log = (tmp_path / "stack" / "api.log").read_text()
            assert "startup failed" not in log and "Traceback" not in log, log[-3000:]  # both replicas started cleanly
    finally:
        cluster.stop()
