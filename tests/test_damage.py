"""Damage a run must survive, and the line it ends with (issues 28 and 65): a state.json missing or
unreadable, a committed checkpoint that lost its manifest, a file truncated, flipped or replaced by a
link, a torch file yattflow did not write, a full disk, a reward rule that raises on some responses,
two first commands on one PREFECT_HOME. The stops (SIGTERM at several points of a real run) and the
resumes end to end are in tests/test_recovery.py."""

from __future__ import annotations

import errno
import hashlib
import os
import re
import subprocess
import textwrap
import threading
from pathlib import Path

import pytest


from engines.host.checkpointing import CheckpointDamaged, Checkpoints
from engines.host.rewards import RewardRuleError, load_rule
from storage import objectstore, runstate
from storage.objectstore import StorageError, StorageIOError
from storage.runstate import RunState, RunStateError

# ---------------------------------------------------------------- a run folder with checkpoints


def committed_run(tmp_path: Path, steps=(1, 3, 5)) -> str:
    """A run whose checkpoints of ``steps`` are committed as the training flow commits them (files,
    then MANIFEST.json with each file's size and SHA-256, then state.json); state.json names the last."""
    run_uri = objectstore.normalize(str(tmp_path / "runs" / "r"))
    for step in steps:
        folder = runstate.checkpoint_uri(run_uri, step)
        records = {}
        for name in ("trainer-torch/trainer.pt", "model/model.safetensors"):
            data = f"{name} of step {step}".encode()
            objectstore.write_bytes(objectstore.join(folder, name), data)
            records[name] = runstate.file_record(data)
        state = RunState(step=step, cursors=[10 * step, 10 * step + 1], checkpoint=folder, policy_version=step + 1,
                         heldout_before=0.25, sampling=[{"carry": None, "carried": 0}] * 2)
        runstate.commit_checkpoint(run_uri, state, records, keep_last=5)
    return run_uri


def folders(run_uri: str) -> list[str]:
    return sorted(p.name for p in Path(objectstore.fs_for(run_uri)[1], "checkpoints").iterdir())


def local(uri: str) -> Path:
    return Path(objectstore.fs_for(uri)[1])


def step_state(run_uri: str, step: int) -> RunState:
    """What state.json held right after ``committed_run`` committed ``step``."""
    return RunState(step=step, cursors=[10 * step, 10 * step + 1], checkpoint=runstate.checkpoint_uri(run_uri, step),
                    policy_version=step + 1, heldout_before=0.25, sampling=[{"carry": None, "carried": 0}] * 2)


# ---------------------------------------------------------------- state.json missing or unreadable


@pytest.mark.parametrize("damage, wrong", [
    (bytes(range(128, 256)), r"state.json: not valid JSON \('utf-8' codec can't decode byte 0x80"),  # random bytes
    (b'{"step": 5, "cursors": [50, 5', r"state.json: not valid JSON \(Expecting"),
    (b'{"step": 3}', r"state.json: not a run state: field 'cursors' is missing; field 'checkpoint' is missing"),
    (b'[1, 2]', r"state.json: not a run state \(a JSON list, not an object\)"),
], ids=["random-bytes", "truncated", "fields-missing", "not-an-object"])
def test_an_unreadable_state_json_is_named_kept_aside_and_rebuilt_from_the_newest_intact_manifest(tmp_path, damage, wrong):
    run_uri = committed_run(tmp_path)
    objectstore.remove(objectstore.join(runstate.checkpoint_uri(run_uri, 1), "model", "model.safetensors"))  # not intact
    state_json = local(run_uri) / "state.json"
    state_json.write_bytes(damage)
    with pytest.raises(RunStateError) as info:  # what `yattflow status` and a stop line read
        RunState.load(run_uri)
    message = str(info.value)
    assert "\n" not in message  # the CLI shows an error's last line
    assert message.startswith(f"{run_uri}/state.json: ")
    assert re.search(wrong, message), message
    intact = [runstate.checkpoint_uri(run_uri, s) for s in (3, 5)]
    assert f"committed checkpoints still intact: {intact[0]} (after step 4), {intact[1]} (after step 6)." in message
    assert runstate.checkpoint_uri(run_uri, 1) not in message

    # the CLI's error path reads it again, and must not fail doing so
    from engines.config import load_config
    from flows.stops import where_it_stopped

    config = load_config(None, [f"storage.root={tmp_path}", "name=r"])
    assert config.run_uri == run_uri
    assert where_it_stopped(config).startswith("where the run stands is unknown: ")

    # the training run's resume rebuilds it from step 5's manifest and keeps the damaged file
    warnings: list[str] = []
    assert runstate.resume_point(run_uri, warnings.append) == step_state(run_uri, 5) == RunState.load(run_uri)
    [aside] = local(run_uri).glob("state.json.damaged-*")
    assert aside.read_bytes() == damage
    [warning] = warnings
    assert warning.startswith(f"{run_uri}/state.json cannot be read: ") and re.search(wrong.split("state.json: ")[1], warning)
    assert warning.endswith(f"(it is kept as {run_uri}/{aside.name}): rebuilt from {intact[1]}/MANIFEST.json, the newest "
                            "intact checkpoint (after step 6); nothing was deleted")
    assert folders(run_uri) == ["000001", "000003", "000005"]


