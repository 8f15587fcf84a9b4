"""One rank's checkpoints: what a checkpoint holds, how it is written beside training, how a
run resumes from it.

Layout of a checkpoint (each rank writes its share; the controller commits the manifest once
every rank's files are written, ``storage/runstate.py``):

    trainer-{backend}/   the train engine's own format (one file for torch, or with train.fsdp
                         the shards every rank writes; Megatron ``dist_checkpointing`` shards)
    critic-{backend}/    an algorithm with a critic: its weights (value head included) and optimizer (torch:
                         rank 0's file, or every rank's shards; Megatron: ``dist_checkpointing`` shards)
    model/               the policy as a Hugging Face folder (rank 0; group 0's other ranks gather it
                         with rank 0: a tensor-parallel export is a collective); with train.lora the adapter
                         folder (the base is the policy folder, recorded in trainer-torch/)
    prompts.json         the prompt files the data cursors point into (rank 0)
    layout.json          the ranks that wrote it: dp, train.tensor_parallel, train.pipeline_parallel,
                         train.expert_parallel, train.fsdp, train.distributed_optimizer (rank 0)
    rng-{rank}.pt        torch's and Python's RNG states
"""

from __future__ import annotations

import io
import logging
import math
import os
import random
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from engines.config.layout import Layout
from engines.host import faults
from engines.wire.commands import CheckpointResult, CheckpointWaitResult
from engines.backends import distributed
from engines.backends.base import Trainer, load_torch_file
from storage import objectstore
from storage.runstate import checkpoint_step, file_digest, file_record, manifest_files

log = logging.getLogger("yattflow.host")


class CheckpointDamaged(ValueError):
    """A checkpoint file's content is not what its manifest recorded (``Checkpoints.verify``)."""


def critic_dir(backend: str) -> str:
    """The critic's share of a checkpoint (``engines/backends/{torch,megatron}/critic.py``)."""
    return f"critic-{backend}"


