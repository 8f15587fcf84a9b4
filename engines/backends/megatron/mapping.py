"""Hugging Face <-> Megatron-Core parameter mapping for GPT models, driven by the name tables of
``architectures.py``.

Megatron-Core has no Hugging Face converter for GPT models; ``hf_to_megatron`` and
``megatron_to_hf`` move tensors between the two through an architecture's table (the local,
non-Transformer-Engine layer spec's names). A load is strict both ways: ``hf_to_megatron`` fails
naming every Hugging Face tensor the table left unconsumed (a q/k norm dropped without a word would
train a different model), ``model.build_gpt`` every Megatron parameter left unfilled.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors.torch import load_file

from engines.backends.megatron.architectures import Rule, architecture, attention_shape

# Megatron splits the vocabulary evenly over TP ranks. Padding it to a fixed multiple (rather than
# to a multiple of the TP size) keeps checkpoint shapes independent of the TP size; real
# vocabularies (Llama 3: 128256, Qwen2: 151936) are already multiples and get no padding.
VOCAB_MULTIPLE = 128
# Hugging Face tensors that carry no weights: rotary tables some older checkpoints saved (recomputed)
IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")


class MappingError(RuntimeError):
    """Hugging Face tensors and Megatron parameters do not correspond one to one."""


def padded_vocab_size(hf_config) -> int:
    return -(-hf_config.vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def _rules(hf_config) -> list[tuple[str, tuple[str, ...], Rule]]:
    """(Megatron name, Hugging Face names, rule) for every parameter of the model."""
    arch = architecture(hf_config)
    out = [(r.megatron, r.hf, r) for r in arch.model_rules(hf_config)]
    for i in range(hf_config.num_hidden_layers):
        out += [(f"decoder.layers.{i}.{r.megatron}", tuple(f"model.layers.{i}.{h}" for h in r.hf), r) for r in arch.layer]
    return out


def hf_to_megatron(hf_state: dict, hf_config, tp_rank: int = 0, tp_size: int = 1) -> dict[str, torch.Tensor]:
    """Hugging Face tensors → the state dict of TP rank ``tp_rank`` of a Megatron ``GPTModel``;
    ``MappingError`` if a tensor the table needs is absent or one it does not know is left over.

    Layouts (``architectures.Rule``): Megatron fuses Q, K and V into one ``linear_qkv`` whose rows
    are grouped per key/value group (that group's query heads, then its key head, then its value
    head) so that a TP split along rows hands each rank whole groups. ``linear_fc1`` is [gate; up]
    *per rank*, because each rank applies SwiGLU to its own half-and-half. The vocabulary is
    padded (zero rows, masked out of the log-softmax) to a multiple of ``VOCAB_MULTIPLE``.

    The local layer spec's norms are modules of their own (``input_layernorm``,
    ``pre_mlp_layernorm``); Transformer Engine's spec fuses them into
    ``linear_qkv.layer_norm_weight`` / ``linear_fc1.layer_norm_weight``, which is also how the
    local spec names them in ``dist_checkpointing`` checkpoints, so those stay interchangeable.
    """
    heads, groups, _ = attention_shape(hf_config)
    if heads % tp_size or groups % tp_size:
        # fewer key/value heads than TP ranks would need each rank's copy of a shared head (Megatron
        # replicates them); the grouped split below would hand rank 0 queries and rank 1 keys
        raise ValueError(f"{heads} query heads and {groups} key/value heads do not split over {tp_size} TP ranks")
    vocab = padded_vocab_size(hf_config)

    def split(t: torch.Tensor, dim: int) -> torch.Tensor:
        if t.shape[dim] % tp_size:
            raise ValueError(f"dimension {dim} of a {tuple(t.shape)} tensor does not split over {tp_size} TP ranks")
        return t.chunk(tp_size, dim)[tp_rank]

    rules = _rules(hf_config)
    absent = [h for _, names, _ in rules for h in names if h not in hf_state]
    if absent:
        raise MappingError(f"model_type {hf_config.model_type!r}: Hugging Face tensors the mapping needs are absent: {absent}")
    out: dict[str, torch.Tensor] = {}
    for name, hf_names, rule in rules:
        ts = [hf_state[h] for h in hf_names]
        if rule.layout == "replicated":
            out[name] = ts[0]
        elif rule.layout == "row":
            out[name] = split(ts[0], 1)
        elif rule.layout == "vocab":
            t = ts[0]
            out[name] = split(torch.cat([t, t.new_zeros(vocab - t.shape[0], *t.shape[1:])]), 0)
        elif rule.layout == "qkv":
            grouped = torch.cat([t.unflatten(0, (groups, -1)) for t in ts], 1)
            out[name] = split(grouped.flatten(0, 1), 0)
        elif rule.layout == "gate_up":
            out[name] = torch.cat([split(t, 0) for t in ts])
        else:
            raise ValueError(f"{rule}: unknown layout")
    consumed = {h for _, names, _ in rules for h in names}
    leftover = [k for k in hf_state if k not in consumed and not IGNORED.fullmatch(k)]
    if hf_config.tie_word_embeddings and "lm_head.weight" in leftover:
        # some checkpoints of tied models save the output layer too: it must be the embedding
        if not torch.equal(hf_state["lm_head.weight"], hf_state["model.embed_tokens.weight"]):
            raise MappingError("tie_word_embeddings is true but lm_head.weight differs from model.embed_tokens.weight")
        leftover.remove("lm_head.weight")
    if leftover:
        raise MappingError(f"model_type {hf_config.model_type!r}: Hugging Face tensors the Megatron mapping does not "
                           f"consume (they would be dropped): {sorted(leftover)}")
    return out


def stage_state(state: dict[str, torch.Tensor], offset: int, layers: int, first: bool, last: bool,
                tied: bool) -> dict[str, torch.Tensor]:
    """The part of a whole model's Megatron state dict (global layer numbers) that one pipeline
    stage holds: its ``layers`` layers from ``offset`` on, renumbered from 0 as the stage's
    ``TransformerBlock`` names them, the embedding on the first stage, the final norm and output
    layer on the last. A tied output layer on a last stage that is not also the first is its own
    copy of the embedding (Megatron keeps the two in step: ``finalize_model_grads`` sums their
    gradients over the embedding group)."""
    out = {}
    for name, tensor in state.items():
        match = LAYER.fullmatch(name)
        if match:
            index = int(match.group(1)) - offset
            if 0 <= index < layers:
                out[f"decoder.layers.{index}.{match.group(2)}"] = tensor
        elif name.startswith("embedding.") and first or not name.startswith("embedding.") and last:
            out[name] = tensor
    if tied and last and not first:
        out["output_layer.weight"] = state["embedding.word_embeddings.weight"]
    return out


def global_name(name: str, offset: int) -> str:
    """A stage's parameter name (its layers numbered from 0) → the whole model's."""
    match = LAYER.fullmatch(name)
    return f"decoder.layers.{int(match.group(1)) + offset}.{match.group(2)}" if match else name


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
    """One Megatron parameter (every TP rank's shard, in rank order) → its Hugging Face tensors."""
    arch = architecture(hf_config)
    match = LAYER.fullmatch(name)
    if match:
        prefix, table, rest = f"model.layers.{match.group(1)}.", arch.layer, match.group(2)
    else:
        prefix, table, rest = "", arch.model_rules(hf_config), name
    rule = next((r for r in table if r.megatron == rest), None)
    if rule is None:
        raise MappingError(f"model_type {hf_config.model_type!r}: no Hugging Face name for Megatron parameter {name!r}")
    hf_names = [prefix + h for h in rule.hf]
    if rule.layout == "replicated":
        return {hf_names[0]: shards[0]}
    if rule.layout == "row":
        return {hf_names[0]: torch.cat(shards, 1)}
    if rule.layout == "vocab":
        return {hf_names[0]: torch.cat(shards)[: hf_config.vocab_size]}
    if rule.layout == "qkv":
        heads, groups, head_dim = attention_shape(hf_config)
        grouped = torch.cat(shards).unflatten(0, (groups, -1))
        q, k, v = grouped.split([heads // groups * head_dim, head_dim, head_dim], dim=1)
        return {h: t.flatten(0, 1) for h, t in zip(hf_names, (q, k, v))}
    if rule.layout == "gate_up":
        halves = [s.chunk(2) for s in shards]
        return {hf_names[0]: torch.cat([g for g, _ in halves]), hf_names[1]: torch.cat([u for _, u in halves])}
    raise ValueError(f"{rule}: unknown layout")


def load_hf_state(model_dir: str | Path) -> dict[str, torch.Tensor]:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state
