"""The embedded default, step by step: ``yattflow train`` with no Prefect server of the user's,
dp=2, on Prefect's SQLite database, tiny models (the engines take ~0.2 s a step, so what is left
is orchestration).

    .venv/bin/python -m bench.embedded [--steps 50] [--dp 2]

Two servers, the same run config, run one after the other in one process tree:

- **yattflow**: the temporary server ``yattflow train`` starts when no ``PREFECT_API_URL`` is set
  (``flows/prefect_server.py``: SQLite write transactions opened IMMEDIATE, so concurrent
  writers wait for each other);
- **baseline**: Prefect's own ``prefect server start`` on SQLite (deferred write transactions: a
  writer that loses the race fails with "database is locked", and the client retries after 2 s).

Each row is a figure over the run's steps, from the train flow's step log line (``step_s``:
the step as the run pays for it). Prints the CPU, a table and the ratio yattflow / baseline.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench import cpu_model

ROOT = Path(__file__).resolve().parent.parent
from tests.helpers import TASK  # the demo at test size
STEP = re.compile(r"step (\d+)/\d+ .*\(([\d.]+)s, ([\d.]+)s in engines\)")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=50, help="RL steps per run (default 50)")
    p.add_argument("--dp", type=int, default=2, help="DP groups (default 2)")
    return p.parse_args(argv)


def _yattflow(*words: str, env: dict) -> str:
    done = subprocess.run([sys.executable, "-m", "flows.cli", *words], cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"yattflow {' '.join(words)} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return done.stdout + done.stderr


def _prefect_server(home: Path, env: dict) -> tuple[subprocess.Popen, str]:
    """Prefect's own server on SQLite, as a user would start it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/api"
    proc = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                            env=env | {"PREFECT_UI_ENABLED": "0"}, stdout=open(home / "baseline-server.log", "ab"),
                            stderr=subprocess.STDOUT)
    deadline = time.time() + 120
    while True:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2)
            return proc, url
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"prefect server did not start; see {home / 'baseline-server.log'}") from None
            time.sleep(0.5)


def figures(log: str) -> dict:
    steps = [(int(n), float(s), float(e)) for n, s, e in STEP.findall(log)]
    seconds = [s for _, s, _ in steps]
    outside = [s - e for _, s, e in steps]
    return {"steps": len(steps), "median_s": statistics.median(seconds), "p90_s": sorted(seconds)[int(0.9 * (len(seconds) - 1))],
            "slowest_s": max(seconds), "slowest_step": max(steps, key=lambda x: x[1])[0],
            "outside_engines_median_s": statistics.median(outside), "total_s": sum(seconds)}


def main(argv=None) -> dict:
    args = parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="yattflow-bench-embedded-", dir=os.environ.get("YATTFLOW_BENCH_DIR")))
    base_env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    store = f"storage.root={work / 'store'}"
    run = [*TASK, store, f"dp={args.dp}", f"steps={args.steps}"]
    results = {}
    home = work / "home-yattflow"
    env = base_env | {"PREFECT_HOME": str(home)}
    _yattflow("prepare", *TASK, store, env=env)
    results["yattflow"] = figures(_yattflow("train", *run, "name=embedded-yattflow", env=env))
    home = work / "home-baseline"
    home.mkdir()
    env = base_env | {"PREFECT_HOME": str(home)}
    server, url = _prefect_server(home, env)
    try:
        results["baseline"] = figures(_yattflow("train", *run, "name=embedded-baseline", env=env | {"PREFECT_API_URL": url}))
    finally:
        server.terminate()
        server.wait(timeout=30)
    labels = {"median_s": "step s, median", "p90_s": "step s, p90", "slowest_s": "step s, slowest",
              "outside_engines_median_s": "step s outside the engines, median", "total_s": f"all {args.steps} steps, s"}
    rows = []
    print(f"\n### The embedded default: dp={args.dp}, {args.steps} steps on SQLite, tiny models ({cpu_model()})\n")
    print("| figure | yattflow (immediate SQLite writes) | baseline (Prefect's server) | ratio (yattflow / baseline) |")
    print("|---|---:|---:|---:|")
    for key, label in labels.items():
        y, b = results["yattflow"][key], results["baseline"][key]
        rows.append({"figure": f"embedded default dp={args.dp}: {label}", "yattflow": y, "baseline": b, "ratio": y / b if b else None})
        print(f"| {label} | {y:.2f} | {b:.2f} | {y / b:.2f} |")
    print(f"\nslowest step: yattflow step {results['yattflow']['slowest_step']}, baseline step {results['baseline']['slowest_step']}")
    return {"rows": rows, **results}


if __name__ == "__main__":
    main()
