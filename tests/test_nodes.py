"""Node controllers (``controllers.groups_per_node``, flows/nodes.py): the DP groups' sub-flows run
in one process per node, under one task per node in the iteration, on the real flows, hosts and
Prefect server (timing-stub engines)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from flows.training import train
from tests.helpers import STUBS, TINY, assert_steps_completed, read_run_tree, settled


async def _node_tasks(run: str) -> dict[str, tuple[str, str]]:
    """{node task-run name: (its iteration's name, state)} under the newest ``train-<run>``."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName, TaskRunFilter, TaskRunFilterName

    async def read(client) -> dict[str, tuple[str, str]]:
        top = max(await client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[f"train-{run}"]))),
                  key=lambda r: r.created)
        its = {r.id: r.name for r in await client.read_flow_runs(flow_run_filter=FlowRunFilter(parent_flow_run_id={"any_": [top.id]}))}
        nodes = await client.read_task_runs(task_run_filter=TaskRunFilter(name=TaskRunFilterName(like_="node ")),
                                            flow_run_filter=FlowRunFilter(id={"any_": list(its)}))
        return {(its[t.flow_run_id], t.name): t.state.type.value for t in nodes}

    async with get_client() as client:
        return await settled(lambda: read(client))


def test_node_controllers_run_the_groups(prepared):
    """dp=4 in 2 node controllers of 2 groups: every group's sub-flow and stage tasks complete, each
    under its node's task; checkpoints commit and the run's parameters stay in step (the iteration
    checks the groups' fingerprints)."""
    summary = asyncio.run(train(overrides=TINY + STUBS + [
        f"storage.root={prepared}", "name=nodestest", "steps=2", "dp=4", "checkpoint.every=1",
        "controllers.groups_per_node=2", "rollout.stub_seconds_per_token=0", "train.stub_seconds_per_token=0"]))
    assert [m["step"] for m in summary["history"]] == [0, 1]
    tree = asyncio.run(read_run_tree("nodestest"))
    assert tree["train-nodestest"][0] == "COMPLETED"
    assert_steps_completed(tree, steps=(0, 1), groups=(0, 1, 2, 3), also=("checkpoint dp={g} step={step}",))
    # the iterations ran their groups as one task per node controller, each answered with its groups' records
    assert asyncio.run(_node_tasks("nodestest")) == {
        (f"iteration-{step:04d}", f"node {k}: dp [{2 * k}, {2 * k + 1}]"): "COMPLETED" for step in (0, 1) for k in (0, 1)}
    assert (Path(prepared) / "runs" / "nodestest" / "final" / "STUB_WEIGHTS.json").exists()


def test_a_node_that_dies_is_a_lost_host_and_the_run_heals(prepared, tmp_path, monkeypatch):
    """Node controller 1 SIGKILLed as step 1's groups reach it (its hosts exit with it), then a host
    under node 0 killed in step 2's rollout: each time the run restarts its hosts and node controllers
    and resumes from the last committed checkpoint, and trains every step once. Hosts and node controllers
    forked (``hosts.fork``: engines/wire/forkserver.py), so a killed forked process is lost as a started one is."""
    planned = ["node_iteration@1:dp-1:kill", "rollout@2:dp-0:kill"]
    fired = tmp_path / "fired"
    fired.mkdir()
    monkeypatch.setenv("YATTFLOW_FAULTS_FIRED", str(fired))
    monkeypatch.setenv("YATTFLOW_FAULTS", ",".join(planned))
    summary = asyncio.run(train(overrides=TINY + STUBS + [
        f"storage.root={prepared}", "name=nodesheal", "steps=3", "dp=4", "checkpoint.every=1", "retries.run=2",
        "controllers.groups_per_node=2", "hosts.fork=true", "rollout.stub_seconds_per_token=0", "train.stub_seconds_per_token=0"]))
    assert sorted(p.name for p in fired.iterdir()) == sorted(planned)  # both faults happened
    assert [m["step"] for m in summary["history"]] == [0, 1, 2]  # a step redone replaced its first try
    assert (Path(prepared) / "runs" / "nodesheal" / "final" / "STUB_WEIGHTS.json").exists()
