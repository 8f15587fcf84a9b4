"""Where a run stands, on the controller (``Ledger``), and the commit of its checkpoints.

The ledger is the train flow's record of the run between two steps: each DP group's data cursor
and dynamic-sampling state (the carried-over groups, the keep-ratio estimate) and the checkpoint the
hosts are still writing in the background. A step's ``iteration`` flow takes the run from one
ledger entry to the next and returns a ``StepEnd``; its metrics (``StepMetrics``) are what the step
measured, nothing the run resumes from. The committed checkpoints are the ledger's durable part:
``state.json`` and the checkpoints' manifests (``storage/runstate.py``), which a resume reads.

The commit protocol (``checkpoint.asynchronous``: the hosts write step n's checkpoint while step
n+1 runs), and the invariants it keeps:

1. ``state.json`` names only a checkpoint whose every group's files are written: a commit writes
   the manifest (each file's size and SHA-256, as the writers report them), then ``state.json``,
   then applies retention (``commit_checkpoint``). Only the holder of the run's lease commits.
2. A checkpoint carries its own step's cursors, sampling state and policy version (``Checkpoint``),
   from the step that wrote it to the step that commits it: a resume takes exactly the prompts and
   carried-over groups after that step, none lost, none trained twice.
3. One write at a time: step n+1's groups wait for step n's write (``checkpoint_wait``) after their
   own train step and sync, before they start their own checkpoint; step n+1's iteration commits
   step n's once every group has waited. A synchronous checkpoint is committed by its own step.
4. A run's last checkpoint is committed before the run ends (``finish``). A step that fails while
   its hosts are alive commits the write they were doing (``keep_pending``, ``PENDING_WAIT_S`` at
   most); a lost host's write is never committed, and the next attempt discards it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from prefect import get_run_logger
from pydantic import BaseModel

from engines.config import RunConfig
from engines.wire import channel
from engines.wire.commands import REQUESTS, CheckpointWaitResult
from flows import events
from flows.metrics import GroupStep, StepMetrics
from storage.lease import verify_held
from storage.runstate import RunState, checkpoint_uri, commit_checkpoint
from tasks import stages


class Checkpoint(BaseModel):
    """A checkpoint of step ``step`` and the run's place after that step, committed with it (invariant 2)."""

    step: int
    uri: str
    cursors: list[int]
    sampling: list[dict]
    policy_version: int


class StepEnd(BaseModel):
    """What a step's ``iteration`` returns: its metrics, and where it left the run."""

    metrics: StepMetrics
    cursors: list[int]  # each group's next prompt position
    sampling: list[dict]  # each group's dynamic-sampling state (flows/sampling.py ``GroupSampling``)
    written: Checkpoint | None = None  # this step's asynchronous checkpoint, still being written (the next step commits it)


@dataclass
class Ledger:
    """Where the run stands between two steps (the train flow's; module docstring)."""

    cursors: list[int]
    sampling: list[dict] | None  # None: a fresh start
    pending: Checkpoint | None = None  # written by the hosts in the background, not committed yet

    @classmethod
    def resumed(cls, state: RunState) -> "Ledger":
        """The ledger of a run (re)starting from its committed ``state``."""
        return cls(cursors=list(state.cursors), sampling=state.sampling or None)

    def advance(self, end: StepEnd) -> Checkpoint | None:
        """Book a step's end (in step order); returns its checkpoint still being written."""
        self.cursors, self.sampling, self.pending = end.cursors, end.sampling, end.written
        return self.pending

    async def finish(self, config: RunConfig) -> None:
        """Commit the pending checkpoint once every group has written it: the end of a run."""
        if self.pending is not None:
            await finish(config, self.pending)
            self.pending = None


def is_checkpoint_step(config: RunConfig, step: int, end: int | None = None) -> bool:
    """Every ``checkpoint.every`` steps, and at the last step of this run (so the next run resumes there)."""
    return (step + 1) % config.checkpoint.every == 0 or step == (config.steps if end is None else end) - 1


