"""The torch trainer sharded with FSDP2 (``train.fsdp``): a DP group of several ranks for a policy
that does not fit one device, without Megatron-Core.

``fully_shard`` (torch's FSDP2) splits every parameter, its gradient and its Adam state over the
group's ``size`` ranks, one transformer block at a time (the model's ``_no_split_modules``), each
block's weights all-gathered just before its forward and backward and freed after; gradients are
reduce-scattered inside the group and all-reduced across the DP groups, which hold replicas of
the same shards (hybrid sharding: a ``replicate x shard`` device mesh, the group's ranks along
``shard``, consecutive as engines/config/layout.py numbers them). Gradients are *summed* (divide
factor 1): ``LossStep`` normalises the loss by global counts, as on every other path.

Unlike Megatron's tensor parallelism, the group's ranks compute on different rows: every rank is
given the group's batch (the controller fans each request out) and trains its share of each
minibatch (``rows``). Each block's all-gather is a collective of the group, so its ranks must run
as many forward and backward passes: a rank with fewer passes runs ``filler`` passes (loss 0)
until it has as many as the busiest (``passes_of_the_busiest``). Log-probabilities are computed
by every rank on the whole batch (the same passes everywhere, no exchange).

Checkpoints are sharded files (``shards.py``: each rank writes its own shards, no rank holds the
whole state), keyed by parameter name and resharded as they are read, so they resume under any
``train.fsdp`` and without it; a sharded trainer still reads a whole checkpoint file
(``load_full_state``), one that was not sharded wrote.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from engines.backends.base import TrainBatch
from engines.backends.batching import micro_batches, packed_micro_batches

if TYPE_CHECKING:  # the FSDP modules are imported where used: ~1.4 s that a trainer without them never pays
    from torch.distributed.device_mesh import DeviceMesh


def mesh(size: int, device: torch.device) -> DeviceMesh:
    """The world's ranks as ``replicate x shard``: groups of ``size`` consecutive ranks (collective)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if world % size:
        raise ValueError(f"train.fsdp={size}: {world} ranks are not groups of {size}")
    return init_device_mesh(device.type, (world // size, size), mesh_dim_names=("replicate", "shard"))


def shard(model: torch.nn.Module, mesh: DeviceMesh, device: torch.device, whole: set[torch.nn.Parameter] | None = None) -> None:
    """``fully_shard`` ``model`` over ``mesh``'s groups: each transformer block (the blocks its
    Hugging Face models name in ``_no_split_modules``, a critic's backbone too), then the rest
    (embeddings, final norm, output layer or value head) as the root; gradients summed, not averaged.
    ``model`` may be in host memory: ``fully_shard`` moves each block to ``device`` as it shards it,
    so the device holds this rank's shards and at most one block whole, never the model.

    ``whole``: parameters FSDP leaves alone, whole on every rank (a vision-language policy's frozen
    vision tower), moved to ``device`` here: a rank runs them on its own images with no collective,
    so the ranks of a group need not encode images in the same passes (a filler pass has none)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    whole = whole or set()
    blocks = {name for m in model.modules() for name in (getattr(m, "_no_split_modules", None) or ())}
    for module in model.modules():
        if type(module).__name__ in blocks and not set(module.parameters()) <= whole:
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh, ignored_params=whole)
    with torch.no_grad():
        for p in whole:
            p.data = p.data.to(device)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # plain sums (gloo has no pre-multiplied sum)


def rows(part: TrainBatch, unit: int, mesh: DeviceMesh) -> TrainBatch:
    """This rank's share of the group's minibatch."""
    return part.split(mesh.size(1), unit)[mesh.get_local_rank(1)]


def passes(part: TrainBatch, max_tokens: int | None, unit: int, mesh: DeviceMesh | None, device: torch.device,
           pad_id: int, packed: bool = False) -> tuple[TrainBatch, list[TrainBatch], int]:
    """This rank's rows of a minibatch (all of them without a mesh), its forward/backward passes of
    at most ``max_tokens`` tokens (``packed``: ``packed_micro_batches``, else padded: ``micro_batches``)
    and how many of them are real: sharded, ``filler`` passes follow until the rank has as many as its
    group's busiest (collective)."""
    mine = part if mesh is None else rows(part, unit, mesh)
    cut = (packed_micro_batches if packed else micro_batches)(mine, max_tokens, unit)
    real = len(cut)
    if mesh is not None:
        cut += [filler(pad_id)] * (passes_of_the_busiest(real, mesh, device) - real)
    return mine, cut, real


def passes_of_the_busiest(count: int, mesh: DeviceMesh, device: torch.device) -> int:
    """The most forward/backward passes a rank of this group has (at least one: the replicas'
    gradient all-reduce runs in the last backward pass, and every group must join it)."""
    t = torch.tensor([max(count, 1)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=mesh.get_group(1))
    return int(t.item())


def filler(pad_id: int) -> TrainBatch:
    """A pass of one two-token row whose loss is multiplied by zero: it joins the group's collectives
    and adds nothing to the gradients or the statistics."""
    return TrainBatch([[pad_id, pad_id]], [[pad_id]], [[0.0]], [0.0])


def sync_gradients(model: torch.nn.Module, now: bool) -> None:
    """Reduce gradients in this backward pass (a minibatch's last) or keep accumulating them."""
    model.set_requires_gradient_sync(now)


def group_sums(values: list[float], mesh: DeviceMesh, device: torch.device) -> list[float]:
    """``values`` summed over the group's ranks."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, group=mesh.get_group(1))
    return t.tolist()


def full(tensor: torch.Tensor) -> torch.Tensor:
    """A parameter whole (collective over its group when sharded)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor  # a DTensor


def load_full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, model_state: dict, optimizer_state: dict,
                    strict: bool = True) -> None:
    """Each rank takes its shards of a whole state (every rank holds it: read from the checkpoint);
    ``strict=False``: ``model_state`` may hold some parameters only (a LoRA adapter's)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state,
                   options=StateDictOptions(full_state_dict=True, strict=strict))


def by_name(optimizer_state: dict, names: list[str]) -> dict:
    """A plain ``optimizer.state_dict()`` (parameters by index) keyed by parameter name instead;
    ``names``: the optimizer's parameters' names, in its order."""
    return {"state": {names[i]: v for i, v in optimizer_state["state"].items()},
            "param_groups": [dict(g, params=[names[i] for i in g["params"]]) for g in optimizer_state["param_groups"]]}


def by_index(optimizer_state: dict, names: list[str]) -> dict:
    """The inverse of :func:`by_name`."""
    index = {n: i for i, n in enumerate(names)}
    return {"state": {index[n]: v for n, v in optimizer_state["state"].items()},
            "param_groups": [dict(g, params=[index[n] for n in g["params"]]) for g in optimizer_state["param_groups"]]}
