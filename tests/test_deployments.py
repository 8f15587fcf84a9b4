"""Deployments, the Prefect way, on real components: the session's real ``prefect server``,
work pools created from ``deployments/*.json`` with ``prefect work-pool create``, a real
``prefect deploy`` of ``deployments/prefect.yaml``, a real ``prefect worker start`` process
that runs the flow runs as subprocesses, and the server's own scheduler. Every assertion on
Prefect reads states back through the client."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.request
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from prefect.client.schemas.filters import (
    DeploymentFilter,
    DeploymentFilterName,
    FlowRunFilter,
    FlowRunFilterName,
)

from flows.prefect_server import SERVER_SETTINGS
from tests.helpers import TINY, assert_steps_completed, children, free_port, read_run_tree
from tests.prefect_cli import (CLI_SECONDS, DEPLOYMENTS, POOLS, ROOT, client_call, prefect, remove_deployment, start_worker,
                               stop_workers, wait_final, yattflow)













# ---------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def pools(prefect_server):
    """Both work pools, created (or overwritten) from the templates in deployments/."""
    for name, (kind, template) in POOLS.items():
        prefect("work-pool", "create", name, "--type", kind, "--base-job-template", str(template), "--overwrite")
    return POOLS


@pytest.fixture(scope="module")
def deployed(pools):
    """``prefect deploy --all`` of deployments/prefect.yaml, from the repository root. The evaluate
    deployment is deleted at once: its trigger would schedule an evaluation of every checkpoint of
    the session's later runs (tests/test_events.py deploys it for its own tests)."""
    out = prefect("deploy", "--prefect-file", str(DEPLOYMENTS / "prefect.yaml"), "--all", timeout=300)
    for name in ("train/yattflow", "engine-host/yattflow-host", "prepare/prepare", "evaluate/evaluate", "train/yattflow-k8s",
                 "engine-host/yattflow-host-k8s"):
        assert f"Deployment '{name}' successfully created" in out, out
    remove_deployment("evaluate/evaluate")
    return out








@pytest.fixture(scope="module")
def worker(pools, tmp_path_factory):
    """The worker of the training runs: the pool's default queue (engine hosts have their own)."""
    log_path = tmp_path_factory.mktemp("worker") / "worker.log"
    proc = start_worker(log_path, "test-worker", ["default"])
    yield log_path
    stop_workers(proc)


@pytest.fixture(scope="module")
def gpu_workers(pools, tmp_path_factory):
    """One worker per "GPU node", each serving one DP group's queue (dp-0, dp-1): {group: its log}."""
    logs = {g: tmp_path_factory.mktemp("gpu-worker") / f"gpu-worker-{g}.log" for g in (0, 1)}
    procs = [start_worker(logs[g], f"gpu-node-{g}", [f"dp-{g}"]) for g in logs]
    yield logs
    stop_workers(*procs)


# ---------------------------------------------------------------------------------- work pools


def render_job(template: dict, values: dict) -> dict:
    """A job as a worker renders it (``BaseJobConfiguration.from_template_and_values``: pool
    defaults, then job variables), keeping every field the template produces."""
    from prefect.workers.base import BaseJobConfiguration
    from pydantic import ConfigDict

    class Job(BaseJobConfiguration):
        model_config = ConfigDict(extra="allow")

    return asyncio.run(Job.from_template_and_values(template, values)).model_dump()


