"""DP load balancing: spread one step's sequences over the DP ranks by token count.

Before the train step every engine host knows only its own experience file. The hosts
all-gather the token count of every row (never the rows), and each of them computes the
same plan with :func:`plan`: every *global minibatch* — minibatch ``k`` of every rank,
as ``TrainBatch.split`` cuts it — is partitioned into ``world`` parts of near-equal token
totals (Karmarkar–Karp), one part per rank. A rank then reads its rows from the other
ranks' experience files (object storage) and trains on them.

Balancing each global minibatch, not the whole step, keeps the update identical: an
optimizer step sees the same set of sequences, normalised by the same global token (or
sequence) count, only summed in another order. It is also what the ranks wait on: every
minibatch ends in a gradient all-reduce.

The planning is pure Python and deterministic (ties broken by index), so every rank computes
the same plan from the same gathered counts; :func:`balanced_batch` does the exchange.
"""

from __future__ import annotations

import heapq
import time
from collections import defaultdict
from itertools import chain

from engines.backends.base import TrainBatch
from engines.config.layout import Layout


def karmarkar_karp(weights: list[int], parts: int) -> list[list[int]]:
    """Karmarkar–Karp (largest differencing method), k-way: indices of ``weights`` in
    ``parts`` lists, each sorted, the lists ordered by total, heaviest first.

    Every item starts as a partial partition (itself in one subset, ``parts - 1`` empty
    ones). The two partial partitions with the largest spread (max − min subset total) are
    merged, heaviest subset of one with lightest of the other, until one remains. Some
    parts are empty when there are fewer items than parts.

    A partial partition keeps only its non-empty subsets (the empty ones are implied): the
    textbook form holds ``parts`` subsets for every item, items x parts in all — at 256 DP
    ranks and 4,096 rows 1M subsets, 127 MB and 5 s of CPU on every rank at every step, which is
    what ran the 256-group bench out of memory. This form holds each item once: same result.
    """
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    if any(w < 0 for w in weights):
        raise ValueError("weights must be >= 0")
    # a subset is (total, items, lowest index, indices): the order below is the textbook's
    # total order (an empty subset is (0, 0, inf) and sorts lightest)
    def heaviest_first(s: tuple) -> tuple:
        return -s[0], -s[1], s[2]

    def spread(state: list[tuple]) -> int:  # heaviest minus lightest, an implied empty one included
        return state[0][0] - (state[-1][0] if len(state) == parts else 0)

    heap: list[tuple[int, int, list[tuple]]] = []
    for seq, i in enumerate(sorted(range(len(weights)), key=lambda i: (-weights[i], i))):
        heap.append((-weights[i], seq, [(weights[i], 1, i, [i])]))
    heapq.heapify(heap)
    seq = len(heap)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)  # heaviest first
        _, _, b = heapq.heappop(heap)
        empty_b = parts - len(b)  # b lightest first: its empty_b implied empty subsets, then b_light
        b_light = sorted(b, key=lambda s: s[:3])
        merged = []
        for j in chain(range(min(len(a), empty_b)), range(empty_b, parts)):  # where a or b is non-empty
            x = a[j] if j < len(a) else None
            y = b_light[j - empty_b] if j >= empty_b else None
            merged.append(y if x is None else x if y is None else (x[0] + y[0], x[1] + y[1], min(x[2], y[2]), x[3] + y[3]))
        merged.sort(key=heaviest_first)
        heapq.heappush(heap, (-spread(merged), seq, merged))
        seq += 1
    state = heap[0][2] if heap else []
    return [sorted(s[3]) for s in state] + [[] for _ in range(parts - len(state))]