def test_a_deleted_state_json_is_rebuilt_from_the_newest_manifest_and_nothing_is_deleted(tmp_path):
    """The probe: state.json of a finished run deleted. It used to read as "nothing committed": every
    checkpoint deleted and the run trained again from step 1."""
    run_uri = committed_run(tmp_path)
    (local(run_uri) / "state.json").unlink()
    warnings: list[str] = []
    resumed = runstate.resume_point(run_uri, warnings.append)
    assert resumed == step_state(run_uri, 5) == RunState.load(run_uri)
    assert warnings == [f"{run_uri}/state.json is missing: rebuilt from {runstate.checkpoint_uri(run_uri, 5)}/MANIFEST.json, "
                        "the newest intact checkpoint (after step 6); nothing was deleted"]
    assert runstate.discard_uncommitted(run_uri, resumed) == []
    assert folders(run_uri) == ["000001", "000003", "000005"]


def test_a_missing_state_json_with_no_intact_checkpoint_stops_naming_the_folders_and_deletes_nothing(tmp_path):
    run_uri = committed_run(tmp_path, steps=(1, 3))
    (local(run_uri) / "state.json").unlink()
    for step in (1, 3):
        (local(runstate.checkpoint_uri(run_uri, step)) / "MANIFEST.json").unlink()
    with pytest.raises(RunStateError) as info:
        runstate.resume_point(run_uri, print)
    folders_named = ", ".join(runstate.checkpoint_uri(run_uri, s) for s in (1, 3))
    assert str(info.value) == (f"{run_uri}/state.json: is missing, and none of the run's checkpoint folders is intact "
                               f"({folders_named}); nothing was deleted. Restore them, or use another run name to start over")
    assert folders(run_uri) == ["000001", "000003"] and not (local(run_uri) / "state.json").exists()


def test_a_state_json_from_before_sampling_still_loads(tmp_path):
    run_uri = committed_run(tmp_path, steps=(1,))
    state = objectstore.read_json(objectstore.join(run_uri, "state.json"))
    del state["sampling"], state["heldout_before"]
    objectstore.write_json(objectstore.join(run_uri, "state.json"), state | {"added_later": 1})
    assert RunState.load(run_uri).sampling == []


def test_a_checkpoint_committed_after_state_json_was_written_is_resumed_from_not_deleted(tmp_path):
    """A stop between the manifest's write and state.json's: the manifest is complete (written after
    every file), so the run resumes from that checkpoint."""
    run_uri = committed_run(tmp_path)
    step_state(run_uri, 3).save(run_uri)  # state.json as it was before step 5's commit reached it
    warnings: list[str] = []
    resumed = runstate.resume_point(run_uri, warnings.append)
    assert resumed == step_state(run_uri, 5) == RunState.load(run_uri)
    assert warnings == [f"{runstate.checkpoint_uri(run_uri, 5)} was committed after {run_uri}/state.json was last written "
                        "(a stop between the two writes): resuming from it (after step 6)"]
    assert runstate.discard_uncommitted(run_uri, resumed) == [] and folders(run_uri) == ["000001", "000003", "000005"]


