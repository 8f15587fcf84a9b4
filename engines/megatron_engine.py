"""Megatron-Core policy trainer: ``TorchTrainer``'s interface on a Megatron ``GPTModel``.

Models come in and go out as Hugging Face folders; inside, the policy is a Megatron-Core GPT
model with the local (non-Transformer-Engine) layer specs, whose core attention is replaced by
:class:`SDPAttention` (torch's fused scaled-dot-product attention), tensor parallel over
``tensor_parallel`` ranks, data parallel over the rest of ``torch.distributed``'s world,
wrapped in Megatron's ``DistributedDataParallel`` and stepped by ``get_megatron_optimizer``.
Everything — model, reference model, gradient buffers, optimizer state — lives on the device
of the process (the current CUDA device, else the CPU).
The loss is the one ``TorchTrainer`` uses (``engines.algorithms``), normalised by *global*
token or sequence counts, so a DP step equals one process stepping on the concatenated batch.

Tensor-parallel ranks of one DP replica must be given the same batch. Methods marked
*collective* must be called on every rank, in the same order.

Megatron-Core has no Hugging Face converter for GPT models; ``hf_to_megatron`` and
``megatron_to_hf`` below are the Llama/Qwen2 mapping.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import re
from datetime import timedelta
from pathlib import Path
from typing import Iterator, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import USING_PYTORCH_OPTIMIZER, OptimizerConfig, get_megatron_optimizer
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed, vocab_parallel_cross_entropy
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import divide
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoTokenizer

from engines import algorithms
from engines.channel import progress
from engines.distributed import default_device, init_process_groups
from engines.offload import Offload, trainer_tensors
from engines.protocols import FrozenCheckpoint, TrainBatch
from engines.torch_engines import micro_batches, pad_batch

# Megatron splits the vocabulary evenly over TP ranks. Padding it to a fixed multiple (rather than
# to a multiple of the TP size) keeps checkpoint shapes independent of the TP size; real
# vocabularies (Llama 3: 128256, Qwen2: 151936) are already multiples and get no padding.
VOCAB_MULTIPLE = 128
SUPPORTED_MODELS = ("llama", "qwen2")


# ---------------------------------------------------------------------------------------------
# Hugging Face <-> Megatron mapping
# ---------------------------------------------------------------------------------------------


def padded_vocab_size(hf_config) -> int:
    return -(-hf_config.vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def _attention_shape(hf_config) -> tuple[int, int, int]:
    """(query heads, key/value groups, head dim)."""
    heads = hf_config.num_attention_heads
    groups = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return heads, groups, head_dim


def _rope_theta(hf_config) -> float:
    params = getattr(hf_config, "rope_parameters", None) or {}  # transformers >= 5
    scaling = getattr(hf_config, "rope_scaling", None) or {}  # transformers 4
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise NotImplementedError(f"rope_type {rope_type!r} is not mapped to Megatron (only 'default' is)")
    return float(params.get("rope_theta") or getattr(hf_config, "rope_theta", None) or 10000.0)


def _check_supported(hf_config) -> None:
    if hf_config.model_type not in SUPPORTED_MODELS:
        raise NotImplementedError(f"model_type {hf_config.model_type!r}: only {SUPPORTED_MODELS} are mapped")
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise NotImplementedError(f"hidden_act {hf_config.hidden_act!r}: only SwiGLU (silu) is mapped")
    if getattr(hf_config, "attention_bias", False) or getattr(hf_config, "mlp_bias", False):
        raise NotImplementedError("Llama attention_bias/mlp_bias are not mapped")
    if getattr(hf_config, "use_sliding_window", False):
        raise NotImplementedError("sliding-window attention is not mapped")
    _rope_theta(hf_config)


def _qkv_bias(hf_config) -> bool:
    return hf_config.model_type == "qwen2"


def hf_to_megatron(hf_state: dict, hf_config, tp_rank: int = 0, tp_size: int = 1) -> dict[str, torch.Tensor]:
    """Hugging Face tensors → the state dict of TP rank ``tp_rank`` of a Megatron ``GPTModel``.

    Megatron fuses Q, K and V into one ``linear_qkv`` whose rows are grouped per key/value
    group (that group's query heads, then its key head, then its value head) so that a TP
    split along rows hands each rank whole groups. ``linear_fc1`` is [gate; up] *per rank*,
    because each rank applies SwiGLU to its own half-and-half. The vocabulary is padded (zero
    rows, masked out of the log-softmax) to a multiple of ``VOCAB_MULTIPLE``.

    Names are those of the local layer spec, whose norms are modules of their own
    (``input_layernorm``, ``pre_mlp_layernorm``); Transformer Engine's spec fuses them into
    ``linear_qkv.layer_norm_weight`` / ``linear_fc1.layer_norm_weight``, which is also how the
    local spec names them in ``dist_checkpointing`` checkpoints, so those stay interchangeable.
    """
    heads, groups, head_dim = _attention_shape(hf_config)
    vocab = padded_vocab_size(hf_config)

    def split(t: torch.Tensor, dim: int) -> torch.Tensor:
        if t.shape[dim] % tp_size:
            raise ValueError(f"dimension {dim} of a {tuple(t.shape)} tensor does not split over {tp_size} TP ranks")
        return t.chunk(tp_size, dim)[tp_rank]

    def vocab_rows(t: torch.Tensor) -> torch.Tensor:
        return split(torch.cat([t, t.new_zeros(vocab - t.shape[0], *t.shape[1:])]), 0)

    def qkv(kind: str, prefix: str) -> torch.Tensor:
        q, k, v = (hf_state[f"{prefix}{x}_proj.{kind}"] for x in "qkv")
        grouped = torch.cat([q.unflatten(0, (groups, -1)), k.unflatten(0, (groups, -1)), v.unflatten(0, (groups, -1))], 1)
        return split(grouped.flatten(0, 1), 0)

    out = {"embedding.word_embeddings.weight": vocab_rows(hf_state["model.embed_tokens.weight"])}
    for i in range(hf_config.num_hidden_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[m + "input_layernorm.weight"] = hf_state[h + "input_layernorm.weight"]
        out[m + "self_attention.linear_qkv.weight"] = qkv("weight", h + "self_attn.")
        if _qkv_bias(hf_config):
            out[m + "self_attention.linear_qkv.bias"] = qkv("bias", h + "self_attn.")
        out[m + "self_attention.linear_proj.weight"] = split(hf_state[h + "self_attn.o_proj.weight"], 1)
        out[m + "pre_mlp_layernorm.weight"] = hf_state[h + "post_attention_layernorm.weight"]
        gate, up = hf_state[h + "mlp.gate_proj.weight"], hf_state[h + "mlp.up_proj.weight"]
        out[m + "mlp.linear_fc1.weight"] = torch.cat([split(gate, 0), split(up, 0)])
        out[m + "mlp.linear_fc2.weight"] = split(hf_state[h + "mlp.down_proj.weight"], 1)
    out["decoder.final_layernorm.weight"] = hf_state["model.norm.weight"]
    if not hf_config.tie_word_embeddings:
        out["output_layer.weight"] = vocab_rows(hf_state["lm_head.weight"])
    return out


def megatron_to_hf(mcore_state: dict | list[dict], hf_config) -> dict[str, torch.Tensor]:
    """Megatron tensors → Hugging Face tensors; the inverse of :func:`hf_to_megatron`.

    ``mcore_state`` is one state dict (TP size 1) or the list of every TP rank's, in rank
    order. Only the keys present are converted, so a caller can stream a model one layer at
    a time.
    """
    shards = list(mcore_state) if isinstance(mcore_state, (list, tuple)) else [mcore_state]
    out: dict[str, torch.Tensor] = {}
    for name in shards[0]:
        out.update(_param_to_hf(name, [s[name] for s in shards], hf_config))
    return out


def _param_to_hf(name: str, shards: list[torch.Tensor], hf_config) -> dict[str, torch.Tensor]:
    heads, groups, head_dim = _attention_shape(hf_config)
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        hf_name = "model.embed_tokens.weight" if name.startswith("embedding") else "lm_head.weight"
        return {hf_name: torch.cat(shards)[: hf_config.vocab_size]}
    if name == "decoder.final_layernorm.weight":
        return {"model.norm.weight": shards[0]}
    match = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", name)
    if match is None:
        raise KeyError(f"no Hugging Face name for Megatron parameter {name!r}")
    h, rest = f"model.layers.{match.group(1)}.", match.group(2)
    if rest == "input_layernorm.weight":
        return {h + "input_layernorm.weight": shards[0]}
    if rest == "pre_mlp_layernorm.weight":
        return {h + "post_attention_layernorm.weight": shards[0]}
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = rest.rsplit(".", 1)[1]
        grouped = torch.cat(shards).unflatten(0, (groups, -1))
        q, k, v = grouped.split([heads // groups * head_dim, head_dim, head_dim], dim=1)
        return {f"{h}self_attn.{x}_proj.{kind}": t.flatten(0, 1) for x, t in zip("qkv", (q, k, v))}
    if rest == "self_attention.linear_proj.weight":
        return {h + "self_attn.o_proj.weight": torch.cat(shards, 1)}
    if rest == "mlp.linear_fc1.weight":
        halves = [s.chunk(2) for s in shards]
        return {
            h + "mlp.gate_proj.weight": torch.cat([g for g, _ in halves]),
            h + "mlp.up_proj.weight": torch.cat([u for _, u in halves]),
        }
    if rest == "mlp.linear_fc2.weight":
        return {h + "mlp.down_proj.weight": torch.cat(shards, 1)}
    raise KeyError(f"no Hugging Face name for Megatron parameter {name!r}")


def load_hf_state(model_dir: str | Path) -> dict[str, torch.Tensor]:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


# ---------------------------------------------------------------------------------------------
# Model construction
# ---------------------------------------------------------------------------------------------


class SDPAttention(MegatronModule):
    """Megatron-Core core attention on ``torch.nn.functional.scaled_dot_product_attention``.

    The local layer spec's ``DotProductAttention`` materialises the [batch, heads, seq, seq] scores
    (and their softmax, kept for the backward pass): at 1.2B parameters and seq 2048 an H100 ran
    out of memory. Torch's SDPA picks a fused kernel instead — flash or memory-efficient attention
    on CUDA (bf16; ``is_causal`` without a mask tensor), a fused CPU kernel on the CPU — that
    never holds the scores. Transformer Engine's attention does the same but cannot be installed
    everywhere; this is a drop-in for the local spec (same constructor and ``forward`` as
    ``DotProductAttention``; no parameters, so checkpoints are unchanged).

    Layout: query [sq, b, heads, d], key/value [sk, b, kv groups, d] of this TP rank → [sq, b,
    heads·d]. Grouped-query attention goes to SDPA as is (``enable_gqa``; flash supports it
    natively); only a mask tensor makes it expand the keys and values (no fused kernel takes both).
    ``attention_mask``: Megatron's boolean mask, True where attention is *not* allowed; None with
    a causal ``attn_mask_type`` is plain causal attention (what the trainer uses).
    """

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise NotImplementedError("SDPAttention: context parallelism needs Transformer Engine")
        if config.softmax_type != "vanilla" or config.window_size is not None:
            raise NotImplementedError("SDPAttention: only vanilla softmax over the whole causal context")
        tp = pg_collection.tp.size() if pg_collection is not None else parallel_state.get_tensor_model_parallel_world_size()
        self.attn_mask_type = attn_mask_type
        self.heads = divide(config.num_attention_heads, tp)
        self.groups = divide(config.num_query_groups, tp)
        self.head_dim = config.kv_channels
        # Megatron's apply_query_key_layer_scaling divides the scale by the layer number and its
        # softmax multiplies it back (an fp16 overflow guard): in exact arithmetic, this scale
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None):
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("SDPAttention: packed sequences and attention bias need Transformer Engine")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [s, b, h, d] -> [b, h, s, d]
        allowed = None
        if attention_mask is not None:
            allowed = ~attention_mask  # SDPA's boolean masks say where attention *is* allowed
            if self.heads != self.groups:
                k, v = (t.repeat_interleave(self.heads // self.groups, dim=1) for t in (k, v))
        dropout = self.dropout if self.training else 0.0
        # the attention dropout draws from the TP-aware RNG stream, as DotProductAttention's does
        rng = tensor_parallel.get_cuda_rng_tracker().fork() if dropout > 0 else contextlib.nullcontext()
        with rng:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=allowed, dropout_p=dropout, scale=self.scale,
                is_causal=allowed is None and mask_type == AttnMaskType.causal,
                enable_gqa=allowed is None and self.heads != self.groups,
            )
        sq, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.heads * self.head_dim)  # [b, h, s, d] -> [s, b, h·d]


def gpt_layer_spec():
    """Megatron-Core's local (non-Transformer-Engine) GPT layer with :class:`SDPAttention`."""
    spec = copy.deepcopy(get_gpt_layer_local_spec(normalization="RMSNorm"))
    spec.submodules.self_attention.submodules.core_attention = SDPAttention
    return spec


def _keep(tensor: torch.Tensor) -> torch.Tensor:
    """Init method that leaves the tensor alone: every weight is overwritten from the HF folder.

    (``perform_initialization=False`` would skip the random init too, but Megatron then never
    marks weights as tensor-parallel, and gradient norms count TP shards wrongly.)"""
    return tensor


RecomputeGranularity = Literal["none", "selective", "full"]


def transformer_config(hf_config, tensor_parallel: int, dtype: torch.dtype, recompute_granularity: RecomputeGranularity = "none",
                       recompute_method: Literal["uniform", "block"] = "uniform", recompute_num_layers: int = 1,
                       recompute_modules: list[str] | tuple[str, ...] = ("core_attn",)) -> TransformerConfig:
    """``recompute_*``: activation recomputation (Megatron's options of the same names). "full"
    recomputes whole layers in the backward pass (``recompute_method``: "uniform", every chunk of
    ``recompute_num_layers`` layers; "block", the first ``recompute_num_layers`` layers), keeping
    only their inputs; "selective" recomputes the ``recompute_modules`` of every layer."""
    _check_supported(hf_config)
    heads, groups, head_dim = _attention_shape(hf_config)
    recompute = {}
    if recompute_granularity == "full":
        recompute = {"recompute_granularity": "full", "recompute_method": recompute_method, "recompute_num_layers": recompute_num_layers}
    elif recompute_granularity == "selective":
        recompute = {"recompute_granularity": "selective", "recompute_modules": list(recompute_modules)}
    elif recompute_granularity != "none":
        raise ValueError(f"recompute_granularity {recompute_granularity!r}: none, selective or full")
    return TransformerConfig(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=_qkv_bias(hf_config),
        hidden_dropout=0.0,  # RL needs the trainer's log-probs to be the rollout engine's
        attention_dropout=0.0,
        tensor_model_parallel_size=tensor_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        init_method=_keep,
        output_layer_init_method=_keep,
        embedding_init_method=_keep,
        # The loss is already normalised by global counts: DDP must sum gradients over DP
        # ranks, not average them (its default divides by the DP size).
        calculate_per_token_loss=True,
        **recompute,
    )


def build_gpt(hf_config, config: TransformerConfig, hf_state: dict, device: torch.device | None = None,
              layer_spec=None) -> GPTModel:
    """A GPT model on ``device`` (None: this process's, ``engines.distributed.default_device``)
    holding this TP rank's share of the Hugging Face weights. ``layer_spec``: the transformer
    layer (default :func:`gpt_layer_spec`)."""
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec if layer_spec is not None else gpt_layer_spec(),
        vocab_size=padded_vocab_size(hf_config),
        max_sequence_length=hf_config.max_position_embeddings,
        parallel_output=True,  # logits stay split over TP ranks; the log-softmax is vocab-parallel
        share_embeddings_and_output_weights=hf_config.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=_rope_theta(hf_config),
    )
    # Megatron allocates its linear layers on the current CUDA device, but the local spec builds its
    # norms on the CPU in torch's default dtype: Megatron-LM casts the whole model for bf16
    # (Float16Module), its optimizers expect parameters of one dtype, and an H100 run failed with
    # the norms left on the CPU. So the whole model goes to the device and dtype here.
    model.to(device=device if device is not None else default_device(), dtype=config.params_dtype)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    state = hf_to_megatron(hf_state, hf_config, tp_rank, tp_size)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise RuntimeError(f"HF→Megatron mapping mismatch: missing {missing}, unexpected {unexpected}")
    return model


