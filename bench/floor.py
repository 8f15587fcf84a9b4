"""Prefect's floor: what the shape of a yattflow run costs with nothing in it.

    .venv/bin/python -m bench.floor                  # dp 4 and 16, default server vs tuned, ~5 min
    .venv/bin/python -m bench.floor --temporary      # dp 1, the run's shape vs one sub-flow per step, ~2 min

The ``floor`` flow has the training flow's structure and nothing else: per step an
``iteration`` sub-flow, in it one sub-flow per DP group started concurrently (each given the
run's real ``GroupPlan`` as its parameter, as ``dp_group`` is), and in each group the same
number of stage tasks, which return at once — no engine hosts, no storage, no artifacts, no
logging of ours. Its time per iteration is the least any design with a Prefect sub-flow per DP
group per step and a task per stage pays on this machine and server; bench/scale.py runs it
beside every timing-stub run, on the same server, and reports yattflow's overhead against it.

Run on its own, it compares Prefect's default server with one whose task-run recorder writes
in batches (``flows.prefect_server.SERVER_SETTINGS``, what ``yattflow server`` starts Prefect with), each on
its own throwaway PostgreSQL cluster, runs alternating.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from bench import cpu_model
from engines.config import RunConfig, load_config
from flows.plan import GroupPlan

# the stage tasks of one DP group in one single-wave iteration: rollout, genrm_score,
# dynamic_filter, train_step, sync_weights
STAGE_TASKS = 5


@task(cache_policy=NO_CACHE, persist_result=False, task_run_name="stage {index} dp={group}")
async def stage(index: int, group: int) -> dict:
    return {"seconds": 0.0}


@flow(name="floor-dp-group", flow_run_name="floor-{step:04d}-dp-{group}")
async def floor_group(plan: GroupPlan, step: int, group: int, tasks: int) -> dict:
    for i in range(tasks):
        await stage(i, group)
    return {"group": group}


@flow(name="floor-iteration", flow_run_name="floor-iteration-{step:04d}")
async def floor_iteration(config: RunConfig, step: int, tasks: int) -> float:
    start = time.perf_counter()
    plan = GroupPlan.of(config)
    await asyncio.gather(*(floor_group(plan, step, g, tasks) for g in range(config.dp)))
    return time.perf_counter() - start


@flow(name="floor-flat-iteration", flow_run_name="floor-flat-iteration-{step:04d}")
async def floor_flat_iteration(config: RunConfig, step: int, tasks: int) -> None:
    """The least a step can be and still be a Prefect flow: one sub-flow, its tasks, no DP-group sub-flow."""
    for i in range(tasks):
        await stage(i, 0)


@flow(name="floor")
async def floor(overrides: list[str], steps: int = 4, tasks: int = STAGE_TASKS, flat: bool = False) -> dict:
    """``steps`` iterations of ``dp`` (from ``overrides``) empty group sub-flows (``flat``: one
    sub-flow per iteration with the tasks in it); seconds of each."""
    config = load_config(None, overrides)
    seconds = []
    for step in range(steps):
        start = time.perf_counter()
        await (floor_flat_iteration if flat else floor_iteration)(config, step, tasks)
        seconds.append(time.perf_counter() - start)
    return {"dp": config.dp, "tasks": tasks, "seconds": seconds}


def temporary_server_shapes(steps: int, repeats: int) -> dict:
    """At dp=1 on the temporary server a CLI command starts (``flows.prefect_server.local_api``: SQLite,
    TEMPORARY_SERVER_SETTINGS), in a throwaway PREFECT_HOME: the run's shape against one sub-flow
    per iteration with and without its tasks, alternating."""
    import os
    import tempfile

    from flows.prefect_server import local_api
    from tests.postgres import run_flow_subprocess

    shapes = {"iteration + dp-group sub-flows, 5 tasks": {"tasks": STAGE_TASKS},
              "one sub-flow, 5 tasks": {"tasks": STAGE_TASKS, "flat": True}, "one sub-flow, no task": {"tasks": 0, "flat": True}}
    seconds = {name: [] for name in shapes}
    os.environ.pop("PREFECT_API_URL", None)  # a server of the user's would be used instead of the temporary one
    os.environ["PREFECT_HOME"] = home = tempfile.mkdtemp(prefix="yattflow-bench-floor-")
    with local_api() as url:
        for _ in range(repeats):
            for name, kwargs in shapes.items():
                out = run_flow_subprocess(url, "bench.floor:floor", overrides=["dp=1"], steps=steps, env={"PREFECT_HOME": home},
                                          **kwargs)
                seconds[name] += out["seconds"][2:]  # the first two are warm-up
    print(f"\n### Prefect's floor per iteration at dp=1, temporary-server settings (SQLite, {cpu_model()})\n")
    print("| shape | ms per iteration, median | min |\n|---|---:|---:|")
    for name, values in seconds.items():
        print(f"| {name} | {statistics.median(values) * 1000:.0f} | {min(values) * 1000:.0f} |")
    return {"seconds": seconds}


def main(argv=None) -> dict:
    """The floor per DP group on a default server and on one with SERVER_SETTINGS (each on its own
    PostgreSQL cluster), runs alternating between them."""
    import contextlib

    from flows.prefect_server import SERVER_SETTINGS
    from tests.postgres import PostgresCluster, PrefectServer, run_flow_subprocess

    p = argparse.ArgumentParser(prog="python -m bench.floor", description=__doc__.split("\n\n")[0])
    p.add_argument("--dps", default="4,16", help="DP group counts, comma-separated")
    p.add_argument("--steps", type=int, default=5, help="iterations per run; the first is not measured")
    p.add_argument("--repeats", type=int, default=2, help="runs per server and DP size, alternating")
    p.add_argument("--temporary", action="store_true",
                   help="instead: dp=1 on the temporary server's settings, the run's shape against one sub-flow per iteration")
    args = p.parse_args(argv)
    if args.temporary:
        return temporary_server_shapes(max(args.steps, 25), args.repeats)
    dps = [int(x) for x in args.dps.split(",")]
    seconds: dict[tuple[str, int], list[float]] = {}
    with contextlib.ExitStack() as stack:
        servers = {}
        for name, env in (("default", {}), ("tuned", SERVER_SETTINGS)):
            cluster = stack.enter_context(PostgresCluster())
            servers[name] = stack.enter_context(PrefectServer(cluster.url, env=env))
        for dp in dps:
            for repeat in range(args.repeats):
                for name in (("default", "tuned") if repeat % 2 == 0 else ("tuned", "default")):
                    out = run_flow_subprocess(servers[name].url, "bench.floor:floor", overrides=[f"dp={dp}"], steps=args.steps)
                    seconds.setdefault((name, dp), []).extend(out["seconds"][1:])
    print(f"\n### Prefect's floor: one sub-flow + {STAGE_TASKS} empty tasks per DP group per iteration (PostgreSQL)\n")
    print("| dp | default server, ms per group | tuned task-run recorder, ms per group | ratio |\n|---|---|---|---|")
    rows = []
    for dp in dps:
        default, tuned = (statistics.fmean(seconds[(name, dp)]) / dp for name in ("default", "tuned"))
        print(f"| {dp} | {default * 1000:.0f} | {tuned * 1000:.0f} | {tuned / default:.2f} |")
        rows.append({"figure": f"Prefect floor per DP group at dp={dp} (s): task-run recorder batched vs Prefect's default",
                     "yattflow": tuned, "baseline": default, "ratio": tuned / default})
    print("\ntuned (what `yattflow server` sets): " + ", ".join(f"{k}={v}" for k, v in SERVER_SETTINGS.items()))
    return {"rows": rows, "seconds": {f"{name}-{dp}": v for (name, dp), v in seconds.items()}}


if __name__ == "__main__":
    main()
