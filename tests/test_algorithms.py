"""engines/rl/algorithms.py against the same formulas written out by hand, plus one full
TorchTrainer step checked against a hand-written forward, loss, clip and AdamW step."""

from __future__ import annotations

import math
import random

import pytest


import torch

from engines.rl import algorithms
from engines.rl.grpo import GRPOConfig
from engines.backends.base import TrainBatch
from engines.backends.torch.trainer import TorchTrainer
from tests.helpers import STEP_RTOL, max_param_diff, params_of, parity, random_batch, step_gap, with_old_logprobs


# ---------------------------------------------------------------- group advantages


def hand_group_advantages(rewards, groups, scale, eps=1e-6):
    out = []
    for r, g in zip(rewards, groups):
        members = [x for x, h in zip(rewards, groups) if h == g]
        mean = sum(members) / len(members)
        std = math.sqrt(sum((x - mean) ** 2 for x in members) / len(members))  # population std
        out.append((r - mean) / (std + eps) if scale == "std" else r - mean)
    return out


@pytest.mark.parametrize("scale", ["std", "none"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_group_advantages_match_hand_formula(scale, seed):
    rng = random.Random(seed)
    groups = [rng.randrange(4) for _ in range(20)]  # interleaved group ids
    rewards = [rng.choice([0.0, 1.0, rng.uniform(-2, 2)]) for _ in groups]
    got = algorithms.group_advantages(rewards, groups, scale=scale)
    assert got == pytest.approx(hand_group_advantages(rewards, groups, scale), rel=1e-9, abs=1e-9)


def test_group_advantages_known_values():
    # group 7: rewards 1, 0, 0, 1 -> mean 0.5, population std 0.5 -> +-1 (not +-0.866 of the sample std)
    got = algorithms.group_advantages([1, 0, 3, 0, 1], [7, 7, 9, 7, 7], scale="std")
    assert got[:2] == pytest.approx([1.0, -1.0], abs=1e-5)
    assert got[3:] == pytest.approx([-1.0, 1.0], abs=1e-5)
    assert got[2] == 0.0  # a one-sample group has no signal
    none = algorithms.group_advantages([1, 0, 3, 0, 1], [7, 7, 9, 7, 7], scale="none")
    assert none == pytest.approx([0.5, -0.5, 0.0, -0.5, 0.5])


def test_group_advantages_equal_rewards_are_zero():
    assert algorithms.group_advantages([0.3] * 4, [1] * 4, scale="std") == pytest.approx([0.0] * 4, abs=1e-9)


def test_group_advantages_std_normalises_each_group_separately():
    adv = algorithms.group_advantages([0, 10, 0, 1], [0, 0, 1, 1], scale="std")
    # both groups are a two-point {low, high} split: after std scaling they are the same
    assert adv[:2] == pytest.approx(adv[2:], abs=1e-5)
    raw = algorithms.group_advantages([0, 10, 0, 1], [0, 0, 1, 1], scale="none")
    assert raw == pytest.approx([-5, 5, -0.5, 0.5])


# ---------------------------------------------------------------- overlong penalty


def hand_overlong(length, max_new, buffer, penalty):
    if buffer <= 0 or length <= max_new - buffer:
        return 0.0
    return -penalty * min((length - (max_new - buffer)) / buffer, 1.0)


@pytest.mark.parametrize("max_new,buffer,penalty", [(16, 4, 1.0), (8, 8, 0.5), (10, 3, 2.0), (8, 0, 1.0)])
def test_overlong_penalty_matches_hand_formula(max_new, buffer, penalty):
    for length in range(0, max_new + 3):
        got = algorithms.overlong_penalty(length, max_new, buffer, penalty)
        assert got == pytest.approx(hand_overlong(length, max_new, buffer, penalty)), length


def test_overlong_penalty_shape():
    # 0 up to max-buffer, linear in between, -penalty at the cap
    assert algorithms.overlong_penalty(12, 16, 4, 1.0) == 0.0
    assert algorithms.overlong_penalty(13, 16, 4, 1.0) == pytest.approx(-0.25)
    assert algorithms.overlong_penalty(14, 16, 4, 1.0) == pytest.approx(-0.5)
    assert algorithms.overlong_penalty(16, 16, 4, 2.0) == pytest.approx(-2.0)
    assert algorithms.overlong_penalty(17, 16, 4, 2.0) == pytest.approx(-2.0)
    assert algorithms.overlong_penalty(16, 16, 0, 1.0) == 0.0


# ---------------------------------------------------------------- policy loss


def hand_policy_loss(lp, old, adv, clip_low, clip_high, ref=None, kl_coef=0.0):
    """Per-token clipped surrogate plus k3 KL, one float at a time."""
    loss, clipped = [], []
    for i, row in enumerate(lp):
        lrow, crow = [], []
        for t, x in enumerate(row):
            ratio = math.exp(x - old[i][t])
            a = adv[i]
            unclipped = ratio * a
            clip = min(max(ratio, 1 - clip_low), 1 + clip_high) * a
            value = -min(unclipped, clip)
            if ref is not None and kl_coef > 0:
                d = ref[i][t] - x
                value += kl_coef * (math.exp(d) - d - 1)
            lrow.append(value)
            crow.append(1.0 if clip < unclipped else 0.0)
        loss.append(lrow)
        clipped.append(crow)
    return loss, clipped


@pytest.mark.parametrize("use_ref,kl_coef", [(False, 0.0), (True, 0.0), (True, 0.3)])
def test_policy_loss_terms_match_hand_formula(use_ref, kl_coef):
    g = torch.Generator().manual_seed(3)
    lp = -torch.rand(4, 6, generator=g, dtype=torch.float64) * 3
    old = lp + (torch.rand(4, 6, generator=g, dtype=torch.float64) - 0.5)  # ratios ~0.6..1.6
    adv = torch.tensor([1.3, -0.7, 0.0, -2.0], dtype=torch.float64)
    ref = lp + (torch.rand(4, 6, generator=g, dtype=torch.float64) - 0.5) if use_ref else None
    loss, clipped = algorithms.policy_loss_terms(lp, old, adv, 0.2, 0.28, ref, kl_coef)
    want_loss, want_clipped = hand_policy_loss(
        lp.tolist(), old.tolist(), adv.tolist(), 0.2, 0.28, ref.tolist() if use_ref else None, kl_coef
    )
    assert loss.shape == (4, 6)
    for got_row, want_row in zip(loss.tolist(), want_loss):
        assert got_row == pytest.approx(want_row, rel=1e-12, abs=1e-12)
    assert clipped.tolist() == want_clipped
    assert 0 < sum(map(sum, want_clipped)) < 24  # the data exercises both clipped and unclipped tokens


def _single(ratio, adv, clip_low=0.2, clip_high=0.28):
    lp = torch.tensor([[math.log(ratio)]], dtype=torch.float64, requires_grad=True)
    loss, clipped = algorithms.policy_loss_terms(
        lp, torch.zeros(1, 1, dtype=torch.float64), torch.tensor([adv], dtype=torch.float64), clip_low, clip_high
    )
    loss.sum().backward()
    return loss.item(), clipped.item(), lp.grad.item()


def test_clip_high_bounds_positive_advantages():
    # ratio 1.5 > 1 + 0.28 with A > 0: clipped at 1.28, no gradient
    loss, clipped, grad = _single(1.5, 2.0)
    assert loss == pytest.approx(-1.28 * 2.0) and clipped == 1.0 and grad == 0.0
    # ratio 1.25 is inside clip-higher's 1.28 (a symmetric 0.2 clip would cut it)
    loss, clipped, grad = _single(1.25, 2.0)
    assert loss == pytest.approx(-1.25 * 2.0) and clipped == 0.0 and grad == pytest.approx(-1.25 * 2.0)
    loss, clipped, _ = _single(1.25, 2.0, clip_high=0.2)
    assert loss == pytest.approx(-1.2 * 2.0) and clipped == 1.0
    # a low ratio with A > 0 is never clipped (pessimistic bound keeps the unclipped term)
    loss, clipped, grad = _single(0.5, 2.0)
    assert loss == pytest.approx(-0.5 * 2.0) and clipped == 0.0 and grad == pytest.approx(-0.5 * 2.0)


def test_clip_low_bounds_negative_advantages():
    # ratio 0.5 < 1 - 0.2 with A < 0: clipped at 0.8, no gradient
    loss, clipped, grad = _single(0.5, -1.0)
    assert loss == pytest.approx(0.8) and clipped == 1.0 and grad == 0.0
    # a high ratio with A < 0 is never clipped
    loss, clipped, grad = _single(1.6, -1.0)
    assert loss == pytest.approx(1.6) and clipped == 0.0 and grad == pytest.approx(1.6)
    # clip_low is its own bound: 0.75 is outside 0.2 but inside 0.3
    assert _single(0.75, -1.0, clip_low=0.2)[1] == 1.0
    assert _single(0.75, -1.0, clip_low=0.3)[1] == 0.0


def test_k3_kl_term():
    lp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64)
    ref = torch.tensor([[-1.5, -1.0, -0.5]], dtype=torch.float64)
    adv = torch.zeros(1, dtype=torch.float64)  # isolate the KL term
    loss, _ = algorithms.policy_loss_terms(lp, lp, adv, 0.2, 0.28, ref, kl_coef=0.1)
    d = (ref - lp)[0].tolist()
    assert loss[0].tolist() == pytest.approx([0.1 * (math.exp(x) - x - 1) for x in d], rel=1e-12)
    assert loss[0, 2].item() == 0.0  # identical to the reference: no penalty
    assert all(v >= 0 for v in loss[0].tolist())  # k3 is non-negative
    # kl_coef 0 or no reference: no KL term at all
    assert algorithms.policy_loss_terms(lp, lp, adv, 0.2, 0.28, ref, 0.0)[0].abs().sum().item() == 0.0
    assert algorithms.policy_loss_terms(lp, lp, adv, 0.2, 0.28, None, 0.5)[0].abs().sum().item() == 0.0


# ---------------------------------------------------------------- token weights


def test_token_weights_token():
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [0.0, 1.0, 0.0, 0.0]])
    w = algorithms.token_weights(mask, "token", total=20.0)
    assert torch.equal(w, mask / 20.0)
    assert w.sum().item() == pytest.approx(7 / 20)


