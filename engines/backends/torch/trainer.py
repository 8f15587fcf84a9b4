"""``TorchTrainer``: policy training (every algorithm of ``engines/rl``) with transformers, the CPU
default and the numerical reference.

It trains the policy with data parallelism over ``torch.distributed`` (gloo on CPU, NCCL on
GPUs) and speaks Hugging Face parameter names, so the Megatron-Core backend can take its place
behind the same methods. It runs on the device it is given (default: the current CUDA device,
else the CPU), with model, buffers and optimizer state there; on CUDA with the fused AdamW.
"""

from __future__ import annotations

import contextlib
import copy as copy_module
import json
import os
from typing import Iterator

import torch
import torch.distributed as dist
from torch.profiler import record_function

from engines.backends import multimodal
from engines.backends.base import FrozenCheckpoint, TrainBatch, load_torch_file, report_progress
from engines.backends.batching import Packed, pad_batch, pad_weights, packed_routes, padded_routes, response_values
from engines.backends.torch import fsdp, lora as lora_adapter, routing
from engines.backends.torch.model import (forward_precision, is_vision_tower, load_model, packed_logprobs, packing_refusal,
                                          resolve_device, sequence_logprobs)
from engines.rl import registry
from engines.rl.base import AlgorithmConfig
from engines.rl.loss_step import LossStep

SHARDED_RECORD = "trainer.json"  # beside a sharded checkpoint's files: its version (and LoRA base), written by rank 0


