"""The stage work of one DP group: what its engine host does with its engines.

``Worker`` reads top to bottom like one RL step: validate_inputs → setup_engines → rollout →
genrm_score (or rollout_and_score, partial colocation) → dynamic_filter → train_step →
sync_weights → checkpoint, then evaluate and export_policy around the run. Each stage takes its
``engines.wire.commands`` request and answers its result; ``Worker.handle`` dispatches a request to
its stage by type. Every stage reads its inputs from object storage and writes its outputs there
atomically; requests and results carry URIs and metrics, never sample data.

The modes are picked once, in ``setup_engines``, which loads the engines (engines/host/loading.py):
what a sample is (``samples``: a response, an episode, a preference pair; engines/host/samples.py)
and how a wave is produced: ``rollout`` then ``genrm_score`` (engines/host/waves.py, whose chunks
and seeds every mode shares), or ``rollout_and_score``'s ``produce``: the judge beside the generator
(engines/host/beside.py) or the streaming lane (engines/host/stream.py). Which engines hold the
devices at each stage: ``devices`` (engines/host/devices.py); an update's work: engines/host/update.py.
The stages ask none of it again.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import time
from datetime import timedelta

import torch

from engines.backends.base import Generator, Trainer, fingerprint
from engines.config import RunConfig
from engines.config.layout import Layout
from engines.host import (checkpointing, devices, experience, heldout, loading, offpolicy, replicas,
                          samples, update, validation)
from engines.host.beside import Beside
from engines.host.checkpointing import CheckpointDamaged, Checkpoints
from engines.host.devices import Devices
from engines.host.prompts import PromptStream
from engines.host.stream import StreamLane
from engines.host.waves import Waves, stable_seed
from engines.host.written import Written
from engines.wire.commands import (Checkpoint, CheckpointResult, CheckpointWait, CheckpointWaitResult, DynamicFilter,
                                   DynamicFilterResult, Evaluate, EvaluateResult, ExportPolicy, ExportPolicyResult, GenRMScore,
                                   GenRMScoreResult, Ping, PingResult, Request, Result, Rollout, RolloutAndScore,
                                   RolloutAndScoreResult, RolloutResult, SetupEngines, SetupEnginesResult, SyncWeights,
                                   SyncWeightsResult, TrainStep, TrainStepResult, ValidateInputs, ValidateInputsResult)
from storage import datasets

log = logging.getLogger("yattflow.host")


class Worker:
    """The engines of one rank (``rank`` of ``world``) of a DP group and the stage work done with them.

    A group of several ranks (``train.tensor_parallel``, engines/config/layout.py) splits its trainer
    between them; its leader, the first, holds the rollout engine and the judge, and with
    ``rollout.replicas`` / ``judge.replicas`` the next ranks hold more of them, which split a wave's
    chunks (engines/host/replicas.py; ``Request.ranks`` names who answers a stage)."""

    def __init__(self, rank: int, world: int, threads: int, rendezvous: socket.socket | None = None, *,
                 config: RunConfig | None = None, policy: Generator | None = None, trainer: Trainer | None = None,
                 critic=None, checkpoints: Checkpoints | None = None):
        """``config`` and the engines: what ``setup_engines`` would load, given instead (a test's stages
        on engines of its own, without loading a run)."""
        self.rank, self.world, self.threads = rank, world, threads
        self.layout = Layout(world)  # one rank per group until the run's config says more
        self.rendezvous = rendezvous  # rank 0 of a DP run: the listening socket its rendezvous store serves on
        self.config = config
        self.policy = policy  # the rollout engine
        self.judge: Generator | None = None  # the GenRM (None: no judge)
        self.trainer = trainer
        self.critic = critic  # an algorithm with a critic (Needs.critic): its value model (engines/host/critic.py)
        self.scorers: samples.Scorers | None = None  # the judge, the reward model and the rules, as a sample is scored
        self.samples: samples.Responses | None = None  # what a sample is: a response, an episode, a preference pair
        self.prompts: PromptStream | None = None  # this group's stream of prompts (rows rank, rank+world, ...)
        self.vision = False  # the policy is a vision-language model: prompts come with images
        self.checkpoints = checkpoints
        self.engine_loads = 0  # times this host loaded its models: once per run is the point of a host
        self.devices = Devices({"policy": [policy], "trainer": [trainer], "critic": [critic]},  # which hold the devices
                               {name for name, e in (("policy", policy), ("trainer", trainer), ("critic", critic)) if e is not None},
                               resident=bool(config and config.rollout.max_staleness))
        self.rollout_weights = offpolicy.RolloutWeights()  # the rollout engine, between an overlapping host's two lanes
        self.waves: Waves | None = None  # how a wave's chunks are made, seeded and scored (engines/host/waves.py)
        self.produce: Beside | StreamLane | None = None  # how rollout_and_score produces a wave (loading.producer)
        self.replicas = {role: replicas.Replicas(self.layout, rank, role) for role in replicas.ROLES}  # one of each
        self.written = Written()  # the stage outputs this host wrote lately: its next stages take them from here

    group = property(lambda self: self.layout.group(self.rank))  # this rank's DP group
    leader = property(lambda self: self.layout.local(self.rank) == 0)  # it holds the group's rollout engine and judge
    name = property(lambda self: self.layout.name(self.rank))  # in logs and faults: dp-1, its second rank dp-1.1

    @functools.singledispatchmethod
    def handle(self, request: Request) -> Result:
        raise TypeError(f"the engine host has no stage for {type(request).__name__}")

    # -- before the first step -----------------------------------------------------------

    @handle.register
    def validate_inputs(self, request: ValidateInputs) -> ValidateInputsResult:
        return ValidateInputsResult(rows=validation.validate_inputs(request.config))

    @handle.register
    def setup_engines(self, request: SetupEngines) -> SetupEnginesResult:
        """Join the DP group, load the engines once for the whole run (engines/host/loading.py), pick
        how waves are produced, resume if asked."""
        start = time.perf_counter()
        cfg = self.config = request.config
        torch.set_num_threads(self.threads)
        self.layout = loading.layout_of(cfg, self.rank, self.world)
        self.checkpoints = loading.checkpoints(cfg, self.rank, self.layout, request.resume)
        device = loading.device_of(cfg)
        loading.join(self.rank, self.world, request.master, cfg.host_timeout_s, device, self.rendezvous)
        self.rendezvous = None  # the store's now
        if self.world > 1:  # the rollout engines' and judges' replicas and their groups (again on a second setup)
            self.replicas = replicas.replica_groups(self.layout, self.rank, timedelta(seconds=cfg.host_timeout_s))
        if request.resume:  # every file as its manifest recorded it, before any engine loads
            try:
                self.checkpoints.verify(request.resume)
            except CheckpointDamaged as e:
                return SetupEnginesResult(seconds=time.perf_counter() - start, policy_version=-1, stream_length=0, damaged=str(e))
        rolls, judges = self.replicas["rollout"].here, self.replicas["judge"].here
        e = loading.load(cfg, self.layout, self.group, self.threads, device, rolls, judges, self.rollout_weights)
        self.trainer, self.critic, self.policy, self.judge = e.trainer, e.critic, e.policy, e.judge
        self.vision, self.prompts, self.scorers, self.samples = e.vision, e.prompts, e.scorers, e.samples
        self.devices = Devices({"policy": [e.policy], "judge": [e.judge, e.reward_model], "trainer": [e.trainer],
                                "critic": [e.critic]}, set(devices.NAMES), resident=bool(cfg.rollout.max_staleness))
        self.engine_loads += 1
        self.rollout_weights.reset(self.trainer.version, int(cfg.rollout.sync_bucket_mb * 2**20))  # both engines loaded the same folder
        if self.produce is not None:  # a second setup: the last one's lane stops
            self.produce.stop()
        self.waves = Waves(cfg, self.samples, self.prompts, self.replicas, self.layout, self.rank, self.written)
        self.produce = loading.producer(cfg, self.waves, self.policy, self.rollout_weights, self.threads, self.group)
        if request.resume:
            self.checkpoints.load(self.trainer, request.resume, self.critic)
            self.sync_weights(SyncWeights())
            log.info("%s: resumed from %s (policy version %d, parameters %s)", self.name, request.resume,
                     self.trainer.version, self.params_sha())
        rollout, judge = cfg.rollout.backend if rolls else "-", cfg.judge.backend if judges else "-"
        log.info("%s: engines (rollout=%s judge=%s train=%s) loaded in %.2fs, policy version %d", self.name, rollout, judge,
                 cfg.train.backend, time.perf_counter() - start, self.trainer.version)
        return SetupEnginesResult(seconds=time.perf_counter() - start, policy_version=self.trainer.version,
                                  stream_length=len(self.prompts))

    # -- one RL step ---------------------------------------------------------------------

    @handle.register
    def rollout(self, request: Rollout) -> RolloutResult:
        """Sample G responses for the next ``count`` prompts of this group's stream, chunk by chunk
        (engines/host/waves.py: the same chunks and seeds in every placement mode)."""
        start = time.perf_counter()
        return self.waves.rollout(request, start, self.devices.take("policy"))

    @handle.register
    def genrm_score(self, request: GenRMScore) -> GenRMScoreResult:
        """Reward = genrm_weight * judge verdict + rule_weight * rule + format_weight * format rule
        + reward_model_weight * reward model score + overlong penalty, chunk by chunk (engines/host/waves.py)."""
        start = time.perf_counter()  # full colocation: the rollout engine sleeps, the judge takes the devices
        return self.waves.score(request, start, self.devices.take("judge"))

    @handle.register
    def rollout_and_score(self, request: RolloutAndScore) -> RolloutAndScoreResult:
        """One wave's samples, generated and scored: ``rollout`` and ``genrm_score``'s outputs in one
        stage, produced as the host chose at setup (``produce``): the judge scoring each chunk as it
        comes (partial colocation, engines/host/beside.py) or the streaming lane's groups
        (``rollout.mode=stream``, engines/host/stream.py)."""
        start = time.perf_counter()
        return self.produce.answer(request, start, self.devices.take("policy", "judge"))

    @handle.register
    def dynamic_filter(self, request: DynamicFilter) -> DynamicFilterResult:
        """DAPO dynamic sampling: keep prompt groups whose rewards differ, up to the target, carried-over
        groups first (``experience.choose``). The chosen are written to ``out`` with their advantages, the
        carried to ``carry_out`` (schema ``CARRY``), which is removed when nothing is carried, so a
        retried or resumed filter leaves exactly its own answer."""
        cfg, r = self.config, request
        choice = experience.choose(cfg, r, self.written.rows(r.carry_in, datasets.CARRY) if r.carry_in else [],
                                   lambda uri: self.written.rows(uri, datasets.SCORED))
        trained = experience.advantaged(cfg.train, self.critic, [row for rows in choice.train for row in rows], self.devices.take)
        if self.leader:
            self.written.write(r.step, r.out, trained, datasets.EXPERIENCE)
            if choice.carry:
                self.written.write(r.step, r.carry_out, [row for rows in choice.carry for row in rows], datasets.CARRY)
            elif r.carry_out is not None:
                self.written.remove(r.carry_out)
        return choice.result(r)

    @handle.register
    def train_step(self, request: TrainStep) -> TrainStepResult:
        """One update with ``train.algorithm``'s loss, gradients all-reduced across every DP group
        (engines/host/update.py)."""
        start = time.perf_counter()
        switch = self.devices.take("trainer", "critic")  # training takes the group's devices (both placement modes)
        rows = self.written.rows(request.experience, datasets.EXPERIENCE)
        return update.train_step(self.trainer, self.critic, rows, request.experience, self.config.train, self.group,
                                 self.layout, self.rank, self.prompts.images if self.vision else None, start,
                                 switch_s=switch, engine_loads=self.engine_loads)

    @handle.register
    def sync_weights(self, request: SyncWeights) -> SyncWeightsResult:
        """Trainer → rollout engine, by Hugging Face parameter name."""
        start = time.perf_counter()
        switch = self.devices.take("policy", "trainer")  # a sleeping vLLM engine cannot load weights
        # overlapping: never waits for the rollout lane's chunk (staged for its next one instead)
        weights = self.trainer.export_weights()
        if self.policy is None:  # a rank that only trains: its shards go into the leader's gathered tensors (a collective)
            return SyncWeightsResult(tensors=sum(1 for _ in weights), seconds=time.perf_counter() - start, switch_s=switch)
        count = self.rollout_weights.sync(self.policy, self.trainer.version, weights)
        return SyncWeightsResult(tensors=count, seconds=time.perf_counter() - start, switch_s=switch)

    @handle.register
    def checkpoint(self, request: Checkpoint) -> CheckpointResult:
        """This rank's share of a checkpoint (``engines/host/checkpointing.py``), written in the
        background with ``checkpoint.asynchronous``; the controller commits the manifest."""
        self.devices.take(*self.devices.awake | {"trainer", "critic"})  # a sleeping trainer (or Megatron critic) is never read
        return self.checkpoints.save(self.trainer, request.uri, self.config.checkpoint.asynchronous, self.critic)

    @handle.register
    def checkpoint_wait(self, request: CheckpointWait) -> CheckpointWaitResult:
        return self.checkpoints.wait()

    # -- around the run ------------------------------------------------------------------

    @handle.register
    def evaluate(self, request: Evaluate) -> EvaluateResult:
        """Each evaluation set (``engines/evaluation.py``): this rank's share of its prompts answered and
        scored (engines/host/heldout.py)."""
        return heldout.evaluate(request, self.group, self.layout.dp, self.samples, self.scorers, self.devices.take,
                                self.rollout_weights, lambda uri: stable_seed(request.seed, "eval", uri, self.group),
                                self.config.judge.good)

    @handle.register
    def export_policy(self, request: ExportPolicy) -> ExportPolicyResult:
        """The current policy as a Hugging Face folder (engines/host/checkpointing.py: ``export_policy``)."""
        if self.group == 0:  # its ranks gather the weights (a collective with several), its leader writes
            lora = self.config.train.lora
            checkpointing.export_policy(self.trainer, self.critic, lora is not None and lora.export_merged, request.uri,
                                        upload=self.rank == 0)
        return ExportPolicyResult(uri=request.uri)

    @handle.register
    def ping(self, request: Ping) -> PingResult:
        return PingResult(pid=os.getpid(), rank=self.rank)

    def params_sha(self) -> str:
        """Fingerprint of the trainer's parameters this rank holds, where they are (no collective; a
        train step's ``params_sha`` is its group's, checked against the other replicas: replica_check.py)."""
        return fingerprint(self.trainer.local_parameters())
