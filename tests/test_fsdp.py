"""The torch trainer sharded with FSDP2 (``train.fsdp``, engines/backends/torch/fsdp.py): four gloo
processes, two DP groups of two ranks each (hybrid sharding: each group shards the policy, the
groups hold replicas), train the step one process trains on both groups' rows; the checkpoints
of either trainer resume in the other (the sharded trainers' in sharded files, each rank writing
its own shards).
Each check runs on the whole policy and on a LoRA adapter over it (``train.lora``), in the same
processes; and on PPO's critic (``TorchCritic``), sharded the same way."""

from __future__ import annotations

import os
import pickle
import random
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engines.backends.base import TrainBatch
from engines.backends.torch import fsdp, lora, shards
from engines.backends.torch.critic import TorchCritic
from engines.backends.torch.generator import TorchGenerator
from engines.backends.torch.model import is_vision_tower
from engines.backends.torch.trainer import TorchTrainer
from engines.config.layout import Layout
from engines.config.train import LoraConfig
from engines.demo import vision
from engines.rl.grpo import GRPOConfig
from engines.rl.ppo import PPOConfig
from tests.helpers import (STEP_RTOL, free_port, global_order, parity, random_batch, save_tiny_model, save_tiny_vlm, step_gap,
                     with_old_logprobs)
from test_replica_check import replica_checks

