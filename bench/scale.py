"""Orchestration overhead at 1, 4, 16 and 64 DP groups, on SQLite and on PostgreSQL, with
TIMING-STUB engines (engines/backends/stub/engines.py: they sleep tokens x a per-token cost measured from the real
torch engines; for scale benchmarks, not training).

    .venv/bin/python -m bench.scale                         # ~10 min on 2 cores
    .venv/bin/python -m bench.scale --dps 1,4 --steps 3     # quicker
    .venv/bin/python -m bench.scale --profile               # + py-spy of the 16-group PostgreSQL run
    .venv/bin/python -m bench.scale --keep DIR; ... --store DIR/store   # prepare once, reuse the store
    .venv/bin/python -m bench.scale --dps 16,64 --groups-per-node 8  # CPU per component, node controllers (bench/nodes.py)

Everything but the engines is real: the ``flows.training:train`` flow in a fresh process, one
async DP-group sub-flow per group with its stage tasks, one engine-host process per group (the
hosts form a gloo group; the stub trainer does one real all-reduce per step), Parquet stage
outputs on local object storage, and real ``prefect server`` processes on SQLite and on a
throwaway PostgreSQL cluster (bench/overhead.py's servers, run function and figures: imported,
not copied). The store is bench/overhead.py's tiny one, built by the real ``prepare`` flow.

Overhead per iteration is ``step_s - engine_s`` (bench/overhead.py: ``step_s`` is the step's wall
time as the ``train`` flow sees it; ``engine_s`` the largest over groups of the seconds its host
spent on commands: the stubs' sleep, the hosts' Parquet reads and writes, the all-reduce). The goal (issue 6): on PostgreSQL at most 50 ms per DP group per
iteration, and flat as groups grow; the figure here is the overhead *including* the wait at the
all-reduce for late-started groups (bench/overhead.py's ``overhead_incl_wait_s``; ``engine_s`` counts that wait as
engine time), divided by ``dp``. A run is bounded by
``--timeout`` / ``--sqlite-timeout`` (SQLite at 16+ groups locks: "database is locked" 503s and
client back-offs); a run that hits it reports the iterations it finished (from its log) and is
marked as timed out. 64 groups run only when
the memory the engine hosts need (measured per host at the largest finished size) is available.

Beside each run, bench/floor.py's empty flow of the same shape on the same PostgreSQL server:
Prefect's own cost per group (one sub-flow and its stage tasks), the floor under any figure here.

The demo-config share (issue 6: overhead at most 10% of iteration time) is measured with the
real torch engines on deployments/demo.yaml (dp=2; its own store, built by ``prepare`` from that
config, ~2 min) on PostgreSQL (``--real-steps``; 0 skips it).

``main(argv)`` prints markdown tables and returns the figures with ``rows`` ({figure, yattflow,
baseline, ratio}: PostgreSQL as "yattflow", SQLite as "baseline") for ``python -m bench``.
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path


from bench import Sampler  # noqa: E402
from bench.overhead import (BACKENDS, TASK, PostgresCluster, PrefectServer, figures,  # noqa: E402
                            run_flow_subprocess, summarize_profile, train_once)

STUBS = ["rollout.backend=stub", "judge.backend=stub", "train.backend=stub"]
DEMO = str(Path(__file__).resolve().parents[1] / "deployments" / "demo.yaml")
GOAL_PER_GROUP_S = 0.050
GOAL_SHARE = 0.10
STEP_LINE = re.compile(r"step (\d+)/\d+ reward .* waves (\d+) \(([\d.]+)s, ([\d.]+)s in engines\)")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.split("\n\n")[0])
    p.add_argument("--dps", default="1,4,16,64", help="DP group counts, comma-separated (default 1,4,16,64)")
    p.add_argument("--steps", type=int, default=4, help="RL steps per run (default 4; the first and the last are not measured)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds per run before it is killed (default 60 + 20 per DP group: starting 16 hosts, each "
                        "importing torch, takes ~2 min on 2 busy cores)")
    p.add_argument("--sqlite-timeout", type=float, default=180, help="at most this many seconds per SQLite run (default 180)")
    p.add_argument("--store", metavar="DIR", help="a storage root prepared by an earlier run (--keep DIR: DIR/store); "
                   "default: prepare one (~100 s)")
    p.add_argument("--real-steps", type=int, default=4, help="steps of the real-engine dp=2 run (0: skip it)")
    p.add_argument("--profile", action="store_true",
                   help="py-spy the 16-group PostgreSQL run (training process and server; no extra run)")
    p.add_argument("--databases", default="postgresql,sqlite", help="Prefect databases to run on (default both)")
    p.add_argument("--ignore-memory", action="store_true",
                   help="run every DP size even when the hosts' estimated memory does not fit (the OOM killer may end the run)")
    p.add_argument("--host-mb", type=float, default=300, help="per-host private memory (USS) assumed before one is measured (MB)")
    p.add_argument("--keep", metavar="DIR", help="keep the work folder in DIR")
    return p.parse_args(argv)


class HostMemory(Sampler):
    """Samples the engine hosts among this process's descendants every 2 s: peak count, the peak
    over samples of their summed RSS and of one host's RSS, and one host's USS (its private memory:
    what each further host adds; RSS also counts the shared library pages) and PSS (MB)."""

    def __init__(self):
        import psutil

        self.psutil, self.me = psutil, psutil.Process()
        self.peak_total_mb = self.peak_host_mb = self.uss_mb = self.pss_mb = 0.0
        self.hosts = 0

    every = 2.0

    def sample(self):
        rss, one = [], None
        for p in self.me.children(recursive=True):
            try:
                if "engines.host" in " ".join(p.cmdline()):
                    rss.append(p.memory_info().rss / 2**20)
                    one = one or p
            except self.psutil.Error:
                pass
        try:
            if one is not None:
                full = one.memory_full_info()
                self.uss_mb, self.pss_mb = max(self.uss_mb, full.uss / 2**20), max(self.pss_mb, full.pss / 2**20)
        except self.psutil.Error:
            pass
        if rss:
            self.hosts = max(self.hosts, len(rss))
            self.peak_total_mb = max(self.peak_total_mb, sum(rss))
            self.peak_host_mb = max(self.peak_host_mb, max(rss))


def available_mb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    return float("inf")


def from_log(log: Path, warmup: int) -> list[dict]:
    """The iterations a killed run finished, from the flow's own log lines (0.1 s resolution)."""
    rows = []
    for m in STEP_LINE.finditer(log.read_text(errors="replace") if log.exists() else ""):
        step, waves, seconds, engine = int(m[1]) - 1, int(m[2]), float(m[3]), float(m[4])
        rows.append({"step": step, "waves": waves, "seconds": seconds, "engine_s": engine, "overhead_s": seconds - engine})
    return rows


