"""REINFORCE++ (Hu 2025): no critic and no per-prompt baseline; the advantage is the reward
normalised over the whole batch, and the update is PPO's clipped ratio, token-level mean.

    A_i = (r_i - mean_batch(r)) / std_batch(r)

"The whole batch" is the step's batch over every DP group: the advantages written by each group's
filter are the raw rewards, and the trainers whiten them with one all-reduce of (count, sum, sum
of squares) before the loss (``Needs.batch_whitening``, ``engines/rl/base.py``). The paper's KL
penalty sits in the per-token reward (k1); here, as for every algorithm, ``kl_coef`` adds a k3 KL
term to the loss instead (0 by default, as in the demo), since advantages are per sequence.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from engines.rl.algorithms import policy_loss_terms
from engines.rl.base import AlgorithmConfig


class ReinforcePPConfig(AlgorithmConfig):
    name: Literal["reinforce_pp"] = "reinforce_pp"
    whitened: ClassVar[bool] = True
    clip_low: float = Field(0.2, ge=0, description="Ratio clip below 1.")
    clip_high: float = Field(0.28, ge=0, description="Ratio clip above 1.")

    def advantages(self, rewards, groups):
        return [float(r) for r in rewards]  # whitened over the global batch by the trainer

    def loss(self, logprobs, old_logprobs, advantages, mask):
        per_token, clipped = policy_loss_terms(logprobs, old_logprobs, advantages, self.clip_low, self.clip_high)
        return per_token, {"clip_fraction": clipped}
