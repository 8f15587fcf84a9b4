"""Megatron-Core trainer: the HF mapping, parity with TorchTrainer, TP and DP over gloo, checkpoints.

On this CPU-only machine Megatron runs under ``megatron_cpu``'s shim. The reference for every
number is ``TorchTrainer`` (transformers) or a single Megatron process. Two processes are
spawned once for the module (imports are the slow part) and run every TP=2 / DP=2 case.

Tolerances: fp32 log-probs agree to ~3e-7 (ATOL 1e-5). After an Adam step the weights are
compared by ``step_gap`` against STEP_RTOL (tests/helpers.py): Adam divides each gradient by its
own size, so tiny gradients born of cancellation, summed in another order (Megatron fuses Q/K/V
and gate/up into single matmuls), move by amounts that depend on the CPU's kernels; the step as a
whole does not. A step that misses the DP all-reduce lands far outside it (checked below).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import megatron_cpu

megatron_cpu.install()  # before Megatron is imported: its modules are patched as they load
pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install megatron-core)")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from engines.backends.megatron.trainer import MegatronTrainer  # noqa: E402

from engines.backends.megatron.mapping import (HFState, hf_to_megatron, load_hf_state, megatron_tensors, megatron_to_hf,  # noqa: E402
                                               stage_name)
from engines.demo.tiny import build_char_tokenizer  # noqa: E402
from engines.backends.base import TrainBatch  # noqa: E402
from engines.backends.torch.generator import TorchGenerator  # noqa: E402
from engines.backends.torch.trainer import TorchTrainer  # noqa: E402
from tests.helpers import STEP_RTOL, free_port, global_order, parity, random_batch, save_tiny_model, step_gap, with_old_logprobs  # noqa: E402
from engines.config.layout import Layout  # noqa: E402
from test_replica_check import replica_checks  # noqa: E402
from engines.rl.cispo import CISPOConfig  # noqa: E402
from engines.rl.grpo import GRPOConfig  # noqa: E402
from engines.rl.gspo import GSPOConfig  # noqa: E402
from engines.rl.online_dpo import OnlineDPOConfig  # noqa: E402
from engines.rl.reinforce_pp import ReinforcePPConfig  # noqa: E402

# Megatron without Apex or Transformer Engine warns at every layer it builds
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning")

TESTS = Path(__file__).resolve().parent
LR = 1e-3
ATOL = 1e-5
MINIBATCHES = 2
# non-default hyperparameters, so that "configured alike" means something
HYPER = {"lr": LR, "betas": (0.8, 0.95), "weight_decay": 0.1, "grad_clip": 0.5}

# name -> (sequences per rank for each of two steps, train_step kwargs, trainer kwargs)
DP_CASES = {
    "token-3-5": ((3, 5), {"algorithm": GRPOConfig(loss_aggregation="token")}, {}),
    "sequence-3-5": ((3, 5), {"algorithm": GRPOConfig(loss_aggregation="sequence")}, {}),
    "token-0-4": ((0, 4), {"algorithm": GRPOConfig(loss_aggregation="token")}, {}),
    "sequence-0-4": ((0, 4), {"algorithm": GRPOConfig(loss_aggregation="sequence")}, {}),
    "token-kl-3-5": ((3, 5), {"algorithm": GRPOConfig(loss_aggregation="token", kl_coef=0.5)}, {"reference": True}),
    "reinforce-pp-3-5": ((3, 5), {"algorithm": ReinforcePPConfig()}, {}),  # advantages whitened over both ranks
    "token-3-5-distopt": ((3, 5), {"algorithm": GRPOConfig(loss_aggregation="token")}, {"distributed_optimizer": True}),
    # each rank's minibatch in several forward/backward passes (under DDP's no_sync but the last)
    "token-kl-3-5-micro": ((3, 5), {"algorithm": GRPOConfig(loss_aggregation="token", kl_coef=0.5), "micro_batch_tokens": 16}, {"reference": True}),
    "sequence-3-5-micro-distopt": ((3, 5), {"algorithm": GRPOConfig(loss_aggregation="sequence"), "micro_batch_tokens": 16}, {"distributed_optimizer": True}),
}


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def lp_diff(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(r) for r in a] == [len(r) for r in b]
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))



def batch_near(trainer, n: int, seed: int) -> TrainBatch:
    """Old log-probs near the trainer's own: ratios ~1, some beyond the clip range."""
    batch = random_batch(n, seed=seed)
    return with_old_logprobs(batch, trainer.logprobs(batch) if n else [], noise=0.5, seed=seed)


# --- 1. mapping ------------------------------------------------------------------------------


