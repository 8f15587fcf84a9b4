"""GRPO, with DAPO's and Dr. GRPO's knobs: group-relative advantages and the clipped token ratio.

* GRPO (DeepSeekMath): A_i = (r_i - mean(r_group)) / std(r_group); loss per token
  -min(r_t A, clip(r_t, 1 - eps, 1 + eps) A) with r_t = pi(y_t) / pi_old(y_t), sequence mean.
* DAPO: clip-higher (``clip_low`` < ``clip_high``), token-level mean (``loss_aggregation=token``);
  its dynamic sampling and overlong penalty live in ``sampling`` and ``reward`` (any algorithm).
* Dr. GRPO: no division by the group's std (``advantage_scale=none``), token-level sums.

The default (DAPO's settings) is what the demo's figures were measured with.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from engines.rl.algorithms import group_advantages, policy_loss_terms
from engines.rl.base import AlgorithmConfig


class GRPOConfig(AlgorithmConfig):
    name: Literal["grpo"] = "grpo"
    advantage_scale: Literal["std", "none"] = Field("std", description="std: GRPO/DAPO; none: Dr. GRPO (r - group mean).")
    clip_low: float = Field(0.2, ge=0, description="Ratio clip below 1 (epsilon_low).")
    clip_high: float = Field(0.28, ge=0, description="Ratio clip above 1 (epsilon_high; DAPO clip-higher).")

    def advantages(self, rewards, groups):
        return group_advantages(rewards, groups, self.advantage_scale)

    def loss(self, logprobs, old_logprobs, advantages, mask):
        per_token, clipped = policy_loss_terms(logprobs, old_logprobs, advantages, self.clip_low, self.clip_high)
        return per_token, {"clip_fraction": clipped}
