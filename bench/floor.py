"""Prefect's floor: what the shape of a yattflow run costs with nothing in it.

    .venv/bin/python -m bench.floor --dp 16          # against a throwaway PostgreSQL-backed server

The ``floor`` flow has the training flow's structure and nothing else: per step an
``iteration`` sub-flow, in it one sub-flow per DP group started concurrently (each given the
run's real ``RunConfig`` as its parameter, as ``dp_group`` is), and in each group the same
number of stage tasks, which return at once — no engine hosts, no storage, no artifacts, no
logging of ours. Its time per iteration is the least any design with a Prefect sub-flow per DP
group per step and a task per stage pays on this machine and server; bench/scale.py runs it
beside every timing-stub run, on the same server, and reports yattflow's overhead against it.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from flows.config import RunConfig, load_config

# the stage tasks of one DP group in one single-wave iteration: rollout, genrm_score,
# dynamic_filter, train_step, sync_weights
STAGE_TASKS = 5


@task(cache_policy=NO_CACHE, persist_result=False, task_run_name="stage {index} dp={group}")
async def stage(index: int, group: int) -> dict:
    return {"seconds": 0.0}


@flow(name="floor-dp-group", flow_run_name="floor-{step:04d}-dp-{group}")
async def floor_group(config: RunConfig, step: int, group: int, tasks: int) -> dict:
    for i in range(tasks):
        await stage(i, group)
    return {"group": group}


@flow(name="floor-iteration", flow_run_name="floor-iteration-{step:04d}")
async def floor_iteration(config: RunConfig, step: int, tasks: int) -> float:
    start = time.perf_counter()
    await asyncio.gather(*(floor_group(config, step, g, tasks) for g in range(config.dp)))
    return time.perf_counter() - start


@flow(name="floor")
async def floor(overrides: list[str], steps: int = 4, tasks: int = STAGE_TASKS) -> dict:
    """``steps`` iterations of ``dp`` (from ``overrides``) empty group sub-flows; seconds of each."""
    config = load_config(None, overrides)
    seconds = []
    for step in range(steps):
        start = time.perf_counter()
        await floor_iteration(config, step, tasks)
        seconds.append(time.perf_counter() - start)
    return {"dp": config.dp, "tasks": tasks, "seconds": seconds}


def main(argv=None) -> dict:
    from tests.postgres import PostgresCluster, PrefectServer, run_flow_subprocess

    p = argparse.ArgumentParser(prog="python -m bench.floor", description=__doc__.split("\n\n")[0])
    p.add_argument("--dp", type=int, default=4)
    p.add_argument("--steps", type=int, default=5, help="iterations; the first is not measured")
    args = p.parse_args(argv)
    with PostgresCluster() as cluster, PrefectServer(cluster.url) as server:
        out = run_flow_subprocess(server.url, "bench.floor:floor", overrides=[f"dp={args.dp}"], steps=args.steps)
    mean = statistics.fmean(out["seconds"][1:])
    print(f"dp={args.dp}: {mean:.3f} s per iteration, {mean / args.dp * 1000:.0f} ms per DP group "
          f"(one sub-flow + {out['tasks']} tasks)")
    return out | {"iteration_s": mean, "per_group_s": mean / args.dp}


if __name__ == "__main__":
    main()
