"""Mixture-of-experts routing on the torch engines: record the experts each token took, replay them.

A MoE policy's rollout and trainer compute the router's logits in different kernels (vLLM or bf16
autocast against the fp32 trainer); where two experts are nearly tied they choose differently, and
the trainer then scores a sampled token under another network than the one that sampled it: the
train-vs-rollout gap that grows until training collapses (Megatron-LM #4168, NeMo-RL #2590).
Router replay ("R3", ``train.router_replay``): the rollout records, per token it fed and per MoE
layer, the experts the router chose (``Generation.routed_experts``); the trainer's forward takes
those experts. The weights among them are still the trainer's router's (softmax of its logits at
the replayed experts, renormalised as the model does), so the router keeps its gradient.

A sequence's routes are one flat list: for each token the engine fed (the prompt and every sampled
token but the last, which nothing reads), for each MoE layer, the top-k expert indices; -1 where a
route is unknown (the trainer's router chooses there).
"""

from __future__ import annotations

import contextlib

import torch

# routers whose scores are softmax(logits) at the top-k experts, renormalised per ``norm_topk_prob``
# (Mixtral: always), answering (logits, scores, indices): what a replay recomputes, by class name
SOFTMAX_TOP_K = ("Qwen3MoeTopKRouter", "Qwen2MoeTopKRouter", "MixtralTopKRouter")


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's expert routers, in layer order (none: a dense model)."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


def shape(model: torch.nn.Module) -> tuple[int, int]:
    """(MoE layers, experts per token) of a routed model."""
    found = routers(model)
    return len(found), found[0].top_k


def check_replayable(model: torch.nn.Module, model_dir: str) -> None:
    """``train.router_replay`` on a model it can replay, else a ValueError naming why."""
    found = routers(model)
    if not found:
        raise ValueError(f"train.router_replay: {model_dir} has no mixture-of-experts router to replay "
                         f"({type(model).__name__} is dense); set train.router_replay=false")
    unknown = sorted({type(m).__name__ for m in found} - set(SOFTMAX_TOP_K))
    if unknown:
        raise ValueError(f"train.router_replay: the router {unknown[0]} of {model_dir} is not one replay knows how to "
                         f"score (those are {', '.join(SOFTMAX_TOP_K)})")


@contextlib.contextmanager
def recording(model: torch.nn.Module):
    """Within the block, every router call's chosen experts are kept: answers one list per router of
    the [rows, top_k] index tensors, call by call (a forward's rows are its batch x positions)."""
    found = routers(model)
    calls: list[list[torch.Tensor]] = [[] for _ in found]
    hooks = [r.register_forward_hook(lambda _m, _i, out, kept=kept: kept.append(out[2].detach().to("cpu", torch.int16)))
             for r, kept in zip(found, calls)]
    try:
        yield calls
    finally:
        for h in hooks:
            h.remove()


def generated_routes(calls: list[list[torch.Tensor]], attention_mask: torch.Tensor, ends: list[int]) -> list[list[int]]:
    """Each row's routes from a ``generate()`` recorded with :func:`recording`: the first call of each
    router is the prefill over the left-padded prompts (``attention_mask`` marks their tokens), each
    later call one decode step; row ``b`` fed its prompt and its first ``ends[b] - 1`` sampled tokens."""
    batch, width = attention_mask.shape
    per_layer = []
    for prefill, *steps in calls:
        k = prefill.shape[-1]
        prompt = prefill.view(batch, width, k)
        decoded = torch.stack([s.view(batch, k) for s in steps], 1) if steps else prefill.new_empty(batch, 0, k)
        per_layer.append((prompt, decoded))
    routes = []
    for b, end in enumerate(ends):
        keep = attention_mask[b].bool().cpu()
        # [tokens, layers, top_k]
        fed = torch.stack([torch.cat([p[b][keep], d[b, : max(end - 1, 0)]]) for p, d in per_layer], 1)
        routes.append(fed.view(-1).tolist())
    return routes


@contextlib.contextmanager
def replaying(model: torch.nn.Module, routes: torch.Tensor | None):
    """Within the block, the model's routers take the experts in ``routes`` ([rows, width, layers,
    top_k], ``batching.padded_routes``, -1: the router's own choice); None: nothing replayed."""
    if routes is None:
        yield
        return

    def hook(module, _inputs, out, layer):
        logits, own_scores, own = out
        chosen = routes[:, :, layer].reshape(own.shape).to(own.device)  # a router's rows: batch x positions
        indices = torch.where(chosen >= 0, chosen, own)
        scores = torch.softmax(logits.float(), dim=-1).gather(-1, indices)
        if getattr(module, "norm_topk_prob", True):
            scores = scores / scores.sum(-1, keepdim=True)
        return logits, scores.to(own_scores.dtype), indices

    hooks = [r.register_forward_hook(lambda m, i, o, layer=layer: hook(m, i, o, layer))
             for layer, r in enumerate(routers(model))]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


def balance_loss(router_logits: list[torch.Tensor], mask: torch.Tensor, top_k: int) -> torch.Tensor:
    """The Switch Transformer's load-balancing loss over the tokens ``mask`` marks ([rows] flat),
    averaged over layers: experts x sum_i (fraction of routes to expert i) x (mean router probability
    of expert i). ``top_k`` when the load is even, ``experts`` when one expert takes every token."""
    weight = mask.float().view(-1, 1)
    total = weight.sum().clamp(min=1)
    losses = []
    for logits in router_logits:
        probs = torch.softmax(logits.float(), -1)
        experts = probs.shape[-1]
        chosen = torch.zeros_like(probs).scatter_(-1, probs.topk(top_k, -1).indices, 1.0)
        fraction = (chosen * weight).sum(0) / total
        mean_prob = (probs * weight).sum(0) / total
        losses.append(experts * (fraction * mean_prob).sum())
    return torch.stack(losses).mean()


@contextlib.contextmanager
def router_logits(model: torch.nn.Module):
    """Within the block, the logits (with their graph) of every router call that computes gradients
    are kept, in layer order: what :func:`balance_loss` reads (a no-grad reference pass adds none)."""
    kept: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda _m, _i, out: kept.append(out[0]) if torch.is_grad_enabled() else None)
             for r in routers(model)]
    try:
        yield kept
    finally:
        for h in hooks:
            h.remove()
