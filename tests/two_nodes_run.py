"""The inside of tests/test_two_nodes.py: run in network namespace A, with B reachable over a veth pair.

    ip netns exec A python -m tests.two_nodes_run --store DIR --policy DIR --work DIR --a 169.254.X.1 --b 169.254.X.2 --ns-b B

Node A: PostgreSQL (its loopback), the Prefect server on A's address, a process worker for work
queues q-0 and q-3, and the training run itself. Node B: a process worker for q-1 and q-2, started in
namespace B. The run (the real engines: torch rollout and judge, the Megatron trainer; dp=2 groups of
train.pipeline_parallel=2 stages of --policy's two layers, hosts.launch=deployment,
hosts.work_queue=q-{rank}, controllers.groups_per_node=1) starts each rank's engine host, and beside
each group's leader that node's controller, as a flow run its node's worker takes, bound to the
node's address (the worker's YATTFLOW_HOST_BIND): group 0 is ranks 0 (A) and 1 (B), group 1 ranks 2
(B) and 3 (A), so each group's two stages are on both nodes, its activations and their gradients
crossing between them. While it trains, every listening TCP socket of both
namespaces is recorded. Writes what it saw to --work/result.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.helpers import TINY, read_run_tree
from tests.postgres import PostgresCluster, PrefectServer, run_flow_subprocess

ROOT = Path(__file__).resolve().parents[1]


def listeners(prefix: list[str]) -> set[str]:
    """``address:port owner`` of every listening TCP socket in a namespace (owner: the process's command)."""
    out = subprocess.run([*prefix, "ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    found = set()
    for line in out.splitlines():
        if not line.strip():
            continue
        pid = line.split("pid=")[1].split(",")[0] if "pid=" in line else None
        try:
            owner = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120] if pid else "?"
        except OSError:
            owner = "?"
        found.add(f"{line.split()[3]} {owner.strip()}")
    return found


def worker(prefix: list[str], name: str, queues: list[str], bind: str, env: dict, log: Path) -> subprocess.Popen:
    cmd = [*prefix, sys.executable, "-m", "prefect", "worker", "start", "--pool", "yattflow-process", "--type", "process",
           "--name", name, *(arg for q in queues for arg in ("--work-queue", q))]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                env=env | {"YATTFLOW_HOST_BIND": bind, "PREFECT_WORKER_QUERY_SECONDS": "1"})
    deadline = time.time() + 180
    while "started!" not in log.read_text():
        if proc.poll() is not None or time.time() > deadline:
            raise RuntimeError(f"worker {name} did not start:\n{log.read_text()}")
        time.sleep(0.5)
    return proc


def main() -> None:
    p = argparse.ArgumentParser()
    for arg in ("--store", "--policy", "--work", "--a", "--b", "--ns-b"):
        p.add_argument(arg, required=True)
    args = p.parse_args()
    work, in_b = Path(args.work), ["ip", "netns", "exec", args.ns_b]
    result: dict = {"listening": {"a": [], "b": []}}
    with PostgresCluster() as db, PrefectServer(db.url, home=work / "prefect", host=args.a) as server:
        env = dict(os.environ, PREFECT_API_URL=server.url, PREFECT_SERVER_ANALYTICS_ENABLED="false")
        os.environ["PREFECT_API_URL"] = server.url
        prefect = [sys.executable, "-m", "prefect", "--no-prompt"]
        subprocess.run([*prefect, "work-pool", "create", "yattflow-process", "--type", "process", "--base-job-template",
                        str(ROOT / "deployments" / "process-gpu.json"), "--overwrite"], cwd=ROOT, env=env, check=True,
                       capture_output=True)
        subprocess.run([*prefect, "deploy", "--prefect-file", str(ROOT / "deployments" / "prefect.yaml"), "--name",
                        "yattflow-host"], cwd=ROOT, env=env, check=True, capture_output=True)
        workers = [worker([], "node-a", ["q-0", "q-3"], args.a, env, work / "worker-a.log"),
                   worker(in_b, "node-b", ["q-1", "q-2"], args.b, env, work / "worker-b.log")]
        done = threading.Event()

        def watch():
            seen = {"a": set(), "b": set()}
            while not done.wait(0.5):
                seen["a"] |= listeners([])
                seen["b"] |= listeners(in_b)
            result["listening"] = {k: sorted(v) for k, v in seen.items()}

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            summary = run_flow_subprocess(server.url, "flows.training:train", timeout=420, log_path=work / "train.log",
                                          overrides=TINY + [
                f"storage.root={args.store}", f"model.policy={args.policy}", "name=twonodes", "steps=2", "dp=2",
                "train.backend=megatron", "train.pipeline_parallel=2", "train.micro_batch_tokens=64", "checkpoint.every=1",
                "hosts.launch=deployment", "hosts.work_queue=q-{rank}", "controllers.groups_per_node=1"])
            result["steps"] = [m["step"] for m in summary["history"]]
            result["tree"] = asyncio.run(read_run_tree("twonodes", api_url=server.url))
        finally:
            done.set()
            watcher.join()
            for w in workers:
                w.send_signal(2)
            for w in workers:
                try:
                    w.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    w.kill()
        result["worker_logs"] = {k: (work / f"worker-{k}.log").read_text(errors="replace") for k in ("a", "b")}
        result["train_log"] = (work / "train.log").read_text(errors="replace")[-20000:]
    (work / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
