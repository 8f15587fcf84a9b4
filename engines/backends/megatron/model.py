"""Building the Megatron-Core GPT model the trainer trains: the local layer spec with torch's
fused attention (:class:`SDPAttention`), a ``TransformerConfig`` from a Hugging Face config, and
Megatron's parallel state for a process.
"""

from __future__ import annotations

import contextlib
import copy
import math
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from megatron.core.utils import divide

from engines.backends.distributed import default_device, init_process_groups
from engines.backends.megatron.architectures import architecture, rope_scaling, rope_theta
from engines.backends.megatron.mapping import MappingError, megatron_tensors, padded_vocab_size, stage_name

# Megatron-Core 0.16's router (moe_utils.RouterGatingLinearFunction) asks ``te_general_gemm is not
# None``, a name moe_utils only defines when Transformer Engine imports: without it every MoE
# forward fails with NameError. None is what the check means to find (then it multiplies with torch).
if not hasattr(moe_utils, "te_general_gemm"):
    moe_utils.te_general_gemm = None


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


def gpt_layer_spec(qk_layernorm: bool = False, num_experts: int | None = None):
    """Megatron-Core's local (non-Transformer-Engine) GPT layer with :class:`SDPAttention`;
    ``qk_layernorm``: per-head RMSNorms of queries and keys (``q_layernorm``/``k_layernorm``, kept:
    only the core attention is swapped); ``num_experts``: a MoE layer (router and ``SequentialMLP``
    experts, each a local MLP) in place of the dense MLP."""
    spec = copy.deepcopy(get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False,
                                                  normalization="RMSNorm", qk_layernorm=qk_layernorm))
    spec.submodules.self_attention.submodules.core_attention = SDPAttention
    return spec


def _keep(tensor: torch.Tensor) -> torch.Tensor:
    """Init method that leaves the tensor alone: every weight is overwritten from the HF folder.

    (``perform_initialization=False`` would skip the random init too, but Megatron then never
    marks weights as tensor-parallel, and gradient norms count TP shards wrongly.)"""
    return tensor


ORDER = "tp-cp-ep-pp-dp"  # engines/config/layout.py numbers the hosts in this order

RecomputeGranularity = Literal["none", "selective", "full"]


