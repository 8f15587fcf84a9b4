"""Off-policy correction (engines/rl/off_policy.py, engines/host/offpolicy.py): each mode against
the plain formula, then through the real TorchTrainer's loss step (decoupled PPO with TIS)."""

from __future__ import annotations

import math
import random

import pytest


import torch

from engines.backends.base import TrainBatch, fingerprint
from engines.backends.torch.trainer import TorchTrainer
from engines.config import ConfigError, load_config
from engines.host import offpolicy
from engines.host.balance import presplit
from engines.rl.grpo import GRPOConfig
from engines.rl.off_policy import correction_weights, staleness_counts
from tests.helpers import random_batch, save_tiny_model, with_old_logprobs


def logprob_rows(seed: int, rows: int = 6, spread: float = 1.5) -> tuple[list[list[float]], list[list[float]]]:
    rng = random.Random(seed)
    lengths = [rng.randint(1, 7) for _ in range(rows)]
    behaviour = [[-rng.uniform(0.1, 3.0) for _ in range(n)] for n in lengths]
    proximal = [[b + rng.uniform(-spread, spread) for b in row] for row in behaviour]
    return proximal, behaviour


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_none_is_the_plain_ratio(seed):
    prox, beh = logprob_rows(seed)
    weights, stats = correction_weights(prox, beh, "none")
    ratios = [[math.exp(p - b) for p, b in zip(pr, br)] for pr, br in zip(prox, beh)]
    assert weights == [pytest.approx(r) for r in ratios]
    flat = [r for row in ratios for r in row]
    assert stats["is_ratio_mean"] == pytest.approx(sum(flat) / len(flat))
    assert stats["is_ratio_max"] == pytest.approx(max(flat))
    assert stats["is_truncated_fraction"] == 0.0 and stats["is_masked_fraction"] == 0.0


@pytest.mark.parametrize("cap", [0.8, 1.5, 2.5])
def test_tis_truncates_each_token_at_the_cap(cap):
    prox, beh = logprob_rows(7, rows=10, spread=2.0)
    weights, stats = correction_weights(prox, beh, "tis", tis_cap=cap)
    flat_ratio = [math.exp(p - b) for pr, br in zip(prox, beh) for p, b in zip(pr, br)]
    assert [w for row in weights for w in row] == pytest.approx([min(r, cap) for r in flat_ratio])
    over = sum(r > cap for r in flat_ratio)
    assert 0 < over < len(flat_ratio)  # the case is a real one: some tokens truncated, some not
    assert stats["is_truncated_fraction"] == pytest.approx(over / len(flat_ratio))
    assert stats["is_ratio_max"] == pytest.approx(max(flat_ratio))  # the raw ratio, before truncation


def test_mis_masks_whole_sequences_by_their_geometric_mean_ratio():
    prox, beh = logprob_rows(3, rows=12, spread=2.0)
    low, high = 0.7, 1.4
    weights, stats = correction_weights(prox, beh, "mis", mis_low=low, mis_high=high)
    masked_tokens = 0
    kinds = set()
    for w, pr, br in zip(weights, prox, beh):
        rho = math.exp(sum(p - b for p, b in zip(pr, br)) / len(pr))
        keep = low <= rho <= high
        kinds.add(keep)
        want = [math.exp(p - b) for p, b in zip(pr, br)] if keep else [0.0] * len(pr)
        assert w == pytest.approx(want)
        masked_tokens += 0 if keep else len(pr)
    assert kinds == {True, False}  # both kept and masked sequences in the case
    assert stats["is_masked_fraction"] == pytest.approx(masked_tokens / sum(len(p) for p in prox))


def test_staleness_counts():
    assert staleness_counts(5, [5, 4, 4, 3, 5, 4]) == {0: 2, 1: 3, 2: 1}


def test_correction_needs_decoupled_old_policy(tmp_path):
    with pytest.raises(ConfigError, match="needs train.old_policy=decoupled"):
        load_config(None, ["train.off_policy_correction=tis"])
    config = load_config(None, ["train.off_policy_correction=mis", "train.old_policy=decoupled", "rollout.max_staleness=1"])
    assert config.rollout.max_staleness == 1


