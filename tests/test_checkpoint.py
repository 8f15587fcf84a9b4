"""Asynchronous checkpoints and retention.

- The engine host's ``checkpoint`` copies the training state into host memory and a thread
  writes the copy: the files hold the state at save time even when training changed the
  live parameters, Adam moments and RNG before the writer read them.
- Retention keeps the newest ``keep_last`` committed checkpoints and every ``keep_every``-th.
- A run whose engine hosts are killed (SIGKILL) mid-write leaves that checkpoint without a
  manifest and ``state.json`` at the previous one, and running it again resumes from there.
"""

from __future__ import annotations

import copy
import json
import os
import random
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import random_batch, save_tiny_model, with_old_logprobs

from engines.host.checkpointing import Checkpoints
from engines.wire.commands import Checkpoint, CheckpointWait
from engines.backends.torch.trainer import TorchTrainer, copy_state
from engines.host.worker import Worker
from engines.config import ConfigError, RunConfig, load_config
from storage import objectstore, runstate
from storage.runstate import RunState

ROOT = Path(__file__).resolve().parents[1]


def assert_same(a, b, path="state") -> None:
    """Nested states equal exactly (tensors bit for bit)."""
    assert type(a) is type(b) or (isinstance(a, dict) and isinstance(b, dict)), path
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


def live_state(trainer: TorchTrainer) -> dict:
    return copy.deepcopy({"model": trainer.model.state_dict(), "optimizer": trainer.optimizer.state_dict(), "version": trainer.version})


def train_once(trainer: TorchTrainer, seed: int) -> None:
    batch = random_batch(6, seed=seed)
    trainer.train_step(with_old_logprobs(batch, trainer.logprobs(batch), noise=0.3, seed=seed), minibatches=2)


# ---------------------------------------------------------------- copy_state


def test_copy_state_is_independent_keeps_ties_and_reuses_buffers():
    weight = torch.randn(4, 3)
    state = {"model": {"a": weight, "tied": weight.detach(), "b": torch.arange(5.0)}, "step": 3, "betas": (0.9, 0.99),
             "groups": [{"params": [0, 1], "lr": 1e-3}]}
    first = copy_state(state)
    assert_same(first, state)
    assert first["model"]["a"] is first["model"]["tied"]  # tied weights stay one tensor
    assert first["model"]["a"].data_ptr() != weight.data_ptr()
    weight.add_(1.0)  # the live state moves on ...
    assert not torch.equal(first["model"]["a"], weight)  # ... the copy does not
    kept = {k: v for k, v in first["model"].items()}
    second = copy_state(state, into=first)
    assert_same(second, state)
    assert all(second["model"][k] is kept[k] for k in kept)  # copied into the earlier copy's tensors
    state["model"]["b"] = torch.arange(6.0)  # another shape: a new tensor
    third = copy_state(state, into=second)
    assert third["model"]["b"].shape == (6,) and third["model"]["b"] is not kept["b"]


# ---------------------------------------------------------------- the host's checkpoint command


@pytest.fixture
def host(tmp_path):
    """An engine host's worker with a torch trainer on a tiny model, without the rest of ``setup_engines``."""
    torch.set_num_threads(1)
    h = Worker(rank=0, world=1, threads=1, config=RunConfig.model_validate({"dp": 1}),
               trainer=TorchTrainer(save_tiny_model(tmp_path / "model"), lr=1e-2),
               checkpoints=Checkpoints(0, "torch", [["part-00000.parquet", 8]]))
    train_once(h.trainer, seed=1)  # Adam moments exist
    return h


def read_checkpoint(uri: str) -> dict:
    local = Path(objectstore.fs_for(uri)[1])
    return {
        "trainer": torch.load(local / "trainer-torch" / "trainer.pt", weights_only=True),
        "hf": load_file(str(local / "model" / "model.safetensors")),
        "rng": torch.load(local / "rng-0.pt", weights_only=True),
        "prompts": json.loads((local / "prompts.json").read_text()),
    }