class TorchTrainer:
    """Policy training with an algorithm's loss; data parallel when ``torch.distributed`` is initialised.

    Gradients are summed with one all-reduce over a flat buffer, and the loss of every
    rank is normalised by the *global* token (or sequence) count, so each replica takes
    exactly the step one process would take on the concatenated batch. Both all-reduces are of
    tensors on ``device``, over the default group (NCCL on CUDA: ``engines/backends/distributed.py``).

    ``device`` and ``autocast``: as for :class:`TorchGenerator`; the reference model lives there
    too, and on CUDA the optimizer is the fused AdamW (its state is created on the device).

    ``shards`` (``train.fsdp``): the ranks of each DP group the model, its gradients and Adam state
    are sharded over with FSDP2, each training its share of the group's rows (``fsdp.py``).

    ``lora`` (``train.lora``): train a LoRA adapter only (``engines/backends/torch/lora.py``): the
    optimizer, checkpoints and ``save_hf`` hold the adapter, ``export_weights`` the merged weights,
    and the KL reference is the policy with its adapter disabled (no second copy); ``seed``: the
    adapter's initialisation, the same on every replica.

    ``packed``: forward passes over packed micro-batches (``batching.packed_micro_batches``: rows end to
    end, positions restarting per row, attention block-diagonal; docs/engines.md), the policy's, the
    reference's and :meth:`logprobs`'s; a family that cannot pack (``model.packing_refusal``: a
    vision-language model, linear attention) runs padded passes, and ``packing`` says why.
    """

    def __init__(
        self,
        model_dir: str,
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        grad_clip: float = 1.0,
        temperature: float = 1.0,
        reference: bool = False,
        dtype: str = "float32",
        device: torch.device | str | None = None,
        autocast: bool | None = None,
        freeze_vision: bool = True,
        lora=None,
        seed: int = 0,
        shards: int = 1,
        router_replay: bool = False,
        router_balance: float = 0.0,
        packed: bool = True,
    ):
        self.device = resolve_device(device)
        self.autocast = autocast
        # sharded, the model is read into host memory and each rank's device takes its shards only
        # (fsdp.shard); a policy larger than one device never is whole on one
        on = self.device if shards == 1 else torch.device("cpu")
        self.tokenizer, self.model, self.processor = load_model(model_dir, dtype, on)
        self.lora = None  # with train.lora: what a checkpoint records of the base (lora_adapter.base_record)
        if lora is not None:
            self.model = lora_adapter.wrap(self.model, lora, freeze_vision and self.processor is not None, seed)
            self.lora = lora_adapter.base_record(model_dir, lora)
        # why this policy trains padded (None: packed; packed=False: asked for)
        self.packing = packing_refusal(self.model.config, vision=self.processor is not None) if packed else "packed=False"
        self.model.train()
        # the KL reference: a second copy of the policy, or with LoRA the policy with its adapter disabled
        self.reference = load_model(model_dir, dtype, on)[1].eval() if reference and lora is None else None
        # a vision model's image tokens are never sampled: outside the policy's distribution here too
        self.banned = multimodal.image_token_ids(self.processor) if self.processor is not None else None
        if self.processor is not None and freeze_vision and lora is None:
            for name, p in self.model.named_parameters():
                if is_vision_tower(name):
                    p.requires_grad_(False)
        if router_replay:
            routing.check_replayable(self.model, model_dir)
        self.router_replay, self.router_balance = router_replay, router_balance
        self.routes = routing.shape(self.model) if routing.routers(self.model) else None  # (MoE layers, experts per token)
        self.routed = self.routes is not None  # a mixture of experts: its load balance is a step figure
        self.mesh = None  # with train.fsdp > 1: the replicate x shard mesh the model is sharded over
        if shards > 1:
            self.mesh = fsdp.mesh(shards, self.device)
            for model in filter(None, (self.model, self.reference)):
                fsdp.shard(model, self.mesh, self.device, whole=self._frozen_tower(model))
        # fused: one kernel for all parameters on CUDA; on the CPU torch's default, as always
        fused = True if self.device.type == "cuda" else None
        trained = [p for p in self.model.parameters() if p.requires_grad]
        self._trained_names = [n for n, p in self.model.named_parameters() if p.requires_grad]  # the optimizer's order
        self.optimizer = torch.optim.AdamW(trained, lr=lr, betas=betas, weight_decay=weight_decay, fused=fused)
        self.grad_clip = grad_clip
        self.temperature = temperature
        self.version = 0  # optimizer steps taken: the policy version rollouts are stamped with
        self._staged: dict | None = None  # the last checkpoint's host copy, whose buffers the next one reuses

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

    def _frozen_tower(self, model: torch.nn.Module) -> set[torch.nn.Parameter]:
        """A vision-language model's vision tower, which FSDP leaves whole on every rank (``fsdp.shard``):
        it must be frozen, since nothing would reduce its gradients."""
        if self.processor is None:
            return set()
        tower = {name: p for name, p in model.named_parameters() if is_vision_tower(name)}
        if model is self.model and any(p.requires_grad for p in tower.values()):
            raise ValueError("train.fsdp > 1 keeps a vision-language policy's vision tower whole on every rank, frozen: "
                             "set train.freeze_vision=true (the default), or train.fsdp=1 to train the tower")
        return set(tower.values())

    def _global_sums(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        if self.distributed:
            dist.all_reduce(t)
        return t.tolist()

    def _all_reduce_grads(self) -> None:
        all_reduce_grads(self.model, self.distributed)

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch) -> list[list[float]]:
        """The trainer's log-probabilities of each response token under the current weights."""
        if not len(batch):
            return []
        inputs = self._inputs(batch)
        # with LoRA in eval mode: adapter dropout would make these random
        mode = lora_adapter.eval_mode(self.model) if self.lora is not None else contextlib.nullcontext()
        with forward_precision(self.device, self.autocast), mode, self._replaying(batch, inputs):
            lp = self._logprobs(self.model, inputs)
        return response_values(lp, batch)

    def train_step(
        self,
        batch: TrainBatch,
        algorithm: AlgorithmConfig | None = None,
        minibatches: int = 1,
        micro_batch_tokens: int | None = None,
    ) -> dict[str, float]:
        """One rollout batch → ``minibatches`` optimizer steps (identical count on every rank).

        ``algorithm``: whose loss to take (``engines/rl``; default: GRPO with DAPO's settings); the
        trainer owns the passes and the all-reduces, :class:`LossStep` the loss and statistics.
        ``micro_batch_tokens``: each minibatch's forward/backward runs in length-sorted passes of
        at most this many padded tokens (see :func:`micro_batches`), gradients accumulating
        before the one all-reduce and optimizer step; the loss weights use the whole minibatch's
        DP-global counts, so the update is the one-pass update (up to float summation order)
        while the compute follows tokens rather than rows x longest row. None: one pass.
        Returns ``loss``, ``grad_norm``, ``tokens`` and the algorithm's statistics per trained token."""
        algorithm = algorithm if algorithm is not None else registry.DEFAULT()
        step = LossStep(algorithm, batch.advantages, self._global_sums)
        loss_total, tokens, grad_norm, balance = 0.0, 0.0, 0.0, 0.0
        pixel_cache = multimodal.PixelCache(self.processor) if self.processor is not None else None  # this step's images
        for part in batch.split(minibatches, step.unit):
            self.optimizer.zero_grad(set_to_none=True)
            # FSDP: this rank's share of the group's rows, and as many passes as the group's busiest rank
            # (each pass's all-gathers are the group's)
            mine, passes, real = fsdp.passes(part, micro_batch_tokens, step.unit, self.mesh, self.device,
                                             self.tokenizer.pad_token_id, packed=self.packing is None)
            (total,) = self._global_sums([step.count(mine)])
            loss_value = 0.0
            for k, micro in enumerate(passes):
                report_progress()  # the host's heartbeat: a long train step is moving
                if self.mesh is not None:
                    fsdp.sync_gradients(self.model, now=k == len(passes) - 1)
                # the named regions are what a profile of the step shows (bench/train_step.py)
                with record_function("pad_batch"):  # the loss's rows (padded) and the forward's inputs (packed or padded)
                    _, _, resp, old = (t.to(self.device) for t in pad_batch(micro, self.tokenizer.pad_token_id))
                    inputs = self._inputs(micro, step.unit, pixel_cache)
                with record_function("forward"), forward_precision(self.device, self.autocast), \
                        self._replaying(micro, inputs), self._router_logits() as router_logits:  # the loss: fp32 either way
                    logprobs = self._logprobs(self.model, inputs)
                    ref = None
                    if algorithm.needs.reference and (self.reference is not None or self.lora is not None):
                        with torch.no_grad(), self._reference() as reference:
                            ref = self._logprobs(reference, inputs)
                with record_function("loss"):
                    # global ``total`` (not this pass's own count): the passes' losses sum to the minibatch's
                    loss = step(logprobs, old, micro.advantages, resp, total, ref, pad_weights(micro)) if k < real \
                        else logprobs.sum() * 0.0  # a filler pass
                    if router_logits:  # the router's load balance over the pass's tokens, its share of the minibatch by rows
                        share = len(micro) / max(len(mine), 1) if k < real else 0.0
                        with torch.set_grad_enabled(self.router_balance > 0):  # else a figure only
                            aux = routing.balance_loss(router_logits, inputs["tokens"], self.routes[1]) * share
                        if self.router_balance:
                            loss = loss + self.router_balance * aux
                        balance += aux.item() / minibatches
                with record_function("backward"):
                    loss.backward()  # accumulates into .grad
                loss_value += loss.item()
            if self.mesh is None:  # FSDP reduced them in the last backward pass
                with record_function("all_reduce"):
                    self._all_reduce_grads()
            with record_function("optimizer"):
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
                self.optimizer.step()
            loss_total += self._global_sums([loss_value])[0]
            tokens += float(sum(part.trained_tokens()))
            grad_norm = float(fsdp.full(grad_norm))
        self.version += 1
        if self.mesh is not None:  # each rank's statistics are of its rows: the group's are their sums
            step.add_up(lambda values: fsdp.group_sums(values, self.mesh, self.device))
        figures = {"router_balance": balance} if self.routed else {}
        return step.result(tokens, loss=loss_total, grad_norm=grad_norm, **figures)

    def _inputs(self, batch: TrainBatch, unit: int = 1, pixel_cache=None) -> dict:
        """What a forward pass over ``batch`` takes: its packed layout (``packed``), or its padded ``ids``
        and ``attn`` and a vision-language policy's ``pixels``; and ``tokens``, 1 on the rows' tokens."""
        if self.packing is None:
            packed = Packed(batch, self.tokenizer.pad_token_id, unit).to(self.device)
            return {"packed": packed, "tokens": packed.real}
        ids, attn, _, _ = (t.to(self.device) for t in pad_batch(batch, self.tokenizer.pad_token_id))
        pixels = multimodal.pixels(self.processor, batch, self.device, pixel_cache, ids)
        return {"ids": ids, "attn": attn, "pixels": pixels, "tokens": attn}

    def _logprobs(self, model, inputs: dict) -> torch.Tensor:
        """``model``'s log-probabilities of a pass (:meth:`_inputs`) in the rows' padded layout [rows, width - 1]."""
        if "packed" in inputs:
            return packed_logprobs(model, inputs["packed"], self.temperature, self.banned)
        return sequence_logprobs(model, inputs["ids"], inputs["attn"], self.temperature, inputs["pixels"], self.banned)

    def _replaying(self, batch: TrainBatch, inputs: dict):
        """The forward's routers take the rollout's experts (``train.router_replay`` and a batch that
        has them; ``routing``), laid out as the pass's tokens, else their own."""
        if not self.router_replay or batch.routed_experts is None:
            return contextlib.nullcontext()
        if "packed" in inputs:
            return routing.replaying(self.model, packed_routes(batch.routed_experts, inputs["packed"], *self.routes))
        return routing.replaying(self.model, padded_routes(batch.routed_experts, inputs["ids"].shape[1], *self.routes))

    def _router_logits(self):
        """A MoE policy's router logits of the forward, for its load-balance figure and loss (else nothing kept)."""
        return routing.router_logits(self.model) if self.routed else contextlib.nullcontext([])

    def _reference(self):
        """The KL reference model, for a ``with`` block."""
        if self.lora is not None:
            return lora_adapter.base_model_of(self.model)
        return contextlib.nullcontext(self.reference)

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Hugging Face-named tensors, for a generator's ``update_weights``; with LoRA the merged
        weights under the base model's names."""
        if self.lora is not None:
            yield from lora_adapter.merged(self.model, self.model.get_base_model().named_parameters())
            return
        for name, p in self.model.named_parameters():
            yield name, fsdp.full(p.detach())  # sharded: gathered one parameter at a time (collective)

    def local_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The parameters this rank holds (see ``base.Trainer``): sharded, each one's local shard
        (``DTensor.to_local``), else whole; with LoRA the peft model's, base and adapter."""
        for name, p in self.model.named_parameters():
            p = p.detach()
            yield name, p.to_local() if hasattr(p, "to_local") else p  # a DTensor: this rank's shard

    def sleep(self) -> None:  # resident, as TorchGenerator
        pass

    def wake(self) -> None:
        pass

    def freeze_checkpoint(self, local_dir: str, copy: bool, hf_weights: bool = True) -> FrozenCheckpoint:
        """This rank's checkpoint as it is now: with ``copy``, model, optimizer and version copied
        into host memory (rank 0; reusing the last copy's buffers), serialised by ``write`` on any
        thread; without, ``write`` saves the live state (call it at once). Replicas are equal, so
        the copy's model is also the policy's Hugging Face weights. Sharded, every rank's shards are
        written now, and with ``copy`` the Hugging Face weights copied to rank 0's host memory."""
        if self.mesh is not None:  # every rank writes its shards now (a collective: on this thread); write lists them
            written = self.save_checkpoint(local_dir)
            return FrozenCheckpoint(lambda: written, self._hf_copy() if copy and hf_weights else None)
        state = None
        if copy:
            state = self._staged = self.checkpoint_state(into=self._staged)
            if state is None:  # a rank that writes nothing; nothing collective may run on the writer's thread
                return FrozenCheckpoint(lambda: [], None)
        return FrozenCheckpoint(lambda: self.save_checkpoint(local_dir, state), state["model"] if state is not None else None)

    def _hf_copy(self) -> dict[str, torch.Tensor] | None:
        """Sharded: the policy's Hugging Face weights (with LoRA the adapter's) in rank 0's host
        memory, gathered one tensor at a time (collective over the group); None elsewhere."""
        named = ((n, fsdp.full(p.detach())) for n, p in lora_adapter.adapter_state(self.model).items()) \
            if self.lora is not None else self.export_weights()
        keep = dist.get_rank() == 0
        copies = {name: tensor.to("cpu", copy=True) for name, tensor in named if keep}
        return copies if keep else None

    def checkpoint_state(self, into: dict | None = None) -> dict | None:
        """A copy of model, optimizer and version in host memory, to write later (on any thread)
        while training goes on: the next ``train_step`` changes parameters and Adam moments in
        place, never the copy. ``into``: an earlier copy that nobody reads any more, whose tensors
        are overwritten instead of allocating new ones (copying into memory that is already mapped
        is several times faster). None on ranks that write nothing (see :meth:`save_checkpoint`).
        """
        state = self._live_state()
        if self.distributed and dist.get_rank() != 0:
            return None
        return copy_state(state, into)

    def _live_state(self) -> dict:
        """What a checkpoint holds: model (with LoRA: the adapter, and the base it adapts), optimizer, version."""
        model = lora_adapter.adapter_state(self.model) if self.lora is not None else self.model.state_dict()
        return {"model": model, "optimizer": self.optimizer.state_dict(), "version": self.version} | \
            ({"lora": self.lora} if self.lora else {})

    def save_checkpoint(self, local_dir: str, state: dict | None = None) -> list[str]:
        """Model, optimizer and version into ``local_dir``; returns the files this rank wrote.

        ``state``: a copy from :meth:`checkpoint_state` to write instead of the live state.
        Replicas are identical, so rank 0 writes everything and the others nothing. Sharded
        (``train.fsdp``), every rank writes its shards (``shards.py``, a collective) and rank 0
        ``trainer.json`` (the version, and with LoRA the base it adapts).
        """
        if self.mesh is not None:
            from engines.backends.torch import shards

            files = shards.save(self.model, self.optimizer, local_dir, frozen=self.lora is None)
            if dist.get_rank() == 0:
                with open(os.path.join(local_dir, SHARDED_RECORD), "w") as f:
                    json.dump({"version": self.version} | ({"lora": self.lora} if self.lora else {}), f)
                files.append(SHARDED_RECORD)
            return files
        if state is None:
            state = self._live_state()
        if self.distributed and dist.get_rank() != 0:
            return []
        os.makedirs(local_dir, exist_ok=True)
        torch.save(state, os.path.join(local_dir, "trainer.pt"))
        return ["trainer.pt"]

    def load_checkpoint(self, local_dir: str) -> None:
        """Either kind of checkpoint, into either layout: ``trainer.pt`` (whole, one rank wrote it) or
        sharded files (``train.fsdp``; collective when distributed)."""
        if not os.path.exists(os.path.join(local_dir, "trainer.pt")):
            return self._load_shards(local_dir)
        # read into host memory (a checkpoint may come from another device); load_state_dict
        # copies into the parameters, and the optimizer moves its state to theirs
        state = load_torch_file(os.path.join(local_dir, "trainer.pt"), os.path.join(local_dir, "trainer.pt"), map_location="cpu")
        self._check_lora(state, local_dir)
        if self.lora is not None:
            lora_adapter.check_adapter_state(self.model, state["model"], local_dir)
        # the optimizer's state by index (one rank wrote it) or by name (a sharded trainer did, before sharded files)
        optimizer = state["optimizer"]
        named = any(isinstance(p, str) for g in optimizer["param_groups"] for p in g["params"])
        if self.mesh is not None:  # with LoRA the model's state is the adapter's only
            fsdp.load_full_state(self.model, self.optimizer, state["model"],
                                 optimizer if named else fsdp.by_name(optimizer, self._trained_names), strict=self.lora is None)
        else:
            self.model.load_state_dict(state["model"], strict=self.lora is None)
            self.optimizer.load_state_dict(fsdp.by_index(optimizer, self._trained_names) if named else optimizer)
        self.version = state["version"]

    def _load_shards(self, local_dir: str) -> None:
        from engines.backends.torch import shards

        record_path = os.path.join(local_dir, SHARDED_RECORD)
        if not shards.is_sharded(local_dir) or not os.path.exists(record_path):
            raise ValueError(f"{local_dir}: neither trainer.pt nor the sharded files ({shards.INDEX}, {SHARDED_RECORD}) of a "
                             "torch trainer's checkpoint")
        with open(record_path) as f:
            record = json.load(f)
        self._check_lora(record, local_dir)
        if self.lora is not None:
            lora_adapter.check_adapter_state(self.model, dict.fromkeys(shards.names(local_dir)), local_dir)
        shards.load(self.model, self.optimizer, local_dir, frozen=self.lora is None)
        self.version = int(record["version"])

    def _check_lora(self, state: dict, local_dir: str) -> None:
        if ("lora" in state) != (self.lora is not None):
            raise ValueError(f"train.lora: checkpoint {local_dir} was trained {'with' if 'lora' in state else 'without'} LoRA "
                             f"and this run is {'with' if self.lora is not None else 'without'}: set train.lora as it was")
        if self.lora is not None:
            lora_adapter.check_base(state["lora"], self.lora, local_dir)

    def save_hf(self, local_dir: str, tensors: dict[str, torch.Tensor] | None = None) -> None:
        """The policy as a Hugging Face folder; ``tensors``: Hugging Face-named weights to write
        instead of the live ones (the ``model`` part of a :meth:`checkpoint_state` copy). With LoRA
        the adapter folder (``tensors``: adapter tensors), which peft loads onto the policy folder."""
        if self.lora is not None:
            if tensors is None and self.mesh is not None:  # gathered (collective over the group)
                tensors = {name: fsdp.full(t.detach()) for name, t in lora_adapter.adapter_state(self.model).items()}
            lora_adapter.save_adapter(self.model, local_dir, tensors)
        else:
            if tensors is None and self.mesh is not None:
                tensors = dict(self.export_weights())  # gathered (collective over the group)
            # save_pretrained drops keys from the dict it is given (tied weights): give it its own
            self.model.save_pretrained(local_dir, safe_serialization=True, state_dict=dict(tensors) if tensors is not None else None)
        (self.processor or self.tokenizer).save_pretrained(local_dir)

    def save_merged(self, local_dir: str) -> None:
        """With LoRA: the merged model (W + B A * alpha / r) as a Hugging Face folder of the base's
        architecture, loadable without peft."""
        if self.lora is None:
            raise ValueError("save_merged: this trainer has no LoRA adapter (train.lora is not set); save_hf writes the model")
        self.model.get_base_model().save_pretrained(local_dir, safe_serialization=True,
                                                    state_dict=lora_adapter.merged_state_dict(self.model))
        (self.processor or self.tokenizer).save_pretrained(local_dir)


