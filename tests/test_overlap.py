"""Off-policy overlap (rollout.max_staleness, flows/pipeline.py) with the real flows, Prefect
server and engine hosts on timing-stub engines: step n+1's rollout runs while step n trains, the
UI shows the iterations as overlapping flow runs, and every sample's staleness is within k."""

from __future__ import annotations

import asyncio

from conftest import TINY
from flows.training import train
from helpers import assert_steps_completed, read_run_tree

STUBS = ["rollout.backend=stub", "judge.backend=stub", "train.backend=stub"]


async def flow_run_times(names: list[str]) -> dict[str, tuple]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    async with get_client() as client:
        runs = await client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=names)))
    newest: dict[str, object] = {}
    for r in runs:
        if r.name not in newest or r.created > newest[r.name].created:
            newest[r.name] = r
    return {name: (r.start_time, r.end_time) for name, r in newest.items()}


def test_overlapping_steps_on_stub_engines(prepared):
    # ~1 s of rollout + judging and ~1 s of training per step: long enough to see the overlap
    summary = asyncio.run(train(overrides=TINY + STUBS + [
        f"storage.root={prepared}", "name=overlap", "steps=3", "dp=2", "checkpoint.every=2", "rollout.max_staleness=1",
        "rollout.stub_seconds_per_token=0.005", "train.stub_seconds_per_token=0.01"]))
    tree = asyncio.run(read_run_tree("overlap"))
    assert tree["train-overlap"][0] == "COMPLETED"
    assert_steps_completed(tree, steps=(0, 1, 2), groups=(0, 1))
    times = asyncio.run(flow_run_times([f"iteration-{s:04d}-dp-0" for s in range(3)]))
    for step in (1, 2):  # step n+1's group flow started before step n's ended: overlapping runs in the UI
        assert times[f"iteration-{step:04d}-dp-0"][0] < times[f"iteration-{step - 1:04d}-dp-0"][1], times
    history = summary["history"]
    assert [m["step"] for m in history] == [0, 1, 2]
    assert history[0]["staleness"] == {0: history[0]["kept_groups"] * 4}  # the first rollout: initial weights, trained first
    for m in history:
        assert set(m["staleness"]) <= {0, 1} and m["train"]["staleness_max"] <= 1, m["staleness"]
        assert sum(m["staleness"].values()) == m["kept_groups"] * 4  # every trained sample has its version
    assert any(1 in m["staleness"] for m in history[1:]), [m["staleness"] for m in history]
