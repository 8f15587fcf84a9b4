"""storage/: atomic object IO, Parquet datasets with schema checks, run state and
checkpoint commits — on a local folder, then the same core against a real S3 server
(SeaweedFS ``weed mini``, started once per session on loopback)."""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from tests import helpers


import pyarrow as pa
import pyarrow.parquet as pq

from storage import datasets, objectstore, runstate
from storage.datasets import PROMPTS, ROLLOUTS, SchemaError
from storage.lease import Lease, LeaseLost, RunInUse
from storage.objectstore import StorageError
from storage.runstate import RunState

# ---------------------------------------------------------------- data


def prompts_table(ids, answers=True) -> pa.Table:
    cols = {"prompt_id": pa.array(ids, pa.int64()), "prompt": [f"{i}+{i}=" for i in ids]}
    if answers:
        cols["answer"] = [str(2 * i) for i in ids]
    return pa.table(cols)


def rollouts_table(n: int) -> pa.Table:
    return pa.table(
        {
            "prompt_id": pa.array(range(n), pa.int64()),
            "sample_index": pa.array([i % 2 for i in range(n)], pa.int32()),
            "policy_version": pa.array([3] * n, pa.int64()),
            "wave": pa.array([0] * n, pa.int32()),
            "prompt": [f"p{i}" for i in range(n)],
            "answer": [None if i % 2 else str(i) for i in range(n)],
            "prompt_ids": pa.array([[1, 5 + i] for i in range(n)], pa.list_(pa.int32())),
            "response": [f"r{i}" for i in range(n)],
            "response_ids": pa.array([[6] * i + [2] for i in range(n)], pa.list_(pa.int32())),
            "logprobs": pa.array([[-0.5] * (i + 1) for i in range(n)], pa.list_(pa.float32())),
            "truncated": [False] * n,
        }
    )


def uri_of(path) -> str:
    return objectstore.normalize(str(path))


# ---------------------------------------------------------------- objectstore, local


def test_write_bytes_creates_parents_and_overwrites_whole(tmp_path):
    uri = uri_of(tmp_path / "a" / "b" / "obj.bin")
    big = os.urandom(1 << 20)
    objectstore.write_bytes(uri, big)
    assert objectstore.read_bytes(uri) == big
    objectstore.write_bytes(uri, b"short")
    assert objectstore.read_bytes(uri) == b"short"  # no tail of the old object left
    assert os.listdir(tmp_path / "a" / "b") == ["obj.bin"]  # no temp files left


def test_failed_write_keeps_old_object_and_leaves_no_temp(tmp_path, monkeypatch):
    uri = uri_of(tmp_path / "obj.bin")
    objectstore.write_bytes(uri, b"old")

    def crash(fd):
        raise OSError("disk vanished")

    monkeypatch.setattr(objectstore.os, "fsync", crash)  # fail after the temp file was written
    with pytest.raises(OSError, match="disk vanished"):
        objectstore.write_bytes(uri, b"new, longer contents")
    monkeypatch.undo()
    assert objectstore.read_bytes(uri) == b"old"
    assert os.listdir(tmp_path) == ["obj.bin"]


def test_json_round_trip_and_errors(tmp_path):
    uri = uri_of(tmp_path / "x" / "state.json")
    objectstore.write_json(uri, {"b": [1, 2], "a": None})
    assert objectstore.read_json(uri) == {"a": None, "b": [1, 2]}
    objectstore.write_bytes(uri, b"{not json")
    with pytest.raises(StorageError, match="not valid JSON") as info:
        objectstore.read_json(uri)
    assert uri in str(info.value)
    missing = uri_of(tmp_path / "missing.json")
    with pytest.raises(StorageError, match="not found") as info:
        objectstore.read_json(missing)
    assert missing in str(info.value)


def test_list_files(tmp_path):
    root = uri_of(tmp_path / "d")
    for name in ["b.parquet", "a.parquet", "c.txt"]:
        objectstore.write_bytes(objectstore.join(root, name), b"x")
    (tmp_path / "d" / "z.parquet.tmp-1234abcd").write_bytes(b"half")  # a writer's temp file
    assert objectstore.list_files(root) == [f"{root}/a.parquet", f"{root}/b.parquet", f"{root}/c.txt"]
    assert objectstore.list_files(root, suffix=".parquet") == [f"{root}/a.parquet", f"{root}/b.parquet"]
    assert objectstore.list_files(f"{root}/c.txt") == [f"{root}/c.txt"]  # a file lists itself
    with pytest.raises(StorageError, match="not found"):
        objectstore.list_files(uri_of(tmp_path / "nope"))


