"""The streaming rollout lane (``rollout.mode=stream``; docs/off-policy.md#streaming).

Two threads on the group's leader (the host holding its rollout engine) generate and score all
along, whatever the step is doing (with ``rollout.replicas`` > 1, on each replica's first rank:
a lane each over every n-th prompt, ``taken_by_all`` keeping one cursor between them). The generating thread keeps ``placement.stream_chunk``
prompts' samples in flight and advances them ``rollout.segment_tokens`` at a time, one generate
call per segment: a sample that ends frees its slot, and the next prompt's samples take it at the
next call, so no call waits long for a straggler (a wave's chunk waits for its longest response). Between two calls it takes the newest
weights the trainer synced (``offpolicy.RolloutWeights``: staged while a call runs); a sample still
running then continues under them, each token keeping the version and the log-probability that
produced it (``rollout.partial=continue``), or starts again (``abort``). The scoring thread hands
each finished prompt group to the judge and rules (``Waves.score_chunk``).

A step's ``take`` gets scored groups, the first drawn first: a straggler's group does not hold the
step up, it is taken by a later one. The group's data cursor (every prompt before it taken) and the
prompts taken beyond it (``ahead``) say exactly which prompts the run has taken: a checkpoint records
both, and a resume starts the lane there (what was in flight, or finished but not taken, is
generated again under the resumed weights). The lane keeps at most ``room`` groups drawn and not
taken: a step's (``sampling.target_groups``) and as many again, spares so that stragglers' groups do
not hold the next step up (with half as many the step waited 0.2 s for its groups on the long-tail
bench). So a group is generated while the step before its own, or the one or two before that,
trains. A long response, continued across weight updates, may fall further behind: a group whose
oldest token is more than ``rollout.max_staleness`` versions behind the trainer when taken is
dropped and counted (its prompt taken, not trained), as dynamic sampling drops a group.

With ``rollout.env`` or ``rollout.tools`` a sample is an episode (engines/agents/episodes.py) and
a segment is one turn: between two turns the newest weights load, so an episode spans weight
updates turn by turn, each sampled token keeping its version (an observation's tokens, never
trained, take the version of the turn before them). A turn's tools and environment step run on a
pool beside the lane while the other samples generate; the episode's next turn waits for them.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from engines.agents.episodes import Episode, Episodes
from engines.backends import chat
from engines.host import rewards
from engines.host.replicas import Replicas
from engines.host.waves import Waves
from engines.wire.channel import progress
from engines.wire.commands import RolloutAndScore, RolloutAndScoreResult
from storage import datasets

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
    decode: Callable[[list[int]], str] | None = None  # the engine's tokenizer's: the whole response's text at its end

    def prompt(self) -> chat.Prompt:
        return self.source if self.prompt_ids is None else chat.Tokens(tuple(self.prompt_ids + self.response_ids))

    def restart(self) -> None:
        self.prompt_ids, self.response_ids, self.logprobs, self.versions, self.text = None, [], [], [], ""

    def ready(self) -> bool:
        return not self.done

    def prepare(self) -> None:
        pass

    def tokens(self, ro) -> int:
        """This segment's length: ``segment_tokens``, fewer where the response would pass ``max_new_tokens``."""
        return min(ro.segment_tokens, ro.max_new_tokens - len(self.response_ids))

    def add(self, gen, version: int, ro) -> None:
        self.prompt_ids = list(gen.prompt_ids) if self.prompt_ids is None else self.prompt_ids
        self.response_ids += gen.response_ids
        self.logprobs += gen.logprobs
        self.versions += [version] * len(gen.response_ids)
        self.text += gen.response
        self.truncated = gen.truncated and len(self.response_ids) >= ro.max_new_tokens
        self.done = self.truncated or not gen.truncated
        if self.done and self.decode is not None:  # a character whose bytes two segments split decodes whole
            self.text = self.decode(self.response_ids)

    def columns(self) -> dict:
        return {"prompt_ids": self.prompt_ids, "response": self.text, "response_ids": self.response_ids,
                "logprobs": self.logprobs, "truncated": self.truncated}


