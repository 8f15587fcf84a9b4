"""Partial colocation (``placement.mode=partial``): one wave generated and judged at once.

The rollout engine and the judge are both resident. The command's thread generates the wave chunk
by chunk and puts every finished chunk on a bounded queue (``placement.queue_size``; a full queue
makes the generator wait); a judge thread takes the chunks as they come and scores them while the
rest of the wave is still generating (the judge is ``build.JudgeProcess``: a process on its own
share of the devices, so neither engine waits for the other's Python). On a CPU the group's threads
are split between the two. The chunks, their seeds and the judge's batches are the ones full
colocation (``rollout`` then ``genrm_score``) makes, so both modes produce the same samples.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from engines.host import rewards
from engines.host.waves import Waves
from engines.wire.commands import RolloutAndScore, RolloutAndScoreResult
from storage import datasets

log = logging.getLogger("yattflow.host")


@dataclass
class Wave:
    """What ``Beside.run`` made of a wave: rollout rows and scored rows by chunk, and its timings."""

    rolled: list[dict]  # what ``generated`` answered: the wave's rollout rows as written
    scored: dict[int, list[dict]]
    generate_s: float  # until the last chunk was generated
    judge_busy_s: float  # the judge thread's time scoring
    queue_wait_s: float  # the generator's time waiting for room on the queue


@dataclass
class Beside:
    """A group's generator and judge side by side (``waves``: its chunks, their seeds, what a sample
    is and how it is scored), on ``threads`` threads of which ``judge_threads`` are the judge's."""

    waves: Waves
    threads: int  # the group's
    judge_threads: int  # the judge thread's share of them
    queue_size: int

    def answer(self, r: RolloutAndScore, start: float, switch: float) -> RolloutAndScoreResult:
        """``rollout_and_score``'s outputs: this replica's chunks of the wave generated and scored,
        every replica's rows written where ``r`` says. ``start``: when the stage began; ``switch``: the
        seconds its placement took."""
        waves = self.waves
        chunks, role, write = waves.chunks(waves.prompts_at(r.cursor, r.count)), waves.replicas["rollout"], waves.writer(r.step)
        wave = self.run(r.step, role.mine(chunks), r.wave,
                        lambda done: role.join(r.rollouts_out, datasets.ROLLOUTS, done, len(chunks), write))
        flat = role.join(r.scored_out, datasets.SCORED, wave.scored, len(chunks), write)
        seconds = time.perf_counter() - start
        log.info("%s rollout_and_score wave %d: %.2fs (generating %.2fs, judge busy %.2fs, judge after the last chunk "
                 "%.2fs, generator waited on the queue %.2fs)", self.waves.name, r.wave, seconds, wave.generate_s,
                 wave.judge_busy_s, seconds - wave.generate_s, wave.queue_wait_s)
        return RolloutAndScoreResult(
            rollout=waves.rollout_result(wave.rolled, r.rollouts_out, r.wave, r.cursor, r.count, wave.generate_s, switch),
            score=rewards.score_result(waves.config.judge, r.scored_out, flat, wave.judge_busy_s, 0.0),
            seconds=seconds, generate_s=wave.generate_s, judge_busy_s=wave.judge_busy_s,
            judge_tail_s=seconds - wave.generate_s, queue_wait_s=wave.queue_wait_s, switch_s=switch)

    def stop(self) -> None:
        """Nothing runs between waves (a wave's threads end with it): what the streaming lane's ``stop`` is."""

    def run(self, step: int, chunks: list[tuple[int, list[dict]]], wave: int,
            generated: Callable[[dict[int, list[dict]]], list[dict]]) -> Wave:
        """Every chunk ``(k, prompts)`` of ``wave`` (of ``step``) generated here and scored on the judge thread;
        ``generated`` writes the rollout rows (by chunk) once the last chunk is generated, while the
        judge scores the tail. A failed judge stops the generating and fails the wave."""
        start = time.perf_counter()
        finished: queue.Queue = queue.Queue(maxsize=self.queue_size)
        scored: dict[int, list[dict]] = {}
        judge = {"busy_s": 0.0, "error": None}

        def judge_loop() -> None:
            torch.set_num_threads(self.judge_threads)  # an in-process judge's share of the cores
            while (item := finished.get()) is not None:
                if judge["error"] is not None:
                    continue  # keep draining: the generator never blocks on a failed judge
                t = time.perf_counter()
                try:
                    scored[item[0]] = self.waves.score_chunk(item[1])
                except BaseException as e:  # noqa: BLE001 - re-raised on the command's thread
                    judge["error"] = e
                judge["busy_s"] += time.perf_counter() - t

        thread = threading.Thread(target=judge_loop, name=f"genrm-judge-{self.waves.name}", daemon=True)
        thread.start()
        done, blocked, complete, rolled = {}, 0.0, False, []
        torch.set_num_threads(max(1, self.threads - self.judge_threads))
        try:
            for k, chunk in chunks:
                done[k] = self.waves.generate_chunk(step, wave, k, chunk)
                t = time.perf_counter()
                finished.put((k, done[k]))
                blocked += time.perf_counter() - t
                if judge["error"] is not None:
                    break  # the wave fails: stop generating
            else:
                complete = True
        finally:
            finished.put(None)
            torch.set_num_threads(self.threads)
        generate_s = time.perf_counter() - start
        if complete:  # while the judge scores the tail
            rolled = generated(done)
        thread.join()
        if judge["error"] is not None:
            raise RuntimeError(f"{self.waves.name}: the GenRM judge failed in wave {wave}") from judge["error"]
        return Wave(rolled, scored, generate_s, judge["busy_s"], blocked)
