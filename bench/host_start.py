"""A run's start as a deployment's flow run pays it: the engine hosts started, the input checked by the
first host, every group's engines loaded, against an earlier commit.

    .venv/bin/python -m bench.host_start [--baseline 5a0cffa] [--dp 2] [--repeats 3]

The ``train`` flow of a tiny run (``TINY``, ``--dp`` groups on the torch engines, one step) in a fresh
process, as a worker runs a deployment's flow run: no command ran the pre-flight, so rank 0's host
checks the input before any engine loads (flows/preflight.py). One Prefect server for every run; this
checkout and ``--baseline`` (a git worktree, the same interpreter) alternate. The figure is the seconds
from the run's own log (the flow's beginning to the first step's sub-flow's): the hosts' start, the input check,
the engines' load and the held-out evaluation before RL.

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
from tests.helpers import TINY

ROOT = Path(__file__).resolve().parent.parent
# Prefect's console lines: "HH:MM:SS.mmm | LEVEL | Flow run 'name' - message"
LINE = re.compile(r"^(\d\d:\d\d:\d\d\.\d+) \| \w+ +\| (?:Flow|Task) run '[^']*' - (.*)$", re.M)
FLOW = "import asyncio, sys; from flows.training import train; asyncio.run(train(overrides=sys.argv[1:]))"


def _start_s(checkout: Path, words: list[str], env: dict) -> float:
    """Seconds from the ``train`` flow's beginning to the first step's sub-flow's, by their log lines."""
    out = subprocess.run([sys.executable, "-c", FLOW, *words], cwd=checkout, env=env, capture_output=True, text=True)
    lines = [(datetime.strptime(t, "%H:%M:%S.%f"), text) for t, text in LINE.findall(out.stdout + out.stderr)]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"the train flow failed in {checkout}:\n{(out.stdout + out.stderr)[-3000:]}")
    begun = next(t for t, text in lines if text.startswith("Beginning flow run 'train-"))
    ready = next(t for t, text in lines if text.startswith("Beginning subflow run 'iteration-0000'"))
    return (ready - begun).total_seconds()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", default="5a0cffa", help="the commit to compare with (default %(default)s)")
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    runs: dict[str, list[float]] = {"yattflow": [], "baseline": []}
    with against(args.baseline, "yattflow-bench-host-start-") as (work, baseline, env, store):
        server, url = started_server(env, work / "server.log", "the benchmark's Prefect server")
        try:
            for i in range(args.repeats):
                for name, checkout in (("baseline", baseline), ("yattflow", ROOT)):
                    words = [*TINY, store, f"dp={args.dp}", "steps=1", f"name=start-{name}-{i}"]
                    runs[name].append(_start_s(checkout, words, env | {"PREFECT_API_URL": url}))
        finally:
            stop(server, "the benchmark's Prefect server")
    print(f"\n### A run's start (hosts, input check, engines), dp={args.dp}, torch engines, tiny models ({cpu_model()})\n")
    print("| | runs, s | median, s |\n|---|---|---:|")
    for name, label in (("yattflow", "this checkout"), ("baseline", f"baseline ({args.baseline})")):
        print(f"| {label} | {', '.join(f'{s:.2f}' for s in runs[name])} | {statistics.median(runs[name]):.2f} |")
    now, before = statistics.median(runs["yattflow"]), statistics.median(runs["baseline"])
    print(f"\nratio of the medians: {now / before:.2f}")
    return {"runs": runs, "rows": [{"figure": f"a run's start at dp={args.dp}, median s", "yattflow": now, "baseline": before,
                                    "ratio": now / before}]}


if __name__ == "__main__":
    main()
