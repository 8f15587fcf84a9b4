"""The Prefect UI as a person watching a run sees it: a real browser (Debian's Chromium driven
by Playwright) on the session's real ``prefect server``.

It opens the run's pages, reads the text a person reads — the DP-group sub-flows, every stage
task with its state, the curves and progress artifacts, a failed task's inputs — and saves
screenshots (paths printed; also copied under ``$YATTFLOW_TEST_ARTIFACTS`` when set).
"""

from __future__ import annotations

import asyncio
import re
import shutil
from pathlib import Path

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey, FlowRunFilter, FlowRunFilterName,
    FlowRunFilterParentFlowRunId, LogFilter, LogFilterTaskRunId,
)
from prefect.client.schemas.sorting import LogSort

from tests.browser import Browser, needs_browser
from tests.helpers import run_train




# ----------------------------------------------------------------------------- helpers


async def _flow_run(client, name: str, parent=None):
    """The newest flow run called ``name`` (under ``parent`` if given)."""
    flt = FlowRunFilter(name=FlowRunFilterName(any_=[name]),  # by the server: one page holds 200 runs at most
                        parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[parent]) if parent else None)
    runs = await client.read_flow_runs(flow_run_filter=flt)
    assert runs, f"no flow run named {name}"
    return max(runs, key=lambda r: r.created)


async def _run_ids(run: str) -> dict[str, str]:
    """Flow-run ids of ``train-<run>``, its ``iteration-0000`` and that step's ``dp-0`` sub-flow."""
    async with get_client() as client:
        top = await _flow_run(client, f"train-{run}")
        it = await _flow_run(client, "iteration-0000", top.id)
        dp0 = await _flow_run(client, "iteration-0000-dp-0", it.id)
        return {"train": str(top.id), "iteration": str(it.id), "dp0": str(dp0.id)}


async def _artifacts(key: str, flow_run_id: str) -> list:
    async with get_client() as client:
        return await client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=[key]), flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))






@pytest.fixture
def browser(prefect_server, tmp_path):
    pytest.importorskip("playwright", reason="needs the Python package playwright")
    b = Browser(prefect_server.removesuffix("/api"), tmp_path)
    yield b
    b.close()


# ------------------------------------------------------------------------------- tests


