"""Dynamic sampling that adapts: wave sizes from the observed keep ratio, surplus kept groups
carried over to the next step, and the state for both committed with each checkpoint.

- the wave-size rule and the keep-ratio estimate (``flows/sampling.py``);
- the engine host's ``dynamic_filter`` with carry-over (no engines needed: hand-made scored files);
- a real run (Prefect server, engine hosts, dp=2): carried groups are trained in the next step,
  never twice; a run resumed from an earlier checkpoint takes that checkpoint's carry-over and
  keep-ratio estimate and redoes exactly the same batches; no prompt is drawn or trained twice.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from engines.wire.commands import DynamicFilter
from engines.host.worker import Worker
from flows.sampling import GroupSampling, plan_wave, wave_size
from engines.config import ConfigError, RunConfig, load_config
from storage import datasets, objectstore
from storage.runstate import RunState

# ---------------------------------------------------------------- the wave-size rule


@pytest.mark.parametrize(
    "missing, ratio, expected",
    [
        (8, 0.5, 20),  # ceil(8 / 0.5 * 1.2) = ceil(19.2)
        (8, 1.0, 10),  # ceil(9.6)
        (5, 0.25, 24),
        (1, 1.0, 2),  # ceil(1.2)
        (3, 0.05, 64),  # 72 → the cap
        (3, 0.0, 64),  # nothing ever kept: the cap
        (0, 0.5, 1),  # the carry-over filled the batch: one prompt, for fresh samples
        (-2, 0.5, 1),
        (4, None, 16),  # no wave observed yet: prompts_per_wave
        (0, None, 1),
    ],
)
def test_wave_size(missing, ratio, expected):
    assert wave_size(missing, ratio, first=16, oversample=1.2, cap=64) == expected


def test_wave_size_is_exact_at_whole_numbers_and_clips_the_first_wave():
    assert wave_size(2, 0.5, first=16, oversample=1.0, cap=64) == 4  # 2 / 0.5 is 4, not 5
    assert wave_size(3, 0.3, first=16, oversample=1.0, cap=64) == 10  # 3 / 0.3 = 10.000000000000002
    assert wave_size(4, None, first=100, oversample=1.2, cap=64) == 64


def test_keep_ratio_is_a_recency_weighted_pooled_ratio():
    state = GroupSampling()
    assert state.keep_ratio is None
    state.observe(drawn=10, kept=5, decay=0.5)
    assert state.keep_ratio == 0.5
    state.observe(drawn=2, kept=2, decay=0.5)  # a tiny refill wave moves it a little, not to 1.0
    assert state.keep_ratio == pytest.approx((0.5 * 5 + 2) / (0.5 * 10 + 2))
    for _ in range(30):  # old waves fade
        state.observe(drawn=10, kept=1, decay=0.5)
    assert state.keep_ratio == pytest.approx(0.1, abs=1e-6)
    zero = GroupSampling()
    zero.observe(drawn=4, kept=3, decay=0.0)
    zero.observe(drawn=8, kept=2, decay=0.0)  # decay 0: the last wave only
    assert zero.keep_ratio == 0.25


def test_state_round_trips_as_plain_data():
    state = GroupSampling(carry="file:///r/steps/000003/carry/group=1/part-000.parquet", carried=2, kept=3.5, drawn=7.0)
    assert json.loads(json.dumps(state.to_dict())) == state.to_dict()
    assert GroupSampling.from_dict(state.to_dict()) == state
    assert GroupSampling.from_dict(None) == GroupSampling()


def test_plan_wave_fixed_and_adaptive():
    config = load_config(None, ["sampling.prompts_per_wave=16", "sampling.target_groups=8"]).sampling
    assert config.adaptive and config.oversample == 1.2 and config.wave_cap == 64 and config.max_carry_age == 1
    state = GroupSampling()
    assert plan_wave(config, state, have=0) == 16  # the run's first wave
    state.observe(drawn=16, kept=4, decay=0.8)  # keep ratio 0.25
    assert plan_wave(config, state, have=4) == math.ceil(4 / 0.25 * 1.2)
    assert plan_wave(config, state, have=8) == 1
    fixed = load_config(None, ["sampling.adaptive=false"]).sampling
    assert plan_wave(fixed, state, have=4) == plan_wave(fixed, state, have=8) == fixed.prompts_per_wave
    capped = load_config(None, ["sampling.max_prompts_per_wave=10"]).sampling
    assert plan_wave(capped, state, have=0) == 10


@pytest.mark.parametrize("override, field", [("sampling.oversample=0.9", "sampling.oversample"),
                                             ("sampling.max_prompts_per_wave=0", "sampling.max_prompts_per_wave"),
                                             ("sampling.keep_ratio_decay=1", "sampling.keep_ratio_decay"),
                                             ("sampling.max_carry_age=-1", "sampling.max_carry_age")])
def test_bad_sampling_settings_are_named(override, field):
    with pytest.raises(ConfigError, match=f"field '{field}'"):
        load_config(None, [override])


def test_state_json_without_sampling_still_loads(tmp_path):
    uri = objectstore.normalize(str(tmp_path))
    objectstore.write_json(objectstore.join(uri, "state.json"), {"step": 2, "cursors": [4], "checkpoint": None, "policy_version": 6,
                                                                 "heldout_before": None})
    assert RunState.load(uri).sampling == []  # written before carry-over existed: a fresh sampling state


# ---------------------------------------------------------------- the host's filter with carry-over


def scored_table(wave: int, groups: dict[int, list[float]], version: int) -> pa.Table:
    """Scored samples: prompt id → the rewards of its samples."""
    rows = []
    for pid, rewards in groups.items():
        for i, reward in enumerate(rewards):
            rows.append({"prompt_id": pid, "sample_index": i, "policy_version": version, "wave": wave, "prompt": f"{pid}+{pid}=",
                         "answer": str(2 * pid), "prompt_ids": [1, 5, 6], "response": "x", "response_ids": [7, 2],
                         "logprobs": [-0.5, -0.1], "truncated": False, "judge_text": "correct" if reward else "wrong",
                         "genrm_reward": reward, "rule_reward": None, "reward": reward})
    return pa.Table.from_pylist(rows, schema=datasets.SCORED)


class Store:
    def __init__(self, root: Path):
        self.root = objectstore.normalize(str(root))

    def uri(self, step: int, stage: str, wave: int | None = None) -> str:
        return datasets.stage_uri(self.root, step, stage, 0, wave)

    def scored(self, step: int, wave: int, groups: dict[int, list[float]], version: int) -> str:
        uri = self.uri(step, "scored", wave)
        datasets.write_table(uri, scored_table(wave, groups, version), datasets.SCORED)
        return uri

    def ids(self, uri: str, schema=datasets.EXPERIENCE) -> list[int]:
        return list(dict.fromkeys(datasets.read_table(uri, schema).column("prompt_id").to_pylist()))


def filter_host(**sampling) -> Worker:
    return Worker(rank=0, world=1, threads=1, config=RunConfig.model_validate({"dp": 1, "sampling": sampling}))


def run_filter(host: Worker, store: Store, step: int, scored: list[str], target: int, carry_in: str | None) -> dict:
    return host.dynamic_filter(DynamicFilter(step=step, scored=scored, out=store.uri(step, "experience"), target_groups=target,
                                             carry_in=carry_in, carry_out=store.uri(step, "carry"))).model_dump()


MIXED, EQUAL = [1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]


def test_filter_carries_surplus_first_into_the_next_step(tmp_path):
    host, store = filter_host(), Store(tmp_path)
    # step 3: five groups, one with equal rewards; target 2 → 2 trained, 2 carried over
    s3 = store.scored(3, 0, {10: EQUAL, 11: MIXED, 12: MIXED, 13: MIXED, 14: MIXED}, version=6)
    r = run_filter(host, store, 3, [s3], 2, None)
    assert (r["kept"], r["dropped_equal"], r["new_kept"], r["surplus"], r["carried_out"], r["surplus_dropped"]) == (2, 1, 4, 2, 2, 0)
    assert r["enough"] and r["carried_in"] == 0 and r["carry"] == store.uri(3, "carry")
    assert store.ids(store.uri(3, "experience")) == [11, 12]
    carry = datasets.read_table(r["carry"], datasets.CARRY)
    assert store.ids(r["carry"], datasets.CARRY) == [13, 14] and set(carry.column("step").to_pylist()) == {3}
    assert set(carry.column("policy_version").to_pylist()) == {6}

    # step 4: the carried groups come first, then this step's wave; its surplus is carried again
    s4 = store.scored(4, 0, {20: MIXED, 21: MIXED, 22: EQUAL}, version=8)
    r = run_filter(host, store, 4, [s4], 3, r["carry"])
    assert (r["kept"], r["carried_in"], r["new_kept"], r["carried_out"], r["surplus_dropped"]) == (3, 2, 2, 1, 0)
    assert "2 carried over" in r["reason"]
    exp = datasets.read_table(store.uri(4, "experience"), datasets.EXPERIENCE)
    assert store.ids(store.uri(4, "experience")) == [13, 14, 20]
    versions = dict(zip(exp.column("prompt_id").to_pylist(), exp.column("policy_version").to_pylist()))
    assert versions == {13: 6, 14: 6, 20: 8}  # carried samples keep the version (and log-probs) that generated them
    advantages = exp.column("advantage").to_pylist()
    for pid in (13, 14, 20):  # per-group advantages, as for fresh groups
        group = [a for a, p in zip(advantages, exp.column("prompt_id").to_pylist()) if p == pid]
        assert group == pytest.approx([1.0, -1.0, 1.0, -1.0], abs=1e-4)
    assert store.ids(r["carry"], datasets.CARRY) == [21]


def test_filter_drops_groups_too_old_for_the_next_step(tmp_path):
    host, store = filter_host(max_carry_age=1), Store(tmp_path)
    s0 = store.scored(0, 0, {1: MIXED, 2: MIXED, 3: MIXED, 4: MIXED, 5: MIXED}, version=0)
    r = run_filter(host, store, 0, [s0], 1, None)
    assert r["carried_out"] == 4
    # step 1: target 2 takes groups 2 and 3 of step 0; 4 and 5 would be 2 steps old at step 2: dropped;
    # this step's own surplus (group 7) is carried
    s1 = store.scored(1, 0, {6: MIXED, 7: MIXED}, version=2)
    r = run_filter(host, store, 1, [s1], 2, r["carry"])
    assert store.ids(store.uri(1, "experience")) == [2, 3]
    assert (r["carried_in"], r["surplus"], r["carried_out"], r["surplus_dropped"]) == (2, 4, 2, 2)
    assert store.ids(r["carry"], datasets.CARRY) == [6, 7]
    # a retry of step 1 that carries nothing leaves no stale carry-over behind
    r = run_filter(host, store, 1, [s1], 8, store.uri(0, "carry"))
    assert r["carry"] is None and r["carried_out"] == 0 and not objectstore.exists(store.uri(1, "carry"))


def test_a_host_takes_its_own_outputs_as_storage_returns_them_without_reading_them_back(tmp_path, monkeypatch):
    """Issue 68: the filter's scored waves, its carry in the next step: what this host wrote is not read
    back, and it is given what Parquet returns (float32 log-probs), so a host that reads them from storage
    (resumed, healed) filters the same rows; two steps on, they come from storage again."""
    host, store, read_table = filter_host(), Store(tmp_path), datasets.read_table
    reads = []
    monkeypatch.setattr(datasets, "read_table", lambda uri, schema: reads.append(uri) or read_table(uri, schema))
    rows = [r | {"logprobs": [-0.1, -1 / 3]} for r in scored_table(0, {1: MIXED, 2: MIXED, 3: MIXED}, version=0).to_pylist()]
    s0 = store.uri(0, "scored", 0)
    host.written.write(0, s0, rows, datasets.SCORED)
    assert host.written.rows(s0, datasets.SCORED) == read_table(s0, datasets.SCORED).to_pylist() != rows  # float32
    r0 = run_filter(host, store, 0, [s0], 1, None)
    s1 = store.uri(1, "scored", 0)
    host.written.write(1, s1, scored_table(0, {4: MIXED}, version=1).to_pylist(), datasets.SCORED)
    r1 = run_filter(host, store, 1, [s1], 2, r0["carry"])  # the carry of step 0 comes first
    assert reads == [] and store.ids(store.uri(1, "experience")) == [2, 3]
    reads.clear()
    again = run_filter(filter_host(), store, 1, [s1], 2, r0["carry"])  # another host: from storage, the same answer
    assert reads == [r0["carry"], s1] and again == r1
    reads.clear()
    host.written.write(3, store.uri(3, "scored", 0), rows, datasets.SCORED)  # step 3: steps 0 and 1 are let go
    assert host.written.rows(s1, datasets.SCORED) and reads == [s1]


def test_filter_without_carry_over_drops_the_surplus(tmp_path):
    host, store = filter_host(max_carry_age=0), Store(tmp_path)
    s0 = store.scored(0, 0, {1: MIXED, 2: MIXED, 3: MIXED}, version=0)
    r = run_filter(host, store, 0, [s0], 1, None)
    assert (r["kept"], r["surplus"], r["carried_out"], r["surplus_dropped"], r["carry"]) == (1, 2, 0, 2, None)
    assert not objectstore.exists(store.uri(0, "carry"))
    # a carry-over written while max_carry_age was higher is dropped after a resume that lowered it
    carried = store.uri(0, "carry")
    rows = scored_table(0, {9: MIXED}, 0).append_column("step", pa.array([0] * 4, pa.int64()))
    datasets.write_table(carried, rows, datasets.CARRY)
    s1 = store.scored(1, 0, {4: MIXED}, version=1)
    r = run_filter(host, store, 1, [s1], 2, carried)
    assert (r["kept"], r["carried_in"], r["surplus_dropped"]) == (1, 0, 1)


def test_new_kept_counts_the_last_wave_only(tmp_path):
    host, store = filter_host(), Store(tmp_path)
    w0 = store.scored(2, 0, {1: MIXED, 2: EQUAL, 3: EQUAL}, version=4)
    w1 = store.scored(2, 1, {4: MIXED, 5: MIXED, 6: EQUAL, 7: MIXED}, version=4)
    r = run_filter(host, store, 2, [w0, w1], 8, None)
    assert (r["kept"], r["new_kept"], r["dropped_equal"], r["enough"]) == (4, 3, 3, False)


# ---------------------------------------------------------------- a real run, resumed


def prompt_ids(path: Path) -> list[int]:
    return list(dict.fromkeys(pq.read_table(path).column("prompt_id").to_pylist()))


def test_carry_over_is_trained_next_step_and_survives_a_resume(prepared):
    """dp=2, 4 steps, checkpoints after steps 1 and 3 (asynchronous: committed one step later).
    Without the equal-reward filter every group is kept (keep ratio 1), so the batches are known:
    step 0 draws prompts_per_wave=4 per group, trains 2 and carries 2; step 1 trains the 2 carried
    groups and draws one prompt (carried on); steps 2 and 3 draw ceil(1 / 1.0 * 1.2) = 2 prompts.
    Then the run is set back to its step-1 checkpoint (as if killed before step 3's commit) and run
    again: it redoes steps 2-3 with exactly the same batches."""
    from flows.training import train
    from tests.helpers import TINY

    extra = ["name=carrytest", "steps=4", "dp=2", "checkpoint.every=2", "sampling.filter_equal_rewards=false",
             "sampling.adaptive=true", "sampling.oversample=1.2", "sampling.max_carry_age=1"]
    first = asyncio.run(train(overrides=TINY + [f"storage.root={prepared}", *extra]))["history"]
    run_dir = Path(prepared) / "runs" / "carrytest"

    def step_file(step: int, stage: str, g: int) -> Path:
        return run_dir / "steps" / f"{step:06d}" / stage / f"group={g}" / "part-000.parquet"

    assert [m["prompts"] for m in first] == [8, 2, 4, 4]  # summed over the two groups
    assert [m["carried_groups"] for m in first] == [0, 4, 2, 2]
    assert [m["carried_over"] for m in first] == [4, 2, 2, 2]
    assert [m["fill_rate"] for m in first] == [1.0] * 4 and [m["waves"] for m in first] == [1] * 4
    assert [m["surplus_dropped"] for m in first] == [0] * 4 and [m["keep_ratio"] for m in first] == [1.0] * 4

    def trained_ids() -> dict[tuple[int, int], list[int]]:
        return {(s, g): prompt_ids(step_file(s, "experience", g)) for s in range(4) for g in (0, 1)}

    def check_batches(trained: dict) -> None:
        everything = [i for ids in trained.values() for i in ids]
        assert len(everything) == len(set(everything)), "a prompt group was trained twice"
        rolled = [i for s in range(4) for g in (0, 1) for i in prompt_ids(step_file(s, "rollouts", g))]
        assert len(rolled) == len(set(rolled)), "a prompt was drawn twice"
        for s in range(1, 4):
            for g in (0, 1):
                carried = prompt_ids(step_file(s - 1, "carry", g))
                assert trained[(s, g)][: len(carried)] == carried  # the carried groups, first in the next batch
                fresh = prompt_ids(step_file(s, "rollouts", g))
                assert set(trained[(s, g)]) <= set(carried) | set(fresh)
                exp = pq.read_table(step_file(s, "experience", g))
                version = dict(zip(exp.column("prompt_id").to_pylist(), exp.column("policy_version").to_pylist()))
                newer = [version[i] for i in trained[(s, g)] if i not in carried]
                if newer:  # carried samples hold the older policy's version (and log-probs)
                    assert max(version[i] for i in carried) < min(newer)

    trained = trained_ids()
    check_batches(trained)

    state = json.loads((run_dir / "state.json").read_text())
    assert state["step"] == 3 and state["cursors"] == [9, 9]
    for g, sampling in enumerate(state["sampling"]):
        assert sampling["carry"] == objectstore.normalize(str(step_file(3, "carry", g))) and sampling["carried"] == 1
        assert sampling["kept"] == sampling["drawn"] > 0
    # the step-1 checkpoint was committed during step 2: it holds step 1's own carry-over
    manifest = json.loads((run_dir / "checkpoints" / "000001" / "MANIFEST.json").read_text())
    assert [s["carry"] for s in manifest["sampling"]] == [objectstore.normalize(str(step_file(1, "carry", g))) for g in (0, 1)]
    assert manifest["cursors"] == [5, 5]

    # Killed before step 3's checkpoint was committed: state.json is still at step 1's.
    state.update(step=1, checkpoint=objectstore.normalize(str(run_dir / "checkpoints" / "000001")),
                 **{k: manifest[k] for k in ("cursors", "policy_version", "sampling")})
    (run_dir / "state.json").write_text(json.dumps(state))
    for later in sorted(run_dir.glob("checkpoints/00000[2-9]/MANIFEST.json")):  # never committed (a newer manifest
        later.unlink()  # would be rolled forward to: docs/recovery.md)
    again = asyncio.run(train(overrides=TINY + [f"storage.root={prepared}", *extra]))["history"]
    assert [m["step"] for m in again] == [2, 3]
    # the carry-over and the keep-ratio estimate came from the checkpoint (without the estimate,
    # step 2 would draw prompts_per_wave=4 per group again)
    assert [m["prompts"] for m in again] == [4, 4] and [m["carried_groups"] for m in again] == [2, 2]
    assert json.loads((run_dir / "state.json").read_text())["cursors"] == [9, 9]  # as the first run left step 3
    assert trained_ids() == trained  # the same batches: nothing lost, nothing trained twice
    check_batches(trained_ids())
