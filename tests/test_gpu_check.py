"""The GPU check's CPU rehearsal (``python -m bench.gpu_check --device cpu``): the one command a
GPU lease runs (docs/engines.md#the-gpu-check) goes through every part here, at tiny sizes, so
that its script, its imports and its report cannot rot between leases; and a part that overruns
its limit is killed with everything it started, the report still written."""

from __future__ import annotations

import json
import os
import time

import psutil
import pytest

from bench import gpu_check


def test_the_cpu_rehearsal_runs_every_part_and_reports(prepared, tmp_path):
    """On the session's prepared tiny demo (its SFT is tested where it is made): the rehearsal's demo
    trains two steps on the Megatron trainer."""
    pytest.importorskip("megatron.core", reason="Megatron-Core is optional (make engines installs it)")
    assert gpu_check.main(["--device", "cpu", "--out", str(tmp_path), "--budget", "600", "--prepared", prepared]) == 0
    report = json.loads((tmp_path / "gpu-report.json").read_text())
    parts = report["parts"]
    assert list(parts) == list(gpu_check.PARTS) and all(p["status"] == "passed" for p in parts.values()), parts
    assert parts["env"]["figures"]["modules"] > 50  # every project module imported
    gpu_tests = parts["tests"]["figures"]["counts"]
    assert gpu_tests.get("skipped", 0) >= 6 and not gpu_tests.get("passed")  # collected, and skipped without CUDA
    demo = parts["demo"]["figures"]
    assert "lift" in demo and len(demo["step_rewards"]) == 2  # the run ended with its held-out figures
    sync = parts["sync"]["figures"]
    assert sync["fingerprint_rollout"] == sync["fingerprint_trainer"] and sync["logprob_gap"] < 1e-4  # fp32 here
    runs = parts["speed"]["figures"]["runs"]
    assert [(r["size"], r["engine"]) for r in runs] == [(s, e) for s in ("0.44b", "1.2b") for e in ("megatron", "transformers")]
    assert all(r["sync_matches"] for r in runs if r["engine"] == "megatron")
    text = (tmp_path / "gpu-report.md").read_text()
    assert "| demo | passed |" in text and "## Train step" in text


@pytest.mark.integration
def test_a_part_past_its_limit_is_killed_with_what_it_started(tmp_path, monkeypatch):
    """The demo starts a Prefect server and an engine host: at the part's limit all of them go,
    the part reads "timed out", and the report is written."""
    monkeypatch.setitem(gpu_check.LIMITS, "demo", 8)
    mark = f"{os.getpid()}-{time.time()}"  # in the environment of all the part starts: another test's processes are not its
    monkeypatch.setenv(MARK, mark)
    start = time.time()
    assert gpu_check.main(["--device", "cpu", "--out", str(tmp_path), "--parts", "demo"]) == 1
    assert time.time() - start < 30
    parts = json.loads((tmp_path / "gpu-report.json").read_text())["parts"]
    assert parts["demo"]["status"] == "timed out"
    assert "flows.cli demo" in (tmp_path / "gpu-check.log").read_text()  # it had started
    # the server and the engine host are in sessions of their own: each goes as its parent does (a host still
    # importing torch when the part was killed too: engines/host/lifeline.py), within a few seconds, not never
    deadline, leaked = time.time() + 10, ["?"]
    while leaked and time.time() < deadline:
        time.sleep(0.5)
        leaked = [c for c in _started_with(mark) if any("flows.cli" in a or "prefect" in a or "engines.host" in a for a in c)]
    assert not leaked, leaked
    assert "| demo | timed out |" in (tmp_path / "gpu-report.md").read_text()


MARK = "YATTFLOW_TEST_GPU_CHECK"


def _started_with(mark: str) -> list[list[str]]:
    """The command lines of the live processes whose environment carries ``mark``, this process's aside."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if (p.info["pid"] != os.getpid() and p.info["status"] != psutil.STATUS_ZOMBIE and p.info["cmdline"]
                    and p.environ().get(MARK) == mark):
                found.append(p.info["cmdline"])
        except psutil.Error:
            pass
    return found


def test_the_gpu_wheel_list_covers_the_projects_runtime_requirements():
    """Each package the project needs at run time is on the GPU machine's image or in the list
    bench/gpu_wheels.sh resolves (with its dependencies) into wheels, or left out on purpose."""
    import re
    import tomllib

    from bench.gpu_check import ROOT

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    needed = {re.split(r"[\[<>=!~ ]", r)[0].lower().replace("_", "-") for r in
              project["dependencies"] + project["optional-dependencies"]["megatron"]}
    image = {line.strip().lower() for line in (ROOT / "bench" / "gpu_image_packages.txt").read_text().splitlines()
             if line.strip() and not line.startswith("#")}
    carried = set(re.search(r"^for n in (.+); do", (ROOT / "bench" / "gpu_wheels.sh").read_text(), re.M).group(1).split())
    left_out = {"s3fs": "the check's storage is a local folder", "prefect-redis": "yattflow stack only",
                "torch": "the image's own CUDA build",
                "av": "videos only, which the check does not run; its wheel carries FFmpeg (36 MB of the 56 MiB)"}
    missing = needed - image - carried - set(left_out)
    assert not missing, f"add to bench/gpu_wheels.sh's list (or say why not): {sorted(missing)}"