class Checkpoints:
    """Write this rank's share of checkpoints, one at a time, and resume from one.

    ``prompt_files``: ``[name, rows]`` of the prompts dataset this run's streams read
    (``storage.datasets.part_files``): a checkpoint records them, and a resume refuses a dataset
    whose first files changed, since the data cursors are positions in them."""

    def __init__(self, rank: int, backend: str, prompt_files: list[list], layout: Layout | None = None,
                 distributed_optimizer: bool = False, reshardable_optimizer: bool = False):
        self.rank, self.backend, self.prompt_files = rank, backend, prompt_files
        # the ranks it is one of (None: not known, nothing recorded) and what layout.json records of them
        self.layout, self.distributed_optimizer, self.reshardable_optimizer = layout, distributed_optimizer, reshardable_optimizer
        known = layout or Layout(rank + 1)
        self.name = known.name(rank)  # in logs and faults: dp-1, dp-1.1
        self.exports = known.group(rank) == 0  # takes part in writing model/ (DP group 0's ranks)
        self._write: BackgroundWrite | None = None  # in flight, or finished and not yet collected

    def save(self, trainer: Trainer, uri: str, asynchronous: bool, critic=None) -> CheckpointResult:
        """Asynchronous: return as soon as the state is copied into host memory (``stall_s``: how
        long training waited) while a thread writes the copy; ``wait`` answers the files.
        Otherwise return after the write, with the files."""
        leftover = self._collect()  # normally collected by ``wait`` already
        if leftover is not None:
            log.warning("%s: checkpoint %s was written but never collected with checkpoint_wait", self.name, leftover["uri"])
        start = time.perf_counter()
        write = self._freeze(trainer, uri, copy=asynchronous, critic=critic)
        if not asynchronous:
            files = write()
            seconds = time.perf_counter() - start
            return CheckpointResult(files=files, asynchronous=False, stall_s=seconds, seconds=seconds)
        self._write = BackgroundWrite(uri, write)
        stall = time.perf_counter() - start
        log.info("%s: checkpoint %s: state copied in %.3fs, writing in the background", self.name, uri, stall)
        return CheckpointResult(files=None, asynchronous=True, stall_s=stall, seconds=stall)

    def wait(self) -> CheckpointWaitResult:
        """Wait for the background write; its files (None when no write was started since the
        last wait). A failed write raises here, with the writer's traceback."""
        start = time.perf_counter()
        done = self._collect()
        if done is None:
            return CheckpointWaitResult(uri=None, files=None, write_s=0.0, wait_s=0.0)
        return CheckpointWaitResult(**done, wait_s=time.perf_counter() - start)

    def _collect(self) -> dict | None:
        write, self._write = self._write, None
        return write.result() if write is not None else None

    def _freeze(self, trainer: Trainer, uri: str, copy: bool, critic=None) -> Callable[[], dict[str, dict]]:
        """Take what this rank's checkpoint holds *now*; return a function that writes it to
        ``uri`` and returns each file's record (``storage.runstate.file_record``: size and SHA-256 of the
        bytes it wrote). With ``copy`` the function reads only host-memory copies (and files already
        written), so it may run on another thread while the next steps change the live state; without,
        it writes the live state (call it at once)."""
        tmp = tempfile.mkdtemp(prefix="yattflow-checkpoint-")
        trainer_dir = os.path.join(tmp, f"trainer-{self.backend}")
        try:
            frozen = trainer.freeze_checkpoint(trainer_dir, copy=copy, hf_weights=self.exports)
            frozen_critic = (critic.freeze_checkpoint(os.path.join(tmp, critic_dir(self.backend)), copy=copy)
                             if critic is not None else None)
            rng = to_bytes({"torch": torch.get_rng_state(), "python": random.getstate()})
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        rank, name, exports, backend, prompt_files = self.rank, self.name, self.exports, self.backend, list(self.prompt_files)
        layout = self._recorded()

        def write() -> dict[str, dict]:
            try:
                return written()
            except objectstore.StorageError:  # a write to storage: it names its URI and the OS's error
                raise
            except OSError as e:  # staging the files in local scratch space
                raise objectstore.StorageIOError(f"{uri}: staging the checkpoint's files in {tmp} failed: "
                                                 f"{objectstore.os_error(e)}") from e
            finally:
                shutil.rmtree(tmp, ignore_errors=True)

        def written() -> dict[str, dict]:
            records = {}  # each file's size and SHA-256, from the bytes as they are written (the manifest's)

            def put(file: str, data: bytes) -> None:
                objectstore.write_bytes(objectstore.join(uri, file), data)
                records[file] = file_record(data)

            files = [f"trainer-{backend}/{f}" for f in frozen.write()]
            files += [f"{critic_dir(backend)}/{f}" for f in frozen_critic.write()] if frozen_critic is not None else []
            if exports and (rank == 0 or not copy):  # rank 0 writes; without a copy taken, its group gathers them with it
                trainer.save_hf(os.path.join(tmp, "model"), tensors=frozen.hf_weights)
            if rank == 0:
                files += sorted(str(p.relative_to(tmp)) for p in Path(tmp, "model").rglob("*") if p.is_file())
            put(f"rng-{rank}.pt", rng)
            faults.inject("checkpoint_write", checkpoint_step(uri), name)
            for file in files:
                put(file, Path(tmp, file).read_bytes())
            if rank == 0:  # the prompt files this run's streams (and so the cursors) were read from
                put("prompts.json", objectstore.json_bytes({"files": prompt_files}))
                put("layout.json", objectstore.json_bytes(layout))
            return records

        return write

    def verify(self, uri: str) -> None:
        """Before any rank loads ``uri``: each rank hashes its share of the files the manifest records
        (every world-th by name: a rank reads a share of the checkpoint, not all of it) and the ranks'
        findings are gathered, so that every rank refuses a damaged checkpoint before any of them
        loaded a byte of it: ``CheckpointDamaged`` naming the files (``SetupEnginesResult.damaged``: the
        training flow sets it aside and resumes from the newest intact one before it). A folder without
        a manifest (a caller that resumes an uncommitted folder: the training flow never does) and a
        manifest written before records were kept have nothing to compare with."""
        manifest = objectstore.join(uri, "MANIFEST.json")
        records = manifest_files(objectstore.read_json(manifest)) if objectstore.exists(manifest) else {}
        world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
        local = objectstore.local_folder(uri)
        damaged = []
        for file in sorted(f for f, record in records.items() if record is not None)[rank::world]:
            try:
                digest = file_digest(os.path.join(local, file))
            except OSError as e:
                damaged.append(f"{file} cannot be read ({objectstore.os_error(e)})")
                continue
            if digest != records[file]["sha256"]:
                damaged.append(f"{file} (SHA-256 {digest[:12]}…, its MANIFEST.json recorded {records[file]['sha256'][:12]}…)")
        if world > 1:
            gathered: list[list[str]] = [[] for _ in range(world)]
            dist.all_gather_object(gathered, damaged, group=distributed.metadata_group())
            damaged = sorted(d for share in gathered for d in share)
        if damaged:
            raise CheckpointDamaged(f"{uri}: has {len(damaged)} file(s) whose content is not what its MANIFEST.json "
                                    f"recorded: {'; '.join(damaged[:3])}")

    def load(self, trainer: Trainer, uri: str, critic=None) -> None:
        """Restore the trainer (and the critic) and this rank's RNG states from a committed checkpoint."""
        local = objectstore.local_folder(uri)
        trainer_dir = Path(local, f"trainer-{self.backend}")
        if not trainer_dir.is_dir():
            found = sorted(p.name for p in Path(local).glob("trainer-*"))
            raise ValueError(f"{uri}: no {trainer_dir.name}/ to resume train.backend={self.backend} from (found {found})")
        trainer.load_checkpoint(str(trainer_dir))
        if critic is not None:
            folder = Path(local, critic_dir(self.backend))
            if not folder.is_dir():
                raise ValueError(f"{uri}: no {folder.name}/ to resume the critic from: the checkpoint was written by a "
                                 "run whose train.algorithm has no critic; resume it with that algorithm")
            critic.load_checkpoint(str(folder))
        rng_uri = objectstore.join(uri, f"rng-{self._rank_then(uri)}.pt")
        rng = load_torch_file(io.BytesIO(objectstore.read_bytes(rng_uri)), rng_uri)
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])

    def _rank_then(self, uri: str) -> int:
        """The rank whose RNG states this rank takes: its own, or under another group size
        (``train.tensor_parallel x expert_parallel x pipeline_parallel x fsdp``) the same place in its group then, or the
        group's last rank then (a group's leader continues its leader's sampling)."""
        recorded = objectstore.join(uri, "layout.json")
        if not self.layout or not objectstore.exists(recorded):
            return self.rank
        was = objectstore.read_json(recorded)
        then = math.prod(was.get(key, 1) for key in ("tensor_parallel", "expert_parallel", "pipeline_parallel", "fsdp"))
        return self.layout.group(self.rank) * then + min(self.layout.local(self.rank), then - 1)

    def _recorded(self) -> dict:
        """What layout.json records of the ranks that write the checkpoint ({}: not known)."""
        if self.layout is None:
            return {}
        return {"dp": self.layout.dp, "tensor_parallel": self.layout.tp, "pipeline_parallel": self.layout.pp,
                "fsdp": self.layout.fsdp, "expert_parallel": self.layout.ep, "distributed_optimizer": self.distributed_optimizer,
                "reshardable_optimizer": self.reshardable_optimizer}

    def check_prompt_files(self, prompts_uri: str, checkpoint: str, field: str = "data.prompts") -> None:
        """The prompts a checkpoint was trained on must still be the first files of the dataset
        (``field`` names it in the error): the cursors it holds are positions in that order."""
        recorded = objectstore.join(checkpoint, "prompts.json")
        if not objectstore.exists(recorded):
            return  # a checkpoint written before this record existed
        for i, (name, rows) in enumerate(objectstore.read_json(recorded)["files"]):
            now = self.prompt_files[i] if i < len(self.prompt_files) else None
            if now != [name, rows]:
                found = f"'{now[0]}' ({now[1]} rows)" if now else "missing"
                raise ValueError(
                    f"{field} {prompts_uri}: part file {i + 1} (name order) was '{name}' ({rows} rows) when checkpoint "
                    f"{checkpoint} was written and is now {found}; the data cursors would point at other prompts. "
                    "Leave existing files as they are and add new prompts as new files that sort after them "
                    "(e.g. part-00001.parquet)."
                )

    def check_layout(self, checkpoint: str) -> None:
        """A checkpoint resumes under another layout where Megatron-Core's ``dist_checkpointing``
        reshards it: the model and the plain optimizer over any TP, PP and DP; the distributed
        optimizer's state over DP only unless it was saved with ``train.reshardable_optimizer``
        (engines/backends/megatron/optimizer.py: ``sharding``), and never into the plain optimizer
        or back. Else an error naming both."""
        recorded = objectstore.join(checkpoint, "layout.json")
        if self.backend != "megatron" or not objectstore.exists(recorded):
            return  # one file per rank that any layout reads; or written before this record existed
        was, now = objectstore.read_json(recorded), self._recorded()
        if not was or not now:
            return  # written or read without a layout (a test's own Checkpoints)
        if was["distributed_optimizer"] != now["distributed_optimizer"]:
            raise ValueError(f"checkpoint {checkpoint} was written with train.distributed_optimizer="
                             f"{str(was['distributed_optimizer']).lower()}, and its optimizer state loads only into the same "
                             f"kind of optimizer: resume with train.distributed_optimizer={str(was['distributed_optimizer']).lower()}")
        if was.get("expert_parallel", 1) != now["expert_parallel"]:
            raise ValueError(f"checkpoint {checkpoint} was written with train.expert_parallel={was.get('expert_parallel', 1)}: "
                             f"resume with train.expert_parallel={was.get('expert_parallel', 1)} (resharding the experts over "
                             "another expert-parallel size is not checked here)")
        sizes = [f"train.{key}={was.get(key, 1)}" for key in ("tensor_parallel", "pipeline_parallel")]
        if now["distributed_optimizer"] and not was.get("reshardable_optimizer") and \
                [was.get(k, 1) for k in ("tensor_parallel", "pipeline_parallel")] != [now["tensor_parallel"], now["pipeline_parallel"]]:
            raise ValueError(f"checkpoint {checkpoint} was written with {' and '.join(sizes)} and the distributed "
                             "optimizer, whose state it saved reshardable over the DP size only (train.reshardable_optimizer="
                             f"false): resume with {' and '.join(sizes)} (any dp)")


