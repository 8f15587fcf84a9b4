"""Fingerprints of tensors computed where the tensors are: an integer reduction on their own device,
never a copy to the host (DESIGN.md invariant 13: a check costs the shard, not the model).

A tensor's raw bytes are read as int32 words (a size that is no multiple of 4 bytes leaves at most
3 bytes, packed into one more word), cut into blocks of ``BLOCK`` words; each block is summed in
int32, wrapping mod 2^32, and the block sums are combined with odd weights 1, 3, 5, ... in int64,
wrapping mod 2^64::

    digest = sum_b (2 b + 1) * (sum of block b's words mod 2^32)   mod 2^64

Integer addition mod 2^n is exact and order-free, so the CPU and a GPU, any thread count and any
reduction order give the same bits. **Equal bits give equal digests; a single flipped bit always
changes the digest**: it changes one word by ±2^k (k < 32), so one block sum by some d with
0 < |d| < 2^32, and (2 b + 1) d is not 0 mod 2^64 (d has at most 31 factors of two, the weight
none). Several flips can cancel, and words permuted inside one block go unseen; blocks moved or
permuted are seen through their weights. It is a check against mistakes (a stale bucket, a
tensor under the wrong name, a replica that drifted, memory that flipped), not against an
adversary: that is SHA-256's job, and what the check cost before (``sha256_fingerprint``, kept as
the benchmarks' baseline).

Each tensor's digest is one 0-dim int64 tensor on its device (a few kernels, no synchronisation);
:class:`Digests` stacks a set of them and copies that one small vector to the host, where each is
hashed with its name, dtype and shape (a few bytes each).
"""

from __future__ import annotations

import hashlib
import os
from typing import TYPE_CHECKING, Any, Iterable

if TYPE_CHECKING:
    import torch

BLOCK = 4096  # int32 words per block: 16 KiB
_odd: dict[Any, "torch.Tensor"] = {}  # device -> 1, 3, 5, ... (int64), grown as needed


def _odd_weights(count: int, device) -> "torch.Tensor":
    import torch

    weights = _odd.get(device)
    if weights is None or weights.numel() < count:
        weights = _odd[device] = torch.arange(1, 2 * max(count, 1024) + 1, 2, dtype=torch.int64, device=device)
    return weights[:count]


def tensor_digest(tensor: "torch.Tensor") -> "torch.Tensor":
    """The digest of ``tensor``'s bytes (see the module): a 0-dim int64 tensor on its device, not
    yet read (on a GPU the kernels are queued, nothing waits for them)."""
    import torch

    t = tensor.detach()
    if not t.is_contiguous():
        t = t.contiguous()  # a copy on the device (rare: parameters are contiguous)
    flat = t.reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    rest = None
    if flat.element_size() % 4 == 0:
        words = flat.view(torch.int32)
    else:  # bf16, fp16, int8, ...: the bytes as int32 words (widening int16 elements is ~6x slower)
        raw = flat.view(torch.uint8)
        whole = raw.numel() // 4 * 4
        try:
            words = raw[:whole].view(torch.int32)
        except RuntimeError:  # a view starting at no multiple of 4 bytes: read from an aligned copy
            words = raw[:whole].clone().view(torch.int32)
        rest = raw[whole:] if whole < raw.numel() else None
    full = words.numel() // BLOCK
    terms = []  # a few kernels per tensor, each term an int64 0-dim tensor
    if full:
        sums = words[: full * BLOCK].view(full, BLOCK).sum(dim=1, dtype=torch.int32)  # wraps mod 2^32
        terms.append((sums.to(torch.int64) * _odd_weights(full, words.device)).sum())  # wraps mod 2^64
    if words.numel() > full * BLOCK:  # the last, shorter block
        terms.append(words[full * BLOCK:].sum(dtype=torch.int32).to(torch.int64) * (2 * full + 1))
    if rest is not None:  # 1-3 bytes past the last word: packed into one more, the block after
        shifts = torch.tensor([0, 8, 16], dtype=torch.int64, device=rest.device)[: rest.numel()]
        terms.append((rest.to(torch.int64) << shifts).sum() * (2 * full + 3))
    if not terms:  # no bytes
        return torch.zeros((), dtype=torch.int64, device=words.device)
    return terms[0] if len(terms) == 1 else sum(terms[1:], terms[0])


def _entry(name: str, dtype, shape, content: int) -> bytes:
    """A tensor's 8-byte digest with its name, dtype and shape."""
    key = f"{name}|{dtype}|{tuple(shape)}|{content & 0xFFFFFFFFFFFFFFFF:016x}".encode()
    return hashlib.sha256(key).digest()[:8]


def _combined(entries: Iterable[bytes]) -> str:
    return hashlib.sha256(b"".join(sorted(entries))).hexdigest()[:16]