# ---------------------------------------------------------------- a committed checkpoint damaged since


def test_a_checkpoint_that_lost_its_manifest_is_set_aside_and_the_run_resumes_from_the_one_before(tmp_path):
    run_uri = committed_run(tmp_path)
    last = runstate.checkpoint_uri(run_uri, 5)
    objectstore.remove(objectstore.join(last, "MANIFEST.json"))
    warnings: list[str] = []
    resumed = runstate.resume_point(run_uri, warnings.append)

    before = runstate.checkpoint_uri(run_uri, 3)
    assert resumed == step_state(run_uri, 3)
    assert RunState.load(run_uri) == resumed  # state.json says so too
    [aside] = [f for f in folders(run_uri) if f.startswith("000005.")]
    assert aside.startswith("000005.damaged-")
    kept = local(run_uri) / "checkpoints" / aside
    assert (kept / "model" / "model.safetensors").read_bytes() == b"model/model.safetensors of step 5"  # never deleted
    [warning] = warnings
    assert warning == (f"{last}, the checkpoint state.json resumed from (after step 6), has no MANIFEST.json; it is kept "
                       f"as {objectstore.join(run_uri, 'checkpoints', aside)}. Resuming from {before} (after step 4), the "
                       "newest intact checkpoint before it: steps 5 to 6 are trained again")
    assert runstate.discard_uncommitted(run_uri, resumed) == []  # the one set aside is not a checkpoint folder any more
    assert runstate.resume_point(run_uri, warnings.append) == resumed and len(warnings) == 1


def test_a_checkpoint_missing_files_counts_as_damaged_too(tmp_path):
    run_uri = committed_run(tmp_path, steps=(1, 3))
    objectstore.remove(objectstore.join(runstate.checkpoint_uri(run_uri, 3), "trainer-torch"))
    warnings: list[str] = []
    resumed = runstate.resume_point(run_uri, warnings.append)
    assert resumed.step == 1
    assert "lacks 1 of the files its MANIFEST.json lists (trainer-torch/trainer.pt)" in warnings[0]


def test_a_truncated_file_is_seen_by_its_size_and_the_run_resumes_from_the_one_before(tmp_path):
    """The probe: the newest trainer.pt truncated. It used to fail in torch's zip reader, naming no file,
    with no fall-back; its size now differs from its manifest's before any host starts."""
    run_uri = committed_run(tmp_path, steps=(1, 3))
    trainer = local(runstate.checkpoint_uri(run_uri, 3)) / "trainer-torch" / "trainer.pt"
    trainer.write_bytes(trainer.read_bytes()[:10])
    warnings: list[str] = []
    assert runstate.resume_point(run_uri, warnings.append) == step_state(run_uri, 1)
    assert ("has trainer-torch/trainer.pt of 10 bytes where its MANIFEST.json recorded 34; it is kept as "
            f"{runstate.checkpoint_uri(run_uri, 3)}.damaged-") in warnings[0]


def test_with_no_intact_checkpoint_before_it_the_run_stops_naming_the_folder_and_deletes_nothing(tmp_path):
    run_uri = committed_run(tmp_path, steps=(1, 3))
    for step in (1, 3):
        objectstore.remove(objectstore.join(runstate.checkpoint_uri(run_uri, step), "MANIFEST.json"))
    state = RunState.load(run_uri)
    with pytest.raises(StorageError) as info:
        runstate.resume_point(run_uri, print)
    assert str(info.value) == (
        f"{state.checkpoint}: the checkpoint state.json resumes from (after step 4) has no MANIFEST.json, and no earlier "
        "checkpoint of the run is intact; nothing was deleted. Restore what is missing, or use another run name to "
        "start over")
    assert folders(run_uri) == ["000001", "000003"]
    # even a caller that skipped resume_point: a folder at or before the committed step is never discarded
    assert runstate.discard_uncommitted(run_uri, state) == []
    assert folders(run_uri) == ["000001", "000003"]


