"""Data parallelism: two gloo replicas take exactly the step of one process on the union.

Two processes are spawned once for the whole module (importing torch/transformers is the
slow part); each runs every case's ``TorchTrainer.train_step`` on its own shard. The
reference is one process without ``torch.distributed`` stepping on the concatenated
batch, ordered minibatch by minibatch so that its ``split`` gives the same global
minibatches as the ranks' local splits together.
"""

from __future__ import annotations

import pytest


import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engines.backends.torch.trainer import TorchTrainer
from engines.rl.cispo import CISPOConfig
from engines.rl.grpo import GRPOConfig
from engines.rl.gspo import GSPOConfig
from engines.rl.ppo import PPOConfig
from engines.rl.reinforce_pp import ReinforcePPConfig
from engines.rl.rloo import RLOOConfig
from tests.helpers import (STEP_RTOL, concat, global_order, dp_worker, free_port, max_param_diff, params_of, parity, random_batch, save_tiny_model,
                     step_gap, with_old_logprobs)

MINIBATCHES = 2
LR = 1e-2
# A step's parity is ``step_gap`` against STEP_RTOL (tests/helpers.py: why not an elementwise bound);
# a step without the all-reduce, or normalised by local token counts, lands far outside it.

# name -> (sequences per rank, train_step kwargs, TorchTrainer kwargs)
CASES = {
    "token-3-5": ((3, 5), {"algorithm": GRPOConfig(loss_aggregation="token")}, {}),
    "sequence-3-5": ((3, 5), {"algorithm": GRPOConfig(loss_aggregation="sequence")}, {}),
    "token-0-4": ((0, 4), {"algorithm": GRPOConfig(loss_aggregation="token")}, {}),
    "sequence-0-4": ((0, 4), {"algorithm": GRPOConfig(loss_aggregation="sequence")}, {}),
    "sequence-4-1": ((4, 1), {"algorithm": GRPOConfig(loss_aggregation="sequence")}, {}),
    "token-kl-3-5": ((3, 5), {"algorithm": GRPOConfig(loss_aggregation="token", kl_coef=0.5)}, {"reference": True}),
    # every algorithm's loss; REINFORCE++ whitens its advantages over both ranks' sequences (one all-reduce)
    "gspo-3-5": ((3, 5), {"algorithm": GSPOConfig(clip_low=0.05, clip_high=0.05)}, {}),
    "cispo-3-5": ((3, 5), {"algorithm": CISPOConfig()}, {}),
    "rloo-3-5": ((3, 5), {"algorithm": RLOOConfig()}, {}),
    "reinforce-pp-3-5": ((3, 5), {"algorithm": ReinforcePPConfig()}, {}),
    "reinforce-pp-0-4": ((0, 4), {"algorithm": ReinforcePPConfig()}, {}),
    # per-token advantages (a critic's), whitened over both ranks' tokens
    "ppo-3-5": ((3, 5), {"algorithm": PPOConfig()}, {}),
}



@pytest.fixture(scope="module")
def dp_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dp")
    model_dir = save_tiny_model(tmp / "model", hidden_size=32, num_layers=1)
    probe = TorchTrainer(model_dir, lr=LR)
    cases = {}
    for i, (name, (sizes, step_kwargs, trainer_kwargs)) in enumerate(CASES.items()):
        batches = []
        for rank, n in enumerate(sizes):
            batch = random_batch(n, seed=100 * i + rank)
            # old log-probs near the trainer's own: ratio ~1 with some tokens beyond the clip range
            batch = with_old_logprobs(batch, probe.logprobs(batch), noise=0.3, seed=100 * i + rank)
            if step_kwargs["algorithm"].needs.critic:  # one advantage per response token
                batch.advantages = [[a * (1 + 0.3 * t) for t in range(len(r))] for a, r in zip(batch.advantages, batch.response_ids)]
            batches.append(batch)
        cases[name] = {
            "batches": batches,
            "kwargs": {"minibatches": MINIBATCHES, **step_kwargs},
            "trainer": {"lr": LR, **trainer_kwargs},
        }
    cases_file = tmp / "cases.pt"
    torch.save(cases, cases_file)
    out = tmp / "out"
    out.mkdir()
    mp.spawn(dp_worker, args=(2, free_port(), model_dir, str(cases_file), str(out)), nprocs=2, join=True)
    results = {
        name: [torch.load(out / f"{name}-rank{rank}.pt", weights_only=False) for rank in range(2)] for name in cases
    }
    return {"model_dir": model_dir, "cases": cases, "results": results}