def test_work_pools_from_the_templates(pools):
    """Both pools exist on the real server with the templates as written; the worker-side
    rendering puts GPUs where each platform reads them."""
    for name, (kind, template) in pools.items():
        pool = client_call(lambda c, n=name: c.read_work_pool(n))
        assert pool.type == kind
        assert pool.base_job_template == json.loads(template.read_text())

    k8s = json.loads(POOLS["yattflow-k8s"][1].read_text())
    job = render_job(k8s, {"gpus": 4, "image": "registry.example.com/yattflow:1", "namespace": "rl"})
    pod = job["job_manifest"]["spec"]["template"]["spec"]
    resources = pod["containers"][0]["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == 4 and resources["requests"]["nvidia.com/gpu"] == 4
    assert pod["containers"][0]["image"] == "registry.example.com/yattflow:1"
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert pod["volumes"][0]["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}

    process = json.loads(POOLS["yattflow-process"][1].read_text())
    job = render_job(process, {"env": {"CUDA_VISIBLE_DEVICES": "2,3"}})
    assert job["env"]["CUDA_VISIBLE_DEVICES"] == "2,3" and job["env"]["HF_HUB_OFFLINE"] == "1"  # merged, not replaced


# ---------------------------------------------------------------------------------- deploy + run


@pytest.mark.slow
def test_deploy_and_run_on_a_process_worker(prepared, deployed, worker):
    """`prefect deployment run 'train/yattflow' --param overrides=[...]` runs to Completed on the
    worker; every iteration, DP-group sub-flow and stage task is on the API, Completed."""
    dep = client_call(lambda c: c.read_deployment_by_name("train/yattflow"))
    assert dep.global_concurrency_limit.limit == 1
    assert dep.concurrency_options.collision_strategy.value == "ENQUEUE"
    assert dep.pull_steps == [{"prefect.deployments.steps.set_working_directory": {"directory": str(ROOT)}}]
    [nightly] = dep.schedules
    assert nightly.schedule.cron == "0 3 * * *" and nightly.active is False  # an example, off until turned on
    assert "steps_per_run=20" in nightly.parameters["overrides"]
    k8s = client_call(lambda c: c.read_deployment_by_name("train/yattflow-k8s"))
    assert k8s.work_pool_name == "yattflow-k8s" and k8s.job_variables["gpus"] == 2
    with pytest.raises(Exception, match="gpus"):  # the server checks run job variables against the pool's schema
        client_call(lambda c: c.create_flow_run_from_deployment(k8s.id, job_variables={"gpus": "lots"}))

    overrides = TINY + [f"storage.root={prepared}", "name=deptest", "steps=2", "dp=2"]
    out = prefect("deployment", "run", "train/yattflow", "--param", f"overrides={json.dumps(overrides)}")
    flow_run_id = re.search(r"UUID: ([0-9a-f-]{36})", out).group(1)
    # Meanwhile `yattflow run` (= prefect deployment run ...) of the prepare deployment, another
    # deployment so it may run alongside; everything exists, so it only checks and skips.
    prepare = subprocess.Popen([sys.executable, "-m", "flows.cli", "run", "--deployment", "prepare/prepare", "--watch",
                                *TINY, f"storage.root={prepared}"], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    run = wait_final(flow_run_id)
    assert run.state.is_completed(), f"{run.name}: {run.state.name} {run.state.message}\n{worker.read_text()[-3000:]}"
    assert run.name == "train-deptest" and run.deployment_id == dep.id

    found = asyncio.run(read_run_tree("deptest"))
    assert sorted(n for n in found if n.startswith("iteration-") and "-dp-" not in n) == ["iteration-0000", "iteration-0001"]
    assert_steps_completed(found, steps=(0, 1), groups=(0, 1))
    assert json.loads((Path(prepared) / "runs" / "deptest" / "state.json").read_text())["step"] == 1

    # the CLI reads the same back: the run, its state and the committed step
    status = yattflow("status", "deptest")
    assert status.returncode == 0 and re.search(r"train-deptest\s+Completed .* deptest\s+2/2", status.stdout), status

    ran, _ = prepare.communicate(timeout=120)
    assert prepare.returncode == 0, ran
    assert "flow run prepare-demo (" in ran, ran  # named as the flow names itself, from the start
    assert "of prepare/prepare: http://" in ran and "/runs/flow-run/" in ran and ran.strip().endswith("Completed"), ran
    bad = yattflow("run", "train.lr=-1")  # checked here, before any flow run is created
    assert bad.returncode == 2 and "field 'train.lr'" in bad.stderr


# ---------------------------------------------------------------------------------- engine hosts on a pool


@pytest.mark.slow
def test_engine_hosts_run_as_flow_runs_on_their_work_queues(prepared, deployed, worker, gpu_workers):
    """With ``hosts.launch=deployment`` each DP group's engine host is a flow run of
    engine-host/yattflow-host on its own work queue, taken by that queue's worker, pinned by its
    ``CUDA_VISIBLE_DEVICES``; the training run connects to them through the registry on object
    storage, with a secret that is in no flow run's parameters; engines load once per host; the
    hosts end Completed when the run does, and the run leaves no secret and no registry behind."""
    from prefect.client.schemas.filters import FlowRunFilterId, LogFilter, LogFilterFlowRunId

    overrides = TINY + [f"storage.root={prepared}", "name=hosttest", "steps=2", "dp=2", "hosts.launch=deployment",
                        'hosts.devices=["0", "1"]', "hosts.start_timeout_s=300"]
    out = prefect("deployment", "run", "train/yattflow", "--param", f"overrides={json.dumps(overrides)}")
    run = wait_final(re.search(r"UUID: ([0-9a-f-]{36})", out).group(1), timeout=600)
    assert run.state.is_completed(), f"{run.name}: {run.state.name} {run.state.message}\n{worker.read_text()[-3000:]}"

    found = asyncio.run(read_run_tree("hosttest"))
    assert_steps_completed(found, steps=(0, 1), groups=(0, 1))
    kids = {r.name: r for r in client_call(lambda c: children(c, run.id))}
    host_dep = client_call(lambda c: c.read_deployment_by_name("engine-host/yattflow-host"))
    for g in (0, 1):
        host = kids[f"hosttest-dp-{g}-host"]  # a sub-flow of the training run in the UI
        assert host.state.is_completed(), (host.state.name, host.state.message)
        assert host.deployment_id == host_dep.id and host.work_queue_name == f"dp-{g}"
        assert host.job_variables == {"env": {"CUDA_VISIBLE_DEVICES": str(g)}}
        # taken by the worker of its queue, and only that one
        assert str(host.id) in gpu_workers[g].read_text() and str(host.id) not in gpu_workers[1 - g].read_text()
        assert str(host.id) not in worker.read_text()
        logs = client_call(lambda c, i=host.id: c.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[i]))))
        assert any(f"dp-{g} listening at" in entry.message and f"CUDA_VISIBLE_DEVICES={g}" in entry.message
                   for entry in logs), [entry.message for entry in logs]
        assert set(host.parameters) == {"run", "rank", "world", "registry", "secret_block", "controller", "threads", "bind",
                                        "label"}
        assert host.parameters["controller"] == str(run.id)

    # The secret never was a parameter, and its block is gone with the run.
    secret_block = kids["hosttest-dp-0-host"].parameters["secret_block"]
    every_run = client_call(lambda c: c.read_flow_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[
        run.id, *(r.id for r in kids.values())]))))
    assert len(every_run) == 1 + len(kids) == 5  # the run, its two iterations, its two hosts
    assert not any(re.search(r"[0-9a-f]{64}", json.dumps(r.parameters)) for r in every_run)  # a 32-byte hex secret
    from prefect.blocks.system import Secret

    with pytest.raises(ValueError, match="Unable to find block document"):
        Secret.load(secret_block)
    assert not (Path(prepared) / "runs" / "hosttest" / "hosts").exists() or not any(
        (Path(prepared) / "runs" / "hosttest" / "hosts").iterdir())

    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    table = client_call(lambda c: c.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["hosttest-iteration"]))))
    loads = [row["engine_loads"] for a in table for row in json.loads(a.data)]
    assert loads and set(loads) == {1}  # engines loaded once per host for the whole run