def test_token_weights_sequence():
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    w = algorithms.token_weights(mask, "sequence", total=5.0)
    lengths = [2, 4, 1, 1]  # an empty row divides by 1 (its weights are 0 anyway)
    want = torch.stack([mask[i] / lengths[i] / 5.0 for i in range(4)])
    assert torch.allclose(w, want, rtol=0, atol=1e-7)
    # each non-empty sequence weighs 1/total in all
    assert w.sum(-1).tolist() == pytest.approx([0.2, 0.2, 0.2, 0.0])


def test_token_weights_total_below_one_is_clamped():
    mask = torch.ones(1, 3)
    assert torch.equal(algorithms.token_weights(mask, "token", total=0.0), mask)
    assert torch.allclose(algorithms.token_weights(mask, "sequence", total=0.0), mask / 3)


# ---------------------------------------------------------------- TorchTrainer against a hand computation


def hand_logprobs(model, prompt, response, temperature):
    """log p(response tokens) from one unpadded forward pass of this sequence alone."""
    ids = torch.tensor([prompt + response])
    logits = model(input_ids=ids).logits[0].float() / temperature
    logp = torch.log_softmax(logits[:-1], -1)
    targets = ids[0, 1:]
    per_position = logp[torch.arange(len(targets)), targets]
    return per_position[len(prompt) - 1 :]