@dataclass
class Turns:
    """An episode (``rollout.env`` / ``rollout.tools``) played a turn per segment; its tools and
    environment step on the lane's pool between two turns (``answer``: their future)."""

    play: Episodes
    row: dict
    pool: ThreadPoolExecutor  # the lane's, for tools and environment steps
    wake: Callable[[], None]  # the lane's: an answer is in
    episode: Episode | None = None  # started (the environment's reset) at its first segment, on the lane's thread
    versions: list[int] = field(default_factory=list)  # per response token (an observation's: its turn's)
    answer: Future | None = None
    finished: dict | None = None  # its rollout columns, once it ended

    @property
    def done(self) -> bool:
        return self.finished is not None

    def restart(self) -> None:
        self.episode, self.versions, self.answer = None, [], None

    def ready(self) -> bool:
        return not self.done and (self.answer is None or self.answer.done())

    def prepare(self) -> None:
        """Started, or its last turn's observation on it (both tokenize: the lane's thread, under the weights lock)."""
        if self.episode is None:
            self.episode = self.play._start(self.row)
        elif self.answer is not None:
            before, answer, self.answer = len(self.episode.response_ids), self.answer, None
            self.play._continue([self.episode], answer.result())
            self.versions += self.versions[-1:] * (len(self.episode.response_ids) - before)
        self._finish()

    def tokens(self, ro) -> int:
        return ro.max_new_tokens

    def prompt(self) -> chat.Prompt:
        return chat.Tokens(tuple(self.episode.prompt_ids + self.episode.response_ids))

    def add(self, gen, version: int, ro) -> None:
        before = len(self.episode.response_ids)
        self.play._sampled(self.episode, gen)
        self.versions += [version] * (len(self.episode.response_ids) - before)
        if not self.episode.done:
            self.answer = self.pool.submit(self.play._observe, [self.episode], self.episode.turns - 1)
            self.answer.add_done_callback(lambda _: self.wake())
        self._finish()

    def _finish(self) -> None:
        if self.episode is not None and self.episode.done and self.answer is None and self.finished is None:
            self.finished = self.episode.columns(self.play.renderer.tokenizer)

    def columns(self) -> dict:
        return self.finished


