"""Timing-stub engines (engines/backends/stub/engines.py; for scale benchmarks, not training): the real flows,
tasks, hosts and storage run on them, and the time they sleep is counted as engine time."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pyarrow.parquet as pq

from engines.backends.stub.engines import TimingStubGenerator, TimingStubTrainer
from flows.training import train
from tests.helpers import TINY, assert_steps_completed, random_batch, read_run_tree

from tests.helpers import STUBS


def test_stub_generator_is_deterministic_and_shaped(tmp_path):
    gen = TimingStubGenerator(str(tmp_path), seconds_per_token=0.0)
    a = gen.generate(["12+34=", "50+50="], n=4, max_new_tokens=8, seed=7)
    b = gen.generate(["12+34=", "50+50="], n=4, max_new_tokens=8, seed=7)
    assert [g.response_ids for g in a] == [g.response_ids for g in b]
    assert [g.prompt_index for g in a] == [0, 0, 0, 0, 1, 1, 1, 1]
    for g in a:
        assert 1 <= len(g.response_ids) <= 8 and len(g.logprobs) == len(g.response_ids)
        assert g.response.startswith(("correct", "wrong"))
        assert g.truncated == (g.response_ids[-1] != 2)
    assert len({tuple(g.response_ids) for g in a}) > 1


def test_stub_trainer_surface_and_checkpoint(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    t = TimingStubTrainer(str(tmp_path / "model"), seconds_per_token=0.0)
    metrics = t.train_step(random_batch(6, seed=0), minibatches=2)
    assert set(metrics) == {"loss", "tokens", "grad_norm"} and t.version == 1
    assert t.save_checkpoint(str(tmp_path / "ckpt")) == ["stub_state.json"]
    other = TimingStubTrainer(str(tmp_path / "model"), seconds_per_token=0.0)
    other.load_checkpoint(str(tmp_path / "ckpt"))
    assert other.version == 1 and other.weights == t.weights
    t.save_hf(str(tmp_path / "hf"))
    assert {p.name for p in (tmp_path / "hf").iterdir()} == {"config.json", "STUB_WEIGHTS.json"}


def test_two_steps_dp2_on_stub_engines(prepared):
    """The real training flow on stub engines: every task Completed, checkpoints committed, and
    the stubs' sleep shows up in ``engine_s`` (so ``overhead_s`` = the rest is orchestration)."""
    spt = 0.004  # seconds per token: large enough that the sleep dominates the hosts' own work
    summary = asyncio.run(train(overrides=TINY + STUBS + [
        f"storage.root={prepared}", "name=stubtest", "steps=2", "dp=2", "checkpoint.every=1",
        f"rollout.stub_seconds_per_token={spt}", f"train.stub_seconds_per_token={spt}"]))
    tree = asyncio.run(read_run_tree("stubtest"))
    assert tree["train-stubtest"][0] == "COMPLETED"
    assert_steps_completed(tree, steps=(0, 1), groups=(0, 1), also=("checkpoint dp={g} step={step}",))

    run_dir = Path(prepared) / "runs" / "stubtest"
    assert (run_dir / "final" / "STUB_WEIGHTS.json").exists()
    for m in summary["history"]:
        step_dir = run_dir / "steps" / f"{m['step']:06d}"
        slept = []  # per group: the rollout stub's sleep (its tokens, read back from storage) + the train stub's
        for g in (0, 1):
            rollouts = pq.read_table(step_dir / "rollouts" / f"group={g}").column("response_ids").to_pylist()
            experience = pq.read_table(step_dir / "experience" / f"group={g}")
            trained = sum(len(p) + len(r) for p, r in zip(experience.column("prompt_ids").to_pylist(),
                                                          experience.column("response_ids").to_pylist()))
            slept.append(spt * (sum(len(r) for r in rollouts) + trained))
        # balancing may move rows between groups, so compare with the smaller group's own sleep
        assert m["engine_s"] >= min(slept) > 0.2, (m, slept)
        assert 0 < m["overhead_s"] < m["seconds"]
        assert abs(m["seconds"] - m["engine_s"] - m["overhead_s"]) < 1e-6
