"""Router replay on the Megatron trainer (``train.router_replay``): its MoE layers take the experts
the rollout recorded for each token (why: ``engines/backends/torch/routing.py``, the torch
trainer's side, which reads the same ``TrainBatch.routed_experts``).

Megatron-Core's ``TopKRouter`` asks its ``router_replay`` for a layer's top-k when one is set (its
own ``RouterReplay`` replays every token or none); :class:`Replayed` stands in for it and replays
per token: the rollout's experts where known, the router's own choice where not (a sequence's last
token, padding, a sequence without routes). The weights among them are the router's own scores
there, which Megatron then normalises as it always does (softmax over the chosen logits), so the
router keeps its gradient.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.router import TopKRouter


class Replayed:
    """One MoE layer's replayed experts: ``target`` [tokens, top_k] in the order the router sees
    tokens (sequence-major), -1 where the router chooses; None: nothing replayed."""

    def __init__(self):
        self.target: torch.Tensor | None = None

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        chosen, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.target is None:
            return chosen, own
        indices = torch.where(self.target >= 0, self.target.to(own.device), own)
        return scores.gather(1, indices), indices


def install(model: torch.nn.Module) -> list[Replayed]:
    """Every MoE layer of ``model`` (a policy, not its reference) replays from now on, in layer order."""
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    for router in routers:
        router.router_replay = Replayed()
    return [router.router_replay for router in routers]


def set_routes(layers: list[Replayed], routes: torch.Tensor | None) -> None:
    """The next forward's routes: ``routes`` [rows, width, layers, top_k] (``batching.padded_routes``,
    the ids' batch-major order) or None (the router's own everywhere)."""
    for layer, replay in enumerate(layers):
        replay.target = None if routes is None else routes[:, :, layer].transpose(0, 1).reshape(-1, routes.shape[-1])
