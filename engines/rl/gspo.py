"""GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"): the importance ratio, its
clipping and the loss are per sequence.

    s_i = (pi(y_i) / pi_old(y_i)) ** (1 / |y_i|) = exp(mean_t(log pi(y_i,t) - log pi_old(y_i,t)))
    J   = mean_i min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i),  A_i the GRPO group advantage

The token-level form (the paper's GSPO-token, equal in value and gradient when every token of a
sequence has the same advantage, as here) is what the trainers' per-token loss needs:
s_i,t = sg[s_i] * pi(y_i,t) / sg[pi(y_i,t)], whose value is s_i and whose gradient is
s_i * grad log pi(y_i,t); averaged over the sequence's tokens (``loss_aggregation=sequence``)
it is the sequence-level gradient s_i A_i / |y_i| sum_t grad log pi(y_i,t). A sequence's
tokens are clipped together; the paper's eps are two orders of magnitude below the token
ratio's (3e-4 / 4e-4), since a geometric mean of ratios stays close to 1.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from engines.rl.algorithms import by_token, group_advantages
from engines.rl.base import AlgorithmConfig

if TYPE_CHECKING:  # torch is imported where a loss is computed: the controller reads this config without it
    import torch


def sequence_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """s_i,t: the value of the sequence's length-normalised ratio s_i on every token, the gradient
    of each token's own log-probability; [batch, tokens]."""
    lengths = mask.sum(-1).clamp(min=1.0)
    import torch

    log_s = ((logprobs - old_logprobs) * mask).sum(-1) / lengths  # [batch]
    return torch.exp(log_s.detach().unsqueeze(-1) + logprobs - logprobs.detach())


def gspo_loss(logprobs, old_logprobs, advantages, mask, clip_low: float, clip_high: float):
    """Per-token loss -min(s_i,t A_i, clip(s_i,t) A_i) and the per-token clipped indicator (a
    sequence's tokens all together)."""
    import torch

    ratio = sequence_ratio(logprobs, old_logprobs, mask)
    adv = by_token(advantages)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    return -torch.minimum(unclipped, clipped), (clipped < unclipped).float()


class GSPOConfig(AlgorithmConfig):
    name: Literal["gspo"] = "gspo"
    loss_aggregation: Literal["token", "sequence"] = Field(
        "sequence", description="sequence: the paper's mean over sequences (each its tokens' mean); token: every token weighs the same.")
    clip_low: float = Field(3e-4, ge=0, description="Sequence-ratio clip below 1 (the paper: 3e-4).")
    clip_high: float = Field(4e-4, ge=0, description="Sequence-ratio clip above 1 (the paper: 4e-4).")

    def advantages(self, rewards, groups):
        return group_advantages(rewards, groups, "std")

    def loss(self, logprobs, old_logprobs, advantages, mask):
        per_token, clipped = gspo_loss(logprobs, old_logprobs, advantages, mask, self.clip_low, self.clip_high)
        return per_token, {"clip_fraction": clipped}
