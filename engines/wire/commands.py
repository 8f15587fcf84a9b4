"""The command contract between a DP group's controller and its engine host: one typed request
and one typed result per stage, each stage named once (its request's ``stage``).

A task builds a request, ``engines/wire/channel.py`` carries it as JSON (never pickles: the host is a
way into a process that holds the model), the host's ``Worker`` dispatches on its type
(``Worker.handle``) and the task gets the typed result back. Requests hold URIs, positions and
parameters, never sample data; results hold small metrics.

Adding a stage: a request and its result here, a handler on ``engines.host.worker.Worker``, a task
in ``tasks/stages.py``, a call in the flow.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict

from engines.config import RunConfig
from engines.evaluation import EvalSet, SetSums


class Result(BaseModel):
    model_config = ConfigDict(extra="forbid")

    host_s: float = 0.0  # seconds the host spent on the command (the channel sets it): the rest is orchestration

    @classmethod
    def merge(cls, results: list["Result"]) -> "Result":
        """One answer from a group's ranks' answers (engines/config/layout.py), the leader's first:
        the leader's, unless a stage's result says how its ranks' answers combine."""
        return results[0]


class Request(BaseModel):
    model_config = ConfigDict(extra="forbid")

    stage: ClassVar[str]  # the stage's one name: on the wire, in logs and in error messages
    result: ClassVar[type[Result]]
    alone: ClassVar[bool] = False  # a host answers it without the other DP groups (no collective inside)
    # which ranks of a DP group carry it out (``Layout.serving``): all of them (the trainer's stages,
    # collectives over the group's ranks), its leader alone, or the ranks holding a rollout engine
    # or a judge (rollout.replicas, judge.replicas: the first ranks of the group, the leader among them)
    ranks: ClassVar[Literal["all", "leader", "rollout", "judge"]] = "all"

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        REQUESTS[cls.stage] = cls


REQUESTS: dict[str, type[Request]] = {}  # stage name -> request type: how the host decodes a message


# --------------------------------------------------------------------------- before the first step


class ValidateInputsResult(Result):
    rows: dict[str, int]  # config field (data.prompts, data.heldout) -> prompts found


class ValidateInputs(Request):
    """Check prompts and model folders before any engine loads (no device time spent)."""

    stage = "validate_inputs"
    ranks = "leader"
    result = ValidateInputsResult
    config: RunConfig


class SetupEnginesResult(Result):
    seconds: float
    policy_version: int
    stream_length: int  # prompts in this group's stream
    # the checkpoint to resume from has files whose content is not what its manifest recorded (which,
    # named): nothing was loaded, and the controller takes an older checkpoint (storage.runstate.set_aside)
    damaged: str | None = None


class SetupEngines(Request):
    """Join the DP group (rendezvous at ``master``, rank 0's "host:port"), check the checkpoint to
    resume from (``damaged`` in the result when it is not what its manifest recorded), load the engines, resume."""

    stage = "setup_engines"
    result = SetupEnginesResult
    config: RunConfig
    resume: str | None = None  # a committed checkpoint's URI
    master: str | None = None


# --------------------------------------------------------------------------- one RL step


# What a step reports of its multi-turn episodes (engines/agents/episodes.py), per episode on average.
EPISODE_FIGURES = ("turns", "tool_calls", "tool_errors", "tool_s", "truncated")


class RolloutResult(Result):
    uri: str
    cursor: int  # the group's stream position after this wave
    prompts: int  # prompts drawn (G samples each)
    samples: int
    tokens: int
    truncated: int
    seconds: float
    switch_s: float = 0.0  # placement: seconds the engines took to hand the devices over
    busy_s: float = 0.0  # seconds the rollout engine generated for it (rollout.mode=stream: the lane, since the last take)
    stale_dropped: int = 0  # rollout.mode=stream: groups taken but older than rollout.max_staleness (not in ``uri``)
    ahead: list[int] = []  # rollout.mode=stream: prompts beyond ``cursor`` taken already (a straggler holds the cursor)
    # multi-turn episodes (rollout.env / rollout.tools): sums over this wave's episodes of ``EPISODE_FIGURES``
    episodes: dict[str, float] = {}


