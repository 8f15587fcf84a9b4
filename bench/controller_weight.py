"""The controller's weight: what the process that runs ``yattflow train`` loads, against an earlier commit.

    .venv/bin/python -m bench.controller_weight [--baseline 6155c6d] [--steps 4] [--dp 2]

For this checkout and for ``--baseline`` (a git worktree of that commit, run by the same interpreter), in fresh
processes, one after the other:

- import s: ``import flows.training`` (median of 3), and how long ``yattflow train`` takes to name an unknown
  config key (the CLI's start, then its first line);
- the ``yattflow train`` process of a tiny run (``TASK``, ``--dp`` groups, ``--steps`` steps, on the temporary
  server it starts): its peak RSS (``VmHWM`` of /proc/PID/status, polled until it exits; its engine hosts are
  other processes and not counted) and whether torch was in it (libtorch in /proc/PID/maps);
- the step as the run pays for it: the median of the seconds each ``train step N/S`` line shows.

Prints the CPU, a table and the ratios (this checkout / baseline).
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import against, cpu_model
from tests.helpers import TASK  # the demo at test size

ROOT = Path(__file__).resolve().parent.parent
STEP = re.compile(r"^train step \d+/\d+ .*, ([\d.]+)s \(", re.M)  # the plain step line of `yattflow train`


def _import_s(checkout: Path) -> float:
    code = "import time; t = time.perf_counter(); import flows.training; print(time.perf_counter() - t)"
    return statistics.median(float(subprocess.run([sys.executable, "-c", code], cwd=checkout, capture_output=True,
                                                   text=True, check=True).stdout) for _ in range(3))


def _first_line_s(checkout: Path) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "flows.cli", "train", "no_such_key=1"], cwd=checkout, capture_output=True)
    return time.perf_counter() - start


def _watched_train(checkout: Path, words: list[str], env: dict) -> dict:
    """``yattflow train words`` from ``checkout``: its peak RSS, torch in it or not, and its step figures."""
    log = tempfile.NamedTemporaryFile(prefix="yattflow-controller-", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "train", *words], cwd=checkout, env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    peak_kb, torch_loaded = 0, False
    while proc.poll() is None:
        try:
            status = Path(f"/proc/{proc.pid}/status").read_text()
            peak_kb = max(peak_kb, int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))))
            torch_loaded = torch_loaded or "libtorch" in Path(f"/proc/{proc.pid}/maps").read_text()
        except (OSError, StopIteration):
            pass
        time.sleep(0.2)
    text = Path(log.name).read_text()
    if proc.returncode != 0:
        raise RuntimeError(f"yattflow train failed in {checkout}:\n{text[-3000:]}")
    return {"peak_rss_mb": peak_kb / 1024, "torch": torch_loaded, "median_s": statistics.median(map(float, STEP.findall(text)))}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", default="6155c6d", help="the commit to compare with (default %(default)s)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--dp", type=int, default=2)
    args = p.parse_args(argv)
    results = {}
    with against(args.baseline, "yattflow-bench-controller-") as (_, baseline, env, store):
        for name, checkout in (("baseline", baseline), ("yattflow", ROOT)):
            results[name] = {"import_s": _import_s(checkout), "first_line_s": _first_line_s(checkout),
                             **_watched_train(checkout, [*TASK, store, f"dp={args.dp}", f"steps={args.steps}",
                                                         f"name=weight-{name}"], env)}
    print(f"\n### The controller: `yattflow train`, dp={args.dp}, {args.steps} steps, tiny models ({cpu_model()})\n")
    print(f"| figure | this checkout | baseline ({args.baseline}) | ratio |")
    print("|---|---:|---:|---:|")
    for key, label in (("import_s", "`import flows.training`, s"), ("first_line_s", "an unknown key named, s"),
                       ("peak_rss_mb", "the train process's peak RSS, MB"), ("median_s", "step, median s")):
        y, b = results["yattflow"][key], results["baseline"][key]
        print(f"| {label} | {y:.2f} | {b:.2f} | {y / b:.2f} |")
    print(f"| torch in the train process | {results['yattflow']['torch']} | {results['baseline']['torch']} | |")
    return results


if __name__ == "__main__":
    main()