@dataclass
class Group:
    index: int  # the prompt's position in the group's stream (the data cursor's unit)
    row: dict
    samples: list[Sample] | list[Turns]
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
                 slots: int, room: int, seed: Callable[[int], int], episodes: Episodes | None = None, role: Replicas | None = None,
                 waves: Waves | None = None):
        self.policy, self.weights, self.prompt_at, self.score, self.ro = policy, weights, prompt_at, score, rollout
        self.waves = waves  # a host's lane (``of``): where ``answer`` writes its rows and how it reports them
        # rollout.replicas: this replica's lane draws prompts index, index + count, ... of the group's stream
        self.role = role if role is not None and role.count > 1 else None
        self.index, self.count = (role.index, role.count) if self.role else (0, 1)
        self.episodes, self.pool = episodes, None  # multi-turn: a sample is an episode, its tools and steps on the pool
        self.slots, self.room, self.seed = slots, room, seed  # samples in flight; groups drawn and not taken, at most
        self.cond = threading.Condition()
        self.groups: list[Group] = []  # drawn, not taken, in prompt order
        self.cursor = self.drawn = 0  # every prompt before ``cursor`` taken; the next to draw
        self.ahead_taken: set[int] = set()  # prompts beyond the cursor taken (a straggler's group holds the cursor)
        self.figures, self._busy_read = Figures(), 0.0
        self.error: BaseException | None = None
        self._threads: list[threading.Thread] = []
        self._stop = False
        self.took: list[int] = []

    @classmethod
    def of(cls, waves: Waves, policy, weights, seed: Callable[[int], int]) -> "StreamLane":
        """The lane of a group whose run streams (``waves``: engines/host/waves.py): its rollout engine
        ``policy`` and its ``weights``, its prompts, judge and rules, ``placement.stream_chunk``
        prompts' samples in flight, and room for a step's groups (``sampling.target_groups``) and as
        many again, split between the group's rollout replicas; ``seed``: segment n's."""
        cfg, role = waves.config, waves.replicas["rollout"]
        return cls(policy, weights, lambda i: waves.prompts_at(i, 1)[0], waves.score_chunk,
                   cfg.rollout, slots=cfg.placement.stream_chunk * cfg.rollout.samples_per_prompt,
                   room=-(-2 * cfg.sampling.target_groups // role.count), seed=seed,
                   episodes=waves.samples.episodes, role=role, waves=waves)

    def answer(self, r: RolloutAndScore, start: float, switch: float = 0.0) -> RolloutAndScoreResult:
        """``rollout_and_score``'s outputs from ``take``'s groups: the rollout and scored rows written where
        the request says (kept for the host's next stages: ``Waves.writer``), their figures
        (``Waves.rollout_result``). ``start``: when the stage began; ``switch``: none, every engine of a
        streaming run stays resident."""
        write = self.waves.writer(r.step)
        mine = len(range(self.index, r.count, self.count))  # this replica's share of the groups
        rows, scored, cursor, ahead, dropped = self.take(r.cursor, r.ahead, mine, r.step, r.wave)
        if self.role is not None:  # every replica's takes: the group's cursor and the prompts beyond it (the leader's answer)
            cursor, ahead, dropped = self.taken_by_all(dropped)
            rows = self.role.join(r.rollouts_out, datasets.ROLLOUTS, {self.index: rows}, self.count, write)
            scored = self.role.join(r.scored_out, datasets.SCORED, {self.index: scored}, self.count, write)
        else:
            write(r.rollouts_out, rows, datasets.ROLLOUTS)
            write(r.scored_out, scored, datasets.SCORED)
        seconds = time.perf_counter() - start
        rolled = self.waves.rollout_result(rows, r.rollouts_out, r.wave, r.cursor, r.count, seconds, switch)
        rolled = rolled.model_copy(update={"cursor": cursor, "ahead": ahead, "stale_dropped": dropped, "busy_s": self.busy()})
        return RolloutAndScoreResult(rollout=rolled, score=rewards.score_result(self.waves.config.judge, r.scored_out, scored, 0.0, 0.0),
                                     seconds=seconds, generate_s=seconds, judge_busy_s=0.0, judge_tail_s=0.0, queue_wait_s=0.0)

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
        self.took = []  # the prompts this take took (its groups and those dropped as too stale)
        with self.cond:
            while len(scored) < count * self.ro.samples_per_prompt:
                if self.error is not None:
                    raise self.error  # as it was raised on the lane's thread (an environment's EnvError names its prompt and turn)
                group = next((g for g in self.groups if g.scored is not None), None)
                if group is None:
                    segments = self.figures.segments
                    self.cond.wait(timeout=1.0)
                    if self.figures.segments != segments:
                        progress()  # the lane is working: the command is not hung
                    continue
                self.groups.remove(group)
                self._mark([group.index])
                self.took.append(group.index)
                self.cond.notify_all()  # room to draw another prompt
                if step - group.oldest > k:
                    dropped += 1
                    continue
                rolled += [row | {"wave": wave} for row in self._rows(group)]
                scored += [row | {"wave": wave} for row in group.scored]
            self.figures.stale_dropped += dropped
        return rolled, scored, self.cursor, sorted(self.ahead_taken), dropped

    def taken_by_all(self, dropped: int) -> tuple[int, list[int], int]:
        """After every replica's take (collective over the replicas): the prompts the others took
        marked taken here too; the group's cursor, the prompts beyond it taken, and the groups all
        replicas dropped as too stale."""
        sizes = [torch.zeros(1, dtype=torch.long) for _ in range(self.count)]
        dist.all_gather(sizes, torch.tensor([len(self.took) + 1]), group=self.role.group)
        width = int(max(sizes).item())
        mine = torch.full((width,), -1, dtype=torch.long)
        mine[: len(self.took) + 1] = torch.tensor([dropped, *self.took])
        every = [torch.empty(width, dtype=torch.long) for _ in range(self.count)]
        dist.all_gather(every, mine, group=self.role.group)
        with self.cond:
            self._mark([i for t in every for i in t[1:].tolist() if i >= 0])
            self.cond.notify_all()
            return self.cursor, sorted(self.ahead_taken), sum(int(t[0]) for t in every)

    def _mark(self, taken: list[int]) -> None:
        """Prompts taken (some maybe marked already): the cursor moves past every prompt taken before it."""
        self.ahead_taken.update(i for i in taken if i >= self.cursor)
        while self.cursor in self.ahead_taken:
            self.ahead_taken.remove(self.cursor)
            self.cursor += 1

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
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)  # (a tool call already running ends within rollout.tool_timeout_s)
            self.pool = None

    def _rows(self, group: Group) -> list[dict]:
        row = group.row
        return [{"prompt_id": row["prompt_id"], "sample_index": j, "policy_version": min(s.versions), "wave": 0,
                 "prompt": row["prompt"], "answer": row["answer"], "prompt_row": row["prompt_row"]} | s.columns()
                | {"token_versions": s.versions} for j, s in enumerate(group.samples)]

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
            # this replica's prompts only; not one taken before a resume's checkpoint
            if self.drawn % self.count == self.index and self.drawn not in self.ahead_taken:
                row = self.prompt_at(self.drawn)
                self.groups.append(Group(self.drawn, row, [self._sample(row) for _ in range(g)]))
                in_flight += g
            self.drawn += 1
        return [s for grp in self.groups for s in grp.samples if s.ready()]

    def _sample(self, row: dict) -> Sample | Turns:
        if self.episodes is None:
            tokenizer = getattr(self.policy, "tokenizer", None)  # (the timing stub has none)
            decode = None if tokenizer is None else (lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
            return Sample(chat.source(row), decode=decode)
        self.pool = self.pool or ThreadPoolExecutor(8, thread_name_prefix="stream-answers")
        return Turns(self.episodes, row, self.pool, self._wake)

    def _wake(self) -> None:
        with self.cond:
            self.cond.notify_all()

    def _segment(self, active: list[Sample] | list[Turns]) -> None:
        """Every in-flight sample ``segment_tokens`` further (fewer where its response would pass
        ``max_new_tokens``: a call of its own; an episode: one turn), under the newest weights."""
        ro, by_length = self.ro, {}
        with self.weights as version:
            for s in active:
                if ro.partial == "abort" and s.versions and s.versions[0] != version:
                    s.restart()
                    self.figures.restarted += 1
                s.prepare()  # an episode: started, or its observation added (it may end there)
                if not s.done:
                    by_length.setdefault(s.tokens(ro), []).append(s)
            for length, samples in sorted(by_length.items(), reverse=True):
                t = time.perf_counter()
                gens = self.policy.generate([s.prompt() for s in samples], n=1, temperature=ro.temperature, top_p=ro.top_p,
                                            max_new_tokens=length, seed=self.seed(self.figures.segments))
                with self.cond:
                    self.figures.busy_s += time.perf_counter() - t
                for s, gen in zip(samples, gens):
                    s.add(gen, version, ro)
        self.figures.segments += 1