def close_step(config: RunConfig, step: int, end: int | None, groups: list[GroupStep], metrics: StepMetrics,
               written: Checkpoint | None) -> StepEnd:
    """Where step ``step`` leaves the run, once every group has ended it: commit ``written`` (the earlier
    checkpoint the groups waited for: invariant 3), then this step's own checkpoint, committed now when
    synchronous, else returned as ``written`` for the next step to commit."""
    cursors, sampling = [g.waves[-1].rollout.cursor for g in groups], [g.sampling for g in groups]
    if written is not None:
        commit(config, written, waited_files(written, [g.checkpoint_waited for g in groups]))
    mine = None
    if is_checkpoint_step(config, step, end):
        mine = Checkpoint(step=step, uri=checkpoint_uri(config.run_uri, step), cursors=cursors, sampling=sampling,
                          policy_version=metrics.policy_version)
        if not config.checkpoint.asynchronous:
            commit(config, mine, {f: r for g in groups if g.checkpoint for f, r in (g.checkpoint.files or {}).items()})
            mine = None
    return StepEnd(metrics=metrics, cursors=cursors, sampling=sampling, written=mine)


def commit(config: RunConfig, checkpoint: Checkpoint, files: dict[str, dict]) -> None:
    """Commit a checkpoint whose files are all written: manifest, then state.json (its step, data cursors,
    dynamic-sampling state and policy version), then retention (invariants 1 and 2)."""
    verify_held(config.run_uri)  # never commit for a run whose lease another run has taken
    state = RunState.load(config.run_uri)
    state.step, state.cursors, state.policy_version = checkpoint.step, checkpoint.cursors, checkpoint.policy_version
    state.sampling, state.checkpoint = checkpoint.sampling, checkpoint.uri
    commit_checkpoint(config.run_uri, state, files, config.checkpoint.keep_last, config.checkpoint.keep_every)
    events.emit(config, events.CHECKPOINT_COMMITTED,
                {"step": state.step, "uri": state.checkpoint, "policy_version": state.policy_version})


def waited_files(checkpoint: Checkpoint, waited: list[CheckpointWaitResult | None]) -> dict[str, dict]:
    """Every group's files of ``checkpoint`` (each with its size and SHA-256), from their ``checkpoint_wait`` results."""
    for group, w in enumerate(waited):
        if w is None or w.uri != checkpoint.uri or w.files is None:
            raise RuntimeError(f"dp-{group}: waited for the write of {checkpoint.uri}, the host reports {w}")
    return {f: record for w in waited for f, record in w.files.items()}


async def finish(config: RunConfig, checkpoint: Checkpoint) -> None:
    """Wait for every group's background write of ``checkpoint`` and commit it."""
    waited = await asyncio.gather(*(stages.checkpoint_wait(stages.Run.of(config), g, checkpoint.step) for g in range(config.dp)))
    commit(config, checkpoint, waited_files(checkpoint, list(waited)))


PENDING_WAIT_S = 60.0  # how long a failed run waits for its hosts to finish the checkpoint write it has not committed


async def keep_pending(config: RunConfig, checkpoint: Checkpoint) -> None:
    """A step failed while the hosts, alive (its input, a reward rule's bug, no prompt group kept; not a lost
    host), were still writing an earlier step's checkpoint in the background, which the failed iteration
    would have committed: commit it once every host has written it (``PENDING_WAIT_S`` at most), so that the
    same command continues from that step and not from the checkpoint before it (the next attempt discards an
    uncommitted write). Not while a host is in a stage that needs the other groups (a train step's all-reduce)
    and some group is not in it: that host answers nothing more. Never raises: the step's own error is what
    stops the run."""
    logger, done = get_run_logger(), checkpoint.step + 1  # steps 1-based, as the console counts them
    why = None
    try:
        state = RunState.load(config.run_uri)
        if state is not None and state.step >= checkpoint.step:
            return  # the failed iteration committed it before it failed
        busy = channel.in_flight(config.name, config.dp)  # the failed step's commands: their tasks are cancelled, they go on
        shared = {g: stage for g, stage in busy.items() if not REQUESTS[stage].alone}
        if config.controllers.groups_per_node:
            why = "the node controllers hold the groups' commands, which this process cannot see"
        elif shared and (len(shared) < config.dp or len(set(shared.values())) > 1):
            why = "dp-{} is still in its '{}', which waits for a group that will not come".format(*next(iter(shared.items())))
        else:
            await asyncio.wait_for(finish(config, checkpoint), PENDING_WAIT_S)
    except Exception as e:  # noqa: BLE001 - a host gone or slow: the resume discards the write
        why = (f"its hosts did not finish it within {PENDING_WAIT_S:g}s" if isinstance(e, TimeoutError)
               else f"{type(e).__name__}: {e}".splitlines()[0])
    if why:
        logger.warning("the checkpoint of step %d (%s) is not committed (%s); the same command resumes from the last "
                       "committed one", done, checkpoint.uri, why)
    else:
        logger.info("committed the checkpoint of step %d (%s), written while the failed step ran", done, checkpoint.uri)