def test_check_reachable_local(tmp_path):
    objectstore.check_reachable(uri_of(tmp_path / "root"))
    assert os.listdir(tmp_path / "root") == []  # the probe is removed
    assert files_under(uri_of(tmp_path / "root")) == []

    blocker = tmp_path / "file"
    blocker.write_text("a regular file, not a folder")
    root = uri_of(blocker) + "/under"
    with pytest.raises(StorageError) as info:
        objectstore.check_reachable(root)
    assert root in str(info.value) and "not reachable or not writable" in str(info.value)


def test_local_folder(tmp_path):
    assert objectstore.local_folder(uri_of(tmp_path)) == str(tmp_path)
    missing = uri_of(tmp_path / "missing")
    with pytest.raises(StorageError, match="folder not found") as info:
        objectstore.local_folder(missing)
    assert missing in str(info.value)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(StorageError):
        objectstore.local_folder(uri_of(tmp_path / "afile"))


def test_resolve_and_join():
    assert objectstore.resolve("s3://b/p/", "data/train") == "s3://b/p/data/train"
    assert objectstore.resolve("/r", "/abs/x") == "file:///abs/x"
    assert objectstore.resolve("/r", "s3://other/x/") == "s3://other/x"
    assert objectstore.join("s3://b/p/", "/a/", "", "b") == "s3://b/p/a/b"


# ---------------------------------------------------------------- datasets, local


def test_table_round_trip_casts_fills_and_drops(tmp_path):
    uri = uri_of(tmp_path / "rollouts.parquet")
    table = rollouts_table(4).append_column("extra", pa.array([1, 2, 3, 4]))
    table = table.set_column(0, "prompt_id", table.column("prompt_id").cast(pa.int32()))  # castable
    datasets.write_table(uri, table, ROLLOUTS)
    back = datasets.read_table(uri, ROLLOUTS)
    assert back.schema == ROLLOUTS
    assert "extra" not in back.column_names
    assert back.column("prompt_id").to_pylist() == [0, 1, 2, 3]
    assert back.column("response_ids").to_pylist() == [[2], [6, 2], [6, 6, 2], [6, 6, 6, 2]]
    assert back.column("answer").to_pylist() == ["0", None, "2", None]

    no_answer = tmp_path / "prompts.parquet"
    datasets.write_table(uri_of(no_answer), prompts_table([1, 2], answers=False), PROMPTS)  # nullable: filled
    assert datasets.read_table(uri_of(no_answer), PROMPTS).column("answer").to_pylist() == [None, None]


def test_read_table_folder_concatenates_parts_in_name_order(tmp_path):
    folder = tmp_path / "train"
    for part, ids in [("part-002", [20, 21]), ("part-000", [0]), ("part-010", [100]), ("part-001", [10, 11])]:
        datasets.write_table(uri_of(folder / f"{part}.parquet"), prompts_table(ids), PROMPTS)
    (folder / "README.txt").write_text("not a part")
    table = datasets.read_table(uri_of(folder), PROMPTS)
    assert table.column("prompt_id").to_pylist() == [0, 10, 11, 20, 21, 100]
    assert table.schema == PROMPTS


def test_read_table_empty_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(SchemaError, match="no .parquet files"):
        datasets.read_table(uri_of(tmp_path / "empty"), PROMPTS)


