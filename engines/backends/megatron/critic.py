"""``MegatronCritic``: PPO's value model on Megatron-Core, a drop-in for ``TorchCritic``
(``engines/backends/torch/critic.py``: same methods, same values and loss to float tolerance).

The ``model.critic`` folder's transformer is built as the policy's is (``model.build_gpt``, the
``mapping.py`` tables), and its vocabulary output layer is replaced by a scalar value head, as
veRL's Megatron critic does (``LinearForLastLayer(hidden, 1)`` put in ``GPTModel.output_layer``):
``GPTModel.forward`` then returns values instead of logits. The head is zero-initialised as the
torch critic's (every replica starts the same; the first values are 0), or read from an exported
critic's ``score.*`` (``engines/backends/value_head.py``; veRL loads ``score.weight`` the same way).
The transformer is mapped as a tied model's, whose name table has no output layer, so a folder's
``lm_head.weight`` is left out and nothing of vocabulary size is allocated for the head.

It splits over the policy's layout, ``tensor_parallel x pipeline_parallel``: each pipeline stage
holds a run of the layers, the last the value head, and its passes run on Megatron-Core's schedules
as the policy's do (``pipeline.schedule``; the last stage computes values and the loss, and
``pipeline.from_last_stage`` hands them to the other stages). Its own Megatron Adam
(``critic_lr``), wrapped in Megatron's DDP and all-reduced with ``finalize_model_grads`` as the
policy's; ``sleep``/``wake`` through ``offload.py`` (full colocation); checkpoints with
``dist_checkpointing`` like ``MegatronTrainer``'s (every rank writes its shards, exact resume).
Methods are collective as ``MegatronTrainer``'s.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from transformers import AutoConfig, AutoTokenizer

from engines.backends import value_head
from engines.backends.base import FrozenCheckpoint, TrainBatch
from engines.backends.batching import micro_batches
from engines.backends.distributed import default_device
from engines.backends.megatron import optimizer as megatron_optimizer, pipeline
from engines.backends.megatron.mapping import HFState, _param_to_hf
from engines.backends.megatron.model import RecomputeGranularity, _init_distributed, build_gpt, transformer_config
from engines.backends.megatron.offload import Offload, Sleeps, trainer_tensors
from engines.backends.torch.critic import explained_variance, variance_sums
from engines.rl.loss_step import on_response_tokens

HEAD = "output_layer"  # the GPTModel attribute the value head takes


class ValueHead(torch.nn.Module):
    """``GPTModel.output_layer`` of a critic: hidden states [seq, batch, hidden] → values
    [seq, batch, 1], computed in fp32 (as the torch critic's head, even on bf16 weights).
    Replicated over TP ranks (veRL's ``LinearForLastLayer``); ``weight``, ``runtime_gather_output``
    (and whatever later Megatron versions pass) are the vocabulary layer's arguments, unused."""

    def __init__(self, hidden_size: int, device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, device=device, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, device=device, dtype=dtype))

    def forward(self, hidden: torch.Tensor, weight=None, runtime_gather_output=None, **_):
        return F.linear(hidden.float(), self.weight.float(), self.bias.float()), None


def backbone_config(hf_config):
    """The folder's config as a tied model's: ``architectures.model_rules`` then has no output
    layer, ``GPTModel`` allocates none, and ``hf_to_megatron`` maps the transformer alone."""
    config = copy.deepcopy(hf_config)
    config.tie_word_embeddings = True
    return config


class MegatronCritic(Sleeps):
    """``values`` before a step, ``train_step`` on its returns, checkpoints: ``TorchCritic``'s interface."""

    def __init__(self, model_dir: str, lr: float, betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0,
                 grad_clip: float = 1.0, dtype: str = "float32", tensor_parallel: int = 1, pipeline_parallel: int = 1,
                 distributed_optimizer: bool = False, reshardable_optimizer: bool = False,
                 recompute_granularity: RecomputeGranularity = "none", recompute_method: str = "uniform",
                 recompute_num_layers: int = 1, recompute_modules: list[str] | tuple[str, ...] = ("core_attn",),
                 device: torch.device | str | None = None):
        self.device = torch.device(device) if device is not None else default_device()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        _init_distributed(tensor_parallel, self.device, pipeline_parallel)
        if dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype {dtype!r}: float32 or bfloat16 (float16 would need loss scaling)")
        self.hf_config = AutoConfig.from_pretrained(model_dir)
        self.text_config = backbone_config(self.hf_config)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.pad_id = self.tokenizer.pad_token_id or 0  # masked out: any id will do
        self.config = transformer_config(self.text_config, tensor_parallel, getattr(torch, dtype), recompute_granularity,
                                         recompute_method, recompute_num_layers, recompute_modules, pipeline_parallel)
        hf_state = HFState.open(model_dir)  # each tensor read when this rank's share needs it
        head = value_head.read_head(model_dir)
        heads = (*value_head.HEAD, "lm_head.weight")  # the policy's vocabulary one is not the critic's
        hf_state = hf_state.view({name: name for name in hf_state if name not in heads})
        gpt = build_gpt(self.text_config, self.config, hf_state, self.device)
        del hf_state
        # the tied model's forward would hand the head the embedding matrix, and its sharded state
        # dict would file the head under the embedding's name: the head is a weight of its own (and
        # no embedding gradient is shared between the first and the last stage)
        gpt.share_embeddings_and_output_weights = False
        if parallel_state.is_pipeline_last_stage():  # the head: the last stage's
            gpt.output_layer = ValueHead(self.config.hidden_size, self.device, self.config.params_dtype)
            if head is not None:
                with torch.no_grad():
                    gpt.output_layer.weight.copy_(head[0])
                    gpt.output_layer.bias.copy_(head[1])
        self.model = DistributedDataParallel(
            config=self.config,
            ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                     use_distributed_optimizer=distributed_optimizer),
            module=gpt,
        )
        self.optimizer = megatron_optimizer.megatron_adam(self.model, self.config, lr, betas, weight_decay, grad_clip,
                                                          distributed_optimizer)
        # as MegatronTrainer's: the schedules' one all-reduce per minibatch, the loss normalised already
        self.config.no_sync_func = self.model.no_sync
        self.config.finalize_model_grads_func = lambda chunks, num_tokens=None, **kw: finalize_model_grads(chunks, None, **kw)
        self.processor, self.replays = None, None  # what pipeline.schedule asks of a policy: no images, no routes
        self._adam_repairs = megatron_optimizer.needs_adam_repairs(distributed_optimizer)
        self._sharding = megatron_optimizer.sharding(reshardable_optimizer)
        self._offload = Offload(self.device)

    # -- forward -------------------------------------------------------------------------------

    def _forward(self, model, ids: torch.Tensor, pixels=None) -> torch.Tensor:
        """This stage's output: the next stage's input, or on the last stage the values [batch, len, 1].
        Right-padded rows, causal attention, no mask tensor (as ``MegatronTrainer``)."""
        batch, length = ids.shape
        positions = torch.arange(length, device=ids.device).expand(batch, length)
        return model(input_ids=ids, position_ids=positions, attention_mask=None)

    def _read(self, output: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Values [batch, len - 1] from the last stage's output, position p's being of the state after
        tokens <= p (as ``TorchCritic``'s)."""
        return output[:, :-1, 0]

    @torch.no_grad()
    def values(self, batch: TrainBatch) -> list[list[float]]:
        """Each response token's value under the current weights (collective over the group's ranks:
        the last stage computes them, every stage answers them)."""
        self._require_awake("values")
        if not len(batch):
            return []

        def response_values(micro, padded, values, k):
            values, resp = values.cpu(), padded.response.cpu().bool()
            return [values[i][resp[i]].tolist() for i in range(len(micro))]

        (values,) = pipeline.schedule(self, self.model, [batch], response_values, forward_only=True) or [None]
        return pipeline.from_last_stage(values, self.device)

    # -- training ------------------------------------------------------------------------------

    def _dp_sums(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(t, group=parallel_state.get_data_parallel_group())
        return t.tolist()

    def train_step(self, batch: TrainBatch, algorithm, minibatches: int = 1, micro_batch_tokens: int | None = None
                   ) -> dict[str, float]:
        """As ``TorchCritic.train_step`` (same loss, normalisation, statistics); the passes of a
        minibatch accumulate in DDP's grad buffers, one all-reduce and Adam step per minibatch."""
        self._require_awake("train_step")
        self.model.train()
        sums: dict[str, torch.Tensor] = {}  # the step's statistics: the last stage's (where the loss is)
        grad_norm = 0.0
        for part in batch.split(minibatches):
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
            (total,) = self._dp_sums([float(sum(part.trained_tokens()))])
            passes = micro_batches(part, micro_batch_tokens)

            def loss(micro, padded, values, k):
                old, returns = (on_response_tokens(x, padded.response).to(values.dtype) for x in (micro.values, micro.returns))
                loss_per_token, stats = algorithm.critic_loss(values, old, returns)
                with torch.no_grad():
                    for name, value in {"value_loss": loss_per_token, **stats}.items():
                        sums[name] = sums.get(name, 0.0) + (value.double() * padded.response).sum()
                return (loss_per_token * padded.response).sum().div(max(total, 1.0))

            if passes:  # accumulates into DDP's grad buffer, then the all-reduce
                pipeline.schedule(self, self.model, passes, loss, False)
            else:  # an empty minibatch still joins the all-reduce
                self.config.finalize_model_grads_func([self.model])
            _, norm, _ = self.optimizer.step()
            grad_norm = float(norm)
        tokens = float(sum(batch.trained_tokens()))
        out = {name: float(value) / max(tokens, 1.0) for name, value in sums.items()}
        moments = self._dp_sums(variance_sums(batch.returns or [], batch.values or []))
        result = out | {"explained_variance": explained_variance(moments), "critic_grad_norm": grad_norm}
        return pipeline.from_last_stage(result, self.device)

    # -- placement -----------------------------------------------------------------------------

    def sleep(self) -> int:
        """Weights, gradient buffers and Adam state to host memory (``offload.py``; on the CPU too)."""
        return self._offload.offload(trainer_tensors(self.model, self.optimizer))

    # -- export --------------------------------------------------------------------------------

    def save_hf(self, local_dir: str) -> None:
        """The critic as a Hugging Face ``*ForTokenClassification`` folder (``value_head.py``), from
        the host copy while asleep. Collective over TP (each parameter's shards gathered, as the
        policy's export: ``pipeline.whole_parameters``); TP rank 0 writes."""
        tensors: dict[str, torch.Tensor] = {}
        for name, shards in pipeline.whole_parameters(self):
            if name.startswith(HEAD + "."):  # replicated over TP
                tensors[f"score.{name[len(HEAD) + 1:]}"] = shards[0].to("cpu", copy=True)
                continue
            tensors |= {k: v.to("cpu", copy=True).contiguous() for k, v in _param_to_hf(name, shards, self.text_config).items()}
        if parallel_state.get_tensor_model_parallel_rank() == 0:
            value_head.save_folder(local_dir, self.hf_config, tensors, self.tokenizer)

    # -- checkpoints ---------------------------------------------------------------------------

    def freeze_checkpoint(self, local_dir: str, copy: bool) -> FrozenCheckpoint:
        """Shards written now with ``dist_checkpointing`` (a collective, so never on the writer's
        thread: as ``MegatronTrainer.freeze_checkpoint``); ``write`` lists them."""
        written = self.save_checkpoint(local_dir)
        return FrozenCheckpoint(lambda: written)

    def save_checkpoint(self, local_dir: str) -> list[str]:
        """Model (value head included) and Adam state (collective); the files this rank wrote."""
        self._require_awake("save_checkpoint")
        path = Path(local_dir)
        megatron_optimizer.save(megatron_optimizer.sharded_state(self.model, self.optimizer, metadata=self._sharding), path,
                                metadata=self._sharding)
        return megatron_optimizer.files_under(path)

    def load_checkpoint(self, local_dir: str) -> None:
        self._require_awake("load_checkpoint")
        if not os.path.isdir(local_dir):
            raise FileNotFoundError(f"{local_dir}: no critic checkpoint")
        megatron_optimizer.load(self.model, self.optimizer, local_dir, self._adam_repairs)
