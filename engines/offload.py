"""Trainer offload: the trainer gives the devices back while rollout and GenRM hold them.

Every tensor the trainer keeps between steps — weights, gradients, Megatron's contiguous
parameter and gradient buffers, the optimizer's moments and fp32 main copies — lives in some
storage, and most are views into a few big ones. ``offload`` copies each storage once into
host memory and shrinks it to zero bytes; ``restore`` grows it back and copies the bytes in.
The tensor objects never change, so the model, Megatron's DDP wrapper and the optimizer keep
every reference they hold (verl offloads Megatron buffers the same way).

Storages already in host memory are left alone: a CPU trainer has nothing to give back
(``include_host=True`` moves them anyway, so tests can check the mechanism without a GPU).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def trainer_tensors(*roots) -> Iterable[torch.Tensor]:
    """The tensors held by modules (parameters, their ``grad``/``main_grad``, buffers), by
    torch optimizers (state and parameter groups), and by Megatron's DDP parameter/gradient
    buffers, found under ``roots`` (modules, optimizers, Megatron's chained optimizer, None)."""
    for root in roots:
        if root is None:
            continue
        if isinstance(root, torch.nn.Module):
            for p in root.parameters():
                yield p
                for grad in (p.grad, getattr(p, "main_grad", None)):
                    if grad is not None:
                        yield grad
            yield from torch.nn.Module.buffers(root)  # Megatron's DDP shadows the method (next line)
            for buffer in _ddp_buffers(root):
                yield from (t for t in (buffer.param_data, buffer.grad_data) if t is not None)
        elif isinstance(root, torch.optim.Optimizer):
            for group in root.param_groups:
                yield from group["params"]
            for state in root.state.values():
                yield from (v for v in state.values() if isinstance(v, torch.Tensor))
        elif hasattr(root, "chained_optimizers"):  # Megatron's ChainedOptimizer
            for chained in root.chained_optimizers:
                yield from trainer_tensors(chained.optimizer)
        else:
            raise TypeError(f"trainer_tensors: don't know where a {type(root).__name__} keeps its tensors")


def _ddp_buffers(module: torch.nn.Module) -> list:
    """Megatron's DistributedDataParallel keeps its contiguous _ParamAndGradBuffers in the
    attributes ``buffers`` (shadowing nn.Module.buffers) and ``expert_parallel_buffers``."""
    found = []
    for name in ("buffers", "expert_parallel_buffers"):
        value = module.__dict__.get(name)
        found += value if isinstance(value, list) else []
    return found


class Offload:
    """Host-memory copies of a trainer's device storages, reused from one offload to the next
    (allocating pinned memory is slower than copying into it)."""

    def __init__(self, include_host: bool = False):
        self.include_host = include_host
        self._copies: dict[int, torch.Tensor] = {}  # storage id → its bytes in host memory
        self._offloaded: list[tuple[torch.UntypedStorage, torch.Tensor]] = []

    @torch.no_grad()
    def offload(self, tensors: Iterable[torch.Tensor]) -> int:
        """Move every storage behind ``tensors`` to host memory; answers the bytes moved."""
        if self._offloaded:
            return 0
        seen: set[int] = set()
        for tensor in tensors:
            storage = tensor.untyped_storage()
            key = storage._cdata  # the storage itself, stable across resizes (data_ptr is not)
            if key in seen or storage.nbytes() == 0 or (storage.device.type == "cpu" and not self.include_host):
                continue
            seen.add(key)
            copy = self._copies.get(key)
            if copy is None or copy.numel() != storage.nbytes():
                copy = self._copies[key] = torch.empty(
                    storage.nbytes(), dtype=torch.uint8, pin_memory=storage.device.type == "cuda")
            copy.untyped_storage().copy_(storage, non_blocking=True)
            self._offloaded.append((storage, copy))
        self._copies = {key: self._copies[key] for key in seen}  # storages gone since the last offload free theirs
        if any(s.device.type == "cuda" for s, _ in self._offloaded):
            torch.cuda.synchronize()  # the copies must land before the device memory goes
        for storage, _ in self._offloaded:
            storage.resize_(0)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # hand the freed blocks back to the driver, for vLLM to take
        return sum(copy.numel() for _, copy in self._offloaded)

    @torch.no_grad()
    def restore(self) -> int:
        """Grow every offloaded storage back on its device and copy its bytes in."""
        moved = 0
        for storage, copy in self._offloaded:
            storage.resize_(copy.numel())
            storage.copy_(copy.untyped_storage(), non_blocking=True)
            moved += copy.numel()
        if any(s.device.type == "cuda" for s, _ in self._offloaded):
            torch.cuda.synchronize()
        self._offloaded = []
        return moved
