"""The host's side of off-policy training (docs/off-policy.md): the correction of a train batch
before the trainer's passes, the staleness of its samples, and the lock that lets the rollout
engine generate while the trainer trains (``rollout.max_staleness`` >= 1).

Kept out of ``worker.py``: the worker calls these in one line each."""

from __future__ import annotations

import threading
from dataclasses import replace

from engines.backends.base import TrainBatch
from engines.host.balance import PresplitBatch, presplit
from engines.rl.off_policy import correction_weights, staleness_counts


def correct(trainer, batch: TrainBatch, train) -> tuple[TrainBatch, dict[str, float]]:
    """``train.old_policy=decoupled``: the batch with the trainer's own log-probabilities (the old
    policy, before this step's updates) as ``old_logprobs`` and the corrected weights old /
    behaviour as ``is_weights``; their statistics. ``bypass``: the batch as it is, no statistics.

    A balanced batch keeps its minibatches (``balance.presplit``): each is recomputed as it is."""
    if train.old_policy == "bypass":
        return batch, {}
    pieces = list(batch.parts) if isinstance(batch, PresplitBatch) else [batch]
    proximal = [trainer.logprobs(p) for p in pieces]  # no_grad forwards, before any optimizer step
    flat_prox = [lp for part in proximal for lp in part]
    flat_behaviour = [lp for p in pieces for lp in p.old_logprobs]
    weights, stats = correction_weights(flat_prox, flat_behaviour, train.off_policy_correction, train.tis_cap,
                                        train.mis_low, train.mis_high)
    out, at = [], 0
    for p, prox in zip(pieces, proximal):
        out.append(replace(p, old_logprobs=prox, is_weights=weights[at : at + len(p)]))
        at += len(p)
    return (presplit(out) if isinstance(batch, PresplitBatch) else out[0]), stats


def staleness(trainer_version: int, rows: list[dict]) -> tuple[dict[int, int], dict[str, float]]:
    """The histogram of this group's samples by versions behind the trainer, and its mean and max
    (statistics of the step, beside the IS ratios)."""
    counts = staleness_counts(trainer_version, [r["policy_version"] for r in rows])
    n = sum(counts.values())
    if not n:
        return counts, {}
    return counts, {"staleness_mean": sum(k * c for k, c in counts.items()) / n, "staleness_max": float(max(counts))}


class PolicyLock:
    """The rollout engine, between the two lanes of an overlapping host: generation holds it per
    chunk of prompts, a weight sync (and a held-out evaluation) for its whole call. A sync thus
    waits for at most one chunk, and every sample is generated wholly by one policy version (the
    version the engine held when its chunk started: ``Worker.policy_version``)."""

    def __init__(self):
        self._lock = threading.RLock()

    def __enter__(self):
        self._lock.acquire()
        return self

    def __exit__(self, *exc):
        self._lock.release()


def too_stale(config, step: int, rows: list[dict]) -> bool:
    """With ``rollout.max_staleness`` = k >= 1: whether a kept group, trained at ``step``, would be
    more than k versions behind the trainer (which has then taken ``step`` updates). Carried-over
    groups age by one version per step; a wave's own groups are never too stale (its rollout
    started from weights at most k versions old). k = 0 (on-policy steps): never, carry-over is
    ``sampling.max_carry_age``'s alone."""
    k = config.rollout.max_staleness
    return k > 0 and step - min(r["policy_version"] for r in rows) > k
