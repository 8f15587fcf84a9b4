"""Training that other things react to, on the session's real Prefect server with its default
services (the triggers service included) and real process workers: a run's events, each committed
checkpoint evaluated by the ``evaluate`` deployment its event triggers, and the automations of
deployments/automations.yaml cancelling a run whose guard tripped or whose steps stopped coming."""

from __future__ import annotations

import asyncio
import http.server
import json
import math
import re
import threading
import time
from pathlib import Path

import pytest
import yaml
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

from engines.config import ConfigError, load_config
from flows import events
from flows.admin import AUTOMATIONS_FILE, ensure_automations
from flows.metrics import StepMetrics
from tests.helpers import TINY, children
from tests.prefect_cli import (
    DEPLOYMENTS,
    client_call,
    prefect,
    remove_deployment,
    start_worker,
    stop_workers,
    wait_final,
    yattflow,
)

from tests.helpers import STUBS


# ---------------------------------------------------------------------------------- the guard, alone


def step(n: int, reward: float, **train: float) -> StepMetrics:
    figures = dict.fromkeys(events.STEP_FIELDS, 0) | {"step": n, "reward": reward, "heldout": None}
    return StepMetrics.model_construct(**figures, train={"loss": 0.1, "grad_norm": 1.0} | train)


def test_guard_trips_on_a_reward_drop_over_its_window_and_on_bounds():
    config = load_config(overrides=["guard.reward_drop=0.3", "guard.window=2", "guard.max={kl_reference: 0.5}"])
    history = [step(0, 0.9), step(1, 0.5), step(2, 0.65)]
    assert events.guard_trips(config, history) == []  # 0.65 is 0.25 below the best of steps 0-1
    history.append(step(3, 0.34))  # 0.31 below 0.65 (step 0's 0.9 is outside the window)
    [reason] = events.guard_trips(config, history)
    assert "reward 0.340 is 0.310 below the best of the 2 step(s)" in reason
    assert events.guard_trips(config, [step(0, 0.1)]) == []  # nothing before the first step
    tripped = events.guard_trips(config, [step(0, 0.5, kl_reference=0.7)])
    assert tripped == ["kl_reference 0.7 is above guard.max.kl_reference=0.5"]
    assert events.guard_trips(config, [step(0, 0.5, kl_reference=math.nan)])  # NaN is outside every bound
    assert events.guard_trips(load_config(), history) == []  # off by default


def test_guard_names_a_figure_no_step_reports_before_engines_load():
    events.check_guard(load_config(overrides=["guard.max={entropy: 5, clip_fraction: 0.3, seconds: 60}"]))
    with pytest.raises(ConfigError, match=r"field 'guard.max': kl_refrence is not a figure .* kl_reference"):
        events.check_guard(load_config(overrides=["guard.max={kl_refrence: 1}"]))


# ---------------------------------------------------------------------------------- on the server


@pytest.fixture(scope="module")
def deployed(prefect_server):
    """The train and evaluate deployments on their pools; removed afterwards, so that the evaluate
    trigger schedules nothing for the session's later runs."""
    template = str(DEPLOYMENTS / "process-gpu.json")
    for pool in ("yattflow-process", "yattflow-eval"):
        prefect("work-pool", "create", pool, "--type", "process", "--base-job-template", template, "--overwrite")
    out = prefect("deploy", "--prefect-file", str(DEPLOYMENTS / "prefect.yaml"), "--name", "yattflow", "--name", "evaluate",
                  timeout=300)
    assert "Deployment 'evaluate/evaluate' successfully created" in out, out
    yield
    remove_deployment("evaluate/evaluate")


@pytest.fixture(scope="module")
def trainer(deployed, tmp_path_factory):
    log = tmp_path_factory.mktemp("events-worker") / "worker.log"
    proc = start_worker(log, "events-train-worker", ["default"])
    yield log
    stop_workers(proc)


def run_deployed(overrides: list[str]) -> str:
    out = prefect("deployment", "run", "train/yattflow", "--param", f"overrides={json.dumps(overrides)}")
    return re.search(r"UUID: ([0-9a-f-]{36})", out).group(1)


def read_events(resource_id: str, prefix: str = "yattflow.") -> list:
    from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter

    page = client_call(lambda c: c.read_events(EventFilter(event=EventNameFilter(prefix=[prefix]),
                                                            resource=EventResourceFilter(id=[resource_id])), limit=50))
    return sorted(page.events, key=lambda e: e.occurred)


