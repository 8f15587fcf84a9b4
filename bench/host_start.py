"""A run's start as a deployment's flow run pays it: the engine hosts started, the input checked by the
first host, every group's engines loaded, against an earlier commit; with ``--steps`` > 2, each step's
orchestration too.

    .venv/bin/python -m bench.host_start [--baseline 5a0cffa] [--dp 2] [--repeats 3] [--steps 1]

The ``train`` flow of a tiny run (``TASK``, ``--dp`` groups on the torch engines, one step) in a fresh
process, as a worker runs a deployment's flow run: no command ran the pre-flight, so rank 0's host
checks the input before any engine loads (flows/preflight.py). One Prefect server for every run; this
checkout and ``--baseline`` (a git worktree, the same interpreter) alternate. The figure is the seconds
from the run's own log (the flow's beginning to the first step's sub-flow's): the hosts' start, the input check,
the engines' load and the held-out evaluation before RL. A step's orchestration is its ``step_s -
engine_s`` (the step as the train flow pays for it, less its longest group's seconds on the hosts:
Prefect's sub-flows and tasks, the controller's own code), the median over the steps after the
first and before the last (which writes a checkpoint).

Prints the CPU, a table of every run and the ratio of the medians (this checkout / baseline).
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
from datetime import datetime
from pathlib import Path

from bench import against, cpu_model
from flows.prefect_server import started_server, stop
from tests.helpers import TASK

ROOT = Path(__file__).resolve().parent.parent
# Prefect's console lines: "HH:MM:SS.mmm | LEVEL | Flow run 'name' - message"
LINE = re.compile(r"^(\d\d:\d\d:\d\d\.\d+) \| \w+ +\| (?:Flow|Task) run '[^']*' - (.*)$", re.M)
FLOW = ("import asyncio, sys; from flows.training import train; s = asyncio.run(train(overrides=sys.argv[1:])); "
        "print('ORCHESTRATION', *(m['step_s'] - m['engine_s'] for m in s['history'][1:-1]))")


def train_log(checkout: Path, words: list[str], env: dict) -> tuple[list, subprocess.CompletedProcess]:
    """The ``train`` flow of ``words`` run in a fresh process in ``checkout``: its Prefect log lines as
    (time, text), and the process."""
    out = subprocess.run([sys.executable, "-c", FLOW, *words], cwd=checkout, env=env, capture_output=True, text=True)
    lines = [(datetime.strptime(t, "%H:%M:%S.%f"), text) for t, text in LINE.findall(out.stdout + out.stderr)]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"the train flow failed in {checkout}:\n{(out.stdout + out.stderr)[-3000:]}")
    return lines, out


def _run(checkout: Path, words: list[str], env: dict) -> tuple[float, list[float]]:
    """Seconds from the ``train`` flow's beginning to the first step's sub-flow's, by their log lines;
    the orchestration seconds of each step after the first and before the last."""
    lines, out = train_log(checkout, words, env)
    begun = next(t for t, text in lines if text.startswith("Beginning flow run 'train-"))
    ready = next(t for t, text in lines if text.startswith("Beginning subflow run 'iteration-0000'"))
    steps = next(line for line in out.stdout.splitlines() if line.startswith("ORCHESTRATION")).split()[1:]
    return (ready - begun).total_seconds(), [float(x) for x in steps]


def _table(title: str, figure: str, values: dict[str, list[float]], baseline: str, column: str, cell,
           now: str = "this checkout") -> dict:
    """Print both checkouts' (or settings') ``values`` (``cell``: what the column shows of them) and the ratio of
    their medians; the combined table's row."""
    print(f"\n### {title}\n\n| | {column} | median, s |\n|---|---|---:|")
    for name, label in (("yattflow", now), ("baseline", f"baseline ({baseline})")):
        print(f"| {label} | {cell(values[name])} | {statistics.median(values[name]):.3f} |")
    now, before = statistics.median(values["yattflow"]), statistics.median(values["baseline"])
    print(f"\nratio of the medians: {now / before:.2f}")
    return {"figure": figure, "yattflow": now, "baseline": before, "ratio": now / before}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", default="5a0cffa", help="the commit to compare with (default %(default)s)")
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=1, help="RL steps per run (> 2: each step's orchestration too)")
    args = p.parse_args(argv)
    runs: dict[str, list[float]] = {"yattflow": [], "baseline": []}
    steps: dict[str, list[float]] = {"yattflow": [], "baseline": []}
    with against(args.baseline, "yattflow-bench-host-start-") as (work, baseline, env, store):
        server, url = started_server(env, work / "server.log", "the benchmark's Prefect server")
        try:
            for i in range(args.repeats):
                for name, checkout in (("baseline", baseline), ("yattflow", ROOT)):
                    words = [*TASK, store, f"dp={args.dp}", f"steps={args.steps}", f"name=start-{name}-{i}"]
                    start, orchestration = _run(checkout, words, env | {"PREFECT_API_URL": url})
                    runs[name].append(start)
                    steps[name] += orchestration
        finally:
            stop(server, "the benchmark's Prefect server")
    rows = [_table(f"A run's start (hosts, input check, engines), dp={args.dp}, torch engines, tiny models ({cpu_model()})",
                   f"a run's start at dp={args.dp}, median s", runs, args.baseline, "runs, s",
                   lambda v: ", ".join(f"{x:.2f}" for x in v))]
    if steps["yattflow"] and steps["baseline"]:
        rows.append(_table(f"A step's orchestration (step_s - engine_s), dp={args.dp}, steps 2 to {args.steps - 1} of each run",
                           f"a step's orchestration at dp={args.dp}, median s", steps, args.baseline, "steps", len))
    return {"runs": runs, "steps": steps, "rows": rows}


if __name__ == "__main__":
    main()
