"""The Megatron trainer's passes on Megatron-Core's schedules: one code path for every layout.

A DP group is ``tensor_parallel x pipeline_parallel`` ranks (engines/config/layout.py); each
pipeline stage holds a run of the policy's layers (``model.build_gpt``), the first the embedding,
the last the final norm and output layer. Every rank of the group is given the whole batch (the
controller fans each request out to all of them: engines/wire/channel.py) and cuts it into the
same micro-batches, so the stages agree on what flows between them without being told.
``schedule`` hands the micro-batches to ``get_forward_backward_func``: with one stage Megatron's
loop without pipelining, with several its 1F1B schedule (each stage runs forward passes ahead
until the pipeline is full, then alternates one forward and one backward; activations and their
gradients go point-to-point between neighbouring stages, their shapes sent first since token-cut
micro-batches differ). What only the last stage computes — log-probs, the loss, the step's
statistics — ``from_last_stage`` broadcasts to the group's other stages, so each rank answers
the controller alike. ``whole_parameters`` gathers the model for export: TP shards within a
stage, then each stage's parameters to the others, a mixture's experts from every expert-parallel
rank, one parameter at a time.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, NamedTuple

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from engines.backends import multimodal
from engines.backends.base import TrainBatch, report_progress
from engines.backends.batching import pad_batch, padded_routes
from engines.backends.megatron import routing
from engines.backends.megatron.mapping import global_expert, global_name


class Padded(NamedTuple):
    """A micro-batch on the device: right-padded ids, response mask and old log-probs (as ``pad_batch``)."""

    ids: torch.Tensor
    response: torch.Tensor
    old: torch.Tensor


# take(micro, padded, read, k): on the last stage, what a pass yields — the loss to backpropagate
# (training) or what to keep (forward only); ``read`` is what the trainer reads off the last stage's
# output (the policy's token log-probs, a critic's values); k is the micro-batch's index
Take = Callable[[TrainBatch, Padded, torch.Tensor, int], Any]


def schedule(trainer, model, micros: list[TrainBatch], take: Take, forward_only: bool, pixel_cache=None) -> list:
    """Run ``model`` (the policy, the reference or a critic) over ``micros`` on this rank's stage.
    Training accumulates gradients in DDP's buffers and ends with ``config.finalize_model_grads_func``
    (the all-reduce); forward only returns what ``take`` kept. Returns ``take``'s value per
    micro-batch, in order, on the last stage; nothing on the others. ``trainer`` gives the stage's
    ``_forward(model, ids, pixels)``, what to read off the last stage's output, ``_read(output, ids)``,
    and the id its rows are padded with, ``pad_id``."""
    if not micros:
        return []
    device, first = trainer.device, parallel_state.is_pipeline_first_stage()

    def forward_step(items, chunk):
        k, micro = next(items)
        report_progress()  # the host's heartbeat: a long train step is moving (engines/wire/channel.py)
        ids, _, response, old = (t.to(device) for t in pad_batch(micro, trainer.pad_id))
        padded = Padded(ids, response, old)
        if trainer.replays is not None and model is trainer.model:  # the policy replays the rollout's routes
            routing.set_routes(trainer.replays, None if micro.routed_experts is None else padded_routes(
                micro.routed_experts, ids.shape[1], len(trainer.replays), trainer.config.moe_router_topk))
        pixels = multimodal.pixels(trainer.processor, micro, device, pixel_cache) if first else None  # the tower's stage
        output = trainer._forward(chunk, ids, pixels)

        def loss_func(logits, non_loss_data=False):
            value = take(micro, padded, trainer._read(logits, ids), k)
            if forward_only:
                return value
            # (loss, tokens, what the schedule collects): the token count is only the schedule's
            # bookkeeping here (finalize_model_grads_func ignores it: LossStep normalised already)
            return value, torch.zeros((), dtype=torch.int, device=device), value.detach()

        return output, loss_func

    rows = [len(p) + len(r) for p, r in zip(micros[0].prompt_ids, micros[0].response_ids)]
    return get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(enumerate(micros)), model=model,
        num_microbatches=len(micros), seq_length=max(rows), micro_batch_size=len(rows),  # shapes: sent per pass
        forward_only=forward_only, collect_non_loss_data=forward_only,
    )


def from_last_stage(value, device: torch.device):
    """``value`` as the last pipeline stage has it, on every stage of this rank's pipeline (collective)."""
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                               group=parallel_state.get_pipeline_model_parallel_group(),
                               device=device if device.type == "cuda" else None)
    return box[0]


