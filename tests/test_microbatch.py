"""Micro-batching (``train.micro_batch_tokens``): each minibatch's forward/backward in
length-sorted passes of bounded padded size is the same update as one padded pass.

The passes' losses are weighted by the whole minibatch's DP-global token (or sequence)
count and their gradients accumulate before the one all-reduce and optimizer step, so the
parameters, the reported loss, clip fraction and gradient norm all equal the one-pass
step's up to float summation order — alone and over two gloo DP ranks.

Precision: in float64 the one-pass and micro-batched steps agree to ~1e-13 (the update is the
same; only summation order differs), so the float64 checks use 1e-9. In float32 the gradients
agree to ~3e-8 of their norm, but Adam's first step moves each weight by ~lr * g / |g|: a
weight whose true gradient is ~0 gets a noise-sized gradient of either sign, and moves by up
to ~lr * 1e-2 either way (seen: 6e-5 at lr 1e-2). The float32 checks therefore compare the
gradients, loss and grad norm tightly and the parameters to lr * 1e-2.

Adam is also nearly blind to a uniform factor on the gradient (it divides by the gradient's
own size), so equal parameters alone are a weak check of the scaling: the checks also compare
the pre-clip gradient norm, the reported loss and the gradient left in ``.grad``, and
``test_wrong_scaling_is_caught`` shows that two wrong scalings fail them.
"""

from __future__ import annotations

import pytest


import torch
import torch.multiprocessing as mp

from engines.rl import algorithms
from engines.backends.base import TrainBatch
from engines.backends.torch.trainer import TorchTrainer
from engines.backends.batching import micro_batches
from tests.helpers import (STEP_RTOL, concat, global_order, dp_worker, free_port, max_param_diff, params_of, parity, random_batch, step_gap, with_old_logprobs)
from engines.rl.grpo import GRPOConfig

LR = 1e-2
# dtype -> (parameters: the step's gap, tests/helpers.py; grad norm, gradients: relative to the grad norm)
TOLERANCE = {"float64": (1e-9, 1e-9), "float32": (STEP_RTOL, 1e-5)}
BUDGET = 16  # padded tokens per pass: sequences here are 3..17 tokens, so 1..5 rows a pass
MINIBATCHES = 2


def lengths(batch: TrainBatch) -> list[int]:
    return [len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)]


def rows(batch: TrainBatch) -> list[tuple]:
    return sorted(zip(map(tuple, batch.prompt_ids), map(tuple, batch.response_ids), map(tuple, batch.old_logprobs), batch.advantages))


# ---------------------------------------------------------------- the split itself


@pytest.mark.parametrize("budget", [1, 10, 16, 40, 10_000])
def test_micro_batches_cover_every_row_once_within_budget(budget):
    batch = random_batch(23, seed=7, max_prompt=5, max_response=12)
    passes = micro_batches(batch, budget)
    assert rows(concat(*passes)) == rows(batch)  # every row once, fields kept together
    widths = []
    for p in passes:
        n = lengths(p)
        assert n == sorted(n, reverse=True)  # longest first within a pass ...
        assert len(p) * max(n) <= budget or len(p) == 1  # ... a lone over-long row is its own pass
        widths.append(max(n))
    assert widths == sorted(widths, reverse=True)  # ... and across passes
    if budget == 10_000:
        assert len(passes) == 1
    if budget == 1:
        assert len(passes) == len(batch)
    # padding computed: never more than the one padded pass
    assert sum(len(p) * max(lengths(p)) for p in passes) <= len(batch) * max(lengths(batch))


def best_cut(widths: list[int], budget: int) -> tuple[int, int]:
    """(passes, padded tokens) of the best cut of rows sorted longest first, by trying every cut."""
    best = None
    for mask in range(2 ** (len(widths) - 1)):
        bounds = [0] + [k + 1 for k in range(len(widths) - 1) if mask >> k & 1] + [len(widths)]
        segments = [(b - a, widths[a]) for a, b in zip(bounds, bounds[1:])]
        if all(n * w <= budget or n == 1 for n, w in segments):
            cost = (len(segments), sum(n * w for n, w in segments))
            best = cost if best is None else min(best, cost)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_micro_batches_fewest_passes_then_least_padding(seed):
    batch = random_batch(9, seed=seed, max_prompt=5, max_response=12)
    for budget in (12, 20, 30, 45, 80):
        passes = micro_batches(batch, budget)
        got = (len(passes), sum(len(p) * max(lengths(p)) for p in passes))
        assert got == best_cut(sorted(lengths(batch), reverse=True), budget), budget


def test_micro_batches_do_not_mix_long_and_short_rows_needlessly():
    """4 long and 4 short rows, a budget that holds 7 long ones: filling the first pass greedily
    would pad 3 short rows to the long width; the fewest passes (2) are long | short."""
    batch = TrainBatch([[1]] * 8, [[5] * 99] * 4 + [[5] * 9] * 4, [[0.0] * 99] * 4 + [[0.0] * 9] * 4, [0.0] * 8)
    passes = micro_batches(batch, 7 * 100)
    assert [lengths(p) for p in passes] == [[100] * 4, [10] * 4]