def one(servers, root, work, backend, dp, args, extra, tag, profile=False, config_file=None) -> dict:
    timeout = args.timeout if args.timeout is not None else 60 + 20 * dp
    if backend == "sqlite":
        timeout = min(timeout, args.sqlite_timeout)
    with HostMemory() as mem:
        start = time.perf_counter()
        try:
            history, wall, info = train_once(servers[backend], root, work, backend, dp, args.steps, tag, profile=profile,
                                             extra=extra, prefix="scale", timeout=timeout, config_file=config_file)
            fig = figures(history, args.warmup, dp) | info | {"timed_out": False}
        except subprocess.TimeoutExpired:
            wall = time.perf_counter() - start
            logged = from_log(work / f"scale-{backend}-dp{dp}-{tag}.log", args.warmup)  # train_once's log
            rows = [r for r in logged if r["step"] >= args.warmup]
            fig = {"timed_out": True, "steps": len(rows), "finished_iterations": len(logged),
                   "logged": [[r["seconds"], r["engine_s"]] for r in logged]}
            if rows:
                mean = lambda k: statistics.fmean(r[k] for r in rows)  # noqa: E731
                fig |= {"iteration_s": mean("seconds"), "engine_s": mean("engine_s"), "overhead_s": mean("overhead_s"),
                        "overhead_max_s": max(r["overhead_s"] for r in rows), "waves": mean("waves")}
                fig["overhead_per_group_s"] = fig["overhead_s"] / dp
                fig["overhead_share"] = fig["overhead_s"] / fig["iteration_s"]
    # the headline: overhead including the wait at the all-reduce for late-started groups (bench/overhead.py), which
    # the flow's own overhead_s counts as engine time; without the server's timings (a killed run), overhead_s
    if "overhead_s" in fig:
        fig["overhead_total_s"] = fig.get("overhead_incl_wait_s", fig["overhead_s"])
        fig["per_group_s"] = fig["overhead_total_s"] / dp
    fig |= {"backend": backend, "dp": dp, "wall_s": wall, "hosts": mem.hosts, "hosts_rss_mb": mem.peak_total_mb,
            "host_rss_mb": mem.peak_host_mb, "host_uss_mb": mem.uss_mb, "host_pss_mb": mem.pss_mb}
    def f(key, fmt="{:.2f}"):
        return fmt.format(fig[key]) if key in fig else "–"
    print(f"  {backend:10s} dp={dp:<3d} iteration {f('iteration_s')}s, engines {f('engine_s')}s, overhead {f('overhead_s')}s, "
          f"incl. all-reduce wait {f('overhead_total_s')}s ({f('per_group_s', '{:.3f}')}s per group), "
          f"503s {fig.get('retries_503', '–')}, "
          f"{'TIMED OUT after ' if fig['timed_out'] else 'run '}{wall:.0f}s, hosts {mem.hosts} x {mem.peak_host_mb:.0f} MB RSS "
          f"({mem.uss_mb:.0f} MB USS; all hosts {mem.peak_total_mb:.0f} MB RSS)",
          flush=True)
    return fig


