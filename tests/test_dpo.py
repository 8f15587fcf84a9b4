"""DPO and online DPO (``engines/rl/dpo.py``, ``engines/rl/online_dpo.py``): the loss against the
paper's formula written out one float at a time (value and gradient), pairs from groups, the
refusal of DPO without pairs, pairs kept together by every batching step, one ``TorchTrainer``
step against a hand-written loss, and one tiny run of each through the real flows whose
chosen-vs-rejected margin moves."""

from __future__ import annotations

import math

import pyarrow as pa
import pyarrow.parquet  # noqa: F401  (pa.parquet)
import pytest


import torch

from engines.backends.batching import micro_batches
from engines.backends.torch.trainer import TorchTrainer
from engines.config import ConfigError, load_config
from engines.host.experience import training_rows
from engines.rl.dpo import best_and_worst, dpo_loss
from tests.helpers import random_batch, run_train


def plain_dpo(c: float, r: float, rc: float, rr: float, beta: float) -> float:
    """-log sigmoid(beta * ((c - rc) - (r - rr))), as the paper writes it."""
    z = beta * ((c - rc) - (r - rr))
    return -math.log(1.0 / (1.0 + math.exp(-z)))


@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_dpo_loss_and_gradient_match_the_papers_formula(beta):
    g = torch.Generator().manual_seed(3)
    c, r, rc, rr = (-torch.rand(6, generator=g, dtype=torch.float64) * 20 for _ in range(4))
    c.requires_grad_(True)
    r.requires_grad_(True)
    loss, stats = dpo_loss(c, r, rc, rr, beta)
    want = [plain_dpo(*(float(t[i]) for t in (c.detach(), r.detach(), rc, rr)), beta) for i in range(6)]
    assert loss.tolist() == pytest.approx(want, rel=1e-12)
    loss.sum().backward()
    for i in range(6):
        z = beta * ((float(c.detach()[i]) - float(rc[i])) - (float(r.detach()[i]) - float(rr[i])))
        sig = 1.0 / (1.0 + math.exp(z))  # sigmoid(-z): d/dz -log sigmoid(z) = -sigmoid(-z)
        assert float(c.grad[i]) == pytest.approx(-beta * sig, rel=1e-10)
        assert float(r.grad[i]) == pytest.approx(beta * sig, rel=1e-10)
        assert float(stats["pair_margin"][i]) == pytest.approx(z, rel=1e-12)
        assert float(stats["pair_accuracy"][i]) == float(z > 0)
    # policy == reference: every pair's loss is log 2, whatever the sequences
    assert dpo_loss(c, r, c.detach(), r.detach(), beta)[0].tolist() == pytest.approx([math.log(2)] * 6)


def test_rpo_term_is_the_chosen_nll_per_token_written_out():
    """RPO (dpo's default rpo_alpha 1): each pair's loss gains alpha * -log pi(y_c) / |y_c|, and its
    gradient on the chosen sequence -alpha / |y_c| beside DPO's."""
    g = torch.Generator().manual_seed(5)
    c, r, rc, rr = (-torch.rand(4, generator=g, dtype=torch.float64) * 20 for _ in range(4))
    n = torch.tensor([3, 4, 1, 7])
    c.requires_grad_(True)
    alpha, beta = 0.7, 0.1
    loss, stats = dpo_loss(c, r, rc, rr, beta, n, alpha)
    loss.sum().backward()
    for i in range(4):
        ci, ri, rci, rri, ni = float(c.detach()[i]), float(r[i]), float(rc[i]), float(rr[i]), int(n[i])
        assert float(loss.detach()[i]) == pytest.approx(plain_dpo(ci, ri, rci, rri, beta) + alpha * (-ci / ni), rel=1e-12)
        assert float(stats["chosen_nll"][i]) == pytest.approx(-ci / ni, rel=1e-12)
        z = beta * ((ci - rci) - (ri - rri))
        assert float(c.grad[i]) == pytest.approx(-beta / (1.0 + math.exp(z)) - alpha / ni, rel=1e-10)
    # alpha 0 is the paper's loss, and the defaults: dpo anchors its dataset's chosen side, online_dpo does not
    assert dpo_loss(c, r, rc, rr, beta, n, 0.0)[0].tolist() == pytest.approx(
        [plain_dpo(*(float(t[i]) for t in (c.detach(), r, rc, rr)), beta) for i in range(4)], rel=1e-12)
    assert load_config(None, ["train.algorithm.name=dpo", "data.preferences=p"]).train.algorithm.rpo_alpha == 1.0
    assert load_config(None, ["train.algorithm.name=online_dpo"]).train.algorithm.rpo_alpha == 0.0