def test_micro_batches_none_and_empty():
    batch = random_batch(5, seed=1)
    assert micro_batches(batch, None) == [batch]  # one pass, rows in their order
    assert micro_batches(TrainBatch([], [], [], []), 16) == []
    assert micro_batches(TrainBatch([], [], [], []), None) == []


# ---------------------------------------------------------------- one process


def make_batch(single_thread_model: str, n: int, seed: int) -> TrainBatch:
    """Lengths 3..17, old log-probs near the trainer's own (some ratios beyond the clip range)."""
    batch = random_batch(n, seed=seed, max_prompt=5, max_response=12)
    return with_old_logprobs(batch, TorchTrainer(single_thread_model).logprobs(batch) if n else [], noise=0.3, seed=seed)


def step(single_thread_model: str, batch: TrainBatch, budget: int | None, trainer_kwargs: dict, step_kwargs: dict, dtype="float64") -> dict:
    trainer = TorchTrainer(single_thread_model, lr=LR, dtype=dtype, **trainer_kwargs)
    before = params_of(trainer.model)
    stats = trainer.train_step(batch, minibatches=MINIBATCHES, micro_batch_tokens=budget, **step_kwargs)
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}  # the last minibatch's (clipped) gradient
    return {"params": params_of(trainer.model), "before": before, "stats": stats, "grads": grads}


def differences(a: dict, b: dict) -> dict:
    """How far apart two steps are: parameters and loss (absolute), grad norm and gradients
    (relative to the grad norm)."""
    norm = max(abs(a["stats"]["grad_norm"]), 1e-12)
    return {
        "params": step_gap(b["params"], a["params"], a["before"]),
        "loss": abs(a["stats"]["loss"] - b["stats"]["loss"]),
        "grad_norm": abs(a["stats"]["grad_norm"] - b["stats"]["grad_norm"]) / norm,
        "grads": max((a["grads"][k] - b["grads"][k]).abs().max().item() for k in a["grads"]) / norm,
        "clip_fraction": abs(a["stats"]["clip_fraction"] - b["stats"]["clip_fraction"]),
        "tokens": abs(a["stats"]["tokens"] - b["stats"]["tokens"]),
    }


def assert_same_step(a: dict, b: dict, dtype: str = "float64") -> None:
    atol, rel = TOLERANCE[dtype]
    d = differences(a, b)
    assert d["params"] < atol, d
    assert d["grad_norm"] < rel and d["grads"] < rel, d
    assert d["loss"] < 1e-6, d  # the loss terms are float32 in both dtypes (logits are cast)
    assert d["clip_fraction"] < 1e-9 and d["tokens"] == 0, d


CASES = {
    "token": ({"algorithm": GRPOConfig(loss_aggregation="token")}, {}),
    "sequence": ({"algorithm": GRPOConfig(loss_aggregation="sequence")}, {}),
    "token-kl": ({"algorithm": GRPOConfig(loss_aggregation="token", kl_coef=0.5)}, {"reference": True}),
    "sequence-kl": ({"algorithm": GRPOConfig(loss_aggregation="sequence", kl_coef=0.5)}, {"reference": True}),
}


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("name", list(CASES))
def test_micro_batched_step_equals_one_pass(single_thread_model, name, dtype):
    step_kwargs, trainer_kwargs = CASES[name]
    batch = make_batch(single_thread_model, 12, seed=3)
    # precondition: every minibatch really runs in several passes of different widths
    for part in batch.split(MINIBATCHES):
        passes = micro_batches(part, BUDGET)
        assert len(passes) >= 3 and len({max(lengths(p)) for p in passes}) >= 3
    one = step(single_thread_model, batch, None, trainer_kwargs, step_kwargs, dtype)
    micro = step(single_thread_model, batch, BUDGET, trainer_kwargs, step_kwargs, dtype)
    assert max_param_diff(one["params"], params_of(TorchTrainer(single_thread_model, dtype=dtype).model)) > 1e-3  # it trained
    assert 0 < one["stats"]["clip_fraction"] < 1
    d = differences(one, micro)
    parity(f"torch trainer: micro-batches vs one pass ({dtype}), step", d["params"])
    parity(f"torch trainer: micro-batches vs one pass ({dtype}), gradients / grad norm", d["grads"])
    assert_same_step(one, micro, dtype)