def export_policy(trainer: Trainer, critic, merged: bool, uri: str, upload: bool) -> None:
    """The trainer's policy as a Hugging Face folder at ``uri`` (MANIFEST.json last), with PPO's critic
    in its ``critic/`` (loadable as model.critic) and, if ``merged``, a LoRA adapter's merged model in
    its ``merged/``. Every rank of the first group calls it (they gather the weights: a collective
    with several); the one that ``upload``s writes. A sleeping trainer is read from its host copy."""
    with tempfile.TemporaryDirectory() as tmp:
        trainer.save_hf(tmp)
        if critic is not None:
            critic.save_hf(os.path.join(tmp, "critic"))
        if merged:
            trainer.save_merged(os.path.join(tmp, "merged"))
        if upload:
            objectstore.upload_folder(tmp, uri)


class BackgroundWrite:
    """One checkpoint write on a thread of its own; ``result()`` waits for it and re-raises its error."""

    def __init__(self, uri: str, write: Callable[[], dict[str, dict]]):
        self.uri, self.files, self.error, self.seconds = uri, None, None, None
        self._started = time.perf_counter()
        # a daemon: a host that shuts down (or fails) before the write was collected does not
        # wait for it; an uncollected checkpoint is never committed anyway
        self._thread = threading.Thread(target=self._run, args=(write,), name="checkpoint-writer", daemon=True)
        self._thread.start()

    def _run(self, write) -> None:
        try:  # Linux schedules threads one by one: where CPU is short, training goes first
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)  # (on 2 cores: step +30% instead of +100%)
        except (AttributeError, OSError):
            pass
        try:
            self.files = write()
        except BaseException as e:  # noqa: BLE001 - handed to whoever collects the write
            self.error = e
        finally:
            self.seconds = time.perf_counter() - self._started

    def result(self) -> dict:
        self._thread.join()
        if self.error is not None:  # its cause on the same line: the line a person reads last (a full disk, say)
            raise RuntimeError(f"checkpoint write to {self.uri} failed after {self.seconds:.2f}s: "
                               f"{type(self.error).__name__}: {self.error}") from self.error
        return {"uri": self.uri, "files": self.files, "write_s": self.seconds}


def to_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()