def test_pairs_are_each_groups_best_and_worst():
    rewards = [0.0, 1.0, 1.0, 0.5, 0.3, 0.3, 0.3, 0.9, -1.0]
    groups = ["a", "a", "a", "a", "b", "b", "b", "c", "c"]
    # a: the first best (1) and the worst (0); b: all equal, no pair; c: 7 over 8
    assert best_and_worst(rewards, groups) == [(1, 0), (7, 8)]
    rows = [{"step": 0, "wave": 0, "prompt_id": g, "reward": x, "i": i} for i, (x, g) in enumerate(zip(rewards, "aaaabbbcc"))]
    online = load_config(None, ["train.algorithm.name=online_dpo"]).train.algorithm
    out = training_rows(online, rows)
    assert [(r["i"], r["advantage"]) for r in out] == [(1, 1.0), (0, -1.0), (7, 1.0), (8, -1.0)]  # chosen, rejected
    grpo = training_rows(load_config(None, []).train.algorithm, rows)
    assert [r["i"] for r in grpo] == list(range(9))  # an advantage algorithm keeps every sample


def test_dpo_without_pairs_is_refused_naming_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"data.preferences is not set: train.algorithm.name=dpo"):
        load_config(None, ["train.algorithm.name=dpo"])
    with pytest.raises(ConfigError, match=r"data.preferences=data/prefs: train.algorithm.name=online_dpo does not"):
        load_config(None, ["train.algorithm.name=online_dpo", "data.preferences=data/prefs"])
    for name in ("dpo", "online_dpo"):
        needs = load_config(None, [f"train.algorithm.name={name}", "data.preferences=p" if name == "dpo" else "seed=0"]).train.algorithm.needs
        assert needs.pairs and needs.reference and needs.unit == 2 and needs.preferences == (name == "dpo")
    # a preference file without its pairs: named, file and field, as validate_inputs reads it (before engines load)
    from storage import datasets

    pa.parquet.write_table(pa.table({"prompt_id": [1], "prompt": ["1+1="], "answer": ["2"], "rejected": ["3"]}),
                           tmp_path / "part-0.parquet")
    with pytest.raises(datasets.SchemaError, match=r"part-0.parquet: missing field 'chosen'"):
        datasets.PromptReader(f"file://{tmp_path}", datasets.PREFERENCES)


def test_batching_never_separates_a_pair():
    batch = random_batch(14, seed=5, max_prompt=9, max_response=9)
    batch.advantages = [float(i) for i in range(14)]  # row ids
    together = lambda part: all(int(a) % 2 == 0 and int(b) == int(a) + 1 for a, b in zip(part[0::2], part[1::2]))  # noqa: E731
    for parts in (2, 3, 4):
        split = batch.split(parts, unit=2)
        assert sum(len(p) for p in split) == 14 and all(len(p) % 2 == 0 and together(p.advantages) for p in split)
    for budget in (12, 30, 60):
        passes = micro_batches(batch, budget, unit=2)
        assert sorted(a for p in passes for a in p.advantages) == batch.advantages
        assert all(together(p.advantages) for p in passes) and len(passes) > 1


def hand_logprob(model, prompt, response) -> torch.Tensor:
    ids = torch.tensor([prompt + response])
    logp = torch.log_softmax(model(input_ids=ids).logits[0].float()[:-1], -1)
    return logp[torch.arange(len(ids[0]) - 1), ids[0, 1:]][len(prompt) - 1 :].sum()