def test_a_host_no_worker_takes_fails_the_run_naming_its_queue(prepared, deployed):
    """No worker serves the hosts' queues: the run fails after hosts.start_timeout_s with the queue
    named, cancels the host flow runs it started and deletes the run's secret."""
    from prefect.blocks.system import Secret

    from flows.training import train

    overrides = TINY + [f"storage.root={prepared}", "name=nohosts", "dp=2", "hosts.launch=deployment",
                        "hosts.work_queue=nobody-{group}", "hosts.start_timeout_s=3"]
    with pytest.raises(Exception, match=r"dp-0: engine-host flow run 'nohosts-dp-0-host' not up within "
                                        r"hosts.start_timeout_s=3s \(state Scheduled\).*work queue 'nobody-0'"):
        asyncio.run(train(overrides=overrides))
    hosts = client_call(lambda c: c.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(like_="nohosts-dp-"))))
    # cancelled by the run on its way out: never picked up, there was no process to wait for
    assert len(hosts) == 2 and all(r.state.is_cancelled() for r in hosts), [r.state for r in hosts]
    with pytest.raises(ValueError, match="Unable to find block document"):
        Secret.load(hosts[0].parameters["secret_block"])


def _flow_run_process(flow_run_id: str) -> int:
    """The pid of the process a worker started for a flow run (it has PREFECT__FLOW_RUN_ID set)."""
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if f"PREFECT__FLOW_RUN_ID={flow_run_id}".encode() in environ.read_bytes().split(b"\0"):
                return int(environ.parent.name)
        except OSError:
            continue
    raise AssertionError(f"no process for flow run {flow_run_id}")