def test_overlap_refuses_a_critic_and_node_controllers():
    # the critic would be read by the rollout lane's filter while the train step updates it; node
    # controllers run a step's groups in order: both refused while the config loads, naming the fields
    with pytest.raises(ConfigError, match="rollout.max_staleness=1 with train.algorithm.name=ppo"):
        load_config(None, ["rollout.max_staleness=1", "train.algorithm.name=ppo"])
    with pytest.raises(ConfigError, match="rollout.max_staleness=1 with controllers.groups_per_node=2"):
        load_config(None, ["rollout.max_staleness=1", "controllers.groups_per_node=2"])
    assert load_config(None, ["train.algorithm.name=ppo"]).train.algorithm.needs.critic  # each alone is fine
    assert load_config(None, ["controllers.groups_per_node=2"]).controllers.groups_per_node == 2


class _Train:
    old_policy, off_policy_correction, tis_cap, mis_low, mis_high = "decoupled", "tis", 1.2, 0.5, 2.0


def test_decoupled_tis_through_the_trainer_matches_the_formula(tiny_model):
    """Decoupled PPO + TIS through ``offpolicy.correct`` and TorchTrainer's loss step: the loss is
    -sum_t min(w_t, C) * min(r_t A, clip(r_t) A) / tokens with r_t = pi/pi_old (= 1 at the first
    pass, so the surrogate is A) and w_t = pi_old / mu, pi_old the trainer's own log-probs."""
    trainer = TorchTrainer(tiny_model, lr=1e-2)
    batch = random_batch(5, seed=4)
    own = trainer.logprobs(batch)
    batch = with_old_logprobs(batch, own, noise=0.6, seed=4)  # the behaviour policy: a stale one
    corrected, stats = offpolicy.correct(trainer, batch, _Train)
    assert corrected.old_logprobs == own
    stats |= trainer.train_step(corrected, GRPOConfig(loss_aggregation="token"), minibatches=1)
    tokens = sum(len(r) for r in batch.response_ids)
    want = -sum(min(math.exp(o - b), _Train.tis_cap) * a
                for o_row, b_row, a in zip(own, batch.old_logprobs, batch.advantages) for o, b in zip(o_row, b_row)) / tokens
    assert stats["loss"] == pytest.approx(want, abs=1e-5)
    assert 0.0 < stats["is_truncated_fraction"] < 1.0


def test_correct_keeps_a_balanced_batch_minibatches(tiny_model):
    trainer = TorchTrainer(tiny_model)
    a, b = random_batch(2, seed=1), random_batch(3, seed=2)
    batch = presplit([a, b])
    out, _ = offpolicy.correct(trainer, batch, _Train)
    parts = out.split(2)
    assert [len(p) for p in parts] == [2, 3]
    assert all(len(w) == len(r) for p in parts for w, r in zip(p.is_weights, p.response_ids))


def test_bypass_leaves_the_batch_alone():
    batch = TrainBatch([[1]], [[2]], [[-0.5]], [1.0])

    class Bypass(_Train):
        old_policy = "bypass"

    assert offpolicy.correct(None, batch, Bypass) == (batch, {})


def test_loss_step_weights_scale_the_per_token_loss():
    from engines.rl.loss_step import LossStep

    torch.manual_seed(0)
    lp, old = torch.randn(3, 4), torch.randn(3, 4)
    mask, w = torch.ones(3, 4), torch.rand(3, 4)
    adv = [0.5, -1.0, 2.0]
    algorithm = GRPOConfig()
    plain, _ = algorithm.loss(lp, old, torch.tensor(adv), mask)
    got = LossStep(algorithm, adv, lambda v: v)(lp, old, adv, mask, total=12.0, weights=w)
    assert got.item() == pytest.approx((plain * w).sum().item() / 12.0, rel=1e-6)


def test_carried_groups_count_against_the_staleness_bound():
    """rollout.max_staleness=k: a group trained at step t may be at most k versions behind (t - its
    oldest sample's policy_version); k=0 leaves carry-over to sampling.max_carry_age."""
    from types import SimpleNamespace

    def config(k):
        return SimpleNamespace(rollout=SimpleNamespace(max_staleness=k))

    group = [{"policy_version": 4}, {"policy_version": 5}]
    assert not offpolicy.too_stale(config(1), 5, group)  # fresh from version 4, trained at 5: 1 behind
    assert offpolicy.too_stale(config(1), 6, group)  # carried one step further: 2 behind
    assert not offpolicy.too_stale(config(2), 6, group)
    assert not offpolicy.too_stale(config(0), 9, group)