class Digests:
    """Tensors' digests, one by one as they pass (:meth:`add` reads each where it is, at once: one
    that was just written is still in the cache), read back together: one small host copy per device."""

    def __init__(self, named: Iterable[tuple[str, Any]] = ()):
        self._names: list[tuple[str, str, tuple]] = []
        self._digests: list[Any] = []
        self.update(named)

    def add(self, name: str, tensor) -> None:
        self._names.append((name, str(tensor.dtype), tuple(tensor.shape)))
        self._digests.append(tensor_digest(tensor))

    def update(self, named: Iterable[tuple[str, Any]]) -> "Digests":
        for name, tensor in named:
            self.add(name, tensor)
        return self

    def __len__(self) -> int:
        return len(self._names)

    def take(self, count: int) -> "Digests":
        """The first ``count`` tensors' digests, moved into a set of their own."""
        taken = Digests()
        taken._names, taken._digests = self._names[:count], self._digests[:count]
        del self._names[:count], self._digests[:count]
        return taken

    def contents(self) -> list[int]:
        """Each tensor's content digest (unsigned 64-bit), in the order added."""
        import torch

        out: list[int] = [0] * len(self._digests)
        by_device: dict[Any, list[int]] = {}
        for i, d in enumerate(self._digests):
            by_device.setdefault(d.device, []).append(i)
        for indices in by_device.values():
            values = torch.stack([self._digests[i] for i in indices]).cpu().tolist()  # the one copy to the host
            for i, v in zip(indices, values):
                out[i] = v & 0xFFFFFFFFFFFFFFFF
        return out

    def entries(self) -> list[tuple[str, bytes]]:
        """(name, 8-byte digest of name, dtype, shape and content) of each tensor, in the order added."""
        return [(meta[0], _entry(*meta, content)) for meta, content in zip(self._names, self.contents())]

    def hexdigest(self) -> str:
        """The fingerprint of them all: 16 hex digits, whatever order they were added in."""
        return _combined(e for _, e in self.entries())


def fingerprint(named_tensors: Iterable[tuple[str, Any]]) -> str:
    """See ``engines.backends.base.fingerprint``."""
    return Digests(named_tensors).hexdigest()


def _sha256_entry(name: str, tensor) -> bytes:
    import torch

    t = tensor.detach().contiguous()
    h = hashlib.sha256(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(t.cpu().view(-1).view(torch.uint8).numpy())  # raw bytes (numpy has no bfloat16), not copied
    return h.digest()


def sha256_fingerprint(named_tensors: Iterable[tuple[str, Any]]) -> str:
    """The fingerprint before issue 67: SHA-256 of each tensor's bytes, copied to the host. Kept as
    the benchmarks' baseline (``YATTFLOW_SYNC_CHECK=sha256``); nothing else uses it."""
    return _combined(_sha256_entry(name, tensor) for name, tensor in named_tensors)


# --- the weight sync's check ----------------------------------------------------------------------

SYNC_CHECK = "YATTFLOW_SYNC_CHECK"
SYNC_CHECKS = ("device", "sha256", "off")


def sync_check() -> str:
    """How a weight sync checks its buckets, on both sides: ``device`` (the default: :class:`Digests`
    where the tensors are), or, for benchmarks only (``bench.sync`` times all three), ``sha256`` (the
    check before issue 67) or ``off`` (no check). Read from ``YATTFLOW_SYNC_CHECK`` at each sync; the
    engine hosts and vLLM's workers inherit it, so both sides agree."""
    mode = os.environ.get(SYNC_CHECK, "device")
    if mode not in SYNC_CHECKS:
        raise ValueError(f"{SYNC_CHECK}={mode!r}: one of {', '.join(SYNC_CHECKS)}")
    return mode


class BucketDigest:
    """A weight-sync bucket's fingerprint, tensor by tensor as the tensors pass (:func:`sync_check`'s way)."""

    def __init__(self, mode: str | None = None):
        self.mode = mode or sync_check()
        self._device = Digests() if self.mode == "device" else None
        self._sha: list[bytes] = []

    def add(self, name: str, tensor) -> None:
        if self._device is not None:
            self._device.add(name, tensor)
        elif self.mode == "sha256":
            self._sha.append(_sha256_entry(name, tensor))  # hashed now, the tensor not kept

    def take(self, count: int) -> "BucketDigest":
        """The first ``count`` tensors', moved into a digest of their own (a bucket's, of what passed)."""
        taken = BucketDigest(self.mode)
        if self._device is not None:
            taken._device = self._device.take(count)
        taken._sha, self._sha = self._sha[:count], self._sha[count:]
        return taken

    def hexdigest(self) -> str:
        if self._device is not None:
            return self._device.hexdigest()
        if self.mode == "sha256":
            return _combined(self._sha)  # = sha256_fingerprint(the bucket)
        return "unchecked"


def bucket_fingerprint(bucket: Iterable[tuple[str, Any]], mode: str | None = None) -> str:
    """A whole bucket's fingerprint at once (:class:`BucketDigest`)."""
    digest = BucketDigest(mode)
    for name, tensor in bucket:
        digest.add(name, tensor)
    return digest.hexdigest()
