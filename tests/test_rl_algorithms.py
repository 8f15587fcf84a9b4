"""Each algorithm of ``engines/rl`` against its paper's formula written out plainly (one float at a
time where it can be), then one ``TorchTrainer`` step per algorithm against a hand-written loss.

GRPO/DAPO's own formulas (group advantages, the clipped ratio, k3 KL, the loss weights) are in
``tests/test_algorithms.py``; data parallelism of every algorithm in ``tests/test_dp.py``, and
Megatron-Core against torch (GSPO, CISPO; REINFORCE++ over two DP ranks) in ``tests/test_megatron.py``.
"""

from __future__ import annotations

import math
import random

import pytest


import torch

from engines.backends.torch.trainer import TorchTrainer
from engines.config import ConfigError, load_config
from engines.rl.loss_step import LossStep
from engines.rl.cispo import cispo_loss
from engines.rl.dpo import DPOConfig
from engines.rl.grpo import GRPOConfig
from engines.rl.gspo import gspo_loss
from engines.rl.ppo import gae, value_loss
from engines.rl.registry import ALGORITHMS
from engines.rl.reinforce_pp import ReinforcePPConfig
from engines.rl.rloo import RLOOConfig, rloo_advantages
from tests.helpers import random_batch, with_old_logprobs


def off_policy(seed: int, batch: int = 4, tokens: int = 6):
    """log-probs, old log-probs (ratios ~0.6..1.6), a ragged mask, advantages; float64."""
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(batch, tokens, generator=g, dtype=torch.float64) * 3
    old = lp + (torch.rand(batch, tokens, generator=g, dtype=torch.float64) - 0.5)
    lengths = [tokens - (i % 3) for i in range(batch)]
    mask = torch.tensor([[1.0 if t < n else 0.0 for t in range(tokens)] for n in lengths], dtype=torch.float64)
    adv = torch.tensor([1.3, -0.7, 0.4, -2.0][:batch], dtype=torch.float64)
    return lp, old, mask, adv, lengths


# ---------------------------------------------------------------- RLOO


@pytest.mark.parametrize("seed", [0, 1])
def test_rloo_advantage_is_reward_minus_the_others_mean(seed):
    rng = random.Random(seed)
    groups = [rng.randrange(3) for _ in range(15)]
    rewards = [rng.choice([0.0, 1.0, rng.uniform(-1, 2)]) for _ in groups]
    want = []
    for i, (r, g) in enumerate(zip(rewards, groups)):
        others = [x for j, (x, h) in enumerate(zip(rewards, groups)) if h == g and j != i]
        want.append(r - sum(others) / len(others) if others else 0.0)
    assert rloo_advantages(rewards, groups) == pytest.approx(want, abs=1e-12)
    assert RLOOConfig().advantages(rewards, groups) == pytest.approx(want, abs=1e-12)


def test_rloo_known_values():
    # group of 4 with rewards 1, 0, 0, 1: 1 - 1/3 = 2/3, 0 - 2/3 = -2/3 (k/(k-1) times GRPO's r - mean)
    assert rloo_advantages([1, 0, 0, 1, 5], [7, 7, 7, 7, 9]) == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.0])


# ---------------------------------------------------------------- REINFORCE++


def test_reinforce_pp_whitens_over_every_dp_rank():
    """A = (r - mean) / std over the step's whole batch: this rank's rewards and the other rank's,
    joined by the trainer's all-reduce of (count, sum, sum of squares)."""
    mine, theirs = [1.0, 0.0, 1.0], [0.0, 0.0, 0.0, 1.0, 0.5]
    config = ReinforcePPConfig()
    assert config.advantages(mine, [0, 0, 1]) == mine  # the host writes raw rewards: no per-group baseline
    other = [float(len(theirs)), sum(theirs), sum(r * r for r in theirs)]
    step = LossStep(config, mine, lambda values: [a + b for a, b in zip(values, other)])
    everything = mine + theirs
    mean = sum(everything) / len(everything)
    std = math.sqrt(sum((r - mean) ** 2 for r in everything) / len(everything))
    assert step.shift == pytest.approx(mean) and step.scale == pytest.approx(std, abs=1e-5)
    # GRPO needs no batch statistics: no all-reduce, advantages as the host wrote them
    plain = LossStep(GRPOConfig(), mine, lambda values: pytest.fail("no collective expected"))
    assert (plain.shift, plain.scale) == (0.0, 1.0)


# ---------------------------------------------------------------- GSPO