def wait_for(what: str, check, timeout: float = 240):
    deadline = time.time() + timeout
    while not (found := check()):
        assert time.time() < deadline, f"{what}: not within {timeout}s"
        time.sleep(1)
    return found


def cancelled_by_automation(run_id: str) -> bool:
    states = client_call(lambda c: c.read_flow_run_states(run_id))
    return any(s.type.value == "CANCELLING" and "Automation" in (s.message or "") for s in states)


@pytest.mark.slow
def test_each_committed_checkpoint_is_evaluated_by_the_deployment_its_event_triggers(prepared, trainer, tmp_path):
    """A deployed run emits its step, checkpoint and finish events (on its flow run, in the event
    feed); each checkpoint event starts an evaluate flow run on the yattflow-eval pool, which
    completes and writes its result beside the run's checkpoints. `yattflow evaluate` by hand too."""
    evaluator = start_worker(tmp_path / "eval-worker.log", "events-eval-worker", ["default"], pool="yattflow-eval")
    try:
        run_id = run_deployed(TINY + [f"storage.root={prepared}", "name=evaltest", "steps=2", "dp=1", "checkpoint.every=1"])
        assert wait_final(run_id).state.is_completed()
        run_dir = Path(prepared) / "runs" / "evaltest"
        def persisted():  # the server stores events in batches, every few seconds
            found = [e.event for e in read_events(f"prefect.flow-run.{run_id}")]
            return found if events.RUN_FINISHED in found else None

        names = wait_for("the run's events in the feed", persisted, timeout=60)
        assert names.count(events.STEP_COMPLETED) == 2 and names.count(events.CHECKPOINT_COMMITTED) == 2, names
        assert names[-1] == events.RUN_FINISHED, names
        [first_step] = [e for e in read_events(f"prefect.flow-run.{run_id}", events.STEP_COMPLETED) if e.payload["step"] == 0]
        assert first_step.resource["yattflow.run"] == "evaltest" and {"reward", "kl_reference", "grad_norm"} <= set(first_step.payload)

        def evaluated():
            mine = client_call(lambda c: c.read_flow_runs(
                flow_run_filter=FlowRunFilter(name=FlowRunFilterName(like_="evaluate-evaltest-"))))
            return mine if len(mine) == 2 and all(r.state.is_final() for r in mine) else None

        runs = wait_for("two evaluation flow runs, final", evaluated)
    finally:
        stop_workers(evaluator)
    assert all(r.state.is_completed() for r in runs), [(r.name, r.state) for r in runs]
    for step_number in (0, 1):
        checkpoint = run_dir / "checkpoints" / f"{step_number:06d}"
        result = json.loads((run_dir / "evaluations" / f"{step_number:06d}.json").read_text())
        manifest = json.loads((checkpoint / "MANIFEST.json").read_text())
        assert result["step"] == step_number and result["policy_version"] == manifest["policy_version"]
        assert result["checkpoint"] == f"file://{checkpoint}" and 0 <= result["score"] <= 1

    by_hand = yattflow("evaluate", *TINY, f"storage.root={prepared}", "name=evaltest", "--checkpoint", "final")
    assert by_hand.returncode == 0, by_hand.stderr
    final = json.loads((run_dir / "evaluations" / "final.json").read_text())
    assert "evaluations/final.json" in by_hand.stdout and final["step"] == 1 and final["policy_version"] == manifest["policy_version"]