def whole_parameters(trainer) -> Iterator[tuple[str, list[torch.Tensor]]]:
    """(the whole model's Megatron name, every TP rank's shard) of each parameter, stage by stage,
    on every rank of the group (collective: TP all-gathers within a stage, broadcasts over the
    pipeline, and an expert's parameter gathers over the expert-parallel group: each rank's
    counterpart comes under its own whole-model name). From the host copy while the trainer
    sleeps. A tied output layer on the last stage is the first stage's embedding: it is left to
    the embedding."""
    tp_group, tp_size = parallel_state.get_tensor_model_parallel_group(), parallel_state.get_tensor_model_parallel_world_size()
    pp_group, pp_size = parallel_state.get_pipeline_model_parallel_group(), parallel_state.get_pipeline_model_parallel_world_size()
    mine = parallel_state.get_pipeline_model_parallel_rank()
    offset = get_transformer_layer_offset(trainer.config) if pp_size > 1 else 0
    # (a critic's folder is mapped as a tied model's, but its output layer is its own value head)
    tied = getattr(trainer.model.module, "share_embeddings_and_output_weights", trainer.text_config.tie_word_embeddings)
    own = {global_name(n, offset): p for n, p in trainer.model.module.named_parameters()
           if not (tied and n == "output_layer.weight")}
    device = trainer.device
    ep_group, ep_size = parallel_state.get_expert_model_parallel_group(), parallel_state.get_expert_model_parallel_world_size()
    if ep_size > 1 and (tp_size > 1 or pp_size > 1):  # transformer_config refuses a mixture at TP or PP > 1
        raise NotImplementedError("whole_parameters: expert parallelism beside tensor or pipeline parallelism")
    for stage in range(pp_size):
        source = dist.get_global_rank(pp_group, stage) if pp_size > 1 else None
        listing = [(n, tuple(p.shape), p.dtype, tp_size > 1 and getattr(p, "tensor_model_parallel", False))
                   for n, p in own.items()] if stage == mine else None
        if pp_size > 1:
            box = [listing]
            dist.broadcast_object_list(box, src=source, group=pp_group, device=device if device.type == "cuda" else None)
            listing = box[0]
        for name, shape, dtype, split in listing:
            if stage == mine:
                local = trainer._offload.host_view(own[name].detach())
                if (tp_size > 1 or pp_size > 1 or ep_size > 1) and local.device != device:
                    local = local.to(device)  # the groups' backend moves device tensors (one parameter at a time)
                shards = [local.contiguous()]
                if split:
                    shards = [torch.empty_like(local) for _ in range(tp_size)]
                    dist.all_gather(shards, local.contiguous(), group=tp_group)
            else:
                shards = [torch.empty(shape, dtype=dtype, device=device) for _ in range(tp_size if split else 1)]
            for shard in shards if pp_size > 1 else ():
                dist.broadcast(shard, src=source, group=pp_group)
            if ep_size > 1 and not getattr(own[name], "allreduce", True):  # an expert's: every EP rank's counterpart
                parts = [torch.empty_like(shards[0]) for _ in range(ep_size)]
                dist.all_gather(parts, shards[0], group=ep_group)
                for rank, part in enumerate(parts):
                    yield global_expert(name, trainer.text_config, rank, ep_size), [part]
                continue
            yield name, shards
