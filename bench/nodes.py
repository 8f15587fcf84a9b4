"""Where orchestration CPU goes, one controller process against node controllers, with
timing-stub engines on a real PostgreSQL-backed Prefect server (``bench.scale --groups-per-node``).

    .venv/bin/python -m bench.nodes --dps 16,64 --groups-per-node 8      # both shapes, each size
    .venv/bin/python -m bench.scale --dps 16,64 --groups-per-node 8      # the same, from bench.scale

For each DP size it runs the real ``train`` flow twice on the same server and store: today's shape
(every ``dp-group`` sub-flow inside the training run's process) and ``controllers.groups_per_node=N``
(flows/nodes.py: one node-controller process per N groups). While a run trains, a sampler takes
the CPU time (user + system, from /proc via psutil) of each process at every step's end (the
``train`` flow's step log line): the training run's own process ("parent"), each node controller,
the engine hosts, the Prefect server (its process tree) and PostgreSQL (the postmaster's tree,
reaped backends included). Per iteration: the difference over the measured steps (after
``--warmup``, the last step left out: it writes a checkpoint), divided by their number.
Orchestration CPU = parent + node controllers + server + database; the hosts' (stub sleep, Parquet
I/O, the all-reduce) is engine work.

The projection to larger sizes uses these per-component costs: the parent's CPU per node and
per iteration (fixed part from the smallest size), a node controller's per group, the server's
and the database's per group, each growing linearly with what it serves (measured: see
docs/controllers.md for how linear it was).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import psutil

from bench import Sampler
from bench.overhead import TASK, PostgresCluster, PrefectServer, run_flow_subprocess
from bench.scale import STEP_LINE, STUBS, available_mb
from flows.prefect_server import SERVER_SETTINGS

CPU = "AMD EPYC, 2 cores (shared)"
# Prefect's server talks to PostgreSQL through a pool of 5 + 10 connections: at 256 groups starting their sub-flows at
# once on busy cores, requests waited for a connection past SQLAlchemy's 30 s and the API answered 500 (QueuePool limit
# ... reached). A bigger pool, here only: `yattflow stack` runs SERVER_SETTINGS in every API worker and the services
# process, and 5 of them x 60 would pass PostgreSQL's default max_connections (100). (The pool's 30 s cannot be raised
# in Prefect 3.8.8: its pool_timeout setting exists but is never passed to the engine.)
SERVER_ENV = {"PREFECT_SERVER_DATABASE_SQLALCHEMY_POOL_SIZE": "20", "PREFECT_SERVER_DATABASE_SQLALCHEMY_MAX_OVERFLOW": "40"}


def server_settings() -> dict[str, str]:
    """What the bench's server runs with: what `yattflow server` users get (``SERVER_SETTINGS``), the pool above,
    and any ``PREFECT_SERVER_*`` of this environment on top (as for `yattflow server`: the environment wins), so
    that a setting can be measured against the default without an option."""
    return SERVER_SETTINGS | SERVER_ENV | {k: v for k, v in os.environ.items() if k.startswith("PREFECT_SERVER_")}


def cpu_of(p: psutil.Process, tree: bool = False) -> float:
    """User + system seconds of ``p``; ``tree``: with its reaped children and live descendants."""
    try:
        t = p.cpu_times()
        total = t.user + t.system + ((t.children_user + t.children_system) if tree else 0.0)
        if tree:
            for c in p.children(recursive=True):
                try:
                    ct = c.cpu_times()
                    total += ct.user + ct.system
                except psutil.Error:
                    pass
        return total
    except psutil.Error:
        return 0.0


def uss_mb(p: psutil.Process) -> float:
    """Private memory (what each further process adds; RSS also counts pages shared with a fork server), MB."""
    try:
        return p.memory_full_info().uss / 2**20
    except psutil.Error:
        return 0.0


class CpuMeter(Sampler):
    """Snapshots every component's CPU seconds whenever the run's log shows another finished step."""

    every = 0.2

    def __init__(self, log: Path, server: list[psutil.Process], postmaster: psutil.Process):
        self.log, self.server, self.postmaster = log, server, postmaster  # server: its processes (a stack's: several)
        self.me = psutil.Process()
        self.snaps: list[dict] = []  # one per finished step, in order
        self.offset = 0  # bytes of the log read so far (whole lines): at 256 groups the log grows by MBs per step
        self.start = self.snapshot()  # before the run: step 0's line counts from here

    def _procs(self) -> dict[str, list[psutil.Process]]:
        found: dict[str, list] = {"parent": [], "nodes": [], "hosts": []}
        for p in self.me.children(recursive=True):
            try:
                cmd = " ".join(p.cmdline())
            except psutil.Error:
                continue
            if "flows.training:train" in cmd:
                found["parent"].append(p)
            elif "flows.node_controller" in cmd:
                found["nodes"].append(p)
            elif "engines.host" in cmd:
                found["hosts"].append(p)
        return found

    def snapshot(self) -> dict:
        procs = self._procs()
        nodes = sorted(procs["nodes"], key=lambda p: p.pid)
        # every CPU figure first, close together in time; then memory (reading 256 hosts' USS takes seconds)
        snap = {"t": time.perf_counter(), "parent": sum(cpu_of(p) for p in procs["parent"]),
                "nodes": [cpu_of(p) for p in nodes], "hosts": sum(cpu_of(p) for p in procs["hosts"]),
                "server": sum(cpu_of(p, tree=True) for p in self.server), "postgres": cpu_of(self.postmaster, tree=True)}
        return snap | {"hosts_uss_mb": sum(uss_mb(p) for p in procs["hosts"]), "n_hosts": len(procs["hosts"]),
                       "nodes_uss_mb": sum(uss_mb(p) for p in nodes), "parent_uss_mb": sum(uss_mb(p) for p in procs["parent"])}

    def sample(self):
        if not self.log.exists():
            return
        with open(self.log, "rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        chunk = chunk[:chunk.rfind(b"\n") + 1]  # whole lines only: a step line half written is read next time
        self.offset += len(chunk)
        steps = len(STEP_LINE.findall(chunk.decode(errors="replace")))
        if steps:
            snap = self.snapshot()
            print("    " + step_line(self.snaps[-1] if self.snaps else self.start, snap, len(self.snaps) + steps - 1), flush=True)
            self.snaps += [snap] * steps  # two steps in one poll: the later snapshot for both


def step_line(a: dict, b: dict, step: int) -> str:
    """One step's CPU seconds per component and wall time as the run goes (step 0: since the run started)."""
    d = lambda key: b[key] - a[key]  # noqa: E731
    nodes = [y - x for x, y in zip(a["nodes"], b["nodes"])] if len(a["nodes"]) == len(b["nodes"]) else b["nodes"]
    each = f" ({min(nodes):.2f}–{max(nodes):.2f} each)" if nodes else ""
    return (f"step {step} done in {d('t'):.1f}s: CPU s parent {d('parent'):.2f}, node controllers {sum(nodes):.2f}{each}, "
            f"server {d('server'):.2f}, postgres {d('postgres'):.2f}, hosts {d('hosts'):.2f}")