def _init_distributed(tensor_parallel: int, device: torch.device) -> None:
    """Join Megatron's parallel state; a single process gets a world of one so that the code
    path (DDP, optimizer, checkpoints) is the same as in a DP run."""
    if not dist.is_initialized():
        init_process_groups(device, 0, 1, dist.HashStore(), timedelta(minutes=10))  # a world of one: no network
    if parallel_state.model_parallel_is_initialized():
        current = parallel_state.get_tensor_model_parallel_world_size()
        if current != tensor_parallel:
            raise ValueError(f"model parallel state already has TP={current}, asked for TP={tensor_parallel}")
    else:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel)
        model_parallel_cuda_manual_seed(0)  # no dropout here, but attention forks this RNG tracker


class MegatronTrainer:
    """GRPO/DAPO policy training on Megatron-Core; a drop-in for ``TorchTrainer``.

    Construction is collective when ``torch.distributed`` is initialised (process groups,
    optimizer parameter groups).
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
        tensor_parallel: int = 1,
        distributed_optimizer: bool = False,
        recompute_granularity: RecomputeGranularity = "none",
        recompute_method: Literal["uniform", "block"] = "uniform",
        recompute_num_layers: int = 1,
        recompute_modules: list[str] | tuple[str, ...] = ("core_attn",),
        device: torch.device | str | None = None,
    ):
        # Megatron allocates on the *current* CUDA device: a device given here becomes it
        self.device = torch.device(device) if device is not None else default_device()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        _init_distributed(tensor_parallel, self.device)
        self.hf_config = AutoConfig.from_pretrained(model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.tokenizer.padding_side = "left"
        self.temperature = temperature
        # Megatron without Transformer Engine or Apex steps torch's AdamW, whose distributed
        # checkpoints need two repairs (see load_checkpoint).
        self._distributed_torch_adam = distributed_optimizer and USING_PYTORCH_OPTIMIZER
        self.version = 0  # optimizer steps taken: the policy version rollouts are stamped with
        if dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype {dtype!r}: float32 or bfloat16 (float16 would need loss scaling)")
        torch_dtype = getattr(torch, dtype)
        self.config = transformer_config(self.hf_config, tensor_parallel, torch_dtype, recompute_granularity,
                                         recompute_method, recompute_num_layers, recompute_modules)
        hf_state = load_hf_state(model_dir)

        model = build_gpt(self.hf_config, self.config, hf_state, self.device)
        self.model = DistributedDataParallel(
            config=self.config,
            ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=distributed_optimizer
            ),
            module=model,
        )
        self.reference = None
        if reference:
            self.reference = build_gpt(self.hf_config, self.config, hf_state, self.device).eval()
            self.reference.requires_grad_(False)
        del hf_state

        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=lr,
                min_lr=lr,
                weight_decay=weight_decay,
                adam_beta1=betas[0],
                adam_beta2=betas[1],
                adam_eps=1e-8,  # torch.optim.AdamW's default, as in TorchTrainer
                clip_grad=grad_clip,
                bf16=self.config.bf16,  # bf16 parameters, fp32 main copies in the optimizer
                params_dtype=torch_dtype,
                use_distributed_optimizer=distributed_optimizer,
            ),
            [self.model],
            config_overrides={},  # decay every parameter, as TorchTrainer's AdamW does
        )
        # Megatron's pipeline schedules call this after the backward pass (without it DP gradients
        # are silently never all-reduced); train_step, which runs no schedule, calls it itself.
        self.config.finalize_model_grads_func = finalize_model_grads
        self._checkpoints = AsyncCallsQueue()
        self._pending_checkpoint: Path | None = None
        self._offload = Offload(self.device)

        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        per_rank = padded_vocab_size(self.hf_config) // tensor_parallel
        vocab_ids = torch.arange(tp_rank * per_rank, (tp_rank + 1) * per_rank, device=self.device)
        padding = vocab_ids >= self.hf_config.vocab_size
        self._vocab_padding = padding if padding.any() else None  # this rank's logits of padded ids

    # --- forward -------------------------------------------------------------------------

    def _token_logprobs(self, model, ids: torch.Tensor) -> torch.Tensor:
        """log p(token t | tokens < t) for t >= 1; shape [batch, len-1] (on every TP rank).

        Sequences are right-padded, so causal attention alone keeps real tokens away from
        padding, and positions 0..n-1 are the ones Hugging Face gives them. No mask tensor: the
        layers' causal mask type lets SDPA use its causal kernels (a [seq, seq] mask would rule
        flash attention out)."""
        batch, length = ids.shape
        positions = torch.arange(length, device=ids.device).expand(batch, length)
        logits = model(input_ids=ids, position_ids=positions, attention_mask=None)
        logits = logits[:, :-1].float() / self.temperature
        if self._vocab_padding is not None:
            logits = logits.masked_fill(self._vocab_padding, float("-inf"))
        return -vocab_parallel_cross_entropy(logits, ids[:, 1:])

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch) -> list[list[float]]:
        """The trainer's log-probabilities of each response token (collective over TP)."""
        self._require_awake("logprobs")
        if not len(batch):
            return []
        ids, _, resp, _ = pad_batch(batch, self.tokenizer.pad_token_id)
        lp = self._token_logprobs(self.model, ids.to(self.device)).cpu()
        return [lp[i][resp[i].bool()].tolist() for i in range(len(batch))]

    # --- training ------------------------------------------------------------------------

    def _dp_sum(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=parallel_state.get_data_parallel_group())
        return t.item()

    def train_step(
        self,
        batch: TrainBatch,
        minibatches: int = 1,
        aggregation: Literal["token", "sequence"] = "token",
        clip_low: float = 0.2,
        clip_high: float = 0.28,
        kl_coef: float = 0.0,
        micro_batch_tokens: int | None = None,
    ) -> dict:
        """One rollout batch → ``minibatches`` optimizer steps (collective: every rank runs the
        same number of steps, an empty minibatch still joins the gradient all-reduce).

        ``micro_batch_tokens``: as in ``TorchTrainer.train_step`` — length-sorted passes of at
        most this many padded tokens, accumulating into DDP's grad buffers (under ``no_sync``
        for all but the last pass), one all-reduce and optimizer step per minibatch."""
        self._require_awake("train_step")
        totals = {"loss": 0.0, "clip_fraction": 0.0, "tokens": 0.0, "grad_norm": 0.0}
        stats = torch.zeros(3, dtype=torch.float64, device=self.device)  # entropy, kl_rollout, kl_reference (token sums)
        self.model.train()
        for part in batch.split(minibatches):
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
            local_tokens = float(sum(len(r) for r in part.response_ids))
            total = self._dp_sum(local_tokens if aggregation == "token" else float(len(part)))
            # summed on the device: no host sync per pass
            loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
            clipped_sum = torch.zeros((), dtype=torch.float64, device=self.device)
            passes = micro_batches(part, micro_batch_tokens)
            for k, micro in enumerate(passes):
                progress()  # the host's heartbeat: a long train step is moving (engines/channel.py)
                with self.model.no_sync() if k < len(passes) - 1 else contextlib.nullcontext():
                    ids, _, resp, old = (t.to(self.device) for t in pad_batch(micro, self.tokenizer.pad_token_id))
                    logprobs = self._token_logprobs(self.model, ids)
                    ref = None
                    if self.reference is not None and kl_coef > 0:
                        with torch.no_grad():
                            ref = self._token_logprobs(self.reference, ids)
                    adv = torch.tensor(micro.advantages, dtype=logprobs.dtype, device=self.device)
                    per_token, clipped = algorithms.policy_loss_terms(logprobs, old, adv, clip_low, clip_high, ref, kl_coef)
                    # global ``total`` (not this pass's own count): the passes' losses sum to the minibatch's
                    loss = (per_token * algorithms.token_weights(resp, aggregation, total)).sum()
                    loss.backward()  # accumulates into the DDP grad buffer (main_grad)
                loss_sum += loss.detach()
                clipped_sum += (clipped * resp).sum()
                stats += algorithms.step_statistics(logprobs, old, resp, ref)
            loss_value = loss_sum.item()
            totals["clip_fraction"] += clipped_sum.item()
            finalize_model_grads([self.model])  # the DP all-reduce (a sum: see calculate_per_token_loss)
            _, grad_norm, _ = self.optimizer.step()
            totals["loss"] += self._dp_sum(loss_value)
            totals["tokens"] += local_tokens
            totals["grad_norm"] = float(grad_norm)
        self.version += 1
        totals["clip_fraction"] /= max(totals["tokens"], 1.0)
        return totals | dict(zip(algorithms.STEP_STATISTICS, (stats / max(totals["tokens"], 1.0)).tolist()))

    # --- placement ---------------------------------------------------------------------

    def sleep(self) -> int:
        """Give the devices back while rollout and GenRM hold them: weights, gradient buffers,
        optimizer moments and main copies move to host memory (see ``engines/offload.py``; on a
        CPU device too, so that CPU runs take the GPU's path). Answers the bytes moved (0 if
        asleep already). While asleep, ``export_weights`` (so ``save_hf``) reads the host copy;
        what needs the live state — ``logprobs``, ``train_step``, checkpoints — refuses."""
        self.finalize_checkpoint()  # an async checkpoint write still reads the live tensors
        return self._offload.offload(trainer_tensors(self.model, self.reference, self.optimizer))

    def wake(self) -> int:
        """Everything ``sleep`` moved, back on the device, bit for bit."""
        return self._offload.restore()

    @property
    def asleep(self) -> bool:
        return self._offload.asleep

    def _require_awake(self, what: str) -> None:
        # a released storage reads as garbage or crashes inside CUDA ("invalid argument"): say so instead
        if self._offload.asleep:
            raise RuntimeError(f"MegatronTrainer.{what}: the trainer is asleep (its device memory is released); wake() it first")

    # --- weights out ---------------------------------------------------------------------

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full Hugging Face-named tensors on the CPU, one Megatron parameter at a time; from the
        host copy while the trainer sleeps (nothing is woken: the devices stay with whoever holds them).

        Collective over the TP group when ``tensor_parallel > 1`` (each parameter's shards are
        all-gathered): every TP rank must consume the whole iterator."""
        tp_group = parallel_state.get_tensor_model_parallel_group()
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
        for name, param in self.model.module.named_parameters():
            local = self._offload.host_view(param.detach())
            if tp_size > 1 and local.device != self.device:
                local = local.to(self.device)  # the TP group's backend gathers device tensors (one parameter at a time)
            shards = [local]
            if tp_size > 1 and getattr(param, "tensor_model_parallel", False):
                shards = [torch.empty_like(local) for _ in range(tp_size)]
                dist.all_gather(shards, local.contiguous(), group=tp_group)
            for hf_name, tensor in _param_to_hf(name, shards, self.hf_config).items():
                yield hf_name, tensor.to("cpu", copy=True).contiguous()

    def save_hf(self, local_dir: str, tensors: dict[str, torch.Tensor] | None = None) -> None:
        """config.json, model.safetensors (HF names) and the tokenizer. Collective over TP;
        TP rank 0 of each DP replica writes. ``tensors``: Hugging Face-named weights taken
        earlier (``dict(export_weights())``, host-memory copies) to write instead of the live
        ones; then nothing is collective and any thread may call it."""
        if tensors is None:
            tensors = dict(self.export_weights())
        if parallel_state.get_tensor_model_parallel_rank() != 0:
            return
        os.makedirs(local_dir, exist_ok=True)
        self.hf_config.save_pretrained(local_dir)
        save_file(tensors, os.path.join(local_dir, "model.safetensors"), metadata={"format": "pt"})
        self.tokenizer.save_pretrained(local_dir)

    # --- checkpoints ---------------------------------------------------------------------

    def _sharded_state(self, is_loading: bool = False) -> dict:
        model = self.model.module.sharded_state_dict()
        # The distributed optimizer's default format in 0.16 ('fully_sharded_model_space') fails
        # on save; with 'dp_reshardable' each rank writes its own optimizer shard without
        # communication (Megatron documents it as reshardable across DP sizes, not TP sizes).
        metadata = {"distrib_optim_sharding_type": "dp_reshardable"}
        optimizer = self.optimizer.sharded_state_dict(model, is_loading=is_loading, metadata=metadata)
        return {"model": model, "optimizer": optimizer, "version": self.version}

    def save_checkpoint(self, local_dir: str, async_save: bool = False) -> list[str] | None:
        """Model + optimizer + version with ``dist_checkpointing`` (collective).

        Every rank writes into its own ``local_dir`` (new or empty) only the shards it owns;
        data-parallel replicas split the replicated tensors between them. The union of all
        ranks' folders is the checkpoint, so a caller can upload each rank's files under one
        prefix and later give every rank the whole folder. Returns the file names (relative to
        ``local_dir``) this rank wrote; with ``async_save`` the files are written in the
        background and :meth:`finalize_checkpoint` returns them.
        """
        self._require_awake("save_checkpoint")
        self.finalize_checkpoint()
        path = Path(local_dir)
        path.mkdir(parents=True, exist_ok=True)
        if any(path.iterdir()):
            raise FileExistsError(f"{path}: checkpoint folder is not empty")
        strategy = FullyParallelSaveStrategyWrapper(
            get_default_save_sharded_strategy(), parallel_state.get_data_parallel_group(with_context_parallel=True)
        )
        request = dist_checkpointing.save(self._sharded_state(), str(path), strategy, async_sharded_save=async_save)
        if not async_save:
            return _files_under(path)
        self._checkpoints.schedule_async_request(request)
        self._pending_checkpoint = path
        return None

    def freeze_checkpoint(self, local_dir: str, copy: bool, hf_weights: bool) -> FrozenCheckpoint:
        """``dist_checkpointing``'s save is a collective (the DP ranks split the replicated tensors)
        that must not run on another thread beside the train step's collectives: the shards are
        written to ``local_dir`` now, and ``write`` only lists them. With ``copy`` and
        ``hf_weights``, the policy's Hugging Face weights are copied to host memory too."""
        written = self.save_checkpoint(local_dir)
        return FrozenCheckpoint(lambda: written, dict(self.export_weights()) if copy and hf_weights else None)

    def finalize_checkpoint(self) -> list[str]:
        """Wait for the async save in flight, if any (collective); returns its files on this rank."""
        if self._pending_checkpoint is None:
            return []
        self._checkpoints.maybe_finalize_async_calls(blocking=True)
        path, self._pending_checkpoint = self._pending_checkpoint, None
        return _files_under(path)

    def load_checkpoint(self, local_dir: str) -> None:
        """Restore model, optimizer and version from a whole checkpoint folder (collective)."""
        self._require_awake("load_checkpoint")
        self.finalize_checkpoint()
        if self._distributed_torch_adam:
            self._materialise_adam_state()
        state = dist_checkpointing.load(self._sharded_state(is_loading=True), str(local_dir))
        self.model.module.load_state_dict(state["model"])
        with torch.no_grad():  # the distributed optimizer copies into views of the parameters
            self.optimizer.load_state_dict(state["optimizer"])
        if self._distributed_torch_adam:
            self._repair_adam_steps(state["optimizer"]["optimizer"]["param_groups"][0]["step"])
        self.version = int(state["version"])

    def _materialise_adam_state(self) -> None:
        """Zero Adam state (step 0) where none exists yet. Megatron 0.16's DistributedOptimizer over
        torch's AdamW (no Transformer Engine or Apex) asserts that its parameters share one step
        count when it describes its state for loading, so an optimizer that never stepped cannot
        load a checkpoint; the checkpoint overwrites these zeros."""
        for chained in self.optimizer.chained_optimizers:
            inner = chained.optimizer
            for group in inner.param_groups:
                for p in group["params"]:
                    if not inner.state[p]:
                        inner.state[p] = {
                            "step": torch.tensor(0.0),
                            "exp_avg": torch.zeros_like(p),
                            "exp_avg_sq": torch.zeros_like(p),
                        }

    def _repair_adam_steps(self, step: float) -> None:
        """Megatron 0.16's DistributedOptimizer over torch's AdamW restores every parameter's step
        count from the pre-load state (not the checkpoint) and into one tensor shared by all
        parameters, which torch's AdamW then increments once per parameter."""
        for chained in self.optimizer.chained_optimizers:
            for param_state in chained.optimizer.state.values():
                param_state["step"] = torch.tensor(float(step))


def _files_under(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())
