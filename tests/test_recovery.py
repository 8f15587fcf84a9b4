"""Runs that heal themselves, resume exactly once, and have one writer (issue 17).

Real runs on the session's Prefect server (dp=2, torch engines, a checkpoint every 2 steps,
asynchronous): an uninterrupted run, then the same run under faults injected into its engine
hosts (``engines/host/faults.py``: SIGKILL of a host, SIGKILL during the asynchronous checkpoint
write, a hang; SIGKILL of the run itself). Every step's trained prompt_ids, sample indices and
rewards, and the final parameters, must equal the uninterrupted run's.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from safetensors.torch import load_file

from flows.training import train
from storage import objectstore
from storage.lease import RunInUse
from tests.conftest import TINY

ROOT = Path(__file__).resolve().parents[1]
STEPS = 6
COMMON = TINY + [f"steps={STEPS}", "dp=2", "checkpoint.every=2", "data.heldout=null", "timeouts.stage_s=5",
                 "retries.run=3", "run.lease_s=10"]
TRAIN = "import asyncio, sys\nfrom flows.training import train\nasyncio.run(train(overrides=sys.argv[1:]))\n"


def trained(run_dir: Path) -> dict[int, list[tuple]]:
    """Per step, what the train step learned from: (group, prompt_id, sample_index, reward) of every experience row."""
    out = {}
    for step in sorted((run_dir / "steps").iterdir()):
        rows = []
        for f in sorted(step.glob("experience/group=*/*.parquet")):
            group = int(f.parent.name.split("=")[1])
            rows += [(group, r["prompt_id"], r["sample_index"], r["reward"])
                     for r in pq.read_table(f, columns=["prompt_id", "sample_index", "reward"]).to_pylist()]
        out[int(step.name)] = sorted(rows)
    return out


def final_parameters(run_dir: Path) -> dict:
    return load_file(str(run_dir / "final" / "model.safetensors"))


def assert_same_training(run_dir: Path, reference: Path) -> None:
    got, want = trained(run_dir), trained(reference)
    assert sorted(got) == list(range(STEPS)) == sorted(want)
    for step in want:
        assert got[step] == want[step], f"step {step} trained other samples or rewards than the uninterrupted run"
    a, b = final_parameters(run_dir), final_parameters(reference)
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a), "final parameters differ"


def no_engine_hosts_left() -> None:
    import psutil

    deadline = time.time() + 30
    while hosts := [p for p in psutil.process_iter(["cmdline"]) if "engines.host" in " ".join(p.info["cmdline"] or [])
                    and p.status() != psutil.STATUS_ZOMBIE and p.ppid() == os.getpid()]:
        assert time.time() < deadline, f"engine hosts left running: {hosts}"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def uninterrupted(prepared) -> Path:
    summary = asyncio.run(train(overrides=[*COMMON, f"storage.root={prepared}", "name=recovery-reference"]))
    assert [m["step"] for m in summary["history"]] == list(range(STEPS))
    return Path(prepared) / "runs" / "recovery-reference"


@pytest.fixture
def faults(tmp_path, monkeypatch):
    """Plan faults for the engine hosts this test starts; returns the fired ones' markers."""
    fired = tmp_path / "fired"
    fired.mkdir()
    monkeypatch.setenv("YATTFLOW_FAULTS_FIRED", str(fired))

    def plan(*specs: str) -> Path:
        monkeypatch.setenv("YATTFLOW_FAULTS", ",".join(specs))
        return fired

    return plan


def test_run_heals_from_dead_and_hung_hosts_and_trains_each_step_once(prepared, uninterrupted, faults):
    """One run, three faults, each healed by restarting the hosts and resuming from the last
    committed checkpoint: a host SIGKILLed in step 1's rollout (no checkpoint yet: from the start),
    a host SIGKILLed while it writes step 3's checkpoint in the background (the write is never
    committed: from step 1's), a host that hangs in step 4's train step (the other waits in the
    all-reduce; the heartbeat watchdog sees no progress for timeouts.stage_s=5)."""
    planned = ["rollout@1:dp-1:kill", "checkpoint_write@3:dp-0:kill", "train_step@4:dp-0:hang"]
    fired = faults(*planned)
    summary = asyncio.run(train(overrides=[*COMMON, f"storage.root={prepared}", "name=recovery-healed"]))
    assert sorted(p.name for p in fired.iterdir()) == sorted(planned)  # every fault happened
    assert [m["step"] for m in summary["history"]] == list(range(STEPS))  # a step redone replaced its first try
    assert_same_training(Path(prepared) / "runs" / "recovery-healed", uninterrupted)
    no_engine_hosts_left()