@pytest.mark.parametrize(
    "table,field,words",
    [
        (pa.table({"prompt_id": pa.array([1], pa.int64())}), "prompt", "missing"),  # missing non-null field
        (pa.table({"prompt_id": pa.array([1, None], pa.int64()), "prompt": ["a", "b"]}), "prompt_id", "null"),
        (pa.table({"prompt_id": ["seven"], "prompt": ["a"]}), "prompt_id", "expected int64"),  # uncastable
    ],
)
def test_schema_errors_name_file_and_field(tmp_path, table, field, words):
    # on write: the destination is named
    uri = uri_of(tmp_path / "out.parquet")
    with pytest.raises(SchemaError) as info:
        datasets.write_table(uri, table, PROMPTS)
    assert uri in str(info.value) and f"'{field}'" in str(info.value) and words in str(info.value)
    assert not (tmp_path / "out.parquet").exists()  # nothing written

    # on read of a folder: the offending part is named
    folder = tmp_path / "ds"
    datasets.write_table(uri_of(folder / "part-000.parquet"), prompts_table([1]), PROMPTS)
    folder.mkdir(exist_ok=True)
    pq.write_table(table, folder / "part-001.parquet")
    with pytest.raises(SchemaError) as info:
        datasets.read_table(uri_of(folder), PROMPTS)
    bad = uri_of(folder / "part-001.parquet")
    assert bad in str(info.value) and f"'{field}'" in str(info.value)


def test_unreadable_parquet_names_file(tmp_path):
    bad = tmp_path / "ds" / "part-000.parquet"
    objectstore.write_bytes(uri_of(bad), b"this is not parquet")
    with pytest.raises(SchemaError, match="not a readable Parquet file") as info:
        datasets.read_table(uri_of(tmp_path / "ds"), PROMPTS)
    assert uri_of(bad) in str(info.value)


def test_stage_uri():
    assert datasets.stage_uri("s3://b/runs/x", 7, "rollout", 1, 2) == "s3://b/runs/x/steps/000007/rollout/group=1/part-002.parquet"
    assert datasets.stage_uri("file:///r", 0, "scored", 0).endswith("steps/000000/scored/group=0/part-000.parquet")


def test_image_column_survives_every_stage_schema(tmp_path):
    """Vision-language prompts: encoded images are a list column of the prompts (a prompt may
    carry several); rollouts → scored → experience (and the carry-over) reference the prompt's
    global row (``prompt_row``), by which a trainer re-reads the images, and never copy the
    bytes. Prompt files without the column still load, with null images."""
    images = [[bytes([i]) * (1000 + i) + os.urandom(64)] * (i % 3) for i in range(4)]  # 0, 1 or 2 images
    uri = lambda name: uri_of(tmp_path / f"{name}.parquet")  # noqa: E731
    table = prompts_table(range(4)).append_column("images", pa.array(images, pa.list_(pa.binary())))
    datasets.write_table(uri("prompts"), table, PROMPTS)
    prompts = datasets.read_table(uri("prompts"), PROMPTS)
    assert prompts.schema.field("images").type == pa.list_(pa.binary())
    assert prompts.column("images").to_pylist() == images

    rollouts = rollouts_table(4).to_pylist()
    for row, r in enumerate(rollouts):
        r["prompt_row"] = row  # the reference, not the bytes
    datasets.write_table(uri("rollouts"), pa.Table.from_pylist(rollouts, schema=ROLLOUTS), ROLLOUTS)
    rows = datasets.read_table(uri("rollouts"), ROLLOUTS).to_pylist()
    for r in rows:
        r.update(judge_text="correct", genrm_reward=1.0, rule_reward=None, reward=1.0)
    datasets.write_table(uri("scored"), pa.Table.from_pylist(rows, schema=datasets.SCORED), datasets.SCORED)
    rows = [r | {"step": 0, "advantage": 0.5} for r in datasets.read_table(uri("scored"), datasets.SCORED).to_pylist()]
    datasets.write_table(uri("experience"), pa.Table.from_pylist(rows, schema=datasets.EXPERIENCE), datasets.EXPERIENCE)
    datasets.write_table(uri("carry"), pa.Table.from_pylist(rows, schema=datasets.CARRY), datasets.CARRY)
    for name, schema in (("rollouts", ROLLOUTS), ("scored", datasets.SCORED), ("experience", datasets.EXPERIENCE), ("carry", datasets.CARRY)):
        back = datasets.read_table(uri(name), schema)
        assert not {"image", "images"} & set(back.column_names)  # no stage copies the bytes
        assert back.schema.field("prompt_row").type == pa.int64()
        assert back.column("prompt_row").to_pylist() == [0, 1, 2, 3]
        assert back.column("prompt_id").to_pylist() == [0, 1, 2, 3]
        # the reference leads back to the prompt's images
        assert [prompts.column("images")[r].as_py() for r in back.column("prompt_row").to_pylist()] == images

    pq.write_table(prompts_table([7]), tmp_path / "text-only.parquet")  # a file written before the column existed
    assert datasets.read_table(uri("text-only"), PROMPTS).column("images").to_pylist() == [None]
    assert datasets.read_table(uri("rollouts"), ROLLOUTS).schema.field("prompt_row").nullable