def prefect_floor(server: PrefectServer, dp: int, args) -> dict:
    """bench/floor.py's empty run of the same shape on the same server: Prefect's cost per group."""
    result = run_flow_subprocess(server.url, "bench.floor:floor", overrides=[f"dp={dp}"], steps=args.steps,
                                 timeout=60 + 10 * dp)
    measured = result["seconds"][args.warmup:]
    fig = {"iteration_s": statistics.fmean(measured), "tasks": result["tasks"]}
    fig["per_group_s"] = fig["iteration_s"] / dp
    print(f"  Prefect floor dp={dp:<3d} {fig['iteration_s']:.2f}s per iteration ({fig['per_group_s']:.3f}s per group: "
          f"one sub-flow + {fig['tasks']} tasks, nothing in them)", flush=True)
    return fig


def main(argv=None) -> dict:
    import sys

    if any(a.startswith("--groups-per-node") for a in (sys.argv[1:] if argv is None else argv)):
        from bench import nodes  # one controller process against node controllers: CPU per component (bench/nodes.py)

        return nodes.main(argv)
    args = parse_args(argv)
    dps = [int(x) for x in args.dps.split(",") if x.strip()]
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="yattflow-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    out: dict = {"args": vars(args), "runs": [], "skipped": {}, "floor": {}}
    session = time.strftime("%H%M%S")  # run names unique per invocation: a reused store keeps earlier runs, and a
    stub, torch = f"stub-{session}", f"torch-{session}"  # finished run of the same name would only resume
    t0 = time.perf_counter()
    cluster = PostgresCluster()
    servers: dict[str, PrefectServer] = {}
    try:
        cluster.start()
        servers["sqlite"] = PrefectServer(home=work / "prefect-sqlite").start()
        servers["postgresql"] = PrefectServer(cluster.url, home=work / "prefect-postgresql").start()
        root = args.store or str(work / "store")
        if not args.store:
            run_flow_subprocess(servers["postgresql"].url, "flows.prepare:prepare", log_path=work / "prepare.log",
                                overrides=TASK + [f"storage.root={root}"])
        print(f"servers up, store prepared ({time.perf_counter() - t0:.0f}s)", flush=True)
        for i, dp in enumerate(dps):
            measured = [r["host_uss_mb"] for r in sorted(out["runs"], key=lambda r: r["dp"]) if r.get("host_uss_mb")]
            host_mb = measured[-1] if measured else args.host_mb  # at the largest size run so far
            need = dp * host_mb * 1.2 + 2048
            if available_mb() < need and not args.ignore_memory:
                out["skipped"][dp] = (f"needs ~{need / 1024:.1f} GB for {dp} engine hosts ({host_mb:.0f} MB private "
                                      f"memory each{', measured' if measured else ''}), {available_mb() / 1024:.1f} GB available")
                print(f"  dp={dp}: skipped, {out['skipped'][dp]}", flush=True)
                continue
            databases = [b for b in BACKENDS if b in args.databases.split(",")]
            for backend in (databases if i % 2 == 0 else databases[::-1]):
                profile = args.profile and backend == "postgresql" and dp == 16
                out["runs"].append(one(servers, root, work, backend, dp, args, STUBS, stub, profile=profile))
                if profile:
                    out["profile"] = {side: summarize_profile(work / f"scale-postgresql-dp16-{stub}.{side}.txt")
                                      for side in ("client", "server")
                                      if (work / f"scale-postgresql-dp16-{stub}.{side}.txt").exists()}
            out["floor"][dp] = prefect_floor(servers["postgresql"], dp, args)
        if args.real_steps:  # the demo config (its own store: its models and data are larger than the tiny ones)
            demo_root = str(work / "demo-store")
            run_flow_subprocess(servers["postgresql"].url, "flows.prepare:prepare", log_path=work / "prepare-demo.log",
                                config_file=DEMO, overrides=[f"storage.root={demo_root}"])
            real = argparse.Namespace(**{**vars(args), "steps": args.real_steps})
            out["real"] = one(servers, demo_root, work, "postgresql", 2, real, [], torch, config_file=DEMO)
    finally:
        for server in servers.values():
            server.stop()
        cluster.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    out["rows"] = report(out, dps)
    out["total_s"] = time.perf_counter() - t0
    print(f"\n(total {out['total_s']:.0f}s)")
    return out