class Rollout(Request):
    """Sample G responses for the next ``count`` prompts of the group's stream from ``cursor``."""

    stage = "rollout"
    ranks = "rollout"
    alone = True
    result = RolloutResult
    step: int
    wave: int
    cursor: int
    count: int
    out: str


class GenRMScoreResult(Result):
    uri: str
    reward_mean: float
    accuracy: float | None  # mean rule reward (None: no rule)
    judge_agreement: float | None  # share of samples where the judge's verdict equals the rule
    unparsed_verdicts: int
    seconds: float
    switch_s: float = 0.0


class GenRMScore(Request):
    """Reward every rollout: the judge's verdict, the rule, the overlong penalty."""

    stage = "genrm_score"
    ranks = "judge"
    alone = True
    result = GenRMScoreResult
    rollouts: str
    out: str


class RolloutAndScoreResult(Result):
    rollout: RolloutResult
    score: GenRMScoreResult  # its ``seconds``: the judge busy
    seconds: float
    generate_s: float
    judge_busy_s: float
    judge_tail_s: float  # judge still scoring after the last chunk was generated
    queue_wait_s: float  # generator blocked on a full queue
    switch_s: float = 0.0


class RolloutAndScore(Request):
    """Partial colocation: ``Rollout`` and ``GenRMScore`` of one wave at once, chunks streaming to the judge."""

    stage = "rollout_and_score"
    ranks = "rollout"
    alone = True
    result = RolloutAndScoreResult
    step: int
    wave: int
    cursor: int
    count: int
    ahead: list[int] = []  # rollout.mode=stream: prompts beyond ``cursor`` taken already (engines/host/stream.py)
    rollouts_out: str
    scored_out: str


class DynamicFilterResult(Result):
    uri: str
    kept: int  # groups in this step's batch
    dropped_equal: int  # groups whose rewards were all equal
    new_kept: int  # groups kept from the last wave (the keep-ratio estimate's input)
    enough: bool  # the target was reached
    reason: str
    carried_in: int  # groups of earlier steps in this batch
    surplus: int  # kept groups beyond the target ...
    carried_out: int  # ... carried into the next step ...
    surplus_dropped: int  # ... or dropped
    carry: str | None  # the carry-over dataset, if anything is carried
    stale_dropped: int = 0  # of the dropped: more than rollout.max_staleness versions behind the trainer


class DynamicFilter(Request):
    """DAPO dynamic sampling: keep groups whose rewards differ (``carry_in`` first), up to the target."""

    stage = "dynamic_filter"
    alone = True
    result = DynamicFilterResult
    step: int
    scored: list[str]  # this step's waves so far
    out: str
    target_groups: int
    carry_in: str | None = None
    carry_out: str | None = None
    critic: bool = False  # the algorithm has a critic: its values are a collective over the group's ranks (TP, FSDP)

    @property
    def ranks(self) -> str:
        """The leader filters; with a critic every rank computes the values with it (the leader writes)."""
        return "all" if self.critic else "leader"


class TrainStepResult(Result):
    # the trainer's figures: loss and grad_norm (the step's, equal on every group) and the algorithm's
    # statistics per trained token of this group (engines.rl.loss_step.LossStep); the stub computes none
    statistics: dict[str, float]
    tokens: float  # response tokens this rank trained on
    seconds: float
    tokens_per_s: float
    sequences: int
    policy_version: int
    params_sha: str  # fingerprint of the trained weights: equal on every replica
    engine_loads: int  # times this host loaded its models (once per run is the point of a host)
    switch_s: float = 0.0
    staleness: dict[int, int] = {}  # samples by versions behind the trainer (0: on-policy); docs/off-policy.md
    # DP token balancing (engines/host/balance.py)
    tokens_before_balance: float
    sequences_before_balance: int
    rows_received: int
    balance_ratio: float  # max/mean of the groups' tokens after balancing (1.0: even)
    balance_ratio_before: float
    balance_s: float

    @classmethod
    def merge(cls, results: list["TrainStepResult"]) -> "TrainStepResult":
        shas = {r.params_sha for r in results}
        if len(shas) > 1:  # the group's ranks gathered different full weights: a shard went astray
            raise ValueError(f"the group's ranks disagree on the trained weights after the step: {sorted(shas)}")
        return results[0]


