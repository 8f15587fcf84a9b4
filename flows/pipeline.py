"""Overlapping RL iterations (``rollout.max_staleness`` = k >= 1; docs/off-policy.md).

Each step is still its own ``iteration`` flow run, with one ``dp-group`` sub-flow per DP group;
with k >= 1 they overlap, and the Prefect UI shows them as overlapping runs:

    iteration-0004:  rollout → score → filter ─ wait for its turn ─ train → sync (→ checkpoint)
    iteration-0005:                    rollout → score → filter ─ wait ─ train → sync
    iteration-0006:                                     rollout → score → filter ─ ...

A DP group's generation of step m (its waves of rollout, scoring and filtering, on its host's
rollout lane) starts once its generation of step m-1 has ended (it continues the data cursors and
the dynamic-sampling carry-over) and its sync of step m-k-1 has returned, so its rollout engine then
holds weights of version >= m-k and the trainer, training step m at version m, is at most k
versions ahead of any fresh sample. Step m's iteration flow is started a step earlier than that
(once step m-k-2 has been recorded), so that Prefect's start-up of its flow runs is done by then and
the group starts generating as soon as its own sync returns. Training stays in step order: step m's train step waits for its *turn*, which this
module's driver gives once step m-1's iteration has ended and the run has recorded it (metrics,
held-out evaluation, the checkpoint to commit). The flows of one run meet here, in this process:
what step m's generation hands on, and the turns.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Awaitable, Callable

if TYPE_CHECKING:
    from flows.ledger import Checkpoint


class _Run:
    def __init__(self, first: int, k: int):
        self.first, self.k = first, k  # this attempt's first step; rollout.max_staleness
        self.generated: dict[tuple[int, int], asyncio.Future] = {}  # (step, group) -> (cursor, sampling) after its generation
        self.synced: dict[tuple[int, int], asyncio.Future] = {}  # (step, group) -> None once its weights are synced
        self.turns: dict[int, asyncio.Future] = {}  # step -> the earlier checkpoint still being written (or None)

    def future(self, table: dict, key) -> asyncio.Future:
        if key not in table:
            table[key] = asyncio.get_running_loop().create_future()
        return table[key]


_runs: dict[str, _Run] = {}


async def generated_then_turn(run: str, step: int, group: int, cursor: int, sampling: dict) -> Checkpoint | None:
    """A DP group of step ``step`` has generated its batch (its data cursor and dynamic-sampling
    state after it: where the next step's generation starts); wait for the step's turn to train.
    Returns the asynchronous checkpoint the hosts are still writing (committed by this step)."""
    r = _runs[run]
    r.future(r.generated, (step, group)).set_result((cursor, sampling))
    return await asyncio.shield(r.future(r.turns, step))


def synced(run: str, step: int, group: int) -> None:
    """A DP group's weight sync of ``step`` has returned: its generation of step + k may start."""
    r = _runs[run]
    r.future(r.synced, (step, group)).set_result(None)


async def generation_start(run: str, step: int, group: int) -> tuple[int, dict]:
    """Where a DP group's generation of ``step`` starts, once it may: its data cursor and
    dynamic-sampling state after its generation of ``step - 1``, answered when that has ended and
    the group's sync of ``step - k - 1`` has returned (steps before the run's first are in the
    weights the hosts loaded)."""
    r = _runs[run]
    if step - r.k - 1 >= r.first:
        await asyncio.shield(r.future(r.synced, (step - r.k - 1, group)))
    return await asyncio.shield(r.future(r.generated, (step - 1, group)))


def turn_given(run: str, step: int) -> Checkpoint | None:
    """What ``generated_then_turn`` answered step ``step``'s groups (the iteration commits it)."""
    return _runs[run].turns[step].result()


async def overlapped(run: str, k: int, first: int, end: int, cursors: list[int], sampling: list[dict] | None,
                     iteration: Callable[[int, list[int], list[dict] | None], Awaitable],
                     record: Callable[[object], Awaitable[object]]) -> None:
    """Steps ``first`` to ``end - 1``, up to ``k`` generations ahead of training: ``iteration(step,
    cursors, sampling)`` runs one step's flow, ``record(ended)`` books a finished step in order (its
    ``StepEnd``, in the run's ledger: flows/ledger.py) and returns its pending asynchronous checkpoint,
    which the next step's groups wait for and its iteration commits.

    A failed iteration fails the run at once (the others are cancelled: the run's restart or
    resume must not meet them in the hosts), even while an earlier step is still training."""
    if first >= end:
        return
    r = _runs[run] = _Run(first, k)
    tasks = {first: asyncio.ensure_future(iteration(first, cursors, sampling))}
    launched, written = first, None
    try:
        for step in range(first, end):
            r.future(r.turns, step).set_result(written)
            while launched + 1 < min(end, step + k + 2):  # launched+1 generates once its groups synced step launched-k
                launched += 1  # its groups start where launched-1's end, after their sync (generation_start)
                tasks[launched] = asyncio.ensure_future(iteration(launched, None, None))
            ended = await _watch(tasks[step], tasks)
            del tasks[step]
            written = await record(ended)
    except BaseException:
        for t in tasks.values():
            t.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        raise
    finally:
        _runs.pop(run, None)


async def _watch(target: asyncio.Future, tasks: dict[int, asyncio.Future]):
    """``target``'s result, failing as soon as any running iteration fails."""
    while not target.done():
        await asyncio.wait([target, *(t for t in tasks.values() if not t.done())], return_when=asyncio.FIRST_COMPLETED)
        for t in tasks.values():
            if t.done() and t is not target and (t.cancelled() or t.exception() is not None):
                return t.result()  # raises its error
    return target.result()
