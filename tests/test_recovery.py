"""Runs that heal themselves, resume exactly once, and have one writer (issue 17).

Real runs on the session's Prefect server (dp=2, torch engines, a checkpoint every 2 steps,
asynchronous): an uninterrupted run, then the same run under faults injected into its engine
hosts (``engines/host/faults.py``: SIGKILL of a host, SIGKILL during the asynchronous checkpoint
write, a hang; SIGKILL of the run itself), and the same run on a real S3 server that stops answering
for 30 s. Every step's trained prompt_ids, sample indices and rewards, and the final parameters, must
equal the uninterrupted run's.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from flows.training import train
from storage import objectstore
from storage.lease import RunInUse
from storage.runstate import RunState
from tests.helpers import TINY, no_engine_hosts_left, same_training

ROOT = Path(__file__).resolve().parents[1]
STEPS = 6
COMMON = TINY + [f"steps={STEPS}", "dp=2", "checkpoint.every=2", "data.heldout=null", "timeouts.stage_s=5",
                 "retries.run=3", "run.lease_s=10"]
TRAIN = "import asyncio, sys\nfrom flows.training import train\nasyncio.run(train(overrides=sys.argv[1:]))\n"


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
    same_training(Path(prepared) / "runs" / "recovery-healed", uninterrupted)
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
    """A reward rule that raises is the user's bug, not a lost host: the run fails at once, and its
    last line (what the CLI shows) names the rule, the prompt_id and the response it raised on."""
    from flows.stops import failure_cause

    rule = tmp_path / "broken_rule.py"
    # (the input check before the engines load scores the reference answer: that one passes)
    rule.write_text("def reward(prompt, response, answer):\n    if response == answer:\n        return 1.0\n"
                    "    raise ZeroDivisionError('my bug')\n")
    started = time.monotonic()
    with pytest.raises(Exception, match="ZeroDivisionError: my bug") as failed:
        asyncio.run(train(overrides=[*COMMON, f"storage.root={prepared}", "name=recovery-bug", "steps=2",
                                     f"reward.rule={rule}:reward", "reward.rule_weight=1"]))
    assert time.monotonic() - started < 120
    assert re.fullmatch(rf"reward.rule {re.escape(str(rule))}:reward raised "
                        r"ZeroDivisionError: my bug on prompt_id \d+, response '.*', answer '\d+'", failure_cause(failed.value))
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
    same_training(run_dir, uninterrupted)


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


# ---------------------------------------------------------------- damage (issues 28 and 65)


def damaged_copy(prepared: str, reference: Path, name: str) -> Path:
    """A copy of the finished reference run under another name (its lease released), its state and
    manifests pointing into the copy."""
    run_dir = Path(prepared) / "runs" / name
    shutil.copytree(reference, run_dir)
    for committed in [run_dir / "state.json", *run_dir.glob("checkpoints/*/MANIFEST.json")]:
        committed.write_text(committed.read_text().replace(str(reference), str(run_dir)))
    return run_dir


def test_a_lost_state_json_and_flipped_bytes_in_the_newest_checkpoint_resume_exactly_from_the_intact_one(
        prepared, uninterrupted):
    """The probes of issue 65 in one real run: state.json deleted (it used to read as "nothing
    committed": every checkpoint deleted, training from step 1) and 64 bytes flipped inside step 5's
    trainer.pt (same size: it used to resume silently with a weight off by 449.5). ``yattflow train``
    rebuilds state.json from step 5's manifest, its hosts find trainer.pt's content is not what the
    manifest recorded before any engine loads, the checkpoint is set aside (kept, not deleted), and
    the run resumes from step 3's and trains steps 4 and 5 as the uninterrupted run did."""
    from flows.cli import main

    run_dir = damaged_copy(prepared, uninterrupted, "recovery-lost-state")
    (run_dir / "state.json").unlink()
    trainer = run_dir / "checkpoints" / "000005" / "trainer-torch" / "trainer.pt"
    data = bytearray(trainer.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = bytes(b ^ 0xFF for b in data[middle:middle + 64])
    trainer.write_bytes(bytes(data))
    assert main(["train", *COMMON, f"storage.root={prepared}", "name=recovery-lost-state"]) == 0
    err = (Path(prepared) / "logs" / "recovery-lost-state-train.log").read_text()  # (the console shows their first lines)
    checkpoint = f"file://{run_dir}/checkpoints/000005"
    assert f"state.json is missing: rebuilt from {checkpoint}/MANIFEST.json, the newest intact checkpoint (after step 6)" in err
    assert (f"{checkpoint}, the checkpoint state.json resumed from (after step 6), has 1 file(s) whose content is not "
            "what its MANIFEST.json recorded: trainer-torch/trainer.pt (SHA-256") in err
    [aside] = (run_dir / "checkpoints").glob("000005.damaged-*")
    assert (aside / "trainer-torch" / "trainer.pt").read_bytes() == bytes(data)  # kept as it was found
    assert RunState.load(f"file://{run_dir}").step == 5  # step 5's checkpoint committed anew
    same_training(run_dir, uninterrupted)


def test_a_checkpoint_that_lost_its_manifest_is_kept_and_the_run_resumes_exactly_from_the_one_before(prepared,
                                                                                                      uninterrupted):
    """The committed checkpoint state.json points at (step 5's) loses its MANIFEST.json: the resume
    neither deletes it nor fails on it, but sets it aside, says so, resumes from step 3's and trains
    steps 4 and 5 again, exactly as the uninterrupted run did."""
    run_dir = damaged_copy(prepared, uninterrupted, "recovery-no-manifest")
    (run_dir / "checkpoints" / "000005" / "MANIFEST.json").unlink()
    summary = asyncio.run(train(overrides=[*COMMON, f"storage.root={prepared}", "name=recovery-no-manifest"]))
    assert [m["step"] for m in summary["history"]] == [4, 5]
    [aside] = (run_dir / "checkpoints").glob("000005.damaged-*")
    assert (aside / "trainer-torch" / "trainer.pt").read_bytes() == (
        uninterrupted / "checkpoints" / "000005" / "trainer-torch" / "trainer.pt").read_bytes()
    assert RunState.load(f"file://{run_dir}").step == 5  # step 5's checkpoint committed anew
    same_training(run_dir, uninterrupted)


class Intruder:
    """Every port the run's engine hosts listen on (their channel, rank 0's rendezvous, gloo's), as soon as
    it opens: a connection that sends garbage, one that reads the host's challenge and never answers, and
    one that says nothing, each left open until the run ends (what any local user could do)."""

    def __init__(self):
        import threading

        self.hit: set[tuple[int, int]] = set()
        self.sockets: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> "Intruder":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)
        for s in self.sockets:
            s.close()

    def _watch(self) -> None:
        import socket

        while not self._stop.wait(0.05):
            for proc in psutil.Process().children(recursive=True):
                try:
                    if "engines.host" not in " ".join(proc.cmdline()):
                        continue
                    ports = [c.laddr.port for c in proc.net_connections("tcp") if c.status == psutil.CONN_LISTEN]
                except psutil.Error:
                    continue
                for port in ports:
                    if (proc.pid, port) in self.hit:
                        continue
                    self.hit.add((proc.pid, port))
                    for kind in ("garbage", "half", "silent"):
                        try:
                            s = socket.create_connection(("127.0.0.1", port), timeout=2)
                            if kind == "garbage":
                                s.sendall(b"\xff\x00\x00\x10garbage" * 64)
                            elif kind == "half":
                                s.recv(64)
                            self.sockets.append(s)
                        except OSError:
                            pass


@pytest.mark.parametrize("staleness", [0, 1])
def test_bad_connections_to_every_host_port_change_nothing(prepared, uninterrupted, staleness):
    """One bad connection used to jam an engine host (its accept loop ended on a failed handshake): now
    garbage, a half handshake and a silent connection on every port the hosts open cost only themselves.
    Synchronous, the run trains exactly what the undisturbed one did; overlapping (its rollout lane is a
    second connection to each host), it trains every step."""
    name = f"recovery-intruded-{staleness}"
    with Intruder() as intruder:
        summary = asyncio.run(train(overrides=[*COMMON, f"storage.root={prepared}", f"name={name}",
                                               f"rollout.max_staleness={staleness}"]))
    assert len({pid for pid, _ in intruder.hit}) >= 2 and len(intruder.hit) >= 3, intruder.hit  # both hosts, several ports
    assert [m["step"] for m in summary["history"]] == list(range(STEPS))
    if staleness == 0:
        same_training(Path(prepared) / "runs" / name, uninterrupted)
    no_engine_hosts_left()


# ---------------------------------------------------------------- storage that stops answering (issue 43)


@pytest.mark.s3
@pytest.mark.slow
def test_a_run_on_s3_rides_out_a_30s_outage_and_trains_what_the_undisturbed_run_did(prepared, uninterrupted, s3_server,
                                                                                     s3_root, tmp_path):
    """``yattflow train`` with ``storage.root=s3://…`` (the demo's data and models copied up from the prepared
    folder) on a real S3 server that is stopped for 30 s once step 2's line is out, then started again: the
    run waits the outage out with the default settings (object-store calls retry for YATTFLOW_STORAGE_RETRY_S,
    180 s; the watchdog's timeouts.stage_s, 300 s; the lease's run.lease_s, 60 s; no heal: retries.run=0),
    exits 0, and trained exactly what the undisturbed run on the local folder did. Its console says so in a
    line or two naming the s3:// URI that did not answer: no traceback, no HTTP endpoint (the engine hosts'
    waits are in the log file). Before the retries, the console of this outage was 2,617 lines with 83
    tracebacks, its last line naming the endpoint."""
    import s3fs

    fs = s3fs.S3FileSystem()
    bucket_path = s3_root.removeprefix("s3://")
    for folder in ("data", "models"):  # the very bytes the reference trained from
        fs.put(str(Path(prepared) / folder), f"{bucket_path}/{folder}", recursive=True)
    name = "recovery-s3-outage"
    args = [*COMMON, f"storage.root={s3_root}", f"name={name}", "timeouts.stage_s=300", "run.lease_s=60", "retries.run=0"]
    home = tmp_path / "prefect-home"  # an s3:// run's log file: $PREFECT_HOME/yattflow-logs/<name>-train.log
    env = dict(os.environ, PREFECT_HOME=str(home), YATTFLOW_CACHE=str(tmp_path / "cache"))
    env.pop("YATTFLOW_STORAGE_RETRY_S", None)
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "train", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 240
        while not any(f"step 2/{STEPS}" in line for line in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)[-3000:]
            time.sleep(0.05)
        before = len(lines)
        s3_server.stop()
        try:
            time.sleep(30)
        finally:
            s3_server.start()
        code = proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(timeout=10)
    out, after = "".join(lines), lines[before:]
    print(f"\n[s3 outage] console: {len(lines)} lines, {len(after)} from the outage on:\n{''.join(after)}")
    assert code == 0, out[-3000:]
    assert "Traceback" not in out and "ERROR" not in out, out
    assert s3_server.endpoint not in out and f"127.0.0.1:{s3_server.port}" not in out, out
    # a warning per call of the run's own process that met the outage (the lease's renewal, every 20 s, is one)
    outage = [line for line in lines if "does not answer" in line]
    assert 1 <= len(outage) <= 4 and all(f"{s3_root}/runs/{name}/" in line for line in outage), out
    assert len(after) <= (STEPS - 2) + len(outage) + 5, out  # the later steps' lines, the outage's, the end's
    assert "does not answer" in (home / "yattflow-logs" / f"{name}-train.log").read_text()

    run_dir = tmp_path / "run"
    fs.get(f"{bucket_path}/runs/{name}", str(run_dir), recursive=True)
    same_training(run_dir, uninterrupted)
