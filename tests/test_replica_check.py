"""The device-side digest behind every fingerprint (``engines/backends/digest.py``), the weight sync's
check built on it, and the replica check's verdicts (``engines/host/replica_check.py``).

The replica check across real gloo processes runs inside the existing multi-process tests: torch
DP=2 (tests/test_distributed.py), FSDP2 and LoRA (tests/test_fsdp.py), Megatron TP=2 x PP=2 x DP=2
with the distributed optimizer (tests/test_megatron.py).
"""

from __future__ import annotations

import numpy as np
import pytest


import torch  # noqa: E402

from engines.backends import digest  # noqa: E402
from engines.backends.base import WeightSyncError, fingerprint, load_weights  # noqa: E402
from engines.config.layout import Layout  # noqa: E402
from engines.host import replica_check  # noqa: E402


def replica_checks(trainer, layout: Layout, rank: int, flip: int) -> dict:
    """For the multi-process tests, after a step: the replica check of the trainers as they are
    (``sha``), then with one bit flipped in one element of one tensor that rank ``flip`` holds
    (``flipped``: that tensor's name, and what the check raised on this rank), put back after
    (``again``); and how many elements this rank holds (``held``: its shard, not the model)."""
    from engines.host.replica_check import ReplicasDiffer, check

    out = {"sha": check(trainer.local_parameters(), layout, rank), "flipped": None,
           "held": sum(t.numel() for _, t in trainer.local_parameters())}
    name, tensor = next((n, t) for n, t in trainer.local_parameters() if t.numel() >= 2 and t.element_size() == 4)
    words = tensor.reshape(-1).view(torch.int32)
    assert words.data_ptr() == tensor.data_ptr()  # the trainer's own memory, not a copy
    with torch.no_grad():
        if rank == flip:
            words[words.numel() // 2] ^= 1 << 20
        try:
            check(trainer.local_parameters(), layout, rank)
        except ReplicasDiffer as e:
            out["flipped"] = (name if rank == flip else None, str(e))
        if rank == flip:
            words[words.numel() // 2] ^= 1 << 20
    out["again"] = check(trainer.local_parameters(), layout, rank)
    return out


def reference(t: torch.Tensor, block: int) -> int:
    """The digest in plain integers (numpy uint32 words, Python ints mod 2^64)."""
    raw = t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.dtype != torch.bool else \
        t.to(torch.uint8).numpy().tobytes()
    whole = len(raw) // 4 * 4
    words = np.frombuffer(raw[:whole], dtype=np.uint32).astype(np.uint64)
    blocks = [words[k:k + block] for k in range(0, len(words), block)]
    sums = [int(b.sum(dtype=np.uint64)) % 2**32 for b in blocks]
    sums = [s - 2**32 if s >= 2**31 else s for s in sums]  # int32, sign-extended to int64
    if whole < len(raw):  # 1-3 bytes past the last word, packed into one more block (after the tail's slot)
        sums += [0] * (len(words) // block + 1 - len(sums)) + [int.from_bytes(raw[whole:], "little")]
    return sum(s * (2 * b + 1) for b, s in enumerate(sums)) % 2**64


def content(t: torch.Tensor) -> int:
    return int(digest.tensor_digest(t)) % 2**64


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool, torch.float64]


def tensor_of(dtype: torch.dtype, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(n, generator=g) > 0.5
    if dtype in (torch.uint8, torch.int64):
        return torch.randint(0, 255 if dtype == torch.uint8 else 2**62, (n,), generator=g, dtype=dtype)
    return (torch.randn(n, generator=g) * 1e3).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_digest_is_the_integer_reduction_numpy_computes(dtype):
    for n in (0, 1, 3, 5, 4096 // 2 - 1, 3 * 4096 + 7):  # empty, under a word, a tail, several blocks
        t = tensor_of(dtype, n, seed=n)
        assert content(t) == reference(t, digest.BLOCK), (dtype, n)
    # words near the int32 limits: the block sums wrap mod 2^32, the weighted sum mod 2^64
    extreme = torch.tensor([2**31 - 1, -(2**31)] * (3 * 4096), dtype=torch.int32)
    assert content(extreme) == reference(extreme, digest.BLOCK)
    assert content(extreme[1:]) == reference(extreme[1:], digest.BLOCK)  # a view at an offset
    odd = torch.arange(21, dtype=torch.bfloat16)[1:]  # 2-byte offset: its int32 words read from a copy
    assert content(odd) == reference(odd, digest.BLOCK)
    assert content(torch.ones(6, 6).t()) == reference(torch.ones(6, 6).t(), digest.BLOCK)  # not contiguous


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_single_bit_flip_changes_the_digest(dtype, monkeypatch):
    """Exhaustive over the bits of small tensors of every kind, with blocks of 3 words so that the
    tensors span several blocks, a short tail block and (2-byte and 1-byte elements) loose bytes."""
    monkeypatch.setattr(digest, "BLOCK", 3)
    for n in (1, 7, 13):
        t = tensor_of(dtype, n, seed=n)
        raw = t.view(torch.uint8) if dtype == torch.bool else t.view(-1).view(torch.uint8)
        base = content(t)
        for byte in range(raw.numel()):
            for bit in range(8):
                flipped = raw.clone()
                flipped[byte] ^= 1 << bit
                d = content(flipped.view(torch.bool) if dtype == torch.bool else flipped.view(dtype))
                assert d != base, (dtype, n, byte, bit)


def test_flips_in_any_block_of_a_large_tensor_and_a_moved_block_are_seen():
    t = torch.randn(5 * digest.BLOCK + 17)
    base = content(t)
    words = t.view(torch.int32)
    for index in (0, digest.BLOCK - 1, digest.BLOCK, 3 * digest.BLOCK + 5, words.numel() - 1):
        for bit in (0, 13, 31):
            flipped = words.clone()
            flipped[index] ^= torch.tensor(1 << bit if bit < 31 else -(2**31), dtype=torch.int32)
            assert content(flipped.view(torch.float32)) != base, (index, bit)
    swapped = t.clone().view(5 * digest.BLOCK + 17)
    swapped[: digest.BLOCK], swapped[digest.BLOCK: 2 * digest.BLOCK] = t[digest.BLOCK: 2 * digest.BLOCK], t[: digest.BLOCK]
    assert content(swapped) != base  # two blocks exchanged


def test_the_fingerprint_keeps_its_contract():
    """Equal bits under the same names, dtypes and shapes, in any order: equal; anything else differs."""
    a, b = torch.randn(4, 8), torch.randn(16).bfloat16()
    fp = fingerprint([("a", a), ("b", b)])
    assert fp == fingerprint([("b", b.clone()), ("a", a.clone())])
    assert fp != fingerprint([("a", a), ("c", b)])  # a name
    assert fp != fingerprint([("a", a.reshape(8, 4)), ("b", b)])  # a shape
    assert fp != fingerprint([("a", a), ("b", b.view(torch.float16))])  # a dtype, the same bits
    assert fp != fingerprint([("a", a), ("b", b), ("c", torch.zeros(0))])  # one more, even empty


def test_the_old_sha256_fingerprint_is_kept_for_the_benchmarks(monkeypatch):
    bucket = [("a", torch.randn(5)), ("b", torch.arange(3))]
    assert digest.bucket_fingerprint(bucket, "sha256") == digest.sha256_fingerprint(bucket)
    assert digest.bucket_fingerprint(bucket, "device") == fingerprint(bucket)
    monkeypatch.setenv(digest.SYNC_CHECK, "sha-1")
    with pytest.raises(ValueError, match=r"YATTFLOW_SYNC_CHECK='sha-1': one of device, sha256, off"):
        digest.sync_check()


class Faulty:
    """A rollout engine whose load goes wrong in bucket ``bad``: a bit flipped in transit
    (``corrupt``), or the bucket's tensors replaced by what the engine held (``stale``)."""

    def __init__(self, engine, bad: int, how: str):
        self.engine, self.bad, self.how = engine, bad, how

    def update_weights(self, buckets):
        held = dict(self.engine.model.named_parameters())

        def delivered():
            for k, bucket in enumerate(buckets):
                if k == self.bad and self.how == "corrupt":
                    name, t = bucket[-1]
                    t = t.clone()
                    t.view(-1).view(torch.int32)[t.numel() // 2] ^= 1 << 7
                    bucket = [*bucket[:-1], (name, t)]
                elif k == self.bad:
                    bucket = [(name, held[name].detach().clone()) for name, _ in bucket]
                yield bucket

        return self.engine.update_weights(delivered())


@pytest.mark.parametrize("check", ["device", "sha256"])
def test_a_stale_or_corrupted_bucket_is_refused_naming_it(tmp_path, monkeypatch, check):
    from engines.backends.torch.generator import TorchGenerator
    from engines.backends.torch.trainer import TorchTrainer
    from tests.helpers import save_tiny_model

    monkeypatch.setenv(digest.SYNC_CHECK, check)
    folder = save_tiny_model(tmp_path / "policy", num_layers=2)
    trainer, engine = TorchTrainer(folder), TorchGenerator(folder)
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    for how in ("corrupt", "stale"):
        with pytest.raises(WeightSyncError, match=r"^weight sync: bucket 2 \(\d+ tensors, model\.\S+ \.\. model\.\S+\) differs "
                                                  r"between the trainer and the rollout engine \(fingerprint \w+ against \w+\)$"):
            load_weights(Faulty(engine, 2, how), trainer.export_weights(), bucket_bytes=8192)
    assert load_weights(engine, trainer.export_weights(), bucket_bytes=8192) > 0  # the same sync, delivered whole
    monkeypatch.setenv(digest.SYNC_CHECK, "off")  # what the benchmark's unchecked sync is: nothing seen
    load_weights(Faulty(engine, 2, "corrupt"), trainer.export_weights(), bucket_bytes=8192)


def test_the_majority_names_the_odd_replica_and_a_tie_names_them_all():
    layout = Layout(dp=3, tp=2)
    assert replica_check._odd_ones([1, 3, 5], [7, 7, 9]) == [5]
    assert replica_check._odd_ones([1, 3], [7, 9]) == [1, 3]
    assert replica_check._message(layout, [1, 3, 5], [5], "w", 2, 0, {4}) == (
        "replica check after the train step: dp-2.1 (rank 5) holds other bits than dp-0.1 (rank 1) and dp-1.1 (rank 3) "
        "in 'w' and 2 more tensors")
    assert replica_check._message(Layout(dp=2), [0, 1], [0, 1], "w", 0, 1, {4}) == (
        "replica check after the train step: dp-0 (rank 0) and dp-1 (rank 1) hold different bits in 'w'; "
        "replicas differ at 1 more place in the group")


def test_one_process_answers_its_own_fingerprint():
    named = [("a", torch.randn(3)), ("b", torch.ones(2, dtype=torch.bfloat16))]
    assert replica_check.check(iter(named), Layout(dp=1), 0) == fingerprint(named)
