"""Trainer offload: the trainer gives the devices back while rollout and GenRM hold them.

Every tensor the trainer keeps between steps — weights, gradients, Megatron's contiguous
parameter and gradient buffers, the optimizer's moments and fp32 main copies — lives in some
storage, and most are views into a few big ones. ``offload`` copies each storage once into
host memory and shrinks it to zero bytes; ``restore`` grows it back and copies the bytes in.
The tensor objects never change, so the model, Megatron's DDP wrapper and the optimizer keep
every reference they hold (verl offloads Megatron buffers the same way).

What is offloaded is every storage on the trainer's device — on a CPU trainer too: there the
"host copy" is just another allocation, but the storages really are released and restored, so
CPU tests run the code path a GPU run takes (reading a sleeping trainer's weights from a
released storage crashed an H100 run that no CPU test could see). While the trainer sleeps,
``host_view`` reads a tensor from its host copy.
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
    """Host-memory copies of a trainer's ``device`` storages, reused from one offload to the next
    (allocating pinned memory is slower than copying into it)."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self._copies: dict[int, torch.Tensor] = {}  # storage id → its bytes in host memory
        self._offloaded: dict[int, tuple[torch.UntypedStorage, torch.Tensor]] = {}  # storage id → (storage, copy)

    @property
    def asleep(self) -> bool:
        return bool(self._offloaded)

    @staticmethod
    def _key(storage: torch.UntypedStorage) -> int:
        return storage._cdata  # the storage itself, stable across resizes (data_ptr is not)

    @torch.no_grad()
    def offload(self, tensors: Iterable[torch.Tensor]) -> int:
        """Move every storage behind ``tensors`` that is on the device to host memory; answers the
        bytes moved (0 when already offloaded)."""
        if self._offloaded:
            return 0
        pinned = self.device.type == "cuda"
        for tensor in tensors:
            storage = tensor.untyped_storage()
            key = self._key(storage)
            if key in self._offloaded or storage.nbytes() == 0 or storage.device.type != self.device.type:
                continue
            copy = self._copies.get(key)
            if copy is None or copy.numel() != storage.nbytes():
                copy = self._copies[key] = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pinned)
            copy.untyped_storage().copy_(storage, non_blocking=True)
            self._offloaded[key] = (storage, copy)
        # storages gone since the last offload free their copies
        self._copies = {key: self._copies[key] for key in self._offloaded}
        if pinned:
            torch.cuda.synchronize()  # the copies must land before the device memory goes
        for storage, _ in self._offloaded.values():
            storage.resize_(0)
        if pinned:
            torch.cuda.empty_cache()  # hand the freed blocks back to the driver, for vLLM to take
        return sum(copy.numel() for _, copy in self._offloaded.values())

    @torch.no_grad()
    def restore(self) -> int:
        """Grow every offloaded storage back on its device and copy its bytes in."""
        moved = 0
        for storage, copy in self._offloaded.values():
            storage.resize_(copy.numel())
            storage.copy_(copy.untyped_storage(), non_blocking=True)
            moved += copy.numel()
        if self.device.type == "cuda" and self._offloaded:
            torch.cuda.synchronize()
        self._offloaded = {}
        return moved

    def host_view(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` itself, or — while its storage is offloaded — the same elements read from the
        host copy (a host-memory tensor of the same dtype, shape and strides; do not write to it)."""
        entry = self._offloaded.get(self._key(tensor.untyped_storage()))
        if entry is None:
            return tensor
        view = torch.empty(0, dtype=tensor.dtype)
        return view.set_(entry[1].untyped_storage(), tensor.storage_offset(), tensor.shape, tensor.stride())


class Sleeps:
    """``wake``, ``asleep`` and the guard of an engine whose ``_offload`` (an :class:`Offload`) holds
    its tensors while it sleeps; its own ``sleep`` names those tensors."""

    _offload: Offload

    def wake(self) -> int:
        """Everything ``sleep`` moved, back on the device, bit for bit."""
        return self._offload.restore()

    @property
    def asleep(self) -> bool:
        return self._offload.asleep

    def _require_awake(self, what: str) -> None:
        # a released storage reads as garbage or crashes inside CUDA ("invalid argument"): say so instead
        if self._offload.asleep:
            raise RuntimeError(f"{type(self).__name__}.{what}: it is asleep (its device memory is released); wake() it first")
