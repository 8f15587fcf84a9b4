"""Two nodes, for real: two network namespaces joined by a veth pair, each with its own address,
process worker, engine hosts and node controller bound to that address, train one run across them,
each DP group's two pipeline stages on both nodes (gloo between the namespaces; the real engines: torch
rollout and judge, the Megatron trainer on the CPU). Only addresses this test assigns to the pair it made are used;
both namespaces are removed after. Needs root and ``ip netns``; skips otherwise."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import assert_steps_completed, save_tiny_model

ROOT = Path(__file__).resolve().parents[1]


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def test_one_run_across_two_namespaces(prepared, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    tag = os.getpid() % 10000
    ns_a, ns_b, veth_a, veth_b = f"yfa{tag}", f"yfb{tag}", f"yfva{tag}", f"yfvb{tag}"
    net = f"169.254.{100 + tag % 100}"
    a, b = f"{net}.1", f"{net}.2"  # a /30 of the link-local range, on this pair only
    try:
        try:
            ip("netns", "add", ns_a)
            ip("netns", "add", ns_b)
            ip("link", "add", veth_a, "type", "veth", "peer", "name", veth_b)
            ip("link", "set", veth_a, "netns", ns_a)
            ip("link", "set", veth_b, "netns", ns_b)
            ip("-n", ns_a, "addr", "add", f"{a}/30", "dev", veth_a)
            ip("-n", ns_b, "addr", "add", f"{b}/30", "dev", veth_b)
            for ns, dev in ((ns_a, veth_a), (ns_b, veth_b)):
                ip("-n", ns, "link", "set", dev, "up")
                ip("-n", ns, "link", "set", "lo", "up")
        except (subprocess.CalledProcessError, FileNotFoundError) as e:
            pytest.skip(f"ip netns does not work here: {getattr(e, 'stderr', e)}")
        # Megatron-Core on the CPU in the engine hosts both nodes' workers start (tests/megatron_cpu_site)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "tests" / "megatron_cpu_site"), str(ROOT)]))
        policy = save_tiny_model(tmp_path / "policy", hidden_size=32, num_layers=2)  # a layer per stage
        env.pop("PREFECT_API_URL", None)  # node A's own server
        run = subprocess.run(["ip", "netns", "exec", ns_a, sys.executable, "-m", "tests.two_nodes_run", "--store", prepared,
                              "--policy", policy, "--work", str(tmp_path), "--a", a, "--b", b, "--ns-b", ns_b],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, f"{run.stdout[-5000:]}\n{run.stderr[-5000:]}"
    finally:
        for ns in (ns_a, ns_b):  # removing a namespace removes its end of the pair, and so the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    assert subprocess.run(["ip", "link", "show", veth_a], capture_output=True).returncode != 0  # the pair is gone
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["steps"] == [0, 1]
    assert result["tree"]["train-twonodes"][0] == "COMPLETED"
    assert_steps_completed(result["tree"], steps=(0, 1), groups=(0, 1))
    # each rank's host flow run was taken by its own node's worker: each group's two ranks on both nodes
    logs = result["worker_logs"]
    for host, node in (("dp-0", "a"), ("dp-0.1", "b"), ("dp-1", "b"), ("dp-1.1", "a")):
        other = "b" if node == "a" else "a"
        assert f"twonodes-{host}-host" in logs[node] and f"twonodes-{host}-host" not in logs[other], host
    # node B served its host and its node controller (and gloo) on B's address, and otherwise on its own
    # loopback only (reachable from inside B alone); node A on its address and its loopback (PostgreSQL, ...)
    at = lambda side: {s.split()[0].rsplit(":", 1)[0] for s in result["listening"][side]}  # noqa: E731
    assert at("b") == {b} | (at("b") & {"127.0.0.1"}), result["listening"]
    assert at("a") == {a} | (at("a") & {"127.0.0.1"}), result["listening"]
    on_b = [s for s in result["listening"]["b"] if s.startswith(f"{b}:")]
    assert any("engines.host" in s for s in on_b) and any("flows.node_controller" in s for s in on_b), on_b
    assert "2 node controllers of 1 DP groups each, at " in result["train_log"] and f"{b}:" in result["train_log"]
    for host in ("dp-0", "dp-1"):  # each group's two stages loaded Megatron, its rollout engine on the first
        assert f"{host}: engines (rollout=torch judge=torch train=megatron)" in result["train_log"], host
        assert f"{host}.1: engines (rollout=- judge=- train=megatron)" in result["train_log"], host
    layout = json.loads((Path(prepared) / "runs" / "twonodes" / "checkpoints" / "000001" / "layout.json").read_text())
    assert (layout["dp"], layout["pipeline_parallel"]) == (2, 2)