def test_async_checkpoint_holds_the_state_at_save_time(host, tmp_path, monkeypatch):
    """The writer is held until a train step (in-place updates of parameters and Adam moments)
    and RNG draws have run: the files still hold the state of the moment ``checkpoint`` returned."""
    trainer = host.trainer
    entered, release = threading.Event(), threading.Event()
    real_save = trainer.save_checkpoint

    def held_save(*args, **kwargs):
        entered.set()
        assert release.wait(60)
        return real_save(*args, **kwargs)

    monkeypatch.setattr(trainer, "save_checkpoint", held_save)
    for n, seed in enumerate((2, 3)):  # the second one copies into the first one's buffers
        uri = objectstore.normalize(str(tmp_path / f"ckpt-{n}"))
        expected = live_state(trainer)
        rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
        entered.clear(), release.clear()
        staged_before = trainer._staged
        reply = save(host, uri)
        assert reply["asynchronous"] and reply["files"] is None and reply["stall_s"] < 5
        if staged_before is not None:
            assert all(trainer._staged["model"][k] is staged_before["model"][k] for k in expected["model"])
        assert entered.wait(60)  # the writer runs, and is held before it serialises anything
        train_once(trainer, seed=seed)  # changes the live state in place
        torch.rand(3), random.random()
        after = live_state(trainer)
        assert not torch.equal(after["model"]["lm_head.weight"], expected["model"]["lm_head.weight"])
        release.set()
        done = wait(host)
        assert done["uri"] == uri and done["wait_s"] >= 0 and done["write_s"] > 0
        assert {"trainer-torch/trainer.pt", "model/model.safetensors", "model/config.json", "prompts.json", "rng-0.pt"} <= set(done["files"])
        saved = read_checkpoint(uri)
        assert_same(saved["trainer"], expected)  # model, Adam moments and step counts, version: save time
        assert_same(saved["hf"], {k: v for k, v in expected["model"].items()})
        assert torch.equal(saved["rng"]["torch"], rng["torch"]) and saved["rng"]["python"] == rng["python"]
        assert saved["prompts"] == {"files": host.checkpoints.prompt_files}
        assert wait(host)["files"] is None  # collected once
    # the first checkpoint's files were not touched by the second (which reused its buffers)
    assert read_checkpoint(objectstore.normalize(str(tmp_path / "ckpt-0")))["trainer"]["version"] == 1


def test_resume_from_an_async_checkpoint_continues_exactly(host, tmp_path):
    uri = objectstore.normalize(str(tmp_path / "ckpt"))
    save(host, uri)
    wait(host)
    train_once(host.trainer, seed=5)
    other = TorchTrainer(save_tiny_model(tmp_path / "fresh", seed=9), lr=1e-2)
    host.checkpoints.load(other, uri)
    train_once(other, seed=5)
    assert_same(live_state(other), live_state(host.trainer))


def save(worker: Worker, uri: str) -> dict:
    return worker.checkpoint(Checkpoint(uri=uri)).model_dump()


def wait(worker: Worker) -> dict:
    return worker.checkpoint_wait(CheckpointWait()).model_dump()


def test_sync_checkpoint_writes_before_it_returns(host, tmp_path):
    host.config = RunConfig.model_validate({"dp": 1, "checkpoint": {"asynchronous": False}})
    uri = objectstore.normalize(str(tmp_path / "ckpt"))
    expected = live_state(host.trainer)
    reply = save(host, uri)
    assert not reply["asynchronous"] and "trainer-torch/trainer.pt" in reply["files"]
    assert_same(read_checkpoint(uri)["trainer"], expected)
    assert host.trainer._staged is None  # no host-memory copy is kept in synchronous mode
    assert wait(host)["files"] is None