def reference_step(model_dir: str, case: dict) -> tuple[dict, dict]:
    """One process, no torch.distributed, on the concatenated batch."""
    assert not (dist.is_available() and dist.is_initialized())
    batches = case["batches"]
    mb = case["kwargs"]["minibatches"]
    union = global_order(batches, mb)
    # precondition: the union's own split is the ranks' minibatches put together
    for k, part in enumerate(union.split(mb)):
        expected = concat(*(b.split(mb)[k] for b in batches))
        assert part.response_ids == expected.response_ids, "case sizes do not give aligned minibatches"
    trainer = TorchTrainer(model_dir, **case["trainer"])
    stats = trainer.train_step(union, **case["kwargs"])
    return params_of(trainer.model), stats


@pytest.mark.parametrize("name", list(CASES))
def test_replicas_identical_and_equal_single_process(dp_run, name):
    case = dp_run["cases"][name]
    rank0, rank1 = dp_run["results"][name]
    initial = params_of(TorchTrainer(dp_run["model_dir"]).model)

    # the step did something, so "equal" below is not "both untouched"
    assert max_param_diff(rank0["params"], initial) > 1e-3

    # replicas agree bit for bit (same all-reduced gradients, same optimizer)
    assert max_param_diff(rank0["params"], rank1["params"]) == 0.0

    ref_params, ref_stats = reference_step(dp_run["model_dir"], case)
    assert parity("torch trainer: dp=2 step vs one process", step_gap(rank0["params"], ref_params, initial)) < STEP_RTOL

    # the reported loss is the global one on every rank, and equals the single process's
    assert rank0["stats"]["loss"] == pytest.approx(rank1["stats"]["loss"], abs=1e-9)
    assert rank0["stats"]["loss"] == pytest.approx(ref_stats["loss"], abs=1e-5)
    tokens = [sum(len(r) for r in b.response_ids) for b in case["batches"]]
    assert [rank0["stats"]["tokens"], rank1["stats"]["tokens"]] == tokens


@pytest.mark.parametrize("name", ["token-3-5", "sequence-3-5"])
def test_without_all_reduce_replicas_diverge(dp_run, name):
    """What the invariant above guards against: each rank stepping on its shard alone
    (no gradient all-reduce, local normalisation) gives replicas that differ from each
    other and from the single-process step by far more than the tolerance."""
    case = dp_run["cases"][name]
    solo = []
    for batch in case["batches"]:
        trainer = TorchTrainer(dp_run["model_dir"], **case["trainer"])
        trainer.train_step(batch, **case["kwargs"])
        solo.append(params_of(trainer.model))
    ref_params, _ = reference_step(dp_run["model_dir"], case)
    initial = params_of(TorchTrainer(dp_run["model_dir"]).model)
    for params in solo:
        assert parity("control: torch trainer, a rank without the all-reduce", step_gap(params, ref_params, initial)) > 50 * STEP_RTOL
    # while the DP replicas match the reference
    assert step_gap(dp_run["results"][name][0]["params"], ref_params, initial) < STEP_RTOL


def test_local_normalisation_would_be_detected(dp_run):
    """Summing per-rank gradients each normalised by its *local* token count (instead of
    the global one) is a different step; the DP run matches the global one only."""
    from engines.rl import algorithms
    from engines.backends.batching import pad_batch
    from engines.backends.torch.model import sequence_logprobs

    case = dp_run["cases"]["token-3-5"]
    mb = case["kwargs"]["minibatches"]
    trainer = TorchTrainer(dp_run["model_dir"], **case["trainer"])
    for k in range(mb):
        trainer.optimizer.zero_grad(set_to_none=True)
        for batch in case["batches"]:  # gradients of the shards accumulate (= an all-reduce sum)
            part = batch.split(mb)[k]
            if not len(part):
                continue
            ids, attn, resp, old = pad_batch(part, trainer.tokenizer.pad_token_id)
            lp = sequence_logprobs(trainer.model, ids, attn, trainer.temperature)
            per_token, _ = algorithms.policy_loss_terms(lp, old, torch.tensor(part.advantages), 0.2, 0.28)
            local_total = resp.sum().item()
            (per_token * algorithms.token_weights(resp, "token", local_total)).sum().backward()
        torch.nn.utils.clip_grad_norm_(trainer.model.parameters(), trainer.grad_clip)
        trainer.optimizer.step()
    ref_params, _ = reference_step(dp_run["model_dir"], case)
    initial = params_of(TorchTrainer(dp_run["model_dir"]).model)
    assert parity("control: torch trainer, local normalisation", step_gap(params_of(trainer.model), ref_params, initial)) > 10 * STEP_RTOL
    assert step_gap(dp_run["results"]["token-3-5"][0]["params"], ref_params, initial) < STEP_RTOL
