"""A run that heals a lost host, its hosts started fresh against forked from the process's fork server.

    .venv/bin/python -m bench.heal [--dp 2] [--steps 3] [--repeats 3]

The ``train`` flow of a tiny run (``TASK``, ``--dp`` groups on the torch engines) in a fresh process, one
host SIGKILLed in step 1's rollout (``engines/host/faults.py``): the run restarts its hosts and resumes
(``retries.run``). Baseline: ``hosts.fork=false``, each host a ``python -m engines.host`` that imports the
engines; against it ``hosts.fork=true``, the hosts forked from one server that the process keeps
(``engines/wire/launch.py``, ``shared_forkserver``), the heal's too. One Prefect server for every run; the two
settings alternate. Figures, from the run's own log lines: the start (the flow's beginning to the first
step's sub-flow's), the heal (the attempt's failure to the resumed run's first sub-flow) and the whole run.

Prints the CPU, a table per figure and the ratios of the medians (fork / fresh).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import cpu_model
from bench.host_start import _table, train_log
from flows.prefect_server import started_server, stop
from tests.helpers import TASK

ROOT = Path(__file__).resolve().parent.parent


def _run(words: list[str], env: dict) -> dict[str, float]:
    """The start, the heal and the whole run of one ``train`` flow, in seconds, by its log lines."""
    lines, _ = train_log(ROOT, words, env)
    begun = next(t for t, text in lines if text.startswith("Beginning flow run 'train-"))
    first = next(t for t, text in lines if text.startswith("Beginning subflow run 'iteration-"))
    failed = next(t for t, text in lines if "Restarting the engine hosts" in text)
    resumed = next(t for t, text in lines if t >= failed and text.startswith("Beginning subflow run 'iteration-"))
    ended = next(t for t, text in reversed(lines) if text.startswith("Finished in state Completed"))
    return {"start": (first - begun).total_seconds(), "heal": (resumed - failed).total_seconds(),
            "run": (ended - begun).total_seconds()}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    figures = {key: {"yattflow": [], "baseline": []} for key in ("start", "heal", "run")}
    work = Path(tempfile.mkdtemp(prefix="yattflow-bench-heal-"))
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"} | {"PREFECT_HOME": str(work / "home")}
    store = f"storage.root={work / 'store'}"
    subprocess.run([sys.executable, "-m", "flows.cli", "prepare", *TASK, store], cwd=ROOT, env=env,
                   capture_output=True, check=True)
    server, url = started_server(env, work / "server.log", "the benchmark's Prefect server")
    try:
        for i in range(args.repeats):
            for name, fork in (("baseline", "false"), ("yattflow", "true")):
                fired = work / f"fired-{name}-{i}"
                fired.mkdir()
                words = [*TASK, store, f"dp={args.dp}", f"steps={args.steps}", f"name=heal-{name}-{i}",
                         f"hosts.fork={fork}", "data.heldout=null", "retries.run=1"]
                faults = {"YATTFLOW_FAULTS": f"rollout@1:dp-{args.dp - 1}:kill", "YATTFLOW_FAULTS_FIRED": str(fired)}
                for key, seconds in _run(words, env | faults | {"PREFECT_API_URL": url}).items():
                    figures[key][name].append(seconds)
    finally:
        stop(server, "the benchmark's Prefect server")
    where = f"dp={args.dp}, {args.steps} steps, torch engines, tiny models ({cpu_model()})"
    titles = {"start": "The run's start (hosts, input check, engines)", "heal": "The heal (failure to the resumed step)",
              "run": "The whole run"}
    rows = [_table(f"{titles[key]}, {where}; baseline = hosts started fresh", f"a healed run's {key}, median s",
                   figures[key], "hosts.fork=false", "runs, s", lambda v: ", ".join(f"{x:.2f}" for x in v),
                   now="hosts.fork=true")
            for key in titles]
    return {"figures": figures, "rows": rows}


if __name__ == "__main__":
    main()
