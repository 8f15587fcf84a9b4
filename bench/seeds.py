"""The demo across seeds and CPU floating-point paths: does the warm start land in its band,
and does RL lift it, whatever the machine?

    .venv/bin/python -m bench.seeds                          # seeds 0-4 on both paths (~55 min on 2 cores)
    .venv/bin/python -m bench.seeds --seeds 0,1 --paths best --steps 20
    .venv/bin/python -m bench.seeds --seeds 3 --paths best --keep /tmp/seeds --variant 'tis=rollout.max_staleness=1 ...'

Each row is one ``yattflow demo`` (prepare, then RL on ``deployments/demo.yaml``) in a
subprocess with a storage root of its own. A *path* is a setting of torch's CPU float kernels:

* ``best``: the kernels torch picks for this CPU (AVX-512, AMX where present), 2 threads;
* ``default``: ``ATEN_CPU_CAPABILITY=default`` (plain vectorised kernels), 1 thread.

Prints the CPU (``lscpu``'s model name), one row per run (seed, path, policy SFT steps, SFT %,
RL %, lift, the GenRM's held-out verdict accuracy and SFT steps, seconds) and the range of each
figure; a run that fails is a row saying why, and the command exits 1. Not part of
``python -m bench``: it is a check that the demo learns, not a speed figure.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import cpu_model

ROOT = Path(__file__).resolve().parents[1]
PATHS = {
    "best": {"OMP_NUM_THREADS": "2"},
    "default": {"ATEN_CPU_CAPABILITY": "default", "OMP_NUM_THREADS": "1"},
}
RESULT = re.compile(r"([\d.]+)% before RL → ([\d.]+)% after")
SFT_STEPS = re.compile(r"policy model: held-out exact match [\d.]+% after (\d+) SFT steps")
JUDGE = re.compile(r"judge model: held-out verdict accuracy ([\d.]+)% after (\d+) SFT steps")


PREFERENCES = "data/preferences"  # where an algorithm that learns from a preference dataset finds the demo's


def needs(algorithm: str):
    """What ``train.algorithm.name=algorithm`` needs (engines/rl/base.py ``Needs``)."""
    from engines.rl.registry import ALGORITHMS

    return next(c for c in ALGORITHMS if c.model_fields["name"].default == algorithm)().needs


def run_demo(seed: int, path: str, steps: int | None, root: str, config: str = "deployments/demo.yaml",
             algorithm: str | None = None, variant: tuple[str, list[str]] | None = None) -> dict:
    env = dict(os.environ, **PATHS[path])
    # another algorithm on the same root: the prepared data and SFT'd models are reused, the run is its own
    picked = [f"train.algorithm.name={algorithm}", f"name=demo-{algorithm.replace('_', '-')}"] if algorithm else []
    if algorithm and needs(algorithm).preferences:  # its pairs: the demo's, which prepare builds where this names
        picked.append(f"data.preferences={PREFERENCES}")
    if variant:  # --variant: the same, with more overrides (e.g. off-policy overlap), a run of its own
        picked += [f"name=demo-{variant[0]}{'-' + algorithm.replace('_', '-') if algorithm else ''}", *variant[1]]
    command = [sys.executable, "-m", "flows.cli", "demo", "-c", str(ROOT / config),
               f"storage.root={root}", f"seed={seed}", *([f"steps={steps}"] if steps else []), *picked]
    start = time.perf_counter()
    out = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    log = out.stdout + out.stderr
    result, sft_steps, judge = RESULT.search(log), SFT_STEPS.search(log), JUDGE.search(log)
    row = {"seed": seed, "path": path, "sft_steps": int(sft_steps.group(1)) if sft_steps else None,
           "judge": f"{judge.group(1)}% in {judge.group(2)}" if judge else None, "seconds": round(seconds)}
    if out.returncode or not result:  # a row of its own: the other runs still tell where the demo lands
        failure = next((line for line in reversed(log.splitlines()) if "Error" in line), f"exit {out.returncode}")
        return {**row, "failed": failure.strip()[:300]}
    sft, rl = float(result.group(1)), float(result.group(2))
    return {**row, "sft": sft, "rl": rl, "lift": round(rl - sft, 1)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated seeds")
    parser.add_argument("--paths", default="best,default", help=f"comma-separated float paths: {', '.join(PATHS)}")
    parser.add_argument("--steps", type=int, default=None, help="RL steps per run (default: the config's)")
    parser.add_argument("--algorithms", default=None,
                        help="comma-separated train.algorithm.name values, each run on the same prepared data and models "
                        "(default: the config's algorithm only)")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=OVERRIDES",
                        help="also run each seed with these space-separated overrides, on the same prepared data and models "
                        "(repeatable), e.g. --variant 'offpolicy=rollout.max_staleness=1 train.old_policy=decoupled "
                        "train.off_policy_correction=tis'")
    parser.add_argument("--keep", default=None, metavar="DIR",
                        help="keep each seed's storage root under DIR (its runs' TensorBoard statistics: IS ratios, "
                        "staleness) instead of a temporary folder that is removed")
    parser.add_argument("--config", default="deployments/demo.yaml",
                        help="the demo's config, relative to the checkout (deployments/vision-demo.yaml: the vision demo)")
    args = parser.parse_args(argv)
    seeds, paths = [int(s) for s in args.seeds.split(",")], args.paths.split(",")
    unknown = set(paths) - set(PATHS)
    if unknown:
        parser.error(f"--paths: unknown {sorted(unknown)}; choose from {list(PATHS)}")
    cpu = cpu_model()
    steps = args.steps or "the config's"
    print(f"CPU: {cpu}; {args.config}: {len(seeds)} seeds x {len(paths)} paths, {steps} RL steps each\n")
    algorithms = args.algorithms.split(",") if args.algorithms else [None]
    variants = [None] + [(v.split("=", 1)[0], v.split("=", 1)[1].split()) for v in args.variant]
    print("| seed | path | algorithm | policy SFT steps | SFT % | RL % | lift (points) | GenRM SFT | seconds |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    rows = []
    with tempfile.TemporaryDirectory() if args.keep is None else contextlib.nullcontext(args.keep) as tmp:
        for seed in seeds:
            for path in paths:
                for algorithm, variant in ((a, v) for a in algorithms for v in variants):  # the first one's seconds include prepare
                    r = run_demo(seed, path, args.steps, os.path.join(tmp, f"{path}-{seed}"), args.config, algorithm, variant)
                    r["algorithm"] = (algorithm or "the config's") + (f" + {variant[0]}" if variant else "")
                    rows.append(r)
                    figures = f"{r['sft']} | {r['rl']} | {r['lift']}" if "failed" not in r else f"failed: {r['failed']} | | "
                    print(f"| {seed} | {path} | {r['algorithm']} | {r['sft_steps']} | {figures} | {r['judge']} | "
                          f"{r['seconds']} |", flush=True)
    done = [r for r in rows if "failed" not in r]
    span = {k: (min(r[k] for r in done), max(r[k] for r in done)) for k in ("sft", "rl", "lift")} if done else {}
    if span:
        print(f"\nSFT {span['sft'][0]}-{span['sft'][1]}%, after RL {span['rl'][0]}-{span['rl'][1]}%, "
              f"lift {span['lift'][0]}-{span['lift'][1]} points; {len(rows) - len(done)} of {len(rows)} runs failed ({cpu})")
        for algorithm in dict.fromkeys(r["algorithm"] for r in done) if len(algorithms) + len(variants) > 2 else ():
            lifts = [r["lift"] for r in done if r["algorithm"] == algorithm]
            print(f"{algorithm}: lift {min(lifts)}-{max(lifts)} points over {len(lifts)} runs")
    return {"cpu": cpu, "rows": rows, "span": span, "failed": len(rows) - len(done)}


if __name__ == "__main__":
    sys.exit(1 if main()["failed"] else 0)
