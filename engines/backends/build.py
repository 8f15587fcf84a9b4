"""Engines from the run config: the trainer and generators a config names (torch, vLLM,
Megatron-Core, timing stubs), and partial colocation's judge in a process of its own.

Engine modules are imported only when built: a host loads the backends its config names, no
more (transformers alone is ~100 MB per host; vLLM and Megatron-Core far more).
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import traceback

from engines.config import RunConfig
from engines.backends import chat
from engines.backends.base import Generation, Generator, Trainer


def make_trainer(cfg: RunConfig, model_dir: str, device=None) -> Trainer:
    """The train engine the config names, on the policy's Hugging Face folder, on ``device``
    (None: ``engines.backends.distributed.default_device()``)."""
    t = cfg.train
    kwargs = dict(
        lr=t.lr, betas=t.betas, weight_decay=t.weight_decay, grad_clip=t.grad_clip,
        temperature=cfg.rollout.temperature, reference=t.algorithm.needs.reference, dtype=cfg.model.dtype,
    )
    if t.backend == "stub":  # timing stub for scale benchmarks, not training (engines/backends/stub/engines.py)
        from engines.backends.stub.engines import TimingStubTrainer

        return TimingStubTrainer(model_dir, seconds_per_token=t.stub_seconds_per_token)
    if t.backend == "megatron":
        from engines.backends.megatron.trainer import MegatronTrainer

        return MegatronTrainer(model_dir, tensor_parallel=t.tensor_parallel, pipeline_parallel=t.pipeline_parallel,
                               expert_parallel=t.expert_parallel, distributed_optimizer=t.distributed_optimizer,
                               reshardable_optimizer=t.reshardable_optimizer,
                               recompute_granularity=t.recompute_granularity, recompute_method=t.recompute_method,
                               recompute_num_layers=t.recompute_num_layers, recompute_modules=t.recompute_modules,
                               device=device, freeze_vision=t.freeze_vision, router_replay=t.router_replay, **kwargs)
    from engines.backends.torch.trainer import TorchTrainer

    return TorchTrainer(model_dir, device=device, freeze_vision=t.freeze_vision, lora=t.lora, seed=cfg.seed, shards=t.fsdp,
                        router_replay=t.router_replay, router_balance=t.router_balance, **kwargs)


def make_critic(cfg: RunConfig, model_dir: str, device=None):
    """The value model of an algorithm that has one (``Needs.critic``), on ``model_dir`` (model.critic,
    else the policy's folder), of the trainer's backend (``train``'s validator refuses the stub)."""
    t = cfg.train
    kwargs = dict(lr=t.algorithm.critic_lr or t.lr, betas=t.betas, weight_decay=t.weight_decay, grad_clip=t.grad_clip,
                  dtype=cfg.model.dtype, device=device)
    if t.backend == "megatron":
        from engines.backends.megatron.critic import MegatronCritic

        return MegatronCritic(model_dir, tensor_parallel=t.tensor_parallel, pipeline_parallel=t.pipeline_parallel,
                              distributed_optimizer=t.distributed_optimizer,
                              reshardable_optimizer=t.reshardable_optimizer,
                              recompute_granularity=t.recompute_granularity, recompute_method=t.recompute_method,
                              recompute_num_layers=t.recompute_num_layers, recompute_modules=t.recompute_modules, **kwargs)
    from engines.backends.torch.critic import TorchCritic

    return TorchCritic(model_dir, shards=t.fsdp, **kwargs)


def make_generator(backend: str, model_dir: str, cfg: RunConfig, threads: int, device=None,
                   prompt_format: chat.PromptFormat | None = None, tensor_parallel: int = 1,
                   record_routes: bool = False) -> Generator:
    """A generation engine (policy rollout or GenRM judge) of the named backend, rendering prompts
    with ``prompt_format`` (None: the policy's, ``chat.PromptFormat.policy(cfg)``); vLLM over
    ``tensor_parallel`` devices (``rollout.tensor_parallel``, ``judge.tensor_parallel``);
    ``record_routes``: a MoE policy's routes recorded for router replay (torch only: the config refuses others)."""
    prompt_format = prompt_format or chat.PromptFormat.policy(cfg)
    if backend == "stub":  # timing stub for scale benchmarks, not training (engines/backends/stub/engines.py)
        from engines.backends.stub.engines import TimingStubGenerator

        return TimingStubGenerator(model_dir, cfg.rollout.stub_seconds_per_token, (cfg.judge.good, cfg.judge.bad),
                                   cfg.rollout.max_new_tokens if cfg.rollout.stub_lengths == "long_tail" else None)
    if backend == "vllm":
        from engines.backends.vllm.generator import VLLMGenerator

        # threads: in a DP host vLLM runs in its own process, which does not inherit torch's setting
        return VLLMGenerator(model_dir, dtype=cfg.model.dtype, seed=cfg.seed, threads=threads, prompt_format=prompt_format,
                             tensor_parallel=tensor_parallel)
    from engines.backends.torch.generator import TorchGenerator

    return TorchGenerator(model_dir, dtype=cfg.model.dtype, device=device, prompt_format=prompt_format,
                          record_routes=record_routes)


def make_judge(cfg: RunConfig, model_dir: str, threads: int, device=None) -> Generator:
    """The GenRM judge: under partial colocation in a process of its own, resident beside the
    rollout engine on its share of the devices; else a generator like the policy's."""
    if cfg.placement.mode == "partial":
        return JudgeProcess(cfg, model_dir, cfg.placement.judge_threads or max(1, threads // 2), cfg.placement.judge_devices)
    return make_generator(cfg.judge.backend, model_dir, cfg, threads, device, chat.PromptFormat.judge(cfg), cfg.judge.tensor_parallel)


def make_reward_model(cfg: RunConfig, model_dir: str, threads: int, device=None):
    """The scalar reward model (``model.reward_model``), on the judge's side of placement: under
    partial colocation in a process of its own as the judge is (its share of the devices), else
    in the host, switched with the judge (``Devices.take``)."""
    if cfg.placement.mode == "partial":
        return JudgeProcess(cfg, model_dir, cfg.placement.judge_threads or max(1, threads // 2), cfg.placement.judge_devices,
                            role="reward model")
    return _reward_model(cfg, model_dir, device)


def _reward_model(cfg: RunConfig, model_dir: str, device=None):
    from engines.backends.torch.reward_model import TorchRewardModel

    return TorchRewardModel(model_dir, dtype=cfg.model.dtype, device=device, prompt_format=chat.PromptFormat.policy(cfg))


class JudgeProcess:
    """Partial colocation's GenRM judge: a generator of its own in a child process, with its own
    share of the group's devices (CUDA: ``placement.judge_devices`` of the host's visible ones;
    CPU: ``placement.judge_threads`` torch threads), so that it computes beside the rollout engine
    (in another process, neither waits for the other's Python: no GIL between them).

    A ``Generator``: each method is the child's generator's, called over a pipe to the host's own
    child (never the network), one at a time. The child exits when the pipe closes (and with the
    host's process group)."""

    def __init__(self, cfg: RunConfig, model_dir: str, threads: int, devices: list[int] | None = None,
                 role: str = "GenRM judge"):
        self.role = role  # "reward model": the child holds the scalar reward model instead (its ``score``)
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no inherited torch or CUDA state
        self._conn, child = ctx.Pipe()
        env = {}
        if devices is not None:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            ids = visible.split(",") if visible else [str(i) for i in range(max(devices) + 1)]
            env["CUDA_VISIBLE_DEVICES"] = ",".join(ids[i] for i in devices)
        self._lock = threading.Lock()
        self.process = ctx.Process(target=_judge_process, args=(child, cfg.model_dump(), model_dir, threads, env, role),
                                   name=role.lower().replace(" ", "-"), daemon=True)
        self.process.start()
        child.close()
        self._call("ping")  # loaded: fail at setup, not in the first wave

    def _call(self, method: str, *args, **kwargs):
        with self._lock:
            try:
                self._conn.send((method, args, kwargs))
                ok, value = self._conn.recv()
            except (EOFError, OSError) as e:
                raise RuntimeError(f"the {self.role} process is gone (exit code {self.process.exitcode})") from e
        if not ok:
            raise RuntimeError(f"the {self.role} process failed in '{method}':\n{value}")
        return value

    def generate(self, prompts: list, n: int = 1, temperature: float = 1.0, top_p: float = 1.0, max_new_tokens: int = 16,
                 seed: int = 0, greedy: bool = False, images: list[list[bytes]] | None = None) -> list[Generation]:
        return self._call("generate", prompts, n=n, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens,
                          seed=seed, greedy=greedy, images=images)

    def score(self, prompts: list, responses: list[str]) -> list[float]:
        return self._call("score", prompts, responses)

    def update_weights(self, buckets) -> list[str]:
        return self._call("update_weights", [list(bucket) for bucket in buckets])

    def sleep(self) -> None:
        self._call("sleep")

    def wake(self) -> None:
        self._call("wake")

    def close(self) -> None:
        self._conn.close()
        self.process.join(timeout=10)


def _judge_process(conn, config: dict, model_dir: str, threads: int, env: dict, role: str = "GenRM judge") -> None:
    """The judge's (or the reward model's) child process: load it, then answer calls until the pipe closes."""
    os.environ.update(env)  # before torch (and CUDA) load
    import torch

    torch.set_num_threads(threads)
    cfg = RunConfig.model_validate(config)
    try:
        judge = (_reward_model(cfg, model_dir) if role == "reward model" else
                 make_generator(cfg.judge.backend, model_dir, cfg, threads, prompt_format=chat.PromptFormat.judge(cfg)))
    except Exception:  # noqa: BLE001 - answered to the first call
        judge, error = None, traceback.format_exc()
    while True:
        try:
            method, args, kwargs = conn.recv()
        except (EOFError, OSError):
            return
        try:
            if judge is None:
                raise RuntimeError(f"the {role} did not load:\n{error}")
            value = None if method == "ping" else getattr(judge, method)(*args, **kwargs)
            conn.send((True, value))
        except Exception:  # noqa: BLE001 - sent back to the host's command
            conn.send((False, traceback.format_exc()))