@needs_browser
def test_ui_shows_every_step_and_the_curves(prepared, browser):
    """A 2-step DP=2 run: the run page lists its iterations, an iteration its DP-group sub-flows,
    a DP group its stage tasks, all Completed; the curves and progress artifacts show."""
    run_train(prepared, "name=uitest", "steps=2", "dp=2")
    ids = asyncio.run(_run_ids("uitest"))
    # Through the API first (the browser's event loop rules out asyncio.run later): one curves
    # artifact for the run, redrawn in place after every step rather than a version per step.
    (curves,) = asyncio.run(_artifacts("uitest-curves", ids["train"]))
    assert "2 of 2 steps" in curves.data
    (progress,) = asyncio.run(_artifacts("uitest-progress", ids["train"]))
    assert progress.data == 100

    # The run: its iteration sub-flows, Completed.
    browser.open(f"/runs/flow-run/{ids['train']}", "Subflow Runs").wait_for("iteration-0000", "iteration-0001")
    browser.shot("1-train-subflows.png")
    text = browser.text()
    assert "train-uitest" in text and "2 Flow runs" in text and text.count("Completed") >= 3, text

    # One iteration: its DP-group sub-flows (the controllers), Completed.
    browser.open(f"/runs/flow-run/{ids['iteration']}", "Subflow Runs").wait_for("iteration-0000-dp-0", "iteration-0000-dp-1")
    browser.shot("2-iteration-dp-groups.png")
    text = browser.text()
    assert "2 Flow runs" in text and text.count("Completed") >= 3, text

    # One DP group: every stage task by name, each Completed.
    stages = ["rollout dp=0 wave=0", "genrm_score dp=0 wave=0", "dynamic_filter dp=0 wave=0", "train_step dp=0",
              "sync_weights dp=0"]  # no checkpoint at step 0 of 2
    browser.open(f"/runs/flow-run/{ids['dp0']}", "Task Runs").wait_for(*stages)
    browser.shot("3-dp-group-tasks.png")
    text = browser.text()
    n = text.count(" dp=0")
    assert n >= len(stages) and f"{n} Task runs" in text and f"({n} Completed)" in text, text

    # The DP group's live progress artifact: all stages done.
    browser.open(f"/runs/flow-run/{ids['dp0']}", "Artifacts").click("uitest-dp-0-progress").wait_for("Progress: 100%")
    browser.shot("4-dp-group-progress.png")
    # 5 stages for one wave, 3 more for each refill wave: the last one done is the last of all
    assert re.search(r"dp-0 step 0: sync_weights done \((\d+)/\1 stages\)", browser.text()), browser.text()

    # The run's artifacts: curves, progress and summary cards ...
    browser.open(f"/runs/flow-run/{ids['train']}", "Artifacts").wait_for("uitest-curves", "uitest-progress", "uitest-summary")
    browser.shot("5-train-artifacts.png")
    assert "uitest: 2 of 2 steps done" in browser.text()
    # ... and the curves themselves: a table of sparklines, a bar per step.
    browser.click("uitest-curves").wait_for("reward and accuracy, 2 of 2 steps", "Rollout accuracy per step")
    browser.shot("6-curves.png")
    text = browser.text()
    assert "Held-out mean engines.demo.arithmetic:exact_match reward" in text and "reward (mean)" in text
    assert any(c in text for c in "▁▂▃▄▅▆▇") and "█" in text, "no chart on the curves page"
    # ... and above them the picture: the browser loaded and drew it (an image 640 pixels wide)
    drawn = browser.page.evaluate("() => [...document.querySelectorAll('img[alt=\"uitest: learning curve\"]')]"
                                  ".map(i => [i.complete, i.naturalWidth, i.src.slice(0, 26)])")
    assert drawn == [[True, 640, "data:image/svg+xml;base64,"]], drawn


FAILED_INPUTS = "'rollout' on run 'uifail' dp-0 with step=0, wave=0, cursor=0, count=4"
FAILED_OUT = "/runs/uifail/steps/000000/rollouts/group=0/part-000.parquet"


@pytest.fixture(scope="module")
def failed_rollout(prepared) -> dict:
    """A real run whose storage stops taking writes after setup (a file stands where the step
    folders go): its first rollout fails. Returns the exception text, the failed task runs and
    the failed task's logs as the API has them."""
    run_dir = Path(prepared) / "runs" / "uifail"
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "steps").write_text("a file where the run's step folders go")
    try:
        with pytest.raises(Exception) as err:
            run_train(prepared, "name=uifail", "steps=1", "dp=1")
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)

    async def read_back():
        async with get_client() as client:
            top = await _flow_run(client, "train-uifail")
            it = await _flow_run(client, "iteration-0000", top.id)
            dp0 = await _flow_run(client, "iteration-0000-dp-0", it.id)
            task_runs = await client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [dp0.id]}))
            failed = [t for t in task_runs if t.state.is_failed()]
            logs = []
            for _ in range(40):  # logs reach the API in batches
                logs = await client.read_logs(
                    log_filter=LogFilter(task_run_id=LogFilterTaskRunId(any_=[failed[0].id])), sort=LogSort.TIMESTAMP_ASC)
                if any(log.level >= 40 for log in logs):
                    break
                await asyncio.sleep(0.5)
            return {"error": str(err.value), "run_failed": top.state.is_failed(), "failed": failed, "logs": logs}

    return asyncio.run(read_back())