# ---------------------------------------------------------------- run state, checkpoints


def commit(run_uri: str, step: int, keep_last: int) -> RunState:
    """Write a checkpoint's files, then commit it (as the training flow does)."""
    ckpt = runstate.checkpoint_uri(run_uri, step)
    data = f"weights {step}".encode()
    objectstore.write_bytes(objectstore.join(ckpt, "trainer.pt"), data)
    state = RunState(step=step, cursors=[step, 2 * step], checkpoint=ckpt, policy_version=step + 1)
    runstate.commit_checkpoint(run_uri, state, {"trainer.pt": runstate.file_record(data)}, keep_last=keep_last)
    return state


def files_under(uri: str) -> list[str]:
    """Objects (not folders) under ``uri``. SeaweedFS keeps emptied folders as directory
    entries for a while, so "no files left" is what a removal promises on every backend."""
    if not objectstore.exists(uri):
        return []
    fs, path = objectstore.fs_for(uri)
    return sorted(name for name, info in fs.find(path, detail=True).items() if info["type"] == "file")


def check_keep_last(run_uri: str) -> None:
    assert RunState.load(run_uri) is None
    assert runstate.committed_checkpoints(run_uri) == []
    states = [commit(run_uri, step, keep_last=2) for step in range(4)]
    assert runstate.committed_checkpoints(run_uri) == [runstate.checkpoint_uri(run_uri, s) for s in (2, 3)]
    assert files_under(runstate.checkpoint_uri(run_uri, 0)) == []
    assert files_under(runstate.checkpoint_uri(run_uri, 1)) == []
    assert len(files_under(runstate.checkpoint_uri(run_uri, 2))) == 2  # trainer.pt, MANIFEST.json
    assert RunState.load(run_uri) == states[-1]
    manifest = objectstore.read_json(objectstore.join(states[-1].checkpoint, "MANIFEST.json"))
    assert manifest["files"] == {"trainer.pt": {"size": 9, "sha256": hashlib.sha256(b"weights 3").hexdigest()}}
    assert manifest["step"] == 3 and manifest["cursors"] == [3, 6]
    assert objectstore.read_bytes(objectstore.join(states[-1].checkpoint, "trainer.pt")) == b"weights 3"

    # a folder without MANIFEST.json (a crash before the commit) is not a checkpoint
    partial = runstate.checkpoint_uri(run_uri, 4)
    objectstore.write_bytes(objectstore.join(partial, "trainer.pt"), b"half")
    assert partial not in runstate.committed_checkpoints(run_uri)
    assert runstate.committed_checkpoints(run_uri)[-1] == states[-1].checkpoint


def test_commit_checkpoint_keeps_last_committed_local(tmp_path):
    check_keep_last(uri_of(tmp_path / "runs" / "demo"))


def test_commit_writes_manifest_then_state(tmp_path, monkeypatch):
    run_uri = uri_of(tmp_path / "run")
    commit(run_uri, 0, keep_last=3)
    written = []
    real_write = objectstore.write_bytes

    def recording_write(uri, data):
        written.append(uri.rsplit("/", 1)[-1])
        real_write(uri, data)

    monkeypatch.setattr(objectstore, "write_bytes", recording_write)
    commit(run_uri, 1, keep_last=3)
    assert written == ["trainer.pt", "MANIFEST.json", "state.json"]


@pytest.mark.parametrize("crash_on", ["MANIFEST.json", "state.json"])
def test_crash_during_commit_resumes_previous_checkpoint(tmp_path, monkeypatch, crash_on):
    run_uri = uri_of(tmp_path / "run")
    previous = commit(run_uri, 0, keep_last=1)
    real_write = objectstore.write_bytes

    def crashing_write(uri, data):
        if uri.endswith(crash_on):
            raise OSError("killed")
        real_write(uri, data)

    monkeypatch.setattr(objectstore, "write_bytes", crashing_write)
    with pytest.raises(OSError):
        commit(run_uri, 1, keep_last=1)
    monkeypatch.undo()
    assert RunState.load(run_uri) == previous  # resume reads the old state
    assert objectstore.exists(objectstore.join(previous.checkpoint, "MANIFEST.json"))  # and it still exists
    if crash_on == "MANIFEST.json":
        assert runstate.committed_checkpoints(run_uri) == [previous.checkpoint]
        assert runstate.resume_point(run_uri, print) == previous
    else:  # the manifest is complete: the resume takes that checkpoint rather than deleting it
        assert runstate.resume_point(run_uri, print).checkpoint == runstate.checkpoint_uri(run_uri, 1)


