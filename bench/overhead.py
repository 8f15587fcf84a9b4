"""Orchestration overhead per RL iteration: a real Prefect server on SQLite against one on
PostgreSQL, same run, same workload.

    python -m bench.overhead                        # dp=2 table + dp=1,2,4 table, ~8 min on 2 cores
    python -m bench.overhead --scaling ''           # dp=2 only
    python -m bench.overhead --profile              # + py-spy of one dp=2 run per database (client and server)

Both servers are real ``prefect server`` processes started here (tests/postgres.py): one
on Prefect's default SQLite database, one on a throwaway PostgreSQL cluster (Debian package
``postgresql``). A tiny storage root is built first by the real ``prepare`` flow (the test
suite's ``TASK`` settings). Every training run is a fresh process (``flows.training:train``,
tiny config, ``threads_per_host=1``, no held-out evaluation) pointed at one server; runs
alternate between the two servers.

Per iteration the training flow reports ``step_s`` (the step's wall time as the ``train`` flow
sees it, the ``iteration`` sub-flow's own creation and state changes included), ``engine_s``
(the largest over DP groups of the seconds its engine host spent on commands), and ``seconds``
/ ``overhead_s`` timed inside the iteration sub-flow. The overhead here is ``step_s - engine_s``:
everything that is not engine work — Prefect's flow and task bookkeeping, API calls, the
server and its database, and the parent's own code.
Figures are means over the measured steps: after ``--warmup`` steps, without the last step
(it always writes a checkpoint, which the others do not).

``engine_s`` counts the time a host waits in the gradient all-reduce for a group that started
late, so a skew between DP groups caused by orchestration shows up as engine time. The bench
reads the server's records after each run: the spread of the DP-group sub-flows' start times
and of the ``train_step`` tasks' start times (how long the first group waits at the
all-reduce), and reports ``overhead incl. the all-reduce wait = seconds - (engine_s - wait)``
beside the flow's own ``overhead_s``. It also counts the 503s the server answered (on SQLite:
"database is locked"; each sends the Prefect client into a 2 s, then 4 s, ... back-off).

``main(argv)`` returns the figures (a dict) and prints markdown tables.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import json
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from tests.postgres import PostgresCluster, PrefectServer, run_flow_subprocess  # noqa: E402

from tests.helpers import TASK  # the demo at test size
BACKENDS = ("sqlite", "postgresql")
RETRY_MARKER = "Encountered retryable exception in request"  # one per 503 (SQLite lock) the server answers


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("--dp", type=int, default=2, help="DP groups of the main comparison (default 2)")
    p.add_argument("--steps", type=int, default=6, help="RL steps per run (default 6)")
    p.add_argument("--warmup", type=int, default=1, help="first steps left out of the figures (default 1)")
    p.add_argument("--scaling", default="1,2,4", help="DP sizes of the scaling table, comma-separated ('' for none)")
    p.add_argument("--repeats", type=int, default=1, help="runs per (database, dp); figures pool their steps")
    p.add_argument("--durable", action="store_true",
                   help="PostgreSQL with fsync on (synchronous_commit=off, like SQLite's WAL + synchronous=NORMAL); "
                        "default: a scratch cluster, fsync off")
    p.add_argument("--profile", action="store_true", help="also py-spy one run per database: training process and server")
    p.add_argument("--keep", metavar="DIR", help="keep the work folder (storage, server logs, run logs) in DIR")
    p.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    return p.parse_args(argv)


def measured(history: list[dict], warmup: int) -> list[dict]:
    rows = [m for m in history[warmup:] if not m.get("checkpoint_s") and not m.get("checkpoint_wait_s")]
    if not rows:
        raise ValueError(f"no step left to measure: {len(history)} steps, warm-up {warmup}, last step checkpoints")
    return rows


def figures(history: list[dict], warmup: int, dp: int) -> dict:
    return summarize(measured(history, warmup), dp)


def summarize(rows: list[dict], dp: int) -> dict:
    """Means over the measured iterations ``rows`` (``iteration`` metrics) of one DP size."""
    mean = lambda key: statistics.fmean(m[key] for m in rows)  # noqa: E731
    # ``step_s``: the step as the train flow pays for it (the iteration sub-flow's own bookkeeping
    # included); the flow's ``seconds`` / ``overhead_s`` are timed inside that sub-flow
    overheads = [m["step_s"] - m["engine_s"] for m in rows]
    out = {"steps": len(rows), "iteration_s": mean("step_s"), "engine_s": mean("engine_s"),
           "overhead_s": statistics.fmean(overheads), "overhead_max_s": max(overheads),
           "overhead_inside_s": mean("overhead_s"), "waves": mean("waves")}
    if all("allreduce_wait_s" in m for m in rows):
        out |= {"dp_start_skew_s": mean("dp_start_skew_s"), "allreduce_wait_s": mean("allreduce_wait_s"),
                "engine_compute_s": mean("engine_compute_s"), "overhead_incl_wait_s": mean("overhead_incl_wait_s")}
    out["overhead_per_group_s"] = out["overhead_s"] / dp
    out["overhead_share"] = out["overhead_s"] / out["iteration_s"]
    # Prefect runs per iteration: the iteration flow, one flow per group, its stage tasks (3 per wave + train + sync)
    out["prefect_runs"] = 1 + dp + dp * (3 * out["waves"] + 2)
    return out


def count_retries(path: Path, marker: str = RETRY_MARKER) -> int:
    try:
        return path.read_text(errors="replace").count(marker)
    except OSError:
        return 0


# --------------------------------------------------------------------------- profiling


def _spy(args: list[str]) -> list[str]:
    """py-spy at 100 Hz, collapsed stacks, without pausing the process."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).exists():
        raise SystemExit("--profile needs py-spy: pip install py-spy")
    return [spy, "record", "--rate", "100", "--format", "raw", "--nonblocking", *args]


