"""RLOO (Ahmadian et al. 2024, "Back to Basics"; Kool et al. 2019): REINFORCE with each sample's
baseline the mean reward of the *other* samples of its prompt, an unbiased baseline:

    A_i = r_i - 1/(k-1) * sum_{j != i} r_j   = k/(k-1) * (r_i - mean(r_group))

A one-sample group has no other sample: its advantage is 0. The update is PPO's clipped ratio
per token (the trainer takes ``train.minibatches`` steps per batch, so later minibatches are
slightly off-policy), token-level mean.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Literal

from pydantic import Field

from engines.rl.algorithms import policy_loss_terms
from engines.rl.base import AlgorithmConfig


def rloo_advantages(rewards, groups) -> list[float]:
    total: dict = defaultdict(float)
    count: dict = defaultdict(int)
    for r, g in zip(rewards, groups):
        total[g] += float(r)
        count[g] += 1
    return [float(r) - (total[g] - float(r)) / (count[g] - 1) if count[g] > 1 else 0.0 for r, g in zip(rewards, groups)]


class RLOOConfig(AlgorithmConfig):
    name: Literal["rloo"] = "rloo"
    clip_low: float = Field(0.2, ge=0, description="Ratio clip below 1.")
    clip_high: float = Field(0.28, ge=0, description="Ratio clip above 1.")

    def advantages(self, rewards, groups):
        return rloo_advantages(rewards, groups)

    def loss(self, logprobs, old_logprobs, advantages, mask):
        per_token, clipped = policy_loss_terms(logprobs, old_logprobs, advantages, self.clip_low, self.clip_high)
        return per_token, {"clip_fraction": clipped}
