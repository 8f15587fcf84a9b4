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


# ---------------------------------------------------------------- packed micro-batches
#
# A packed pass lays its rows end to end in a few *lanes* of one width (its longest row), with no
# padding between rows: only a lane's tail is padded. Positions restart at 0 on each row, and the
# model is called with these position ids and no attention mask: transformers then builds a
# block-diagonal causal mask from where the positions restart (``masking_utils.
# find_packed_sequence_indices``), so no token attends to another row. The logits are read back
# into the row layout of :func:`pad_batch` (:meth:`Packed.rows`), where the losses run unchanged.


def _lanes(lengths: list[int], unit: int, width: int, max_tokens: int | None) -> tuple[list[list[int]], int]:
    """First-fit decreasing: items of ``unit`` consecutive rows, longest item first, each row into the
    first lane of ``width`` with room, a new lane opened while lanes x width stays within
    ``max_tokens`` and the row is at least half as long as ``width`` (None: always). Answers (each lane's rows, how many items were placed): placing
    stops at the first item that does not fit whole."""
    items = sorted(range(0, len(lengths), unit), key=lambda u: -max(lengths[u : u + unit]))
    lanes: list[list[int]] = []
    room: list[int] = []
    for placed, u in enumerate(items):
        trial_room, trial_new = list(room), []
        for i in sorted(range(u, min(u + unit, len(lengths))), key=lambda i: -lengths[i]):
            lane = next((k for k, r in enumerate(trial_room) if r >= lengths[i]), None)
            if lane is None:
                # a bounded pass takes no new lane past the budget, nor one for a row under half its width
                # (attention costs lanes x width^2: short rows make a narrower pass of their own)
                if max_tokens is not None and lanes and ((len(trial_room) + 1) * width > max_tokens or 2 * lengths[i] < width):
                    return lanes, placed
                lane = len(trial_room)
                trial_room.append(width)
            trial_new.append((lane, i))
            trial_room[lane] -= lengths[i]
        for lane, i in trial_new:
            if lane == len(lanes):
                lanes.append([])
            lanes[lane].append(i)
        room = trial_room
    return lanes, len(items)


def packed_micro_batches(batch: TrainBatch, max_tokens: int | None, unit: int = 1) -> list[TrainBatch]:
    """``batch`` cut into packed passes (:func:`pack_batch`) of at most ``max_tokens`` tokens each,
    counting a pass as lanes x its longest row (the tensor it runs: rows plus the lanes' padded
    tails). Rows are taken longest first; a pass's longest row is its lane width; each row goes into
    the first lane with room, and a new pass starts when no lane has room and another lane would
    pass the budget or be for a row under half the width (a lane's attention costs width^2: short
    rows fill the tails of long rows' lanes, else make a narrower pass). A row longer than ``max_tokens`` is a pass of one lane (shorter rows may fill its
    tail, at no cost in memory). ``None``: one pass;
    empty: none. ``unit``: runs of that many rows (a pair) always share a pass. Rows of a pass come
    in the order they were placed (longest item first); the loss reads them in that order."""
    if not len(batch):
        return []
    rows = [len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)]
    order = sorted(range(0, len(rows), unit), key=lambda u: -max(rows[u : u + unit]))
    out = []
    while order:
        width = max(rows[order[0] : order[0] + unit])
        rest = [i for u in order for i in range(u, min(u + unit, len(rows)))]
        _, placed = _lanes([rows[i] for i in rest], unit, width, max_tokens)
        placed = max(placed, 1)
        out.append(batch.take([i for u in order[:placed] for i in range(u, min(u + unit, len(rows)))]))
        order = order[placed:]
    return out


class Packed:
    """One packed pass of ``batch``: ``ids`` and ``positions`` [lanes, width] (positions restart at 0
    on every row; a lane's padded tail is a run of its own), ``real`` [lanes, width] (1 on the rows'
    tokens), and where each row lies (``lane``, ``start``, ``length``)."""

    def __init__(self, batch: TrainBatch, pad_id: int, unit: int = 1):
        self.length = [len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)]
        width = max(self.length)
        lanes, _ = _lanes(self.length, unit, width, None)
        self.ids = torch.full((len(lanes), width), pad_id, dtype=torch.long)
        self.positions = torch.zeros((len(lanes), width), dtype=torch.long)
        self.real = torch.zeros((len(lanes), width), dtype=torch.long)
        self.lane, self.start = [0] * len(batch), [0] * len(batch)
        for k, lane in enumerate(lanes):
            at = 0
            for i in lane:
                n = self.length[i]
                self.ids[k, at : at + n] = torch.tensor(batch.prompt_ids[i] + batch.response_ids[i])
                self.positions[k, at : at + n] = torch.arange(n)
                self.real[k, at : at + n] = 1
                self.lane[i], self.start[i] = k, at
                at += n
            self.positions[k, at:] = torch.arange(width - at)  # the tail: a run of its own, read by nobody
        # row i's column t (t < length - 1) of the row layout is lane[i]'s column start[i] + t
        t = torch.arange(width - 1)
        self.valid = t < torch.tensor(self.length).unsqueeze(-1) - 1  # [rows, width - 1]
        self._lane = torch.tensor(self.lane).unsqueeze(-1).expand(-1, width - 1)
        self._column = torch.where(self.valid, torch.tensor(self.start).unsqueeze(-1) + t, 0)

    def to(self, device) -> Packed:
        for name in ("ids", "positions", "real", "valid", "_lane", "_column"):
            setattr(self, name, getattr(self, name).to(device))
        return self

    def rows(self, values: torch.Tensor) -> torch.Tensor:
        """Per-position ``values`` [lanes, width - 1 or more] (position p: what is read at token p,
        e.g. the log-probability of token p + 1) in :func:`pad_batch`'s row layout [rows, width - 1],
        0 past each row's end (so that a masked term stays finite)."""
        out = values[self._lane, self._column]
        return torch.where(self.valid, out, torch.zeros((), dtype=out.dtype, device=out.device))


def packed_routes(routes: list[list[int] | None], packed: Packed, layers: int, top_k: int) -> torch.Tensor:
    """A batch's MoE routes laid out like ``packed.ids``: [lanes, width, layers, top_k], -1 where a
    route is unknown (as :func:`padded_routes`)."""
    out = torch.full((*packed.ids.shape, layers, top_k), -1, dtype=torch.long)
    for i, r in enumerate(routes):
        if r:
            fed = torch.tensor(r, dtype=torch.long).view(-1, layers, top_k)
            out[packed.lane[i], packed.start[i] : packed.start[i] + len(fed)] = fed
    return out