def test_trainer_logprobs_match_unpadded_forward(tiny_model):
    trainer = TorchTrainer(tiny_model, temperature=0.7)
    batch = random_batch(4, seed=5)
    got = trainer.logprobs(batch)
    with torch.no_grad():
        for row, p, r in zip(got, batch.prompt_ids, batch.response_ids):
            assert len(row) == len(r)
            assert row == pytest.approx(hand_logprobs(trainer.model, p, r, 0.7).tolist(), abs=1e-5)


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_trainer_loss_at_ratio_one(tiny_model, aggregation):
    """With old log-probs = the trainer's own, ratio is 1: the token-level loss is
    -sum(mask * adv) / tokens, the sequence-level one -mean(adv)."""
    trainer = TorchTrainer(tiny_model, lr=1e-2)
    batch = random_batch(5, seed=11)
    batch = with_old_logprobs(batch, trainer.logprobs(batch))
    stats = trainer.train_step(batch, GRPOConfig(loss_aggregation=aggregation), minibatches=1)
    lengths = [len(r) for r in batch.response_ids]
    if aggregation == "token":
        want = -sum(a * n for a, n in zip(batch.advantages, lengths)) / sum(lengths)
    else:
        want = -sum(batch.advantages) / len(batch)
    assert stats["loss"] == pytest.approx(want, abs=1e-5)
    assert stats["tokens"] == sum(lengths)
    assert stats["clip_fraction"] == 0.0
    assert trainer.version == 1


