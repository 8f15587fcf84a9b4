"""bench/nodes.py's bookkeeping: the server it measures, and CPU per iteration from its snapshots
(the bench itself needs minutes and a PostgreSQL server: `python -m bench.nodes`)."""

from __future__ import annotations

from bench.nodes import per_iteration, server_settings, step_line
from flows.prefect_server import SERVER_SETTINGS


def test_the_bench_server_runs_what_yattflow_server_users_get(monkeypatch):
    monkeypatch.delenv("PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE", raising=False)
    assert SERVER_SETTINGS.items() <= server_settings().items()
    # a setting measured against yattflow's: the environment wins, as for `yattflow server`
    monkeypatch.setenv("PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE", "1")
    assert server_settings()["PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE"] == "1"


def _snap(t, parent, nodes, server, postgres):
    return {"t": t, "parent": parent, "nodes": nodes, "hosts": 0.0, "server": server, "postgres": postgres,
            "hosts_uss_mb": 0.0, "n_hosts": 2, "nodes_uss_mb": 0.0, "parent_uss_mb": 0.0}


def test_cpu_per_iteration_from_the_step_snapshots():
    start = _snap(0.0, 0.0, [], 1.0, 0.5)  # before the run: the server and database already ran
    snaps = [_snap(10.0, 3.0, [2.0, 2.2], 9.0, 1.5), _snap(14.0, 3.1, [2.5, 2.8], 11.0, 1.9),
             _snap(19.0, 3.3, [3.1, 3.3], 13.5, 2.4)]
    history = [{"step": s, "step_s": w, "engine_s": 0.5} for s, w in ((0, 9.0), (1, 4.2), (2, 4.8))]
    fig = per_iteration(snaps, history, warmup=1)  # step 1 only: step 0 warms up, the last writes a checkpoint
    assert fig["iterations"] == 1 and fig["wall_s"] == 4.2
    assert round(fig["parent_cpu_s"], 6) == 0.1 and [round(x, 6) for x in fig["node_cpu_s"]] == [0.5, 0.6]
    assert round(fig["orchestration_cpu_s"], 6) == round(0.1 + 1.1 + 2.0 + 0.4, 6)
    assert step_line(start, snaps[0], 0).startswith("step 0 done in 10.0s: CPU s parent 3.00, node controllers 4.20 "
                                                    "(2.00–2.20 each), server 8.00, postgres 1.00")
    assert "node controllers 1.10 (0.50–0.60 each), server 2.00" in step_line(snaps[0], snaps[1], 1)