# ---------------------------------------------------------------- S3 (SeaweedFS)

s3 = pytest.mark.s3  # the server and s3_root: tests/conftest.py (skipped without SeaweedFS's weed)


@s3
def test_s3_bytes_and_json(s3_root):
    uri = objectstore.join(s3_root, "a", "obj.bin")
    objectstore.write_bytes(uri, b"first version, long")
    objectstore.write_bytes(uri, b"second")
    assert objectstore.read_bytes(uri) == b"second"
    assert objectstore.exists(uri)
    objectstore.write_json(objectstore.join(s3_root, "state.json"), {"step": 3, "cursors": [1, 2]})
    assert objectstore.read_json(objectstore.join(s3_root, "state.json")) == {"cursors": [1, 2], "step": 3}
    with pytest.raises(StorageError, match="not found") as info:
        objectstore.read_bytes(objectstore.join(s3_root, "missing.bin"))
    assert f"{s3_root}/missing.bin" in str(info.value)
    objectstore.remove(objectstore.join(s3_root, "a"))
    assert not objectstore.exists(uri)


@pytest.mark.integration  # waits out an outage on purpose: not the edit loop's
@s3
def test_s3_outage_is_ridden_out_then_named(s3_root, s3_server, monkeypatch, caplog):
    """An object store that stops answering is retried with backoff (YATTFLOW_STORAGE_RETRY_S): reads,
    writes and a dataset's row group go through once it is back; past the limit the error names the
    s3:// URI, not the HTTP endpoint."""
    import threading
    import time

    import pyarrow as pa

    table_uri = objectstore.join(s3_root, "data")
    datasets.write_table(table_uri, pa.table({"prompt_id": [1, 2], "prompt": ["a", "b"], "answer": ["1", "2"]}), datasets.PROMPTS)
    uri = objectstore.join(s3_root, "state.json")
    objectstore.write_json(uri, {"step": 1})
    reader = datasets.PromptReader(table_uri, datasets.PROMPTS)
    monkeypatch.setenv("YATTFLOW_STORAGE_RETRY_S", "60")
    s3_server.stop()
    back = threading.Timer(4.0, s3_server.start)
    back.start()
    started = time.monotonic()
    try:
        assert objectstore.read_json(uri) == {"step": 1}
        objectstore.write_json(uri, {"step": 2})
        assert [r["prompt"] for r in reader.rows([0, 1])] == ["a", "b"]
    finally:
        back.join()
    assert 3.5 < time.monotonic() - started < 60
    assert objectstore.read_json(uri) == {"step": 2}
    assert any("does not answer" in r.getMessage() and uri in r.getMessage() for r in caplog.records)

    monkeypatch.setenv("YATTFLOW_STORAGE_RETRY_S", "1")
    s3_server.stop()
    try:
        with pytest.raises(StorageError, match=rf"^{uri}: read failed: the object store did not answer for 1s") as info:
            objectstore.read_json(uri)
        assert "127.0.0.1" not in str(info.value)  # the URI, not the HTTP endpoint

        # the stop line of a run that failed on the outage (an engine host's error) reads where the run stands
        # for objectstore.ON_THE_WAY_OUT_S, not another YATTFLOW_STORAGE_RETRY_S, and names what it could not read
        from engines.config import load_config
        from flows import stops

        class FromHost(RuntimeError):
            remote = ("StorageError", f"{s3_root}/runs/r/steps/000002/rollouts/group=0/part-000.parquet: write failed")

        monkeypatch.setenv("YATTFLOW_STORAGE_RETRY_S", "180")
        monkeypatch.setattr(objectstore, "ON_THE_WAY_OUT_S", 1.0)
        config = load_config(None, [f"storage.root={s3_root}", "name=r"])
        started = time.monotonic()
        try:
            raise FromHost
        except FromHost:
            where = stops.where_it_stopped(config)
        assert time.monotonic() - started < 10
        assert where.startswith(f"where the run stands is unknown: {s3_root}/runs/r/state.json: exists failed: the object "
                                "store did not answer for 1s"), where
        assert "127.0.0.1" not in where
    finally:
        s3_server.start()


