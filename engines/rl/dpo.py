"""DPO (Rafailov et al. 2023, "Direct Preference Optimization"), offline: the policy learns from a
preference dataset's (prompt, chosen, rejected) rows (``data.preferences``), against a frozen
reference (the starting policy):

    L = -log sigmoid(beta * ((log pi(y_c|x) - log ref(y_c|x)) - (log pi(y_r|x) - log ref(y_r|x))))

with log pi(y|x) the sum of the response's token log-probabilities. beta * (log pi - log ref) is
the pair's implicit reward; the step reports its chosen and rejected means, their margin and the
share of pairs whose chosen sequence the policy already prefers (``pair_accuracy``).

``rpo_alpha`` adds RPO's term (Pang et al. 2024, "Iterative Reasoning Preference Optimization";
TRL's ``DPOConfig.rpo_alpha``): the chosen response's negative log-likelihood per token,

    L_RPO = L + alpha * (-log pi(y_c|x) / |y_c|)

DPO alone only asks for a *margin*; on pairs whose rejected side is a near miss of the chosen one
(the same digits but one) it widens the margin mostly by pushing both down, the rejected faster,
and the policy drifts off both (the demo at beta 0.1: +8.8 points, KL to the reference 1.9e5 per
token). The NLL term anchors the chosen response's likelihood, as the paper found for math.

The rows of a pair travel together (``Needs.unit``: 2), so the loss of a pair sees both of its
sequences in one forward pass; ``online_dpo`` (``engines/rl/online_dpo.py``) is the same loss on
pairs the policy samples every step.
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from engines.rl.base import AlgorithmConfig, Needs

if TYPE_CHECKING:  # torch is imported where a loss is computed: the controller reads this config without it
    import torch


def dpo_loss(chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor,
             beta: float, chosen_tokens: torch.Tensor | None = None,
             rpo_alpha: float = 0.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-pair DPO loss from sequence log-probabilities [pairs], and per-pair statistics; with
    ``rpo_alpha`` > 0, plus alpha times the chosen response's NLL per token (``chosen_tokens``: its
    response token counts [pairs])."""
    import torch.nn.functional as F

    chosen_reward, rejected_reward = beta * (chosen - ref_chosen), beta * (rejected - ref_rejected)
    margin = chosen_reward - rejected_reward
    stats = {"chosen_reward": chosen_reward.detach(), "rejected_reward": rejected_reward.detach(),
             "pair_margin": margin.detach(), "pair_accuracy": (margin.detach() > 0).to(margin.dtype)}
    loss = -F.logsigmoid(margin)
    if rpo_alpha > 0:
        if chosen_tokens is None:
            raise ValueError("rpo_alpha > 0 needs the chosen responses' token counts")
        nll = -chosen / chosen_tokens.to(chosen.dtype).clamp(min=1)
        stats["chosen_nll"] = nll.detach()
        loss = loss + rpo_alpha * nll
    return loss, stats


def best_and_worst(rewards, groups) -> list[tuple[int, int]]:
    """(chosen, rejected) per group, groups in the order they first appear: the first sample with the
    group's highest reward and the first with its lowest; a group whose rewards are all equal has no
    pair (nothing to prefer)."""
    members: dict = defaultdict(list)
    for i, g in enumerate(groups):
        members[g].append(i)
    pairs = []
    for indices in members.values():
        best = max(indices, key=lambda i: (rewards[i], -i))
        worst = min(indices, key=lambda i: (rewards[i], i))
        if rewards[best] > rewards[worst]:
            pairs.append((best, worst))
    return pairs


class DPOConfig(AlgorithmConfig):
    name: Literal["dpo"] = "dpo"
    # the fields every algorithm has mean nothing here: a pair loss is a mean over pairs, and beta is its KL
    loss_aggregation: Literal["token", "sequence"] = Field("token", description="Unused: the loss is a mean over pairs.")
    kl_coef: float = Field(0.0, ge=0, le=0, description="Unused (must stay 0): beta keeps the policy near the reference.")
    beta: float = Field(0.1, gt=0, description="Inverse temperature of the implicit reward beta * log(pi / ref): "
                        "how far from the reference the policy may move (the paper: 0.1 to 0.5).")
    rpo_alpha: float = Field(1.0, ge=0, description="Weight of RPO's chosen-response NLL per token added to each pair's "
                             "loss (Pang et al. 2024; TRL's rpo_alpha; the paper's 1.0): keeps the chosen responses "
                             "likely while the margin grows. 0: plain DPO.")

    @property
    def needs(self) -> Needs:
        return Needs(reference=True, pairs=True, preferences=True)

    def statistics(self) -> tuple[str, ...]:
        return ("chosen_reward", "rejected_reward", "pair_margin", "pair_accuracy", *(("chosen_nll",) if self.rpo_alpha > 0 else ()))

    def pairs(self, rewards, groups):
        # a preference row's two samples: chosen scored 1, rejected 0 (engines/host/preferences.py)
        return best_and_worst(rewards, groups)

    def pair_loss(self, chosen, rejected, ref_chosen, ref_rejected, chosen_tokens=None):
        return dpo_loss(chosen, rejected, ref_chosen, ref_rejected, self.beta, chosen_tokens, self.rpo_alpha)