def test_wrong_scaling_is_caught(single_thread_model, monkeypatch):
    """Two plausible mistakes fail ``assert_same_step``: normalising each pass by its own
    token count, and a uniform factor (here 1/2, e.g. dividing by the number of passes) —
    the latter changes Adam's step only where a gradient is near Adam's eps, but the loss
    and the grad norm by 2x."""
    step_kwargs, trainer_kwargs = CASES["token"][0], {"grad_clip": 1e9}  # no clipping: see the halved case
    batch = make_batch(single_thread_model, 12, seed=3)
    one = step(single_thread_model, batch, None, trainer_kwargs, step_kwargs)
    good = algorithms.token_weights

    monkeypatch.setattr(algorithms, "token_weights", lambda mask, aggregation, total: good(mask, aggregation, mask.sum().item()))
    per_pass = differences(one, step(single_thread_model, batch, BUDGET, trainer_kwargs, step_kwargs))
    assert per_pass["params"] > 1e-3 and per_pass["grad_norm"] > 1e-3 and per_pass["grads"] > 1e-3, per_pass

    monkeypatch.setattr(algorithms, "token_weights", lambda mask, aggregation, total: good(mask, aggregation, total) / 2)
    halved = step(single_thread_model, batch, BUDGET, trainer_kwargs, step_kwargs)
    assert halved["stats"]["loss"] / one["stats"]["loss"] == pytest.approx(0.5, rel=1e-3)
    assert halved["stats"]["grad_norm"] / one["stats"]["grad_norm"] == pytest.approx(0.5, rel=1e-3)
    with pytest.raises(AssertionError):
        assert_same_step(one, halved)


# ---------------------------------------------------------------- two gloo DP ranks


# name -> (sequences per rank, train_step kwargs, TorchTrainer kwargs)
DP_CASES = {
    "token-7-5": ((7, 5), {"algorithm": GRPOConfig(loss_aggregation="token")}, {}),
    "sequence-7-5": ((7, 5), {"algorithm": GRPOConfig(loss_aggregation="sequence")}, {}),
    "token-kl-7-5": ((7, 5), {"algorithm": GRPOConfig(loss_aggregation="token", kl_coef=0.5)}, {"reference": True}),
    "sequence-kl-0-8": ((0, 8), {"algorithm": GRPOConfig(loss_aggregation="sequence", kl_coef=0.5)}, {"reference": True}),
}



@pytest.fixture(scope="module")
def dp_run(single_thread_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("micro-dp")
    cases = {}
    for i, (name, (sizes, step_kwargs, trainer_kwargs)) in enumerate(DP_CASES.items()):
        cases[name] = {
            "batches": [make_batch(single_thread_model, n, seed=100 * i + rank) for rank, n in enumerate(sizes)],
            "kwargs": {"minibatches": MINIBATCHES, "micro_batch_tokens": BUDGET, **step_kwargs},
            "trainer": {"lr": LR, "dtype": "float64", **trainer_kwargs},
        }
    torch.save(cases, tmp / "cases.pt")
    out = tmp / "out"
    out.mkdir()
    mp.spawn(dp_worker, args=(2, free_port(), single_thread_model, str(tmp / "cases.pt"), str(out)), nprocs=2, join=True)
    results = {name: [torch.load(out / f"{name}-rank{r}.pt", weights_only=False) for r in range(2)] for name in cases}
    return {"cases": cases, "results": results}


@pytest.mark.parametrize("name", list(DP_CASES))
def test_dp2_micro_batched_equals_one_process_one_pass(single_thread_model, dp_run, name):
    """Two ranks, each in several passes, step like one process on the union in one pass."""
    case = dp_run["cases"][name]
    rank0, rank1 = dp_run["results"][name]
    assert max_param_diff(rank0["params"], rank1["params"]) == 0.0
    assert any(len(micro_batches(part, BUDGET)) >= 2 for b in case["batches"] for part in b.split(MINIBATCHES))

    trainer = TorchTrainer(single_thread_model, **case["trainer"])
    one_pass = {k: v for k, v in case["kwargs"].items() if k != "micro_batch_tokens"}
    ref_stats = trainer.train_step(global_order(case["batches"], MINIBATCHES), **one_pass)
    ref_params = params_of(trainer.model)
    atol, rel = TOLERANCE["float64"]
    assert step_gap(rank0["params"], ref_params, params_of(TorchTrainer(single_thread_model, dtype="float64").model)) < atol
    for stats in (rank0["stats"], rank1["stats"]):
        assert stats["loss"] == pytest.approx(ref_stats["loss"], abs=1e-6)  # float32 loss terms
        assert stats["grad_norm"] == pytest.approx(ref_stats["grad_norm"], rel=rel)
    # clip fraction and tokens are per rank (as without micro-batching): their token-weighted sum is the union's
    tokens = [rank0["stats"]["tokens"], rank1["stats"]["tokens"]]
    assert tokens == [sum(len(r) for r in b.response_ids) for b in case["batches"]]
    clipped = sum(s["clip_fraction"] * t for s, t in zip((rank0["stats"], rank1["stats"]), tokens))
    assert clipped == pytest.approx(ref_stats["clip_fraction"] * ref_stats["tokens"], abs=1e-6)
