"""The streaming rollout lane (``rollout.mode=stream``; docs/off-policy.md#streaming).

Two threads on the group's host generate and score all along, whatever the step is doing. The
generating thread keeps ``placement.stream_chunk`` prompts' samples in flight and advances them
``rollout.segment_tokens`` at a time, one generate call per segment: a sample that ends frees its
slot, and the next prompt's samples take it at the next call, so no call waits long for a
straggler (a wave's chunk waits for its longest response). Between two calls it takes the newest
weights the trainer synced (``offpolicy.RolloutWeights``: staged while a call runs); a sample still
running then continues under them, each token keeping the version and the log-probability that
produced it (``rollout.partial=continue``), or starts again (``abort``). The scoring thread hands
each finished prompt group to the judge and rules (the worker's ``score``).

A step's ``take`` gets scored groups, the first drawn first: a straggler's group does not hold the
step up, it is taken by a later one. The group's data cursor (every prompt before it taken) and the
prompts taken beyond it (``ahead``) say exactly which prompts the run has taken: a checkpoint records
both, and a resume starts the lane there (what was in flight, or finished but not taken, is
generated again under the resumed weights). The lane keeps at most ``room`` groups drawn and not
taken: a step's (``sampling.target_groups``) and half as many again, spares so that a straggler's
group does not hold the next step up. So a group is generated while the step before its own, or the
one before that, trains: one or two versions behind. A long response, continued across weight updates, may fall further
behind: a group whose oldest token is more than ``rollout.max_staleness`` versions behind the
trainer when taken is dropped and counted (its prompt taken, not trained), as dynamic sampling
drops a group.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from engines.backends import chat
from engines.wire.channel import progress

log = logging.getLogger(__name__)


@dataclass
class Sample:
    """One response in the making: its tokens so far, each with its log-probability and version."""

    source: chat.Prompt  # what its first segment is generated from; later ones from prompt_ids + response_ids
    prompt_ids: list[int] | None = None
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # per response token: the policy version that sampled it
    text: str = ""
    done: bool = False
    truncated: bool = False

    def prompt(self) -> chat.Prompt:
        return self.source if self.prompt_ids is None else chat.Tokens(tuple(self.prompt_ids + self.response_ids))

    def restart(self) -> None:
        self.prompt_ids, self.response_ids, self.logprobs, self.versions, self.text = None, [], [], [], ""


@dataclass
class Group:
    index: int  # the prompt's position in the group's stream (the data cursor's unit)
    row: dict
    samples: list[Sample]
    scored: list[dict] | None = None  # its scored rows, once the scoring thread has them

    @property
    def done(self) -> bool:
        return all(s.done for s in self.samples)

    @property
    def oldest(self) -> int:
        return min(v for s in self.samples for v in s.versions)


@dataclass
class Figures:
    """What the lane did since it started."""

    busy_s: float = 0.0  # inside generate calls (a step's share: ``busy``)
    segments: int = 0
    restarted: int = 0  # samples started again under new weights (rollout.partial=abort)
    stale_dropped: int = 0  # groups taken but older than rollout.max_staleness


class StreamLane:
    """One group's streaming lane: ``take`` a step's scored groups; the threads generate and score the rest."""

    def __init__(self, policy, weights, prompt_at: Callable[[int], dict], score: Callable[[list[dict]], list[dict]], rollout,
                 slots: int, room: int, seed: Callable[[int], int]):
        self.policy, self.weights, self.prompt_at, self.score, self.ro = policy, weights, prompt_at, score, rollout
        self.slots, self.room, self.seed = slots, room, seed  # samples in flight; groups drawn and not taken, at most
        self.cond = threading.Condition()
        self.groups: list[Group] = []  # drawn, not taken, in prompt order
        self.cursor = self.drawn = 0  # every prompt before ``cursor`` taken; the next to draw
        self.ahead_taken: set[int] = set()  # prompts beyond the cursor taken (a straggler's group holds the cursor)
        self.figures, self._busy_read = Figures(), 0.0
        self.error: BaseException | None = None
        self._threads: list[threading.Thread] = []
        self._stop = False

    # -- the step's side --------------------------------------------------------------------

    def take(self, cursor: int, ahead: list[int], count: int, step: int, wave: int) -> tuple[list[dict], list[dict], int, list[int], int]:
        """``count`` scored groups, the first drawn first, for the trainer at version ``step``: their
        rollout rows and scored rows (G per prompt, prompt-major). ``cursor`` and ``ahead``: where
        the group's stream stands (every prompt before ``cursor`` taken, and those in ``ahead``
        beyond it); answers where it stands after them, and the groups dropped as too stale on the
        way. Starts (or restarts) the lane there."""
        if not self._threads or (cursor, sorted(ahead)) != (self.cursor, sorted(self.ahead_taken)):
            self.start(cursor, ahead)
        rolled, scored, dropped, k = [], [], 0, self.ro.max_staleness
        with self.cond:
            while len(scored) < count * self.ro.samples_per_prompt:
                if self.error is not None:
                    raise RuntimeError("the streaming rollout lane failed") from self.error
                group = next((g for g in self.groups if g.scored is not None), None)
                if group is None:
                    segments = self.figures.segments
                    self.cond.wait(timeout=1.0)
                    if self.figures.segments != segments:
                        progress()  # the lane is working: the command is not hung
                    continue
                self.groups.remove(group)
                self.ahead_taken.add(group.index)
                while self.cursor in self.ahead_taken:
                    self.ahead_taken.remove(self.cursor)
                    self.cursor += 1
                self.cond.notify_all()  # room to draw another prompt
                if step - group.oldest > k:
                    dropped += 1
                    continue
                rolled += [row | {"wave": wave} for row in self._rows(group)]
                scored += [row | {"wave": wave} for row in group.scored]
            self.figures.stale_dropped += dropped
        return rolled, scored, self.cursor, sorted(self.ahead_taken), dropped

    def busy(self) -> float:
        """Seconds the lane spent in generate calls since the last time this was asked."""
        with self.cond:
            busy, self._busy_read = self.figures.busy_s - self._busy_read, self.figures.busy_s
        return busy

    def start(self, cursor: int, ahead: list[int] = ()) -> None:
        """(Re)start the lane at prompt ``cursor``, the prompts in ``ahead`` beyond it taken
        already: whatever was in flight is dropped."""
        self.stop()
        self.groups, self.error, self._stop = [], None, False
        self.cursor, self.ahead_taken, self.drawn = cursor, set(ahead), cursor
        self.figures, self._busy_read = Figures(), 0.0
        self._threads = [threading.Thread(target=self._guarded, args=(work,), name=f"stream-{work.__name__.strip('_')}", daemon=True)
                         for work in (self._generate, self._score)]
        for thread in self._threads:
            thread.start()
        log.info("streaming rollout lane started at prompt %d (%d samples in flight, partial=%s)", cursor, self.slots,
                 self.ro.partial)

    def stop(self) -> None:
        with self.cond:
            self._stop = True
            self.cond.notify_all()
        for thread in self._threads:
            thread.join()
        self._threads = []

    def _rows(self, group: Group) -> list[dict]:
        row = group.row
        return [{"prompt_id": row["prompt_id"], "sample_index": j, "policy_version": min(s.versions), "wave": 0,
                 "prompt": row["prompt"], "answer": row["answer"], "prompt_row": row["prompt_row"], "prompt_ids": s.prompt_ids,
                 "response": s.text, "response_ids": s.response_ids, "logprobs": s.logprobs, "truncated": s.truncated,
                 "token_versions": s.versions} for j, s in enumerate(group.samples)]

    # -- the lane's threads -----------------------------------------------------------------

    def _guarded(self, work: Callable[[], None]) -> None:
        try:
            work()
        except BaseException as e:  # noqa: BLE001 - handed to the next take, on the command's thread
            log.exception("the streaming rollout lane failed")
            with self.cond:
                self.error, self._stop = e, True
                self.cond.notify_all()

    def _generate(self) -> None:
        while True:
            with self.cond:
                while not self._stop and not (active := self._draw()):
                    self.cond.wait()
                if self._stop:
                    return
            self._segment(active)
            with self.cond:
                self.cond.notify_all()

    def _score(self) -> None:
        """Each finished group's rows through the judge and rules, as many groups at once as are finished."""
        while True:
            with self.cond:
                while not self._stop and not (ready := [g for g in self.groups if g.done and g.scored is None]):
                    self.cond.wait()
                if self._stop:
                    return
            scored = self.score([row for g in ready for row in self._rows(g)])
            with self.cond:
                for i, g in enumerate(ready):
                    g.scored = scored[i * len(g.samples) : (i + 1) * len(g.samples)]
                self.cond.notify_all()

    def _draw(self) -> list[Sample]:
        """Draw prompts while a group's samples fit in the free slots and fewer than ``room`` groups
        are drawn and not taken; the samples in flight."""
        g = self.ro.samples_per_prompt
        in_flight = sum(not s.done for grp in self.groups for s in grp.samples)
        while in_flight + g <= max(self.slots, g) and len(self.groups) < self.room:
            if self.drawn not in self.ahead_taken:  # (a resume: taken before the checkpoint)
                row = self.prompt_at(self.drawn)
                self.groups.append(Group(self.drawn, row, [Sample(chat.source(row)) for _ in range(g)]))
                in_flight += g
            self.drawn += 1
        return [s for grp in self.groups for s in grp.samples if not s.done]

    def _segment(self, active: list[Sample]) -> None:
        """Every in-flight sample ``segment_tokens`` further (fewer where its response would pass
        ``max_new_tokens``: a call of its own), under the newest weights."""
        ro, by_length = self.ro, {}
        with self.weights as version:
            for s in active:
                if ro.partial == "abort" and s.versions and s.versions[0] != version:
                    s.restart()
                    self.figures.restarted += 1
                by_length.setdefault(min(ro.segment_tokens, ro.max_new_tokens - len(s.response_ids)), []).append(s)
            for length, samples in sorted(by_length.items(), reverse=True):
                t = time.perf_counter()
                gens = self.policy.generate([s.prompt() for s in samples], n=1, temperature=ro.temperature, top_p=ro.top_p,
                                            max_new_tokens=length, seed=self.seed(self.figures.segments))
                with self.cond:
                    self.figures.busy_s += time.perf_counter() - t
                for s, gen in zip(samples, gens):
                    s.prompt_ids = list(gen.prompt_ids) if s.prompt_ids is None else s.prompt_ids
                    s.response_ids += gen.response_ids
                    s.logprobs += gen.logprobs
                    s.versions += [version] * len(gen.response_ids)
                    s.text += gen.response
                    s.truncated = gen.truncated and len(s.response_ids) >= ro.max_new_tokens
                    s.done = s.truncated or not gen.truncated
        self.figures.segments += 1
