"""The one loss step both trainers run: an algorithm's loss over a pass's log-probabilities, weighted
over the minibatch's DP-global count, with the statistics every step reports (``engines/rl/base.py``
says what an algorithm is made of)."""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

from engines.rl import algorithms
from engines.rl.base import SHARED_STATISTICS, AlgorithmConfig, statistic_names

DPSum = Callable[[list[float]], list[float]]  # the trainer's all-reduce: these numbers summed over the DP groups


def on_response_tokens(advantages: Sequence[float | Sequence[float]], mask: torch.Tensor) -> torch.Tensor:
    """``[batch, tokens]`` advantages laid out on the response positions of ``mask`` (row i has as
    many as its response tokens, in order); a sequence's single float on each of its tokens."""
    counts = mask.sum(-1).long().tolist()
    flat = [x for a, n in zip(advantages, counts) for x in (a if isinstance(a, (list, tuple)) else [a] * n)]
    out = torch.zeros(mask.shape, dtype=torch.float64)
    out[mask.cpu().bool()] = torch.tensor(flat, dtype=torch.float64)
    return out.to(mask.device)


class LossStep:
    """One ``train_step``'s loss and statistics, for a trainer that owns the passes.

    ``dp_sum`` must be called alike on every DP rank: it is (once here, with whitening) a
    collective. The trainer calls :meth:`count` per minibatch (to all-reduce), :meth:`__call__`
    per forward pass (backward on what it returns), :meth:`result` at the end.
    """

    def __init__(self, algorithm: AlgorithmConfig, advantages: Sequence[float], dp_sum: DPSum):
        self.algorithm = algorithm
        self.unit = algorithm.needs.unit  # rows per loss term: the trainers cut their batches between units
        # per-token statistics summed over this rank's tokens (on the device once added to); their
        # names as the algorithm declares them, so that a rank given no rows reports them too (as 0)
        names = statistic_names(algorithm)
        self.pair_statistics = set(names) - set(SHARED_STATISTICS) if algorithm.needs.pairs else set()
        self.sums = {name: torch.zeros((), dtype=torch.float64) for name in names}
        self.pairs = 0
        self.shift, self.scale = 0.0, 1.0
        if algorithm.needs.batch_whitening:
            # the step's batch is every DP group's rows (their tokens, with per-token advantages):
            # one all-reduce of count, sum, sum of squares
            flat = [x for a in advantages for x in (a if isinstance(a, (list, tuple)) else (a,))]
            n, s, ss = dp_sum([float(len(flat)), float(sum(flat)), float(sum(a * a for a in flat))])
            mean = s / max(n, 1.0)
            self.shift, self.scale = mean, math.sqrt(max(ss / max(n, 1.0) - mean * mean, 0.0)) + 1e-6

    def count(self, batch) -> float:
        """This rank's share of a minibatch's (a ``TrainBatch``) normaliser: trained tokens (an
        episode's observations not counted), sequences, or pairs."""
        if self.algorithm.needs.pairs:
            return float(len(batch) // 2)
        return float(sum(batch.trained_tokens())) if self.algorithm.loss_aggregation == "token" else float(len(batch))

    def __call__(self, logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: Sequence[float | Sequence[float]],
                 mask: torch.Tensor, total: float, ref_logprobs: torch.Tensor | None = None,
                 weights: torch.Tensor | None = None) -> torch.Tensor:
        """The pass's share of the minibatch loss, ``total`` being the minibatch's DP-global count:
        the passes' losses sum to the minibatch's, and the DP groups' gradients to one process's.

        ``advantages``: one per sequence (a float), or one per response token (a list per sequence,
        an algorithm with a critic); the loss then gets them as ``[batch]`` or ``[batch, tokens]``.
        ``weights``: the off-policy correction per token (``engines/rl/off_policy.py``; None: 1),
        multiplying the algorithm's loss (not the KL to the reference, which is the current policy's)."""
        if self.algorithm.needs.pairs:
            return self._pairs(logprobs, old_logprobs, mask, total, ref_logprobs)
        adv = (on_response_tokens(advantages, mask) if any(isinstance(a, (list, tuple)) for a in advantages)
               else torch.tensor(advantages, dtype=logprobs.dtype, device=logprobs.device))
        adv = (adv.to(logprobs.dtype) - self.shift) / self.scale
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

    def _pairs(self, logprobs, old_logprobs, mask, total, ref_logprobs) -> torch.Tensor:
        """A pass of (chosen, rejected) rows: sequence log-probabilities, the algorithm's pair loss, each
        pair weighted 1 / the minibatch's DP-global pair count."""
        if ref_logprobs is None:
            raise ValueError("a pair loss compares with the reference policy: the trainer computed no reference log-probs")
        seq, ref = (logprobs * mask).sum(-1), (ref_logprobs * mask).sum(-1)
        per_pair, stats = self.algorithm.pair_loss(seq[0::2], seq[1::2], ref[0::2], ref[1::2], mask[0::2].sum(-1))
        with torch.no_grad():
            shared = algorithms.step_statistics(logprobs, old_logprobs, mask, ref_logprobs)
            stats = {name: value.detach().double().sum() for name, value in stats.items()}
            stats |= dict(zip(SHARED_STATISTICS, shared.double()))
            for name, value in stats.items():
                self.sums[name] = self.sums[name] + value
        self.pairs += len(per_pair)
        return per_pair.sum() / max(total, 1.0)

    def add_up(self, sums: DPSum) -> None:
        """The statistics summed over ranks that split one batch between them (FSDP's group):
        ``sums`` adds a list of floats over them."""
        names = list(self.sums)
        totals = sums([float(self.sums[n]) for n in names] + [float(self.pairs)])
        self.sums = {n: torch.tensor(v, dtype=torch.float64) for n, v in zip(names, totals)}
        self.pairs = int(totals[-1])

    def result(self, tokens: float, **figures: float) -> dict[str, float]:
        """``figures`` (loss, grad_norm, tokens: the trainer's own) and every statistic per trained
        token (a pair statistic: per trained pair)."""
        return figures | {"tokens": tokens} | {
            name: value.item() / max(float(self.pairs if name in self.pair_statistics else tokens), 1.0)
            for name, value in self.sums.items()}
