"""The streaming rollout lane (rollout.mode=stream, engines/host/stream.py): samples continued across
weight updates keep each token's version and log-probability, the correction works per token on
them, groups are handed in prompt order, and a whole run streams through the real flows, Prefect
server and engine hosts (timing-stub engines with long-tailed responses)."""

from __future__ import annotations

import copy
import math
import time

import pytest
import torch

from engines.backends.base import TrainBatch
from engines.backends.stub.engines import TimingStubGenerator
from engines.config.sections import RolloutConfig
from engines.host import offpolicy
from engines.host.prompts import PromptStream
from engines.host.stream import StreamLane
from engines.rl.grpo import GRPOConfig
from tests.helpers import (STUBS, TINY, random_batch, run_until_healed, save_tiny_model, taken_prompts, trained_once,
                           with_old_logprobs)


def prompt_at(i: int) -> dict:
    return {"prompt_id": i, "prompt": f"{i % 10}+{i % 7}=", "answer": str(i % 10 + i % 7), "prompt_row": i}


class _Train:
    old_policy, off_policy_correction, tis_cap, mis_low, mis_high = "decoupled", "tis", 1.5, 0.5, 2.0


def test_a_sample_continued_under_three_versions_keeps_each_tokens_and_is_corrected_per_token(tmp_path):
    """Real torch engines: the lane's segments run under versions 0, 1 and 2 of the policy (a train
    step and a weight sync between two segments). Each token's recorded behaviour log-prob is the
    one the trainer computes for it under the version the token is labelled with, and decoupled
    TIS weights each token by its own version: min(pi_old / mu_version(t), C)."""
    from engines.backends.torch.generator import TorchGenerator
    from engines.backends.torch.trainer import TorchTrainer

    model_dir = save_tiny_model(tmp_path / "policy", seed=3)
    trainer, generator = TorchTrainer(model_dir, lr=3e-2), TorchGenerator(model_dir)
    weights = offpolicy.RolloutWeights()
    ro = RolloutConfig(mode="stream", max_staleness=3, samples_per_prompt=4, max_new_tokens=6, segment_tokens=2)
    lane = StreamLane(generator, weights, prompt_at, list, ro, slots=4, room=1, seed=lambda n: 100 + n)
    lane._draw()
    snapshots = []
    for version in range(3):  # one segment per version, then a train step and its sync
        snapshots.append(copy.deepcopy(trainer.model.state_dict()))
        lane._segment([s for s in lane.groups[0].samples if not s.done])
        batch = with_old_logprobs(random_batch(4, seed=version), trainer.logprobs(random_batch(4, seed=version)))
        trainer.train_step(batch, GRPOConfig(), minibatches=1)
        weights.sync(generator, trainer.version, trainer.export_weights())
    samples = [s for s in lane.groups[0].samples if sorted(set(s.versions)) == [0, 1, 2]]
    assert samples, [s.versions for s in lane.groups[0].samples]  # at least one ran 5-6 tokens without ending
    assert all(s.done for s in samples)  # three segments of 2: at max_new_tokens
    for s in lane.groups[0].samples:  # a finished response's text is its whole ids decoded, not its segments' texts joined
        assert not s.done or s.text == generator.tokenizer.decode(s.response_ids, skip_special_tokens=True)
    batch = TrainBatch([s.prompt_ids for s in samples], [s.response_ids for s in samples], [s.logprobs for s in samples],
                       [1.0] * len(samples))
    latest = copy.deepcopy(trainer.model.state_dict())
    under = []  # each version's log-probs of the samples' tokens
    for snapshot in snapshots:
        trainer.model.load_state_dict(snapshot)
        under.append(trainer.logprobs(batch))
    trainer.model.load_state_dict(latest)
    for i, s in enumerate(samples):
        for t, (v, mu) in enumerate(zip(s.versions, s.logprobs)):
            assert mu == pytest.approx(under[v][i][t], abs=2e-4), (s.versions, t)  # labelled with the version that sampled it
        assert any(abs(under[0][i][t] - under[2][i][t]) > 1e-2 for t in range(len(s.versions)))  # the versions differ
    corrected, stats = offpolicy.correct(trainer, batch, _Train)
    own = trainer.logprobs(batch)
    for i, s in enumerate(samples):
        want = [min(math.exp(o - under[v][i][t]), _Train.tis_cap) for t, (o, v) in enumerate(zip(own[i], s.versions))]
        assert corrected.is_weights[i] == pytest.approx(want, abs=1e-3)


