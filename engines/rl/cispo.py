"""CISPO (MiniMax-M1, 2025): clip the importance-sampling weight, not the update, so every token
keeps its gradient (PPO's clip zeroes the gradient of clipped tokens, often the rare "fork"
tokens that matter most for reasoning).

    loss_t = -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) * A_i * log pi(y_i,t),   r_t = pi / pi_old

averaged over every token of the step (``loss_aggregation=token``), A_i the GRPO group advantage.
The paper sets no lower bound (a large eps_low) and tunes only eps_high: ``clip_low=1`` makes the
lower bound 0.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from engines.rl.algorithms import by_token, group_advantages
from engines.rl.base import AlgorithmConfig


def cispo_loss(logprobs, old_logprobs, advantages, mask, clip_low: float, clip_high: float):
    """Per-token loss and the per-token clipped-weight indicator."""
    import torch  # here: the controller reads this config without torch

    ratio = torch.exp(logprobs.detach() - old_logprobs)
    weight = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    return -weight * by_token(advantages) * logprobs, (weight != ratio).float()


class CISPOConfig(AlgorithmConfig):
    name: Literal["cispo"] = "cispo"
    clip_low: float = Field(1.0, ge=0, description="Weight clip below 1; 1 (the paper): no lower bound.")
    clip_high: float = Field(0.28, ge=0, description="Weight clip above 1 (epsilon_high, the one the paper tunes).")

    def advantages(self, rewards, groups):
        return group_advantages(rewards, groups, "std")

    def loss(self, logprobs, old_logprobs, advantages, mask):
        per_token, clipped = cispo_loss(logprobs, old_logprobs, advantages, mask, self.clip_low, self.clip_high)
        return per_token, {"clip_fraction": clipped}
