"""Mixture of experts on the torch engines: a tiny random Qwen3-MoE (Qwen3-30B-A3B's architecture,
``engines.demo.tiny_hub``) rolls out and trains, and router replay (``train.router_replay``) closes the
train-vs-rollout gap that routing flips open.

The gap is made the way it arises in production: the rollout engine computes in bf16 (autocast,
as on a GPU), the trainer in fp32; where two experts are nearly tied the two choose differently. The
same batch is scored by the trainer with its own routing and with the rollout's routes replayed.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from engines.backends.base import TrainBatch
from engines.backends.batching import pad_batch, padded_routes
from engines.backends.torch import routing
from engines.backends.torch.generator import TorchGenerator
from engines.backends.torch.model import sequence_logprobs
from engines.backends.torch.trainer import TorchTrainer
from engines.demo.tiny_hub import save_tiny_hub_model

PROMPTS = ["What is 12 + 7?", "Solve for x: 3x + 5 = 20.", "You are a helpful assistant. 2^10 = ?"]


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> str:
    # head size 32; std 0.1 so that routing is decided by the input, not near-uniform
    folder = tmp_path_factory.mktemp("tiny-qwen3-moe")
    return str(save_tiny_hub_model("qwen3_moe", folder, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                                   init_std=0.1))


def rollout_batch(generator: TorchGenerator) -> TrainBatch:
    gens = generator.generate(PROMPTS, n=4, temperature=1.0, max_new_tokens=16, seed=0)
    return TrainBatch([g.prompt_ids for g in gens], [g.response_ids for g in gens], [g.logprobs for g in gens],
                      [1.0 if i % 2 else -1.0 for i in range(len(gens))], routed_experts=[g.routed_experts for g in gens])


def gaps(trainer: TorchTrainer, batch: TrainBatch) -> tuple[float, float]:
    """(max, mean) |trainer - rollout| log-prob over the batch's response tokens."""
    _, _, resp, old = pad_batch(batch, trainer.tokenizer.pad_token_id)
    ours = trainer.logprobs(batch)
    gap = torch.tensor([abs(a - b) for r, o in zip(ours, batch.old_logprobs) for a, b in zip(r, o)])
    assert gap.numel() == int(resp.sum())
    return gap.max().item(), gap.mean().item()


def test_routes_are_recorded_for_every_token_fed_and_replaying_them_is_exact(moe):
    """fp32 rollout: the recorded routes are the trainer's own choices, token for token, and a forward
    that replays them gives bit-identical log-probs (the replayed scoring is the router's own)."""
    generator = TorchGenerator(moe, record_routes=True)
    batch = rollout_batch(generator)
    layers, top_k = routing.shape(generator.model)
    assert (layers, top_k) == (2, 2)
    for p, r, routes in zip(batch.prompt_ids, batch.response_ids, batch.routed_experts):
        assert len(routes) == (len(p) + len(r) - 1) * layers * top_k  # every token fed: all but the last sampled
    ids, attn, _, _ = pad_batch(batch, generator.tokenizer.pad_token_id)
    replayed = padded_routes(batch.routed_experts, ids.shape[1], layers, top_k)
    with torch.no_grad(), routing.recording(generator.model) as calls:
        own = sequence_logprobs(generator.model, ids, attn, 1.0)
    chosen = torch.stack([c[0].long() for c in calls], 1).view(replayed.shape)  # [rows, width, layers, top_k]
    known = replayed[..., 0, 0] >= 0
    assert known.sum() > 100 and torch.equal(chosen[known], replayed[known])
    with torch.no_grad(), routing.replaying(generator.model, replayed):
        again = sequence_logprobs(generator.model, ids, attn, 1.0)
    assert torch.equal(own, again)
    assert TorchGenerator(moe).generate(PROMPTS[:1], max_new_tokens=4)[0].routed_experts is None  # off unless asked