@pytest.mark.slow
@pytest.mark.parametrize("how", ["cancel", "kill"])
def test_deployed_hosts_end_with_their_training_run(prepared, deployed, worker, gpu_workers, how):
    """A training run stops while its deployed hosts serve it — cancelled from the CLI, or its
    process killed (OOM, a lost node) — and its hosts end too: shut down by the run on its way
    out (a cancel that reaches the flow as an exception lets `async with engine_hosts` exit), or
    on their own when the run's connection drops or its state turns final (Failed, with the
    reason). No engine process is left holding a device."""
    name = f"{how}test"
    overrides = TINY + [f"storage.root={prepared}", f"name={name}", "steps=50", "dp=2", "hosts.launch=deployment"]
    out = prefect("deployment", "run", "train/yattflow", "--param", f"overrides={json.dumps(overrides)}")
    run_id = re.search(r"UUID: ([0-9a-f-]{36})", out).group(1)
    deadline = time.time() + 300
    while not any(c.name == "iteration-0001" for c in client_call(lambda c: children(c, run_id))):
        assert time.time() < deadline, "the run did not reach its second iteration"
        time.sleep(1)
    [registry] = (Path(prepared) / "runs" / name / "hosts").iterdir()
    pids = [json.loads(f.read_text())["pid"] for f in sorted(registry.glob("dp-*.json"))]
    assert len(pids) == 2 and all(Path(f"/proc/{pid}").exists() for pid in pids)

    if how == "cancel":
        prefect("flow-run", "cancel", run_id)
        assert wait_final(run_id, timeout=120).state.is_cancelled()
    else:
        os.kill(_flow_run_process(run_id), signal.SIGKILL)
    hosts = [r for r in client_call(lambda c: children(c, run_id)) if r.name.endswith("-host")]
    assert sorted(r.name for r in hosts) == [f"{name}-dp-0-host", f"{name}-dp-1-host"]
    for host in hosts:
        final = wait_final(host.id, timeout=120).state
        on_its_own = final.is_failed() and any(reason in final.message for reason in (
            "exited with code 3", "the training run ended"))  # the connection dropped / the run's state is final
        # a cancel: the run shuts its hosts down on its way out (Completed), unless Prefect's own
        # cancellation of the cancelled run's child runs reaches a host first (Cancelled; seen in CI)
        assert on_its_own or (how == "cancel" and (final.is_completed() or final.is_cancelled())), final
    deadline = time.time() + 30
    while any(Path(f"/proc/{pid}").exists() for pid in pids):
        assert time.time() < deadline, f"engine host processes {pids} outlived their run"
        time.sleep(0.5)


# ---------------------------------------------------------------------------------- schedule


def _prompt_part(prepared: str, folder: Path, name: str, start: int, rows: int) -> list[int]:
    table = pq.read_table(Path(prepared) / "data" / "train").slice(start, rows)
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, folder / f".{name}.tmp")
    (folder / f".{name}.tmp").rename(folder / name)  # whole files only, as a data pipeline would drop them
    return table.column("prompt_id").to_pylist()


def _stage_ids(run_dir: Path, stage: str) -> dict[int, list[int]]:
    """prompt_ids per step (every group, every wave) of one stage's outputs."""
    return {int(step.name): [i for f in sorted(step.glob(f"{stage}/group=*/*.parquet"))
                             for i in set(pq.read_table(f).column("prompt_id").to_pylist())]
            for step in sorted((run_dir / "steps").iterdir())}