def greedy(weights: list[int], parts: int) -> list[list[int]]:
    """Longest-processing-time first: heaviest item to the currently lightest part."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    lightest, out = [(0, p) for p in range(parts)], [[] for _ in range(parts)]  # a heap of (total, part)
    for i in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        total, p = lightest[0]
        heapq.heapreplace(lightest, (total + weights[i], p))
        out[p].append(i)
    return [sorted(o) for o in out]


def partition(weights: list[int], parts: int) -> list[list[int]]:
    """Karmarkar–Karp, or greedy where greedy's heaviest part is strictly lighter (KK is
    better on most inputs but not on all; taking the better of the two costs nothing)."""
    lpt = greedy(weights, parts)
    if len(weights) * parts > 2**20:  # KK's time grows as items x parts (0.13-0.18 s here at 2**20);
        return lpt  # with that many items per part LPT was within 0.3% of it (256 x 16 rows, 64 x 64)
    kk = karmarkar_karp(weights, parts)
    return lpt if max_total(weights, lpt) < max_total(weights, kk) else kk


def max_total(weights: list[int], parts: list[list[int]]) -> int:
    return max((sum(weights[i] for i in p) for p in parts), default=0)


def imbalance(totals: list[float]) -> float:
    """max / mean of per-rank totals: 1.0 is perfect balance (and the answer for all zeros)."""
    if not totals:
        return 1.0
    mean = sum(totals) / len(totals)
    return max(totals) / mean if mean > 0 else 1.0


def split_bounds(n: int, parts: int) -> list[int]:
    """Minibatch boundaries of ``n`` rows, exactly as ``TrainBatch.split`` cuts them."""
    return [round(i * n / parts) for i in range(parts + 1)]


def assign(parts: list[list[tuple[int, int]]], weights: dict[tuple[int, int], int], world: int) -> list[int]:
    """Which rank takes each part (a permutation): greedily the (part, rank) pairs whose rows
    already live on that rank, by token weight, so that the fewest tokens are read remotely.
    Rows are ``(source rank, row)``; ties go to the lower part, then the lower rank. Only the
    pairs that share rows are weighed (parts x world of them would be 1M at 1,024 ranks); a part
    left without one takes the lowest rank still free."""
    overlap: dict[tuple[int, int], int] = defaultdict(int)
    for p, rows in enumerate(parts):
        for src, i in rows:
            overlap[(p, src)] += weights[(src, i)] + 1  # +1: an empty-token row still counts as staying
    owner, taken = [-1] * len(parts), set()
    for (p, r), _ in sorted(overlap.items(), key=lambda x: (-x[1], x[0])):
        if owner[p] < 0 and r not in taken:
            owner[p] = r
            taken.add(r)
    free = iter(r for r in range(world) if r not in taken)
    return [r if r >= 0 else next(free) for r in owner]


def plan(tokens: list[list[int]], minibatches: int) -> list[list[list[tuple[int, int]]]]:
    """``tokens[r][i]``: tokens of row ``i`` of rank ``r``'s experience. Returns, for every rank,
    its rows per minibatch as ``(source rank, row)`` pairs (sorted), so that minibatch ``k``
    over all ranks holds the same rows as without balancing, spread by token count. A minibatch
    whose heaviest rank would not get lighter is left where it is."""
    world = len(tokens)
    out: list[list[list[tuple[int, int]]]] = [[[] for _ in range(minibatches)] for _ in range(world)]
    bounds = [split_bounds(len(t), minibatches) for t in tokens]
    weights = {(r, i): w for r, t in enumerate(tokens) for i, w in enumerate(t)}
    for k in range(minibatches):
        home = [[(r, i) for i in range(bounds[r][k], bounds[r][k + 1])] for r in range(world)]
        rows = [row for rows in home for row in rows]
        parts = [[rows[j] for j in p] for p in partition([weights[row] for row in rows], world)]
        heaviest = max(sum(weights[row] for row in p) for p in parts)
        if max(sum(weights[row] for row in h) for h in home) <= heaviest:
            out_k = home  # already as good: move nothing
        else:
            out_k = [[] for _ in range(world)]
            for p, r in enumerate(assign(parts, weights, world)):
                out_k[r] = sorted(parts[p])
        for r in range(world):
            out[r][k] = out_k[r]
    return out


def plan_totals(tokens: list[list[int]], layout: list[list[list[tuple[int, int]]]]) -> list[int]:
    """Tokens per rank under a plan."""
    return [sum(tokens[src][i] for mb in rank for src, i in mb) for rank in layout]


def presplit(minibatches: list[TrainBatch]) -> TrainBatch:
    """One ``TrainBatch`` holding ``minibatches``, whose ``split`` gives exactly them back:
    balanced minibatches need not have the sizes ``split`` would cut. Both trainers only ever
    call ``batch.split(minibatches)``."""
    return PresplitBatch.of(minibatches)


class PresplitBatch(TrainBatch):
    @classmethod
    def of(cls, parts: list[TrainBatch]) -> "PresplitBatch":
        batch = cls(**vars(TrainBatch.concat(parts)))
        batch.parts = list(parts)
        return batch

    def split(self, parts: int, unit: int = 1) -> list[TrainBatch]:  # the plan kept units together already
        if parts != len(self.parts):
            raise ValueError(f"balanced batch was planned for {len(self.parts)} minibatches, asked to split into {parts}")
        return list(self.parts)


# --------------------------------------------------------------------------- the exchange


def to_batch(rows: list[dict]) -> TrainBatch:
    """Experience rows (``storage.datasets.EXPERIENCE``) as a train batch."""
    def column(name: str) -> list | None:  # a critic's per-token column, None when the rows have none
        values = [r.get(name) for r in rows]
        return None if not rows or any(v is None for v in values) else values

    per_token = column("token_advantages")
    return TrainBatch([r["prompt_ids"] for r in rows], [r["response_ids"] for r in rows],
                      [r["logprobs"] for r in rows], per_token or [r["advantage"] for r in rows],
                      prompt_rows=[r.get("prompt_row") for r in rows], returns=column("returns"), values=column("values"),
                      loss_mask=column("loss_mask"), routed_experts=column("routed_experts"))


def balanced_batch(group: int, layout: Layout | int, experience: str, rows: list[dict], minibatches: int,
                   enabled: bool, unit: int = 1) -> tuple[TrainBatch, dict]:
    """DP group ``group``'s train batch, spread over the ``layout``'s groups (a number: that many
    groups of one rank) by token count (collective over every rank).

    The hosts all-gather (experience URI, tokens per row) — small integers, as tensors over the
    gloo metadata group, no pickles and no sample data — and every rank computes the same
    :func:`plan` from each group's leader's, then reads the rows it is given from the other groups'
    experience files. The ranks of a group read the same file and get the same batch.
    Returns (batch, metrics); ``balance_ratio`` is max/mean of the groups' tokens (prompt +
    response) after, ``balance_ratio_before`` before; both are reported with balancing off too.
    ``unit``: runs of that many consecutive rows (a pair algorithm's (chosen, rejected)) move as one
    item, weighing their tokens together."""
    import torch.distributed as dist

    from engines.backends.distributed import all_gather_ints
    from storage import datasets

    start = time.perf_counter()
    tokens = [len(r["prompt_ids"]) + len(r["response_ids"]) for r in rows]
    info = {"tokens_before_balance": float(sum(len(r["response_ids"]) for r in rows)),
            "sequences_before_balance": len(rows), "rows_received": 0, "balance_ratio": 1.0, "balance_ratio_before": 1.0}
    layout = layout if isinstance(layout, Layout) else Layout(layout)
    if layout.dp == 1 or not dist.is_initialized():
        return to_batch(rows), info | {"balance_s": time.perf_counter() - start}
    uri = list(experience.encode())
    gathered = all_gather_ints([len(uri), *uri, *tokens])
    gathered = [gathered[layout.leader(g)] for g in range(layout.dp)]  # a group's ranks send the same
    uris = [bytes(g[1 : 1 + g[0]]).decode() for g in gathered]
    counts = [g[1 + g[0] :] for g in gathered]
    info["balance_ratio"] = info["balance_ratio_before"] = imbalance([sum(c) for c in counts])
    if not enabled:
        return to_batch(rows), info | {"balance_s": time.perf_counter() - start}
    per_unit = [[sum(c[u : u + unit]) for u in range(0, len(c), unit)] for c in counts]
    parts = [[[(src, u * unit + k) for src, u in mb for k in range(unit) if u * unit + k < len(counts[src])] for mb in r]
             for r in plan(per_unit, minibatches)]
    wanted: dict[int, set[int]] = defaultdict(set)
    for minibatch in parts[group]:
        for src, i in minibatch:
            wanted[src].add(i)
    fetched = {(group, i): rows[i] for i in wanted.pop(group, ())}
    for src, indices in sorted(wanted.items()):
        table = datasets.read_table(uris[src], datasets.EXPERIENCE)
        if table.num_rows != len(counts[src]):
            raise RuntimeError(f"{uris[src]}: {table.num_rows} rows, but dp-{src} trains on {len(counts[src])}: it changed under the step")
        indices = sorted(indices)
        fetched.update(zip(((src, i) for i in indices), table.take(indices).to_pylist()))
    for (src, i), r in fetched.items():
        if len(r["prompt_ids"]) + len(r["response_ids"]) != counts[src][i]:
            raise RuntimeError(f"{uris[src]} row {i}: not the row dp-{src} announced (token count differs)")
    batch = presplit([to_batch([fetched[x] for x in minibatch]) for minibatch in parts[group]])
    info.update(rows_received=sum(src != group for src, _ in fetched),
                balance_ratio=imbalance(plan_totals(counts, parts)), balance_s=time.perf_counter() - start)
    return batch, info
