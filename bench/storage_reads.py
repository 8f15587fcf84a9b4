"""What a step's engine hosts read from object storage, against an earlier commit (issue 68: no read-back).

    .venv/bin/python -m bench.storage_reads [--baseline 1ee9484] [--dp 2]

For this checkout and for ``--baseline`` (a git worktree of that commit, run by the same interpreter), two tiny
runs each (``TASK``, ``--dp`` groups, on a local store): ``--short`` steps and ``--long`` steps. Every engine host
counts the bytes it reads through fsspec (the store's only reader of stage outputs, state and manifests; a
``sitecustomize`` on ``PYTHONPATH`` wraps ``LocalFileOpener.read`` in the host processes, nothing in the project
changes); a step's bytes are (long run - short run) / (long - short) steps, so setup and the last evaluation
cancel out. Prints the CPU, a table and the ratio (this checkout / baseline).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from bench import against, cpu_model
from tests.helpers import TASK  # the demo at test size

ROOT = Path(__file__).resolve().parent.parent
COUNTER = '''
import os, sys
if "engines.host" in " ".join(sys.orig_argv):
    from fsspec.implementations.local import LocalFileOpener
    _read, _out = LocalFileOpener.read, os.path.join(os.environ["YATTFLOW_BENCH_READS"], str(os.getpid()))

    def read(self, *args, **kwargs):
        data = _read(self, *args, **kwargs)
        with open(_out, "a") as f:
            f.write(f"{len(data)}\\n")
        return data

    LocalFileOpener.read = read
'''


def _host_bytes(checkout: Path, words: list[str], env: dict, counts: Path) -> int:
    counts.mkdir(parents=True)
    out = subprocess.run([sys.executable, "-m", "flows.cli", "train", *words], cwd=checkout, capture_output=True, text=True,
                         env=env | {"YATTFLOW_BENCH_READS": str(counts)})
    if out.returncode != 0:
        raise RuntimeError(f"yattflow train failed in {checkout}:\n{out.stdout[-2000:]}{out.stderr[-3000:]}")
    return sum(int(n) for f in counts.iterdir() for n in f.read_text().split())


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", default="1ee9484", help="the commit to compare with (default %(default)s)")
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--short", type=int, default=2)
    p.add_argument("--long", type=int, default=6)
    args = p.parse_args(argv)
    results = {}
    with against(args.baseline, "yattflow-bench-reads-") as (work, baseline, env, store):
        (work / "site").mkdir()
        (work / "site" / "sitecustomize.py").write_text(COUNTER)  # counts in the engine hosts of the runs below
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(work / "site"), os.environ.get("PYTHONPATH")]))
        for name, checkout in (("baseline", baseline), ("yattflow", ROOT)):
            runs = {steps: _host_bytes(checkout, [*TASK, store, f"dp={args.dp}", f"steps={steps}", "data.heldout=null",
                                                  f"name=reads-{name}-{steps}"], env, work / f"{name}-{steps}")
                    for steps in (args.short, args.long)}
            results[name] = {"runs": runs, "step_kb": (runs[args.long] - runs[args.short]) / (args.long - args.short) / 1024}
    y, b = results["yattflow"]["step_kb"], results["baseline"]["step_kb"]
    print(f"\n### What a step's engine hosts read from storage: dp={args.dp}, tiny models ({cpu_model()})\n")
    print(f"| figure | this checkout | baseline ({args.baseline}) | ratio |")
    print("|---|---:|---:|---:|")
    print(f"| KB read per step, all {args.dp} hosts | {y:.1f} | {b:.1f} | {y / b:.2f} |")
    for steps in (args.short, args.long):
        print(f"| KB read in a {steps}-step run | {results['yattflow']['runs'][steps] / 1024:.1f} | "
              f"{results['baseline']['runs'][steps] / 1024:.1f} | |")
    return results


if __name__ == "__main__":
    main()
