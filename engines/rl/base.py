"""What every RL algorithm is made of, and the one loss step both trainers run.

An algorithm is one config class (a subclass of :class:`AlgorithmConfig` with a ``name`` literal,
in ``engines/rl/<name>.py``) that holds its own fields and two functions:

* ``advantages(rewards, groups)``: one step's kept samples of one DP group → their advantages,
  computed on the host before training (``engines/host/worker.py``'s dynamic filter);
* ``loss(logprobs, old_logprobs, advantages, mask)``: per-token loss and per-token statistics.

and a record of what it needs from the run (:class:`Needs`). ``engines/rl/registry.py`` lists the
classes; ``train.algorithm`` in the run config is their discriminated union. Trainers own forward,
backward, micro-batches and the all-reduces; they hand the algorithm to :class:`LossStep`, which
turns log-probabilities into the pass's loss and sums its statistics, so the loss loop and the
names of the statistics live here once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, ClassVar, Hashable, Literal, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field

from engines.rl import algorithms


@dataclass(frozen=True)
class Needs:
    """What an algorithm needs beyond the policy and its rollout log-probabilities; the host
    and the trainers branch on these, never on an algorithm's name."""

    reference: bool = False  # a frozen copy of the starting policy (KL to it)
    batch_whitening: bool = False  # advantages normalised over the whole step, every DP group together


class AlgorithmConfig(BaseModel):
    """Fields every algorithm has; subclasses add their own and implement the two functions."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    whitened: ClassVar[bool] = False  # see Needs.batch_whitening

    loss_aggregation: Literal["token", "sequence"] = Field(
        "token", description="token: every response token of the step weighs the same (DAPO); "
        "sequence: mean over each sequence's tokens, then over sequences (GRPO, GSPO).")
    kl_coef: float = Field(0.0, ge=0, description="KL(policy || reference) coefficient, k3 estimator added to every "
                           "token's loss; > 0 loads a reference model (the starting policy).")

    @property
    def needs(self) -> Needs:
        return Needs(reference=self.kl_coef > 0, batch_whitening=self.whitened)

    def advantages(self, rewards: Sequence[float], groups: Sequence[Hashable]) -> list[float]:
        raise NotImplementedError

    def loss(self, logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
             mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Per-token loss [batch, tokens] and per-token statistics of the same shape (averaged over
        the response tokens for the step's metrics, e.g. ``clip_fraction``: 1 where clipped)."""
        raise NotImplementedError


SHARED_STATISTICS = ("entropy", "kl_rollout", "kl_reference")  # every algorithm's (algorithms.step_statistics)
DPSum = Callable[[list[float]], list[float]]  # the trainer's all-reduce: these numbers summed over the DP groups


class LossStep:
    """One ``train_step``'s loss and statistics, for a trainer that owns the passes.

    ``dp_sum`` must be called alike on every DP rank: it is (once here, with whitening) a
    collective. The trainer calls :meth:`count` per minibatch (to all-reduce), :meth:`__call__`
    per forward pass (backward on what it returns), :meth:`result` at the end.
    """

    def __init__(self, algorithm: AlgorithmConfig, advantages: Sequence[float], dp_sum: DPSum):
        self.algorithm = algorithm
        # per-token statistics summed over this rank's tokens (on the device once added to); their
        # names from a pass over no tokens, so that a rank given no rows reports them too (as 0)
        empty = torch.zeros(0, 0, dtype=torch.float64)
        names = [*algorithm.loss(empty, empty, torch.zeros(0, dtype=torch.float64), empty)[1], *SHARED_STATISTICS]
        self.sums = {name: torch.zeros((), dtype=torch.float64) for name in names}
        self.shift, self.scale = 0.0, 1.0
        if algorithm.needs.batch_whitening:
            # the step's batch is every DP group's rows: one all-reduce of count, sum, sum of squares
            n, s, ss = dp_sum([float(len(advantages)), float(sum(advantages)), float(sum(a * a for a in advantages))])
            mean = s / max(n, 1.0)
            self.shift, self.scale = mean, math.sqrt(max(ss / max(n, 1.0) - mean * mean, 0.0)) + 1e-6

    def count(self, response_ids: Sequence[Sequence[int]]) -> float:
        """This rank's share of a minibatch's normaliser: response tokens, or sequences."""
        return float(sum(len(r) for r in response_ids)) if self.algorithm.loss_aggregation == "token" else float(len(response_ids))

    def __call__(self, logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: Sequence[float],
                 mask: torch.Tensor, total: float, ref_logprobs: torch.Tensor | None = None,
                 weights: torch.Tensor | None = None) -> torch.Tensor:
        """The pass's share of the minibatch loss, ``total`` being the minibatch's DP-global count:
        the passes' losses sum to the minibatch's, and the DP groups' gradients to one process's.
        ``weights``: the off-policy correction per token (``engines/rl/off_policy.py``; None: 1),
        multiplying the algorithm's loss (not the KL to the reference, which is the current policy's)."""
        adv = (torch.tensor(advantages, dtype=logprobs.dtype, device=logprobs.device) - self.shift) / self.scale
        per_token, stats = self.algorithm.loss(logprobs, old_logprobs, adv, mask)
        if weights is not None:
            per_token = per_token * weights.to(device=per_token.device, dtype=per_token.dtype)
        if ref_logprobs is not None and self.algorithm.kl_coef > 0:
            per_token = per_token + self.algorithm.kl_coef * algorithms.kl_k3(logprobs, ref_logprobs)
        with torch.no_grad():
            entropy, kl_rollout, kl_reference = algorithms.step_statistics(logprobs, old_logprobs, mask, ref_logprobs)
            stats = {name: (value.detach().double() * mask).sum() for name, value in stats.items()}
            stats |= dict(zip(SHARED_STATISTICS, (entropy.double(), kl_rollout.double(), kl_reference.double())))
            for name, value in stats.items():
                self.sums[name] = self.sums[name] + value
        return (per_token * algorithms.token_weights(mask, self.algorithm.loss_aggregation, total)).sum()

    def result(self, tokens: float, **figures: float) -> dict[str, float]:
        """``figures`` (loss, grad_norm, tokens: the trainer's own) and every statistic per trained token."""
        return figures | {"tokens": tokens} | {name: value.item() / max(tokens, 1.0) for name, value in self.sums.items()}