def postmaster(cluster: PostgresCluster) -> psutil.Process:
    data = str(cluster.folder / "data")
    for p in psutil.process_iter(["name", "cmdline"]):
        if data in " ".join(p.info["cmdline"] or []) and (p.info["name"] or "").startswith("postgres"):
            return p
    raise RuntimeError(f"no postmaster for {data}")


def per_iteration(snaps: list[dict], history: list[dict], warmup: int) -> dict:
    """Per measured iteration: CPU of each component, and the wall time (``step_s``)."""
    first, last = warmup - 1, len(snaps) - 2  # snapshot k: the end of step k; the last step left out
    n = last - first
    if n < 1:
        raise RuntimeError(f"too few steps: {len(snaps)} finished, warmup {warmup}")
    a, b = snaps[first] if first >= 0 else None, snaps[last]
    d = lambda key: (b[key] - (a[key] if a else 0.0)) / n  # noqa: E731
    nodes = [(y - (x if a else 0.0)) / n for x, y in zip(a["nodes"] if a else [0.0] * len(b["nodes"]), b["nodes"])]
    steps = [m for m in history if first < m["step"] <= last]
    out = {"iterations": n, "parent_cpu_s": d("parent"), "node_cpu_s": nodes, "hosts_cpu_s": d("hosts"),
           "server_cpu_s": d("server"), "postgres_cpu_s": d("postgres"),
           "wall_s": statistics.fmean(m["step_s"] for m in steps), "engine_s": statistics.fmean(m["engine_s"] for m in steps)}
    out["orchestration_cpu_s"] = out["parent_cpu_s"] + sum(nodes) + out["server_cpu_s"] + out["postgres_cpu_s"]
    out |= {k: max(s[k] for s in snaps) for k in ("hosts_uss_mb", "nodes_uss_mb", "parent_uss_mb", "n_hosts")}
    return out