@pytest.mark.slow
def test_schedule_continues_the_run_and_runs_never_overlap(prepared, pools, worker, tmp_path):
    """An RRULE schedule fires twice, 5 s apart, on a deployment of the same prefect.yaml entry with
    ``steps_per_run=2``: the second firing waits for the first (deployment concurrency limit 1,
    ENQUEUE), then trains steps 2-3 from the first one's checkpoint, on prompts it has not trained —
    including a prompt file that arrived while the first run was training."""
    prompts = tmp_path / "prompts"
    first_ids = _prompt_part(prepared, prompts, "part-00000.parquet", 0, 24)  # 12 per DP group
    spec = yaml.safe_load((DEPLOYMENTS / "prefect.yaml").read_text())
    [entry] = [d for d in spec["deployments"] if d["name"] == "yattflow"]
    # the first firing must come after the deploy below and the scheduler's next pass (5 s)
    margin = max(20.0, 2 * max(CLI_SECONDS, default=0) + 10)
    start = (datetime.now(timezone.utc) + timedelta(seconds=margin)).replace(microsecond=0)
    # Without the dynamic filter every wave keeps enough groups: with fixed waves, exactly 4 prompts per
    # group per step (adaptive waves would draw fewer, having learnt that every group is kept).
    overrides = TINY + [f"storage.root={prepared}", f"data.prompts={prompts}", "name=schedtest", "steps=4",
                        "steps_per_run=2", "dp=2", "sampling.filter_equal_rewards=false", "sampling.adaptive=false"]
    entry.update(name="yattflow-schedtest", parameters={"config_file": "deployments/demo.yaml", "overrides": overrides},
                 schedules=[{"rrule": f"DTSTART:{start:%Y%m%dT%H%M%SZ}\nRRULE:FREQ=SECONDLY;INTERVAL=5;COUNT=2",
                             "active": True}])
    spec["deployments"] = [entry]
    (tmp_path / "prefect.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    prefect("deploy", "--prefect-file", str(tmp_path / "prefect.yaml"), "--name", "yattflow-schedtest")
    assert datetime.now(timezone.utc) < start - timedelta(seconds=6), "deploy took too long: the first firing is missed"

    def scheduled():
        return client_call(lambda c: c.read_flow_runs(
            deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=["yattflow-schedtest"]))))

    deadline = time.time() + 120
    while len(runs := scheduled()) < 2:
        assert time.time() < deadline, f"the scheduler created {len(runs)} of 2 runs"
        time.sleep(1)
    early, late = sorted(runs, key=lambda r: r.expected_start_time)
    assert early.auto_scheduled and late.auto_scheduled
    assert late.expected_start_time - early.expected_start_time == timedelta(seconds=5)

    # New prompts arrive once the run that started has its engine hosts up and the prompt stream
    # read (setup runs before the first iteration): that run does not see them, the other must.
    deadline = time.time() + 240
    while not any(c.name == "iteration-0000" for r in runs for c in client_call(lambda c, i=r.id: children(c, i))):
        assert time.time() < deadline, "no run reached its first iteration"
        time.sleep(1)
    new_ids = _prompt_part(prepared, prompts, "part-00001.parquet", 24, 24)

    done = [wait_final(r.id, timeout=400) for r in runs]
    assert all(r.state.is_completed() for r in done), worker.read_text()[-3000:]
    history = {r.id: client_call(lambda c, i=r.id: c.read_flow_run_states(i)) for r in done}
    running = {r.id: next(s.timestamp for s in history[r.id] if s.name == "Running") for r in done}
    finished = {r.id: next(s.timestamp for s in history[r.id] if s.is_final()) for r in done}
    first, second = sorted(done, key=lambda r: running[r.id])  # (the schedule's order, unless a worker poll raced)

    # Scheduled: the first started within seconds of its RRULE time.
    assert abs((first.start_time - first.expected_start_time).total_seconds()) < 15
    # Never alongside: the second waited for the concurrency slot, and its Running began after
    # the first had finished.
    names = [s.name for s in history[second.id]]
    assert "AwaitingConcurrencySlot" in names, names
    assert running[first.id] < finished[first.id] <= running[second.id]

    # The second continued the first: steps 2-3, from the checkpoint of step 1.
    its = {r.id: sorted(c.name for c in client_call(lambda c, i=r.id: children(c, i))) for r in (first, second)}
    assert its[first.id] == ["iteration-0000", "iteration-0001"]
    assert its[second.id] == ["iteration-0002", "iteration-0003"]
    run_dir = Path(prepared) / "runs" / "schedtest"
    state = json.loads((run_dir / "state.json").read_text())
    assert state["step"] == 3 and state["cursors"] == [16, 16]
    assert json.loads((run_dir / "checkpoints" / "000003" / "prompts.json").read_text())["files"] == [
        ["part-00000.parquet", 24], ["part-00001.parquet", 24]]

    # No prompt drawn or trained twice across both runs; the second reached the new file.
    for stage in ("rollouts", "experience"):
        ids = [i for step in _stage_ids(run_dir, stage).values() for i in step]
        assert len(ids) == len(set(ids)), f"{stage}: a prompt appears in two steps"
    rolled = _stage_ids(run_dir, "rollouts")
    assert sorted(rolled) == [0, 1, 2, 3]
    assert set(rolled[0] + rolled[1]) <= set(first_ids)
    assert set(rolled[2] + rolled[3]) & set(new_ids)


