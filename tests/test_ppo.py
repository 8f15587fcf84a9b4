"""PPO's critic as an engine (its formulas: tests/test_rl_algorithms.py).

- ``TorchCritic.train_step``'s value loss and gradients against the clipped value loss written out
  per sequence on unpadded forwards;
- an engine host's PPO step: the dynamic filter writes the critic's values and per-token
  advantages (A_t = R - V_t with the defaults), the train step trains policy and critic and
  reports the critic's statistics in the step's one dict, full colocation puts the critic to
  sleep for the rollout engine;
- a checkpoint holds the critic and its optimizer, and a run resumed from it continues exactly;
- a critic folder that is not there is refused before any engine loads, naming model.critic.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

from tests.helpers import random_batch, save_tiny_model, scored_rows

from engines.backends.base import TrainBatch
from engines.backends.torch.critic import TorchCritic
from engines.backends.torch.trainer import TorchTrainer
from engines.config import RunConfig
from engines.host.checkpointing import Checkpoints
from engines.host.validation import InputError, validate_inputs
from engines.host.worker import Worker
from engines.wire.commands import Checkpoint, CheckpointWait, DynamicFilter, TrainStep
from storage import datasets, objectstore

PPO = {"dp": 1, "train": {"algorithm": {"name": "ppo"}, "minibatches": 2, "micro_batch_tokens": 24}}


def critic_of(model_dir: str, seed: int = 0, lr: float = 1e-2) -> TorchCritic:
    """A critic whose value head is not zero (a fresh one's is): its backbone gets gradients too."""
    critic = TorchCritic(model_dir, lr=lr, grad_clip=1e9)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        critic.model.value_head.weight.copy_(torch.randn(critic.model.value_head.weight.shape, generator=g) * 0.5)
    return critic


def critic_batch(critic: TorchCritic, seed: int) -> TrainBatch:
    """Old values and returns near the critic's values: both branches of the value loss are taken."""
    rng = random.Random(seed)
    batch = random_batch(5, seed=seed)
    now = critic.values(batch)
    batch.values = [[v + rng.uniform(-0.4, 0.4) for v in row] for row in now]
    batch.returns = [[v + rng.uniform(-0.6, 0.6) for v in row] for row in now]
    return batch


def test_critic_step_matches_hand_written_value_loss(tiny_model):
    torch.set_num_threads(1)
    critic, hand = critic_of(tiny_model), critic_of(tiny_model)
    batch = critic_batch(critic, 7)
    tokens = sum(len(r) for r in batch.response_ids)
    loss, clipped = torch.zeros((), dtype=torch.float64), 0.0
    for p, r, old, ret in zip(batch.prompt_ids, batch.response_ids, batch.values, batch.returns):
        ids = torch.tensor([p + r])
        v = hand.model(ids, torch.ones_like(ids))[0, len(p) - 1 :].double()  # the states before each response token
        old, ret = torch.tensor(old, dtype=torch.float64), torch.tensor(ret, dtype=torch.float64)
        vc = torch.minimum(torch.maximum(v, old - 0.2), old + 0.2)
        loss = loss + (0.5 * torch.maximum((v - ret) ** 2, (vc - ret) ** 2)).sum() / tokens
        clipped += float(((vc - ret) ** 2 > (v - ret) ** 2).sum())
    loss.backward()
    algorithm = RunConfig.model_validate(PPO).train.algorithm
    stats = critic.train_step(batch, algorithm, minibatches=1, micro_batch_tokens=12)  # several passes
    assert stats["value_loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert stats["value_clip_fraction"] == pytest.approx(clipped / tokens) and 0 < clipped < tokens
    r = torch.tensor([x for row in batch.returns for x in row], dtype=torch.float64)
    d = r - torch.tensor([x for row in batch.values for x in row], dtype=torch.float64)
    assert stats["explained_variance"] == pytest.approx(1 - d.var(unbiased=False).item() / r.var(unbiased=False).item())
    grads = dict(hand.model.named_parameters())
    assert grads["backbone.layers.0.mlp.up_proj.weight"].grad.abs().sum() > 0
    for name, p in critic.model.named_parameters():
        assert torch.allclose(p.grad, grads[name].grad, rtol=1e-4, atol=1e-7), name


def ppo_host(model_dir: str, seed: int = 0) -> Worker:
    return Worker(rank=0, world=1, threads=1, config=RunConfig.model_validate(PPO), trainer=TorchTrainer(model_dir, lr=1e-2),
                  critic=critic_of(model_dir, seed=seed), checkpoints=Checkpoints(0, "torch", [["part-00000.parquet", 8]]))


def ppo_step(h: Worker, tmp, step: int) -> tuple[list[dict], dict]:
    scored = objectstore.normalize(str(tmp / f"scored-{step}.parquet"))
    rows = scored_rows(step)
    for row in rows:  # the policy's own log-probabilities: on-policy
        row["logprobs"] = h.trainer.logprobs(TrainBatch([row["prompt_ids"]], [row["response_ids"]], [row["logprobs"]], [0.0]))[0]
    datasets.write_rows(scored, rows, datasets.SCORED)
    out = objectstore.normalize(str(tmp / f"experience-{step}.parquet"))
    h.dynamic_filter(DynamicFilter(step=step, scored=[scored], out=out, target_groups=3))
    experience = datasets.read_table(out, datasets.EXPERIENCE).to_pylist()
    return experience, h.train_step(TrainStep(experience=out)).statistics


def test_host_ppo_step_and_exact_resume(tiny_model, tmp_path):
    torch.set_num_threads(1)
    h = ppo_host(tiny_model)
    rows = scored_rows(0)
    values = h.critic.values(TrainBatch([r["prompt_ids"] for r in rows], [r["response_ids"] for r in rows],
                                        [r["logprobs"] for r in rows], [0.0] * 6))
    experience, stats = ppo_step(h, tmp_path, 0)
    for row, v in zip(experience, values):  # gamma = lam = 1: A_t = R - V_t, every return R
        assert row["values"] == pytest.approx(v, abs=1e-6) and len(v) == len(row["response_ids"])
        assert row["token_advantages"] == pytest.approx([row["reward"] - x for x in v], abs=1e-6)
        assert row["returns"] == pytest.approx([row["reward"]] * len(v), abs=1e-6)
    assert {"loss", "clip_fraction", "value_loss", "value_clip_fraction", "explained_variance", "critic_grad_norm"} <= set(stats)
    assert stats["value_loss"] > 0 and h.devices.awake == {"trainer", "critic"}
    h.devices.take("policy")  # full colocation: the rollout engine takes the devices, the critic sleeps like the trainer
    assert "critic" not in h.devices.awake
    # a checkpoint holds the critic and its Adam moments; a run resumed from it continues exactly
    uri = objectstore.normalize(str(tmp_path / "ckpt"))
    h.checkpoint(Checkpoint(uri=uri))
    assert "critic-torch/critic.pt" in h.checkpoint_wait(CheckpointWait()).files
    saved = copy.deepcopy(h.critic.optimizer.state_dict())
    _, after = ppo_step(h, tmp_path, 1)
    other = ppo_host(save_tiny_model(tmp_path / "other", seed=9), seed=9)
    other.checkpoints.load(other.trainer, uri, other.critic)
    assert torch.equal(other.critic.optimizer.state_dict()["state"][0]["exp_avg"], saved["state"][0]["exp_avg"])
    _, resumed = ppo_step(other, tmp_path, 1)
    assert resumed == after
    for (name, a), b in zip(h.critic.model.state_dict().items(), other.critic.model.state_dict().values()):
        assert torch.equal(a, b), name
    # a checkpoint without a critic cannot resume one
    plain = objectstore.normalize(str(tmp_path / "plain"))
    h.checkpoints.save(h.trainer, plain, asynchronous=False)
    with pytest.raises(ValueError, match="no critic-torch/ to resume the critic from"):
        other.checkpoints.load(other.trainer, plain, other.critic)


def test_a_missing_critic_folder_is_refused_before_engines_load(tiny_model, tmp_path):
    config = RunConfig.model_validate({
        "storage": {"root": str(tmp_path)}, "model": {"policy": tiny_model, "critic": str(tmp_path / "no-such-critic")},
        "train": {"algorithm": {"name": "ppo"}}, "reward": {"genrm_weight": 0.0, "rule_weight": 1.0,
                                                            "rule": "engines.demo.arithmetic:exact_match"}})
    with pytest.raises(InputError, match="^model.critic: .*no-such-critic is not a readable Hugging Face model folder"):
        validate_inputs(config)