def hand_gspo_objective(lp, old, mask, adv, eps_low, eps_high):
    """The paper's sequence-level objective, J = mean_i min(s_i A_i, clip(s_i) A_i) with
    s_i = exp(mean_t(log pi - log pi_old)), written per sequence (no stop-gradient anywhere)."""
    terms = []
    for i in range(lp.shape[0]):
        n = int(mask[i].sum())
        s = torch.exp(sum(lp[i, t] - old[i, t] for t in range(n)) / n)
        terms.append(torch.minimum(s * adv[i], torch.clamp(s, 1 - eps_low, 1 + eps_high) * adv[i]))
    return sum(terms) / len(terms)


@pytest.mark.parametrize("eps", [(3e-4, 4e-4), (0.05, 0.05), (10.0, 10.0)])
def test_gspo_value_and_gradient_are_the_sequence_objectives(eps):
    lp, old, mask, adv, _ = off_policy(5)
    old = lp.detach() + (old - lp.detach()) * 0.2  # sequence ratios around 1 +- a few percent
    lp = lp.clone().requires_grad_(True)
    hand_lp = lp.detach().clone().requires_grad_(True)
    per_token, clipped = gspo_loss(lp, old, adv, mask, *eps)
    weights = mask / mask.sum(-1, keepdim=True) / lp.shape[0]  # loss_aggregation=sequence: mean of sequence means
    loss = (per_token * weights).sum()
    want = -hand_gspo_objective(hand_lp, old, mask, adv, *eps)
    assert loss.item() == pytest.approx(want.item(), rel=1e-12)
    loss.backward()
    want.backward()
    assert torch.allclose(lp.grad, hand_lp.grad, rtol=1e-10, atol=1e-14)
    # a sequence is clipped as a whole: its tokens share one indicator
    for i in range(lp.shape[0]):
        assert len({clipped[i, t].item() for t in range(int(mask[i].sum()))}) == 1


def test_gspo_clips_whole_sequences_with_the_papers_eps():
    """A sequence whose tokens are each within PPO's 0.2 but whose mean log-ratio is 1% above
    1 + 4e-4 is clipped (A > 0): no gradient; one inside the range keeps s_i * A per token."""
    lp = torch.zeros(2, 3, dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-0.01, -0.01, -0.01], [-1e-4, -1e-4, -1e-4]], dtype=torch.float64)
    mask = torch.ones(2, 3, dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0], dtype=torch.float64)
    per_token, clipped = gspo_loss(lp, old, adv, mask, 3e-4, 4e-4)
    assert clipped[0].tolist() == [1.0] * 3 and clipped[1].tolist() == [0.0] * 3
    per_token.sum().backward()
    assert lp.grad[0].abs().max().item() == 0.0
    assert lp.grad[1].tolist() == pytest.approx([-math.exp(1e-4)] * 3)  # -s_i A on every token


# ---------------------------------------------------------------- CISPO


@pytest.mark.parametrize("eps_low,eps_high", [(1.0, 0.28), (0.2, 0.2)])
def test_cispo_matches_the_formula_and_every_token_has_a_gradient(eps_low, eps_high):
    lp, old, mask, adv, _ = off_policy(7)
    lp = lp.clone().requires_grad_(True)
    per_token, clipped = cispo_loss(lp, old, adv, mask, eps_low, eps_high)
    n_tokens = mask.sum().item()
    loss = (per_token * mask / n_tokens).sum()  # token-level mean
    want_loss, want_grad, want_clipped = 0.0, torch.zeros_like(lp), torch.zeros_like(lp)
    for i in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            if not mask[i, t]:
                continue
            r = math.exp(lp[i, t].item() - old[i, t].item())
            w = min(max(r, 1 - eps_low), 1 + eps_high)  # sg(clip(r)): a number, not a function of the weights
            want_loss += -w * adv[i].item() * lp[i, t].item() / n_tokens
            want_grad[i, t] = -w * adv[i].item() / n_tokens
            want_clipped[i, t] = float(w != r)
    assert loss.item() == pytest.approx(want_loss, rel=1e-12)
    loss.backward()
    assert torch.allclose(lp.grad, want_grad, rtol=1e-12, atol=0)
    assert torch.equal(clipped * mask, want_clipped)
    assert 0 < want_clipped.sum() < mask.sum()  # clipped tokens exist ...
    assert (lp.grad[want_clipped.bool()] != 0).all()  # ... and still get a gradient (PPO's clip would zero it)