# inclusive time is shown for these (what Prefect does), not for the generic wrappers around them
INTERESTING = re.compile(r"^(prefect/(flow_engine|task_engine|client|events|logging|artifacts|states|results|context|"
                         r"server/(api|models|orchestration|services|events|database))|flows/|tasks/)")


def summarize_profile(path: Path, top: int = 12) -> dict:
    """From py-spy's raw (collapsed-stack) output, imports left out: on-CPU seconds, self time per
    package of the innermost frame, and inclusive time of Prefect's own operations."""
    self_time: collections.Counter = collections.Counter()
    inclusive: collections.Counter = collections.Counter()
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit() or "importlib._bootstrap" in stack:  # no Python frame, or an import
            continue
        n = int(count)
        total += n
        frames = [_frame(f) for f in stack.split(";")]
        self_time[_package(frames[-1][0]) or "(other)"] += n
        for key in {f"{module}:{name}" for module, name in frames if INTERESTING.match(module)}:
            inclusive[key] += n
    hz = 100.0
    return {"cpu_s": total / hz,
            "self": [(k, v / total) for k, v in self_time.most_common(top)],
            "inclusive": [(k, v / total) for k, v in inclusive.most_common(top)]}


def _frame(frame: str) -> tuple[str, str]:
    name, _, where = frame.partition(" (")
    module = where.rsplit(":", 1)[0]
    for marker in ("site-packages/", "lib/python3.11/", str(ROOT) + "/"):
        if marker in module:
            module = module.split(marker, 1)[1]
    return module.removesuffix(".py"), name


def _package(module: str) -> str:
    parts = module.split("/")
    if parts[0] == "prefect" and len(parts) > 2:
        return "/".join(parts[:3]) if parts[1] in ("server", "_internal", "client") else "/".join(parts[:2])
    return parts[0] if len(parts) > 1 else module


# --------------------------------------------------------------------------- runs


async def _all_pages(read, page: int = 200, **filters) -> list:
    """Every record a filtered read matches: the server answers at most 200 per call (64 groups x 4 steps is more)."""
    found = []
    while True:
        batch = await read(**filters, limit=page, offset=len(found))
        found += batch
        if len(batch) < page:
            return found


