"""The host's side of off-policy training (docs/off-policy.md): the correction of a train batch
before the trainer's passes, the staleness of its samples, and the lock that lets the rollout
engine generate while the trainer trains and takes the trainer's weights between two chunks
(``rollout.max_staleness`` >= 1).

Kept out of ``worker.py``: the worker calls these in one line each."""

from __future__ import annotations

import threading
from dataclasses import replace

from engines.backends.base import TrainBatch, load_weights
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
    masks = [m for p in pieces for m in (p.loss_mask or [None] * len(p))]
    weights, stats = correction_weights(flat_prox, flat_behaviour, train.off_policy_correction, train.tis_cap,
                                        train.mis_low, train.mis_high, masks)
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
    stats = {"staleness_mean": sum(k * c for k, c in counts.items()) / n, "staleness_max": float(max(counts))}
    streamed = [[v for v, m in zip(r["token_versions"], r.get("loss_mask") or [1] * len(r["token_versions"])) if m]
                for r in rows if r.get("token_versions")]  # rollout.mode=stream: per sampled token (an episode's observations not)
    streamed = [vs for vs in streamed if vs]
    if streamed:  # how far each token is behind, and how many samples mix versions (rollout.partial=continue)
        stats["token_staleness_mean"] = sum(trainer_version - v for vs in streamed for v in vs) / sum(len(vs) for vs in streamed)
        stats["mixed_version_fraction"] = sum(len(set(vs)) > 1 for vs in streamed) / len(streamed)
    return counts, stats


class RolloutWeights:
    """The rollout engine's weights, between an overlapping host's two lanes
    (``rollout.max_staleness`` >= 1; docs/off-policy.md).

    The rollout lane holds the engine for one chunk of prompts at a time (``with weights as
    version``), a held-out evaluation for its whole call. A weight sync never waits for either: if
    the engine is held, the trainer's weights are *staged* (copied to host memory, so the trainer
    can go on training) and loaded by whoever next takes the engine, before its chunk starts. So the
    train lane goes straight on to its next step, and every sample is still generated wholly by one
    policy version (the one loaded when its chunk started: ``version``). With k = 0 there is no
    second lane: a sync finds the engine free and loads the weights at once, as before."""

    def __init__(self, bucket_bytes: int = 64 << 20):
        self.bucket_bytes = bucket_bytes  # a sync's unit, gathered, loaded and checked (rollout.sync_bucket_mb)
        self.version = 0  # the trainer version whose weights the rollout engine holds
        self._lock = threading.RLock()  # the engine
        self._staged: tuple[object, int, list] | None = None  # (engine, version, [(name, tensor)]) not yet loaded
        self._slot = threading.Lock()  # ``_staged``: a newer staging is never lost to a load taking the older one

    def sync(self, engine, version: int, named_tensors) -> int:
        """The trainer's weights of ``version`` into ``engine``: loaded now if the engine is free,
        else staged for its next holder; checked bucket by bucket as they load (``base.load_weights``).
        Answers the number of tensors."""
        if self._lock.acquire(blocking=False):
            try:
                with self._slot:
                    self._staged = None  # superseded
                count = load_weights(engine, named_tensors, self.bucket_bytes)
                self.version = version
                return count
            finally:
                self._lock.release()
        # the rollout lane holds the engine: a copy, because the trainer's next step changes its tensors in place
        staged = [(name, tensor.detach().to("cpu", copy=True)) for name, tensor in named_tensors]
        with self._slot:
            self._staged = (engine, version, staged)
        if self._lock.acquire(blocking=False):  # the chunk ended meanwhile: nobody else will load it soon
            try:
                self._load_staged()
            finally:
                self._lock.release()
        return len(staged)

    def _load_staged(self) -> None:
        with self._slot:
            staged, self._staged = self._staged, None
        if staged is not None:
            engine, version, tensors = staged
            load_weights(engine, tensors, self.bucket_bytes)
            self.version = version

    def reset(self, version: int, bucket_bytes: int) -> None:
        """Engines (re)loaded from a folder of ``version``: nothing staged is theirs."""
        with self._lock, self._slot:
            self._staged, self.version, self.bucket_bytes = None, version, bucket_bytes

    def __enter__(self) -> int:
        """Hold the engine (the newest staged weights loaded first); the version it holds."""
        self._lock.acquire()
        try:
            self._load_staged()
        except BaseException:
            self._lock.release()
            raise
        return self.version

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
