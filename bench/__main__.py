"""Every benchmark, one after another, and one combined table.

    .venv/bin/python -m bench                          # every CPU benchmark with its defaults (~12 min on 2 cores)
    .venv/bin/python -m bench --quick                  # shorter settings of each (QUICK below)
    .venv/bin/python -m bench --only controller,balance
    .venv/bin/python -m bench --args overhead="--scaling '' --steps 4" --json all.json

Each benchmark module of ``bench/`` runs in its own subprocess (``python -m bench --one MODULE OUT ARGS``:
imports it, calls ``main(argv)``, writes the figures it returns as JSON), prints its own tables
as it goes, and this process then turns the figures into rows of one table — benchmark, figure,
yattflow, baseline, ratio (yattflow / baseline) — each pair measured in the same run of that
module. A module whose figures carry ``rows`` ({figure, yattflow, baseline, ratio}: controller,
sampling, scale, placement, floor) is taken as it is; for the others, ``EXTRACT`` below names the figures (their ``main``
return values are not changed for this). A module added to ``bench/`` later runs too; its rows
appear once it returns ``rows``.

What is "baseline" differs per module (see each module's docstring): raw ``LLM.generate``
(rollout), the SQLite Prefect server against PostgreSQL (overhead), unbalanced DP groups
(balance), a synchronous checkpoint (checkpoint), Prefect's own server on SQLite (embedded), fixed waves (sampling), full colocation (placement), a single controller
that gathers and scatters every stage's data (controller), hosts started fresh against forked (heal), the SQLite server against PostgreSQL at 1-64 DP
groups with timing-stub engines, and Prefect's floor beside each (scale), Prefect's default server against
one with a batched task-run recorder (floor), a DP group of one Megatron rank against one of two (sync), episodes
one at a time against batched (agents). ``megatron_gpu`` needs CUDA and is
skipped without it; ``rollout`` needs vLLM.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import cpu_model

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

ORDER = ["rollout", "balance", "checkpoint", "sampling", "placement", "controller", "embedded", "overhead", "floor", "events", "scale",
         "megatron_gpu"]
# run on their own only: seeds is the demo ten times over (~40 min), a learning check, not a speed figure;
# lora_memory measures memory, not speed; packing takes ~8 min (512 x 8 train steps, each mode in its own process)
APART = {"seeds", "vs_trl", "train_step", "lora_memory", "packing"}
QUICK = {
    "rollout": "--repeats 3 --sizes 64,256 --sync-repeats 3",
    "agents": "--repeats 1 --episodes 16",
    "balance": "--repeats 4 --warmup 1",
    "checkpoint": "--repeats 3",
    "sampling": "--steps 8",
    "placement": "--repeats 1 --full-threads 1",
    "controller": "--steps 2",
    "host_start": "--repeats 1",
    "heal": "--repeats 1",
    "embedded": "--steps 10",
    "overhead": "--scaling '' --steps 4",
    "floor": "--dps 4 --repeats 1",
    "events": "--steps 40",
    "scale": "--dps 1,4,16 --steps 3 --real-steps 3",
    "megatron_gpu": "--sizes 0.44b --layers 4 --steps 3",
}


def _g(d, *keys):
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def _pair(rows, figure, yatt, base):
    if yatt is None and base is None:
        return
    r = yatt / base if isinstance(yatt, (int, float)) and isinstance(base, (int, float)) and base else None
    rows.append({"figure": figure, "yattflow": yatt, "baseline": base, "ratio": r})


def rollout_rows(f: dict) -> list[dict]:
    rows: list[dict] = []
    tp = f.get("throughput", {})
    _pair(rows, "generated tokens/s: VLLMGenerator vs raw LLM.generate", _g(tp, "ours", "tokens_per_s"), _g(tp, "raw", "tokens_per_s"))
    _pair(rows, "generated tokens/s: Prefect rollout task → host → Parquet vs raw LLM.generate",
          _g(tp, "task", "tokens_per_s"), _g(tp, "raw", "tokens_per_s"))
    for r in f.get("weight_sync", []):
        _pair(rows, f"weight sync ms, hidden {r['hidden']} ({r['params']:,} params; no baseline)", r["ms"], None)
    return rows


def overhead_rows(f: dict) -> list[dict]:
    rows: list[dict] = []
    f = f.get("tables", f)  # main() returns its runs with the tables it printed under "tables"
    main = f.get("main", {})
    for label, key in (("iteration wall time (s)", "iteration_s"), ("orchestration overhead per iteration (s)", "overhead_s"),
                       ("overhead per DP group (s)", "overhead_per_group_s"), ("overhead share of iteration", "overhead_share")):
        _pair(rows, f"{label}: PostgreSQL server vs SQLite server", _g(main, "postgresql", key), _g(main, "sqlite", key))
    for dp, sides in (f.get("scaling") or {}).items():
        _pair(rows, f"overhead per DP group at dp={dp} (s): PostgreSQL vs SQLite",
              _g(sides, "postgresql", "overhead_per_group_s"), _g(sides, "sqlite", "overhead_per_group_s"))
    return rows


def balance_rows(f: dict) -> list[dict]:
    rows: list[dict] = []
    for v in ("padded", "micro"):
        b, u = f.get(v, {}).get("balanced", {}), f.get(v, {}).get("unbalanced", {})
        _pair(rows, f"[{v}] slowest / mean busy time, 2 ranks at once: balanced vs unbalanced",
              _g(b, "busy", "slowest_over_mean"), _g(u, "busy", "slowest_over_mean"))
        _pair(rows, f"[{v}] train step wall time (s): balanced vs unbalanced", b.get("wall_s"), u.get("wall_s"))
    return rows


def checkpoint_rows(f: dict) -> list[dict]:
    rows: list[dict] = []
    _pair(rows, "train-loop stall per checkpoint (s): async vs sync", _g(f, "stall_s", "async"), _g(f, "stall_s", "sync"))
    _pair(rows, "checkpoint written after (s): async vs sync", _g(f, "write_s", "async"), _g(f, "write_s", "sync"))
    _pair(rows, "train step (s): overlapping an async write vs alone", _g(f, "train_step_s", "during_write"),
          _g(f, "train_step_s", "alone"))
    return rows


def megatron_gpu_rows(f: dict) -> list[dict]:
    """Per size: the Megatron engine against plain transformers (SDPA, bf16 autocast, fused AdamW)."""
    rows: list[dict] = []
    by = {(r["size"], r["engine"]): r for r in f.get("runs", [])}
    for size in dict.fromkeys(r["size"] for r in f.get("runs", [])):
        ours, base = by.get((size, "megatron"), {}), by.get((size, "transformers"), {})
        label = f"{size}, seq {ours.get('seq') or base.get('seq')}"
        _pair(rows, f"train tokens/s on {f.get('device')}, {label}: Megatron engine vs transformers + SDPA",
              ours.get("tokens_per_s", ours.get("error")), base.get("tokens_per_s", base.get("error")))
        _pair(rows, f"MFU, {label}: Megatron engine vs transformers + SDPA", ours.get("mfu"), base.get("mfu"))
        _pair(rows, f"peak GiB, {label}: Megatron engine vs transformers + SDPA", ours.get("peak_gib"), base.get("peak_gib"))
    return rows


EXTRACT = {"rollout": rollout_rows, "overhead": overhead_rows, "balance": balance_rows, "checkpoint": checkpoint_rows,
           "megatron_gpu": megatron_gpu_rows}


def rows_of(module: str, figures: dict) -> list[dict]:
    if isinstance(figures.get("rows"), list):
        return figures["rows"]
    extract = EXTRACT.get(module)
    return extract(figures) if extract else []


def modules() -> list[str]:
    found = sorted(p.stem for p in Path(__file__).parent.glob("*.py") if not p.stem.startswith("_") and p.stem not in APART)
    return [m for m in ORDER if m in found] + [m for m in found if m not in ORDER]


def unavailable(module: str) -> str | None:
    """Why ``module`` cannot run here, or None."""
    if module == "megatron_gpu":
        done = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                              capture_output=True, text=True)
        if done.stdout.strip() != "True":
            return "needs a CUDA device (none here)"
    if module == "rollout" and importlib.util.find_spec("vllm") is None:
        return "needs vLLM (not installed)"
    return None


def run_one(module: str, argv: list[str], out: str) -> None:
    """In the subprocess: run one benchmark module's ``main`` and write what it returns."""
    figures = importlib.import_module(f"bench.{module}").main(argv)
    Path(out).write_text(json.dumps(figures, default=str))


