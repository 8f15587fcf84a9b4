"""The engines' device, and the hosts' two process groups: one for the trainer, one for metadata.

A DP run's trainers exchange *device* tensors — the gradient all-reduce, tensor-parallel shards,
the global token counts — and on CUDA only NCCL carries those: gloo fails on them
(``ProcessGroupGloo::allreduce_coalesced: unsupported device type cuda``, seen on an H100).
The hosts also exchange small integers that live in host memory — the balance plan's token
counts (:func:`all_gather_ints`) and anything else about the run rather than the
model — which NCCL would need copied onto the device and back. So the default group gets the
backend of the trainer's device (NCCL on CUDA, gloo on the CPU), and a second group, always gloo,
carries the CPU metadata. On the CPU both are gloo, and the metadata still goes through its own
group, so CPU tests exercise the same routing the GPU run takes.

Nothing here listens beyond the host's bind address: rank 0 serves the rendezvous store on a
socket the host bound (:func:`rendezvous_store`), and the host points gloo's and NCCL's sockets
at the bind address's interface (``engines.host.process.pin_interface``).
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist

# (the default group the metadata group was created beside, the metadata group): a default group
# destroyed and created again (tests do) leaves a stale entry, recognised by the first element
_metadata: tuple[object, dist.ProcessGroup] | None = None


def default_device() -> torch.device:
    """The device an engine of this process computes on: the current CUDA device (a host sees
    its group's GPUs through ``CUDA_VISIBLE_DEVICES``), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def backend_for(device: torch.device | str) -> str:
    """The ``torch.distributed`` backend for collectives of tensors on ``device``."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def rendezvous_store(rank: int, world: int, master: str, timeout: timedelta,
                     listening: socket.socket | None = None) -> dist.TCPStore:
    """The DP group's rendezvous at ``master`` ("host:port"): rank 0 serves it on ``listening``, a
    socket it bound to that port and listens on; the other ranks connect to it.

    torch's ``tcp://`` rendezvous would have rank 0 listen on every interface, whatever address
    the host was told to bind to; a store on our own socket listens where that socket does."""
    host, port = master.rsplit(":", 1)
    if rank == 0:
        # detach: the store owns the descriptor from now on (and closes it), not this socket object
        return dist.TCPStore(host, int(port), world, is_master=True, timeout=timeout, master_listen_fd=listening.detach())
    return dist.TCPStore(host, int(port), world, is_master=False, timeout=timeout)


def init_process_groups(device: torch.device | str, rank: int, world: int, store: dist.Store,
                        timeout: timedelta) -> None:
    """Join the DP group through ``store`` (collective: every rank calls it once, before any other
    collective). A world of one needs no network: ``dist.HashStore()`` serves.

    The default group uses :func:`backend_for` the trainer's ``device``; a gloo group over the
    same ranks is created for :func:`metadata_group`."""
    global _metadata
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL binds a rank to the device that is current when it connects
    dist.init_process_group(backend_for(device), store=store, rank=rank, world_size=world, timeout=timeout)
    _metadata = (dist.group.WORLD, dist.new_group(backend="gloo", timeout=timeout))


def metadata_group() -> dist.ProcessGroup:
    """The gloo group for collectives of CPU tensors (balance plans and other run metadata).

    Where ``torch.distributed`` was initialised by other code (a test's or a benchmark's own
    gloo workers) the default group is gloo already and serves; with another backend there is
    no group for CPU tensors, which is an error rather than a hang or a crash inside NCCL."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: no metadata group")
    if _metadata is not None and _metadata[0] is dist.group.WORLD:
        return _metadata[1]
    if dist.get_backend() == "gloo":
        return dist.group.WORLD
    raise RuntimeError(f"torch.distributed was initialised with {dist.get_backend()!r} without "
                       "engines.backends.distributed.init_process_groups: there is no gloo group for CPU metadata")


def all_gather_ints(values: list[int]) -> list[list[int]]:
    """Every rank's list of integers (lengths may differ), as int64 CPU tensors over the
    metadata group: unlike ``all_gather_object`` nothing is unpickled from the network."""
    group = metadata_group()
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([len(values)], dtype=torch.int64), group=group)
    mine = torch.zeros(max(max(int(s) for s in sizes), 1), dtype=torch.int64)
    mine[: len(values)] = torch.tensor(values, dtype=torch.int64)
    out = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(out, mine, group=group)
    return [o[: int(s)].tolist() for o, s in zip(out, sizes)]