def report(out: dict, dps: list[int]) -> list[dict]:
    runs = {(r["backend"], r["dp"]): r for r in out["runs"]}
    lines = ["\n### Orchestration overhead with timing-stub engines (means of the measured iterations)\n",
             "| dp | database | iteration, `step_s` (s) | engines, `engine_s` (s) | overhead, `step_s - engine_s` (s) | wait at the all-reduce (s) | "
             "**overhead incl. that wait (s)** | **per DP group (ms)** | goal ≤ 50 ms | 503s | engine hosts × RSS / USS (MB) | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    rows: list[dict] = []
    for dp in dps:
        if dp in out["skipped"]:
            lines.append(f"| {dp} | both | | | | | | | | | | skipped: {out['skipped'][dp]} |")
            continue
        for backend in ("postgresql", "sqlite"):
            r = runs.get((backend, dp))
            if r is None:
                continue
            per = r.get("per_group_s")
            note = ""
            if r["timed_out"]:
                note = (f"timed out after {r['wall_s']:.0f}s, {r['finished_iterations']} iteration(s) finished "
                        f"(seconds, engine_s: {'; '.join(f'{a:.1f}, {b:.1f}' for a, b in r['logged']) or 'none'}); "
                        f"{r['steps']} measured (from its log, 0.1 s resolution)")
            lines.append(f"| {dp} | {backend} | {_f(r.get('iteration_s'))} | {_f(r.get('engine_s'))} | {_f(r.get('overhead_s'))} | "
                         f"{_f(r.get('allreduce_wait_s'))} | {_f(r.get('overhead_total_s'))} | {_f(per, 1000, '{:.0f}')} | {'yes' if per is not None and per <= GOAL_PER_GROUP_S else 'no'} | "
                         f"{r.get('retries_503', '–')} | {r['hosts']} × {r['host_rss_mb']:.0f} / {r['host_uss_mb']:.0f} | {note} |")
        pg, sq = runs.get(("postgresql", dp)), runs.get(("sqlite", dp))
        rows.append({"figure": f"[stub engines] overhead (incl. all-reduce wait) per DP group per iteration at dp={dp} (s): "
                               "PostgreSQL vs SQLite",
                     "yattflow": (pg or {}).get("per_group_s"), "baseline": (sq or {}).get("per_group_s"),
                     "ratio": _ratio((pg or {}).get("per_group_s"), (sq or {}).get("per_group_s"))})
    floors = out.get("floor") or {}
    if floors:
        lines += ["\n### Against Prefect's floor (bench/floor.py: the same flow shape, empty; same PostgreSQL server)\n",
                  "| dp | yattflow overhead per group (ms) | Prefect floor per group (ms) | yattflow above the floor (ms) | ratio |",
                  "|---|---|---|---|---|"]
    for dp, fl in floors.items():
        ours = runs.get(("postgresql", dp), {}).get("per_group_s")
        above = ours - fl["per_group_s"] if ours is not None else None
        lines.append(f"| {dp} | {_f(ours, 1000, '{:.0f}')} | {fl['per_group_s'] * 1000:.0f} | {_f(above, 1000, '{:.0f}')} | "
                     f"{_f(_ratio(ours, fl['per_group_s']))} |")
        rows.append({"figure": f"[stub engines, PostgreSQL] overhead per DP group at dp={dp} (s) vs Prefect's floor "
                               f"(empty sub-flow + {fl['tasks']} tasks per group)",
                     "yattflow": ours, "baseline": fl["per_group_s"], "ratio": _ratio(ours, fl["per_group_s"])})
    pgs = [(dp, runs[("postgresql", dp)]["per_group_s"]) for dp in dps
           if ("postgresql", dp) in runs and "per_group_s" in runs[("postgresql", dp)]]
    if len(pgs) >= 2:
        (d0, a), (d1, b) = pgs[0], pgs[-1]
        flat = b <= max(1.5 * a, GOAL_PER_GROUP_S)
        lines.append(f"\nPostgreSQL, overhead per group from dp={d0} to dp={d1}: {a * 1000:.0f} → {b * 1000:.0f} ms "
                     f"({b / a:.2f}×): {'flat' if flat else 'NOT flat'} (flat: at most 1.5× or within the 50 ms goal).")
        rows.append({"figure": f"[stub engines, PostgreSQL] overhead per group, dp={d1} vs dp={d0} (flat ≈ 1)",
                     "yattflow": b, "baseline": a, "ratio": b / a if a else None})
    real = out.get("real")
    if real and "overhead_s" in real:
        share = real["overhead_total_s"] / real["iteration_s"]
        lines += ["\n### Overhead share, real torch engines, the demo config (deployments/demo.yaml: dp=2), PostgreSQL\n",
                  "| iteration, `step_s` (s) | engines (s) | overhead (s) | overhead incl. all-reduce wait (s) | share of iteration | "
                  "goal ≤ 10% |", "|---|---|---|---|---|---|",
                  f"| {_f(real['iteration_s'])} | {_f(real['engine_s'])} | {_f(real['overhead_s'])} | "
                  f"{_f(real['overhead_total_s'])} | {share:.0%} | {'yes' if share <= GOAL_SHARE else 'no'} |"]
        rows.append({"figure": "[real torch engines, demo config, dp=2, PostgreSQL] overhead share of iteration time "
                               "(baseline: the 0.10 goal)",
                     "yattflow": share, "baseline": GOAL_SHARE, "ratio": share / GOAL_SHARE})
    for side, prof in (out.get("profile") or {}).items():
        who = "training process" if side == "client" else "prefect server"
        lines += [f"\n### py-spy, dp=16 PostgreSQL stub run, {who}: {prof['cpu_s']:.1f} s on CPU (imports left out)\n",
                  "| self time, by package | share |", "|---|---|"]
        lines += [f"| `{k}` | {v:.0%} |" for k, v in prof["self"]]
        lines += ["", "| inclusive, Prefect's operations | share |", "|---|---|"]
        lines += [f"| `{k}` | {v:.0%} |" for k, v in prof["inclusive"]]
    print("\n".join(lines))
    return rows


def _f(x, scale: float = 1.0, fmt: str = "{:.2f}") -> str:
    return "–" if x is None else fmt.format(x * scale)


def _ratio(a, b):
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


if __name__ == "__main__":
    main()