class _Engine:
    """Records what it loads (a rollout engine's ``update_weights``)."""

    def __init__(self):
        self.loaded: list[dict] = []

    def update_weights(self, buckets) -> list[str]:
        loaded = [[(name, t.clone()) for name, t in bucket] for bucket in buckets]
        self.loaded.append({name: t for bucket in loaded for name, t in bucket})
        return [fingerprint(bucket) for bucket in loaded]


def test_a_sync_while_the_rollout_lane_holds_the_engine_is_staged_for_its_next_chunk():
    import threading

    weights, engine = offpolicy.RolloutWeights(), _Engine()
    param = torch.zeros(3)
    assert weights.sync(engine, 1, [("w", param)]) == 1  # the engine is free: loaded at once
    assert weights.version == 1 and engine.loaded[-1]["w"].tolist() == [0, 0, 0]

    in_chunk, chunk_may_end, versions = threading.Event(), threading.Event(), []

    def rollout_lane():
        for _ in range(2):  # two chunks
            with weights as version:
                versions.append(version)
                in_chunk.set()
                chunk_may_end.wait(timeout=30)

    lane = threading.Thread(target=rollout_lane)
    lane.start()
    assert in_chunk.wait(timeout=30)
    param += 1  # the trainer's step 2
    assert weights.sync(engine, 2, [("w", param)]) == 1  # returns while the chunk still holds the engine
    param += 1  # the trainer's step 3, in place, before the chunk ends
    assert len(engine.loaded) == 1 and weights.version == 1  # not loaded inside the chunk
    chunk_may_end.set()
    lane.join(timeout=30)
    assert versions == [1, 2]  # the next chunk loaded the staged weights first
    assert engine.loaded[-1]["w"].tolist() == [1, 1, 1]  # version 2's values: a copy, not the trainer's tensor


def test_the_newest_staged_weights_win():
    import threading

    weights, engine = offpolicy.RolloutWeights(), _Engine()
    held, release = threading.Event(), threading.Event()

    def chunk():  # the rollout lane holds the engine through two syncs
        with weights:
            held.set()
            release.wait(timeout=30)

    lane = threading.Thread(target=chunk)
    lane.start()
    assert held.wait(timeout=30)
    weights.sync(engine, 1, [("w", torch.ones(1))])
    weights.sync(engine, 2, [("w", 2 * torch.ones(1))])
    release.set()
    lane.join(timeout=30)
    assert engine.loaded == []  # neither loaded inside the chunk
    with weights as version:
        assert version == 2 and [e["w"].item() for e in engine.loaded] == [2.0]  # version 1 was superseded, never loaded


def test_a_weight_sync_is_checked_bucket_by_bucket(tmp_path):
    """``load_weights`` into the torch rollout engine: every tensor lands (read back, bucket by
    bucket); a tensor it has no parameter for, a parameter no tensor reached, and an engine that
    holds something other than what the trainer sent (bf16 against the trainer's fp32) are refused."""
    from engines.backends.base import WeightSyncError, load_weights
    from engines.backends.torch.generator import TorchGenerator

    folder = save_tiny_model(tmp_path / "policy", num_layers=2)
    trainer, engine = TorchTrainer(folder), TorchGenerator(folder)
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    sent = dict(trainer.export_weights())
    assert load_weights(engine, trainer.export_weights(), bucket_bytes=8192) == len(sent)  # several buckets
    assert all(torch.equal(p, sent[name]) for name, p in engine.model.named_parameters())
    with pytest.raises(WeightSyncError, match=r"got no tensor \(e\.g\. model\.norm\.weight\)"):
        load_weights(engine, ((n, t) for n, t in sent.items() if n != "model.norm.weight"))
    with pytest.raises(WeightSyncError, match=r"no parameter 'model\.norm\.scale'"):
        load_weights(engine, (("model.norm.scale" if n == "model.norm.weight" else n, t) for n, t in sent.items()))
    with pytest.raises(WeightSyncError, match=r"bucket 0 \(\d+ tensors, model\.embed_tokens\.weight \.\. .*\) differs"):
        load_weights(TorchGenerator(folder, dtype="bfloat16"), trainer.export_weights(), bucket_bytes=8192)