# ---------------------------------------------------------------------------------- prompt files


def test_new_prompt_files_extend_each_stream_and_reordering_is_refused(tmp_path):
    """Part files added after the existing ones only extend every DP group's stream, so cursors keep
    their prompts; a file that sorts before a trained one (or a changed file) stops the resume."""
    import pyarrow as pa

    from engines.host.checkpointing import Checkpoints
    from engines.host.prompts import PromptStream
    from storage.datasets import part_files

    def prompt_stream(uri: str, rank: int, world: int) -> list[dict]:  # the whole stream, one epoch
        stream = PromptStream(uri, rank, world)
        return stream.wave(0, len(stream))

    def part(name: str, ids: range) -> None:
        pq.write_table(pa.table({"prompt_id": list(ids), "prompt": [f"{i}+1=" for i in ids], "answer": ["x"] * len(ids)}),
                       tmp_path / "prompts" / name)

    (tmp_path / "prompts").mkdir()
    part("part-00000.parquet", range(0, 10))
    uri = f"file://{tmp_path / 'prompts'}"
    before = [[r["prompt_id"] for r in prompt_stream(uri, rank, 3)] for rank in range(3)]
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "prompts.json").write_text(json.dumps({"files": part_files(uri)}))

    part("part-00001.parquet", range(10, 17))
    for rank, old in enumerate(before):
        stream = [r["prompt_id"] for r in prompt_stream(uri, rank, 3)]
        assert stream[: len(old)] == old and len(stream) > len(old)
        Checkpoints(rank, "torch", part_files(uri)).check_prompt_files(uri, f"file://{checkpoint}")  # accepted

    part("extra.parquet", range(20, 23))  # sorts before part-00000: every position would shift
    with pytest.raises(ValueError, match=r"part file 1 \(name order\) was 'part-00000.parquet' \(10 rows\).*'extra.parquet'"):
        Checkpoints(0, "torch", part_files(uri)).check_prompt_files(uri, f"file://{checkpoint}")


# ---------------------------------------------------------------------------------- yattflow server