HYPER = {"lr": 1e-3, "betas": (0.8, 0.95), "weight_decay": 0.1, "grad_clip": 0.5, "reference": True}
# two minibatches, each cut into 16-token passes: the ranks of a group have different numbers of passes
STEP = {"minibatches": 2, "micro_batch_tokens": 16, "algorithm": GRPOConfig(loss_aggregation="token", kl_coef=0.5)}
GROUPS, SHARDS = 2, 2
# what each kind of trainer adds: a LoRA adapter without dropout (the ranks' rows differ from one process's)
# and a vision-language policy (the tiny Idefics3), its frozen vision tower whole on every rank
KINDS = {"full": {}, "lora": {"lora": LoraConfig(rank=4, alpha=8.0, dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"])},
         "vision": {}}
CRITIC = {"lr": 1e-2, "betas": (0.8, 0.95), "weight_decay": 0.1, "grad_clip": 0.5}
CRITIC_STEP = {"algorithm": PPOConfig(), "minibatches": 2, "micro_batch_tokens": 16}


def _worker(rank: int, port: int, cases: dict, critic_steps: list, plain: str, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=GROUPS * SHARDS,
                            timeout=timedelta(seconds=120))
    try:
        group = rank // SHARDS  # every rank of a group is given the group's batch (the controller fans out)
        results = {}
        for kind, extra in KINDS.items():
            model_dir, steps = cases[kind]
            trainer = TorchTrainer(model_dir, **HYPER, **extra, shards=SHARDS)
            result = results[kind] = {"logprobs": trainer.logprobs(steps[0][group]),
                                      "stats": trainer.train_step(steps[0][group], **STEP)}
            result["after"] = weights(trainer)
            result["replicas"] = replica_checks(trainer, Layout(dp=GROUPS, fsdp=SHARDS), rank, flip=3)
            result["files"] = trainer.save_checkpoint(os.path.join(out, kind, "sharded"))  # each rank its shards
            trainer.load_checkpoint(os.path.join(plain, kind))  # the one-process trainer's checkpoint after the same step
            trainer.train_step(steps[1][group], **STEP)
            result["resumed"] = weights(trainer)
        critic = TorchCritic(os.path.join(out, "critic-folder"), **CRITIC, shards=SHARDS)
        valued = critic_steps[0][group]
        result = results["critic"] = {"values": critic.values(valued), "stats": critic.train_step(valued, **CRITIC_STEP)}
        result["after"] = critic_weights(critic)
        result["files"] = critic.freeze_checkpoint(os.path.join(out, "critic", "sharded"), copy=True).write()  # each rank its shards
        critic.load_checkpoint(os.path.join(plain, "critic"))
        critic.train_step(critic_steps[1][group], **CRITIC_STEP)
        result["resumed"] = critic_weights(critic)
        torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def weights(trainer: TorchTrainer) -> dict[str, torch.Tensor]:
    """A copy of the trainer's weights now (its export yields the live tensors)."""
    return {name: t.clone() for name, t in trainer.export_weights()}


def critic_weights(critic: TorchCritic) -> dict[str, torch.Tensor]:
    """A copy of the critic's weights now, whole (sharded: gathered, a collective of the group)."""
    return {name: fsdp.full(p.detach()).clone() for name, p in critic.model.named_parameters()}


def critic_batch(critic: TorchCritic, n: int, seed: int) -> TrainBatch:
    """Old values and returns near the critic's values: both branches of the clipped value loss are taken."""
    rng, batch = random.Random(seed), random_batch(n, seed=seed)
    now = critic.values(batch)
    batch.values = [[v + rng.uniform(-0.4, 0.4) for v in row] for row in now]
    batch.returns = [[v + rng.uniform(-0.6, 0.6) for v in row] for row in now]
    return batch


def assert_sharded_files(folder, written: list[list[str]], record: list[str]) -> None:
    """Every rank wrote its own shards (none holds the whole state), rank 0 the index and ``record``;
    the folder holds those files and nothing else."""
    assert all(files and all(f.startswith(f"__{rank}_") for f in files[:1]) for rank, files in enumerate(written))
    assert sorted(written[0][1:]) == sorted([shards.INDEX, *record]) and all(len(files) == 1 for files in written[1:])
    assert sorted(p.name for p in folder.iterdir()) == sorted(f for files in written for f in files)


def vision_steps(model_dir: str) -> list[list[TrainBatch]]:
    """Two steps of two groups' batches (5 and 7 sequences) sampled by the tiny vision-language policy
    on its pictures, each sequence with its prompt's image."""
    rows = vision.make_problems(12, seed=5)
    gens = TorchGenerator(model_dir).generate([p for p, *_ in rows], n=2, max_new_tokens=6, seed=2,
                                              images=[im for _, im, *_ in rows])
    rng = random.Random(0)
    batch = TrainBatch([g.prompt_ids for g in gens], [g.response_ids for g in gens], [g.logprobs for g in gens],
                       [rng.uniform(-1, 1) for _ in gens], images=[rows[g.prompt_index][1] for g in gens])
    return [[batch.take(range(12 * s, 12 * s + 5)), batch.take(range(12 * s + 5, 12 * s + 12))] for s in range(2)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp")
    model_dir = save_tiny_model(tmp / "model", hidden_size=32, num_layers=2)
    vision_dir = save_tiny_vlm(tmp / "vlm")
    torch.set_num_threads(1)
    pictures = vision_steps(vision_dir)
    steps, before, single = [], {}, {}
    for kind, extra in KINDS.items():
        one = TorchTrainer(vision_dir if kind == "vision" else model_dir, **HYPER, **extra)
        # the batches once, by the first trainer (a fresh adapter leaves the policy as it was): per step, each
        # group's batch, of sizes that split unevenly over its two ranks
        for s in range(2 * (not steps)):
            batches = [random_batch(n, seed=10 * s + g) for g, n in enumerate((5, 7))]
            steps.append([with_old_logprobs(b, one.logprobs(b), noise=0.5, seed=g) for g, b in enumerate(batches)])
        kind_steps = pictures if kind == "vision" else steps
        before[kind] = weights(one)
        result = single[kind] = {"logprobs": one.logprobs(kind_steps[0][0]),
                                 "stats": one.train_step(global_order(kind_steps[0], STEP["minibatches"]), **STEP)}
        result["after"] = weights(one)
        one.save_checkpoint(str(tmp / "plain" / kind))
        one.train_step(global_order(kind_steps[1], STEP["minibatches"]), **STEP)
        result["second"] = weights(one)
    cases = {kind: (vision_dir, pictures) if kind == "vision" else (model_dir, steps) for kind in KINDS}
    # the critic: a folder with a non-zero value head (a fresh one's is zero: its backbone would get no gradient)
    probe = TorchCritic(model_dir, **CRITIC)
    with torch.no_grad():
        probe.model.value_head.weight.copy_(torch.randn(probe.model.value_head.weight.shape,
                                                        generator=torch.Generator().manual_seed(0)) * 0.5)
    probe.save_hf(str(tmp / "critic-folder"))
    one = TorchCritic(str(tmp / "critic-folder"), **CRITIC)
    critic_steps = [[critic_batch(one, n, seed=100 + 10 * s + g) for g, n in enumerate((5, 7))] for s in range(2)]
    before["critic"] = critic_weights(one)
    result = single["critic"] = {"values": one.values(critic_steps[0][0]),
                                 "stats": one.train_step(global_order(critic_steps[0], 2), **CRITIC_STEP)}
    result["after"] = critic_weights(one)
    one.freeze_checkpoint(str(tmp / "plain" / "critic"), copy=True).write()
    one.train_step(global_order(critic_steps[1], 2), **CRITIC_STEP)
    result["second"] = critic_weights(one)
    mp.spawn(_worker, args=(free_port(), cases, critic_steps, str(tmp / "plain"), str(tmp)), nprocs=GROUPS * SHARDS, join=True)
    ranks = [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(GROUPS * SHARDS)]
    return {"model_dir": model_dir, "cases": cases, "critic_steps": critic_steps, "before": before, "single": single,
            "ranks": ranks, "tmp": tmp}


@pytest.mark.parametrize("kind", KINDS)
def test_two_groups_of_two_fsdp_ranks_train_the_step_one_process_trains(runs, kind):
    single, before = runs["single"][kind], runs["before"][kind]
    ranks = [r[kind] for r in runs["ranks"]]
    lp = [x for a, b in zip(ranks[0]["logprobs"], single["logprobs"]) for x in (abs(u - v) for u, v in zip(a, b))]
    assert parity(f"fsdp {kind}: hsdp 2x2 vs one process, log-probs", max(lp)) <= 1e-5
    assert ranks[0]["after"].keys() == before.keys()  # every parameter gathered, by its Hugging Face name
    assert parity(f"fsdp {kind}: hsdp 2x2 vs one process, step", step_gap(ranks[0]["after"], single["after"], before)) <= STEP_RTOL
    assert all(torch.equal(r["after"][k], ranks[0]["after"][k]) for r in ranks for k in before)  # replicas equal
    # the replica check on each rank's shards: equal replicas pass, every rank answering the same sha; a
    # bit flipped in dp-1.1's shard of one tensor fails it on every rank, naming both ranks at that place
    # and the tensor; each rank digested its shards (the whole tower of a vision policy), not the model
    checks = [r["replicas"] for r in ranks]
    assert len({c["sha"] for c in checks} | {c["again"] for c in checks}) == 1
    flipped = checks[3]["flipped"][0]
    assert {c["flipped"][1] for c in checks} == {
        f"replica check after the train step: dp-0.1 (rank 1) and dp-1.1 (rank 3) hold different bits in {flipped!r}"}
    whole = sum(t.numel() for t in before.values())
    assert all(c["held"] < 0.75 * whole for c in checks) and sum(c["held"] for c in checks[:SHARDS]) >= whole
    tokens = [sum(len(r) for r in b.response_ids) for b in runs["cases"][kind][1][0]]
    for rank, result in enumerate(ranks):  # each group's statistics: its two ranks' rows together
        stats = result["stats"]
        assert stats["tokens"] == tokens[rank // SHARDS] and stats == ranks[rank // SHARDS * SHARDS]["stats"]
        assert stats["loss"] == pytest.approx(single["stats"]["loss"], abs=1e-6)  # the loss is the global one
        assert stats["grad_norm"] == pytest.approx(single["stats"]["grad_norm"], rel=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_checkpoints_resume_across_sharded_and_unsharded_trainers(runs, kind):
    """The sharded trainers resume from the one process's checkpoint (its optimizer's state by index)
    and step on as it does; one process resumes from the sharded trainers' checkpoint (by name)."""
    single, ranks, sharded = runs["single"][kind], [r[kind] for r in runs["ranks"]], runs["tmp"] / kind / "sharded"
    assert parity(f"fsdp {kind}: resumed from one process, next step",
                  step_gap(ranks[0]["resumed"], single["second"], single["after"])) <= STEP_RTOL
    assert_sharded_files(sharded, [r["files"] for r in ranks], ["trainer.json"])
    stored = shards.names(str(sharded))
    if kind == "lora":  # the adapter and its Adam state only, by name
        assert stored == set(lora.adapter_state(TorchTrainer(runs["model_dir"], **HYPER, **KINDS[kind]).model))
    elif kind == "vision":  # the frozen tower too, written once though every rank holds it whole
        assert stored == set(runs["before"][kind]) and any(is_vision_tower(n) for n in stored)
    else:
        assert stored == set(runs["before"][kind])
    model_dir, steps = runs["cases"][kind]
    one = TorchTrainer(model_dir, **HYPER, **KINDS[kind])
    one.load_checkpoint(str(sharded))
    assert one.version == 1
    one.train_step(global_order(steps[1], STEP["minibatches"]), **STEP)
    assert parity(f"fsdp {kind}: one process resumed from the sharded one, next step",
                  step_gap(weights(one), single["second"], single["after"])) <= STEP_RTOL


def test_a_critic_sharded_over_two_groups_of_two_ranks_values_and_steps_as_one_process(runs):
    """PPO's critic under train.fsdp=2, dp=2: the values of one process, the step one process takes
    on both groups' rows, each group's value loss over its own tokens (its two ranks' rows
    together), and checkpoints that resume across the layouts both ways."""
    single, before, ranks = runs["single"]["critic"], runs["before"]["critic"], [r["critic"] for r in runs["ranks"]]
    gap = max(abs(u - v) for a, b in zip(ranks[0]["values"], single["values"]) for u, v in zip(a, b))
    assert parity("fsdp critic: hsdp 2x2 vs one process, values", gap) <= 1e-5
    assert ranks[0]["after"].keys() == before.keys()
    assert parity("fsdp critic: hsdp 2x2 vs one process, step", step_gap(ranks[0]["after"], single["after"], before)) <= STEP_RTOL
    assert all(torch.equal(r["after"][k], ranks[0]["after"][k]) for r in ranks for k in before)  # replicas equal
    for rank, result in enumerate(ranks):
        stats = result["stats"]
        assert stats == ranks[rank // SHARDS * SHARDS]["stats"]  # a group's two ranks report the group's figures
        assert stats["critic_grad_norm"] == pytest.approx(single["stats"]["critic_grad_norm"], rel=1e-5)
        assert stats["explained_variance"] == pytest.approx(single["stats"]["explained_variance"], rel=1e-6)
    # each group's value loss is over its own tokens: weighted by them, the groups' make one process's
    tokens = [sum(b.trained_tokens()) for b in runs["critic_steps"][0]]
    pooled = sum(ranks[g * SHARDS]["stats"]["value_loss"] * n for g, n in enumerate(tokens)) / sum(tokens)
    assert pooled == pytest.approx(single["stats"]["value_loss"], rel=1e-5)
    assert parity("fsdp critic: resumed from one process, next step",
                  step_gap(ranks[0]["resumed"], single["second"], single["after"])) <= STEP_RTOL
    sharded = runs["tmp"] / "critic" / "sharded"
    assert_sharded_files(sharded, [r["files"] for r in ranks], [])
    one = TorchCritic(str(runs["tmp"] / "critic-folder"), **CRITIC)
    one.load_checkpoint(str(sharded))  # the optimizer's state by parameter name
    one.train_step(global_order(runs["critic_steps"][1], 2), **CRITIC_STEP)
    assert parity("fsdp critic: one process resumed from the sharded one, next step",
                  step_gap(critic_weights(one), single["second"], single["after"])) <= STEP_RTOL


def test_sharded_files_read_back_and_a_planted_pickle_in_their_index_never_runs(tmp_path):
    """One process writes and reads the sharded files (the whole tensors); an index replaced by a
    pickle that would run a command is refused, naming the file, and the command never runs."""
    torch.manual_seed(0)
    model, other = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    optimizer, other_optimizer = torch.optim.AdamW(model.parameters()), torch.optim.AdamW(other.parameters())
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    folder = tmp_path / "shards"
    assert shards.save(model, optimizer, str(folder)) == ["__0_0.distcp", shards.INDEX]
    shards.load(other, other_optimizer, str(folder))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values()))
    assert torch.equal(other_optimizer.state_dict()["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])
    marker = tmp_path / "ran"

    class Planted:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    (folder / shards.INDEX).write_bytes(pickle.dumps(Planted()))
    with pytest.raises(ValueError, match=rf"{folder / shards.INDEX}: not the index of a checkpoint's shards \(.*system is not"):
        shards.load(other, other_optimizer, str(folder))
    assert not marker.exists()
