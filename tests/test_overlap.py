"""Off-policy overlap (rollout.max_staleness, flows/pipeline.py) with the real flows, Prefect
server and engine hosts on timing-stub engines: step n+1's rollout runs while step n trains, the
UI shows the iterations as overlapping flow runs, and every sample's staleness is within k."""

from __future__ import annotations

import asyncio

from flows.training import train
from tests.helpers import (STUBS, TINY, assert_steps_completed, no_engine_hosts_left, read_run_tree, run_until_healed,
                           taken_prompts, trained_once)


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
    # fresh samples one version behind (not only carried-over groups): step n+1 generated while step n trained
    assert any(m["staleness"].get(1, 0) > 4 * m["carried_groups"] for m in history[1:]), history


def test_kill_during_overlap_resumes_with_no_prompt_trained_twice_or_skipped(prepared, tmp_path):
    """kill -9 of the run while step 3's rollout overlaps step 2's train step, then of a host while
    step 4's filtering overlaps step 3's training (the run heals itself): the same command run again
    finishes, every group's rollouts drew its prompt stream in order with no prompt drawn twice or
    skipped (the redone generation starts at the last checkpoint's cursors), and no prompt was trained
    in two steps. (Which samples are drawn is not compared with an uninterrupted run: with overlap,
    which policy version generates a chunk depends on when the sync lands.)"""
    import signal
    from pathlib import Path

    from engines.host.prompts import PromptStream
    from storage.runstate import RunState

    fired = tmp_path / "fired"
    fired.mkdir()
    args = TINY + STUBS + [f"storage.root={prepared}", "name=overlap-killed", "steps=6", "dp=2", "checkpoint.every=2",
                           "rollout.max_staleness=1", "sampling.max_waves=1", "data.heldout=null", "retries.run=2",
                           "timeouts.stage_s=60", "run.lease_s=10",
                           "rollout.stub_seconds_per_token=0.004", "train.stub_seconds_per_token=0.006"]
    codes, run, _ = run_until_healed(args, "rollout@3:dp-0:kill-run,dynamic_filter@4:dp-1:kill", fired, 300)
    assert codes == [-signal.SIGKILL, 0], run.stderr[-3000:]
    assert len(list(fired.iterdir())) == 2  # both faults happened
    run_dir = Path(prepared) / "runs" / "overlap-killed"
    state = RunState.load(str(run_dir))
    assert state.step == 5
    steps = sorted((run_dir / "steps").iterdir())
    assert [int(s.name) for s in steps] == list(range(6))
    for g in (0, 1):
        stream = PromptStream(str(Path(prepared) / "data" / "train"), g, 2)
        assert taken_prompts(steps, g) == [r["prompt_id"] for r in stream.wave(0, state.cursors[g])]  # in order, none twice, none skipped
    assert len(trained_once(steps, (0, 1))) >= 6 * 2  # at least one group per step and DP group

async def under_run(run_name: str) -> tuple[dict[str, list[str]], list[tuple[str, str, str]]]:
    """Every attempt's iteration and DP-group flow runs under the newest ``train-<run_name>`` run,
    {name: [state of each run of that name]}, and their task runs as (name, state, message)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    from tests.helpers import children

    async with get_client() as client:
        runs = await client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[f"train-{run_name}"])))
        top = max(runs, key=lambda r: r.created)
        iterations = await children(client, top.id)
        groups = [g for it in iterations for g in await children(client, it.id)]
        task_runs = await client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [g.id for g in groups]}))
    flows: dict[str, list[str]] = {}
    for r in iterations + groups:
        flows.setdefault(r.name, []).append(r.state.type.value)
    return flows, [(t.name, t.state.type.value, t.state.message) for t in task_runs]


def test_a_weight_sync_that_does_not_finish_is_a_lost_host_and_the_run_heals(prepared, tmp_path, monkeypatch):
    """dp-1's host hangs for good as a weight sync reaches it (engines/host/faults.py). Its
    heartbeats go on, and while its rollout lane generates they even show progress (the counter is
    the host's), so the progress watchdog cannot be relied on; here timeouts.stage_s=600, far beyond
    this test, so only rollout.sync_timeout_s=4 can end the wait, and it must: step 0's sync task (step 1's rollout beside it) fails with HostLost, the run kills its hosts
    (the hung one included), restarts them from the last committed checkpoint (here: the start) and
    finishes every step, all well within the watchdog's 600 s."""
    import time

    fired = tmp_path / "fired"
    fired.mkdir()
    monkeypatch.setenv("YATTFLOW_FAULTS_FIRED", str(fired))
    monkeypatch.setenv("YATTFLOW_FAULTS", "sync_weights@0:dp-1:hang")
    start = time.monotonic()
    summary = asyncio.run(train(overrides=TINY + STUBS + [
        f"storage.root={prepared}", "name=overlap-sync-hang", "steps=2", "dp=2",
        "rollout.max_staleness=1", "rollout.sync_timeout_s=4", "timeouts.stage_s=600", "host_timeout_s=600",
        "retries.run=1", "data.heldout=null", "rollout.stub_seconds_per_token=0.002", "train.stub_seconds_per_token=0.002"]))
    seconds = time.monotonic() - start
    assert [p.name for p in fired.iterdir()] == ["sync_weights@0:dp-1:hang"]  # the hang happened
    assert [m["step"] for m in summary["history"]] == [0, 1]  # healed: every step trained, a redone one once
    assert seconds < 300, f"the run took {seconds:.0f}s: a hung sync was waited on"
    flows, task_runs = asyncio.run(under_run("overlap-sync-hang"))
    failed = [(name, message) for name, state, message in task_runs if state == "FAILED"]
    assert len(failed) == 1 and failed[0][0] == "sync_weights dp=1", failed  # the sync, and nothing else, failed
    assert "'sync_weights' did not finish within its time-out of 4s" in failed[0][1], failed
    # the failed attempt's flow runs all ended (none left Running in the UI)
    assert not [name for name, states in flows.items() if set(states) & {"RUNNING", "PENDING", "SCHEDULED"}], flows
    no_engine_hosts_left()  # the hung host was killed with the failed attempt, not left holding its devices
