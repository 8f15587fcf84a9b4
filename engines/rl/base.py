"""What every RL algorithm is made of, and the one loss step both trainers run.

An algorithm is one config class (a subclass of :class:`AlgorithmConfig` with a ``name`` literal,
in ``engines/rl/<name>.py``) that holds its own fields and two functions:

* ``advantages(rewards, groups)``: one step's kept samples of one DP group → their advantages,
  computed on the host before training (``engines/host/worker.py``'s dynamic filter); an
  algorithm with a critic (``Needs.critic``, PPO) has ``token_advantages(rewards, values)`` instead,
  one advantage per response token (``engines/host/critic.py``);
* ``loss(logprobs, old_logprobs, advantages, mask)``: per-token loss and per-token statistics.

and a record of what it needs from the run (:class:`Needs`). ``engines/rl/registry.py`` lists the
classes; ``train.algorithm`` in the run config is their discriminated union. Trainers own forward,
backward, micro-batches and the all-reduces; they hand the algorithm to :class:`LossStep`, which
turns log-probabilities into the pass's loss and sums its statistics, so the loss loop and the
names of the statistics live in ``engines/rl/loss_step.py`` once.

An algorithm that learns from preference pairs (``Needs.pairs``: DPO) has instead ``pairs(rewards,
groups)`` (which of a step's samples form each (chosen, rejected) pair) and ``pair_loss(chosen,
rejected, ref_chosen, ref_rejected)`` over sequence log-probabilities. Its rows travel as
consecutive (chosen, rejected) twos: ``Needs.unit`` is 2, and minibatches, micro-batches and the
DP balance cut only between pairs, so a pass always holds both sequences of a pair.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Hashable, Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:  # the configs are read by the controller, which imports no torch (tests/test_config.py)
    import torch


@dataclass(frozen=True)
class Needs:
    """What an algorithm needs beyond the policy and its rollout log-probabilities; the host
    and the trainers branch on these, never on an algorithm's name."""

    reference: bool = False  # a frozen copy of the starting policy (KL to it)
    batch_whitening: bool = False  # advantages normalised over the whole step, every DP group together
    critic: bool = False  # a value model (model.critic), trained beside the policy; advantages per token from its values
    pairs: bool = False  # trains on (chosen, rejected) pairs: ``pairs`` and ``pair_loss`` instead of ``advantages`` and ``loss``
    preferences: bool = False  # the pairs come from a preference dataset (``data.preferences``), not from rollouts

    @property
    def unit(self) -> int:
        """Consecutive rows that one loss term reads, which batching never separates."""
        return 2 if self.pairs else 1


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

    # -- pair algorithms (Needs.pairs) ---------------------------------------------------

    def statistics(self) -> tuple[str, ...]:
        """The names of the statistics ``loss`` returns (``pair_loss``, for a pair algorithm), in its order: what a
        step reports of this algorithm, known without torch (tests/test_rl_algorithms.py checks them against a pass)."""
        return ("clip_fraction",)  # the clipped ratio's (or weight's): every algorithm here but the pair ones

    def pairs(self, rewards: Sequence[float], groups: Sequence[Hashable]) -> list[tuple[int, int]]:
        """(chosen, rejected) indices of one step's samples of one DP group."""
        raise NotImplementedError

    def pair_loss(self, chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor,
                  ref_rejected: torch.Tensor, chosen_tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Per-pair loss [pairs] from sequence log-probabilities (sums over the response tokens) of
        the policy and the reference (``chosen_tokens``: the chosen responses' token counts), and
        per-pair statistics of the same shape (averaged over the step's pairs)."""
        raise NotImplementedError


SHARED_STATISTICS = ("entropy", "kl_rollout", "kl_reference")  # every algorithm's (algorithms.step_statistics)


def statistic_names(algorithm: AlgorithmConfig) -> list[str]:
    """The statistics a train step of ``algorithm`` reports besides loss, grad_norm and tokens: its loss's own,
    then ``SHARED_STATISTICS``."""
    return [*algorithm.statistics(), *SHARED_STATISTICS]