@pytest.mark.parametrize("tp_size", [1, 2])
def test_hf_megatron_round_trip_is_exact(megatron_model, tp_size):
    hf_state, hf_config = load_hf_state(megatron_model), AutoConfig.from_pretrained(megatron_model)
    shards = [hf_to_megatron(hf_state, hf_config, rank, tp_size) for rank in range(tp_size)]
    back = megatron_to_hf(shards if tp_size > 1 else shards[0], hf_config)
    assert back.keys() == hf_state.keys()
    assert all(torch.equal(back[k], hf_state[k]) for k in hf_state)
    # each rank holds whole query groups: 2 KV groups over 2 ranks -> 1 group (2 q + k + v heads)
    assert shards[0]["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (4 * 8 * 2 // tp_size, 32)


def test_qkv_is_interleaved_per_group_and_fc1_is_gate_up_per_rank(megatron_model):
    hf_state, hf_config = load_hf_state(megatron_model), AutoConfig.from_pretrained(megatron_model)
    q, k, v = (hf_state[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv")
    gate, up = hf_state["model.layers.0.mlp.gate_proj.weight"], hf_state["model.layers.0.mlp.up_proj.weight"]
    for rank in range(2):  # TP=2, 2 KV groups of 2 query heads of dim 8
        m = hf_to_megatron(hf_state, hf_config, rank, 2)
        qkv = m["decoder.layers.0.self_attention.linear_qkv.weight"]
        assert torch.equal(qkv, torch.cat([q[16 * rank : 16 * rank + 16], k[8 * rank : 8 * rank + 8], v[8 * rank : 8 * rank + 8]]))
        fc1 = m["decoder.layers.0.mlp.linear_fc1.weight"]
        assert torch.equal(fc1, torch.cat([gate.chunk(2)[rank], up.chunk(2)[rank]]))


def test_a_pipeline_stage_reads_only_its_own_tensors_from_the_folder(tmp_path):
    """``megatron_tensors`` with a stage's ``keep`` reads its layers' Hugging Face tensors (and the
    last stage's norm and output layer) from the folder and no other, and converts them as the
    whole model's mapping does."""
    folder = save_tiny_model(tmp_path / "policy", hidden_size=32, num_layers=4)
    hf_config, reads = AutoConfig.from_pretrained(folder), []

    class Counted(HFState):
        def __getitem__(self, name):
            reads.append(name)
            return super().__getitem__(name)

    last = lambda name: stage_name(name, 2, 2, False, True, hf_config.tie_word_embeddings)  # noqa: E731 - layers 2-3 of 4
    mine = dict(megatron_tensors(Counted(HFState.open(folder).index), hf_config, keep=lambda n: last(n) is not None))
    own = ("model.layers.2.", "model.layers.3.", "model.norm.", "lm_head.", *(("model.embed_tokens.",) * hf_config.tie_word_embeddings))
    assert reads and all(name.startswith(own) for name in reads) and len(reads) == len(set(reads))
    whole = hf_to_megatron(load_hf_state(folder), hf_config)
    assert mine.keys() == {n for n in whole if last(n) is not None} and all(torch.equal(mine[n], whole[n]) for n in mine)
    assert {last(n) for n in mine} >= {"decoder.layers.0.mlp.linear_fc2.weight", "decoder.final_layernorm.weight"}


# --- 2./3. parity with TorchTrainer -----------------------------------------------------------


def test_logprobs_match_torch_trainer(megatron_model):
    megatron, reference = MegatronTrainer(megatron_model), TorchTrainer(megatron_model)
    batch = random_batch(6, seed=1, max_response=9)
    assert parity("megatron vs torch trainer: log-probs", lp_diff(megatron.logprobs(batch), reference.logprobs(batch))) <= ATOL
    assert megatron.logprobs(TrainBatch([], [], [], [])) == []


def test_optimizers_are_configured_alike(megatron_model):
    megatron, reference = MegatronTrainer(megatron_model, **HYPER), TorchTrainer(megatron_model, **HYPER)
    (inner,) = [o.optimizer for o in megatron.optimizer.chained_optimizers]
    assert type(inner) is type(reference.optimizer) is torch.optim.AdamW
    for key in ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize"):
        assert inner.defaults[key] == reference.optimizer.defaults[key], key
    # no parameter group opts out of weight decay (Megatron's default exempts norms and biases)
    assert all(group.get("weight_decay", inner.defaults["weight_decay"]) == 0.1 for group in inner.param_groups)
    assert sum(p.numel() for g in inner.param_groups for p in g["params"]) > 0
    assert megatron.optimizer.config.clip_grad == reference.grad_clip == 0.5


@pytest.mark.parametrize(
    "step_kwargs, trainer_kwargs",
    [
        ({"minibatches": 2, "algorithm": GRPOConfig(loss_aggregation="token")}, {}),
        ({"minibatches": 1, "algorithm": GRPOConfig(loss_aggregation="sequence", kl_coef=0.5)}, {"reference": True}),
        # sequence-level ratio and clipping; eps wider than the paper's so that some sequences stay unclipped
        ({"minibatches": 2, "algorithm": GSPOConfig(clip_low=0.1, clip_high=0.1)}, {}),
        ({"minibatches": 2, "algorithm": CISPOConfig()}, {}),
    ],
    ids=["token-2-minibatches", "sequence-kl", "gspo", "cispo"],
)
def test_train_step_matches_torch_trainer(megatron_model, step_kwargs, trainer_kwargs):
    megatron = MegatronTrainer(megatron_model, **HYPER, **trainer_kwargs)
    reference = TorchTrainer(megatron_model, **HYPER, **trainer_kwargs)
    batch = batch_near(reference, 8, seed=3)
    before = {k: v.clone() for k, v in reference.export_weights()}  # TorchTrainer yields live views
    stats, ref_stats = megatron.train_step(batch, **step_kwargs), reference.train_step(batch, **step_kwargs)
    after, ref_after = dict(megatron.export_weights()), dict(reference.export_weights())
    assert parity("megatron vs torch trainer: step", step_gap(after, ref_after, before)) <= STEP_RTOL
    assert stats["grad_norm"] > HYPER["grad_clip"]  # clipping was active
    for key in ("loss", "clip_fraction", "tokens", "grad_norm"):
        assert stats[key] == pytest.approx(ref_stats[key], rel=1e-6, abs=1e-5), key  # a grad norm of ~50 is 1e-5 apart on plain kernels
    assert 0 < stats["clip_fraction"] < 1
    assert megatron.version == 1


def test_dpo_pair_loss_matches_torch_trainer(megatron_model):
    """Online DPO's pair loss (both rows of a pair in one pass, reference log-probs) over two
    minibatches of length-sorted micro-batches: Megatron's step is torch's."""
    algorithm = OnlineDPOConfig(beta=0.5)
    megatron = MegatronTrainer(megatron_model, **HYPER, reference=True)
    reference = TorchTrainer(megatron_model, **HYPER, reference=True)
    batch = batch_near(reference, 8, seed=3)
    before = {k: v.clone() for k, v in reference.export_weights()}
    kwargs = {"minibatches": 2, "micro_batch_tokens": 24}
    stats, ref_stats = megatron.train_step(batch, algorithm, **kwargs), reference.train_step(batch, algorithm, **kwargs)
    after, ref_after = dict(megatron.export_weights()), dict(reference.export_weights())
    assert parity("megatron vs torch trainer: online DPO step", step_gap(after, ref_after, before)) <= STEP_RTOL
    for key in ("loss", "grad_norm", "pair_margin", "pair_accuracy", "kl_reference"):
        assert stats[key] == pytest.approx(ref_stats[key], rel=1e-6, abs=1e-5), key  # a grad norm of ~50 is 1e-5 apart on plain kernels
    assert stats["pair_margin"] != 0.0  # the second minibatch saw the first one's update


@pytest.mark.parametrize(
    "step_kwargs, trainer_kwargs",
    [({"algorithm": GRPOConfig(loss_aggregation="token")}, {}), ({"algorithm": GRPOConfig(loss_aggregation="sequence", kl_coef=0.5)}, {"reference": True})],
    ids=["token", "sequence-kl"],
)
def test_micro_batches_equal_one_pass(megatron_model, step_kwargs, trainer_kwargs):
    """Length-sorted passes of <= 16 padded tokens, gradients accumulated in DDP's buffers: the
    one-pass step (and its loss and pre-clip grad norm, which Adam's step alone would not show)."""
    from engines.backends.batching import micro_batches

    batch = batch_near(TorchTrainer(megatron_model), 10, seed=7)
    kwargs = {"minibatches": 2, **step_kwargs}
    assert all(len(micro_batches(part, 16)) >= 3 for part in batch.split(2))
    runs = []
    for budget in (None, 16):
        trainer = MegatronTrainer(megatron_model, **HYPER, **trainer_kwargs)
        runs.append((trainer.train_step(batch, micro_batch_tokens=budget, **kwargs), dict(trainer.export_weights())))
    (one, one_weights), (micro, micro_weights) = runs
    assert parity("megatron: micro-batches vs one pass, step", step_gap(micro_weights, one_weights, load_hf_state(megatron_model))) <= STEP_RTOL
    assert micro["loss"] == pytest.approx(one["loss"], abs=1e-6)
    assert micro["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
    assert micro["clip_fraction"] == pytest.approx(one["clip_fraction"], abs=1e-9) and micro["tokens"] == one["tokens"]


def test_qwen2_tied_embeddings_and_qkv_bias(tmp_path, megatron_model):
    """The other mapped family: Qwen2 (bias on Q/K/V) with input and output embeddings tied."""
    tokenizer = build_char_tokenizer()
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
        rope_theta=50000.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    model = Qwen2ForCausalLM(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)  # HF initialises biases to zero: make the mapping matter
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)

    megatron, reference = MegatronTrainer(str(tmp_path)), TorchTrainer(str(tmp_path))
    assert dict(megatron.export_weights()).keys() == dict(reference.export_weights()).keys()
    assert all(torch.equal(t, dict(reference.export_weights())[k]) for k, t in megatron.export_weights())
    batch = random_batch(5, seed=2)
    assert lp_diff(megatron.logprobs(batch), reference.logprobs(batch)) <= ATOL


def test_save_hf_loads_in_transformers(tmp_path, megatron_model):
    megatron = MegatronTrainer(megatron_model, lr=LR)
    megatron.train_step(batch_near(megatron, 4, seed=5))
    megatron.save_hf(str(tmp_path / "hf"))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    exported = dict(megatron.export_weights())
    assert {k: p.detach() for k, p in loaded.named_parameters()}.keys() == exported.keys()
    assert all(torch.equal(p, exported[k]) for k, p in loaded.named_parameters())
    batch = random_batch(4, seed=6)
    assert lp_diff(TorchTrainer(str(tmp_path / "hf")).logprobs(batch), megatron.logprobs(batch)) <= ATOL


def test_bfloat16_trains(megatron_model):
    """bf16 parameters (norms included: the optimizer wants one dtype), fp32 main copies."""
    megatron, reference = MegatronTrainer(megatron_model, **HYPER, dtype="bfloat16"), TorchTrainer(megatron_model)
    batch = batch_near(reference, 6, seed=4)
    assert lp_diff(megatron.logprobs(batch), reference.logprobs(batch)) < 1e-2  # bf16 rounding
    assert {p.dtype for p in megatron.model.parameters()} == {torch.bfloat16}
    before = dict(megatron.export_weights())
    assert megatron.train_step(batch)["grad_norm"] > 0
    assert max_diff(dict(megatron.export_weights()), before) > 0


# --- attention: SDPA instead of the local spec's unfused DotProductAttention -------------------


def _causal(s: int) -> torch.Tensor:
    return torch.ones(s, s, dtype=torch.bool).triu(1)[None, None]  # Megatron's masks: True = not allowed


def _padded_causal(s: int, batch: int) -> torch.Tensor:
    """Causal, and row b's first b keys hidden from every query after the first b+1 (never a whole row)."""
    mask = _causal(s).repeat(batch, 1, 1, 1)
    for b in range(batch):
        mask[b, 0, b + 1 :, :b] = True
    return mask


@pytest.mark.parametrize("mask", ["none", "causal", "padded"])
def test_sdpa_attention_equals_local_spec_attention_with_gqa(megatron_model, mask):
    """Same inputs through Megatron's DotProductAttention and SDPAttention: 2 query heads sharing
    1 key/value head (the demo's shape), outputs and input gradients equal to 1e-5 in fp32. Megatron
    builds the causal mask itself when given none (the trainer gives none)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer import TransformerConfig

    from engines.backends.megatron.model import SDPAttention, _init_distributed

    _init_distributed(1, torch.device("cpu"))
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=2, num_query_groups=1, kv_channels=16,
                               attention_dropout=0.0, hidden_dropout=0.0)
    kwargs = {"config": config, "layer_number": 1, "attn_mask_type": AttnMaskType.causal, "attention_type": "self"}
    local, sdpa = DotProductAttention(**kwargs), SDPAttention(**kwargs)
    seq, batch = 9, 3
    g = torch.Generator().manual_seed(0)
    q = torch.randn(seq, batch, 2, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(seq, batch, 1, 16, generator=g, requires_grad=True) for _ in range(2))
    attention_mask = {"none": None, "causal": _causal(seq), "padded": _padded_causal(seq, batch)}[mask]
    outs, grads = [], []
    for module in (local, sdpa):
        out = module(q, k, v, attention_mask, attn_mask_type=AttnMaskType.causal)
        assert out.shape == (seq, batch, 32)
        outs.append(out)
        grads.append(torch.autograd.grad(out, (q, k, v), torch.ones_like(out) + out.detach()))
    assert (outs[0] - outs[1]).abs().max().item() <= ATOL
    assert max((a - b).abs().max().item() for a, b in zip(*grads)) <= ATOL
    # the tolerance tells attention patterns apart: attending to the future is far outside it
    full = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), enable_gqa=True)
    assert (full.permute(2, 0, 1, 3).reshape(seq, batch, 32) - outs[0]).abs().max().item() > 1e-2


def test_gpt_logits_with_sdpa_equal_the_local_spec(tmp_path, megatron_model):
    """A whole GPTModel of the demo's shape (2 query heads, 1 key/value head) built from the same
    Hugging Face weights with each attention: logits equal to 1e-5 in fp32."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from engines.backends.megatron.model import SDPAttention, _init_distributed, build_gpt, transformer_config
    from engines.demo.tiny import build_tiny_llama

    tokenizer = build_char_tokenizer()
    build_tiny_llama(len(tokenizer), hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, seed=3).save_pretrained(tmp_path)
    _init_distributed(1, torch.device("cpu"))
    hf_config, hf_state = AutoConfig.from_pretrained(tmp_path), load_hf_state(tmp_path)
    config = transformer_config(hf_config, 1, torch.float32)
    local = build_gpt(hf_config, config, hf_state, layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"))
    sdpa = build_gpt(hf_config, config, hf_state)
    assert isinstance(sdpa.decoder.layers[0].self_attention.core_attention, SDPAttention)
    assert not isinstance(local.decoder.layers[0].self_attention.core_attention, SDPAttention)
    ids = torch.randint(4, len(tokenizer), (3, 12), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(12).expand(3, 12)
    with torch.no_grad():
        logits = [m(input_ids=ids, position_ids=positions, attention_mask=None) for m in (local, sdpa)]
    assert logits[0].abs().max() > 0.1
    assert (logits[0] - logits[1]).abs().max().item() <= ATOL


# --- activation recomputation -----------------------------------------------------------------


RECOMPUTE = {
    "full-uniform": ({"recompute_granularity": "full"}, "layer"),
    "full-block": ({"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1}, "layer"),
    "selective-core_attn": ({"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}, "core_attention"),
    "selective-mlp": ({"recompute_granularity": "selective", "recompute_modules": ["mlp"]}, "mlp"),
}


@pytest.mark.parametrize("name", list(RECOMPUTE))
def test_recomputation_reruns_the_forward_and_changes_nothing(megatron_model, name):
    """With recomputation the chosen parts run their forward again in the backward pass (counted
    by forward hooks: the option reaches Megatron), and the step is bit for bit the step without."""
    options, part = RECOMPUTE[name]
    batch = batch_near(TorchTrainer(megatron_model), 6, seed=21)
    runs = {}
    for label, extra in (("plain", {}), ("recompute", options)):
        trainer = MegatronTrainer(megatron_model, **HYPER, **extra)
        calls = {i: 0 for i in range(2)}
        for i, layer in enumerate(trainer.model.module.decoder.layers):
            module = {"layer": layer, "core_attention": layer.self_attention.core_attention, "mlp": layer.mlp}[part]
            module.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
        stats = trainer.train_step(batch)  # one pass: each layer runs forward once (twice if recomputed)
        runs[label] = (calls, stats, dict(trainer.export_weights()))
    assert runs["plain"][0] == {0: 1, 1: 1}
    expected = {0: 2, 1: 1} if name == "full-block" else {0: 2, 1: 2}  # block: only the first layer
    assert runs["recompute"][0] == expected
    assert runs["recompute"][1] == runs["plain"][1]
    assert max_diff(runs["recompute"][2], runs["plain"][2]) == 0.0


def test_run_config_recomputation_reaches_megatron(megatron_model):
    from engines.backends.build import make_trainer
    from engines.config import RunConfig

    cfg = RunConfig(train={"backend": "megatron", "recompute_granularity": "full", "recompute_method": "block",
                           "recompute_num_layers": 2})
    trainer = make_trainer(cfg, megatron_model)
    assert (trainer.config.recompute_granularity, trainer.config.recompute_method, trainer.config.recompute_num_layers) == ("full", "block", 2)
    cfg = RunConfig(train={"backend": "megatron", "recompute_granularity": "selective", "recompute_modules": ["mlp"]})
    trainer = make_trainer(cfg, megatron_model)
    assert trainer.config.recompute_granularity == "selective" and trainer.config.recompute_modules == ["mlp"]
    assert make_trainer(RunConfig(train={"backend": "megatron"}), megatron_model).config.recompute_granularity is None


# --- 5. placement: the trainer's offload ---------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sleep_releases_every_storage_and_wake_restores_it_bit_for_bit(megatron_model, dtype):
    """Full colocation: the trainer sleeps while rollout and GenRM hold the devices. On the CPU as
    on a GPU every storage the trainer holds (weights, gradient buffer, Adam moments, fp32 main
    copies, the reference model) is released and its bytes kept in host memory; training after
    ``wake`` is bit for bit the training of a trainer that never slept."""
    from engines.backends.megatron.offload import trainer_tensors

    options = {**HYPER, "distributed_optimizer": True, "reference": True, "dtype": dtype}
    a, b = MegatronTrainer(megatron_model, **options), MegatronTrainer(megatron_model, **options)
    steps = [batch_near(a, 6, seed=s) for s in (11, 12, 13)]
    n = sum(p.numel() for p in a.model.parameters())
    for batch in steps:
        a.train_step(batch, GRPOConfig(kl_coef=0.5))
        b.train_step(batch, GRPOConfig(kl_coef=0.5))
        moved = a.sleep()
        # fp32: weights, gradient buffer, two Adam moments, the reference model (20 bytes per parameter);
        # bf16: weights and reference (2 + 2), fp32 gradient buffer, main copy and moments (4 + 4 + 8)
        assert moved >= 20 * n, (moved, n)
        assert a.asleep and {t.untyped_storage().nbytes() for t in trainer_tensors(a.model, a.reference, a.optimizer)} == {0}
        assert a.sleep() == 0  # already asleep
        assert a.wake() == moved and not a.asleep
    assert max_diff(dict(a.export_weights()), dict(b.export_weights())) == 0.0
    probe = random_batch(4, seed=14)
    assert a.logprobs(probe) == b.logprobs(probe)


def test_a_sleeping_trainer_exports_from_host_memory_and_refuses_the_rest(tmp_path, megatron_model):
    """``export_weights`` and ``save_hf`` of a sleeping trainer read the host copy (bit for bit the
    awake weights; nothing is woken); what needs the live state fails with a message rather than
    reading released memory (on an H100, ``export_policy`` after evaluation crashed inside CUDA)."""
    from engines.backends.megatron.offload import trainer_tensors

    trainer = MegatronTrainer(megatron_model, **HYPER, dtype="bfloat16")
    trainer.train_step(batch_near(trainer, 6, seed=15))
    awake = dict(trainer.export_weights())
    trainer.sleep()
    asleep = dict(trainer.export_weights())
    assert awake.keys() == asleep.keys() and all(torch.equal(awake[k], asleep[k]) for k in awake)
    assert {t.untyped_storage().nbytes() for t in trainer_tensors(trainer.model)} == {0}  # still asleep
    trainer.save_hf(str(tmp_path / "hf"))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.bfloat16)
    assert all(torch.equal(p, awake[k]) for k, p in loaded.named_parameters())
    for call in (lambda: trainer.logprobs(random_batch(2, seed=1)), lambda: trainer.train_step(random_batch(2, seed=1)),
                 lambda: trainer.save_checkpoint(str(tmp_path / "ckpt"))):
        with pytest.raises(RuntimeError, match="asleep"):
            call()
    trainer.wake()
    assert all(torch.equal(awake[k], v) for k, v in trainer.export_weights())


def test_host_stages_read_a_sleeping_trainer_or_wake_it(tmp_path, megatron_model):
    """The host's stages after evaluation put the trainer to sleep (``take("policy")``):
    the params fingerprint and ``export_policy`` read its host copy and leave it asleep;
    ``sync_weights`` and ``checkpoint`` wake it. Each gives what it gives for an awake trainer."""
    from safetensors.torch import load_file

    from engines.host.checkpointing import Checkpoints
    from engines.wire.commands import Checkpoint, ExportPolicy, SyncWeights
    from engines.config import RunConfig
    from engines.host.worker import Worker

    def host() -> Worker:
        config = RunConfig.model_validate({"dp": 1, "train": {"backend": "megatron"}, "checkpoint": {"asynchronous": False}})
        return Worker(rank=0, world=1, threads=1, config=config, trainer=MegatronTrainer(megatron_model, **HYPER),
                      policy=TorchGenerator(megatron_model), checkpoints=Checkpoints(0, "megatron", [["part-00000.parquet", 8]]))

    h = host()
    h.trainer.train_step(batch_near(h.trainer, 6, seed=16))
    weights, sha = dict(h.trainer.export_weights()), h.params_sha()

    h.devices.take("policy")  # evaluation
    assert h.trainer.asleep
    assert h.params_sha() == sha and h.trainer.asleep
    h.export_policy(ExportPolicy(uri=f"file://{tmp_path / 'export'}"))
    exported = load_file(str(tmp_path / "export" / "model.safetensors"))
    assert exported.keys() == weights.keys() and all(torch.equal(exported[k], weights[k]) for k in weights)
    assert h.trainer.asleep

    assert h.sync_weights(SyncWeights()).tensors == len(weights)
    assert not h.trainer.asleep
    assert all(torch.equal(p.detach(), weights[k]) for k, p in h.policy.model.named_parameters())

    h.devices.take("policy")
    assert h.trainer.asleep
    assert h.checkpoint(Checkpoint(uri=f"file://{tmp_path / 'ckpt'}")).files
    assert not h.trainer.asleep
    resumed = host()
    resumed.trainer.load_checkpoint(str(tmp_path / "ckpt" / "trainer-megatron"))
    assert resumed.params_sha() == sha


# --- 6. checkpoints ---------------------------------------------------------------------------


CHECKPOINTED = [("float32", False), ("float32", True), ("bfloat16", True)]


@pytest.mark.parametrize("dtype, distributed_optimizer", CHECKPOINTED, ids=["fp32", "fp32-distopt", "bf16-distopt"])
def test_checkpoint_resume_is_exact_sync_and_async(tmp_path, megatron_model, dtype, distributed_optimizer):
    options = {**HYPER, "dtype": dtype, "distributed_optimizer": distributed_optimizer}
    a = MegatronTrainer(megatron_model, **options)
    first, second, probe = batch_near(a, 6, seed=7), batch_near(a, 6, seed=8), random_batch(4, seed=9)
    a.train_step(first)
    files = a.save_checkpoint(str(tmp_path / "sync"))
    assert {"metadata.json", "common.pt", ".metadata"} <= set(files)
    assert sorted(files) == sorted(p.name for p in (tmp_path / "sync").iterdir())
    assert a.save_checkpoint(str(tmp_path / "async"), async_save=True) is None
    async_files = a.finalize_checkpoint()
    assert set(async_files) == set(files)
    assert a.finalize_checkpoint() == []
    with pytest.raises(FileExistsError):
        a.save_checkpoint(str(tmp_path / "sync"))
    a_probe = a.logprobs(probe)
    a.train_step(second)
    a_after = dict(a.export_weights())

    for folder in ("sync", "async"):
        b = MegatronTrainer(megatron_model, **options)
        b.load_checkpoint(str(tmp_path / folder))
        assert b.version == 1
        assert b.logprobs(probe) == a_probe  # bit for bit
        b.train_step(second)  # Adam moments and step count came back too
        assert max_diff(dict(b.export_weights()), a_after) == 0.0, folder


# --- 7. processes the product starts: the shim through sitecustomize --------------------------


def test_engine_in_a_subprocess_via_sitecustomize(megatron_model):
    code = """
import json, sys
assert "torch" not in sys.modules and "megatron" not in sys.modules, "the shim was not lazy"
assert "megatron_cpu" in sys.modules, "sitecustomize did not run"
import torch
torch.set_num_threads(1)
from engines.backends.megatron.trainer import MegatronTrainer
from engines.backends.base import TrainBatch
trainer = MegatronTrainer(sys.argv[1], lr=1e-3)
batch = TrainBatch([[1, 5, 6], [1, 7]], [[8, 9, 2], [2]], [[-3.0, -3.0, -3.0], [-3.0]], [1.0, -1.0])
print(json.dumps({"stats": trainer.train_step(batch), "version": trainer.version}))
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS / "megatron_cpu_site"), str(TESTS.parent)]))
    done = subprocess.run(
        [sys.executable, "-c", code, megatron_model], env=env, capture_output=True, text=True, timeout=120, cwd=TESTS.parent
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["version"] == 1 and result["stats"]["tokens"] == 4.0 and result["stats"]["grad_norm"] > 0


# --- 2./4./5. two processes over gloo: TP=2, then DP=2 ---------------------------------------


def _worker(rank: int, port: int, megatron_model: str, cases_file: str, out: str) -> None:
    from datetime import timedelta

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=120))
    try:
        cases = torch.load(cases_file, weights_only=False)
        results = {}

        # TP=2: one replica over both processes. PP=2: one replica's layers over both processes,
        # Megatron's 1F1B schedule over several token-cut micro-batches, the reference pipelined
        # too; the stats come from the last stage
        for name, layout in (("tp", {"tensor_parallel": 2}), ("pp", {"pipeline_parallel": 2})):
            case = cases[name]
            trainer = MegatronTrainer(megatron_model, **HYPER, **layout, **case.get("trainer", {}))
            results[name] = {
                "logprobs": trainer.logprobs(case["batch"]),
                "initial": dict(trainer.export_weights()),
                "stats": trainer.train_step(case["batch"], **case["kwargs"]),
                "after": dict(trainer.export_weights()),
            }
            del trainer
            parallel_state.destroy_model_parallel()

        # the distributed optimizer saved fully reshardable by TP=2 ranks, resumed by two pipeline stages
        first, second = cases["reshard"]
        trainer = MegatronTrainer(megatron_model, **HYPER, tensor_parallel=2, distributed_optimizer=True, reshardable_optimizer=True)
        trainer.train_step(first, minibatches=MINIBATCHES)
        trainer.save_checkpoint(os.path.join(out, "reshard-checkpoint"))
        trainer.save_hf(os.path.join(out, "reshard-hf"))  # the weights after the first step (TP rank 0 writes)
        trainer.train_step(second, minibatches=MINIBATCHES)
        results["reshard-tp2"] = dict(trainer.export_weights())
        del trainer
        parallel_state.destroy_model_parallel()
        resumed = MegatronTrainer(megatron_model, **HYPER, pipeline_parallel=2, distributed_optimizer=True, reshardable_optimizer=True)
        resumed.load_checkpoint(os.path.join(out, "reshard-checkpoint"))
        resumed.train_step(second, minibatches=MINIBATCHES)
        results["reshard-pp2"] = dict(resumed.export_weights())
        del resumed
        parallel_state.destroy_model_parallel()

        # DP=2: each rank steps on its own shard
        for name, case in cases["dp"].items():
            trainer = MegatronTrainer(megatron_model, **HYPER, **case["trainer"])
            stats = [trainer.train_step(step[rank], **case["kwargs"]) for step in case["steps"]]
            results[name] = {"stats": stats, "weights": dict(trainer.export_weights())}

        # DP=2 checkpoint: each rank writes its own folder; both load the union
        ckpt = cases["checkpoint"]
        for distributed_optimizer in (False, True):
            trainer = MegatronTrainer(megatron_model, **HYPER, distributed_optimizer=distributed_optimizer)
            trainer.train_step(ckpt["first"][rank])
            name = f"ckpt-distopt{int(distributed_optimizer)}"
            own = Path(out) / f"{name}-rank{rank}"
            files = trainer.save_checkpoint(str(own))
            dist.barrier()
            merged = Path(out) / f"{name}-merged"
            if rank == 0:
                for r in range(2):
                    shutil.copytree(Path(out) / f"{name}-rank{r}", merged, dirs_exist_ok=True)
            dist.barrier()
            resumed = MegatronTrainer(megatron_model, **HYPER, distributed_optimizer=distributed_optimizer)
            resumed.load_checkpoint(str(merged))
            results[name] = {
                "files": files,
                "sizes": {f: (own / f).stat().st_size for f in files},
                "logprobs": (trainer.logprobs(ckpt["probe"]), resumed.logprobs(ckpt["probe"])),
                "stats": (trainer.train_step(ckpt["second"][rank]), resumed.train_step(ckpt["second"][rank])),
                "weights": (dict(trainer.export_weights()), dict(resumed.export_weights())),
            }
        torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_processes(megatron_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("megatron-2p")
    probe = TorchTrainer(megatron_model)
    steps_of = lambda sizes, seed: [batch_near(probe, n, seed + rank) for rank, n in enumerate(sizes)]  # noqa: E731
    cases = {
        "tp": {"batch": batch_near(probe, 8, seed=11), "kwargs": {"minibatches": MINIBATCHES}},
        "pp": {"batch": batch_near(probe, 8, seed=12), "trainer": {"reference": True},
               "kwargs": {"minibatches": MINIBATCHES, "micro_batch_tokens": 16, **DP_CASES["token-kl-3-5"][1]}},
        "dp": {
            name: {
                "steps": [steps_of(sizes, 100 * i), steps_of(sizes, 100 * i + 50)],
                "kwargs": {"minibatches": MINIBATCHES, **step_kwargs},
                "trainer": trainer_kwargs,
            }
            for i, (name, (sizes, step_kwargs, trainer_kwargs)) in enumerate(DP_CASES.items())
        },
        "checkpoint": {"first": steps_of((3, 4), 900), "second": steps_of((4, 3), 950), "probe": random_batch(4, seed=999)},
        "reshard": (batch_near(probe, 6, seed=71), batch_near(probe, 6, seed=72)),
    }
    torch.save(cases, tmp / "cases.pt")
    mp.spawn(_worker, args=(free_port(), megatron_model, str(tmp / "cases.pt"), str(tmp)), nprocs=2, join=True)
    results = [torch.load(tmp / f"rank{rank}.pt", weights_only=False) for rank in range(2)]
    return {"cases": cases, "results": results, "tmp": tmp}


def single_process_steps(megatron_model: str, case: dict, **trainer_kwargs) -> tuple[dict, list[dict]]:
    """One process (world of one) stepping on the concatenated batches."""
    trainer = MegatronTrainer(megatron_model, **HYPER, **trainer_kwargs)
    mb = case["kwargs"]["minibatches"]
    stats = [trainer.train_step(global_order(step, mb), **case["kwargs"]) for step in case["steps"]]
    return dict(trainer.export_weights()), stats


def test_tp2_matches_tp1(megatron_model, two_processes):
    tp = two_processes["cases"]["tp"]
    single = MegatronTrainer(megatron_model, **HYPER)
    single_lp = single.logprobs(tp["batch"])
    initial = load_hf_state(megatron_model)
    for rank in range(2):
        result = two_processes["results"][rank]["tp"]
        assert parity("megatron: tp=2 vs tp=1, log-probs", lp_diff(result["logprobs"], single_lp)) <= ATOL
        # gathering the TP shards gives back the HF weights exactly
        assert all(torch.equal(result["initial"][k], initial[k]) for k in initial)
    single_stats = single.train_step(tp["batch"], **tp["kwargs"])
    single_after = dict(single.export_weights())
    assert parity("megatron: tp=2 vs tp=1, step", step_gap(two_processes["results"][0]["tp"]["after"], single_after, initial)) <= STEP_RTOL
    assert max_diff(two_processes["results"][0]["tp"]["after"], two_processes["results"][1]["tp"]["after"]) == 0.0
    # the grad norm counts each TP shard once (norm and vocab shards included)
    assert two_processes["results"][0]["tp"]["stats"]["grad_norm"] == pytest.approx(single_stats["grad_norm"], rel=1e-5)


def test_pp2_matches_pp1(megatron_model, two_processes):
    """Two pipeline stages, one layer each, train what one process trains: log-probs, the exported
    weights before and after a step of several micro-batches per minibatch (1F1B) with a KL to the
    pipelined reference, and the step's statistics on both stages."""
    pp = two_processes["cases"]["pp"]
    single = MegatronTrainer(megatron_model, **HYPER, **pp["trainer"])
    single_lp = single.logprobs(pp["batch"])
    initial = load_hf_state(megatron_model)
    rank0, rank1 = (r["pp"] for r in two_processes["results"])
    for result in (rank0, rank1):
        assert parity("megatron: pp=2 vs pp=1, log-probs", lp_diff(result["logprobs"], single_lp)) <= ATOL
        assert result["initial"].keys() == initial.keys() and all(torch.equal(result["initial"][k], initial[k]) for k in initial)
    single_stats = single.train_step(pp["batch"], **pp["kwargs"])
    assert parity("megatron: pp=2 vs pp=1, step", step_gap(rank0["after"], dict(single.export_weights()), initial)) <= STEP_RTOL
    assert max_diff(rank0["after"], rank1["after"]) == 0.0
    assert rank0["stats"] == rank1["stats"]  # the last stage's, on the first stage too
    for name in ("loss", "grad_norm", "kl_reference", "tokens"):
        assert rank0["stats"][name] == pytest.approx(single_stats[name], rel=1e-5, abs=1e-7), name


def test_the_distributed_optimizer_resumes_under_another_tp_and_pp_when_saved_reshardable(megatron_model, two_processes):
    """train.reshardable_optimizer: a checkpoint of TP=2 ranks with the distributed optimizer
    (Megatron's fully_reshardable format) resumes in two pipeline stages and in one process, whose
    next step is the TP=2 ranks' own; a control that lost the Adam state is far from it."""
    tmp, results = two_processes["tmp"], two_processes["results"][0]
    before, second = load_hf_state(str(tmp / "reshard-hf")), two_processes["cases"]["reshard"][1]
    one = MegatronTrainer(megatron_model, **HYPER, distributed_optimizer=True, reshardable_optimizer=True)
    one.load_checkpoint(str(tmp / "reshard-checkpoint"))
    one.train_step(second, minibatches=MINIBATCHES)
    resumed = {"pp2": results["reshard-pp2"], "tp1": dict(one.export_weights())}
    for name, weights in resumed.items():
        assert parity(f"megatron distopt: tp=2 checkpoint resumed at {name}, next step",
                      step_gap(weights, results["reshard-tp2"], before)) <= STEP_RTOL, name
    fresh = MegatronTrainer(str(tmp / "reshard-hf"), **HYPER, distributed_optimizer=True)  # the weights, no Adam state
    fresh.train_step(second, minibatches=MINIBATCHES)
    assert step_gap(dict(fresh.export_weights()), results["reshard-tp2"], before) > 50 * STEP_RTOL


@pytest.mark.parametrize("name", list(DP_CASES))
def test_dp2_replicas_identical_and_equal_single_process(megatron_model, two_processes, name):
    case = two_processes["cases"]["dp"][name]
    rank0, rank1 = (r[name] for r in two_processes["results"])
    assert max_diff(rank0["weights"], rank1["weights"]) == 0.0

    ref_weights, ref_stats = single_process_steps(megatron_model, case, **DP_CASES[name][2])
    assert parity("megatron: dp=2 vs one process, 2 steps", step_gap(rank0["weights"], ref_weights, load_hf_state(megatron_model))) <= STEP_RTOL
    for step in range(2):
        assert rank0["stats"][step]["loss"] == pytest.approx(ref_stats[step]["loss"], abs=1e-5)
        assert rank0["stats"][step]["grad_norm"] == pytest.approx(ref_stats[step]["grad_norm"], rel=1e-5)
        tokens = [sum(len(r) for r in b.response_ids) for b in case["steps"][step]]
        assert [rank0["stats"][step]["tokens"], rank1["stats"][step]["tokens"]] == tokens


@pytest.mark.parametrize("name", [n for n in DP_CASES if "micro" in n])
def test_dp2_micro_batches_equal_one_process_one_pass(megatron_model, two_processes, name):
    """Two ranks stepping in several passes each equal one process stepping in one pass."""
    case = two_processes["cases"]["dp"][name]
    one_pass = dict(case, kwargs={k: v for k, v in case["kwargs"].items() if k != "micro_batch_tokens"})
    ref_weights, ref_stats = single_process_steps(megatron_model, one_pass, **DP_CASES[name][2])
    rank0 = two_processes["results"][0][name]
    assert parity("megatron: dp=2 micro-batches vs one process one pass, 2 steps",
                  step_gap(rank0["weights"], ref_weights, load_hf_state(megatron_model))) <= STEP_RTOL
    for step in range(2):
        assert rank0["stats"][step]["loss"] == pytest.approx(ref_stats[step]["loss"], abs=1e-5)
        assert rank0["stats"][step]["grad_norm"] == pytest.approx(ref_stats[step]["grad_norm"], rel=1e-5)


def test_dp2_tolerance_would_catch_a_missing_all_reduce(megatron_model, two_processes):
    """A rank stepping on its shard alone (what a missed all-reduce amounts to) lands far
    outside the tolerance the DP run meets."""
    case = two_processes["cases"]["dp"]["token-3-5"]
    solo = MegatronTrainer(megatron_model, **HYPER)
    for step in case["steps"]:
        solo.train_step(step[1], **case["kwargs"])
    ref_weights, _ = single_process_steps(megatron_model, case)
    gap = step_gap(dict(solo.export_weights()), ref_weights, load_hf_state(megatron_model))
    assert parity("control: megatron, a rank without the all-reduce", gap) > 50 * STEP_RTOL


@pytest.mark.parametrize("name", ["ckpt-distopt0", "ckpt-distopt1"])
def test_dp2_checkpoint_union_of_rank_folders_resumes(two_processes, name):
    rank0, rank1 = (r[name] for r in two_processes["results"])
    assert {"metadata.json", "common.pt", ".metadata"} <= set(rank0["files"])
    # each rank wrote shards of its own (replicated tensors are split between the DP ranks)
    assert rank1["files"] and not set(rank1["files"]) & {"metadata.json", "common.pt", ".metadata"}
    assert sum(rank1["sizes"].values()) > 10_000
    for result in (rank0, rank1):
        original, resumed = result["logprobs"]
        assert original == resumed
        assert result["stats"][0] == result["stats"][1]
        assert max_diff(*result["weights"]) == 0.0
    assert max_diff(rank0["weights"][1], rank1["weights"][1]) == 0.0


def _tp_pp_dp_worker(rank: int, port: int, megatron_model: str, out: str) -> None:
    """One of eight ranks: two DP replicas, each over TP=2 x PP=2 (Megatron's order: rank = tp +
    2 pp + 4 dp), the distributed optimizer; each replica steps on its own batches."""
    from datetime import timedelta

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=8, timeout=timedelta(seconds=300))
    try:
        case = torch.load(os.path.join(out, "case.pt"), weights_only=False)
        trainer = MegatronTrainer(megatron_model, **HYPER, tensor_parallel=2, pipeline_parallel=2, distributed_optimizer=True)
        stats = [trainer.train_step(step[rank // 4], **case["kwargs"]) for step in case["steps"]]
        weights = dict(trainer.export_weights())
        if rank % 4 == 0:  # each replica's first rank
            torch.save({"stats": stats, "weights": weights}, os.path.join(out, f"dp{rank // 4}.pt"))
        # the replica check (tests/test_replica_check.py), a bit flipped on dp-1.3 (TP rank 1 of stage 1)
        checked = replica_checks(trainer, Layout(dp=2, tp=2, pp=2), rank, flip=7)
        torch.save(checked, os.path.join(out, f"replicas{rank}.pt"))
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.mark.integration  # eight ranks in subprocesses: the check tier keeps the two-rank layouts
def test_tp2_pp2_dp2_equals_one_process(megatron_model, tmp_path):
    """Eight ranks, TP=2 x PP=2 x DP=2 with the distributed optimizer and token-cut micro-batches
    on the 1F1B schedule, train two steps as one process does on both replicas' batches."""
    probe = TorchTrainer(megatron_model)
    case = {"steps": [[batch_near(probe, n, seed + dp) for dp, n in enumerate((3, 5))] for seed in (300, 350)],
            "kwargs": {"minibatches": MINIBATCHES, "micro_batch_tokens": 16}}
    torch.save(case, tmp_path / "case.pt")
    mp.spawn(_tp_pp_dp_worker, args=(free_port(), megatron_model, str(tmp_path)), nprocs=8, join=True)
    dp0, dp1 = (torch.load(tmp_path / f"dp{d}.pt", weights_only=False) for d in range(2))
    assert max_diff(dp0["weights"], dp1["weights"]) == 0.0  # the replicas stay equal
    # and the replica check says so, each rank digesting its own TP x PP shard (a quarter of the model or
    # so, none of it gathered); a flipped bit on dp-1.3 fails it on every rank, naming the ranks and the tensor
    checks = [torch.load(tmp_path / f"replicas{r}.pt", weights_only=False) for r in range(8)]
    assert len({c["sha"] for c in checks[:4]} | {c["again"] for c in checks[:4]}) == 1 == len({c["sha"] for c in checks[4:]})
    assert checks[0]["sha"] == checks[4]["sha"]
    assert all(c["held"] < 0.4 * sum(t.numel() for t in dp0["weights"].values()) for c in checks)
    flipped = checks[7]["flipped"][0]
    assert flipped.startswith("decoder.layers.1.") or flipped.startswith("output_layer")  # stage 1's, by its global name
    assert {c["flipped"][1] for c in checks} == {
        f"replica check after the train step: dp-0.3 (rank 3) and dp-1.3 (rank 7) hold different bits in {flipped!r}"}
    weights, stats = single_process_steps(megatron_model, case, distributed_optimizer=True)
    assert parity("megatron: tp=2 x pp=2 x dp=2 vs one process, 2 steps",
                  step_gap(dp0["weights"], weights, load_hf_state(megatron_model))) <= STEP_RTOL
    for step in range(2):
        assert dp0["stats"][step]["loss"] == pytest.approx(stats[step]["loss"], abs=1e-5)
        assert dp0["stats"][step]["grad_norm"] == pytest.approx(stats[step]["grad_norm"], rel=1e-5)
