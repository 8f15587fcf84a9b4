"""The Hugging Face architectures the Megatron trainer maps: one record per family.

A record holds what differs between families: the ``model_type`` values that name it, the name
table (which Megatron parameter of a decoder layer comes from which Hugging Face tensors, and how
they are laid out over tensor-parallel ranks), and — read off that table — the Megatron flags it
needs (Q/K/V bias, per-head q/k RMSNorm). Everything else is shared: the model-level names
(embeddings, final norm, output layer: tied or not per checkpoint), the ``TransformerConfig``
fields, the rotary embedding (plain, or Llama 3's frequency scaling) and the checks that refuse
what the local layer spec cannot express. Adding a family is one ``Architecture(...)`` in
``ARCHITECTURES``; a family Megatron cannot train is a record with ``refused`` (its reason).

A mixture of experts (Qwen3-MoE) has rules with an ``{e}`` in their names, one per expert: its
Megatron layers are Megatron-Core MoE layers (router, ``SequentialMLP`` experts). Its table names
the experts as checkpoints do (``mlp.experts.{e}.gate_proj.weight``: what ``save_pretrained``
writes and what the Hub's folders hold); transformers >= 5 holds them in memory fused, one tensor
per layer for all experts (``mlp.experts.gate_up_proj``), and those are the names the rollout
engines take weights by: the record's ``fused`` says how the two correspond (``mapping.py``
converts: ``fuse_experts`` for the trainer's export, ``unfuse_experts`` for what it loads and saves).

This module imports no Megatron: input validation reads it before any engine loads
(``engines/host/validation.py``), so an unsupported policy fails there, naming the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch.nn.functional as F

Layout = Literal["replicated", "row", "qkv", "gate_up", "vocab"]


@dataclass(frozen=True)
class Rule:
    """One Megatron parameter and the Hugging Face tensors it is made of.

    ``layout``: how the tensors become this TP rank's parameter — ``replicated`` (norms: the
    same on every rank), ``row`` (a row-parallel linear: split along the input dimension),
    ``qkv`` (q, k, v fused, grouped per key/value group, split by whole groups), ``gate_up``
    (gate and up fused as [gate; up] *per rank*), ``vocab`` (padded vocabulary rows, split)."""

    megatron: str
    hf: tuple[str, ...]
    layout: Layout


class Unsupported(NotImplementedError):
    """A Hugging Face model the Megatron mapping cannot train; the message names the model_type
    and the config.json field (or the architecture's trait) that rules it out."""


@dataclass(frozen=True)
class Fused:
    """A tensor transformers (>= 5) holds for all of a layer's experts at once, in place of the
    per-expert tensors of checkpoints and the name table: ``model`` [experts, rows, columns] is,
    expert by expert, its ``parts`` (``{e}``: the expert's number) concatenated along the rows,
    each part an equal share (Qwen3-MoE's ``gate_up_proj``: gate rows, then up rows)."""

    model: str
    parts: tuple[str, ...]


# Names inside a decoder layer: ``decoder.layers.{i}.`` on the Megatron side (the local spec's
# names: its norms are modules of their own), ``model.layers.{i}.`` on the Hugging Face side.
ATTENTION = (
    Rule("input_layernorm.weight", ("input_layernorm.weight",), "replicated"),
    Rule("self_attention.linear_qkv.weight", ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"), "qkv"),
    Rule("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",), "row"),
    Rule("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",), "replicated"),
)
LLAMA_LAYER = ATTENTION + (
    Rule("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), "gate_up"),
    Rule("mlp.linear_fc2.weight", ("mlp.down_proj.weight",), "row"),
)
QKV_BIAS = (Rule("self_attention.linear_qkv.bias", ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"), "qkv"),)
# Qwen3 normalises each head's query and key (RMSNorm over the head dimension, one weight shared
# by all heads) before the rotary embedding; Megatron's q_layernorm/k_layernorm do the same, at
# the same place, on this rank's heads.
QK_NORM = (
    Rule("self_attention.q_layernorm.weight", ("self_attn.q_norm.weight",), "replicated"),
    Rule("self_attention.k_layernorm.weight", ("self_attn.k_norm.weight",), "replicated"),
)
# Qwen3-MoE's sparse MLP: the router (its weight on every TP rank: each routes all of its tokens)
# and per expert a SwiGLU MLP laid out as the dense one. ``{e}``: the expert's number, the same on
# both sides in the whole model (an expert-parallel rank's ``local_experts`` count from 0: mapping.py).
EXPERTS = (
    Rule("mlp.router.weight", ("mlp.gate.weight",), "replicated"),
    Rule("mlp.experts.local_experts.{e}.linear_fc1.weight", ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight"), "gate_up"),
    Rule("mlp.experts.local_experts.{e}.linear_fc2.weight", ("mlp.experts.{e}.down_proj.weight",), "row"),
)
QWEN3_MOE_FUSED = (
    Fused("mlp.experts.gate_up_proj", ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight")),
    Fused("mlp.experts.down_proj", ("mlp.experts.{e}.down_proj.weight",)),
)
EMBEDDING = Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab")
FINAL_NORM = Rule("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated")
OUTPUT = Rule("output_layer.weight", ("lm_head.weight",), "vocab")

# Llama 3.1-3.3 checkpoints' rope_type "llama3": Megatron's RotaryEmbedding._apply_scaling is the
# same formula as transformers' (adapted from it), with all four of these parameters.
LLAMA3_ROPE = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True)
class Architecture:
    family: str  # for people: messages and docs
    model_types: tuple[str, ...]
    layer: tuple[Rule, ...] = ()  # the name table of one decoder layer
    refused: str | None = None  # why the Megatron trainer cannot train this family (None: it can)
    fused: tuple[Fused, ...] = ()  # a mixture of experts: its expert tensors as transformers holds them

    @property
    def experts(self) -> bool:
        """A mixture of experts: Megatron-Core MoE layers (router and experts) in every layer."""
        return any("{e}" in r.megatron for r in self.layer)

    @property
    def qkv_bias(self) -> bool:
        return any(r.megatron == "self_attention.linear_qkv.bias" for r in self.layer)

    @property
    def qk_layernorm(self) -> bool:
        return any(r.megatron == "self_attention.q_layernorm.weight" for r in self.layer)

    def check(self, hf_config) -> None:
        """Refuse (``Unsupported``) a config whose traits the local layer spec cannot express."""
        model_type = hf_config.model_type

        def refuse(why: str):
            raise Unsupported(f"model_type {model_type!r} ({self.family}): {why}")

        if self.refused:
            refuse(self.refused)
        if getattr(hf_config, "hidden_act", "silu") != "silu":
            refuse(f"hidden_act {hf_config.hidden_act!r} is not mapped (only SwiGLU, 'silu')")
        if getattr(hf_config, "mlp_bias", False):
            refuse("mlp_bias=true is not mapped (Megatron's add_bias_linear would add biases to o_proj too)")
        if getattr(hf_config, "attention_bias", False):  # Llama/Qwen3: biases on q, k, v *and* o_proj
            refuse("attention_bias=true is not mapped (biases on q/k/v/o_proj; Megatron's add_qkv_bias covers q/k/v only)")
        sliding = [t for t in (getattr(hf_config, "layer_types", None) or []) if t != "full_attention"]
        # Qwen2/Qwen3 keep a sliding_window that use_sliding_window=false switches off; Mistral-style
        # configs have no switch: a window there is in use
        window = getattr(hf_config, "sliding_window", None) and getattr(hf_config, "use_sliding_window", True)
        if window or sliding:
            refuse("sliding-window attention layers (use_sliding_window / layer_types) are not mapped: "
                   "every layer must attend to the whole causal context")
        if float(rope_parameters(hf_config).get("partial_rotary_factor", 1.0)) != 1.0:
            refuse("partial_rotary_factor != 1 is not mapped")
        rope_scaling(hf_config)  # refuses rope types other than default and llama3
        if self.experts:
            # Qwen3-MoE can keep dense MLPs in some layers (mlp_only_layers, decoder_sparse_step):
            # Megatron's moe_layer_freq could say which, but the name table is one for all layers
            step, dense = getattr(hf_config, "decoder_sparse_step", 1), getattr(hf_config, "mlp_only_layers", None) or []
            if step != 1 or dense:
                refuse(f"dense MLP layers among the expert layers (decoder_sparse_step={step}, mlp_only_layers={dense}) "
                       "are not mapped: every layer must be a mixture of experts")
            if hf_config.num_experts_per_tok == 1 and getattr(hf_config, "norm_topk_prob", False):
                refuse("norm_topk_prob with one expert per token is not mapped (Megatron's router refuses a softmax "
                       "over the top-1 logit alone: its weight is always 1)")

    def transformer_kwargs(self, hf_config) -> dict:
        """The architecture's ``TransformerConfig`` fields (the trainer adds parallelism, dtype, init)."""
        heads, groups, head_dim = attention_shape(hf_config)
        return dict(
            num_layers=hf_config.num_hidden_layers,
            hidden_size=hf_config.hidden_size,
            ffn_hidden_size=hf_config.intermediate_size,
            num_attention_heads=heads,
            num_query_groups=groups,
            kv_channels=head_dim,
            normalization="RMSNorm",
            layernorm_epsilon=hf_config.rms_norm_eps,  # also the q/k norms' (as in Qwen3)
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            add_qkv_bias=self.qkv_bias,
            qk_layernorm=self.qk_layernorm,
            **(self.moe_kwargs(hf_config) if self.experts else {}),
        )

    @staticmethod
    def moe_kwargs(hf_config) -> dict:
        """Qwen3-MoE's router and experts as Megatron-Core's. transformers' router takes the softmax
        over all experts, keeps the top k and, with ``norm_topk_prob``, renormalises them: that is
        the softmax over the top k logits, Megatron's default (``moe_router_pre_softmax=False``);
        without it, the top k of the softmax over all (``moe_router_pre_softmax=True``). No
        load-balancing loss (the torch trainer's ``router_balance`` is not mapped) and no
        capacity: every token goes to its k experts, as in transformers and vLLM."""
        return dict(
            num_moe_experts=hf_config.num_experts,
            moe_router_topk=hf_config.num_experts_per_tok,
            moe_ffn_hidden_size=hf_config.moe_intermediate_size,
            moe_router_pre_softmax=not getattr(hf_config, "norm_topk_prob", False),
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_expert_capacity_factor=None,
            moe_grouped_gemm=False,  # SequentialMLP: the local spec's grouped GEMM needs the grouped_gemm package
        )

    def model_rules(self, hf_config) -> tuple[Rule, ...]:
        """The name table outside the layers; the output layer only when not tied to the embeddings."""
        return (EMBEDDING, FINAL_NORM) + (() if hf_config.tie_word_embeddings else (OUTPUT,))


ARCHITECTURES = (
    Architecture("Llama 3.x", ("llama",), LLAMA_LAYER),
    Architecture("Qwen2 / Qwen2.5", ("qwen2",), LLAMA_LAYER + QKV_BIAS),
    Architecture("Qwen3 (dense)", ("qwen3",), LLAMA_LAYER + QK_NORM),
    Architecture("Qwen3-MoE", ("qwen3_moe",), ATTENTION + QK_NORM + EXPERTS, fused=QWEN3_MOE_FUSED),
    Architecture("Gemma 3 (text)", ("gemma3_text",), refused=(
        "its layers alternate sliding-window (local) and full (global) attention, each kind with its own rotary base "
        "(rope_parameters for sliding_attention and full_attention), and Megatron-Core's GPTModel has one rotary "
        "embedding for all layers and yattflow's SDPA attention no window; its 'sandwich' norms "
        "(pre/post_feedforward_layernorm, post_attention_layernorm after attention) have no place in the local "
        "TransformerLayer, and its (1 + weight) RMSNorm, sqrt(hidden_size)-scaled embeddings and GeGLU MLP would need "
        "changes of their own: train it with train.backend=torch")),
    Architecture("Qwen3.5 (text)", ("qwen3_5_text",), refused=(
        "its layers are mostly Gated DeltaNet linear attention (layer_types 'linear_attention': a causal convolution and "
        "a gated delta-rule recurrence), which Megatron-Core's GPT layer spec has no module for, beside gated full "
        "attention with a partial rotary embedding: train it with train.backend=torch")),
)
BY_MODEL_TYPE = {t: a for a in ARCHITECTURES for t in a.model_types}


def architecture(hf_config) -> Architecture:
    """The record of a Hugging Face config, checked: ``Unsupported`` names the model_type and why."""
    model_type = getattr(hf_config, "model_type", None)
    arch = BY_MODEL_TYPE.get(model_type)
    if arch is None:
        mapped = ", ".join(f"{a.family} ({'/'.join(a.model_types)})" for a in ARCHITECTURES if not a.refused)
        raise Unsupported(f"model_type {model_type!r} is not mapped to Megatron-Core; the mapped architectures are {mapped}")
    arch.check(hf_config)
    return arch


def attention_shape(hf_config) -> tuple[int, int, int]:
    """(query heads, key/value groups, head dim)."""
    heads = hf_config.num_attention_heads
    groups = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return heads, groups, head_dim


def rope_parameters(hf_config) -> dict:
    """transformers >= 5 keeps them in ``rope_parameters``; 4.x in ``rope_scaling`` and ``rope_theta``."""
    params = dict(getattr(hf_config, "rope_scaling", None) or {})
    params.update(getattr(hf_config, "rope_parameters", None) or {})
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", None) or 10000.0)
    return params


def rope_theta(hf_config) -> float:
    return float(rope_parameters(hf_config)["rope_theta"])


def rope_scaling(hf_config) -> dict | None:
    """Llama 3's frequency-scaling parameters (``LLAMA3_ROPE``), None for plain RoPE; other rope
    types (linear, dynamic, yarn, longrope, ...) are refused."""
    params = rope_parameters(hf_config)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type == "default":
        return None
    if rope_type != "llama3":
        raise Unsupported(f"model_type {hf_config.model_type!r}: rope_type {rope_type!r} is not mapped to Megatron "
                          "(only 'default' and 'llama3')")
    missing = [k for k in LLAMA3_ROPE if k not in params]
    if missing:
        raise Unsupported(f"model_type {hf_config.model_type!r}: rope_type 'llama3' without {missing}")
    return {k: float(params[k]) for k in LLAMA3_ROPE}