def test_a_folder_a_write_in_progress_left_after_the_committed_step_is_discarded(tmp_path):
    run_uri = committed_run(tmp_path, steps=(1,))
    half = runstate.checkpoint_uri(run_uri, 3)
    objectstore.write_bytes(objectstore.join(half, "rng-0.pt"), b"half")  # no manifest: the write never finished
    assert runstate.discard_uncommitted(run_uri, RunState.load(run_uri)) == [half]
    assert folders(run_uri) == ["000001"]


# ---------------------------------------------------------------- content that is not what was written


def write_checkpoint(tmp_path: Path) -> tuple[str, Checkpoints]:
    """A checkpoint as a host writes it (``Checkpoints.save``), committed with the records it answered."""
    run_uri = objectstore.normalize(str(tmp_path / "runs" / "r"))
    uri = runstate.checkpoint_uri(run_uri, 1)
    checkpoints = Checkpoints(0, "torch", [["part-00000.parquet", 8]])
    files = checkpoints.save(FilesTrainer(), uri, asynchronous=False).files
    runstate.commit_checkpoint(run_uri, RunState(step=1, cursors=[8], checkpoint=uri), files, keep_last=2)
    return uri, checkpoints


def test_the_manifest_records_what_the_writer_wrote_and_an_intact_checkpoint_verifies(tmp_path):
    uri, checkpoints = write_checkpoint(tmp_path)
    manifest = objectstore.read_json(objectstore.join(uri, "MANIFEST.json"))
    assert sorted(manifest["files"]) == ["layout.json", "model/model.safetensors", "prompts.json", "rng-0.pt",
                                         "trainer-torch/trainer.pt"]
    for name, record in manifest["files"].items():
        data = (local(uri) / name).read_bytes()
        assert record == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    checkpoints.verify(uri)  # raises nothing


@pytest.mark.parametrize("damage", ["flipped", "symlink"])
def test_content_that_is_not_what_the_manifest_recorded_is_refused_naming_the_file(tmp_path, damage):
    """The probes: 64 bytes flipped inside the newest trainer.pt (same size: it used to resume silently,
    one weight off by 449.5), and prompts.json replaced by a link to /etc/passwd (the store followed it)."""
    uri, checkpoints = write_checkpoint(tmp_path)
    if damage == "flipped":
        trainer = local(uri) / "trainer-torch" / "trainer.pt"
        data = bytearray(trainer.read_bytes())
        data[500:564] = bytes(b ^ 0xFF for b in data[500:564])
        trainer.write_bytes(bytes(data))
        named = "trainer-torch/trainer.pt"
    else:
        (local(uri) / "prompts.json").unlink()
        (local(uri) / "prompts.json").symlink_to("/etc/passwd")
        named = "prompts.json"
        with pytest.raises(StorageError, match=r"prompts.json: a symbolic link \(to /etc/passwd\), not an object the store "
                                               "wrote; the store never follows one"):
            objectstore.read_json(objectstore.join(uri, "prompts.json"))
    with pytest.raises(CheckpointDamaged) as info:
        checkpoints.verify(uri)
    assert re.fullmatch(rf"{uri}: has 1 file\(s\) whose content is not what its MANIFEST.json recorded: {named} "
                        r"\(SHA-256 [0-9a-f]{12}…, its MANIFEST.json recorded [0-9a-f]{12}…\)", str(info.value))


class PickledObject:
    """Any class of the user's: unpickling it would run its module's code (here: none)."""


