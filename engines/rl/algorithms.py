"""RL maths the algorithms share, on plain tensors: group advantages, PPO's clipped ratio,
the k3 KL, the loss weights, the step's statistics, the overlong penalty. Each algorithm's own
maths is in ``engines/rl/<name>.py`` (``engines/rl/registry.py`` lists them).

Nothing here knows about engines, storage or Prefect, so every formula is unit-tested
against the same formula written out by hand in ``tests/test_algorithms.py``. torch is imported inside
the functions that call it: the algorithms' config classes import this module, and the controller reads
those configs without loading torch (``tests/test_config.py``).
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Literal, Sequence

if TYPE_CHECKING:
    import torch


def group_advantages(
    rewards: Sequence[float], group_ids: Sequence[int], scale: Literal["std", "none"] = "std", eps: float = 1e-6
) -> list[float]:
    """GRPO advantage: a sample's reward minus its prompt group's mean.

    ``scale="std"`` divides by the group's standard deviation (GRPO, DAPO);
    ``scale="none"`` does not (Dr. GRPO, which argues the division biases towards
    easy and hard prompts).
    """
    import torch
    by_group: dict[int, list[float]] = defaultdict(list)
    for r, g in zip(rewards, group_ids):
        by_group[g].append(float(r))
    stats = {}
    for g, rs in by_group.items():
        t = torch.tensor(rs, dtype=torch.float64)
        stats[g] = (t.mean().item(), t.std(unbiased=False).item() if len(rs) > 1 else 0.0)
    out = []
    for r, g in zip(rewards, group_ids):
        mean, std = stats[g]
        out.append((r - mean) / (std + eps) if scale == "std" else r - mean)
    return out


def overlong_penalty(length: int, max_new_tokens: int, buffer: int, penalty: float = 1.0) -> float:
    """DAPO's soft overlong punishment: 0 until ``max_new_tokens - buffer`` tokens, then
    falling linearly to ``-penalty`` at ``max_new_tokens``."""
    if buffer <= 0:
        return 0.0
    expected = max_new_tokens - buffer
    if length <= expected:
        return 0.0
    return -penalty * min(length - expected, buffer) / buffer


def policy_loss_terms(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss of the clipped surrogate (DAPO's clip-higher: separate low/high
    bounds) plus ``kl_coef`` times the k3 estimate of KL(policy || reference).

    Shapes: ``[batch, tokens]`` for log-probabilities, ``[batch]`` or ``[batch, tokens]`` for
    advantages (see :func:`by_token`). Returns (per-token loss, per-token clipped indicator).
    """
    import torch
    adv = by_token(advantages)
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    loss = -torch.minimum(unclipped, clipped)
    if ref_logprobs is not None and kl_coef > 0:
        loss = loss + kl_coef * kl_k3(logprobs, ref_logprobs)
    return loss, (clipped < unclipped).float()


def by_token(advantages: torch.Tensor) -> torch.Tensor:
    """Advantages that broadcast over ``[batch, tokens]``: per sequence ``[batch]`` → ``[batch, 1]``;
    per token (an algorithm with a critic) as they are."""
    return advantages if advantages.dim() == 2 else advantages.unsqueeze(-1)


def kl_k3(logprobs: torch.Tensor, other_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(p || other) from tokens sampled from p (``logprobs`` are p's):
    r - log r - 1 with r = other / p; unbiased, never negative."""
    import torch
    log_ratio = other_logprobs - logprobs
    return torch.exp(log_ratio) - log_ratio - 1.0


def step_statistics(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor,
                    ref_logprobs: torch.Tensor | None = None) -> torch.Tensor:
    """Sums over the response tokens of one pass, for the step's metrics: [entropy, KL to the
    rollout policy, KL to the reference]. Entropy is the sampled-token estimate (-log p of the tokens
    the rollout policy drew, at its temperature); the KLs are k3 estimates, KL(rollout || current)
    and KL(current || reference) (0 without a reference)."""
    import torch
    new = logprobs.detach()
    kl_reference = (kl_k3(new, ref_logprobs) * mask).sum() if ref_logprobs is not None else new.new_zeros(())
    return torch.stack([-(old_logprobs * mask).sum(), (kl_k3(old_logprobs, new) * mask).sum(), kl_reference])


def token_weights(mask: torch.Tensor, aggregation: Literal["token", "sequence"], total: float) -> torch.Tensor:
    """Weights that turn a sum of per-token losses into the batch loss.

    ``token`` (DAPO): every token of the *global* batch counts the same, ``total`` is
    the number of response tokens over all DP groups. ``sequence`` (original GRPO):
    mean over each sequence's tokens, then over sequences; ``total`` is the number of
    sequences over all DP groups. Using global totals makes the sum of the groups'
    gradients equal to the gradient of one process on the concatenated batch.
    """
    if aggregation == "token":
        return mask / max(total, 1.0)
    lengths = mask.sum(-1, keepdim=True).clamp(min=1.0)
    return mask / lengths / max(total, 1.0)
