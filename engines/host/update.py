"""One update of a DP group's policy (and critic) on its step's experience: the ``train_step`` stage's work.

The group's batch is evened out with the other groups' first (``train.balance_tokens``:
engines/host/balance.py; the update is the same without it, up to float summation order), a vision
policy's rows get their prompts' images, ``train.old_policy=decoupled`` adds the trainer's own old
log-probabilities and the importance weights (engines/host/offpolicy.py), then the trainer takes
one step with ``train.algorithm``'s loss, its gradients all-reduced across every DP group, and a
critic the same step on the same rows and minibatches. The replicas' parameters are checked equal
after it (engines/host/replica_check.py).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable

from engines.backends.base import Trainer
from engines.config.layout import Layout
from engines.host import balance, offpolicy, replica_check
from engines.wire.commands import TrainStepResult


def train_step(trainer: Trainer, critic, rows: list[dict], experience: str, t, group: int, layout: Layout, rank: int,
               images: Callable[[list[int]], list] | None, start: float, **figures) -> TrainStepResult:
    """Rank ``rank`` of ``group`` trains on its ``rows`` (read from ``experience``; ``t``: the run's
    ``train`` section). ``images``: a vision policy's, by prompt row; ``start``: when the stage began;
    ``figures``: the result's own (the placement's ``switch_s``, the host's ``engine_loads``)."""
    unit = t.algorithm.needs.unit  # a pair's rows stay together
    batch, balanced = balance.balanced_batch(group, layout, experience, rows, t.minibatches, t.balance_tokens, unit)
    if images is not None:  # the rows reference their prompts' images: read them here, on the host that trains them
        batch = balance.presplit([replace(p, images=images(p.prompt_rows)) for p in batch.split(t.minibatches, unit)])
    batch, correction = offpolicy.correct(trainer, batch, t)  # train.old_policy=decoupled: old log-probs, IS weights
    stale, staleness = offpolicy.staleness(trainer.version, rows)
    statistics = trainer.train_step(batch, t.algorithm, minibatches=t.minibatches, micro_batch_tokens=t.micro_batch_tokens)
    if critic is not None:  # the same rows and minibatches; its statistics join the step's one dict
        statistics |= critic.train_step(batch, t.algorithm, minibatches=t.minibatches, micro_batch_tokens=t.micro_batch_tokens)
    statistics |= correction | staleness
    tokens = statistics.pop("tokens")
    seconds = time.perf_counter() - start
    return TrainStepResult(statistics=statistics, tokens=tokens, **balanced, seconds=seconds,
                           tokens_per_s=tokens / seconds if seconds else 0.0, sequences=len(batch),
                           policy_version=trainer.version, staleness=stale,
                           params_sha=replica_check.check(trainer.local_parameters(), layout, rank), **figures)