class TrainStep(Request):
    """One update with ``train.algorithm``'s loss on the group's experience; gradients all-reduced across every group."""

    stage = "train_step"
    result = TrainStepResult
    experience: str
    step: int | None = None  # the step it trains (an overlapping host's rollout lane may be a step ahead)


class SyncWeightsResult(Result):
    tensors: int
    seconds: float
    switch_s: float = 0.0


class SyncWeights(Request):
    """Trainer → rollout engine, by Hugging Face parameter name."""

    stage = "sync_weights"
    result = SyncWeightsResult
    timeout_s: float | None = None  # the controller's deadline: past it the host is lost (rollout.sync_timeout_s)


class CheckpointResult(Result):
    # each file written -> its size and SHA-256 (storage.runstate.file_record); None: still being
    # written (asynchronous; CheckpointWait answers them)
    files: dict[str, dict] | None
    asynchronous: bool
    stall_s: float  # how long training waited
    seconds: float

    @classmethod
    def merge(cls, results: list["CheckpointResult"]) -> "CheckpointResult":
        return results[0].model_copy(update={"files": _files(results), "stall_s": max(r.stall_s for r in results),
                                             "seconds": max(r.seconds for r in results)})


class Checkpoint(Request):
    """Write this rank's share of a checkpoint; the controller commits the manifest."""

    stage = "checkpoint"
    result = CheckpointResult
    uri: str


class CheckpointWaitResult(Result):
    uri: str | None  # None: no write was started since the last wait
    files: dict[str, dict] | None
    write_s: float
    wait_s: float

    @classmethod
    def merge(cls, results: list["CheckpointWaitResult"]) -> "CheckpointWaitResult":
        return results[0].model_copy(update={"files": _files(results), "write_s": max(r.write_s for r in results),
                                             "wait_s": max(r.wait_s for r in results)})


def _files(results) -> dict[str, dict] | None:
    """Every rank's files of one checkpoint (each writes its own shards and RNG state)."""
    if any(r.files is None for r in results):
        return None
    return {f: record for r in results for f, record in sorted(r.files.items())}


class CheckpointWait(Request):
    """Wait for the background checkpoint write; its files."""

    stage = "checkpoint_wait"
    alone = True
    result = CheckpointWaitResult


# --------------------------------------------------------------------------- around the run


class EvaluateResult(Result):
    score_sum: float  # the sum over this rank's prompts of the first set's greedy score (``heldout_metric``)
    total: int
    sets: dict[str, SetSums] = {}  # every set's sums over this rank's prompts (engines/evaluation.py)


class Evaluate(Request):
    """This rank's share of each evaluation set's first ``limit`` prompts, answered greedily and, with
    ``samples``, k times at ``temperature`` (seeded by ``seed``), each set scored by its rule, or by the
    judge's verdict (1 for ``judge.good``) when it has none (engines/evaluation.py)."""

    stage = "evaluate"
    ranks = "leader"
    alone = True
    result = EvaluateResult
    sets: list[EvalSet]
    samples: int = 0
    temperature: float = 1.0
    correct_at: float = 1.0
    seed: int = 0


class ExportPolicyResult(Result):
    uri: str


class ExportPolicy(Request):
    """Write the current policy as a Hugging Face folder (rank 0)."""

    stage = "export_policy"
    result = ExportPolicyResult
    uri: str


class PingResult(Result):
    pid: int
    rank: int


class Ping(Request):
    stage = "ping"
    result = PingResult


class Shutdown(Request):
    """Answered by the channel itself: the host exits."""

    stage = "shutdown"
    result = Result