def test_router_replay_shrinks_the_gap_of_a_bf16_rollout_and_the_router_still_trains(moe):
    """A bf16 rollout and the fp32 trainer: routing flips on near-ties and the trainer's log-probs of
    the sampled tokens drift far from the rollout's; replaying the rollout's routes brings them back
    to what bf16 rounding alone leaves (measured on a 2-core AMD EPYC, 2026-11-28: max 1.39 -> 0.038,
    mean 0.026 -> 0.011). A train step under replay moves the router's weights (their gradient is the
    trainer's softmax at the replayed experts), and reports the load-balance figure."""
    batch = rollout_batch(TorchGenerator(moe, record_routes=True, autocast=True))
    own = gaps(TorchTrainer(moe), batch)
    trainer = TorchTrainer(moe, router_replay=True, lr=1e-2)
    replayed = gaps(trainer, batch)
    assert replayed[0] < own[0] / 5 and replayed[1] < own[1], (own, replayed)

    gate = "model.layers.0.mlp.gate.weight"
    before = dict(trainer.model.named_parameters())[gate].detach().clone()
    figures = trainer.train_step(batch)
    assert not torch.equal(dict(trainer.model.named_parameters())[gate], before)
    assert 2.0 <= figures["router_balance"] <= 4.0  # experts per token (even) .. experts (one takes all)


TWO_TURNS = '''
from engines.agents.environment import Step

class TwoTurns:
    def reset(self, row):
        self.turn = 0
        return row["prompt"]
    def step(self, text):
        self.turn += 1
        return Step(None, reward=0.0, done=True) if self.turn == 2 else Step("Once more.", reward=0.0)
'''


def test_router_replay_in_episodes_keeps_each_turns_routes(tmp_path):
    """Multi-turn episodes on a bf16 rollout: each turn's call records the routes of what it fed, and
    the episode keeps, for every token, the routes of the call that generated it (earlier turns'
    tokens their own decoding's, observations their prefill's): replayed, the trainer's log-probs of
    the sampled tokens, in every turn, come back to what bf16 rounding leaves (measured, AMD EPYC,
    2026-11-29: max 1.14 -> 0.042 nats over 324 sampled tokens of 24 episodes, 23 of two turns; the
    second turns' alone at most 0.042)."""
    from transformers import AutoModelForCausalLM

    from engines.agents.episodes import Episodes
    from engines.backends import chat
    from engines.config.sections import RolloutConfig

    folder = str(save_tiny_hub_model("qwen3_moe", tmp_path / "moe", hidden_size=128, num_layers=2, num_heads=4,
                                     num_kv_heads=2, init_std=0.1))
    model = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():  # a random model never ends its turn: make its end-of-turn token likely after a few tokens
        ids = torch.tensor([list(range(2, 40))])
        direction = model.model(input_ids=ids).last_hidden_state[0].mean(0)
        model.lm_head.weight[model.config.eos_token_id] += 3.0 * direction / direction.norm()
    model.save_pretrained(folder)
    (tmp_path / "two_turns.py").write_text(TWO_TURNS)
    generator = TorchGenerator(folder, prompt_format=chat.PromptFormat("auto"), record_routes=True, autocast=True)
    episodes = Episodes(RolloutConfig(env=f"{tmp_path}/two_turns.py:TwoTurns", max_turns=2, max_new_tokens=24), generator.renderer)
    played = episodes.run(generator, [{"prompt_id": i, "prompt": p, "answer": ""} for i, p in enumerate(PROMPTS)], 8, seed=3)
    layers, top_k = routing.shape(generator.model)
    assert sum(e.turns == 2 for e in played) >= 3, [e.turns for e in played]
    assert all(len(e.routes) == (len(e.prompt_ids) + len(e.response_ids) - 1) * layers * top_k for e in played)
    batch = TrainBatch([e.prompt_ids for e in played], [e.response_ids for e in played], [e.logprobs for e in played],
                       [1.0, -1.0] * 12, loss_mask=[e.loss_mask for e in played], routed_experts=[e.routes for e in played])

    def sampled_gaps(trainer: TorchTrainer, second_turn: bool = False) -> list[float]:
        out = []
        for e, lps in zip(played, trainer.logprobs(batch)):
            start = e.loss_mask.index(0) if second_turn and 0 in e.loss_mask else 0  # past the first observation
            out += [abs(a - b) for a, b, m in list(zip(lps, e.logprobs, e.loss_mask))[start:] if m]
        return out

    own, replayed = TorchTrainer(folder), TorchTrainer(folder, router_replay=True)
    assert max(sampled_gaps(replayed)) < max(sampled_gaps(own)) / 5, (max(sampled_gaps(own)), max(sampled_gaps(replayed)))
    later = sampled_gaps(replayed, second_turn=True)
    assert later and max(later) < 0.1  # the second turns' tokens too: no route off by a position


