"""An engine host's engines, loaded once for the run by ``setup_engines`` (engines/host/worker.py).

Every rank of a group loads its share of the trainer (and a critic, with ``Needs.critic``); the
group's leader, and with ``rollout.replicas`` / ``judge.replicas`` its next ranks, also load the
rollout engine and the scorers (``rolls``, ``judges``). Here the sample kind is picked too
(engines/host/samples.py): a response, an episode, a preference pair; images inside it; and how
``rollout_and_score`` produces a wave (``producer``): the judge beside the generator or the streaming lane.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist

from engines.agents.episodes import Episodes
from engines.backends import build, distributed, multimodal
from engines.backends.base import Generator, Trainer
from engines.config import RunConfig
from engines.config.layout import Layout
from engines.host import critic as critic_host, rewards, samples
from engines.host.beside import Beside
from engines.host.checkpointing import Checkpoints
from engines.host.offpolicy import RolloutWeights
from engines.host.preferences import PreferenceRows
from engines.host.prompts import Frames, PromptStream
from engines.host.stream import StreamLane
from engines.host.waves import Waves, stable_seed
from storage import datasets, objectstore


def prompts_uri(cfg: RunConfig) -> str:
    """The run's stream of prompts: ``data.prompts``, or a preference dataset instead."""
    return cfg.uri(cfg.data.preferences or cfg.data.prompts)


def layout_of(cfg: RunConfig, rank: int, world: int) -> Layout:
    """The run's layout over the ``world`` hosts started: its DP groups, or fewer of them to evaluate."""
    if world % cfg.layout.size:
        raise ValueError(f"this host is rank {rank} of {world}: not DP groups of {cfg.layout.size} ranks")
    return replace(cfg.layout, dp=world // cfg.layout.size)


def checkpoints(cfg: RunConfig, rank: int, layout: Layout, resume: str | None) -> Checkpoints:
    """Rank ``rank``'s checkpoints of the run; with ``resume``, the checkpoint's prompt files and layout
    checked against the run's (before any engine loads)."""
    uri = prompts_uri(cfg)
    checkpoints = Checkpoints(rank, cfg.train.backend, datasets.part_files(uri), layout, cfg.train.distributed_optimizer,
                              cfg.train.reshardable_optimizer)
    if resume:
        checkpoints.check_prompt_files(uri, resume, "data.preferences" if cfg.data.preferences else "data.prompts")
        checkpoints.check_layout(resume)
    return checkpoints


def device_of(cfg: RunConfig) -> torch.device:
    """Where the engines run: the accelerator, or the CPU for the timing stub (its one all-reduce is of a CPU tensor)."""
    return torch.device("cpu") if cfg.train.backend == "stub" else distributed.default_device()


def join(rank: int, world: int, master: str, timeout_s: float, device: torch.device, listening=None) -> None:
    """Rank ``rank`` of a run's ``world`` joins its process groups, once per process (``listening``:
    rank 0's socket its rendezvous store serves on)."""
    if world > 1 and not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s)
        distributed.init_process_groups(device, rank, world,
                                        distributed.rendezvous_store(rank, world, master, timeout, listening), timeout)


@dataclass
class Loaded:
    """What a rank holds for the run: its engines (None where it holds none) and how samples are made."""

    trainer: Trainer
    critic: object | None  # an algorithm with a critic: its value model (engines/host/critic.py)
    policy: Generator | None  # the rollout engine
    judge: Generator | None  # the GenRM
    reward_model: object | None  # the scalar reward model (model.reward_model), on the judge's side
    vision: bool  # the policy is a vision-language model: prompts come with images
    prompts: PromptStream  # this group's stream of prompts
    scorers: samples.Scorers
    samples: samples.Responses  # what a sample is