CLIP_LOW, CLIP_HIGH, KL_COEF, TEMPERATURE = 0.2, 0.28, 0.2, 0.9


def GRPO(aggregation):
    return GRPOConfig(loss_aggregation=aggregation, clip_low=CLIP_LOW, clip_high=CLIP_HIGH, kl_coef=KL_COEF)


def hand_minibatch_loss(model, reference, batch: TrainBatch, lo: int, hi: int, aggregation: str) -> torch.Tensor:
    """Clipped surrogate + k3 KL of sequences lo..hi, each from its own unpadded forward,
    normalised by the minibatch's token count (token) or sequence count (sequence)."""
    total_tokens = sum(len(batch.response_ids[i]) for i in range(lo, hi))
    loss = torch.zeros(())
    for i in range(lo, hi):
        p, r = batch.prompt_ids[i], batch.response_ids[i]
        lp = hand_logprobs(model, p, r, TEMPERATURE)
        with torch.no_grad():
            ref = hand_logprobs(reference, p, r, TEMPERATURE)
        old = torch.tensor(batch.old_logprobs[i])
        a = batch.advantages[i]
        ratio = torch.exp(lp - old)
        surrogate = torch.minimum(ratio * a, torch.clamp(ratio, 1 - CLIP_LOW, 1 + CLIP_HIGH) * a)
        per_token = -surrogate + KL_COEF * (torch.exp(ref - lp) - (ref - lp) - 1)
        if aggregation == "token":
            loss = loss + per_token.sum() / total_tokens
        else:
            loss = loss + per_token.mean() / (hi - lo)
    return loss