def transformer_config(hf_config, tensor_parallel: int, dtype: torch.dtype, recompute_granularity: RecomputeGranularity = "none",
                       recompute_method: Literal["uniform", "block"] = "uniform", recompute_num_layers: int = 1,
                       recompute_modules: list[str] | tuple[str, ...] = ("core_attn",),
                       pipeline_parallel: int = 1, expert_parallel: int = 1) -> TransformerConfig:
    """``recompute_*``: activation recomputation (Megatron's options of the same names). "full"
    recomputes whole layers in the backward pass (``recompute_method``: "uniform", every chunk of
    ``recompute_num_layers`` layers; "block", the first ``recompute_num_layers`` layers), keeping
    only their inputs; "selective" recomputes the ``recompute_modules`` of every layer. The
    architecture's own fields (shape, norms, biases, experts) come from its record (``architectures.py``).

    A mixture of experts' tokens go to their experts by Megatron's "allgather" dispatcher: it runs
    on gloo and NCCL alike ("alltoall" builds a ``torch.cuda.Stream`` when the layer is made).
    ``expert_parallel`` ranks hold the experts in equal shares; they must be given the same batch
    (they are, as the ranks of one DP group are: the dispatcher all-gathers every rank's tokens,
    so their shapes and passes must agree)."""
    arch = architecture(hf_config)
    moe = {}
    if arch.experts:
        # the MoE layer refuses to train under TP without sequence parallelism (not wired here), and
        # the allgather dispatcher refuses the variable sequence lengths a pipeline sends
        if tensor_parallel > 1 or pipeline_parallel > 1:
            raise ValueError(f"model_type {hf_config.model_type!r}: a mixture of experts trains on Megatron at "
                             f"tensor_parallel=1 and pipeline_parallel=1 only (now {tensor_parallel} and "
                             f"{pipeline_parallel}): Megatron-Core's MoE layer needs sequence parallelism under TP, "
                             "which the trainer does not wire, and its allgather token dispatcher takes no variable "
                             "sequence lengths (the pipeline's); its experts split by expert_parallel instead")
        if hf_config.num_experts % expert_parallel:
            raise ValueError(f"{hf_config.num_experts} experts do not split over {expert_parallel} expert-parallel ranks")
        moe = {"moe_token_dispatcher_type": "allgather", "expert_model_parallel_size": expert_parallel}
    elif expert_parallel != 1:
        raise ValueError(f"expert_parallel={expert_parallel}: model_type {hf_config.model_type!r} has no experts")
    recompute = {}
    if recompute_granularity == "full":
        recompute = {"recompute_granularity": "full", "recompute_method": recompute_method, "recompute_num_layers": recompute_num_layers}
    elif recompute_granularity == "selective":
        recompute = {"recompute_granularity": "selective", "recompute_modules": list(recompute_modules)}
    elif recompute_granularity != "none":
        raise ValueError(f"recompute_granularity {recompute_granularity!r}: none, selective or full")
    return TransformerConfig(
        **arch.transformer_kwargs(hf_config),
        hidden_dropout=0.0,  # RL needs the trainer's log-probs to be the rollout engine's
        attention_dropout=0.0,
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        # micro-batches are cut by tokens (engines/backends/batching.py), so their shapes differ: the
        # pipeline's stages send each activation's shape before it (the config refuses that beside its
        # default MoE token dispatcher, which a dense model never runs)
        **({"variable_seq_lengths": True, "moe_token_dispatcher_type": "alltoall"} if pipeline_parallel > 1 else {}),
        **moe,
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


def build_gpt(hf_config, config: TransformerConfig, hf_state, device: torch.device | None = None,
              layer_spec=None) -> GPTModel:
    """A GPT model on ``device`` (None: this process's, ``engines.backends.distributed.default_device``)
    holding this TP rank's share of the Hugging Face weights, of this pipeline stage's layers
    (``hf_state``: a mapping such as ``mapping.HFState``, of which only those tensors are read).
    ``layer_spec``: the transformer layer (default :func:`gpt_layer_spec`). Strict: every Megatron parameter is filled from the
    folder (and ``hf_to_megatron`` consumes every Hugging Face tensor), else ``MappingError``."""
    first, last = parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()
    model = GPTModel(
        config=config,
        pre_process=first,  # the embedding: the first pipeline stage's
        post_process=last,  # the final norm and output layer: the last stage's
        transformer_layer_spec=layer_spec if layer_spec is not None else gpt_layer_spec(config.qk_layernorm, config.num_moe_experts),
        vocab_size=padded_vocab_size(hf_config),
        max_sequence_length=hf_config.max_position_embeddings,
        parallel_output=True,  # logits stay split over TP ranks; the log-softmax is vocab-parallel
        share_embeddings_and_output_weights=hf_config.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=rope_theta(hf_config),
    )
    scaling = rope_scaling(hf_config)
    if scaling is not None:
        # Llama 3's frequency scaling. GPTModel's own rope_scaling passes only the factor and fixes
        # the other three parameters at Llama 3.1's values; _apply_scaling (transformers' formula)
        # takes all four, so every checkpoint's own values are used (test_architectures.py checks
        # the frequencies against transformers').
        rotary = model.rotary_pos_emb
        rotary.inv_freq = rotary._apply_scaling(rotary.inv_freq, **scaling)
    # Megatron allocates its linear layers on the current CUDA device, but the local spec builds its
    # norms on the CPU in torch's default dtype: Megatron-LM casts the whole model for bf16
    # (Float16Module), its optimizers expect parameters of one dtype, and an H100 run failed with
    # the norms left on the CPU. So the whole model goes to the device and dtype here.
    model.to(device=device if device is not None else default_device(), dtype=config.params_dtype)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    ep_size = parallel_state.get_expert_model_parallel_world_size()
    stage = (get_transformer_layer_offset(config), config.num_layers // config.pipeline_model_parallel_size, first, last,
             hf_config.tie_word_embeddings)
    # one tensor at a time, into its parameter: the stage's tensors are never all in memory beside the model
    target, filled, unexpected = model.state_dict(), set(), []
    mine = lambda name: stage_name(name, *stage) is not None  # noqa: E731
    with torch.no_grad():
        for name, tensor in megatron_tensors(hf_state, hf_config, tp_rank, tp_size, ep_rank, ep_size, keep=mine):
            local = stage_name(name, *stage)
            if local not in target:
                unexpected.append(local)
                continue
            if target[local].shape != tensor.shape:
                raise MappingError(f"model_type {hf_config.model_type!r}: {name} maps to a {tuple(tensor.shape)} tensor, "
                                   f"the Megatron parameter {local} is {tuple(target[local].shape)}")
            target[local].copy_(tensor)
            filled.add(local)
    missing = [k for k in target if k not in filled and not k.endswith("_extra_state")]
    if missing or unexpected:
        raise MappingError(f"model_type {hf_config.model_type!r}: Megatron parameters the Hugging Face folder did not "
                           f"fill: {missing}; mapped tensors the Megatron model has no parameter for: {unexpected}")
    return model


def _init_distributed(tensor_parallel: int, device: torch.device, pipeline_parallel: int = 1,
                      expert_parallel: int = 1) -> None:
    """Join Megatron's parallel state; a single process gets a world of one so that the code
    path (DDP, optimizer, checkpoints) is the same as in a DP run. ``expert_parallel`` ranks split
    a mixture's experts; Megatron carves them out of the data-parallel ranks."""
    if not dist.is_initialized():
        init_process_groups(device, 0, 1, dist.HashStore(), timedelta(minutes=10))  # a world of one: no network
    if parallel_state.model_parallel_is_initialized():
        current = (parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_pipeline_model_parallel_world_size(),
                   parallel_state.get_expert_model_parallel_world_size())
        if current != (tensor_parallel, pipeline_parallel, expert_parallel):
            raise ValueError(f"model parallel state already has TP x PP x EP = {current}, asked for {tensor_parallel} x "
                             f"{pipeline_parallel} x {expert_parallel}")
    else:
        # the rank order the engine hosts are laid out in (engines/config/layout.py): a DP group's
        # ranks consecutive, TP ranks innermost, then pipeline stages
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel,
                                                 pipeline_model_parallel_size=pipeline_parallel,
                                                 expert_model_parallel_size=expert_parallel, order=ORDER)
        model_parallel_cuda_manual_seed(0)  # no dropout here, but attention forks this RNG tracker
