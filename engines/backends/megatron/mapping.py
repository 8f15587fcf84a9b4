"""Hugging Face <-> Megatron-Core parameter mapping for GPT models, driven by the name tables of
``architectures.py``.

Megatron-Core has no Hugging Face converter for GPT models; ``hf_to_megatron`` and
``megatron_to_hf`` move tensors between the two through an architecture's table (the local,
non-Transformer-Engine layer spec's names). A load is strict both ways: ``hf_to_megatron`` fails
naming every Hugging Face tensor the table left unconsumed (a q/k norm dropped without a word would
train a different model), ``model.build_gpt`` every Megatron parameter left unfilled.

A mixture of experts' table names each expert's tensors as checkpoints do; transformers >= 5
holds them fused per layer (``architectures.Fused``). ``hf_to_megatron`` takes either (it unfuses
first), ``megatron_to_hf`` gives the checkpoint's names, and ``fuse_experts`` turns a stream of
those into transformers' own (what the trainer exports to the rollout engines). Over ``ep_size``
expert-parallel ranks, rank r holds experts r·E/ep_size … (r+1)·E/ep_size − 1, numbered from 0 in
its ``local_experts``; names of the whole model number them as one rank would.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch
from safetensors import safe_open

from engines.backends.megatron.architectures import Architecture, Rule, architecture, attention_shape

# Megatron splits the vocabulary evenly over TP ranks. Padding it to a fixed multiple (rather than
# to a multiple of the TP size) keeps checkpoint shapes independent of the TP size; real
# vocabularies (Llama 3: 128256, Qwen2: 151936) are already multiples and get no padding.
VOCAB_MULTIPLE = 128
# Hugging Face tensors that carry no weights: rotary tables some older checkpoints saved (recomputed)
IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
EXPERT = re.compile(r"(.*\.local_experts\.)(\d+)(\..+)")  # a Megatron expert parameter, its number in the middle


class MappingError(RuntimeError):
    """Hugging Face tensors and Megatron parameters do not correspond one to one."""


def padded_vocab_size(hf_config) -> int:
    return -(-hf_config.vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def _experts(rule: Rule, hf_config) -> range:
    """The expert numbers a rule stands for: every expert's for an ``{e}`` rule, else one (unused)."""
    return range(hf_config.num_experts) if "{e}" in rule.megatron else range(1)


def _rules(hf_config) -> list[tuple[str, tuple[str, ...], Rule]]:
    """(Megatron name, Hugging Face names, rule) for every parameter of the whole model (experts
    numbered as on one expert-parallel rank)."""
    arch = architecture(hf_config)
    out = [(r.megatron, r.hf, r) for r in arch.model_rules(hf_config)]
    for i in range(hf_config.num_hidden_layers):
        out += [(f"decoder.layers.{i}.{r.megatron.format(e=e)}", tuple(f"model.layers.{i}.{h.format(e=e)}" for h in r.hf), r)
                for r in arch.layer for e in _experts(r, hf_config)]
    return out


def local_expert(name: str, hf_config, ep_rank: int, ep_size: int) -> str | None:
    """A whole-model Megatron name → expert-parallel rank ``ep_rank``'s (its experts numbered from
    0); None for an expert another rank holds. Names of other parameters come back as they are."""
    match = EXPERT.fullmatch(name)
    if match is None or ep_size == 1:
        return name
    per_rank = hf_config.num_experts // ep_size
    rank, local = divmod(int(match.group(2)), per_rank)
    return f"{match.group(1)}{local}{match.group(3)}" if rank == ep_rank else None


def global_expert(name: str, hf_config, ep_rank: int, ep_size: int) -> str:
    """The inverse of :func:`local_expert`: rank ``ep_rank``'s expert parameter → its whole-model name."""
    match = EXPERT.fullmatch(name)
    if match is None or ep_size == 1:
        return name
    return f"{match.group(1)}{ep_rank * (hf_config.num_experts // ep_size) + int(match.group(2))}{match.group(3)}"


def _fused(arch: Architecture, hf_config):
    """(layer, Fused, its per-expert Hugging Face names expert by expert) of every fused tensor."""
    for i in range(hf_config.num_hidden_layers):
        for f in arch.fused:
            yield i, f, [[f"model.layers.{i}.{p.format(e=e)}" for p in f.parts] for e in range(hf_config.num_experts)]