def off_policy_setup(tiny_model, seed, **trainer_kwargs):
    trainer = TorchTrainer(tiny_model, lr=1e-2, temperature=TEMPERATURE, reference=True, **trainer_kwargs)
    batch = random_batch(5, seed=seed)
    batch = with_old_logprobs(batch, trainer.logprobs(batch), noise=0.4, seed=seed)
    hand = TorchTrainer(tiny_model).model  # same initial weights, our own copy
    reference = TorchTrainer(tiny_model).model.eval()
    return trainer, batch, hand, reference


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_trainer_gradients_match_hand_written_loss(tiny_model, aggregation):
    """One minibatch, no clipping: the gradient the trainer applied (left in ``.grad``)
    and its norm equal those of the hand-written loss."""
    trainer, batch, hand, reference = off_policy_setup(tiny_model, seed=31, grad_clip=1e9)
    loss = hand_minibatch_loss(hand, reference, batch, 0, len(batch), aggregation)
    loss.backward()
    stats = trainer.train_step(batch, GRPO(aggregation), minibatches=1)
    assert stats["loss"] == pytest.approx(loss.item(), abs=1e-6)
    hand_grads = dict((n, p.grad) for n, p in hand.named_parameters())
    norm = torch.sqrt(sum((g**2).sum() for g in hand_grads.values())).item()
    assert stats["grad_norm"] == pytest.approx(norm, rel=1e-5)
    for name, p in trainer.model.named_parameters():
        assert torch.allclose(p.grad, hand_grads[name], rtol=1e-4, atol=1e-6 * norm), name
    assert 0.0 < stats["clip_fraction"] < 1.0  # noise of 0.4 pushes some ratios out of the clip range


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_trainer_step_matches_hand_written_step(tiny_model, aggregation):
    """Two minibatches with off-policy old log-probs: the parameters after ``train_step``
    equal a hand-written loop (per-sequence forward, clipped loss, k3 KL, minibatch
    normalisation, grad-norm clip, AdamW)."""
    grad_clip = 0.5
    trainer, batch, hand, reference = off_policy_setup(tiny_model, seed=21, grad_clip=grad_clip)
    opt = torch.optim.AdamW(hand.parameters(), lr=1e-2, betas=(0.9, 0.99), weight_decay=0.0)
    hand_loss = 0.0
    for lo, hi in [(0, 2), (2, 5)]:  # TrainBatch.split(2) of 5 sequences: round(2.5) = 2
        opt.zero_grad(set_to_none=True)
        loss = hand_minibatch_loss(hand, reference, batch, lo, hi, aggregation)
        loss.backward()
        hand_loss += loss.item()
        torch.nn.utils.clip_grad_norm_(hand.parameters(), grad_clip)
        opt.step()

    stats = trainer.train_step(batch, GRPO(aggregation), minibatches=2)
    assert stats["loss"] == pytest.approx(hand_loss, abs=1e-5)
    moved = max_param_diff(params_of(trainer.model), params_of(reference))
    assert moved > 1e-3  # it did train (Adam moves each weight by ~lr per step)
    # fp32 + Adam (which divides small gradients by their own size): the step as a whole (tests/helpers.py)
    gap = step_gap(params_of(trainer.model), params_of(hand), params_of(reference))
    assert parity("torch trainer vs a hand-written step", gap) < STEP_RTOL


def test_trainer_empty_batch_is_a_no_op(tiny_model):
    trainer = TorchTrainer(tiny_model, lr=1e-2)
    before = params_of(trainer.model)
    stats = trainer.train_step(TrainBatch([], [], [], []), minibatches=2)
    assert stats["loss"] == 0.0 and stats["tokens"] == 0.0
    assert max_param_diff(before, params_of(trainer.model)) == 0.0
    assert trainer.version == 1


def test_step_statistics_are_the_plain_sums():
    """Entropy (the sampled tokens' -log p) and the two k3 KL estimates, over the masked tokens."""
    torch.manual_seed(0)
    new, old, ref = (torch.randn(3, 5).clamp(max=-0.01) for _ in range(3))
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.float32)
    entropy, kl_rollout, kl_reference = algorithms.step_statistics(new, old, mask, ref).tolist()
    expected_entropy, expected_rollout, expected_reference = 0.0, 0.0, 0.0
    for i in range(3):
        for t in range(5):
            if mask[i, t]:
                p_new, p_old, p_ref = math.exp(new[i, t]), math.exp(old[i, t]), math.exp(ref[i, t])
                expected_entropy -= math.log(p_old)
                expected_rollout += p_new / p_old - math.log(p_new / p_old) - 1  # KL(rollout || current), k3
                expected_reference += p_ref / p_new - math.log(p_ref / p_new) - 1  # KL(current || reference), k3
    assert entropy == pytest.approx(expected_entropy, rel=1e-5)
    assert kl_rollout == pytest.approx(expected_rollout, rel=1e-4, abs=1e-6)
    assert kl_reference == pytest.approx(expected_reference, rel=1e-4, abs=1e-6)
    assert algorithms.step_statistics(new, old, mask).tolist()[2] == 0.0  # no reference: 0