def test_a_failed_background_write_fails_checkpoint_wait(host, tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(host.trainer, "save_checkpoint", broken)
    uri = objectstore.normalize(str(tmp_path / "ckpt"))
    save(host, uri)
    with pytest.raises(RuntimeError, match="checkpoint write to .*ckpt failed") as failed:
        wait(host)
    assert isinstance(failed.value.__cause__, OSError)
    assert not objectstore.exists(objectstore.join(uri, "MANIFEST.json"))


# ---------------------------------------------------------------- retention


def test_retained_steps():
    assert runstate.retained(list(range(10)), keep_last=2) == {8, 9}
    # keep_every counts trained steps from 1, as checkpoint.every does: steps 2, 5, 8 end steps 3, 6, 9
    assert runstate.retained(list(range(10)), keep_last=2, keep_every=3) == {2, 5, 8, 9}
    assert runstate.retained([9, 19, 29, 39, 41], keep_last=1, keep_every=20) == {19, 39, 41}
    assert runstate.retained([], keep_last=2, keep_every=3) == set()


def commit(run_uri: str, step: int, keep_last: int, keep_every: int | None) -> RunState:
    ckpt = runstate.checkpoint_uri(run_uri, step)
    data = f"weights {step}".encode()
    objectstore.write_bytes(objectstore.join(ckpt, "trainer.pt"), data)
    state = RunState(step=step, cursors=[step], checkpoint=ckpt, policy_version=step + 1)
    runstate.commit_checkpoint(run_uri, state, {"trainer.pt": runstate.file_record(data)}, keep_last, keep_every)
    return state


def test_commit_keeps_last_k_and_every_nth(tmp_path):
    run_uri = objectstore.normalize(str(tmp_path / "run"))
    for step in range(0, 12):
        commit(run_uri, step, keep_last=2, keep_every=4)
        kept = [runstate.checkpoint_step(u) for u in runstate.committed_checkpoints(run_uri)]
        assert kept == sorted(runstate.retained(list(range(step + 1)), 2, 4))
    assert kept == [3, 7, 10, 11]
    assert RunState.load(run_uri).checkpoint == runstate.checkpoint_uri(run_uri, 11)
    # the folders retention removed are gone, not just their manifests
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["000003", "000007", "000010", "000011"]


def test_keep_every_must_be_a_multiple_of_every():
    assert load_config(None, ["checkpoint.every=5", "checkpoint.keep_every=20"]).checkpoint.keep_every == 20
    with pytest.raises(ConfigError, match="keep_every=30 is not a multiple of every=20"):
        load_config(None, ["checkpoint.every=20", "checkpoint.keep_every=30"])


def test_discard_uncommitted(tmp_path):
    run_uri = objectstore.normalize(str(tmp_path / "run"))
    for step in (0, 1, 2):
        commit(run_uri, step, keep_last=5, keep_every=None)
    state1 = RunState.load(run_uri)
    state1.step, state1.checkpoint = 1, runstate.checkpoint_uri(run_uri, 1)  # as if state.json of step 2 never landed
    half = runstate.checkpoint_uri(run_uri, 3)  # a write killed half way: no manifest
    objectstore.write_bytes(objectstore.join(half, "rng-0.pt"), b"half")
    removed = runstate.discard_uncommitted(run_uri, state1)
    assert removed == [half]  # step 2's has its manifest: committed (a resume resumes from it), never deleted
    assert [runstate.checkpoint_step(u) for u in runstate.committed_checkpoints(run_uri)] == [0, 1, 2]
    assert runstate.discard_uncommitted(run_uri, None) == []  # nor read as "nothing committed" without a state


# ---------------------------------------------------------------- kill during the write


def _checkpoint_dir(root: str, name: str, step: int) -> Path:
    return Path(root) / "runs" / name / "checkpoints" / f"{step:06d}"


# ---------------------------------------------------------------- Megatron-Core (CPU shim, own process)

MEGATRON_HOST = """
import json, sys
import torch
torch.set_num_threads(1)
from safetensors.torch import load_file
from tests.helpers import random_batch, with_old_logprobs
from engines.host.checkpointing import Checkpoints
from engines.wire.commands import Checkpoint, CheckpointWait
from engines.config import RunConfig
from engines.backends.megatron.trainer import MegatronTrainer
from engines.host.worker import Worker

model_dir, out = sys.argv[1], sys.argv[2]

def host():
    return Worker(rank=0, world=1, threads=1, config=RunConfig.model_validate({"dp": 1, "train": {"backend": "megatron"}}),
                  trainer=MegatronTrainer(model_dir, lr=1e-2), checkpoints=Checkpoints(0, "megatron", [["part-00000.parquet", 8]]))

def step(h, seed):
    b = random_batch(6, seed=seed)
    h.trainer.train_step(with_old_logprobs(b, h.trainer.logprobs(b), noise=0.3, seed=seed))

a = host()
step(a, 1)
before = {k: v.clone() for k, v in a.trainer.export_weights()}
probe = random_batch(4, seed=9)
probe_lp = a.trainer.logprobs(probe)
reply = a.checkpoint(Checkpoint(uri="file://" + out))
step(a, 2)  # while model/ is written in the background
done = a.checkpoint_wait(CheckpointWait())
hf = load_file(out + "/model/model.safetensors")
b = host()
b.checkpoints.load(b.trainer, "file://" + out)
print(json.dumps({
    "reply": {"asynchronous": reply.asynchronous, "files": reply.files}, "files": done.files,
    "hf_at_save_time": hf.keys() == before.keys() and all(torch.equal(hf[k], v) for k, v in before.items()),
    "resumed_version": b.trainer.version, "resumed_logprobs_equal": b.trainer.logprobs(probe) == probe_lp,
}))
"""


@pytest.mark.integration  # a Megatron host in a subprocess: the check tier keeps the torch checkpoints
def test_megatron_host_checkpoint_async(tmp_path):
    """Megatron keeps its ``dist_checkpointing`` save synchronous (a collective) and writes the
    rest — upload, Hugging Face folder from weights copied at save time, RNG — in the background."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    model = save_tiny_model(tmp_path / "model", hidden_size=32, num_layers=2)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "tests" / "megatron_cpu_site"), str(ROOT / "tests"), str(ROOT)]))
    done = subprocess.run([sys.executable, "-c", MEGATRON_HOST, model, str(tmp_path / "ckpt")], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["reply"] == {"asynchronous": True, "files": None}
    files = set(result["files"])
    assert {"trainer-megatron/metadata.json", "model/model.safetensors", "rng-0.pt", "prompts.json"} <= files
    assert result["hf_at_save_time"] and result["resumed_version"] == 1 and result["resumed_logprobs_equal"]