def test_failed_task_keeps_its_inputs(failed_rollout):
    """The failed rollout's exception, its state message (what the UI shows) and its log name
    the command and its inputs — step, wave, cursor, output URI — and the host's error."""
    assert FAILED_INPUTS in failed_rollout["error"] and FAILED_OUT in failed_rollout["error"], failed_rollout["error"]
    assert failed_rollout["run_failed"]
    assert [t.name for t in failed_rollout["failed"]] == ["rollout dp=0 wave=0"]
    message = failed_rollout["failed"][0].state.message
    # the host's error in one line (its traceback is in the task's log)
    assert FAILED_INPUTS in message and FAILED_OUT in message and "[Errno 20] Not a directory" in message, message
    errors = [log.message for log in failed_rollout["logs"] if log.level >= 40]
    assert any(FAILED_INPUTS in m and FAILED_OUT in m and "NotADirectoryError" in m for m in errors), errors


@needs_browser
def test_ui_shows_a_failed_tasks_inputs(failed_rollout, browser):
    """The failed rollout's page in the UI: Failed, and its inputs in its log."""
    task_run_id = failed_rollout["failed"][0].id
    browser.open(f"/runs/task-run/{task_run_id}").wait_for("rollout dp=0 wave=0", "engine host command failed")
    browser.shot("7-failed-task.png")
    text = browser.text()
    assert "Failed" in text and FAILED_INPUTS in text and FAILED_OUT in text, text


# ------------------------------------------------------------------- what the artifacts say


def test_curves_markdown_stays_small_on_long_runs():
    """500 steps: sparklines stay 60 characters wide, bars show the latest 40 steps, the picture 200
    points a line; a negative reward (overlong penalty) widens the scale instead of breaking the bars."""
    from flows.curves import bar, curves_markdown, curves_svg, sparkline, svg_image

    points = [{"step": i, "reward": -0.5 + i / 500, "accuracy": i / 500, "kept_groups": 4, "loss": 0.1, "seconds": 2.0}
              for i in range(500)]
    md = curves_markdown("long", points, 1000, 0.3, heldout_metric="mean rule reward")
    assert "500 of 1000 steps" in md and "**30.0%** before RL" in md
    sparks = [line.split("`")[1] for line in md.splitlines() if line.startswith("| reward (mean)")]
    assert len(sparks[0]) == 60 and sparks[0][0] == "▁" and sparks[0][-1] == "█"
    assert "the latest 40 steps, bars from -0.500 to 1.000" in md
    assert md.count("\n   499  ") == 2 and "\n   459  " not in md
    assert bar(0.5, 0.0, 1.0, width=4) == "██" and bar(None, 0.0, 1.0) == "" and sparkline([]) == ""
    # the picture: a line per figure thinned to 200 points, the scale widened to the negative reward
    svg = curves_svg("long", points, 1000, 0.3)
    lines = re.findall(r'<polyline points="([^"]+)"', svg)
    assert [len(line.split()) for line in lines] == [200, 200] and ">-0.5</text>" in svg and len(svg) < 12_000
    assert svg_image(svg, "long: learning curve") in md and len(md) < 30_000


def test_describe_call_names_inputs_not_data():
    from engines.wire.commands import DynamicFilter, SetupEngines
    from engines.config import RunConfig
    from tasks._host import describe_call

    config = RunConfig(name="demo", dp=2, storage={"root": "s3://b/p"}, model={"policy": "models/p", "judge": "models/j"})
    text = describe_call("demo", 1, SetupEngines(config=config))
    assert text == ("'setup_engines' on run 'demo' dp-1 with config={name: 'demo', dp: 2, storage.root: 's3://b/p', "
                    "data.prompts: 'data/train', model.policy: 'models/p', model.judge: 'models/j'}, resume=None, master=None")
    request = DynamicFilter(step=0, scored=["s3://x/" + "y" * 100] * 20, out="s3://x/e", target_groups=4)
    assert "chars)" in describe_call("demo", 0, request)
