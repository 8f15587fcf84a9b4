"""PPO with a critic (Schulman et al. 2017, "Proximal Policy Optimization Algorithms"; GAE:
Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage
Estimation"), in the RLHF form of InstructGPT, OpenRLHF and veRL.

A value model V (the critic: ``model.critic``, by default the policy's folder with a fresh scalar
value head, ``engines/backends/torch/critic.py``) estimates, at every response token, the reward
still to come. The sequence's reward is the reward of its last token (every other token's is 0);
per response token t of a response of T tokens, with V_T = 0:

    delta_t = r_t + gamma * V_{t+1} - V_t
    A_t     = delta_t + gamma * lam * A_{t+1}            (A_T = 0)
    R_t     = A_t + V_t                                  (the critic's target, the "return")

The policy's loss is the clipped surrogate per token, -min(rho_t A_t, clip(rho_t, 1 - eps_low,
1 + eps_high) A_t), rho_t = pi / pi_old, with A_t whitened over every response token of the step
(all DP groups together, as veRL's ``masked_whiten``). The critic's loss per token is the clipped
value loss of OpenAI baselines' ppo2:

    L_V = 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -eps_v, eps_v) - R)^2)

V_old being the values the advantages were computed with (before the step). The critic has its
own AdamW (``critic_lr``; betas, weight decay and gradient clip are ``train``'s), so the paper's
value coefficient c1 (a shared network's loss weight) has no role here. The KL to the reference
(``kl_coef``) stays in the policy's loss (k3, like every algorithm here), not in the reward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal, Sequence

from pydantic import Field

from engines.rl.algorithms import policy_loss_terms
from engines.rl.base import AlgorithmConfig, Needs

if TYPE_CHECKING:  # torch is imported where a loss is computed: the controller reads this config without it
    import torch


def gae(rewards: Sequence[float], values: Sequence[Sequence[float]], gamma: float, lam: float
        ) -> tuple[list[list[float]], list[list[float]]]:
    """Per-token advantages and returns of each sequence: its reward on its last token, its
    values ``values[i]`` (one per response token). Plain Python floats: a step's few thousand
    tokens, computed once on the host."""
    advantages, returns = [], []
    for reward, v in zip(rewards, values):
        n = len(v)
        adv = [0.0] * n
        running = 0.0
        for t in reversed(range(n)):
            next_value = v[t + 1] if t + 1 < n else 0.0
            delta = (float(reward) if t == n - 1 else 0.0) + gamma * next_value - v[t]
            running = delta + gamma * lam * running
            adv[t] = running
        advantages.append(adv)
        returns.append([a + x for a, x in zip(adv, v)])
    return advantages, returns


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped value loss 0.5 * max((V - R)^2, (clip(V, V_old ± clip) - R)^2) and the
    per-token indicator of the clipped branch being the larger (its gradient is 0 there)."""
    import torch

    clipped_values = old_values + torch.clamp(values - old_values, -clip, clip)
    unclipped = (values - returns) ** 2
    clipped = (clipped_values - returns) ** 2
    return 0.5 * torch.maximum(unclipped, clipped), (clipped > unclipped).float()


class PPOConfig(AlgorithmConfig):
    name: Literal["ppo"] = "ppo"
    whitened: ClassVar[bool] = True  # per-token advantages, whitened over the step's tokens
    gamma: float = Field(1.0, ge=0, le=1, description="GAE discount gamma over response tokens (1: veRL's and OpenRLHF's "
                         "default; the reward is only on the last token).")
    lam: float = Field(1.0, ge=0, le=1, description="GAE lambda: 1 makes A_t = R - V_t (the critic only as a baseline, "
                       "veRL's default); lower trusts the critic's bootstrapped estimates more (less variance, more bias).")
    clip_low: float = Field(0.2, ge=0, description="Ratio clip below 1 (the paper's epsilon).")
    clip_high: float = Field(0.2, ge=0, description="Ratio clip above 1 (the paper's epsilon; > clip_low: DAPO's clip-higher).")
    value_clip: float = Field(0.2, gt=0, description="The critic's values move at most this far from the step's old values "
                              "before the clipped branch of the value loss takes over (OpenAI baselines' ppo2).")
    critic_lr: float | None = Field(None, gt=0, description="The critic's AdamW learning rate (its own optimiser; betas, "
                                    "weight decay and gradient clip are train's). None: train.lr.")

    @property
    def needs(self) -> Needs:
        return Needs(reference=self.kl_coef > 0, batch_whitening=True, critic=True)

    def advantages(self, rewards, groups):
        raise TypeError("ppo's advantages are per token, from the critic's values: token_advantages(rewards, values)")

    def token_advantages(self, rewards: Sequence[float], values: Sequence[Sequence[float]]):
        """(advantages, returns), per response token of each sequence (see :func:`gae`)."""
        return gae(rewards, values, self.gamma, self.lam)

    def loss(self, logprobs, old_logprobs, advantages, mask):
        per_token, clipped = policy_loss_terms(logprobs, old_logprobs, advantages, self.clip_low, self.clip_high)
        return per_token, {"clip_fraction": clipped}

    def critic_loss(self, values, old_values, returns):
        """The critic's per-token loss and its per-token statistics (``value_clip_fraction``)."""
        loss, clipped = value_loss(values, old_values, returns, self.value_clip)
        return loss, {"value_clip_fraction": clipped}
