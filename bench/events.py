"""What a run's Prefect events cost a step (flows/events.py).

    .venv/bin/python -m bench.events                 # ~1 min on 2 cores

On a Prefect server with its default services (the event persister and the triggers service on, as
under `yattflow server`, with the automations of deployments/automations.yaml created), steps of
Prefect's floor at dp=1 (bench/floor.py: the run's sub-flows and stage tasks, nothing in them) run in
alternating blocks without events and with the events of a checkpointing step (its step event and
a checkpoint commit, a real step's payload). Blocks, not single steps: the server persists and
matches a step's events while the next step runs, so their cost can land on the step after them.
Printed: ms per step each way and their ratio, and what one emit costs the calling thread (Prefect's
events worker sends from its own thread).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from prefect import flow

from bench import cpu_model
from bench.floor import STAGE_TASKS, floor_iteration
from engines.config import load_config

PAYLOAD = {"step": 7, "reward": 0.41, "accuracy": 0.38, "kept_groups": 8, "dropped_groups": 3, "waves": 1, "samples": 64,
           "prompts": 8, "fill_rate": 1.0, "response_tokens": 9.4, "seconds": 0.43, "engine_s": 0.31, "policy_version": 8,
           "heldout": None, "loss": 0.012, "grad_norm": 2.7, "tokens": 602.0, "clip_fraction": 0.01, "entropy": 1.2,
           "kl_rollout": 0.0, "kl_reference": 0.03}


@flow(name="events-bench")
async def steps(overrides: list[str], count: int, block: int) -> dict:
    """``count`` floor steps in blocks of ``block``, alternating without and with a step's events;
    seconds of each, and the calling thread's seconds per emit."""
    from flows import events

    config = load_config(None, overrides)
    events.top_flow_run(config)
    seconds: dict[str, list[float]] = {"none": [], "2 events": []}
    emit_s = []
    for step in range(count):
        with_events = (step // block) % 2 == 1
        start = time.perf_counter()
        await floor_iteration(config, step, STAGE_TASKS)
        if with_events:
            for name in (events.STEP_COMPLETED, events.CHECKPOINT_COMMITTED):
                t = time.perf_counter()
                events.emit(config, name, PAYLOAD)
                emit_s.append(time.perf_counter() - t)
        if step % block >= 1:  # the first of a block carries the other kind's spill-over
            seconds["2 events" if with_events else "none"].append(time.perf_counter() - start)
    return {"seconds": seconds, "emit_s": emit_s}


def main(argv=None) -> dict:
    from flows.admin import ensure_automations
    from flows.prefect_server import SERVER_SETTINGS, started_server, stop, use_api

    p = argparse.ArgumentParser(prog="python -m bench.events", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=80, help="steps in all")
    p.add_argument("--block", type=int, default=10, help="steps per block, alternating without and with events")
    args = p.parse_args(argv)
    home = tempfile.mkdtemp(prefix="yattflow-bench-events-")
    env = {**SERVER_SETTINGS, **os.environ, "PREFECT_HOME": home, "PREFECT_UI_ENABLED": "0"}
    os.environ["PREFECT_HOME"] = home
    proc, url = started_server(env, Path(home) / "server.log", "the benchmark's Prefect server")
    try:
        with use_api(url):
            asyncio.run(ensure_automations())
            out = asyncio.run(steps(["dp=1"], args.steps, args.block))
            from prefect.logging.handlers import APILogWorker

            APILogWorker.drain_all(timeout=5)  # the flow's last log lines, while the server listens
    finally:
        stop(proc, "the benchmark's Prefect server")
    none, with_events = (statistics.median(out["seconds"][k]) for k in ("none", "2 events"))
    size = len(json.dumps(PAYLOAD))
    print(f"\n### A step's Prefect events (dp=1 floor step, server with default services; {cpu_model()})\n")
    print("| step | ms, median | steps |\n|---|---:|---:|")
    for name, values in out["seconds"].items():
        print(f"| {name} | {statistics.median(values) * 1000:.1f} | {len(values)} |")
    print(f"\nratio (2 events / none): {with_events / none:.3f}; one emit on the calling thread: median "
          f"{statistics.median(out['emit_s']) * 1e6:.0f} µs, max {max(out['emit_s']) * 1e6:.0f} µs; payload {size} bytes of JSON")
    return {"rows": [{"figure": "floor step at dp=1 with a checkpointing step's 2 events vs none (s)", "yattflow": with_events,
                      "baseline": none, "ratio": with_events / none}],
            "emit_us_median": statistics.median(out["emit_s"]) * 1e6}


if __name__ == "__main__":
    main()