@pytest.mark.parametrize("content", [b"PK\x03\x04 truncated zip", "pickle"], ids=["damaged", "a-pickled-object"])
def test_a_torch_file_that_yattflow_did_not_write_is_refused_in_one_line_naming_it(tmp_path, content):
    import torch

    from engines.backends.base import load_torch_file

    path = tmp_path / "rng-0.pt"
    if content == "pickle":
        torch.save({"x": PickledObject()}, path)  # an object torch's weights-only reader refuses
    else:
        path.write_bytes(content)
    with pytest.raises(ValueError) as info:
        load_torch_file(str(path), str(path))
    message = str(info.value)
    assert message.startswith(f"{path}: not a torch file yattflow wrote (") and "\n" not in message
    assert "weights_only=False" not in message
    if content == "pickle":
        assert "it holds objects other than tensors and plain data" in message


# ---------------------------------------------------------------- a full disk


def test_a_failed_write_names_the_uri_and_the_os_error(tmp_path, monkeypatch):
    uri = objectstore.normalize(str(tmp_path / "steps" / "part-0.parquet"))
    objectstore.write_bytes(uri, b"old")

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(objectstore.os, "fsync", full)
    with pytest.raises(StorageIOError) as info:
        objectstore.write_bytes(uri, b"new")
    assert str(info.value) == f"{uri}: write failed: [Errno 28] No space left on device"
    assert isinstance(info.value, OSError)  # still one, for code that catches those
    monkeypatch.undo()
    assert objectstore.read_bytes(uri) == b"old" and os.listdir(tmp_path / "steps") == ["part-0.parquet"]


