"""Packed micro-batches (``batching.packed_micro_batches``, ``batching.Packed``) and the loss normalised
over the global batch: the same step however the rows are cut, packed or spread over DP ranks.

Every invariance runs on rows of very uneven length (one 8x the median, where padding costs most and a
per-micro-batch normalisation errs most) for every algorithm's aggregation: GRPO (sequence mean, with
the reference's KL), DAPO (token mean), Dr. GRPO, GSPO, CISPO, RLOO, REINFORCE++ (whitened over the
batch), PPO and its critic (per-token advantages; the critic's value loss), DPO (pairs, kept together).
DAPO's rows are episodes with observation tokens (loss mask 0). One step of each is compared with the step of one padded pass over the whole batch ("1 x 8"): eight
passes of one row ("8 x 1"), packed passes within a budget, one packed pass, and two gloo DP ranks
against one process. The measure is ``step_gap`` (tests/helpers.py: the parameters' distance from the
reference step relative to the step's size; fp32 summation noise is ~1e-7 here, STEP_RTOL 1e-3) and,
since Adam's first step is nearly blind to how large a gradient is, the gradient left in ``.grad``
relative to its norm and the reported loss. A control that normalises each micro-batch by its own
count must fail the same check.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
import torch.multiprocessing as mp

from engines.backends.base import TrainBatch
from engines.backends.batching import (
    Packed,
    micro_batches,
    packed_micro_batches,
    pad_batch,
)
from engines.backends.torch.critic import TorchCritic
from engines.backends.torch.model import (
    packed_logprobs,
    packing_refusal,
    sequence_logprobs,
)
from engines.backends.torch.trainer import TorchTrainer
from engines.rl import algorithms
from engines.rl.cispo import CISPOConfig
from engines.rl.dpo import DPOConfig
from engines.rl.grpo import GRPOConfig
from engines.rl.gspo import GSPOConfig
from engines.rl.ppo import PPOConfig
from engines.rl.reinforce_pp import ReinforcePPConfig
from engines.rl.rloo import RLOOConfig
from tests.helpers import (
    BOS,
    EOS,
    FIRST_CHAR_ID,
    STEP_RTOL,
    free_port,
    global_order,
    params_of,
    parity,
    step_gap,
)

LR = 1e-2
GRADS_RTOL = 1e-5  # the gradient's largest elementwise difference relative to its norm (fp32 noise: ~1e-7)
ALGORITHMS = {
    "grpo": GRPOConfig(loss_aggregation="sequence", clip_high=0.2, kl_coef=0.1),
    "dapo": GRPOConfig(),
    "dr_grpo": GRPOConfig(advantage_scale="none"),
    "gspo": GSPOConfig(),
    "cispo": CISPOConfig(),
    "rloo": RLOOConfig(),
    "reinforce_pp": ReinforcePPConfig(),
    "ppo": PPOConfig(),
    "dpo": DPOConfig(beta=0.5),
}
# name -> (packed, micro_batch_tokens): the step "1 x 8" is the reference the others are held to
LAYOUTS = {"1x8": (False, None), "8x1": (False, 1), "packed": (True, 48), "packed-1-pass": (True, None)}


def uneven_batch(seed: int, rows: int = 8) -> TrainBatch:
    """``rows`` sequences of 5..9 tokens and one of 8x the median (the third), rows i and i + 1 of
    each pair of one prompt (DPO's chosen and rejected)."""
    rng = random.Random(seed)
    prompts, responses = [], []
    for i in range(rows):
        if i % 2 == 0:
            prompt = [BOS] + [rng.randrange(FIRST_CHAR_ID, 49) for _ in range(rng.randint(1, 3))]
        prompts.append(prompt)
        responses.append([rng.randrange(FIRST_CHAR_ID, 49) for _ in range(rng.randint(3, 5))] + [EOS])
    lengths = sorted(len(p) + len(r) for p, r in zip(prompts, responses))
    median = lengths[rows // 2]
    responses[2] = [rng.randrange(FIRST_CHAR_ID, 49) for _ in range(8 * median - len(prompts[2]) - 1)] + [EOS]
    return TrainBatch(prompts, responses, [[0.0] * len(r) for r in responses], [0.0] * rows)


def algorithm_batch(single_thread_model: str, name: str, seed: int) -> TrainBatch:
    """An uneven batch with what ``name``'s step reads: old log-probabilities near the policy's (some
    ratios clipped), advantages from rewards as the host computes them (PPO: per token, from a critic's
    values, with the critic's returns). DPO: 12 rows, so that its pairs too fill more than one packed pass
    (the long row's partner opens a second lane as long as it, where 8 short rows would all fit)."""
    rows = 12 if ALGORITHMS[name].needs.pairs else 8
    batch = uneven_batch(seed, rows)
    rng = random.Random(seed + 1)
    now = TorchTrainer(single_thread_model).logprobs(batch)
    batch.old_logprobs = [[x + rng.uniform(-0.3, 0.3) for x in row] for row in now]
    rewards = [float(rng.random() < 0.5) + rng.uniform(-0.1, 0.1) for _ in range(rows)]
    algorithm = ALGORITHMS[name]
    if name == "ppo":
        batch.values = [[rng.uniform(-0.5, 0.5) for _ in r] for r in batch.response_ids]
        batch.advantages, batch.returns = algorithm.token_advantages(rewards, batch.values)
    elif name != "dpo":
        batch.advantages = algorithm.advantages(rewards, [i // 4 for i in range(rows)])
    if name == "dapo":  # an episode's observation tokens (loss mask 0): read by no loss and no count
        batch.loss_mask = [[0 if 1 <= j <= 2 else 1 for j in range(len(r))] for r in batch.response_ids]
    return batch


def critic_of(single_thread_model: str, packed: bool) -> TorchCritic:
    """A critic whose value head is not zero, so that its backbone gets gradients too."""
    critic = TorchCritic(single_thread_model, lr=LR, grad_clip=1e9, packed=packed)
    with torch.no_grad():
        critic.model.value_head.weight.copy_(torch.randn(critic.model.value_head.weight.shape,
                                                         generator=torch.Generator().manual_seed(0)) * 0.5)
    return critic


def train(single_thread_model: str, name: str, batch: TrainBatch, packed: bool, budget: int | None) -> dict:
    """One step of ``name`` (and of PPO's critic); parameters, gradients and statistics of each model."""
    algorithm = ALGORITHMS[name]
    trainer = TorchTrainer(single_thread_model, lr=LR, grad_clip=1e9, reference=algorithm.needs.reference, packed=packed)
    out = {"policy": record(trainer.model, lambda: trainer.train_step(batch, algorithm, 1, budget))}
    if algorithm.needs.critic:
        critic = critic_of(single_thread_model, packed)
        out["critic"] = record(critic.model, lambda: critic.train_step(batch, algorithm, 1, budget))
    return out


def record(model: torch.nn.Module, step) -> dict:
    before = params_of(model)
    stats = step()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"before": before, "params": params_of(model), "grads": grads, "stats": stats}


def gaps(a: dict, b: dict) -> dict[str, float]:
    """How far step ``b`` is from the reference step ``a``, per model: step_gap, gradients relative to
    their norm, and the largest difference of a reported loss."""
    out = {}
    for part in a:
        ga, gb = a[part]["grads"], b[part]["grads"]
        norm = max(sum(float((g.double() ** 2).sum()) for g in ga.values()) ** 0.5, 1e-12)
        loss = "value_loss" if part == "critic" else "loss"
        out[part] = {"step": step_gap(b[part]["params"], a[part]["params"], a[part]["before"]),
                     "grads": max(float((ga[k] - gb[k]).abs().max()) for k in ga) / norm,
                     "loss": abs(a[part]["stats"][loss] - b[part]["stats"][loss])}
    return out


def assert_same_step(a: dict, b: dict) -> None:
    for part, g in gaps(a, b).items():
        assert g["step"] < STEP_RTOL and g["grads"] < GRADS_RTOL and g["loss"] < 1e-5, (part, g)


# ---------------------------------------------------------------- the layout


def test_packed_passes_hold_every_row_once_within_the_budget_and_pairs_together():
    batch = uneven_batch(3, rows=24)
    batch.advantages = [float(i) for i in range(24)]  # row ids
    lengths = [len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)]
    for budget in (1, 40, max(lengths), 2 * max(lengths), 10_000, None):
        for unit in (1, 2):
            passes = packed_micro_batches(batch, budget, unit)
            assert sorted(a for p in passes for a in p.advantages) == batch.advantages
            for p in passes:
                packed = Packed(p, 0, unit)
                # over the budget only as one lane (a pair: two) of a row longer than it, shorter rows in its tail
                assert budget is None or packed.ids.numel() <= budget or packed.ids.shape[0] <= unit
                assert int(packed.real.sum()) == sum(len(x) + len(y) for x, y in zip(p.prompt_ids, p.response_ids))
                if unit == 2:  # a pair's rows are consecutive in the pass (the pair loss reads rows 2k, 2k + 1)
                    assert all(int(a) % 2 == 0 and int(b) == int(a) + 1 for a, b in zip(p.advantages[0::2], p.advantages[1::2]))
            if budget is None:
                assert len(passes) == 1
            if budget == 10_000:  # the long row's lane takes short rows in its tail; the rest make a narrower pass
                assert len(passes) == 2 and max(len(x) + len(y) for x, y in zip(passes[1].prompt_ids, passes[1].response_ids)) < max(lengths) / 2
    # positions restart on every row; the rows read back in pad_batch's layout
    packed = Packed(batch, 0)
    ids, _, resp, _ = pad_batch(batch, 0)
    assert torch.equal(packed.rows(packed.ids[:, 1:]) * resp.long(), ids[:, 1:] * resp.long())
    for i, n in enumerate(lengths):
        assert packed.positions[packed.lane[i], packed.start[i] : packed.start[i] + n].tolist() == list(range(n))
    # far less padding than one padded pass
    assert packed.ids.numel() < 0.4 * len(batch) * max(lengths)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen3_moe", "gemma3_text", "qwen3_5_text"])
def test_packed_forward_equals_padded_or_packing_is_refused(family, single_thread_model):
    """Each family of tiny_hub: the packed forward's log-probabilities are the padded forward's (Gemma 3's
    sliding window shorter than the long row), or the family is refused, for the reason that shows here:
    Qwen3.5's linear attention carries one row's state into the next."""
    from engines.demo.tiny_hub import (
        ARCHITECTURES,
        build_bpe_tokenizer,
        build_tiny_model,
    )

    tokenizer = build_bpe_tokenizer(ARCHITECTURES[family])
    model = build_tiny_model(family, tokenizer, hidden_size=64, num_layers=2, init_std=0.1).eval()
    batch = uneven_batch(5)
    ids, attn, resp, _ = pad_batch(batch, 0)
    with torch.no_grad():
        gap = float(((sequence_logprobs(model, ids, attn, 1.0) - packed_logprobs(model, Packed(batch, 0), 1.0)) * resp).abs().max())
    refusal = packing_refusal(model.config)
    if family == "qwen3_5_text":
        assert refusal and "linear-attention" in refusal and gap > 1e-2
    else:
        assert refusal is None and parity(f"packed vs padded forward, {family}", gap) < 1e-5


def test_families_that_cannot_pack_are_named(tmp_path):
    from engines.demo.tiny_hub import save_tiny_hub_model

    folder = save_tiny_hub_model("qwen3_5_text", tmp_path / "q35", hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1)
    assert "linear-attention" in TorchTrainer(str(folder)).packing  # the trainer runs padded passes
    assert "linear-attention" in TorchCritic(str(folder), lr=1e-3).packing
    from transformers import LlamaConfig

    assert "vision-language" in packing_refusal(LlamaConfig(), vision=True)
    assert "mamba" in packing_refusal(type("C", (), {"model_type": "mamba"})())


# ---------------------------------------------------------------- one process: every layout, every algorithm


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_every_layout_takes_the_step_of_one_padded_pass(single_thread_model, name):
    unit = ALGORITHMS[name].needs.unit
    batch = algorithm_batch(single_thread_model, name, seed=11)
    # preconditions: the budgets cut this batch into several passes, packing pads less
    assert len(packed_micro_batches(batch, LAYOUTS["packed"][1], unit)) >= 2
    assert len(micro_batches(batch, LAYOUTS["8x1"][1], unit)) == len(batch) // unit
    steps = {layout: train(single_thread_model, name, batch, packed, budget) for layout, (packed, budget) in LAYOUTS.items()}
    reference = steps.pop("1x8")
    assert all(s["stats"]["grad_norm" if part == "policy" else "critic_grad_norm"] > 0 for part, s in reference.items())
    for layout, step in steps.items():
        for part, g in gaps(reference, step).items():
            parity(f"{name} {part}: {layout} vs 1x8, step_gap", g["step"])
        assert_same_step(reference, step)


def test_a_per_micro_batch_normalisation_fails_the_check(single_thread_model, monkeypatch):
    """The control: each pass's loss divided by its own token count (OpenRLHF #1249, veRL #6957's
    critic) instead of the minibatch's is a different step on these rows, and the check says so."""
    batch = algorithm_batch(single_thread_model, "dapo", seed=11)
    reference = train(single_thread_model, "dapo", batch, False, None)
    assert_same_step(reference, train(single_thread_model, "dapo", batch, True, LAYOUTS["packed"][1]))
    good = algorithms.token_weights
    monkeypatch.setattr(algorithms, "token_weights", lambda mask, aggregation, total: good(mask, aggregation, mask.sum().item()))
    for packed, budget in (LAYOUTS["8x1"], LAYOUTS["packed"]):
        wrong = train(single_thread_model, "dapo", batch, packed, budget)
        g = gaps(reference, wrong)["policy"]
        assert g["step"] > 10 * STEP_RTOL and g["grads"] > 100 * GRADS_RTOL, g
        with pytest.raises(AssertionError):
            assert_same_step(reference, wrong)


# ---------------------------------------------------------------- two gloo DP ranks against one process


def dp_worker(rank: int, port: int, single_thread_model: str, cases_file: str, out_dir: str) -> None:
    """One of two DP ranks: every case's step (policy, and PPO's critic) on its rank's rows, packed."""
    from datetime import timedelta

    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    try:
        for name, batches in torch.load(cases_file, weights_only=False).items():
            step = train(single_thread_model, name, batches[rank], *LAYOUTS["packed"])
            torch.save({part: {k: v for k, v in s.items() if k != "before"} for part, s in step.items()},
                       os.path.join(out_dir, f"{name}-rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def dp_run(single_thread_model, tmp_path_factory):
    """Each algorithm's rows split unevenly over two ranks: rank 0 holds the long row and two more,
    rank 1 the other five (DPO: rank 0 one pair, rank 1 the five others, the long row's among them)."""
    tmp = tmp_path_factory.mktemp("packing-dp")
    cases = {}
    for name, algorithm in ALGORITHMS.items():
        batch = algorithm_batch(single_thread_model, name, seed=23)
        cut = 2 if algorithm.needs.pairs else 3
        cases[name] = [batch.take(range(cut)), batch.take(range(cut, len(batch)))]
    torch.save(cases, tmp / "cases.pt")
    (tmp / "out").mkdir()
    mp.spawn(dp_worker, args=(free_port(), single_thread_model, str(tmp / "cases.pt"), str(tmp / "out")), nprocs=2, join=True)
    return cases, {name: [torch.load(tmp / "out" / f"{name}-rank{r}.pt", weights_only=False) for r in range(2)]
                   for name in cases}


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_dp2_packed_takes_the_step_of_one_process(single_thread_model, dp_run, name):
    cases, results = dp_run
    rank0, rank1 = results[name]
    for part in rank0:
        assert all(torch.equal(rank0[part]["params"][k], rank1[part]["params"][k]) for k in rank0[part]["params"])
    one = train(single_thread_model, name, global_order(cases[name], 1), False, None)  # one process, one padded pass
    for part in one:
        rank0[part]["before"] = one[part]["before"]
    if "critic" in one:  # each rank reports its critic's loss per its own tokens: their token-weighted mean
        tokens = [sum(b.trained_tokens()) for b in cases[name]]
        rank0["critic"]["stats"]["value_loss"] = sum(
            r["critic"]["stats"]["value_loss"] * t for r, t in zip((rank0, rank1), tokens)) / sum(tokens)
    parity(f"{name}: dp=2 packed vs dp=1 padded, step_gap", gaps(one, rank0)["policy"]["step"])
    assert_same_step(one, rank0)


# ---------------------------------------------------------------- MoE: replayed routes stay with their tokens


def test_moe_router_replay_packed_equals_padded(tmp_path, single_thread_model):
    """Random routes replayed (``train.router_replay``): a route put on the wrong token of a packed lane
    would change the log-probabilities; packed and padded agree, and so do their steps and load balance."""
    from engines.demo.tiny_hub import save_tiny_hub_model

    folder = str(save_tiny_hub_model("qwen3_moe", tmp_path / "moe", hidden_size=64, num_layers=2, num_heads=2,
                                     num_kv_heads=1, init_std=0.1))
    batch = uneven_batch(7)
    rng = random.Random(0)
    # 2 layers x top 2 of 4 experts per token fed (all but the last); -1 here and there: the router's own choice
    batch.routed_experts = [[e for _ in range(len(p) + len(r) - 1) for _ in range(2) for e in rng.sample(range(4), 2)]
                            for p, r in zip(batch.prompt_ids, batch.response_ids)]
    batch.routed_experts[1][:4] = [-1] * 4
    batch.advantages = [rng.uniform(-1, 1) for _ in range(len(batch))]
    own = TorchTrainer(folder).logprobs(batch)  # without replay
    batch.old_logprobs = [[x + 0.1 * (-1) ** i for i, x in enumerate(row)] for row in own]
    steps = {}
    for packed in (False, True):
        trainer = TorchTrainer(folder, lr=LR, grad_clip=1e9, router_replay=True, packed=packed)
        assert (trainer.packing is None) == packed
        logprobs = trainer.logprobs(batch)
        assert max(abs(a - b) for r, o in zip(logprobs, own) for a, b in zip(r, o)) > 1e-2  # the routes matter
        steps[packed] = {"logprobs": logprobs,
                         **record(trainer.model, lambda t=trainer: t.train_step(batch, GRPOConfig(), 1, 48))}
    gap = max(abs(a - b) for r, o in zip(steps[True]["logprobs"], steps[False]["logprobs"]) for a, b in zip(r, o))
    assert parity("moe router replay: packed vs padded log-probs", gap) < 1e-5
    assert_same_step({"policy": steps[False]}, {"policy": steps[True]})
    assert steps[True]["stats"]["router_balance"] == pytest.approx(steps[False]["stats"]["router_balance"], rel=1e-5)
