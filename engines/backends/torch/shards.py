"""Sharded checkpoint files (``train.fsdp`` > 1): ``torch.distributed.checkpoint`` (DCP), as
Megatron-Core's ``dist_checkpointing`` writes them.

Each rank writes its own shards of the model's and the optimizer's state (``__{rank}_0.distcp``;
a shard that the DP groups replicate is written by one of them) and rank 0 the index
(``.metadata``), keyed by parameter name; no rank ever holds the whole state, so a checkpoint's
memory is a rank's shards, not the policy. Reading reshards: each rank reads what its layout
holds, whatever layout wrote the files (any ``train.fsdp``, or none: a trainer that is not
sharded reads the whole tensors).

The index is a pickle: it is read with the classes an index is made of and nothing else, and the
few non-tensor values (the optimizer's hyper-parameters) as plain data (``weights_only``), so a
file planted on storage never runs code (DCP's own reader would unpickle anything). Megatron-Core's
``dist_checkpointing`` writes the same index: the Megatron trainer reads it here first, before
Megatron's reader unpickles it (engines/backends/megatron/optimizer.py).
"""

from __future__ import annotations

import glob
import io
import os
import pickle
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

INDEX = ".metadata"


def is_sharded(folder: str) -> bool:
    """Whether ``folder`` holds sharded files rather than one whole checkpoint file."""
    return os.path.exists(os.path.join(folder, INDEX))


def save(model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: str, frozen: bool = True) -> list[str]:
    """This rank's shards of the model's and the optimizer's state into ``folder`` (rank 0: and
    the index); collective over every rank. Returns the files this rank wrote. ``frozen=False``:
    the trained parameters only (a LoRA adapter)."""
    model_state, optimizer_state = get_state_dict(model, optimizer, options=StateDictOptions(ignore_frozen_params=not frozen))
    os.makedirs(folder, exist_ok=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"model": model_state, "optimizer": optimizer_state}, no_dist=not dist.is_initialized(),
                 storage_writer=dcp.FileSystemWriter(folder, single_file_per_rank=True, thread_count=1))
    rank = dist.get_rank() if dist.is_initialized() else 0
    mine = sorted(os.path.basename(f) for f in glob.glob(os.path.join(folder, f"__{rank}_*.distcp")))
    return mine + ([INDEX] if rank == 0 else [])


def load(model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: str, frozen: bool = True) -> None:
    """What this rank holds of the model's and the optimizer's state, read from ``folder``'s shards
    (collective when distributed). ``frozen=False``: the files hold the trained parameters only."""
    index = read_index(folder)  # first: a bad index is this error, not one inside DCP's collectives
    options = StateDictOptions(ignore_frozen_params=not frozen)
    model_state, optimizer_state = get_state_dict(model, optimizer, options=options)  # the shapes to read into
    state = {"model": model_state, "optimizer": optimizer_state}
    with warnings.catch_warnings():  # one process, no process group: what it warns of is meant
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=IndexReader(folder, index), planner=PlainDataPlanner(), no_dist=not dist.is_initialized())
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=StateDictOptions(strict=frozen))


def names(folder: str, part: str = "model") -> set[str]:
    """The parameter names ``folder``'s shards hold of ``part`` (``model`` or ``optimizer``), from the index."""
    return {key[len(part) + 1 :] for key in read_index(folder).state_dict_metadata if key.startswith(part + ".")}


def read_index(folder: str):
    """``folder``'s index (DCP's ``Metadata``), unpickled with the classes of an index only."""
    path = os.path.join(folder, INDEX)
    if not os.path.exists(path):
        raise ValueError(f"{folder}: no {INDEX}, the index of a checkpoint's shards (not a sharded checkpoint, or not all of one)")
    with open(path, "rb") as f:
        try:
            return IndexUnpickler(f).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, TypeError) as e:
            raise ValueError(f"{path}: not the index of a checkpoint's shards ({e})") from e


class IndexUnpickler(pickle.Unpickler):
    """DCP's ``Metadata`` (with the save plans Megatron-Core keeps in it) and nothing else: no
    function of any module can be called."""

    ALLOWED = {("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "_MEM_FORMAT_ENCODING")} | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"), ("pathlib", "PosixPath"),
        ("torch.serialization", "_get_layout")} | {  # a layout by its name
        ("torch.distributed.checkpoint.planner", name) for name in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")}

    def find_class(self, module: str, name: str):
        if (module, name) in self.ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint index")


class IndexReader(FileSystemReader):
    """DCP's file reader, given the index ``read_index`` read."""

    def __init__(self, folder: str, index):
        super().__init__(folder)
        self.index = index

    def read_metadata(self, *args, **kwargs):
        if getattr(self.index, "storage_meta", None) is None:
            self.index.storage_meta = StorageMeta()
        self.index.storage_meta.load_id = self.load_id
        return self.index


class PlainDataPlanner(DefaultLoadPlanner):
    """DCP's planner, its non-tensor values (the optimizer's hyper-parameters) read as plain data."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        data = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], data)
        else:
            self.state_dict[read_item.dest_index.fqn] = data