# ---------------------------------------------------------------- PPO


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.9, 0.8), (0.99, 0.0)])
def test_gae_is_the_discounted_sum_of_td_errors(gamma, lam):
    # reward on the last token, V_T = 0: delta_t = r_t + gamma V_{t+1} - V_t, A_t = sum_l (gamma lam)^l delta_{t+l}
    rng = random.Random(3)
    rewards = [rng.uniform(-1, 2) for _ in range(4)]
    values = [[rng.uniform(-1, 1) for _ in range(n)] for n in (1, 3, 5, 2)]
    advantages, returns = gae(rewards, values, gamma, lam)
    for reward, v, adv, ret in zip(rewards, values, advantages, returns):
        n = len(v)
        r = [0.0] * (n - 1) + [reward]
        nxt = v[1:] + [0.0]
        delta = [r[t] + gamma * nxt[t] - v[t] for t in range(n)]
        want = [sum((gamma * lam) ** k * delta[t + k] for k in range(n - t)) for t in range(n)]
        assert adv == pytest.approx(want, abs=1e-12)
        assert ret == pytest.approx([a + x for a, x in zip(want, v)], abs=1e-12)
    if gamma == lam == 1.0:  # veRL's default: the critic is only a baseline, A_t = R - V_t, every return R
        assert advantages[2] == pytest.approx([rewards[2] - x for x in values[2]], abs=1e-12)
        assert returns[2] == pytest.approx([rewards[2]] * 5, abs=1e-12)


def test_value_loss_is_the_larger_of_the_clipped_and_unclipped_squares():
    g = torch.Generator().manual_seed(5)
    old, step, noise = (torch.randn(3, 4, generator=g, dtype=torch.float64) for _ in range(3))
    v = (old + 0.6 * step).requires_grad_()  # many values beyond the clip, returns near them: both branches win somewhere
    ret = v.detach() + 0.3 * noise
    loss, clipped = value_loss(v, old, ret, clip=0.2)
    for i in range(3):
        for t in range(4):
            x, o, r = v[i, t].item(), old[i, t].item(), ret[i, t].item()
            xc = min(max(x, o - 0.2), o + 0.2)
            assert loss[i, t].item() == pytest.approx(0.5 * max((x - r) ** 2, (xc - r) ** 2), rel=1e-12)
            assert clipped[i, t].item() == float((xc - r) ** 2 > (x - r) ** 2)
    assert 0 < clipped.sum() < 12  # both branches are taken
    loss.sum().backward()  # the clipped branch has no gradient: V is outside V_old +- 0.2 there
    assert torch.equal(v.grad == 0, clipped.bool())


# ---------------------------------------------------------------- the config picks them by name


def test_every_algorithm_is_picked_by_name_with_its_own_fields():
    names = [c.model_fields["name"].default for c in ALGORITHMS]
    assert names == ["grpo", "gspo", "cispo", "rloo", "reinforce_pp", "ppo", "online_dpo", "dpo"]
    for name, cls in zip(names, ALGORITHMS):
        pairs = ["data.preferences=data/preferences"] if cls().needs.preferences else []  # its pairs' source (tests/test_dpo.py)
        assert type(load_config(None, [f"train.algorithm.name={name}", *pairs]).train.algorithm) is cls
    gspo = load_config(None, ["train.algorithm.name=gspo"]).train.algorithm
    assert (gspo.clip_low, gspo.clip_high, gspo.loss_aggregation) == (3e-4, 4e-4, "sequence")  # the paper's
    assert load_config(None, ["train.algorithm.kl_coef=0.1"]).train.algorithm.needs.reference  # grpo, with a reference
    with pytest.raises(ConfigError, match="train.kl_coef moved to train.algorithm.kl_coef"):
        load_config(None, ["train.kl_coef=0.1"])
    ppo = load_config(None, ["train.algorithm.name=ppo", "train.algorithm.lam=0.95"]).train.algorithm
    assert (ppo.gamma, ppo.lam, ppo.value_clip, ppo.needs.critic, ppo.needs.batch_whitening) == (1.0, 0.95, 0.2, True, True)
    assert [c().needs.critic for c in ALGORITHMS] == [n == "ppo" for n in names]  # only PPO has a critic
    # what it needs and a backend lacks: refused while the config loads, naming the fields
    with pytest.raises(ConfigError, match="train.algorithm.name=ppo needs a critic \\(model.critic\\) and train.backend=stub"):
        load_config(None, ["train.algorithm.name=ppo", "train.backend=stub"])
    assert load_config(None, ["train.algorithm.name=ppo", "train.backend=megatron"]).train.backend == "megatron"  # MegatronCritic


# ---------------------------------------------------------------- one TorchTrainer step per algorithm


def hand_logprobs(model, prompt, response):
    ids = torch.tensor([prompt + response])
    logp = torch.log_softmax(model(input_ids=ids).logits[0].float()[:-1], -1)
    return logp[torch.arange(len(ids[0]) - 1), ids[0, 1:]][len(prompt) - 1 :]