def unfuse_experts(hf_state: dict[str, torch.Tensor], hf_config) -> dict[str, torch.Tensor]:
    """transformers' fused expert tensors (``architectures.Fused``) → each expert's, under the names
    checkpoints use; every other tensor as it is (a dense model's state is returned unchanged)."""
    arch = architecture(hf_config)
    if not arch.fused:
        return hf_state
    out = dict(hf_state)
    for i, f, names in _fused(arch, hf_config):
        fused = out.pop(f"model.layers.{i}.{f.model}", None)
        if fused is None:
            continue
        if fused.shape[0] != len(names):
            raise MappingError(f"model.layers.{i}.{f.model}: {fused.shape[0]} experts, the config says {len(names)}")
        for expert, parts in zip(fused, names):
            for name, part in zip(parts, expert.chunk(len(parts))):
                if name in out:
                    raise MappingError(f"{name} is given twice: on its own and in model.layers.{i}.{f.model}")
                out[name] = part
    return out


def fuse_experts(tensors: Iterable[tuple[str, torch.Tensor]], hf_config) -> Iterator[tuple[str, torch.Tensor]]:
    """Hugging Face-named tensors (checkpoint names, as ``megatron_to_hf`` gives them) → the names
    and shapes of transformers' model (its ``named_parameters``): a mixture of experts' per-expert
    tensors are held back until their layer's are all there, then yielded fused. Streams: one
    layer's experts at a time are held."""
    arch = architecture(hf_config)
    waiting: dict[str, tuple[str, list[list[str]]]] = {}  # a per-expert name → its fused name, all its parts
    for i, f, names in _fused(arch, hf_config):
        waiting.update({n: (f"model.layers.{i}.{f.model}", names) for parts in names for n in parts})
    held: dict[str, torch.Tensor] = {}
    for name, tensor in tensors:
        if name not in waiting:
            yield name, tensor
            continue
        held[name] = tensor
        fused, names = waiting[name]
        if all(n in held for parts in names for n in parts):
            yield fused, torch.stack([torch.cat([held.pop(n) for n in parts]) for parts in names])
    if held:
        raise MappingError(f"model_type {hf_config.model_type!r}: expert tensors whose layer's others never came: {sorted(held)}")


def hf_to_megatron(hf_state: Mapping, hf_config, tp_rank: int = 0, tp_size: int = 1, ep_rank: int = 0,
                   ep_size: int = 1) -> dict[str, torch.Tensor]:
    """Hugging Face tensors → the state dict of TP rank ``tp_rank`` (and expert-parallel rank
    ``ep_rank``: its experts only) of a Megatron ``GPTModel`` (:func:`megatron_tensors`, all of them)."""
    return dict(megatron_tensors(hf_state, hf_config, tp_rank, tp_size, ep_rank, ep_size))


