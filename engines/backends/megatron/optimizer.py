"""The pieces a Megatron-Core engine that trains (the policy's ``MegatronTrainer``, PPO's
``MegatronCritic``) shares: its Adam, its ``dist_checkpointing`` save and load, and the repairs
Megatron 0.16's distributed optimizer over torch's AdamW needs to resume.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
from megatron.core.optimizer import USING_PYTORCH_OPTIMIZER, OptimizerConfig, get_megatron_optimizer

from engines.backends.torch import shards


def megatron_adam(ddp_model, config, lr: float, betas: tuple[float, float], weight_decay: float, grad_clip: float,
                  distributed_optimizer: bool):
    """``get_megatron_optimizer``'s Adam configured as ``TorchTrainer``'s AdamW (``config``: the
    model's ``TransformerConfig``, for its dtype)."""
    return get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=lr,
            min_lr=lr,
            weight_decay=weight_decay,
            adam_beta1=betas[0],
            adam_beta2=betas[1],
            adam_eps=1e-8,  # torch.optim.AdamW's default, as in TorchTrainer
            clip_grad=grad_clip,
            bf16=config.bf16,  # bf16 parameters, fp32 main copies in the optimizer
            params_dtype=config.params_dtype,
            use_distributed_optimizer=distributed_optimizer,
        ),
        [ddp_model],
        config_overrides={},  # decay every parameter, as TorchTrainer's AdamW does
    )


def needs_adam_repairs(distributed_optimizer: bool) -> bool:
    """Megatron without Transformer Engine or Apex steps torch's AdamW, whose distributed
    checkpoints need two repairs (:func:`load`)."""
    return distributed_optimizer and USING_PYTORCH_OPTIMIZER


def sharding(reshardable: bool) -> dict:
    """The distributed optimizer's checkpoint format (``train.reshardable_optimizer``). Megatron-Core
    0.16's default, 'fully_sharded_model_space', fails on save; 'dp_reshardable' has each rank
    write its own shard without communication and reshards over the DP size only;
    'fully_reshardable' gathers each TP x PP part's state over DP at save and reshards over TP and
    PP too. Recorded in the checkpoint (its content metadata), so a load reads what was written."""
    return {"distrib_optim_sharding_type": "fully_reshardable" if reshardable else "dp_reshardable"}


def sharded_state(ddp_model, optimizer, is_loading: bool = False, metadata: dict | None = None, **extra) -> dict:
    """Model and optimizer as ``dist_checkpointing`` shards, with ``extra`` (plain values)."""
    model = ddp_model.module.sharded_state_dict()
    optimizer_state = optimizer.sharded_state_dict(model, is_loading=is_loading, metadata=metadata or sharding(False))
    return {"model": model, "optimizer": optimizer_state, **extra}


def save(state: dict, path: Path, async_save: bool = False, metadata: dict | None = None):
    """``dist_checkpointing.save`` into ``path`` (new or empty), the replicated tensors split over
    the DP ranks (collective); an async request with ``async_save``. ``metadata``: the
    ``sharding`` the state was described with, recorded for the load."""
    path.mkdir(parents=True, exist_ok=True)
    if any(path.iterdir()):
        raise FileExistsError(f"{path}: checkpoint folder is not empty")
    strategy = FullyParallelSaveStrategyWrapper(
        get_default_save_sharded_strategy(), parallel_state.get_data_parallel_group(with_context_parallel=True)
    )
    return dist_checkpointing.save(state, str(path), strategy, async_sharded_save=async_save,
                                   content_metadata=metadata or sharding(False))


def load(ddp_model, optimizer, local_dir: str, repairs: bool) -> dict:
    """Restore model and optimizer from a whole checkpoint folder (collective); answers the loaded
    state (its extra values). ``repairs``: :func:`needs_adam_repairs`. The index is read first by
    ``shards.read_index`` (the classes of an index only): Megatron's reader unpickles anything."""
    shards.read_index(local_dir)
    if repairs:
        _materialise_adam_state(optimizer)
    written = dist_checkpointing.load_content_metadata(str(local_dir)) or sharding(False)  # (older checkpoints: none)
    state = dist_checkpointing.load(sharded_state(ddp_model, optimizer, is_loading=True, metadata=written), str(local_dir))
    ddp_model.module.load_state_dict(state["model"])
    with torch.no_grad(), _steps_set_later(optimizer, repairs):  # the distributed optimizer copies into views of the parameters
        optimizer.load_state_dict(state["optimizer"])
    if repairs:
        _repair_adam_steps(optimizer, state["optimizer"]["optimizer"]["param_groups"][0]["step"])
    return state


@contextlib.contextmanager
def _steps_set_later(optimizer, repairs: bool):
    """Megatron 0.16's DistributedOptimizer loading a fully reshardable state into torch's AdamW
    copies every key of the parameter's Adam state from the checkpoint, whose state has no
    ``step`` (torch's AdamW keeps one per parameter): a zero stands in, and
    :func:`_repair_adam_steps` sets the real count after the load."""
    patched = [chained for chained in optimizer.chained_optimizers
               if repairs and hasattr(chained, "_set_main_param_and_optimizer_states")]
    for chained in patched:
        setter = chained._set_main_param_and_optimizer_states
        chained._set_main_param_and_optimizer_states = (
            lambda param, tensors, setter=setter: setter(param, {"step": torch.zeros(()), **tensors}))
    try:
        yield
    finally:
        for chained in patched:
            del chained._set_main_param_and_optimizer_states


def _materialise_adam_state(optimizer) -> None:
    """Zero Adam state (step 0) where none exists yet. Megatron 0.16's DistributedOptimizer over
    torch's AdamW (no Transformer Engine or Apex) asserts that its parameters share one step
    count when it describes its state for loading, so an optimizer that never stepped cannot
    load a checkpoint; the checkpoint overwrites these zeros."""
    for chained in optimizer.chained_optimizers:
        inner = chained.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                if not inner.state[p]:
                    inner.state[p] = {
                        "step": torch.tensor(0.0),
                        "exp_avg": torch.zeros_like(p),
                        "exp_avg_sq": torch.zeros_like(p),
                    }


def _repair_adam_steps(optimizer, step: float) -> None:
    """Megatron 0.16's DistributedOptimizer over torch's AdamW restores every parameter's step
    count from the pre-load state (not the checkpoint) and into one tensor shared by all
    parameters, which torch's AdamW then increments once per parameter."""
    for chained in optimizer.chained_optimizers:
        for param_state in chained.optimizer.state.values():
            param_state["step"] = torch.tensor(float(step))


def files_under(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())
