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