def hand_loss(name, model, batch):
    """Each algorithm's loss from unpadded per-sequence forwards, as its paper writes it."""
    advantages = batch.advantages
    if name == "reinforce_pp":
        mean = sum(advantages) / len(advantages)
        std = math.sqrt(sum((a - mean) ** 2 for a in advantages) / len(advantages))
        advantages = [(a - mean) / (std + 1e-6) for a in advantages]
    tokens = sum(len(r) for r in batch.response_ids)
    loss = torch.zeros(())
    for i, (p, r) in enumerate(zip(batch.prompt_ids, batch.response_ids)):
        lp, old, a = hand_logprobs(model, p, r), torch.tensor(batch.old_logprobs[i]), advantages[i]
        if name == "gspo":  # sequence ratio, sequence clip, mean over sequences
            s = torch.exp((lp - old).mean())
            loss = loss - torch.minimum(s * a, torch.clamp(s, 1 - 0.05, 1 + 0.05) * a) / len(batch)
        elif name == "cispo":  # sg(clip(r)) A log pi, token mean, no lower bound
            w = torch.clamp(torch.exp(lp.detach() - old), 0.0, 1.28)
            loss = loss - (w * a * lp).sum() / tokens
        elif name == "ppo":  # per-token advantages, whitened over every token of the step; clip 0.2 both ways
            flat = [x for row in advantages for x in row]
            mean = sum(flat) / len(flat)
            std = math.sqrt(sum((x - mean) ** 2 for x in flat) / len(flat))
            ratio = torch.exp(lp - old)
            adv = (torch.tensor(a, dtype=torch.float64) - mean) / (std + 1e-6)
            loss = loss - torch.minimum(ratio * adv, torch.clamp(ratio, 0.8, 1.2) * adv).sum() / tokens
        else:  # PPO's clipped ratio (clip-higher 0.2 / 0.28), token mean
            ratio = torch.exp(lp - old)
            loss = loss - torch.minimum(ratio * a, torch.clamp(ratio, 0.8, 1.28) * a).sum() / tokens
    return loss


@pytest.mark.parametrize("name", ["grpo", "gspo", "cispo", "rloo", "reinforce_pp", "ppo"])
def test_trainer_gradient_matches_hand_written_loss(tiny_model, name):
    algorithm = load_config(None, [f"train.algorithm.name={name}"]
                            + (["train.algorithm.clip_low=0.05", "train.algorithm.clip_high=0.05"] if name == "gspo" else [])
                            ).train.algorithm
    trainer = TorchTrainer(tiny_model, lr=1e-2, grad_clip=1e9)
    batch = random_batch(5, seed=41)
    batch = with_old_logprobs(batch, trainer.logprobs(batch), noise=0.3, seed=41)
    if name == "ppo":  # one advantage per response token (GAE's), as the host writes them
        rng = random.Random(41)
        batch.advantages = [[rng.uniform(-1.5, 1.5) for _ in r] for r in batch.response_ids]
    hand = TorchTrainer(tiny_model).model
    loss = hand_loss(name, hand, batch)
    loss.backward()
    stats = trainer.train_step(batch, algorithm, minibatches=1)
    assert stats["loss"] == pytest.approx(loss.item(), abs=1e-6)
    grads = dict((n, p.grad) for n, p in hand.named_parameters())
    norm = torch.sqrt(sum((g**2).sum() for g in grads.values())).item()
    assert stats["grad_norm"] == pytest.approx(norm, rel=1e-5)
    for n, p in trainer.model.named_parameters():
        assert torch.allclose(p.grad, grads[n], rtol=1e-4, atol=1e-6 * norm), n
    assert set(stats) >= {"loss", "grad_norm", "tokens", "clip_fraction", "entropy", "kl_rollout", "kl_reference"}


@pytest.mark.parametrize("algorithm", [*(c() for c in ALGORITHMS), DPOConfig(rpo_alpha=0.0)], ids=lambda a: f"{a.name}-{a.statistics()[-1]}")
def test_each_algorithm_names_the_statistics_its_loss_returns(algorithm):
    """``statistics()`` (what the controller checks ``guard.max`` against, without torch) is what a pass returns."""
    empty = torch.zeros(0, 0, dtype=torch.float64)
    if algorithm.needs.pairs:
        returned = algorithm.pair_loss(*[torch.zeros(0, dtype=torch.float64)] * 5)[1]
    else:
        returned = algorithm.loss(empty, empty, torch.zeros(0, dtype=torch.float64), empty)[1]
    assert list(algorithm.statistics()) == list(returned)