@pytest.mark.parametrize("rpo_alpha", [0.0, 0.5])
def test_trainer_step_is_the_hand_written_dpo_loss_and_moves_the_margin(tiny_model, rpo_alpha):
    """Pairs over two minibatches and length-sorted micro-batches of ~2 rows: the trainer's loss and
    gradient are the hand-written mean over pairs of the formula (reference = the starting policy;
    with rpo_alpha, plus alpha times the chosen response's NLL per token), and after a few steps the
    policy prefers its chosen responses."""
    algorithm = load_config(None, ["train.algorithm.name=online_dpo", "train.algorithm.beta=0.5",
                                   f"train.algorithm.rpo_alpha={rpo_alpha}"]).train.algorithm
    batch = random_batch(8, seed=11)
    trainer = TorchTrainer(tiny_model, lr=5e-3, grad_clip=1e9, reference=True)
    hand = TorchTrainer(tiny_model).model
    ref = TorchTrainer(tiny_model).model
    pairs = [(2 * k, 2 * k + 1) for k in range(4)]
    first = pairs[:2]  # minibatch 1 of 2: its gradient is what the trainer's first optimizer step used
    loss = sum(-torch.nn.functional.logsigmoid(0.5 * (
        (hand_logprob(hand, batch.prompt_ids[c], batch.response_ids[c]) - hand_logprob(ref, batch.prompt_ids[c], batch.response_ids[c]).detach())
        - (hand_logprob(hand, batch.prompt_ids[r], batch.response_ids[r]) - hand_logprob(ref, batch.prompt_ids[r], batch.response_ids[r]).detach())))
        - rpo_alpha * hand_logprob(hand, batch.prompt_ids[c], batch.response_ids[c]) / len(batch.response_ids[c])
        for c, r in first) / len(first)
    loss.backward()
    if not rpo_alpha:
        assert loss.item() == pytest.approx(math.log(2), abs=1e-6)  # policy == reference
    grads = {n: p.grad.clone() for n, p in hand.named_parameters()}
    seen = {}
    original = torch.optim.AdamW.step

    def record(self, *a, **k):  # the first optimizer step's gradients
        if not seen:
            seen.update({n: p.grad.clone() for n, p in trainer.model.named_parameters()})
        return original(self, *a, **k)

    torch.optim.AdamW.step = record
    try:
        stats = trainer.train_step(batch, algorithm, minibatches=2, micro_batch_tokens=24)
    finally:
        torch.optim.AdamW.step = original
    norm = torch.sqrt(sum((g**2).sum() for g in grads.values())).item()
    for n, g in grads.items():
        assert torch.allclose(seen[n], g, rtol=1e-4, atol=1e-6 * norm), n
    assert {"pair_margin", "pair_accuracy", "chosen_reward", "rejected_reward", "kl_reference"} <= set(stats)

    def margin() -> float:
        lp = [sum(x) for x in trainer.logprobs(batch)]
        return sum(lp[c] - lp[r] for c, r in pairs) / len(pairs)

    start = margin()
    for _ in range(4):
        stats = trainer.train_step(batch, algorithm, minibatches=1)
    assert margin() > start + 1.0 and stats["pair_accuracy"] == 1.0 and stats["pair_margin"] > 0


# ---------------------------------------------------------------- one tiny run of each, through the real flows



def margins(summary: dict) -> list[float]:
    return [m["train"]["pair_margin"] for m in summary["history"]]


def test_online_dpo_run_trains_on_its_best_and_worst_samples(prepared):
    """Each step's experience is (chosen, rejected) rows of one prompt, chosen rewarded higher; the
    policy's preference for its chosen samples over the reference's grows."""
    summary = run_train(prepared, "name=online-dpo", "steps=2", "dp=1", "train.algorithm.name=online_dpo",
                        "train.algorithm.beta=0.5", "train.lr=0.002", "train.minibatches=1")
    rows = pa.parquet.read_table(f"{prepared}/runs/online-dpo/steps/000001/experience").to_pylist()
    assert len(rows) == 4  # sampling.target_groups=2 pairs
    for chosen, rejected in zip(rows[0::2], rows[1::2]):
        assert chosen["prompt_id"] == rejected["prompt_id"] and chosen["reward"] > rejected["reward"]
        assert (chosen["advantage"], rejected["advantage"]) == (1.0, -1.0)
    first, *_, last = margins(summary)
    assert first == pytest.approx(0.0, abs=1e-4)  # one optimizer step per batch: its policy is the reference
    assert last > 0.05, margins(summary)


def test_offline_dpo_run_learns_the_preferences_prepare_wrote(prepared):
    """``data.preferences`` from prepare (right sum over the carry mistake); the host reads it instead of
    rollouts: no generation, the rows' labels as rewards; the margin moves from 0."""
    from flows.prepare import prepare
    from tests.helpers import TINY

    pairs = ["train.algorithm.name=dpo", "data.preferences=data/preferences"]
    prepare(overrides=TINY + [f"storage.root={prepared}", *pairs])
    table = pa.parquet.read_table(f"{prepared}/data/preferences").to_pylist()
    assert all(r["chosen"] == r["answer"] != r["rejected"] for r in table)
    summary = run_train(prepared, "name=offline-dpo", "steps=2", "dp=2", *pairs, "train.algorithm.beta=0.5", "train.lr=0.002",
                        "train.minibatches=1", "reward.genrm_weight=0", "reward.rule_weight=1")
    rows = pa.parquet.read_table(f"{prepared}/runs/offline-dpo/steps/000001/experience/group=1").to_pylist()
    by_id = {r["prompt_id"]: r for r in table}
    for chosen, rejected in zip(rows[0::2], rows[1::2]):
        assert chosen["response"] == by_id[chosen["prompt_id"]]["chosen"] and chosen["reward"] == 1.0
        assert rejected["response"] == by_id[chosen["prompt_id"]]["rejected"] and rejected["reward"] == 0.0
    first, *_, last = margins(summary)
    assert first == pytest.approx(0.0, abs=1e-4)
    assert last > 0.05, margins(summary)
