"""The Prefect UI as a person watching a run sees it: a real browser (Debian's Chromium driven
by Playwright) on the session's real ``prefect server``.

It opens the run's pages, reads the text a person reads — the DP-group sub-flows, every stage
task with its state, the curves and progress artifacts, a failed task's inputs — and saves
screenshots (paths printed; also copied under ``$YATTFLOW_TEST_ARTIFACTS`` when set).
"""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter, ArtifactFilterKey, FlowRunFilter, FlowRunFilterParentFlowRunId, LogFilter, LogFilterTaskRunId,
)
from prefect.client.schemas.sorting import LogSort

from tests.test_flows import run_train

CHROMIUM = "/usr/bin/chromium"

needs_browser = pytest.mark.skipif(
    not Path(CHROMIUM).exists(), reason=f"needs Debian's chromium at {CHROMIUM} (apt-get install chromium)"
)


# ----------------------------------------------------------------------------- helpers


async def _flow_run(client, name: str, parent=None):
    """The newest flow run called ``name`` (under ``parent`` if given)."""
    flt = FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[parent])) if parent else None
    runs = [r for r in await client.read_flow_runs(flow_run_filter=flt) if r.name == name]
    assert runs, f"no flow run named {name}"
    return max(runs, key=lambda r: r.created)


async def _run_ids(run: str) -> dict[str, str]:
    """Flow-run ids of ``train-<run>``, its ``iteration-0000`` and that step's ``dp-0`` sub-flow."""
    async with get_client() as client:
        top = await _flow_run(client, f"train-{run}")
        it = await _flow_run(client, "iteration-0000", top.id)
        dp0 = await _flow_run(client, "iteration-0000-dp-0", it.id)
        return {"train": str(top.id), "iteration": str(it.id), "dp0": str(dp0.id)}


async def _artifacts(key: str) -> list:
    async with get_client() as client:
        return await client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))


def _keep(path: Path) -> Path:
    """Print where a screenshot is; copy it under ``$YATTFLOW_TEST_ARTIFACTS`` if that is set."""
    print(f"screenshot: {path}")
    if os.environ.get("YATTFLOW_TEST_ARTIFACTS"):
        dest = Path(os.environ["YATTFLOW_TEST_ARTIFACTS"]) / "ui" / path.name
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, dest)
        print(f"screenshot copy: {dest}")
    return path