def all_reduce_grads(model: torch.nn.Module, distributed: bool) -> None:
    """Sum the trained parameters' gradients over the DP groups, with one all-reduce of a flat buffer."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:  # every rank steps every parameter (AdamW's weight decay included)
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if not distributed:  # nothing to add: no flat copy of every gradient (GBs on a large model)
        return
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat)
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat[offset : offset + n].view_as(p).clone()
        offset += n


def copy_state(obj, into=None):
    """A deep copy of a nested state (dicts, lists, tuples, tensors, plain values) with every
    tensor copied to host memory. Tensors that share memory in ``obj`` (tied weights) share it
    in the copy. Where ``into`` (an earlier copy of the same structure) has a tensor of the same
    shape and dtype at the same place, the data is copied into it rather than into a new one."""
    reusable: dict[tuple, torch.Tensor] = {}

    def collect(node, path):
        if isinstance(node, torch.Tensor):
            reusable[path] = node
        elif isinstance(node, dict):
            for k, v in node.items():
                collect(v, path + (k,))
        elif isinstance(node, (list, tuple)):
            for i, v in enumerate(node):
                collect(v, path + (i,))

    if into is not None:
        collect(into, ())
    shared: dict[tuple, torch.Tensor] = {}

    def walk(node, path):
        if isinstance(node, torch.Tensor):
            node = node.detach()
            key = (node.untyped_storage().data_ptr(), node.storage_offset(), tuple(node.shape), node.stride(), node.dtype, node.device)
            if node.numel() and key in shared:
                return shared[key]
            old = reusable.get(path)
            if old is not None and old.shape == node.shape and old.dtype == node.dtype and old.stride() == node.stride():
                copy = old.copy_(node)
            else:
                copy = node.to("cpu", copy=True)
            shared[key] = copy
            return copy
        if isinstance(node, dict):
            out = type(node)((k, walk(v, path + (k,))) for k, v in node.items())
            if hasattr(node, "_metadata"):  # a module's state_dict keeps its modules' versions here
                out._metadata = copy_module.deepcopy(node._metadata)
            return out
        if isinstance(node, (list, tuple)):
            return type(node)(walk(v, path + (i,)) for i, v in enumerate(node))
        return copy_module.deepcopy(node)

    return walk(obj, ())
