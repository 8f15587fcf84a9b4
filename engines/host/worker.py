"""The stage work of one DP group: what its engine host does with its engines.

``Worker`` reads top to bottom like one RL step: validate_inputs → setup_engines → rollout →
genrm_score (or rollout_and_score, partial colocation) → dynamic_filter → train_step →
sync_weights → checkpoint, then evaluate and export_policy around the run. Each stage takes its
``engines.wire.commands`` request and answers its result; ``Worker.handle`` dispatches a request to
its stage by type. Every stage reads its inputs from object storage and writes its outputs there
atomically; requests and results carry URIs and metrics, never sample data.

The modes are picked once, in ``setup_engines``: what a sample is (``samples``: a response, an
episode, a preference pair; engines/host/samples.py) and how ``rollout_and_score`` produces a wave
(``produce``: the judge beside the generator, engines/host/beside.py, or the streaming lane,
engines/host/stream.py). The stages ask neither again.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import socket
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist

from engines.agents.episodes import Episodes
from engines.evaluation import SetSums
from engines.host import balance, critic as critic_host, experience, heldout, offpolicy, replicas, rewards, samples, validation
from engines.host.beside import Beside
from engines.host.preferences import PreferenceRows
from engines.host.prompts import Frames, PromptStream
from engines.host.stream import StreamLane
from engines.host.written import Written

from engines.backends import chat, distributed, build, multimodal
from engines.wire.channel import progress
from engines.host.checkpointing import CheckpointDamaged, Checkpoints
from engines.host import replica_check
from engines.wire.commands import (Checkpoint, CheckpointResult, CheckpointWait, CheckpointWaitResult,
                              DynamicFilter, DynamicFilterResult, Evaluate, EvaluateResult, ExportPolicy, ExportPolicyResult,
                              GenRMScore, GenRMScoreResult, Ping, PingResult, Request, Result, Rollout, RolloutAndScore,
                              RolloutAndScoreResult, RolloutResult, SetupEngines, SetupEnginesResult, SyncWeights,
                              SyncWeightsResult, TrainStep, TrainStepResult, ValidateInputs, ValidateInputsResult)
from engines.config import RunConfig
from engines.config.layout import Layout
from engines.backends.base import Generator, Trainer, fingerprint
from storage import datasets, objectstore

log = logging.getLogger("yattflow.host")


def stable_seed(*parts) -> int:
    """A seed derived from (run seed, step, group, wave, ...): the same on every retry or resume."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:4], "little")


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
        self.reward_model = None  # the scalar reward model (model.reward_model; None: none), on the judge's side
        self.trainer = trainer
        self.critic = critic  # an algorithm with a critic (Needs.critic): its value model (engines/host/critic.py)
        self.scorers: samples.Scorers | None = None  # the judge, the reward model and the rules, as a sample is scored
        self.samples: samples.Responses | None = None  # what a sample is: a response, an episode, a preference pair
        self.prompts: PromptStream | None = None  # this group's stream of prompts (rows rank, rank+world, ...)
        self.vision = False  # the policy is a vision-language model: prompts come with images
        self.checkpoints = checkpoints
        self.engine_loads = 0  # times this host loaded its models: once per run is the point of a host
        self.awake = {name for name, engine in (("policy", policy), ("trainer", trainer), ("critic", critic))
                      if engine is not None}  # the engines holding the group's devices (see ``take``)
        self.rollout_weights = offpolicy.RolloutWeights()  # the rollout engine, between an overlapping host's two lanes
        self.stream: StreamLane | None = None  # rollout.mode=stream: the lane generating all along (engines/host/stream.py)
        self.produce = self._beside  # how rollout_and_score produces a wave: beside the judge, or the lane's (setup picks)
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
        """Join the DP group, load the engines once for the whole run, resume if asked."""
        start = time.perf_counter()
        cfg = self.config = request.config
        torch.set_num_threads(self.threads)
        size = cfg.layout.size
        if self.world % size:
            raise ValueError(f"this host is rank {self.rank} of {self.world}: not DP groups of {size} ranks")
        self.layout = replace(cfg.layout, dp=self.world // size)  # the hosts started: dp groups, or fewer to evaluate
        prompts_uri = cfg.uri(cfg.data.preferences or cfg.data.prompts)  # a preference dataset is the stream instead
        self.checkpoints = Checkpoints(self.rank, cfg.train.backend, datasets.part_files(prompts_uri), self.layout,
                                       cfg.train.distributed_optimizer, cfg.train.reshardable_optimizer)
        if request.resume:  # before any engine loads
            self.checkpoints.check_prompt_files(prompts_uri, request.resume,
                                                "data.preferences" if cfg.data.preferences else "data.prompts")
            self.checkpoints.check_layout(request.resume)
        # the timing stub trains nothing on a device: its one all-reduce is of a CPU tensor
        device = torch.device("cpu") if cfg.train.backend == "stub" else distributed.default_device()
        if self.world > 1 and not dist.is_initialized():
            timeout = timedelta(seconds=cfg.host_timeout_s)
            store = distributed.rendezvous_store(self.rank, self.world, request.master, timeout, self.rendezvous)
            self.rendezvous = None  # the store's now
            distributed.init_process_groups(device, self.rank, self.world, store, timeout)
        if self.world > 1:  # the rollout engines' and judges' replicas and their groups (again on a second setup)
            self.replicas = replicas.replica_groups(self.layout, self.rank, timedelta(seconds=cfg.host_timeout_s))
        if request.resume:  # every file as its manifest recorded it, before any engine loads
            try:
                self.checkpoints.verify(request.resume)
            except CheckpointDamaged as e:
                return SetupEnginesResult(seconds=time.perf_counter() - start, policy_version=-1, stream_length=0, damaged=str(e))
        policy_dir = objectstore.local_folder(cfg.uri(cfg.model.policy))
        self.vision = multimodal.is_vision_folder(policy_dir)
        if self.vision and cfg.rollout.mode == "stream":
            raise ValueError(f"rollout.mode=stream is not wired yet for a vision-language policy (model.policy="
                             f"{cfg.model.policy}): use rollout.mode=waves")
        self.trainer = build.make_trainer(cfg, policy_dir, device)
        if cfg.train.algorithm.needs.critic:
            self.critic = build.make_critic(cfg, objectstore.local_folder(critic_host.folder(cfg)), device)
        # the rollout engine and the scorers: the group's leader's, and its next ranks' with replicas
        rolls, judges = self.replicas["rollout"].here, self.replicas["judge"].here
        self.policy = (build.make_generator(cfg.rollout.backend, policy_dir, cfg, self.threads, device,
                                            tensor_parallel=cfg.rollout.tensor_parallel,
                                            record_routes=cfg.train.router_replay) if rolls else None)
        self.judge, judge_sees_images = None, False
        if cfg.reward.genrm_weight > 0 and judges:
            judge_dir = objectstore.local_folder(cfg.uri(cfg.model.judge))
            self.judge = build.make_judge(cfg, judge_dir, self.threads, device)
            judge_sees_images = self.vision and multimodal.is_vision_folder(judge_dir)
        self.reward_model = (build.make_reward_model(cfg, objectstore.local_folder(cfg.uri(cfg.model.reward_model)), self.threads,
                                                     device) if cfg.reward.reward_model_weight > 0 and judges else None)
        frames, placeholders = None, ()
        if self.vision:
            processor = multimodal.load_processor(policy_dir)
            if not judge_sees_images:  # an image in the policy's prompts, taken out of a text judge's
                placeholders = (multimodal.image_text(processor), multimodal.placeholder(processor))
            frames = Frames.of(cfg.data, processor)
        self.awake = {"policy", "judge", "trainer", "critic"}  # all loaded, all on the devices
        self.engine_loads += 1
        self.prompts = PromptStream(prompts_uri, self.group, self.layout.dp, cfg.data.max_image_bytes,
                                    datasets.PREFERENCES if cfg.data.preferences else datasets.PROMPTS,
                                    extra=cfg.rollout.env is not None, frames=frames,  # an environment reads every column
                                    max_image_pixels=cfg.data.max_image_pixels)
        limit = rewards.timeout_of(cfg)  # each call's (reward.rule_timeout_s): a hang is the rule's error, not a lost host
        self.scorers = samples.Scorers(
            cfg, self.judge, self.reward_model, rewards.load_rule(cfg.reward.rule, timeout_s=limit) if cfg.reward.rule else None,
            rewards.load_rule(cfg.reward.format_rule, "reward.format_rule", limit) if cfg.reward.format_rule else None,
            self.prompts, judge_sees_images, placeholders,
            # one judge call at a time: a streaming lane's scoring thread and an evaluation; overlapping lanes: the
            # held-out evaluation's judge and the rollout lane's never generate at once
            self.rollout_weights if cfg.rollout.overlapped else threading.Lock())
        self.samples = samples.of(cfg, self.policy, self.rollout_weights, self.scorers, vision=self.vision,
                                  episodes=Episodes.of(cfg, policy_dir) if cfg.rollout.episodes and rolls else None,
                                  pairs=PreferenceRows(policy_dir, cfg, self.vision) if cfg.data.preferences else None,
                                  version=lambda: self.trainer.version)
        self.rollout_weights.reset(self.trainer.version, int(cfg.rollout.sync_bucket_mb * 2**20))  # both engines loaded the same folder
        if self.stream is not None:
            self.stream.stop()
        self.stream = StreamLane.of(self, seed=lambda n: stable_seed(cfg.seed, "stream", self.group, self.replicas["rollout"].index, n)) \
            if cfg.rollout.mode == "stream" and rolls else None
        self.produce = self._streamed if self.stream is not None else self._beside  # how rollout_and_score produces a wave
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
        """Sample G responses for the next ``count`` prompts of this group's stream.

        Generated in chunks of ``placement.stream_chunk`` prompts, chunk k seeded by (seed, step,
        group, wave, k): the samples are the same whether the chunks run back to back here (full
        colocation) or stream to the judge in ``rollout_and_score`` (partial)."""
        start = time.perf_counter()
        switch = self.take("policy")
        chunks, role = self._chunks(self.prompts_at(request.cursor, request.count)), self.replicas["rollout"]
        done = {k: self._generate_chunk(request.step, request.wave, k, chunk) for k, chunk in role.mine(chunks)}
        rows = role.join(request.out, datasets.ROLLOUTS, done, len(chunks), self._writer(request.step))  # every replica's chunks
        return self.rollout_result(rows, request.out, request.wave, request.cursor, request.count, time.perf_counter() - start,
                                   switch)

    @handle.register
    def genrm_score(self, request: GenRMScore) -> GenRMScoreResult:
        """Reward = genrm_weight * judge verdict + rule_weight * rule + format_weight * format rule
        + reward_model_weight * reward model score + overlong penalty.

        The judge scores the rollout's chunks one by one (the same batches as in
        ``rollout_and_score``, so its batched greedy verdicts are the same in both placement modes)."""
        start = time.perf_counter()
        switch = self.take("judge")  # full colocation: the rollout engine sleeps, the judge takes the devices
        rows = self.written.rows(request.rollouts, datasets.ROLLOUTS)
        samples = self._chunks(rows, self.config.placement.stream_chunk * self.config.rollout.samples_per_prompt)
        role = self.replicas["judge"]
        scored = role.join(request.out, datasets.SCORED, {k: self.score_chunk(chunk) for k, chunk in role.mine(samples)},
                           len(samples), self._writer(None))  # (the request names no step: the rollout's)
        return rewards.score_result(self.config.judge, request.out, scored, time.perf_counter() - start, switch)

    @handle.register
    def rollout_and_score(self, request: RolloutAndScore) -> RolloutAndScoreResult:
        """One wave's samples, generated and scored: ``rollout`` and ``genrm_score``'s outputs in one
        stage, produced as the host chose at setup (``produce``): beside each other (partial
        colocation) or by the streaming lane (``rollout.mode=stream``)."""
        return self.produce(request)

    def _streamed(self, r: RolloutAndScore) -> RolloutAndScoreResult:
        """``rollout.mode=stream``: the groups the lane has generated and scored (engines/host/stream.py)."""
        return self.stream.answer(r, self.config.judge, self.rollout_result, self._writer(r.step))

    def _beside(self, r: RolloutAndScore) -> RolloutAndScoreResult:
        """Partial colocation: the judge scores each chunk as it comes (engines/host/beside.py)."""
        cfg = self.config
        start = time.perf_counter()
        switch = self.take("policy", "judge")
        chunks, role = self._chunks(self.prompts_at(r.cursor, r.count)), self.replicas["rollout"]  # = the judge's replicas
        beside = Beside(functools.partial(self._generate_chunk, r.step, r.wave), self.score_chunk, self.threads,
                        cfg.placement.judge_threads or max(1, self.threads // 2), cfg.placement.queue_size, self.name)
        wave = beside.run(role.mine(chunks), r.wave,
                          lambda done: role.join(r.rollouts_out, datasets.ROLLOUTS, done, len(chunks), self._writer(r.step)))
        flat = role.join(r.scored_out, datasets.SCORED, wave.scored, len(chunks), self._writer(r.step))
        seconds = time.perf_counter() - start
        log.info("%s rollout_and_score wave %d: %.2fs (generating %.2fs, judge busy %.2fs, judge after the last chunk "
                 "%.2fs, generator waited on the queue %.2fs)", self.name, r.wave, seconds, wave.generate_s,
                 wave.judge_busy_s, seconds - wave.generate_s, wave.queue_wait_s)
        return RolloutAndScoreResult(
            rollout=self.rollout_result(wave.rolled, r.rollouts_out, r.wave, r.cursor, r.count, wave.generate_s, switch),
            score=rewards.score_result(cfg.judge, r.scored_out, flat, wave.judge_busy_s, 0.0),
            seconds=seconds, generate_s=wave.generate_s, judge_busy_s=wave.judge_busy_s,
            judge_tail_s=seconds - wave.generate_s, queue_wait_s=wave.queue_wait_s, switch_s=switch)

    @handle.register
    def dynamic_filter(self, request: DynamicFilter) -> DynamicFilterResult:
        """DAPO dynamic sampling: keep prompt groups whose rewards differ, up to the target.

        ``request.scored``: this step's waves so far. Groups carried over from earlier steps
        (``carry_in``, the previous step's ``carry_out``) come first, oldest first, then this
        step's waves in order; the first ``target_groups`` are written to ``out`` with their
        advantages. The kept groups beyond the target are written to ``carry_out`` (schema
        ``CARRY``: with the step that generated them) if they will be at most
        ``sampling.max_carry_age`` steps old in the next step, and dropped otherwise;
        ``carry_out`` is removed when nothing is carried, so a retried or resumed filter leaves
        exactly its own answer."""
        cfg, r = self.config, request
        max_age = cfg.sampling.max_carry_age
        carried: dict[tuple[int, int, int], list[dict]] = defaultdict(list)  # (step, wave, prompt_id): rows
        if r.carry_in:
            for row in self.written.rows(r.carry_in, datasets.CARRY):
                carried[(row["step"], row["wave"], row["prompt_id"])].append(row)
        too_old = [key for key in carried if r.step - key[0] > max_age]  # only if max_carry_age was lowered
        too_old += (stale := [key for key in carried if key not in too_old and offpolicy.too_stale(cfg, r.step, carried[key])])
        for key in too_old:
            del carried[key]
        kept, equal, new_kept = experience.kept_groups(r.scored, r.step, cfg.sampling.filter_equal_rewards,
                                                       lambda uri: self.written.rows(uri, datasets.SCORED))
        candidates = list(carried.values()) + kept
        train, rest = candidates[: r.target_groups], candidates[r.target_groups :]
        young = [rows for rows in rest if r.step + 1 - rows[0]["step"] <= max_age] if r.carry_out is not None else []
        carry = [rows for rows in young if not offpolicy.too_stale(cfg, r.step + 1, rows)]  # rollout.max_staleness
        flat = [row for rows in train for row in rows]
        if cfg.train.algorithm.needs.critic:  # per-token advantages from the critic's values (full colocation: it wakes)
            self.take("critic")
            trained = critic_host.with_token_advantages(cfg.train.algorithm, self.critic, flat, cfg.train.micro_batch_tokens)
        else:
            trained = experience.training_rows(cfg.train.algorithm, flat)
        if self.leader:  # with a critic every rank of the group computed its values (a collective over TP)
            self.written.write(r.step, r.out, trained, datasets.EXPERIENCE)
            if carry:
                self.written.write(r.step, r.carry_out, [row for rows in carry for row in rows], datasets.CARRY)
            elif r.carry_out is not None:
                self.written.remove(r.carry_out)
        used = min(len(carried), r.target_groups)
        enough = len(train) >= r.target_groups
        reason = "target reached" if enough else f"{len(train)}/{r.target_groups} groups kept, {equal} had equal rewards"
        if used:
            reason += f" ({used} carried over from earlier steps)"
        return DynamicFilterResult(
            uri=r.out, kept=len(train), dropped_equal=equal, new_kept=new_kept, enough=enough, reason=reason, carried_in=used,
            surplus=len(rest), carried_out=len(carry), surplus_dropped=len(rest) - len(carry) + len(too_old),
            carry=r.carry_out if carry else None, stale_dropped=len(stale) + len(young) - len(carry))

    @handle.register
    def train_step(self, request: TrainStep) -> TrainStepResult:
        """One update with ``train.algorithm``'s loss; gradients are all-reduced across every DP group.

        With ``train.balance_tokens`` the groups first even out their work
        (``engines.host.balance.balanced_batch``); the update is the same without it, up to float
        summation order."""
        t = self.config.train
        start = time.perf_counter()
        switch = self.take("trainer", "critic")  # training takes the group's devices (both placement modes)
        rows = self.written.rows(request.experience, datasets.EXPERIENCE)
        unit = t.algorithm.needs.unit  # a pair's rows stay together
        batch, balanced = balance.balanced_batch(self.group, self.layout, request.experience, rows, t.minibatches,
                                                 t.balance_tokens, unit)
        if self.vision:  # the rows reference their prompts' images: read them here, on the host that trains them
            parts = batch.split(t.minibatches, unit)
            batch = balance.presplit([replace(p, images=self.prompts.images(p.prompt_rows)) for p in parts])
        batch, correction = offpolicy.correct(self.trainer, batch, t)  # train.old_policy=decoupled: old log-probs, IS weights
        stale, staleness = offpolicy.staleness(self.trainer.version, rows)
        statistics = self.trainer.train_step(batch, t.algorithm, minibatches=t.minibatches, micro_batch_tokens=t.micro_batch_tokens)
        if self.critic is not None:  # the same rows and minibatches; its statistics join the step's one dict
            statistics |= self.critic.train_step(batch, t.algorithm, minibatches=t.minibatches, micro_batch_tokens=t.micro_batch_tokens)
        statistics |= correction | staleness
        tokens = statistics.pop("tokens")
        seconds = time.perf_counter() - start
        return TrainStepResult(statistics=statistics, tokens=tokens, **balanced, seconds=seconds,
                               tokens_per_s=tokens / seconds if seconds else 0.0,
                               sequences=len(batch), policy_version=self.trainer.version, staleness=stale,
                               params_sha=replica_check.check(self.trainer.local_parameters(), self.layout, self.rank),
                               switch_s=switch, engine_loads=self.engine_loads)

    @handle.register
    def sync_weights(self, request: SyncWeights) -> SyncWeightsResult:
        """Trainer → rollout engine, by Hugging Face parameter name."""
        start = time.perf_counter()
        switch = self.take("policy", "trainer")  # a sleeping vLLM engine cannot load weights
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
        self.take(*self.awake | {"trainer", "critic"})  # a sleeping trainer (or Megatron critic) is never read
        return self.checkpoints.save(self.trainer, request.uri, self.config.checkpoint.asynchronous, self.critic)

    @handle.register
    def checkpoint_wait(self, request: CheckpointWait) -> CheckpointWaitResult:
        return self.checkpoints.wait()

    # -- around the run ------------------------------------------------------------------

    @handle.register
    def evaluate(self, request: Evaluate) -> EvaluateResult:
        """Each evaluation set (``engines/evaluation.py``): this rank's share of its first ``limit`` prompts
        answered greedily (with ``rollout.env`` or ``rollout.tools``: greedy episodes, the rule reading the
        whole episode) and, with ``request.samples``, k times at ``request.temperature``, scored by the set's
        rule, or by the judge's verdict when it has none. Sets on the same prompts share their answers."""
        by_data: dict[tuple[str, int], list] = {}
        for s in request.sets:
            by_data.setdefault((s.uri, s.limit), []).append(s)
        sums: dict[str, SetSums] = {}
        for (uri, limit), sets in by_data.items():
            rows = heldout.rows_of(uri, limit, self.group, self.layout.dp, self.prompts.frames)  # this rank's share
            if not rows:
                sums |= {s.name: SetSums() for s in sets}
                continue
            self.take("policy")
            with self.rollout_weights:  # overlapping: the rollout lane's engines wait (the judge too: one generate at a time)
                greedy, sampled = self.samples.answers(rows, request.samples, request.temperature,
                                                       stable_seed(request.seed, "eval", uri, self.group))
                if any(s.rule is None for s in sets):
                    self.take("judge")
                    verdicts = self.scorers.judge_answers(rows, greedy, sampled)
            for s in sets:
                scores = (heldout.verdict_scores(verdicts, self.config.judge.good) if s.rule is None else
                          heldout.rule_scores(self.scorers.rule_for(s.rule, s.rule_field), rows, greedy, sampled))
                sums[s.name] = heldout.sums_of(s, scores, sampled, request.correct_at)
        first = sums.get(request.sets[0].name) if request.sets else None
        return EvaluateResult(score_sum=first.greedy if first else 0.0, total=first.prompts if first else 0, sets=sums)

    @handle.register
    def export_policy(self, request: ExportPolicy) -> ExportPolicyResult:
        """The current policy as a Hugging Face folder (MANIFEST.json last). A sleeping trainer
        is not woken: its weights are read from its host copy. With ``train.lora`` the folder is the
        adapter's, and with ``train.lora.export_merged`` the merged model is in its ``merged/``."""
        if self.group == 0:  # its ranks gather the weights (a collective with several), its leader writes
            with tempfile.TemporaryDirectory() as tmp:
                self.trainer.save_hf(tmp)
                if self.critic is not None:  # PPO's critic beside it, loadable as model.critic (value_head.py)
                    self.critic.save_hf(os.path.join(tmp, "critic"))
                lora = self.config.train.lora
                if lora is not None and lora.export_merged:
                    self.trainer.save_merged(os.path.join(tmp, "merged"))
                if self.rank == 0:
                    objectstore.upload_folder(tmp, request.uri)
        return ExportPolicyResult(uri=request.uri)

    @handle.register
    def ping(self, request: Ping) -> PingResult:
        return PingResult(pid=os.getpid(), rank=self.rank)

    # -- placement -----------------------------------------------------------------------

    def take(self, *engines: str) -> float:
        """Make ``engines`` (of "policy", "judge", "trainer", "critic") the ones holding the group's devices:
        the others release them first (``sleep``: vLLM offloads its weights and drops its KV
        cache; the Megatron trainer moves weights, gradients and optimizer state to host memory,
        ``engines/backends/megatron/offload.py``), then these wake. Answers the seconds the switch took.

        Full colocation switches at every stage (rollout → score → train → sync); partial keeps
        policy and judge resident together through ``rollout_and_score``, and training still
        takes the devices alone. Stages that only read the trainer's weights (``export_policy``,
        ``params_sha``) read a sleeping trainer's host copy."""
        if self.config.rollout.max_staleness:
            return 0.0  # overlapping lanes: every engine stays resident (docs/off-policy.md)
        start = time.perf_counter()
        # "judge": the scorers, GenRM and scalar reward model (either may be None)
        engines_by_name = {"policy": [self.policy], "judge": [self.judge, self.reward_model], "trainer": [self.trainer],
                           "critic": [self.critic]}
        for name in sorted(self.awake - set(engines)):
            for engine in (e for e in engines_by_name[name] if e is not None):
                engine.sleep()
            self.awake.discard(name)
        for name in engines:
            for engine in (e for e in engines_by_name[name] if e is not None and name not in self.awake):
                engine.wake()
            self.awake.add(name)
        return time.perf_counter() - start

    # -- the pieces both placement modes share (same chunks, same seeds, same judge batches) --

    def prompts_at(self, cursor: int, count: int) -> list[dict]:
        """The ``count`` prompts of this group's stream from ``cursor`` on, with the text the rule and judge read."""
        batch = [r | {"prompt": chat.question(r)} for r in self.prompts.wave(cursor, count)]
        if self.leader and (cursor + count - 1) // len(self.prompts) > cursor // len(self.prompts):
            log.warning("%s: all %d prompts of this group's stream trained; starting it again (another epoch)", self.name, len(self.prompts))
        return batch

    def _writer(self, step: int | None):
        """How step ``step``'s stage outputs are written: kept for this host's next stages (``Written``)."""
        return functools.partial(self.written.write, step)

    def _chunks(self, batch: list, size: int | None = None) -> list[list]:
        """``batch`` in pieces of ``size`` (default ``placement.stream_chunk``: prompts per chunk)."""
        size = size or self.config.placement.stream_chunk
        return [batch[i : i + size] for i in range(0, len(batch), size)]

    def _generate_chunk(self, step: int, wave: int, k: int, chunk: list[dict]) -> list[dict]:
        """Rollout rows of chunk ``k`` of a wave (``samples``: what a sample is), seeded by its place."""
        progress()  # the host's heartbeat (engines/wire/channel.py): each chunk is a piece of work done
        return self.samples.generate(chunk, wave, stable_seed(self.config.seed, step, self.group, wave, k))

    def score_chunk(self, rows: list[dict]) -> list[dict]:
        """``rows`` with their verdicts and rewards (new dicts: the rollout rows are left as they are)."""
        progress()
        return self.samples.score(rows)

    def rollout_result(self, rows: list[dict], out: str, wave: int, cursor: int, count: int, seconds: float,
                       switch: float = 0.0) -> RolloutResult:
        """What the rollout of ``count`` prompts from ``cursor`` on, written to ``out``, answers."""
        tokens = sum(len(row["response_ids"]) for row in rows)
        log.info("%s rollout wave %d: %d prompts x %d samples, %d tokens in %.2fs", self.name, wave, count,
                 self.config.rollout.samples_per_prompt, tokens, seconds)
        episodes = self.samples.figures(rows)  # an episode's turns and tool calls
        return RolloutResult(uri=out, cursor=cursor + count, prompts=count, samples=len(rows), tokens=tokens, seconds=seconds,
                             busy_s=seconds, truncated=sum(row["truncated"] for row in rows), switch_s=switch, episodes=episodes)

    def params_sha(self) -> str:
        """Fingerprint of the trainer's parameters this rank holds, where they are (no collective; a
        train step's ``params_sha`` is its group's, checked against the other replicas: replica_check.py)."""
        return fingerprint(self.trainer.local_parameters())