async def _server_timings(api_url: str, run_name: str, steps: int, dp: int, timeout: float = 30) -> dict[int, dict]:
    """Per step, from the server's records: the spread of the DP-group sub-flows' start times, and
    of their ``train_step`` tasks' start times — the first group to reach the all-reduce waits that
    long for the last, and the host counts the wait as engine time."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (FlowRunFilter, FlowRunFilterId, FlowRunFilterName,
                                                FlowRunFilterParentFlowRunId, TaskRunFilter, TaskRunFilterName)
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: api_url}):
        async with get_client() as client:
            tops = await client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[f"train-{run_name}"])))
            top = max(tops, key=lambda r: r.created)
            its = await client.read_flow_runs(flow_run_filter=FlowRunFilter(
                parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[top.id])))
            groups = await _all_pages(client.read_flow_runs, flow_run_filter=FlowRunFilter(
                parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[r.id for r in its])))
            deadline = time.monotonic() + timeout
            while True:  # task runs are recorded from events, a moment after the run ends
                trains = await _all_pages(
                    client.read_task_runs, flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[g.id for g in groups])),
                    task_run_filter=TaskRunFilter(name=TaskRunFilterName(like_="train_step")))
                if len([t for t in trains if t.start_time]) >= steps * dp or time.monotonic() > deadline:
                    break
                await asyncio.sleep(1)
    step_of = {g.id: int(g.name.split("-")[1]) for g in groups}  # iteration-0003-dp-1
    out: dict[int, dict] = {}
    for step in range(steps):
        starts = [g.start_time for g in groups if step_of[g.id] == step and g.start_time]
        train_starts = [t.start_time for t in trains if step_of.get(t.flow_run_id) == step and t.start_time]
        if len(starts) == dp and len(train_starts) == dp:
            out[step] = {"dp_start_skew_s": (max(starts) - min(starts)).total_seconds(),
                         "allreduce_wait_s": (max(train_starts) - min(train_starts)).total_seconds()}
    return out


def train_once(server: PrefectServer, root: str, work: Path, backend: str, dp: int, steps: int, tag: str,
               profile: bool = False, extra: list[str] | tuple[str, ...] = (), prefix: str = "overhead",
               timeout: float = 1800, config_file: str | None = None) -> tuple[list[dict], float, dict]:
    """One training run of ``dp`` groups on ``server``; ``extra``: more config overrides (bench/scale.py:
    the timing-stub backends); ``timeout``: seconds before the run is killed (``subprocess.TimeoutExpired``);
    ``config_file``: a run config (e.g. deployments/demo.yaml) instead of the tiny settings."""
    name = f"{prefix}-{backend}-dp{dp}-{tag}"
    overrides = ([] if config_file else TASK) + [f"storage.root={root}", f"name={name}", f"dp={dp}", f"steps={steps}", "threads_per_host=1",
                        "data.heldout=null", "checkpoint.every=1000", *extra]
    log = work / f"{name}.log"
    spy, server_spy, info = None, None, {}
    if profile:
        spy = _spy(["--output", str(work / f"{name}.client.txt"), "--"])
        server_spy = subprocess.Popen(_spy(["--output", str(work / f"{name}.server.txt"), "--subprocesses",
                                            "--pid", str(server.proc.pid)]),
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server_log_before = count_retries(server.log_path)
    start = time.perf_counter()
    try:
        summary = run_flow_subprocess(server.url, "flows.training:train", log_path=log, prefix=spy, overrides=overrides,
                                      timeout=timeout, config_file=config_file)
    finally:
        if server_spy is not None:
            server_spy.send_signal(signal.SIGINT)  # py-spy writes its output and exits
            server_spy.wait(timeout=60)
    wall = time.perf_counter() - start
    info["retries_503"] = count_retries(server.log_path) - server_log_before
    history = summary["history"]
    try:
        timings = asyncio.run(_server_timings(server.url, name, steps, dp))
    except Exception as e:  # noqa: BLE001 - e.g. more runs than the API answers in one page (dp=64): figures without
        timings, info["timings_error"] = {}, repr(e)  # the start skews rather than no figures
    for m in history:
        if m["step"] in timings:
            m.update(timings[m["step"]])
            # engine time without the wait at the all-reduce (the group that waited has the largest engine_s)
            m["engine_compute_s"] = max(m["engine_s"] - m["allreduce_wait_s"], 0.0)
            m["overhead_incl_wait_s"] = m["step_s"] - m["engine_compute_s"]
    return history, wall, info


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.steps - args.warmup < 2:
        raise SystemExit("--steps must leave at least one measured step after --warmup and before the last step")
    dps = sorted({args.dp, *(int(x) for x in args.scaling.split(",") if x.strip())})
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="yattflow-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    settings = {"synchronous_commit": "off"} if args.durable else None
    results: dict = {"args": vars(args), "runs": []}
    t0 = time.perf_counter()
    cluster = PostgresCluster(settings=settings)
    servers: dict[str, PrefectServer] = {}
    try:
        cluster.start()
        servers["sqlite"] = PrefectServer(home=work / "prefect-sqlite").start()
        servers["postgresql"] = PrefectServer(cluster.url, home=work / "prefect-postgresql").start()
        print(f"servers up: sqlite {servers['sqlite'].url}, postgresql {servers['postgresql'].url} "
              f"({cluster.url}; {time.perf_counter() - t0:.0f}s)", flush=True)
        root = str(work / "store")
        start = time.perf_counter()
        run_flow_subprocess(servers["sqlite"].url, "flows.prepare:prepare", log_path=work / "prepare.log",
                            overrides=TASK + [f"storage.root={root}"])
        print(f"prepared {root} ({time.perf_counter() - start:.0f}s)", flush=True)

        for i, dp in enumerate(dps):
            for rep in range(args.repeats):
                order = BACKENDS if (i + rep) % 2 == 0 else BACKENDS[::-1]  # alternate which database goes first
                for backend in order:
                    history, wall, extra = train_once(servers[backend], root, work, backend, dp, args.steps, f"r{rep}")
                    fig = figures(history, args.warmup, dp)
                    results["runs"].append({"backend": backend, "dp": dp, "repeat": rep, "wall_s": wall,
                                            "history": history, **extra, **fig})
                    print(f"  {backend:10s} dp={dp} run {rep}: iteration {fig['iteration_s']:.2f}s, engines "
                          f"{fig['engine_s']:.2f}s, overhead {fig['overhead_s']:.2f}s (max {fig['overhead_max_s']:.2f}s), "
                          f"wait at all-reduce {fig.get('allreduce_wait_s', float('nan')):.2f}s, 503 retries {extra['retries_503']}, "
                          f"run {wall:.0f}s",
                          flush=True)
        if args.profile:
            results["profiles"] = {}
            for backend in BACKENDS:
                train_once(servers[backend], root, work, backend, args.dp, args.steps, "profile", profile=True)
                name = f"overhead-{backend}-dp{args.dp}-profile"
                results["profiles"][backend] = {side: summarize_profile(work / f"{name}.{side}.txt")
                                                for side in ("client", "server")
                                                if (work / f"{name}.{side}.txt").exists()}
    finally:
        for server in servers.values():
            server.stop()
        cluster.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    results["tables"] = report(results, args, dps)
    results["total_s"] = time.perf_counter() - t0
    print(f"\n(total {results['total_s']:.0f}s)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    return results


def pooled(results: dict, backend: str, dp: int, args) -> dict:
    runs = [r for r in results["runs"] if r["backend"] == backend and r["dp"] == dp]
    history = [m for r in runs for m in measured(r["history"], args.warmup)]
    fig = summarize(history, dp)
    fig["retries_503"] = sum(r["retries_503"] for r in runs) / len(runs)
    return fig


def report(results: dict, args, dps: list[int]) -> dict:
    pg_label = "PostgreSQL (fsync on)" if args.durable else "PostgreSQL"
    a, b = pooled(results, "sqlite", args.dp, args), pooled(results, "postgresql", args.dp, args)
    rows = [("measured iterations", "steps", "{:.0f}"), ("iteration wall time (s)", "iteration_s", "{:.2f}"),
            ("engine time, `engine_s` as the flow reports it (s)", "engine_s", "{:.2f}"),
            ("**orchestration overhead, `overhead_s` as the flow reports it (s)**", "overhead_s", "{:.2f}"),
            ("overhead, worst iteration (s)", "overhead_max_s", "{:.2f}"),
            ("overhead per DP group (s)", "overhead_per_group_s", "{:.2f}"),
            ("`overhead_s` share of iteration", "overhead_share", "{:.0%}"), ("waves per step", "waves", "{:.1f}"),
            ("Prefect runs per iteration", "prefect_runs", "{:.0f}"),
            ("DP-group sub-flow start skew (s)", "dp_start_skew_s", "{:.2f}"),
            ("wait at the all-reduce (spread of train_step starts; counted in `engine_s`) (s)", "allreduce_wait_s", "{:.2f}"),
            ("engine time without that wait (s)", "engine_compute_s", "{:.2f}"),
            ("**overhead incl. the all-reduce wait (s)**", "overhead_incl_wait_s", "{:.2f}"),
            ("server 503s (SQLite 'database is locked'), per run", "retries_503", "{:.0f}")]
    lines = [f"\n### dp={args.dp}, {args.steps} steps (mean of steps {args.warmup}..{args.steps - 2}), "
             f"{args.repeats} run(s) each\n", f"| figure | SQLite | {pg_label} | SQLite / PostgreSQL |", "|---|---|---|---|"]
    ratio = lambda x, y: f"{x / y:.2f}×" if y else "–"  # noqa: E731
    for label, key, fmt in rows:
        if key not in a or key not in b:
            continue
        lines.append(f"| {label} | {fmt.format(a[key])} | {fmt.format(b[key])} | "
                     f"{ratio(a[key], b[key]) if key.endswith('_s') else ''} |")
    tables = {"main": {"sqlite": a, "postgresql": b}}
    if len(dps) > 1:
        lines += ["", "### scaling with DP groups (threads_per_host=1; means of measured steps)\n",
                  "| dp | database | iteration (s) | engines (s) | overhead (s) | overhead per group (s) | "
                  "all-reduce wait (s) | overhead incl. wait (s) | 503s per run |",
                  "|---|---|---|---|---|---|---|---|---|"]
        tables["scaling"] = {}
        for dp in dps:
            s, p = pooled(results, "sqlite", dp, args), pooled(results, "postgresql", dp, args)
            tables["scaling"][dp] = {"sqlite": s, "postgresql": p}
            for label, f in (("SQLite", s), (pg_label, p)):
                lines.append(f"| {dp} | {label} | {f['iteration_s']:.2f} | {f['engine_s']:.2f} | {f['overhead_s']:.2f} | "
                             f"{f['overhead_per_group_s']:.2f} | {f.get('allreduce_wait_s', float('nan')):.2f} | "
                             f"{f.get('overhead_incl_wait_s', float('nan')):.2f} | {f['retries_503']:.0f} |")
    for backend, sides in results.get("profiles", {}).items():
        for side, prof in sides.items():
            who = "training process" if side == "client" else "prefect server"
            lines += ["", f"### py-spy: {backend}, {who} (dp={args.dp}, {args.steps} steps): {prof['cpu_s']:.1f} s on CPU, "
                      "imports left out\n", "| self time, by package | share | inclusive, Prefect's operations | share |",
                      "|---|---|---|---|"]
            for (a_key, a_val), (b_key, b_val) in itertools.zip_longest(prof["self"], prof["inclusive"], fillvalue=("", None)):
                lines.append(f"| {a_key and f'`{a_key}`'} | {'' if a_val is None else f'{a_val:.0%}'} | "
                             f"{b_key and f'`{b_key}`'} | {'' if b_val is None else f'{b_val:.0%}'} |")
    print("\n".join(lines))
    return tables


if __name__ == "__main__":
    main()