@pytest.mark.integration
@pytest.mark.slow
def test_yattflow_server_starts_server_and_workers_and_ctrl_c_stops_them(tmp_path):
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"} | {"PREFECT_HOME": str(tmp_path / "home")}
    log_path = tmp_path / "server.out"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "server", "--port", str(port)], cwd=ROOT, env=env,
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 180
        while log_path.read_text().count("started!") < 2:  # the workers' lines, printed after the UI URL
            assert proc.poll() is None and time.time() < deadline, log_path.read_text()
            time.sleep(0.5)
        assert f"Prefect UI: http://127.0.0.1:{port}" in log_path.read_text()
        for name in ("yattflow-process", "yattflow-eval"):  # training, and the evaluations its checkpoints trigger
            pool = json.load(urllib.request.urlopen(f"{api}/work_pools/{name}", timeout=10))
            assert pool["type"] == "process" and pool["base_job_template"] == json.loads(POOLS[name][1].read_text())
        kids = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert len(kids) == 3, kids  # the server and the workers; the pools were created through the server, not an ephemeral API
        server_pid = next(k for k in kids if b"server\x00start" in Path(f"/proc/{k}/cmdline").read_bytes())
        server_env = dict(kv.split("=", 1) for kv in Path(f"/proc/{server_pid}/environ").read_text().split("\0") if "=" in kv)
        assert {k: server_env.get(k) for k in SERVER_SETTINGS} == SERVER_SETTINGS  # the batched task-run recorder
    finally:
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        rc = proc.wait(timeout=90)
    assert rc == 0, log_path.read_text()
    assert not any(Path(f"/proc/{k}").exists() for k in kids)
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{api}/health", timeout=2)


def test_train_without_a_server_runs_on_a_temporary_one_whose_sqlite_writes_never_fail(prepared, tmp_path):
    """No PREFECT_API_URL: ``yattflow train`` starts a temporary Prefect server on SQLite for the
    command (``flows/prefect_server.py``) and stops it after. Its write transactions are
    immediate, so concurrent writers (the next iteration's sub-flow, the task-run recorder, two DP
    groups) wait their turn: the server never answers "database is locked" (with Prefect's
    deferred transactions it did at almost every step, and the client waited 2 s each time)."""
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"} | {
        "PREFECT_HOME": str(home), "PREFECT_API_LOG_RETRYABLE_ERRORS": "true"}
    done = subprocess.run([sys.executable, "-m", "flows.cli", "train", *TINY, f"storage.root={prepared}", "name=temporary-server",
                           "steps=4", "dp=2"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "step 4/4" in done.stdout + done.stderr
    server_log = (home / "yattflow-temporary-server.log").read_text()
    assert "Server stopped!" in server_log, server_log[-2000:]  # the run used the temporary server ...
    assert "retryable exception" not in server_log and "database is locked" not in server_log, server_log[-3000:]
    # ... and it is gone
    assert not subprocess.run(["pgrep", "-f", f"flows.prefect_server.*{home}"], capture_output=True).stdout
    # It recorded every stage's task run (a later `yattflow server` on this PREFECT_HOME shows them) and
    # nothing a one-command server does not need: no event feed (flows.prefect_server.TEMPORARY_SERVER_SETTINGS)
    with contextlib.closing(sqlite3.connect(home / "prefect.db")) as db:
        states = db.execute("SELECT state_type FROM task_run WHERE name LIKE 'train_step dp=%'").fetchall()
        events = db.execute("SELECT count(*) FROM events").fetchone()[0]
    assert states == [("COMPLETED",)] * 8, states  # 4 steps x 2 DP groups
    assert events == 0


def test_a_killed_cli_takes_its_temporary_server_with_it(prepared, tmp_path):
    """kill -9 of ``yattflow`` leaves no Prefect server behind: the server gets SIGTERM when its parent dies.
    (The run's input is the prepared demo's: a bad one would stop the command before its server starts.)"""
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"} | {"PREFECT_HOME": str(tmp_path / "home")}
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "train", *TINY, f"storage.root={prepared}", "name=killed"],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline, server = time.time() + 120, None
        while server is None:
            assert proc.poll() is None and time.time() < deadline
            kids = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
            server = next((k for k in kids if b"flows.prefect_server" in Path(f"/proc/{k}/cmdline").read_bytes()), None)
            time.sleep(0.2)
    finally:
        proc.kill()
        proc.wait()
    deadline = time.time() + 30
    while Path(f"/proc/{server}").exists() and b"zombie" not in subprocess.run(
            ["ps", "-o", "stat=", "-p", server], capture_output=True).stdout.lower() and time.time() < deadline:
        time.sleep(0.2)
    state = subprocess.run(["ps", "-o", "stat=", "-p", server], capture_output=True, text=True).stdout.strip()
    assert state in ("", "Z"), f"the temporary server {server} outlived its killed parent (state {state})"