def megatron_tensors(hf_state: Mapping, hf_config, tp_rank: int = 0, tp_size: int = 1, ep_rank: int = 0,
                     ep_size: int = 1, keep: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Hugging Face tensors → (whole-model Megatron name, TP rank ``tp_rank``'s tensor) of a
    Megatron ``GPTModel``, one at a time (expert-parallel rank ``ep_rank``: its experts only);
    ``MappingError`` before the first if a tensor the table needs is absent or one it does not know
    is left over. A mixture of experts' tensors may come per expert (checkpoints) or fused
    (transformers' model). ``keep``: the names wanted (a pipeline stage's); the others' tensors are
    never read from ``hf_state`` (an ``HFState`` reads each when asked). A TP rank keeps its slice
    of each tensor, not the whole.

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
    if getattr(hf_config, "num_experts", None) and hf_config.num_experts % ep_size:
        raise ValueError(f"{hf_config.num_experts} experts do not split over {ep_size} expert-parallel ranks")
    hf_state = unfuse_experts(hf_state, hf_config)

    def split(t: torch.Tensor, dim: int) -> torch.Tensor:
        if t.shape[dim] % tp_size:
            raise ValueError(f"dimension {dim} of a {tuple(t.shape)} tensor does not split over {tp_size} TP ranks")
        return t.chunk(tp_size, dim)[tp_rank].clone() if tp_size > 1 else t  # a copy: the whole tensor is freed

    rules = _rules(hf_config)
    absent = [h for _, names, _ in rules for h in names if h not in hf_state]
    if absent:
        raise MappingError(f"model_type {hf_config.model_type!r}: Hugging Face tensors the mapping needs are absent: {absent}")
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
    for name, hf_names, rule in rules:
        name = local_expert(name, hf_config, ep_rank, ep_size)
        if name is None or keep is not None and not keep(name):  # another expert-parallel rank's expert, or stage's
            continue
        ts = [hf_state[h] for h in hf_names]
        if rule.layout == "replicated":
            yield name, ts[0]
        elif rule.layout == "row":
            yield name, split(ts[0], 1)
        elif rule.layout == "vocab":
            t = ts[0]
            yield name, split(torch.cat([t, t.new_zeros(vocab - t.shape[0], *t.shape[1:])]), 0)
        elif rule.layout == "qkv":
            grouped = torch.cat([t.unflatten(0, (groups, -1)) for t in ts], 1)
            yield name, split(grouped.flatten(0, 1), 0)
        elif rule.layout == "gate_up":
            yield name, torch.cat([split(t, 0) for t in ts])
        else:
            raise ValueError(f"{rule}: unknown layout")


def stage_name(name: str, offset: int, layers: int, first: bool, last: bool, tied: bool) -> str | None:
    """A whole model's Megatron parameter → its name in the pipeline stage that holds it, or None
    for another stage's: the stage's ``layers`` layers from ``offset`` on, renumbered from 0 as
    its ``TransformerBlock`` names them, the embedding on the first stage, the final norm and output
    layer on the last. A tied output layer on a last stage that is not also the first is its own
    copy of the embedding (Megatron keeps the two in step: ``finalize_model_grads`` sums their
    gradients over the embedding group)."""
    match = LAYER.fullmatch(name)
    if match:
        index = int(match.group(1)) - offset
        return f"decoder.layers.{index}.{match.group(2)}" if 0 <= index < layers else None
    if name.startswith("embedding."):
        if first:
            return name
        return "output_layer.weight" if last and tied and name == "embedding.word_embeddings.weight" else None
    return name if last else None


def global_name(name: str, offset: int) -> str:
    """A stage's parameter name (its layers numbered from 0) → the whole model's."""
    match = LAYER.fullmatch(name)
    return f"decoder.layers.{int(match.group(1)) + offset}.{match.group(2)}" if match else name


def megatron_to_hf(mcore_state: dict | list[dict], hf_config) -> dict[str, torch.Tensor]:
    """Megatron tensors → Hugging Face tensors; the inverse of :func:`hf_to_megatron`.

    ``mcore_state`` is one state dict (TP size 1) or the list of every TP rank's, in rank
    order, under whole-model names (experts numbered as on one expert-parallel rank). Only the
    keys present are converted, so a caller can stream a model one layer at a time. A mixture of
    experts' tensors come per expert, under the names checkpoints use (``fuse_experts``: transformers').
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
    expert = EXPERT.fullmatch(rest)  # an expert's parameter: its rule has {e} for the number
    key, number = (f"{expert.group(1)}{{e}}{expert.group(3)}", int(expert.group(2))) if expert else (rest, None)
    rule = next((r for r in table if r.megatron == key), None)
    if rule is None:
        raise MappingError(f"model_type {hf_config.model_type!r}: no Hugging Face name for Megatron parameter {name!r}")
    hf_names = [prefix + h.format(e=number) for h in rule.hf]
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
    """Every tensor of a Hugging Face folder, in memory (a whole model: tests and small folders)."""
    return dict(HFState.open(model_dir).items())


class HFState(Mapping):
    """A Hugging Face folder's tensors by name, each read from its safetensors file when asked for
    (memory-mapped, copied out one at a time): a pipeline stage or a TP rank that builds its share
    of a model reads its share, not the whole folder (``hf_to_megatron``'s ``keep``)."""

    def __init__(self, index: dict[str, tuple[str, str]]):
        self.index = index  # name -> (file, name in the file)

    @classmethod
    def open(cls, model_dir: str | Path) -> "HFState":
        files = sorted(Path(model_dir).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{model_dir}: no *.safetensors weights")
        index = {}
        for f in files:
            with safe_open(str(f), framework="pt") as opened:
                index |= {name: (str(f), name) for name in opened.keys()}
        return cls(index)

    def __getitem__(self, name: str) -> torch.Tensor:
        file, stored = self.index[name]
        with safe_open(file, framework="pt") as opened:
            return opened.get_tensor(stored)

    def __contains__(self, name) -> bool:  # (Mapping's would read the tensor)
        return name in self.index

    def __iter__(self) -> Iterator[str]:
        return iter(self.index)

    def __len__(self) -> int:
        return len(self.index)

    def view(self, names: dict[str, str]) -> "HFState":
        """Some of the tensors under other names: ``{new name: name here}``."""
        return HFState({new: self.index[old] for new, old in names.items()})
