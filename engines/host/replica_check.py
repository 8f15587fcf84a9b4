"""The DP replicas' check after each train step, at the cost of the shard (DESIGN.md invariants 2 and 13).

Every DP group holds one copy of the policy in the same layout, so the ranks at the same place in
their groups (``Layout.local``: the same TP rank, stage, expert share or FSDP shard) hold the same
parameters, which after every step must be equal bit for bit. Each rank digests the parameters it
holds (``Trainer.local_parameters``) on their device (``engines/backends/digest.py``: a reduction,
no gather, no copy to the host but one small vector), and the ranks all-gather one 64-bit digest
each over the metadata gloo group (``engines.backends.distributed.metadata_group``). Equal bits give
equal digests; one flipped bit anywhere changes its rank's. A mismatch costs two more all-gathers,
of each tensor's digest and of the differing tensor's name, so that every rank raises the same
one-line ``ReplicasDiffer`` naming the ranks and the tensor.

Before (issue 67) every rank fingerprinted ``export_weights()``: under Megatron every parameter
gathered over TP, broadcast over the stages, copied to the host and hashed with SHA-256 there, on
every rank, every step: the whole model per rank to compare what each rank already holds.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from typing import Any, Iterable

import torch
import torch.distributed as dist

from engines.backends.digest import Digests
from engines.config.layout import Layout


class ReplicasDiffer(RuntimeError):
    """DP replicas hold different parameters after a train step."""


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _gather(values: list[int], group) -> list[list[int]]:
    """Every rank's ``values`` (int64; the same count on every rank) over ``group``."""
    world = dist.get_world_size(group)
    out = [torch.zeros(len(values), dtype=torch.int64) for _ in range(world)]
    dist.all_gather(out, torch.tensor(values, dtype=torch.int64), group=group)
    return [o.tolist() for o in out]


def check(named: Iterable[tuple[str, Any]], layout: Layout, rank: int) -> str:
    """Digest the parameters this rank holds (``named``) and compare them with those of the ranks at
    its place in the other DP groups (collective: every rank of the run calls it). Answers the
    group's fingerprint, equal on every replica: with one rank per group that rank's
    ``base.fingerprint`` of ``named``, else a hash of its ranks' in order. Raises
    ``ReplicasDiffer`` naming the ranks and the tensor where replicas differ."""
    from engines.backends.distributed import all_gather_ints, metadata_group

    digests = Digests(named)
    entries = sorted(digests.entries())  # by name: the same order on every rank at the same place
    own = hashlib.sha256(b"".join(sorted(e for _, e in entries))).hexdigest()[:16]  # = base.fingerprint(named)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return own
    group = metadata_group()
    ranks = [v[0] for v in _gather([_signed(int(own, 16))], group)]
    places = [[layout.ranks(g)[p] for g in range(layout.dp)] for p in range(layout.size)]
    differing = [p for p in range(layout.size) if len({ranks[r] for r in places[p]}) > 1]
    if differing:
        # every rank saw the same mismatch: each tensor's digest, then the first differing tensor's
        # name from the ranks that hold it, so that every rank raises the same line
        per_tensor = all_gather_ints([_signed(int.from_bytes(e, "little")) for _, e in entries])
        p = differing[0]
        values = [per_tensor[r] for r in places[p]]
        odd = _odd_ones(places[p], [ranks[r] for r in places[p]])
        first = next((i for i in range(max(map(len, values))) if len({tuple(v[i:i + 1]) for v in values}) > 1), 0)
        count = sum(len({tuple(v[i:i + 1]) for v in values}) > 1 for i in range(max(map(len, values))))
        here = layout.local(rank) == p
        names = all_gather_ints(list(entries[first][0].encode()) if here and first < len(entries) else [])
        tensor = bytes(names[places[p][0]]).decode()
        raise ReplicasDiffer(_message(layout, places[p], odd, tensor, count - 1, len(differing) - 1,
                                      {len(v) for v in values}))
    return own if layout.size == 1 else hashlib.sha256(
        b"".join(ranks[r].to_bytes(8, "little", signed=True) for r in layout.ranks(layout.group(rank)))).hexdigest()[:16]


def _odd_ones(ranks: list[int], digests: list[int]) -> list[int]:
    """The ranks whose digest differs from the one most of them hold (none is most: all of them)."""
    (common, seen), *rest = Counter(digests).most_common()
    if rest and rest[0][1] == seen:
        return ranks
    return [r for r, d in zip(ranks, digests) if d != common]


def _message(layout: Layout, place: list[int], odd: list[int], tensor: str, more_tensors: int, more_places: int,
             counts: set[int]) -> str:
    who = lambda rs: " and ".join(f"{layout.name(r)} (rank {r})" for r in rs)  # noqa: E731
    if len(counts) > 1:
        what = f"hold different parameters ({' against '.join(map(str, sorted(counts)))} tensors)"
    elif odd == place:
        what = f"hold different bits in {tensor!r}"
    else:
        others = [r for r in place if r not in odd]
        what = f"{'holds' if len(odd) == 1 else 'hold'} other bits than {who(others)} in {tensor!r}"
    more = f" and {more_tensors} more tensor{'s' * (more_tensors > 1)}" if more_tensors else ""
    places = f"; replicas differ at {more_places} more place{'s' * (more_places > 1)} in the group" if more_places else ""
    return f"replica check after the train step: {who(odd)} {what}{more}{places}"
