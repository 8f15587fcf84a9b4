"""The torch trainer sharded with FSDP2 (``train.fsdp``, engines/backends/torch/fsdp.py): four gloo
processes, two DP groups of two ranks each (hybrid sharding: each group shards the policy, the
groups hold replicas), train the step one process trains on both groups' rows; the checkpoints
of either trainer resume in the other (the optimizer's state by index or by parameter name)."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engines.backends.torch.trainer import TorchTrainer
from engines.rl.grpo import GRPOConfig
from helpers import (STEP_RTOL, free_port, global_order, parity, random_batch, save_tiny_model, step_gap,
                     with_old_logprobs)

HYPER = {"lr": 1e-3, "betas": (0.8, 0.95), "weight_decay": 0.1, "grad_clip": 0.5, "reference": True}
# two minibatches, each cut into 16-token passes: the ranks of a group have different numbers of passes
STEP = {"minibatches": 2, "micro_batch_tokens": 16, "algorithm": GRPOConfig(loss_aggregation="token", kl_coef=0.5)}
GROUPS, SHARDS = 2, 2


def _worker(rank: int, port: int, model_dir: str, steps: list, plain: str, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=GROUPS * SHARDS,
                            timeout=timedelta(seconds=120))
    try:
        group = rank // SHARDS  # every rank of a group is given the group's batch (the controller fans out)
        trainer = TorchTrainer(model_dir, **HYPER, shards=SHARDS)
        result = {"logprobs": trainer.logprobs(steps[0][group]), "stats": trainer.train_step(steps[0][group], **STEP)}
        result["after"] = weights(trainer)
        trainer.save_checkpoint(os.path.join(out, "sharded"))  # rank 0 writes the whole state
        trainer.load_checkpoint(plain)  # the one-process trainer's checkpoint after the same step
        trainer.train_step(steps[1][group], **STEP)
        result["resumed"] = weights(trainer)
        torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def weights(trainer: TorchTrainer) -> dict[str, torch.Tensor]:
    """A copy of the trainer's weights now (its export yields the live tensors)."""
    return {name: t.clone() for name, t in trainer.export_weights()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp")
    model_dir = save_tiny_model(tmp / "model", hidden_size=32, num_layers=2)
    torch.set_num_threads(1)
    one = TorchTrainer(model_dir, **HYPER)
    steps = []
    for s in range(2):  # per step, each group's batch (sizes that split unevenly over its two ranks)
        batches = [random_batch(n, seed=10 * s + g) for g, n in enumerate((5, 7))]
        steps.append([with_old_logprobs(b, one.logprobs(b), noise=0.5, seed=g) for g, b in enumerate(batches)])
    before = weights(one)
    single = {"logprobs": one.logprobs(steps[0][0]), "stats": one.train_step(global_order(steps[0], STEP["minibatches"]), **STEP)}
    single["after"] = weights(one)
    one.save_checkpoint(str(tmp / "plain"))
    one.train_step(global_order(steps[1], STEP["minibatches"]), **STEP)
    single["second"] = weights(one)
    mp.spawn(_worker, args=(free_port(), model_dir, steps, str(tmp / "plain"), str(tmp)), nprocs=GROUPS * SHARDS, join=True)
    ranks = [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(GROUPS * SHARDS)]
    return {"model_dir": model_dir, "steps": steps, "before": before, "single": single, "ranks": ranks, "tmp": tmp}


def test_two_groups_of_two_fsdp_ranks_train_the_step_one_process_trains(runs):
    single, ranks, before = runs["single"], runs["ranks"], runs["before"]
    lp = [x for a, b in zip(ranks[0]["logprobs"], single["logprobs"]) for x in (abs(u - v) for u, v in zip(a, b))]
    assert parity("fsdp: hsdp 2x2 vs one process, log-probs", max(lp)) <= 1e-5
    assert ranks[0]["after"].keys() == before.keys()  # every parameter gathered, by its Hugging Face name
    assert parity("fsdp: hsdp 2x2 vs one process, step", step_gap(ranks[0]["after"], single["after"], before)) <= STEP_RTOL
    assert all(torch.equal(r["after"][k], ranks[0]["after"][k]) for r in ranks for k in before)  # replicas equal
    tokens = [sum(len(r) for r in b.response_ids) for b in runs["steps"][0]]
    for rank, result in enumerate(ranks):  # each group's statistics: its two ranks' rows together
        stats = result["stats"]
        assert stats["tokens"] == tokens[rank // SHARDS] and stats == ranks[rank // SHARDS * SHARDS]["stats"]
        assert stats["loss"] == pytest.approx(single["stats"]["loss"], abs=1e-6)  # the loss is the global one
        assert stats["grad_norm"] == pytest.approx(single["stats"]["grad_norm"], rel=1e-5)


def test_checkpoints_resume_across_sharded_and_unsharded_trainers(runs):
    """The sharded trainers resume from the one process's checkpoint (its optimizer's state by index)
    and step on as it does; one process resumes from the sharded trainers' checkpoint (by name)."""
    single, ranks = runs["single"], runs["ranks"]
    assert parity("fsdp: resumed from one process, next step", step_gap(ranks[0]["resumed"], single["second"], single["after"])) \
        <= STEP_RTOL
    assert sorted(p.name for p in (runs["tmp"] / "sharded").iterdir()) == ["trainer.pt"]
    one = TorchTrainer(runs["model_dir"], **HYPER)
    one.load_checkpoint(str(runs["tmp"] / "sharded"))
    assert one.version == 1
    one.train_step(global_order(runs["steps"][1], STEP["minibatches"]), **STEP)
    assert parity("fsdp: one process resumed from the sharded one, next step",
                  step_gap(weights(one), single["second"], single["after"])) <= STEP_RTOL