def test_an_episode_spans_weight_updates_turn_by_turn(tool_agent):
    """Real torch engines and the calculator (rollout.tools): the lane plays each episode a turn per
    segment, so a weight sync between two turns puts the call under version 0 and the answer under
    version 1. Each sampled token's recorded log-prob is the trainer's under its own version; the
    tool's tokens (mask 0) take their turn's version and are left out of the token figures."""
    from engines.agents.episodes import Episodes
    from engines.backends import chat
    from engines.backends.torch.generator import TorchGenerator
    from engines.backends.torch.trainer import TorchTrainer

    agent = tool_agent
    trainer, generator = TorchTrainer(agent, lr=3e-3, temperature=0.3), TorchGenerator(agent, prompt_format=chat.PromptFormat("auto"))
    ro = RolloutConfig(mode="stream", max_staleness=2, samples_per_prompt=2, max_new_tokens=80, temperature=0.3,
                       tools=["engines.agents.tools:calculator"], max_turns=3)
    weights, play = offpolicy.RolloutWeights(), Episodes(ro, generator.renderer)
    row = {"prompt_id": 0, "prompt": "What is 2+3?", "answer": "5", "prompt_row": 0}
    lane = StreamLane(generator, weights, lambda i: row | {"prompt_id": i}, list, ro, slots=2, room=1, seed=lambda n: n,
                      episodes=play)
    lane._draw()  # (no threads: the segments run here, one by one)
    samples, snapshots = lane.groups[0].samples, []
    for version in range(3):
        snapshots.append(copy.deepcopy(trainer.model.state_dict()))
        for s in samples:
            if s.answer is not None:
                s.answer.result()  # the tool's answer is in before the next turn
        lane._segment([s for s in samples if s.ready()])
        batch = with_old_logprobs(random_batch(4, seed=version), trainer.logprobs(random_batch(4, seed=version)))
        trainer.train_step(batch, GRPOConfig(), minibatches=1)
        weights.sync(generator, trainer.version, trainer.export_weights())
    lane.stop()
    assert all(s.done for s in samples), [s.episode.turns for s in samples]
    rows = lane._rows(lane.groups[0])
    call = [r for r in rows if r["tool_calls"] == 1 and r["turns"] == 2]
    assert call, [(r["turns"], r["tool_calls"]) for r in rows]  # the well-formed call: the answer a turn later
    for r in call:
        first = r["loss_mask"].index(0)
        second = first + r["loss_mask"][first:].index(1)
        assert set(r["token_versions"][:second]) == {0} and set(r["token_versions"][second:]) == {1}, r["token_versions"]
    batch = TrainBatch([r["prompt_ids"] for r in rows], [r["response_ids"] for r in rows], [r["logprobs"] for r in rows],
                       [0.0] * len(rows), loss_mask=[r["loss_mask"] for r in rows])
    latest, under = copy.deepcopy(trainer.model.state_dict()), []
    for snapshot in snapshots:
        trainer.model.load_state_dict(snapshot)
        under.append(trainer.logprobs(batch))
    trainer.model.load_state_dict(latest)
    for i, r in enumerate(rows):
        for t, (v, m) in enumerate(zip(r["token_versions"], r["loss_mask"])):
            if m:
                assert r["logprobs"][t] == pytest.approx(under[v][i][t], abs=1e-4), (r["token_versions"], t)
    assert max(abs(under[0][i][t] - under[1][i][t]) for i, r in enumerate(call) for t in range(len(r["loss_mask"]))
               if r["loss_mask"][t]) > 1e-3  # the versions differ
    _, stats = offpolicy.staleness(2, rows)
    sampled = sum(sum(r["loss_mask"]) for r in rows)
    assert stats["token_staleness_mean"] == pytest.approx(
        sum(2 - v for r in rows for v, m in zip(r["token_versions"], r["loss_mask"]) if m) / sampled)


def long_tail_lane(partial: str, room: int = 8, k: int = 2) -> tuple[StreamLane, offpolicy.RolloutWeights, TimingStubGenerator]:
    ro = RolloutConfig(backend="stub", mode="stream", partial=partial, max_staleness=k, samples_per_prompt=4,
                       max_new_tokens=64, segment_tokens=8)
    generator, weights = TimingStubGenerator("unused", 3e-4, long_tail=64), offpolicy.RolloutWeights()
    scored = lambda rows: [row | {"reward": float(len(row["response_ids"]) > 8)} for row in rows]  # noqa: E731
    return StreamLane(generator, weights, prompt_at, scored, ro, slots=16, room=room, seed=lambda n: n), weights, generator


@pytest.mark.parametrize("partial", ["continue", "abort"])
def test_the_lane_hands_finished_groups_across_weight_updates_each_prompt_once(partial):
    lane, weights, generator = long_tail_lane(partial, k=8)
    cursor, ahead, seen, mixed = 0, [], [], 0
    try:
        for step in range(8):
            rows, scored, cursor, ahead, dropped = lane.take(cursor, ahead, 4, step, 0)
            assert dropped == 0 and len(rows) == 16
            assert [r["reward"] for r in scored] == [float(len(r["response_ids"]) > 8) for r in rows]
            seen += [r["prompt_id"] for r in rows[::4]]
            assert [r["sample_index"] for r in rows] == [0, 1, 2, 3] * 4
            for r in rows:
                assert len(r["token_versions"]) == len(r["response_ids"]) == len(r["logprobs"])
                assert r["policy_version"] == min(r["token_versions"]) <= step
            mixed += sum(len(set(r["token_versions"])) > 1 for r in rows)
            weights.sync(generator, step + 1, [("stub.weights", torch.zeros(4))])
            time.sleep(0.05)  # a train step's time: the lane generates meanwhile
        figures = lane.figures
    finally:
        lane.stop()
    assert len(seen) == len(set(seen)) == 32 and sorted(seen) == sorted(set(range(cursor)) | set(ahead))  # each once
    assert seen != sorted(seen)  # a straggler's group was taken after later ones (it held no step up)
    if partial == "continue":
        assert mixed > 0  # long responses continued under newer weights
    else:
        assert mixed == 0 and figures.restarted > 0  # each started again under the new weights instead
    assert len(lane.groups) <= 8  # never more than two steps' groups drawn and not taken


