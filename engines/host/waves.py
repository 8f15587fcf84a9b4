"""How a DP group's samples are made, wave by wave, and the pieces every way of making them shares.

A wave is the next ``count`` prompts of the group's stream, in chunks of ``placement.stream_chunk``
prompts; chunk k is generated with the seed of its place (run seed, step, group, wave, k) and
scored in the same batches, so the samples are the same however the stages are placed:

- full colocation: ``Waves.rollout``, then ``Waves.score`` (the judge after, the devices switched
  between them);
- partial colocation: engines/host/beside.py (the judge beside the generator, chunk by chunk);
- ``rollout.mode=stream``: engines/host/stream.py (a lane generating all along, in segments).

What a sample is (a response, an episode, a preference pair): ``samples`` (engines/host/samples.py).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import time
from dataclasses import dataclass

from engines.backends import chat
from engines.config import RunConfig
from engines.config.layout import Layout
from engines.host import rewards
from engines.host.prompts import PromptStream
from engines.host.replicas import Replicas
from engines.host.samples import Responses
from engines.host.written import Written
from engines.wire.channel import progress
from engines.wire.commands import GenRMScore, GenRMScoreResult, Rollout, RolloutResult
from storage import datasets

log = logging.getLogger("yattflow.host")


def stable_seed(*parts) -> int:
    """A seed derived from (run seed, step, group, wave, ...): the same on every retry or resume."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:4], "little")


@dataclass
class Waves:
    """The waves of one rank (``rank`` of ``layout``): its group's prompts, its sample kind, its share
    of the rollout and judge replicas, and where its outputs are kept (``written``)."""

    config: RunConfig
    samples: Responses
    prompts: PromptStream
    replicas: dict[str, Replicas]
    layout: Layout
    rank: int
    written: Written

    group = property(lambda self: self.layout.group(self.rank))
    name = property(lambda self: self.layout.name(self.rank))

    def rollout(self, r: Rollout, start: float, switch: float) -> RolloutResult:
        """G samples for each of the ``r.count`` prompts from ``r.cursor`` on, this replica's chunks
        generated here, every replica's written to ``r.out`` (``start``: when the stage began;
        ``switch``: its placement's seconds)."""
        chunks, role = self.chunks(self.prompts_at(r.cursor, r.count)), self.replicas["rollout"]
        done = {k: self.generate_chunk(r.step, r.wave, k, chunk) for k, chunk in role.mine(chunks)}
        rows = role.join(r.out, datasets.ROLLOUTS, done, len(chunks), self.writer(r.step))  # every replica's chunks
        return self.rollout_result(rows, r.out, r.wave, r.cursor, r.count, time.perf_counter() - start, switch)

    def score(self, r: GenRMScore, start: float, switch: float) -> GenRMScoreResult:
        """The rollout's rows scored chunk by chunk (the batches ``rollout_and_score`` makes, so the
        judge's batched greedy verdicts are the same in both placement modes), written to ``r.out``."""
        cfg = self.config
        rows = self.written.rows(r.rollouts, datasets.ROLLOUTS)
        samples = self.chunks(rows, cfg.placement.stream_chunk * cfg.rollout.samples_per_prompt)
        role = self.replicas["judge"]
        scored = role.join(r.out, datasets.SCORED, {k: self.score_chunk(chunk) for k, chunk in role.mine(samples)},
                           len(samples), self.writer(None))  # (the request names no step: the rollout's)
        return rewards.score_result(cfg.judge, r.out, scored, time.perf_counter() - start, switch)

    def prompts_at(self, cursor: int, count: int) -> list[dict]:
        """The ``count`` prompts of this group's stream from ``cursor`` on, with the text the rule and judge read."""
        batch = [r | {"prompt": chat.question(r)} for r in self.prompts.wave(cursor, count)]
        if self.layout.local(self.rank) == 0 and (cursor + count - 1) // len(self.prompts) > cursor // len(self.prompts):
            log.warning("%s: all %d prompts of this group's stream trained; starting it again (another epoch)", self.name,
                        len(self.prompts))
        return batch

    def chunks(self, batch: list, size: int | None = None) -> list[list]:
        """``batch`` in pieces of ``size`` (default ``placement.stream_chunk``: prompts per chunk)."""
        size = size or self.config.placement.stream_chunk
        return [batch[i : i + size] for i in range(0, len(batch), size)]

    def generate_chunk(self, step: int, wave: int, k: int, chunk: list[dict]) -> list[dict]:
        """Rollout rows of chunk ``k`` of a wave, seeded by its place."""
        progress()  # the host's heartbeat (engines/wire/channel.py): each chunk is a piece of work done
        return self.samples.generate(chunk, wave, stable_seed(self.config.seed, step, self.group, wave, k))

    def score_chunk(self, rows: list[dict]) -> list[dict]:
        """``rows`` with their verdicts and rewards (new dicts: the rollout rows are left as they are)."""
        progress()
        return self.samples.score(rows)

    def writer(self, step: int | None):
        """How step ``step``'s stage outputs are written: kept for this host's next stages (``Written``)."""
        return functools.partial(self.written.write, step)

    def rollout_result(self, rows: list[dict], out: str, wave: int, cursor: int, count: int, seconds: float,
                       switch: float = 0.0) -> RolloutResult:
        """What the rollout of ``count`` prompts from ``cursor`` on, written to ``out``, answers."""
        tokens = sum(len(row["response_ids"]) for row in rows)
        log.info("%s rollout wave %d: %d prompts x %d samples, %d tokens in %.2fs", self.name, wave, count,
                 self.config.rollout.samples_per_prompt, tokens, seconds)
        episodes = self.samples.figures(rows)  # an episode's turns and tool calls
        return RolloutResult(uri=out, cursor=cursor + count, prompts=count, samples=len(rows), tokens=tokens, seconds=seconds,
                             busy_s=seconds, truncated=sum(row["truncated"] for row in rows), switch_s=switch, episodes=episodes)