@pytest.fixture
def hook(prefect_server):
    """A webhook on loopback that keeps what is posted to it, and a Prefect notification block
    (custom-webhook/yattflow-test-hook) that posts there."""
    from prefect.blocks.notifications import CustomWebhookNotificationBlock

    posted: list[dict] = []

    class Hook(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            posted.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    CustomWebhookNotificationBlock(name="yattflow test", url=f"http://127.0.0.1:{server.server_address[1]}/hook",
                                   json_data={"subject": "{{subject}}", "body": "{{body}}"}).save("yattflow-test-hook", overwrite=True)
    yield posted
    server.shutdown()


@pytest.fixture
def automations(hook):
    """The automations of deployments/automations.yaml, as `yattflow deploy --notify` makes them
    (notifying the test's webhook); deleted after."""
    names = asyncio.run(ensure_automations("custom-webhook/yattflow-test-hook"))
    yield names
    for name in names:
        for automation in client_call(lambda c, n=name: c.read_automations_by_name(n)):
            client_call(lambda c, a=automation: c.delete_automation(a.id))


@pytest.mark.slow
def test_a_guard_cancels_a_run_whose_kl_explodes_and_the_run_resumes(prepared, trainer, automations, hook):
    """A huge learning rate makes the KL to the reference explode at once; the run's guard event
    fires the guard automation, which cancels the run and notifies (a webhook block); the run's
    checkpoint is intact and the same run, started again with a sane learning rate, resumes after it
    and completes."""
    name, root = "guardtest", f"storage.root={prepared}"
    common = TINY + [root, f"name={name}", "dp=1", "data.heldout=null", "checkpoint.every=1", "checkpoint.asynchronous=false",
                     "train.algorithm.kl_coef=0.1"]
    run_id = run_deployed(common + ["steps=50", "train.lr=0.03", "guard.max={kl_reference: 1.0}"])
    run = wait_final(run_id, timeout=300)
    assert run.state.is_cancelled() and cancelled_by_automation(run_id), run.state
    tripped = read_events(f"prefect.flow-run.{run_id}", events.GUARD_TRIPPED)
    assert tripped and "kl_reference" in tripped[0].payload["reasons"][0], tripped
    [note] = wait_for("the guard's notification", lambda: [p for p in hook if "guard-tripped" in p["subject"]] or None, 60)[:1]
    assert note["subject"] == "yattflow: yattflow-guard-tripped" and "kl_reference" in note["body"], note
    state = json.loads((Path(prepared) / "runs" / name / "state.json").read_text())
    assert 0 <= state["step"] < 49 and Path(state["checkpoint"].removeprefix("file://"), "MANIFEST.json").exists()

    # no held-out set (data.heldout=null): its checkpoints' events match no evaluation trigger
    assert not client_call(lambda c: c.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(like_="evaluate-guardtest-"))))
    resumed = run_deployed(common + [f"steps={state['step'] + 3}"])
    assert wait_final(resumed).state.is_completed()
    iterations = sorted(r.name for r in client_call(lambda c: children(c, resumed)) if r.name.startswith("iteration-"))
    assert iterations == [f"iteration-{s:04d}" for s in range(state["step"] + 1, state["step"] + 3)]


@pytest.mark.slow
def test_a_run_whose_steps_stop_coming_is_cancelled_and_a_cli_run_stops_as_on_ctrl_c(prepared, tmp_path, monkeypatch):
    """The no-step automation, its window cut to Prefect's least (10 s), on a `yattflow train` run (the
    CLI, in its own process: no worker to stop it) of timing-stub engines whose host hangs in the third
    step's rollout (``rollout@2``: engines/host/faults.py counts steps from 0, as the events do; the host
    timeout, 600 s, is far off): after the second step no other comes, the automation cancels the run,
    and the command stops as on Ctrl-C (exit 130, where it stands), its flow run Cancelled."""
    monkeypatch.setenv("YATTFLOW_FAULTS_FIRED", str(tmp_path))
    monkeypatch.setenv("YATTFLOW_FAULTS", "rollout@2:dp-0:hang")
    [spec] = [a for a in yaml.safe_load(AUTOMATIONS_FILE.read_text())["automations"] if a["name"] == "yattflow-no-step"]
    spec = spec | {"name": "yattflow-no-step-test", "trigger": spec["trigger"] | {"within": 10}}
    (tmp_path / "no-step.yaml").write_text(yaml.safe_dump({"automations": [spec]}))
    prefect("automation", "create", "--from-file", str(tmp_path / "no-step.yaml"))
    try:
        cli = yattflow("train", *TINY, *STUBS, f"storage.root={prepared}", "name=stalltest", "dp=1", "steps=20",
                       "data.heldout=null", timeout=300)
    finally:
        for automation in client_call(lambda c: c.read_automations_by_name("yattflow-no-step-test")):
            client_call(lambda c, a=automation: c.delete_automation(a.id))
    run_id = re.search(r"train-stalltest in the Prefect UI: \S+/runs/flow-run/([0-9a-f-]{36})", cli.stdout).group(1)
    assert cli.returncode == 130 and "cancelled on the Prefect server (Cancelled by Automation" in cli.stdout + cli.stderr, cli
    assert "yattflow train: stopped" in cli.stderr, cli.stderr
    assert wait_final(run_id, timeout=60).state.is_cancelled() and cancelled_by_automation(run_id)
    steps = sorted(e.payload["step"] for e in read_events(f"prefect.flow-run.{run_id}", events.STEP_COMPLETED))
    assert steps == [0, 1], steps