def test_a_group_older_than_max_staleness_is_dropped_and_counted():
    lane, weights, generator = long_tail_lane("continue", room=4, k=1)
    try:
        _, _, cursor, ahead, _ = lane.take(0, [], 1, 0, 0)
        time.sleep(0.3)  # the lane finishes the next prompts under version 0
        for version in (1, 2, 3):
            weights.sync(generator, version, [("stub.weights", torch.zeros(4))])
        rows, _, cursor, ahead, dropped = lane.take(cursor, ahead, 2, 3, 0)  # the trainer at version 3: version 0's are 3 behind
    finally:
        lane.stop()
    assert dropped >= 1 and len(range(cursor)) + len(ahead) == 1 + 2 + dropped
    assert all(3 - r["policy_version"] <= 1 for r in rows)
    assert lane.figures.stale_dropped == dropped


def test_a_streaming_run_killed_resumes_with_no_prompt_trained_twice_or_skipped(prepared, tmp_path):
    """Timing stubs with long-tailed responses at dp=2, each group two ranks with a rollout replica
    and a judge each (placement.mode=partial): two lanes a group, each drawing every other prompt.
    kill -9 of the run as step 3 trains, then of a host as step 4 generates (the run heals itself). The same command run again finishes; each
    group's rollouts took every prompt before its cursor, and those its checkpoint lists beyond it,
    exactly once (a straggler's group taken after later ones), no prompt was trained in two steps,
    and staleness stayed within k."""
    import signal
    from pathlib import Path

    from storage.runstate import RunState

    fired = tmp_path / "fired"
    fired.mkdir()
    args = TINY + STUBS + [
        f"storage.root={prepared}", "name=streaming", "steps=6", "dp=2", "checkpoint.every=2", "rollout.mode=stream",
        "rollout.max_staleness=8", "placement.stream_chunk=2", "rollout.stub_lengths=long_tail", "rollout.max_new_tokens=64",
        "rollout.segment_tokens=4", "train.tensor_parallel=2", "rollout.replicas=2", "judge.replicas=2", "placement.mode=partial",
        "train.old_policy=decoupled", "train.off_policy_correction=tis", "data.heldout=null",
        "retries.run=2", "timeouts.stage_s=60", "run.lease_s=10",
        "rollout.stub_seconds_per_token=0.01", "train.stub_seconds_per_token=0.002"]
    codes, run, history = run_until_healed(args, "train_step@3:dp-0:kill-run,rollout_and_score@4:dp-1:kill", fired, 400)
    assert codes == [-signal.SIGKILL, 0], run.stderr[-3000:]
    assert len(list(fired.iterdir())) == 2  # both faults happened
    run_dir = Path(prepared) / "runs" / "streaming"
    state = RunState.load(str(run_dir))
    assert state.step == 5
    steps = sorted((run_dir / "steps").iterdir())
    assert [int(s.name) for s in steps] == list(range(6))
    for g in (0, 1):
        assert state.cursors[g] >= 8  # past prompts of both rollout replicas' lanes (each draws every other prompt)
        ahead = state.sampling[g]["ahead"]
        want = [r["prompt_id"] for r in PromptStream(str(Path(prepared) / "data" / "train"), g, 2).wave(0, max([state.cursors[g], *ahead]) + 1)]
        assert sorted(taken_prompts(steps, g)) == sorted(want[: state.cursors[g]] + [want[i] for i in ahead])  # each once, none skipped
    trained_once(steps, (0, 1))
    for m in history:
        assert max(map(int, m["staleness"])) <= 8 and m["stale_dropped"] == 0, m["staleness"]
    # Whether a sample here continues across a weight update is the CPU's timing (a lane that ran ahead
    # and filled its room has nothing in flight at a sync): the lane tests above check that it does.


def test_the_config_refuses_a_stream_without_staleness_or_where_it_is_not_wired(tmp_path):
    from engines.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="rollout.mode=stream with rollout.max_staleness=0"):
        load_config(None, ["rollout.mode=stream"])
    with pytest.raises(ConfigError, match="rollout.replicas=2 and judge.replicas=1: each rollout replica's lane scores"):
        load_config(None, ["rollout.mode=stream", "rollout.max_staleness=2", "train.fsdp=2", "rollout.replicas=2",
                           "placement.stream_chunk=8"])
    assert not load_config(None, ["rollout.mode=stream", "rollout.max_staleness=2"]).rollout.overlapped