class Browser:
    """One headless Chromium page on the Prefect UI."""

    def __init__(self, base_url: str, out: Path):
        from playwright.sync_api import sync_playwright

        self.base, self.out = base_url, out
        self._pw = sync_playwright().start()
        self._browser = self._pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        self.page = self._browser.new_page(viewport={"width": 1600, "height": 1100})

    def open(self, path: str, *expected: str, shot: str | None = None, timeout_s: float = 60) -> str:
        """Go to ``path``, wait until every ``expected`` text shows, screenshot, and return the page text."""
        self.page.goto(self.base + path)
        for text in expected:
            self.page.get_by_text(text, exact=False).first.wait_for(timeout=timeout_s * 1000)
        self.page.wait_for_load_state("networkidle")
        if shot:
            self.page.screenshot(path=str(self.out / shot), full_page=True)
            _keep(self.out / shot)
        return self.page.inner_text("body")

    def close(self) -> None:
        self._browser.close()
        self._pw.stop()


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

    # The run: its iteration sub-flows, Completed.
    text = browser.open(f"/runs/flow-run/{ids['train']}?tab=Subflow%20Runs", "iteration-0000", "iteration-0001",
                        shot="1-train-subflows.png")
    assert "train-uitest" in text and "iteration-0000" in text and "iteration-0001" in text
    assert "Completed" in text

    # One iteration: its DP-group sub-flows (the controllers), Completed.
    text = browser.open(f"/runs/flow-run/{ids['iteration']}?tab=Subflow%20Runs", "iteration-0000-dp-0",
                        "iteration-0000-dp-1", shot="2-iteration-dp-groups.png")
    assert "iteration-0000-dp-0" in text and "iteration-0000-dp-1" in text and "Completed" in text

    # One DP group: every stage task by name, each Completed.
    stages = ["rollout dp=0 wave=0", "genrm_score dp=0 wave=0", "dynamic_filter dp=0 wave=0", "train_step dp=0",
              "sync_weights dp=0"]
    text = browser.open(f"/runs/flow-run/{ids['dp0']}?tab=Task%20Runs", *stages, shot="3-dp-group-tasks.png")
    for name in stages:
        assert name in text, name
    assert text.count("Completed") >= len(stages)
    assert "Failed" not in text

    # The DP group's live progress artifact (100% once the step is done).
    text = browser.open(f"/runs/flow-run/{ids['dp0']}?tab=Artifacts", "uitest-dp-0-progress", shot="4-dp-group-artifacts.png")
    assert "uitest-dp-0-progress" in text

    # The run's artifacts: curves, summary, progress, per-iteration table.
    text = browser.open(f"/runs/flow-run/{ids['train']}?tab=Artifacts", "uitest-curves", shot="5-train-artifacts.png")
    for key in ("uitest-curves", "uitest-summary", "uitest-progress"):
        assert key in text, key

    # The curves page: the chart of reward and accuracy per step.
    text = browser.open("/artifacts/key/uitest-curves", "reward and accuracy, 2 of 2 steps", shot="6-curves.png")
    assert "rollout accuracy" in text and "Held-out exact match" in text
    assert any(c in text for c in "▁▂▃▄▅▆▇█"), "no sparkline on the curves page"

    # The same through the API: one curves version per step plus the final one; progress at 100%.
    assert len(asyncio.run(_artifacts("uitest-curves"))) == 3
    progress = max(asyncio.run(_artifacts("uitest-progress")), key=lambda a: a.created)
    assert progress.data == 100, progress


def test_failed_task_keeps_its_inputs(prepared, tmp_path):
    """Storage that stops taking writes mid-run: the rollout task fails, and its failed state
    and its log name the command and its inputs (step, wave, cursor, output URI)."""
    run_dir = Path(prepared) / "runs" / "uifail"
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "steps").write_text("a file where the run's step folders go")  # every stage write now fails
    try:
        with pytest.raises(Exception) as err:
            run_train(prepared, "name=uifail", "steps=1", "dp=1")
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    out_uri = "/runs/uifail/steps/000000/rollouts/group=0/part-000.parquet"
    for needed in ("'rollout' on run 'uifail' dp-0 with step=0, wave=0, cursor=0, count=4", out_uri):
        assert needed in str(err.value), str(err.value)

    async def failed_task():
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
                if any("failed" in log.message for log in logs):
                    break
                await asyncio.sleep(0.5)
            return top, failed, logs

    top, failed, logs = asyncio.run(failed_task())
    assert top.state.is_failed()
    assert [t.name for t in failed] == ["rollout dp=0 wave=0"]
    message = failed[0].state.message
    assert "'rollout' on run 'uifail' dp-0 with step=0, wave=0, cursor=0, count=4" in message and out_uri in message, message
    errors = [log.message for log in logs if log.level >= 40]
    assert any("cursor=0" in m and out_uri in m and "steps" in m for m in errors), [log.message for log in logs]
    test_failed_task_keeps_its_inputs.task_run_id = str(failed[0].id)  # for the browser test below


@needs_browser
def test_ui_shows_a_failed_tasks_inputs(browser):
    """The failed rollout's page in the UI shows its inputs in its log."""
    task_run_id = getattr(test_failed_task_keeps_its_inputs, "task_run_id", None)
    if task_run_id is None:
        pytest.skip("needs test_failed_task_keeps_its_inputs to have run first")
    text = browser.open(f"/runs/task-run/{task_run_id}", "rollout dp=0 wave=0", "cursor=0", shot="7-failed-task.png")
    assert "Failed" in text and "'rollout' on run 'uifail' dp-0 with step=0, wave=0, cursor=0" in text