@s3
def test_s3_list_files(s3_root):
    for name in ["b.parquet", "a.parquet", "c.txt"]:
        objectstore.write_bytes(objectstore.join(s3_root, "d", name), b"x")
    objectstore.write_bytes(objectstore.join(s3_root, "d", "sub", "deep.parquet"), b"x")
    folder = objectstore.join(s3_root, "d")
    assert objectstore.list_files(folder, suffix=".parquet") == [f"{folder}/a.parquet", f"{folder}/b.parquet"]
    assert objectstore.list_files(f"{folder}/c.txt") == [f"{folder}/c.txt"]
    with pytest.raises(StorageError, match="not found"):
        objectstore.list_files(objectstore.join(s3_root, "nope"))


@s3
def test_s3_table_round_trip(s3_root):
    uri = objectstore.join(s3_root, "rollouts.parquet")
    datasets.write_table(uri, rollouts_table(5), ROLLOUTS)
    back = datasets.read_table(uri, ROLLOUTS)
    assert back.equals(datasets.check_schema(rollouts_table(5), ROLLOUTS, "expected"))

    folder = objectstore.join(s3_root, "train")
    for part, ids in [("part-001", [3, 4]), ("part-000", [1, 2]), ("part-002", [5])]:
        datasets.write_table(objectstore.join(folder, f"{part}.parquet"), prompts_table(ids), PROMPTS)
    assert datasets.read_table(folder, PROMPTS).column("prompt_id").to_pylist() == [1, 2, 3, 4, 5]

    with pytest.raises(SchemaError) as info:
        datasets.write_table(objectstore.join(s3_root, "bad.parquet"), pa.table({"prompt_id": [1]}), PROMPTS)
    assert "bad.parquet" in str(info.value) and "'prompt'" in str(info.value)