def fmt(x) -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        return f"{x:.3g}" if abs(x) < 1000 else f"{x:,.0f}"
    return str(x)


def table(results: dict) -> str:
    lines = ["| benchmark | figure | yattflow | baseline | ratio (yattflow / baseline) |", "|---|---|---:|---:|---:|"]
    for module, res in results.items():
        if res.get("skipped") or res.get("failed"):
            lines.append(f"| {module} | {'skipped: ' + res['skipped'] if res.get('skipped') else 'FAILED: ' + res['failed']} | | | |")
            continue
        for r in res["rows"]:
            lines.append(f"| {module} | {r['figure']} | {fmt(r['yattflow'])} | {fmt(r['baseline'])} | {fmt(r['ratio'])} |")
        if not res["rows"]:
            lines.append(f"| {module} | (no rows: see its own tables above) | | | |")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", help="comma-separated modules to run (default: all)")
    p.add_argument("--skip", default="", help="comma-separated modules to leave out")
    p.add_argument("--quick", action="store_true", help="shorter settings of each benchmark (QUICK)")
    p.add_argument("--args", action="append", default=[], metavar='MODULE="ARGS"',
                   help="extra arguments for one module (repeatable), e.g. overhead=\"--steps 4\"")
    p.add_argument("--json", metavar="FILE", help="also write every module's figures and the rows as JSON")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--one"]:  # in the subprocess: --one MODULE OUT [the module's own arguments]
        run_one(argv[1], argv[3:], argv[2])
        return {}
    args = parse_args(argv)
    chosen = [m.strip() for m in args.only.split(",")] if args.only else modules()
    skip = {m.strip() for m in args.skip.split(",") if m.strip()}
    extra = {}
    for item in args.args:
        name, _, value = item.partition("=")
        extra[name.strip()] = shlex.split(value)
    results: dict = {}
    t0 = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    with tempfile.TemporaryDirectory(prefix="yattflow-bench-all-") as tmp:
        for module in chosen:
            if module in skip:
                continue
            why = unavailable(module)
            if why:
                print(f"\n## bench.{module}: skipped, {why}", flush=True)
                results[module] = {"skipped": why}
                continue
            argv_m = (shlex.split(QUICK.get(module, "")) if args.quick else []) + extra.get(module, [])
            out = Path(tmp) / f"{module}.json"
            print(f"\n## bench.{module} {' '.join(argv_m)}".rstrip(), flush=True)
            start = time.perf_counter()
            done = subprocess.run([sys.executable, "-m", "bench", "--one", module, str(out), *argv_m], cwd=ROOT, env=env)
            seconds = time.perf_counter() - start
            if done.returncode != 0 or not out.exists():
                results[module] = {"failed": f"exit code {done.returncode}", "seconds": seconds}
                continue
            figures = json.loads(out.read_text())
            results[module] = {"rows": rows_of(module, figures), "seconds": seconds, "figures": figures}
    text = table(results)
    print(f"\n## All benchmarks on {cpu_model()}, {os.cpu_count()} cores ({time.perf_counter() - t0:.0f}s: "
          + ", ".join(f"{m} {r['seconds']:.0f}s" for m, r in results.items() if "seconds" in r) + ")\n")
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    return {"results": results, "table": text}


if __name__ == "__main__":
    main()