def one_run(server: PrefectServer, cluster: PostgresCluster, root: str, work: Path, dp: int, per_node: int | None,
            args, tag: str) -> dict:
    name = f"nodes-dp{dp}-{'n' + str(per_node) if per_node else 'inline'}-{tag}"
    log = work / f"{name}.log"
    timeout = args.timeout or 120 + 25 * dp
    # hang detection no shorter than the run: at hundreds of groups on 2 cores a group can wait minutes at the
    # train step's all-reduce for the last group to start (no host progress meanwhile); this bench measures cost
    overrides = TASK + STUBS + [f"storage.root={root}", f"name={name}", f"dp={dp}", f"steps={args.steps}", "threads_per_host=1",
                                "data.heldout=null", "checkpoint.every=1000", f"host_timeout_s={max(600, timeout)}",
                                f"timeouts.stage_s={max(300, timeout)}"]
    if per_node:
        overrides.append(f"controllers.groups_per_node={per_node}")
    if not args.no_fork:  # hosts (and node controllers) forked from one process: 256 stub hosts fit in 24 GB
        overrides.append("hosts.fork=true")
    start = time.perf_counter()
    procs = [psutil.Process(p.pid) for p, _ in server.procs] if hasattr(server, "procs") else [psutil.Process(server.proc.pid)]
    with CpuMeter(log, procs, postmaster(cluster)) as meter:
        summary = run_flow_subprocess(server.url, "flows.training:train", log_path=log, overrides=overrides,
                                      timeout=timeout)
    fig = per_iteration(meter.snaps, summary["history"], args.warmup)
    fig |= {"dp": dp, "groups_per_node": per_node, "run_s": time.perf_counter() - start}
    nodes = fig["node_cpu_s"]
    print(f"  dp={dp:<4d} {'node controllers of ' + str(per_node) if per_node else 'one process':22s} wall {fig['wall_s']:.2f}s/it; "
          f"CPU s/it: parent {fig['parent_cpu_s']:.2f}, nodes {sum(nodes):.2f} "
          f"({', '.join(f'{x:.2f}' for x in nodes) or '–'}), server {fig['server_cpu_s']:.2f}, postgres {fig['postgres_cpu_s']:.2f}, "
          f"hosts {fig['hosts_cpu_s']:.2f}; orchestration {fig['orchestration_cpu_s']:.2f} "
          f"({fig['orchestration_cpu_s'] / dp * 1000:.0f} ms per group); private memory (USS, peak): "
          f"{fig['n_hosts']} host processes {fig['hosts_uss_mb']:.0f} MB, node controllers {fig['nodes_uss_mb']:.0f} MB, "
          f"parent {fig['parent_uss_mb']:.0f} MB; run {fig['run_s']:.0f}s", flush=True)
    return fig


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.nodes", description=__doc__.split("\n\n")[0])
    p.add_argument("--dps", default="16,64", help="DP group counts (default 16,64)")
    p.add_argument("--groups-per-node", type=int, default=8, help="DP groups per node controller (default 8)")
    p.add_argument("--steps", type=int, default=5, help="RL steps per run (default 5: first warmup, last not measured)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--timeout", type=float, default=None, help="seconds per run (default 120 + 25 per group)")
    p.add_argument("--store", metavar="DIR", help="a storage root prepared earlier (default: prepare one, ~100 s)")
    p.add_argument("--host-mb", type=float, default=None,
                   help="private memory per engine host assumed for the memory check (MB; default 250, forked 40)")
    p.add_argument("--no-fork", action="store_true", help="start every host fresh (hosts.fork=false: ~260 MB private each)")
    p.add_argument("--project", default="256,1024,4096", help="DP sizes of the projection table")
    p.add_argument("--keep", metavar="DIR", help="keep the work folder in DIR")
    p.add_argument("--only-nodes", action="store_true", help="run the node-controller shape only")
    p.add_argument("--shapes", default="one,nodes",
                   help="which shapes, in this order (default one,nodes: one controller process, then node controllers)")
    p.add_argument("--stack", type=int, default=0, metavar="REPLICAS",
                   help="run on `yattflow stack` (flows/stack.py: REPLICAS API replicas, Redis, a services process, yattflow's "
                   "server settings) instead of one default `prefect server start`; its CPU is all of them together")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    dps = [int(x) for x in args.dps.split(",") if x.strip()]
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="yattflow-nodes-"))
    work.mkdir(parents=True, exist_ok=True)
    tag, out = time.strftime("%H%M%S"), {"runs": [], "skipped": {}, "failed": [], "cpu": CPU,
                                         "server": f"yattflow stack, {args.stack} replicas" if args.stack else "prefect server start"}
    cluster, server = PostgresCluster(), None
    try:
        cluster.start()
        if args.stack:
            from flows.stack import Stack

            server = Stack(cluster.url, replicas=args.stack, home=work / "stack").start()
        else:
            server = PrefectServer(cluster.url, home=work / "prefect", env=server_settings()).start()
            print("prefect server start with " + ", ".join(f"{k}={v}" for k, v in server_settings().items()), flush=True)
        root = args.store or str(work / "store")
        if not args.store:
            run_flow_subprocess(server.url, "flows.prepare:prepare", log_path=work / "prepare.log",
                                overrides=TASK + [f"storage.root={root}"])
        for dp in dps:
            need = dp * (args.host_mb or (250 if args.no_fork else 40)) * 1.2 + 1024
            if available_mb() < need:
                out["skipped"][dp] = f"needs ~{need / 1024:.1f} GB for {dp} hosts, {available_mb() / 1024:.1f} GB available"
                print(f"  dp={dp}: skipped, {out['skipped'][dp]}", flush=True)
                continue
            shapes = ["nodes"] if args.only_nodes else [x.strip() for x in args.shapes.split(",")]
            for per_node in [args.groups_per_node if x == "nodes" else None for x in shapes]:  # the same server, store and size: today's shape, then nodes
                try:
                    out["runs"].append(one_run(server, cluster, root, work, dp, per_node, args, tag))
                except (RuntimeError, subprocess.TimeoutExpired) as e:  # a failed run is a finding: report it, go on
                    reason = str(e).strip().splitlines()[-1][:300]
                    out["failed"].append({"dp": dp, "groups_per_node": per_node, "error": reason})
                    print(f"  dp={dp} {'nodes of ' + str(per_node) if per_node else 'one process'}: FAILED: {reason}", flush=True)
    finally:
        if server is not None:
            server.stop()
        cluster.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    out["tables"] = report(out["runs"], args)
    print(out["tables"])
    return out


