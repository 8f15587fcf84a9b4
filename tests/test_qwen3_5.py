"""Qwen3.5 (text): hybrid layers, Gated DeltaNet linear attention beside full attention, on the
torch engines; vLLM (CPU) and the Megatron trainer refuse it at validation, naming why.

A tiny random ``Qwen3_5ForCausalLM`` (``engines.demo.tiny_hub``: one linear-attention and one
full-attention layer, head size 32, weights std 0.1) through the code a downloaded folder goes
through. transformers runs the linear attention with its reference PyTorch kernels here (neither
flash-linear-attention nor causal-conv1d is installed): the chunked form over a whole sequence in
the trainer, the recurrent form token by token in ``generate()`` — two computations of one
model, which is what the parity below checks.
"""

from __future__ import annotations

import pyarrow as pa
import pytest
import torch

from engines.backends.base import TrainBatch, load_weights
from engines.backends.torch.generator import TorchGenerator
from engines.backends.torch.trainer import TorchTrainer
from engines.demo.tiny_hub import save_tiny_hub_model
from tests.helpers import parity

# prompts of different lengths: generate() left-pads them, the trainer right-pads
PROMPTS = ["What is 12 + 7?", "Solve for x: 3x + 5 = 20. Please reason step by step.", "2^10 = ?"]
# max |trainer - rollout| over the sampled tokens measured 7.2e-6 (2-core AMD EPYC, 2026-11-28)
TOL = 5e-5


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory) -> str:
    return str(save_tiny_hub_model("qwen3_5_text", tmp_path_factory.mktemp("tiny-qwen3_5"), hidden_size=128, num_layers=2,
                                   num_heads=4, num_kv_heads=2, init_std=0.1))


def test_qwen3_5_rolls_out_and_trains_on_the_torch_engines_with_parity(qwen3_5):
    generator = TorchGenerator(qwen3_5)
    assert {type(m).__name__ for m in generator.model.modules()} >= {"Qwen3_5GatedDeltaNet", "Qwen3_5Attention"}
    gens = generator.generate(PROMPTS, n=2, temperature=1.0, max_new_tokens=16, seed=0)
    batch = TrainBatch([g.prompt_ids for g in gens], [g.response_ids for g in gens], [g.logprobs for g in gens],
                       [(-1.0) ** i for i in range(len(gens))])
    trainer = TorchTrainer(qwen3_5, lr=1e-2)
    gap = max(abs(a - b) for r, o in zip(trainer.logprobs(batch), batch.old_logprobs) for a, b in zip(r, o))
    assert parity("qwen3.5 torch trainer vs torch rollout, log-probs", gap) <= TOL

    linear = "model.layers.0.linear_attn.in_proj_qkv.weight"
    before = dict(trainer.model.named_parameters())[linear].detach().clone()
    trainer.train_step(batch)
    assert not torch.equal(dict(trainer.model.named_parameters())[linear], before)  # the linear attention trains
    load_weights(generator, trainer.export_weights())  # every tensor, each bucket's fingerprint checked
    after = generator.generate(PROMPTS, n=2, temperature=1.0, max_new_tokens=16, seed=0)
    batch = TrainBatch([g.prompt_ids for g in after], [g.response_ids for g in after], [g.logprobs for g in after],
                       [0.0] * len(after))
    assert max(abs(a - b) for r, o in zip(trainer.logprobs(batch), batch.old_logprobs) for a, b in zip(r, o)) <= TOL


@pytest.mark.parametrize("backends, message", [
    (("vllm", "torch"), r"model\.policy: .*config\.json: model_type 'qwen3_5_text': vLLM's Qwen3\.5 module imports .*torchvision"),
    (("torch", "megatron"), r"model\.policy: .*config\.json: train\.backend=megatron cannot train it: model_type 'qwen3_5_text' .*Gated DeltaNet"),
])
def test_qwen3_5_is_refused_before_engines_load_where_it_cannot_run(qwen3_5, tmp_path, backends, message):
    from engines.config import load_config
    from engines.host import validation
    from storage import datasets

    if torch.cuda.is_available() and backends[0] == "vllm":
        pytest.skip("vLLM on a GPU loads Qwen3.5")
    prompts = str(tmp_path / "prompts.parquet")
    datasets.write_table(prompts, pa.Table.from_pylist([{"prompt_id": 1, "prompt": PROMPTS[0], "answer": "19"}]), datasets.PROMPTS)
    config = load_config(None, [f"storage.root={tmp_path}", f"model.policy={qwen3_5}", f"data.prompts={prompts}",
                                "data.heldout=null", "reward.genrm_weight=0", "reward.rule_weight=1",
                                f"rollout.backend={backends[0]}", f"train.backend={backends[1]}"])
    with pytest.raises(validation.InputError, match=message):
        validation.validate_inputs(config)