def load(cfg: RunConfig, layout: Layout, group: int, threads: int, device: torch.device, rolls: bool, judges: bool,
         weights: RolloutWeights) -> Loaded:
    """Rank-of-``group`` engines on ``device``: the trainer always, the rollout engine if ``rolls``, the
    judge and reward model if ``judges``; ``weights``: the rollout engine's, between an overlapping
    host's two lanes (its lock is the judge's too then)."""
    policy_dir = objectstore.local_folder(cfg.uri(cfg.model.policy))
    vision = multimodal.is_vision_folder(policy_dir)
    if vision and cfg.rollout.mode == "stream":
        raise ValueError(f"rollout.mode=stream is not wired yet for a vision-language policy (model.policy="
                         f"{cfg.model.policy}): use rollout.mode=waves")
    trainer = build.make_trainer(cfg, policy_dir, device)
    critic = (build.make_critic(cfg, objectstore.local_folder(critic_host.folder(cfg)), device)
              if cfg.train.algorithm.needs.critic else None)
    policy = (build.make_generator(cfg.rollout.backend, policy_dir, cfg, threads, device,
                                   tensor_parallel=cfg.rollout.tensor_parallel, record_routes=cfg.train.router_replay)
              if rolls else None)
    judge, judge_sees_images = None, False
    if cfg.reward.genrm_weight > 0 and judges:
        judge_dir = objectstore.local_folder(cfg.uri(cfg.model.judge))
        judge = build.make_judge(cfg, judge_dir, threads, device)
        judge_sees_images = vision and multimodal.is_vision_folder(judge_dir)
    reward_model = (build.make_reward_model(cfg, objectstore.local_folder(cfg.uri(cfg.model.reward_model)), threads, device)
                    if cfg.reward.reward_model_weight > 0 and judges else None)
    frames, placeholders = None, ()
    if vision:
        processor = multimodal.load_processor(policy_dir)
        if not judge_sees_images:  # an image in the policy's prompts, taken out of a text judge's
            placeholders = (multimodal.image_text(processor), multimodal.placeholder(processor))
        frames = Frames.of(cfg.data, processor)
    prompts = PromptStream(prompts_uri(cfg), group, layout.dp, cfg.data.max_image_bytes,
                           datasets.PREFERENCES if cfg.data.preferences else datasets.PROMPTS,
                           extra=cfg.rollout.env is not None, frames=frames,  # an environment reads every column
                           max_image_pixels=cfg.data.max_image_pixels)
    limit = rewards.timeout_of(cfg)  # each call's (reward.rule_timeout_s): a hang is the rule's error, not a lost host
    scorers = samples.Scorers(
        cfg, judge, reward_model, rewards.load_rule(cfg.reward.rule, timeout_s=limit) if cfg.reward.rule else None,
        rewards.load_rule(cfg.reward.format_rule, "reward.format_rule", limit) if cfg.reward.format_rule else None,
        prompts, judge_sees_images, placeholders,
        # one judge call at a time: a streaming lane's scoring thread and an evaluation; overlapping lanes: the
        # held-out evaluation's judge and the rollout lane's never generate at once
        weights if cfg.rollout.overlapped else threading.Lock())
    kind = samples.of(cfg, policy, weights, scorers, vision=vision,
                      episodes=Episodes.of(cfg, policy_dir) if cfg.rollout.episodes and rolls else None,
                      pairs=PreferenceRows(policy_dir, cfg, vision) if cfg.data.preferences else None,
                      version=lambda: trainer.version)
    return Loaded(trainer, critic, policy, judge, reward_model, vision, prompts, scorers, kind)


def producer(cfg: RunConfig, waves: Waves, policy: Generator | None, weights: RolloutWeights, threads: int,
             group: int) -> Beside | StreamLane:
    """How ``rollout_and_score`` produces this rank's share of a wave (``answer``; ``stop`` when the
    run's setup comes again): the streaming lane of a replica that rolls out with ``rollout.mode=stream``
    (engines/host/stream.py), else the judge beside the generator (engines/host/beside.py)."""
    role = waves.replicas["rollout"]
    if cfg.rollout.mode == "stream" and role.here:
        return StreamLane.of(waves, policy, weights, seed=lambda n: stable_seed(cfg.seed, "stream", group, role.index, n))
    return Beside(waves, threads, cfg.placement.judge_threads or max(1, threads // 2), cfg.placement.queue_size)