def report(runs: list[dict], args) -> str:
    server = f"yattflow stack ({args.stack} API replicas, Redis, services process)" if args.stack else "one `prefect server start`"
    lines = [f"\n### Orchestration CPU per iteration, timing-stub engines, PostgreSQL, {server} ({CPU})\n",
             "| dp | controllers | parent CPU (s) | node controllers' CPU, each (s) | Prefect server CPU (s) | PostgreSQL CPU (s) | "
             "orchestration CPU (s) | per DP group (ms) | wall (s) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        nodes = r["node_cpu_s"]
        each = f"{min(nodes):.2f}–{max(nodes):.2f} ({len(nodes)} nodes)" if nodes else "–"
        lines.append(f"| {r['dp']} | {'nodes of ' + str(r['groups_per_node']) if r['groups_per_node'] else 'one process'} | "
                     f"{r['parent_cpu_s']:.2f} | {each} | {r['server_cpu_s']:.2f} | {r['postgres_cpu_s']:.2f} | "
                     f"{r['orchestration_cpu_s']:.2f} | {r['orchestration_cpu_s'] / r['dp'] * 1000:.0f} | {r['wall_s']:.2f} |")
    lines += projection([r for r in runs if r["groups_per_node"]], args)
    return "\n".join(lines)


def projection(runs: list[dict], args) -> list[str]:
    """Linear per-component costs from the largest node-controller run: the parent's per node, a node's per
    group, the server's and the database's per group; the cores each needs to stay under 10 s per iteration."""
    if not runs:
        return []
    r = max(runs, key=lambda r: r["dp"])
    n_nodes = len(r["node_cpu_s"])
    parent_per_node = r["parent_cpu_s"] / n_nodes
    node_per_group = sum(r["node_cpu_s"]) / r["dp"]
    server_per_group, pg_per_group = r["server_cpu_s"] / r["dp"], r["postgres_cpu_s"] / r["dp"]
    k = args.groups_per_node
    lines = [f"\n### Projection from dp={r['dp']} (per iteration; parent {parent_per_node * 1000:.0f} ms per node, a node "
             f"controller {node_per_group * 1000:.0f} ms per group, server {server_per_group * 1000:.0f} ms and PostgreSQL "
             f"{pg_per_group * 1000:.0f} ms per group; cores = CPU s / 10 s)\n",
             "| dp | nodes | parent CPU (s) | each node controller (s) | server CPU (s) → cores for < 10 s | PostgreSQL CPU (s) → cores |",
             "|---|---|---|---|---|---|"]
    for dp in [int(x) for x in args.project.split(",")]:
        nodes = -(-dp // k)
        srv, pg = server_per_group * dp, pg_per_group * dp
        lines.append(f"| {dp} | {nodes} | {parent_per_node * nodes:.2f} | {node_per_group * k:.2f} | {srv:.1f} → {srv / 10:.1f} | "
                     f"{pg:.1f} → {pg / 10:.1f} |")
    return lines


if __name__ == "__main__":
    main()
