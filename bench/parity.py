"""The parity tests on every CPU kernel path this machine has: are their tolerances about the code,
or about one CPU's floating-point kernels?

    .venv/bin/python -m bench.parity                      # the parity test files, four paths (~15 min on 2 cores)
    .venv/bin/python -m bench.parity --files tests/test_dp.py --paths best-2,default-1

Paths: ``best`` (the kernels torch picks for this CPU: AVX-512, AMX where there is one) and
``default`` (``ATEN_CPU_CAPABILITY=default``, the plain kernels), each with 1 and 2 threads
(``OMP_NUM_THREADS``; tests that pin their own threads keep them). Each path runs the files in a
pytest of its own with ``YATTFLOW_PARITY_LOG`` set, so every figure a parity test checks
(``tests/helpers.py: parity``) is recorded; the table gives each check's largest figure per path
and its tolerance. Figures that a control must exceed ("control: ...") are the smallest.
Every path must pass: a test that fails on one path only has a tolerance tuned to one CPU.
``tests/test_vllm.py`` runs on the ``best`` paths only: vLLM's CPU build compiles its kernels with
torch's inductor for this CPU, which fails under ``ATEN_CPU_CAPABILITY=default`` (a C++ compile
error, not a tolerance).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FILES = ["tests/test_dp.py", "tests/test_megatron.py", "tests/test_megatron_critic.py", "tests/test_megatron_vision.py",
         "tests/test_microbatch.py", "tests/test_algorithms.py", "tests/test_architectures.py", "tests/test_balance.py",
         "tests/test_vllm.py"]
PATHS = {"best-2": (None, 2), "best-1": (None, 1), "default-2": ("default", 2), "default-1": ("default", 1)}


def run_path(name: str, files: list[str]) -> dict:
    capability, threads = PATHS[name]
    if capability == "default":
        files = [f for f in files if not f.endswith("test_vllm.py")]
    with tempfile.NamedTemporaryFile(suffix=".jsonl", delete=False) as f:
        log = f.name
    env = dict(os.environ, YATTFLOW_PARITY_LOG=log, OMP_NUM_THREADS=str(threads))
    env.pop("ATEN_CPU_CAPABILITY", None)
    env.pop("YATTFLOW_TEST_TIER", None)  # every test of the files, whichever tier runs this
    if capability:
        env["ATEN_CPU_CAPABILITY"] = capability
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-300:]
    failed = re.findall(r"^FAILED (\S+)", proc.stdout, re.M)
    figures: dict[str, float] = {}
    for line in Path(log).read_text().splitlines():
        record = json.loads(line)
        pick = min if record["check"].startswith("control") else max
        figures[record["check"]] = pick(figures.get(record["check"], record["value"]), record["value"])
    Path(log).unlink()
    print(f"[parity] {name}: {summary}", flush=True)
    return {"summary": summary, "failed": failed, "figures": figures}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--files", default=",".join(FILES))
    p.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated, of {', '.join(PATHS)}")
    args = p.parse_args(argv)
    paths = args.paths.split(",")
    results = {name: run_path(name, args.files.split(",")) for name in paths}
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = re.search(r"Model name:\s*(.+)", cpu)
    print(f"\n### Parity figures on {model.group(1).strip() if model else 'this CPU'}, {os.cpu_count()} CPUs\n")
    print("| check | " + " | ".join(paths) + " |")
    print("|---|" + "---:|" * len(paths))
    checks = sorted({c for r in results.values() for c in r["figures"]})
    for check in checks:
        cells = [f"{results[n]['figures'][check]:.2e}" if check in results[n]["figures"] else "–" for n in paths]
        print(f"| {check} | " + " | ".join(cells) + " |")
    print("\n| path | pytest |\n|---|---|")
    for name in paths:
        print(f"| {name} | {results[name]['summary']}" + (f"; failed: {', '.join(results[name]['failed'])}" if results[name]["failed"] else "")
              + " |")
    return {"paths": results}


if __name__ == "__main__":
    result = main()
    sys.exit(1 if any(r["failed"] for r in result["paths"].values()) else 0)
