"""Prefect the way a person uses it, for the deployment and event tests (tests/test_deployments.py,
tests/test_events.py): the ``prefect`` and ``yattflow`` commands, the client, process workers."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from prefect.client.orchestration import get_client


ROOT = Path(__file__).resolve().parent.parent
DEPLOYMENTS = ROOT / "deployments"
POOLS = {"yattflow-process": ("process", DEPLOYMENTS / "process-gpu.json"),
         "yattflow-eval": ("process", DEPLOYMENTS / "process-gpu.json"),
         "yattflow-k8s": ("kubernetes", DEPLOYMENTS / "kubernetes-gpu.json")}


CLI_SECONDS: list[float] = []  # how long a plain `prefect` command takes on this machine now


def prefect(*args: str, timeout: float = 240) -> str:
    """Run the real ``prefect`` CLI from the checkout; its output, or a failure that shows it."""
    start = time.time()
    proc = subprocess.run([sys.executable, "-m", "prefect", "--no-prompt", *args], cwd=ROOT, env=dict(os.environ),
                          capture_output=True, text=True, timeout=timeout)
    if args[0] != "deploy":
        CLI_SECONDS.append(time.time() - start)
    assert proc.returncode == 0, f"prefect {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def yattflow(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=ROOT, env=dict(os.environ),
                          capture_output=True, text=True, timeout=timeout)


def client_call(fn):
    async def go():
        async with get_client() as client:
            return await fn(client)

    return asyncio.run(go())


def wait_final(flow_run_id, timeout: float = 360):
    deadline = time.time() + timeout
    while True:
        run = client_call(lambda c: c.read_flow_run(flow_run_id))
        if run.state and run.state.is_final():
            return run
        assert time.time() < deadline, f"flow run {run.name} still {run.state.name if run.state else None} after {timeout}s"
        time.sleep(1)


def remove_deployment(name: str) -> None:
    """Delete a deployment and the automations of its triggers (deleting a deployment leaves them)."""
    deployment = client_call(lambda c: c.read_deployment_by_name(name))
    client_call(lambda c: c.delete_resource_owned_automations(f"prefect.deployment.{deployment.id}"))
    client_call(lambda c: c.delete_deployment(deployment.id))


def start_worker(log_path: Path, name: str, queues: list[str], env: dict | None = None,
                 pool: str = "yattflow-process") -> subprocess.Popen:
    """A real process worker on ``pool`` serving ``queues``, polling every second."""
    env = dict(os.environ, PREFECT_WORKER_QUERY_SECONDS="1", PREFECT_WORKER_PREFETCH_SECONDS="10", **(env or {}))
    cmd = [sys.executable, "-m", "prefect", "worker", "start", "--pool", pool, "--type", "process",
           "--name", name, *(arg for q in queues for arg in ("--work-queue", q))]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 120
    while "started!" not in log_path.read_text():
        assert proc.poll() is None and time.time() < deadline, f"worker {name} did not start:\n{log_path.read_text()}"
        time.sleep(0.5)
    return proc


def stop_workers(*procs: subprocess.Popen, grace_s: float = 10) -> None:
    """SIGINT to every worker at once (they exit on SIGINT, not promptly on SIGTERM), then kill
    the ones still there after ``grace_s``: the tests are done with them."""
    for proc in procs:
        proc.send_signal(signal.SIGINT)
    deadline = time.time() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(deadline - time.time(), 0.1))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
