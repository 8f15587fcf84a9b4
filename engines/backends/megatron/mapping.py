"""Hugging Face <-> Megatron-Core parameter mapping for GPT models (Llama, Qwen2).

Megatron-Core has no Hugging Face converter for GPT models; ``hf_to_megatron`` and
``megatron_to_hf`` are the Llama/Qwen2 mapping of the local (non-Transformer-Engine) layer spec.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors.torch import load_file

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
