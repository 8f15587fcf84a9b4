"""Padding and micro-batching of a ``TrainBatch``: shared by the torch and Megatron trainers."""

from __future__ import annotations

import torch

from engines.backends.base import TrainBatch


def pad_batch(batch: TrainBatch, pad_id: int):
    """Right-padded ids, attention mask and response mask (aligned with logprobs[:, 1:]); an
    episode's observation tokens (``TrainBatch.loss_mask`` 0) are 0 in the response mask, so
    that the loss and every statistic read only the tokens the policy sampled."""
    seqs = [p + r for p, r in zip(batch.prompt_ids, batch.response_ids)]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    resp = torch.zeros((len(seqs), width - 1))
    old = torch.zeros((len(seqs), width - 1))
    for i, (p, r, lp) in enumerate(zip(batch.prompt_ids, batch.response_ids, batch.old_logprobs)):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        attn[i, : len(p) + len(r)] = 1
        resp[i, len(p) - 1 : len(p) - 1 + len(r)] = 1
        old[i, len(p) - 1 : len(p) - 1 + len(r)] = torch.tensor(lp)
        if batch.loss_mask is not None and batch.loss_mask[i] is not None:
            resp[i, len(p) - 1 : len(p) - 1 + len(r)] = torch.tensor(batch.loss_mask[i], dtype=resp.dtype)
    return ids, attn, resp, old


def response_values(values: torch.Tensor, batch: TrainBatch) -> list[list[float]]:
    """Each sequence's ``values`` [batch, width - 1] (aligned as :func:`pad_batch`'s response mask)
    at its response tokens, observations included: one per response token."""
    return [values[i, len(p) - 1 : len(p) - 1 + len(r)].tolist()
            for i, (p, r) in enumerate(zip(batch.prompt_ids, batch.response_ids))]


def pad_weights(batch: TrainBatch) -> torch.Tensor | None:
    """The off-policy correction's per-token weights (``TrainBatch.is_weights``) aligned like
    :func:`pad_batch`'s response mask; None when the batch has none (``train.old_policy=bypass``)."""
    if batch.is_weights is None:
        return None
    width = max(len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids))
    out = torch.zeros((len(batch), width - 1))
    for i, (p, w) in enumerate(zip(batch.prompt_ids, batch.is_weights)):
        out[i, len(p) - 1 : len(p) - 1 + len(w)] = torch.tensor(w)
    return out


def micro_batches(batch: TrainBatch, max_tokens: int | None, unit: int = 1) -> list[TrainBatch]:
    """``batch`` cut into forward passes of at most ``max_tokens`` *padded* tokens each (rows x
    longest row, what :func:`pad_batch` computes), so that short rows are padded to short rows
    rather than to the minibatch's longest. ``None``: one pass, rows in their order; empty: none.

    Rows are sorted longest first and cut into consecutive passes: the fewest passes the budget
    allows (as many forwards as filling each pass greedily) and, among those, the cuts that pad
    least, so a pass does not mix long and short rows when another cut avoids it. A row longer
    than ``max_tokens`` is a pass of its own. Passes come longest first (running out of memory
    shows on the first). Cost: rows x rows-per-pass steps.

    Which rows share a pass changes only float summation order: every pass's loss is
    normalised by the whole (DP-global) minibatch's counts and gradients accumulate.

    ``unit``: runs of that many consecutive rows (a pair algorithm's (chosen, rejected)) are
    placed as one item, as long as its longest row, and always share a pass."""
    if not len(batch):
        return []
    if max_tokens is None:
        return [batch]
    rows = [len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)]
    length = [max(rows[u : u + unit]) for u in range(0, len(rows), unit)]  # per item: ``unit`` rows
    order = sorted(range(len(length)), key=lambda i: -length[i])  # stable: ties keep their order
    width = [length[i] * unit for i in order]  # a pass of sorted items i..j is padded to (j - i + 1) * width[i]
    # best[j]: (passes, padded tokens) of the best cut of the first j sorted rows; first[j]: where its last pass starts
    best: list[tuple[int, int]] = [(0, 0)]
    first: list[int] = [0]
    lo = 0  # the first row that can open a pass ending at row j (never decreases with j)
    for j in range(len(order)):
        while lo < j and (j - lo + 1) * width[lo] > max_tokens:
            lo += 1
        options = ((best[i][0] + 1, best[i][1] + (j - i + 1) * width[i], i) for i in range(lo, j + 1))
        passes, padded, i = min(options)
        best.append((passes, padded))
        first.append(i)
    cuts, j = [], len(order)
    while j:
        cuts.append((first[j], j))
        j = first[j]
    return [batch.take([u * unit + k for u in order[a:b] for k in range(unit) if u * unit + k < len(batch)])
            for a, b in reversed(cuts)]


def padded_routes(routes: list[list[int] | None], width: int, layers: int, top_k: int) -> torch.Tensor:
    """A batch's MoE routes (``TrainBatch.routed_experts``) aligned with its right-padded ids
    [rows, width] (:func:`pad_batch`): [rows, width, layers, top_k], -1 where a route is unknown (a
    sequence's last token, padding, a sequence without routes): there the router chooses."""
    out = torch.full((len(routes), width, layers, top_k), -1, dtype=torch.long)
    for i, r in enumerate(routes):
        if r:
            fed = torch.tensor(r, dtype=torch.long).view(-1, layers, top_k)
            out[i, : len(fed)] = fed
    return out
