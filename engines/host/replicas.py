"""Several rollout engines (or judges) in one DP group: who does which chunk, and how the leader
gets them all.

A group of several ranks (engines/config/layout.py) holds ``rollout.replicas`` rollout engines, each
over ``rollout.tensor_parallel`` ranks and held by the first of them, and ``judge.replicas`` judges
likewise (ChatLearn's layout per model). A wave is already generated and scored in chunks of ``placement.stream_chunk``
prompts, chunk k seeded by (seed, step, group, wave, k); replica r takes the chunks k = r, r + n,
..., so the samples, verdicts and rewards are the ones a single engine draws, whatever n. Each
replica writes its chunks next to the stage's output (``{out}.chunks/chunk-{k}.parquet``), the
replicas meet at a barrier of their own gloo group, and the leader reads the chunks in order,
writes the stage's one output and removes them: data between ranks goes through storage as
between stages, and nothing is unpickled from the network.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Callable, TypeVar

import torch.distributed as dist

from engines.config.layout import Layout
from storage import datasets, objectstore

T = TypeVar("T")
ROLES = ("rollout", "judge")


class Replicas:
    """One rank's place among its group's replicas of a role ("rollout" or "judge")."""

    def __init__(self, layout: Layout, rank: int, role: str, group: dist.ProcessGroup | None = None):
        places = layout.serving(role)  # each replica's first rank: it holds the engine
        self.count = len(places)
        self.index = places.index(layout.local(rank)) if layout.local(rank) in places else None  # this rank's replica
        self.group = group  # the replicas' gloo group (None: one replica)

    @property
    def here(self) -> bool:
        """This rank holds one of the role's engines."""
        return self.index is not None

    def mine(self, chunks: list[T]) -> list[tuple[int, T]]:
        """The chunks this replica does: ``(k, chunk)`` for k = index, index + count, ..."""
        return [(k, chunk) for k, chunk in enumerate(chunks) if k % self.count == self.index]

    def join(self, out: str, schema, done: dict[int, list[dict]], chunks: int,
             write: Callable[[str, list[dict], object], object] = datasets.write_rows) -> list[dict]:
        """The stage's output ``out``: every chunk's rows in order, written by the leader (with ``write``:
        the host's ``Written.write`` for its step) and answered (``done``: this replica's chunks by k);
        the other replicas answer their own rows."""
        if self.count == 1:
            rows = [row for k in range(chunks) for row in done[k]]
            write(out, rows, schema)
            return rows
        folder = f"{out}.chunks"
        if self.index:  # a follower's chunks go beside the output, for the leader
            for k, rows in done.items():
                datasets.write_rows(f"{folder}/chunk-{k:05d}.parquet", rows, schema)
        dist.barrier(group=self.group)  # every replica's chunks are written
        if self.index:
            return [row for rows in done.values() for row in rows]
        rows = [row for k in range(chunks) for row in (done[k] if k in done else
                                                       datasets.read_table(f"{folder}/chunk-{k:05d}.parquet", schema).to_pylist())]
        write(out, rows, schema)
        objectstore.remove(folder)
        return rows


def replica_groups(layout: Layout, rank: int, timeout: timedelta) -> dict[str, Replicas]:
    """Each role's ``Replicas`` for ``rank``, creating the replicas' gloo groups of every DP group
    (collective: every rank of the run calls it, in the same order)."""
    replicas = {}
    for role in ROLES:
        mine = None
        if len(layout.serving(role)) > 1:
            for g in range(layout.dp):
                pg = dist.new_group([layout.ranks(g)[i] for i in layout.serving(role)], backend="gloo", timeout=timeout)
                mine = pg if layout.group(rank) == g else mine
        replicas[role] = Replicas(layout, rank, role, mine)
    return replicas