@pytest.fixture
def tiny_disk(tmp_path):
    """A 64 KiB tmpfs (needs root; skipped without)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)],
                                           capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_a_full_disk_names_the_uri_and_keeps_what_was_there(tiny_disk):
    uri = objectstore.normalize(str(tiny_disk / "runs" / "r" / "state.json"))
    objectstore.write_json(uri, {"step": 1})
    with pytest.raises(StorageError) as info:
        objectstore.write_bytes(uri, b"x" * 200_000)
    assert str(info.value) == f"{uri}: write failed: [Errno 28] No space left on device"
    assert objectstore.read_json(uri) == {"step": 1} and os.listdir(tiny_disk / "runs" / "r") == ["state.json"]


class FilesTrainer:
    """Just enough of a trainer for ``Checkpoints``: a trainer file and a model file, 1 kB each."""

    def freeze_checkpoint(self, local_dir: str, copy: bool, hf_weights: bool = True):
        from engines.backends.base import FrozenCheckpoint

        def write() -> list[str]:
            os.makedirs(local_dir, exist_ok=True)
            Path(local_dir, "trainer.pt").write_bytes(b"t" * 1000)
            return ["trainer.pt"]

        return FrozenCheckpoint(write)

    def save_hf(self, path: str, tensors=None) -> None:
        os.makedirs(path, exist_ok=True)
        Path(path, "model.safetensors").write_bytes(b"m" * 1000)


def test_a_checkpoint_write_on_a_full_disk_names_the_checkpoint_the_file_and_the_os_error(tmp_path, monkeypatch):
    checkpoint = objectstore.normalize(str(tmp_path / "checkpoints" / "000003"))
    writes = []

    def full_after_the_first(fd):  # the rng file lands; the disk is full from the next one on
        writes.append(fd)
        if len(writes) > 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(objectstore.os, "fsync", full_after_the_first)
    checkpoints = Checkpoints(0, "torch", [])
    checkpoints.save(FilesTrainer(), checkpoint, asynchronous=True)
    with pytest.raises(RuntimeError) as info:
        checkpoints.wait()
    assert re.fullmatch(rf"checkpoint write to {checkpoint} failed after \d+\.\d\ds: StorageIOError: {checkpoint}/"
                        r"trainer-torch/trainer.pt: write failed: \[Errno 28\] No space left on device", str(info.value))
    assert not objectstore.exists(objectstore.join(checkpoint, "MANIFEST.json"))


# ---------------------------------------------------------------- a rule that raises on some responses


def test_a_rule_that_raises_on_some_responses_names_the_rule_the_prompt_and_the_response(tmp_path):
    path = tmp_path / "picky.py"
    path.write_text(textwrap.dedent("""
        def reward(prompt, response, answer):
            if response != answer:
                raise ValueError("boom on a wrong answer")
            return 1.0
    """))
    rule = load_rule(f"{path}:reward")
    assert rule("12+30=", "24", "24", prompt_id=7) == 1.0  # what the input check tries: it passes
    with pytest.raises(RewardRuleError) as info:
        rule("12+30=", "25\n", "24", prompt_id=7)
    assert str(info.value) == (f"reward.rule {path}:reward raised ValueError: boom on a wrong answer on prompt_id 7, "
                               "response '25\\n', answer '24'")
    assert isinstance(info.value.__cause__, ValueError)  # the user's own error, with its traceback
    with pytest.raises(RewardRuleError, match=r"response 'x{199}… \(5000 characters\), answer '24'$"):
        rule("p", "x" * 5000, "24", prompt_id=8)


def test_a_rule_that_raises_on_the_reference_answer_fails_the_input_check_naming_the_file(tmp_path):
    from engines.config import load_config
    from engines.host.validation import InputError, check_answers

    path = tmp_path / "broken.py"
    path.write_text("def reward(prompt, response, answer):\n    return 1 / 0\n")
    first = {"prompt_id": 3, "prompt": "01+01=", "answer": "20"}
    with pytest.raises(InputError) as info:
        check_answers(load_config(None, []), "data.prompts", "file:///data/train", first, [], 1, load_rule(f"{path}:reward"))
    assert str(info.value) == (f"reward.rule {path}:reward raised ZeroDivisionError: division by zero on prompt_id 3, "
                               "response '20', answer '20' (the first prompt of file:///data/train, called with its "
                               "reference answer as the response)")


# ---------------------------------------------------------------- stopped while it waits for another run


def test_a_run_stopped_while_it_waits_for_the_lease_stops_waiting(tmp_path):
    """``run.on_conflict=wait``, and the waiting run is stopped (Ctrl-C, SIGTERM): the training flow
    releases its lease object, and the thread that waits gives up at its next poll instead of waiting
    on (asyncio.run would wait for that thread) and taking the lease for nobody."""
    from storage.lease import Lease, RunInUse

    run_uri = objectstore.normalize(str(tmp_path / "runs" / "r"))
    holder, waiter = Lease(run_uri, ttl_s=30), Lease(run_uri, ttl_s=30)
    holder.acquire()
    failed: list[BaseException] = []

    def wait() -> None:
        try:
            waiter.acquire(wait=True, poll_s=0.2)
        except RunInUse as e:
            failed.append(e)

    thread = threading.Thread(target=wait)
    thread.start()
    threading.Timer(0.5, waiter.release).start()
    thread.join(timeout=10)
    assert not thread.is_alive() and "stopped while waiting for run held by" in str(failed[0])
    assert objectstore.read_json(objectstore.join(run_uri, "lease.json"))["holder"] == holder.me  # untouched
    holder.release()


# ---------------------------------------------------------------- two first commands on one PREFECT_HOME


@pytest.mark.integration
def test_two_first_servers_on_one_new_prefect_home_both_start(tmp_path):
    """Two commands that start their temporary server at the same moment on a new PREFECT_HOME:
    both servers answer (they start one at a time; at once, both ran the database migration and
    one failed: alembic "expected to match one row", or "duplicate column name")."""
    from flows.prefect_server import TEMPORARY_SERVER_SETTINGS, started_server, stop

    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"} | TEMPORARY_SERVER_SETTINGS | {
        "PREFECT_HOME": str(home), "PREFECT_UI_ENABLED": "0"}
    started, errors = [], []

    def start(n: int) -> None:
        try:
            started.append(started_server(env, home / f"server-{n}.log", f"server {n}")[0])
        except RuntimeError as e:
            errors.append(f"{e}:\n{(home / f'server-{n}.log').read_text()[-3000:]}")

    threads = [threading.Thread(target=start, args=(n,)) for n in (1, 2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert not errors, errors[0]
        assert len(started) == 2
    finally:
        for proc in started:
            stop(proc, "a test server")