@s3
def test_s3_model_folder_upload_and_download(s3_root, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    local = helpers.save_tiny_model(tmp_path / "model", hidden_size=32, num_layers=1, seed=5)
    (tmp_path / "model" / "extra").mkdir()
    (tmp_path / "model" / "extra" / "notes.txt").write_text("nested files travel too")
    uri = objectstore.join(s3_root, "models", "policy")
    objectstore.upload_folder(local, uri)
    manifest = objectstore.read_json(objectstore.join(uri, "MANIFEST.json"))
    assert "config.json" in manifest["files"] and "extra/notes.txt" in manifest["files"]

    cache = tmp_path / "cache"
    path = objectstore.local_folder(uri, cache_dir=str(cache))
    assert path.startswith(str(cache))
    assert sorted(os.listdir(path)) == sorted(set(os.listdir(local)) | {"MANIFEST.json"})
    assert open(os.path.join(path, "extra", "notes.txt")).read() == "nested files travel too"
    assert not [p for p in os.listdir(os.path.dirname(path)) if ".tmp-" in p]  # no half downloads left

    original = AutoModelForCausalLM.from_pretrained(local)
    loaded = AutoModelForCausalLM.from_pretrained(path)
    for (name, a), (_, b) in zip(original.named_parameters(), loaded.named_parameters()):
        assert torch.equal(a, b), name
    assert AutoTokenizer.from_pretrained(path)("12+3=").input_ids == AutoTokenizer.from_pretrained(local)("12+3=").input_ids

    # a committed download is reused: the cache answers even once the remote copy is gone
    objectstore.remove(uri)
    assert objectstore.local_folder(uri, cache_dir=str(cache)) == path
    with pytest.raises(StorageError, match="folder not found"):
        objectstore.local_folder(objectstore.join(s3_root, "models", "missing"), cache_dir=str(cache))


@s3
def test_s3_commit_checkpoint_keeps_last(s3_root):
    check_keep_last(objectstore.join(s3_root, "runs", "demo"))


@s3
def test_s3_check_reachable(s3_root, s3_server, s3_env):
    objectstore.check_reachable(s3_root)
    assert files_under(s3_root) == []  # the probe was removed

    s3_env(s3_server.env(AWS_SECRET_ACCESS_KEY="wrong-secret"))
    with pytest.raises(StorageError) as info:
        objectstore.check_reachable(s3_root)
    assert f"storage root {s3_root} " in str(info.value)

    s3_env(s3_server.env(AWS_ACCESS_KEY_ID="unknown-key"))
    with pytest.raises(StorageError) as info:
        objectstore.check_reachable(s3_root)
    assert f"storage root {s3_root} " in str(info.value)

    closed = helpers.free_port()
    s3_env(s3_server.env(AWS_ENDPOINT_URL_S3=f"http://127.0.0.1:{closed}"))
    with pytest.raises(StorageError) as info:
        objectstore.check_reachable(s3_root)
    assert f"storage root {s3_root} " in str(info.value) and str(closed) in str(info.value)


# ---------------------------------------------------------------- the run lease (storage/lease.py), local and S3


@pytest.fixture(params=["local", pytest.param("s3", marks=s3)])
def run_root(request, tmp_path):
    """A run folder on a local folder, then on the real S3 server."""
    if request.param == "local":
        return uri_of(tmp_path / "runs" / "r")
    return objectstore.join(request.getfixturevalue("s3_root"), "runs", "r")


def test_update_json_lets_exactly_one_of_racing_writers_create(run_root):
    """The compare-and-swap under the lease: 8 threads create the same object at once; one wins,
    the others see the winner's object (flock locally, If-None-Match on S3)."""
    uri = objectstore.join(run_root, "lease.json")
    barrier, results = threading.Barrier(8), []

    def take(i: int) -> None:
        barrier.wait()
        results.append(objectstore.update_json(uri, lambda current: {"holder": i} if current is None else None))

    threads = [threading.Thread(target=take, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({r["holder"] for r in results}) == 1 and objectstore.read_json(uri) == results[0]
    # and an update that reads-then-writes never loses one: 8 increments make 8
    objectstore.write_json(uri, {"n": 0})
    threads = [threading.Thread(target=objectstore.update_json, args=(uri, lambda c: {"n": c["n"] + 1})) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert objectstore.read_json(uri) == {"n": 8}


def test_second_holder_is_refused_naming_the_first_then_takes_the_released_lease(run_root):
    first, second = Lease(run_root, ttl_s=30, flow_run_id="flow-run-1"), Lease(run_root, ttl_s=30, flow_run_id="flow-run-2")
    first.acquire()
    with pytest.raises(RunInUse) as refused:
        second.acquire()
    message = str(refused.value)
    assert "flow run flow-run-1" in message and socket.gethostname() in message and f"pid {os.getpid()}" in message
    assert "since 20" in message and "run.on_conflict=wait" in message
    first.verify()
    first.release()
    second.acquire()  # released: free at once
    with pytest.raises(LeaseLost):
        first.verify()
    second.release()


def test_waiting_holder_takes_the_lease_when_the_first_releases_it(run_root):
    first, second = Lease(run_root, ttl_s=30), Lease(run_root, ttl_s=30)
    first.acquire()
    notes = []
    releaser = threading.Timer(1.5, first.release)
    releaser.start()
    started = time.monotonic()
    second.acquire(wait=True, on_wait=notes.append, poll_s=0.2)
    assert time.monotonic() - started >= 1.4 and notes and "waiting for run held by a process" in notes[0]
    second.verify()
    second.release()


def test_dead_holders_lease_is_taken_over(run_root):
    """A holder on another machine that stopped renewing: its lease expires after ``ttl_s``. A holder
    on this machine whose process is gone (SIGKILL): taken over at once."""
    uri = objectstore.join(run_root, "lease.json")
    elsewhere = {"id": "x", "flow_run_id": "gone-1", "hostname": "another-node", "pid": 1}
    expires = time.time() + 5.0  # room for a slow S3 round trip on a loaded machine (1 s was seen to pass in CI)
    objectstore.write_json(uri, {"holder": elsewhere, "since": "2026-11-25T00:00:00+00:00",
                                 "expires_at": expires, "released": False})
    with pytest.raises(RunInUse, match="flow run gone-1 on host another-node"):
        Lease(run_root, ttl_s=30).acquire()
    time.sleep(max(0.0, expires - time.time()) + 0.2)
    taker = Lease(run_root, ttl_s=30)
    taker.acquire()
    assert "gone-1" in objectstore.read_json(uri)["took_over"]
    taker.release()

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    here = {"id": "y", "flow_run_id": "gone-2", "hostname": socket.gethostname(), "pid": dead.pid}
    objectstore.write_json(uri, {"holder": here, "since": "2026-11-25T00:00:00+00:00",
                                 "expires_at": time.time() + 3600, "released": False})
    taker = Lease(run_root, ttl_s=30)
    taker.acquire()
    assert "gone-2" in objectstore.read_json(uri)["took_over"]
    taker.release()


def test_holder_whose_lease_was_taken_over_stops(run_root):
    """A holder that could not renew in time (paused, storage down) finds another run holds the
    lease: renewing and verifying before a commit both raise LeaseLost."""
    slow = Lease(run_root, ttl_s=30)
    slow.acquire()
    uri = objectstore.join(run_root, "lease.json")
    objectstore.update_json(uri, lambda current: current | {"expires_at": time.time() - 1})  # it missed its renewals
    taker = Lease(run_root, ttl_s=30, flow_run_id="the-taker")
    taker.acquire()
    with pytest.raises(LeaseLost, match="the-taker"):
        slow.renew()
    with pytest.raises(LeaseLost):
        slow.verify()
    slow.release()  # gives back nothing: the lease is the taker's
    taker.verify()
    taker.release()


def test_holder_renews_its_lease_before_it_expires(run_root):
    lease = Lease(run_root, ttl_s=3.0)
    lease.acquire()
    time.sleep(4.5)  # longer than the lease: the renewer thread (every 1 s) kept it
    lease.verify()
    assert objectstore.read_json(lease.uri)["expires_at"] > time.time()
    lease.release()


@pytest.mark.integration  # waits out an outage on purpose: not the edit loop's
@s3
def test_a_lease_outlives_an_outage_longer_than_itself(s3_root, s3_server, monkeypatch):
    """S3 stops answering for longer than the lease (less than the store's retries): the holder's renewal
    waits it out and, nobody having taken the lease meanwhile, extends it; the holder still holds the run.
    (A run that took the lease over while it was out wins: test_holder_whose_lease_was_taken_over_stops.)
    Before, the lease that ran out was never extended again, and the run stopped with LeaseLost at its next
    checkpoint: an outage of more than about two thirds of run.lease_s (60 s) stopped a run that the
    object store's retries (180 s) would have carried."""
    monkeypatch.setenv("YATTFLOW_STORAGE_RETRY_S", "60")
    lease = Lease(objectstore.join(s3_root, "runs", "r"), ttl_s=2.0)
    lease.acquire()
    s3_server.stop()
    try:
        time.sleep(3.0)  # the lease runs out; the renewer (every 0.7 s) waits on the store
    finally:
        s3_server.start()
    lease.verify()
    deadline = time.time() + 20  # the renewer's store call retries with a back-off: it sees the store back within it
    while objectstore.read_json(lease.uri)["expires_at"] <= time.time():
        assert time.time() < deadline, "the lease was not extended after the outage"
        time.sleep(0.2)
    assert lease.lost is None
    lease.release()
    assert objectstore.read_json(lease.uri)["released"]


@s3
def test_giving_a_lease_back_waits_briefly_for_a_store_that_does_not_answer(s3_root, s3_server, monkeypatch, caplog):
    """On the way out of a run that failed on storage (or was stopped during an outage), release waits
    objectstore.ON_THE_WAY_OUT_S, not the store's whole retry time, and does not raise over the run's own error: the
    lease expires by itself."""
    monkeypatch.setenv("YATTFLOW_STORAGE_RETRY_S", "180")
    monkeypatch.setattr(objectstore, "ON_THE_WAY_OUT_S", 2.0)
    lease = Lease(objectstore.join(s3_root, "runs", "r"), ttl_s=3.0)
    lease.acquire()
    s3_server.stop()
    try:
        time.sleep(1.5)  # the renewer (every second) is waiting on the store
        started = time.monotonic()
        lease.release()
        took = time.monotonic() - started
    finally:
        s3_server.start()
    assert took < 2 * objectstore.ON_THE_WAY_OUT_S + 3
    assert any("not released" in r.getMessage() and lease.uri in r.getMessage() for r in caplog.records)
    assert not objectstore.read_json(lease.uri).get("released")  # it expires by itself