def test_balance_loss_reads_even_load_as_top_k_and_one_expert_as_all():
    even = torch.zeros(8, 4)
    even[torch.arange(8), torch.arange(8) % 4] = 5.0  # each token prefers another expert, evenly
    assert routing.balance_loss([even], torch.ones(8), top_k=1).item() == pytest.approx(1.0, abs=0.05)
    collapsed = torch.zeros(8, 4)
    collapsed[:, 0] = 20.0
    assert routing.balance_loss([collapsed], torch.ones(8), top_k=1).item() == pytest.approx(4.0, abs=1e-3)
    # masked rows do not count: the even batch plus collapsed padding reads as even
    both = torch.cat([even, collapsed])
    assert routing.balance_loss([both], torch.cat([torch.ones(8), torch.zeros(8)]), 1).item() == pytest.approx(1.0, abs=0.05)


def test_what_is_not_wired_for_a_mixture_is_refused_naming_why(moe, tmp_path):
    import pyarrow as pa

    from engines.config import RunConfig, load_config
    from engines.host import validation
    from storage import datasets

    with pytest.raises(ValueError, match="train.router_balance: wired for train.backend=torch only"):
        RunConfig.model_validate({"train": {"router_balance": 0.001, "backend": "megatron"}})
    with pytest.raises(ValueError, match="train.router_replay: the timing stub routes nothing"):
        RunConfig.model_validate({"train": {"router_replay": True, "backend": "stub"}})
    with pytest.raises(ValueError, match="recorded by rollout.backend=torch only"):
        RunConfig.model_validate({"train": {"router_replay": True}, "rollout": {"backend": "vllm"}})
    dense = save_tiny_hub_model("qwen3", tmp_path / "dense", hidden_size=32, num_layers=1, num_heads=1, num_kv_heads=1)
    with pytest.raises(ValueError, match=r"has no mixture-of-experts router.*Qwen3ForCausalLM is dense"):
        TorchTrainer(str(dense), router_replay=True)
    # the Megatron trainer takes the mixture at TP = PP = 1 only: said before engines load
    prompts = str(tmp_path / "prompts.parquet")
    datasets.write_table(prompts, pa.Table.from_pylist([{"prompt_id": 1, "prompt": PROMPTS[0], "answer": "19"}]), datasets.PROMPTS)
    config = load_config(None, [f"storage.root={tmp_path}", f"model.policy={moe}", f"data.prompts={prompts}", "data.heldout=null",
                                "reward.genrm_weight=0", "reward.rule_weight=1", "train.backend=megatron",
                                "train.tensor_parallel=2"])
    with pytest.raises(validation.InputError, match=r"model\.policy: .*a mixture of experts .*tensor_parallel=1"):
        validation.validate_inputs(config)


def test_a_moe_policy_trains_through_the_flow_with_router_replay(prepared):
    """The production path: the demo's prompts on a tiny Qwen3-MoE policy, one step on a real engine
    host with ``train.router_replay``: the rollout dataset carries each sample's routes (every token
    fed), the trainer replays them, and the step reports the router's load balance."""
    from pathlib import Path

    import pyarrow.parquet as pq

    from flows.training import train
    from tests.helpers import TINY

    root = Path(prepared)
    save_tiny_hub_model("qwen3_moe", root / "models" / "tiny-moe", hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1)
    summary = asyncio.run(train(overrides=TINY + [f"storage.root={root}", "name=moe", "steps=1", "dp=1", "eval.every=null",
                                                  "model.policy=models/tiny-moe", "train.router_replay=true",
                                                  "train.router_balance=0.001"]))
    (step,) = summary["history"]
    assert 2.0 <= step["train"]["router_balance"] <= 4.0
    rows = [r for part in (root / "runs" / "moe" / "steps" / "000000" / "rollouts").glob("group=0/*.parquet")
            for r in pq.read_table(part).to_pylist()]
    assert rows and all(len(r["routed_experts"]) == (len(r["prompt_ids"]) + len(r["response_ids"]) - 1) * 2 * 2
                        and set(r["routed_experts"]) <= {0, 1, 2, 3} for r in rows)
