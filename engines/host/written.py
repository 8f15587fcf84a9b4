"""The stage outputs a host wrote, kept for its own next stages: written once, not read back.

Every stage still writes its output to object storage: that is the durable log resume, retries,
lineage and the other DP groups read. But the host that wrote a wave's rollouts hands them to its
judge from here, its scored waves to the step's filter, the filter's experience to the train step
and its carry to the next step's filter. What is kept is the Arrow table as it was written, cast to
the stage's schema, so a stage is given exactly what Parquet would return (float32 lists stay
float32): a resumed or healed run, which reads these outputs from storage, trains on the same
numbers as an uninterrupted one.

Kept for the step that wrote them and the next (a carry is read one step later), then dropped. A
URI this process did not write (another rank's, another group's, one written before a restart) is
read from storage.
"""

from __future__ import annotations

import threading

import pyarrow as pa

from storage import datasets, objectstore


class Written:
    """One host's recent stage outputs, by URI."""

    def __init__(self):
        self._tables: dict[str, tuple[int, pa.Table]] = {}  # uri: (step, the table written)
        self._step = 0  # the step of the last write
        self._lock = threading.Lock()  # a streaming lane writes from its own thread

    def write(self, step: int | None, uri: str, rows: list[dict], schema: pa.Schema) -> None:
        """``datasets.write_rows``, keeping what was written for this host's next stages; ``step``: the
        step it belongs to (None: the last write's, for a stage whose request names no step)."""
        table = datasets.write_rows(uri, rows, schema)
        with self._lock:
            step = self._step = self._step if step is None else step
            self._tables = {u: kept for u, kept in self._tables.items() if kept[0] >= step - 1} | {uri: (step, table)}

    def rows(self, uri: str, schema: pa.Schema) -> list[dict]:
        """``uri``'s rows: as this host wrote them, or from storage."""
        with self._lock:
            kept = self._tables.get(uri)
        return (kept[1] if kept else datasets.read_table(uri, schema)).to_pylist()

    def remove(self, uri: str) -> None:
        with self._lock:
            self._tables.pop(uri, None)
        objectstore.remove(uri)