def test_run_that_keeps_failing_stops_after_its_retries(prepared, faults):
    """retries.run=1 and two hosts killed: the first heals, the second ends the run with the host's error."""
    from engines.wire.channel import HostLost

    faults("rollout@0:dp-0:kill", "rollout@1:dp-1:kill")
    with pytest.raises(HostLost, match="dp-1: engine host is gone"):
        asyncio.run(train(overrides=[*COMMON, f"storage.root={prepared}", "name=recovery-gives-up", "retries.run=1",
                                     "steps=3"]))
    no_engine_hosts_left()


def test_bug_in_user_code_is_not_retried(prepared, tmp_path):
    """A reward rule that raises is the user's bug, not a lost host: the run fails at once."""
    rule = tmp_path / "broken_rule.py"
    # (the input check before the engines load scores the reference answer: that one passes)
    rule.write_text("def reward(prompt, response, answer):\n    if response == answer:\n        return 1.0\n"
                    "    raise ZeroDivisionError('my bug')\n")
    started = time.monotonic()
    with pytest.raises(Exception, match="ZeroDivisionError: my bug"):
        asyncio.run(train(overrides=[*COMMON, f"storage.root={prepared}", "name=recovery-bug", "steps=2",
                                     f"reward.rule={rule}:reward", "reward.rule_weight=1"]))
    assert time.monotonic() - started < 120
    no_engine_hosts_left()


def test_killed_run_resumes_exactly_also_from_a_kill_during_the_checkpoint_write(prepared, uninterrupted, faults):
    """The run itself (the process running the train flow) SIGKILLed twice — in step 2's scoring,
    then while step 3's checkpoint is being written in the background — and started again with
    the same command each time: it resumes from the last committed checkpoint (the half-written one
    is discarded) and trains exactly what the uninterrupted run trained. The killed run's lease does
    not block the next one: its holder's process is gone."""
    fired = faults("genrm_score@2:dp-0:kill-run", "checkpoint_write@3:dp-1:kill-run")
    args = [*COMMON, f"storage.root={prepared}", "name=recovery-killed"]
    codes = []
    for _ in range(3):
        run = subprocess.run([sys.executable, "-c", TRAIN, *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                             env=dict(os.environ, PYTHONPATH=str(ROOT)))
        codes.append(run.returncode)
        if run.returncode == 0:
            break
    assert codes == [-signal.SIGKILL, -signal.SIGKILL, 0], run.stderr[-3000:]
    assert len(list(fired.iterdir())) == 2
    run_dir = Path(prepared) / "runs" / "recovery-killed"
    assert "removed" in run.stderr and "never committed" in run.stderr  # step 3's half-written checkpoint
    assert_same_training(run_dir, uninterrupted)


def test_two_runs_of_one_name_one_writer(prepared):
    """A second run of a name that a live run trains refuses at once, naming it; with
    run.on_conflict=wait it starts when the first ends (and finds the run finished)."""
    args = [*COMMON, f"storage.root={prepared}", "name=recovery-twice"]
    first = subprocess.Popen([sys.executable, "-c", TRAIN, *args], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    lease = Path(prepared) / "runs" / "recovery-twice" / "lease.json"
    try:
        deadline = time.time() + 120
        while not (lease.exists() and not objectstore.read_json(objectstore.normalize(str(lease)))["released"]):
            assert first.poll() is None and time.time() < deadline, "the first run never took its lease"
            time.sleep(0.2)
        holder = objectstore.read_json(objectstore.normalize(str(lease)))["holder"]
        started = time.monotonic()
        with pytest.raises(RunInUse) as refused:
            asyncio.run(train(overrides=args))
        assert time.monotonic() - started < 30
        assert f"flow run {holder['flow_run_id']}" in str(refused.value) and f"pid {first.pid}" in str(refused.value)
        assert first.poll() is None  # the refusal did not disturb the live run

        summary = asyncio.run(train(overrides=[*args, "run.on_conflict=wait"]))
        assert first.poll() == 0, first.stderr.read()[-3000:]  # it waited for the first run to end
        assert summary["history"] == []  # ... which trained every step
    finally:
        if first.poll() is None:
            first.kill()
        first.wait()
