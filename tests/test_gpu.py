"""Checks that need a CUDA device: the production engines on the device they target, without
the CPU shim. Skipped where there is no GPU (tests/conftest.py)."""

from __future__ import annotations

import pytest


@pytest.mark.gpu
def test_megatron_trains_in_bf16_on_cuda():
    pytest.importorskip("megatron.core", reason="Megatron-Core is optional (pip install -e .[megatron])")
    from bench.megatron_gpu import main

    result = main(["--layers", "2", "--hidden", "512", "--heads", "8", "--kv-heads", "4", "--seq", "256",
                   "--batch", "4", "--steps", "2", "--warmup", "1"])
    assert result["tokens_per_s"] > 0 and result["mfu"] > 0


@pytest.mark.gpu
def test_megatron_trainer_sleep_frees_the_device_and_wakes_bit_for_bit(tmp_path):
    """Full colocation on a GPU: a sleeping trainer holds (almost) no device memory — weights,
    gradient buffers, Adam moments and fp32 main copies are in host memory — and after ``wake``
    it trains exactly as a trainer that never slept."""
    pytest.importorskip("megatron.core", reason="Megatron-Core is optional (pip install -e .[megatron])")
    import time

    import torch

    from engines.megatron_engine import MegatronTrainer
    from tests.helpers import random_batch, save_tiny_model, with_old_logprobs

    model_dir = save_tiny_model(tmp_path / "model", hidden_size=512, num_layers=4)
    options = {"lr": 1e-3, "dtype": "bfloat16", "distributed_optimizer": True}
    a, b = MegatronTrainer(model_dir, **options), MegatronTrainer(model_dir, **options)
    n = sum(p.numel() for p in a.model.parameters())
    for seed in (1, 2):
        batch = random_batch(8, seed=seed)
        batch = with_old_logprobs(batch, b.logprobs(batch), noise=0.5, seed=seed)
        a.train_step(batch)
        b.train_step(batch)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        start = time.perf_counter()
        moved = a.sleep()
        slept = time.perf_counter() - start
        freed = before - torch.cuda.memory_allocated()
        # bf16 weights (2 bytes), fp32 gradient buffer (4), fp32 main copy (4), two fp32 moments (8)
        assert moved >= 18 * n and freed >= 18 * n, (moved, freed, n)
        start = time.perf_counter()
        assert a.wake() == moved
        print(f"\n[offload] {moved / 2**20:.1f} MiB: sleep {slept * 1e3:.1f} ms, wake {(time.perf_counter() - start) * 1e3:.1f} ms")
    probe = random_batch(4, seed=3)
    assert a.logprobs(probe) == b.logprobs(probe)
    weights_a, weights_b = dict(a.export_weights()), dict(b.export_weights())
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_b)
