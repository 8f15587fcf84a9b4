"""A DP group's stream of prompts, read from object storage a wave at a time."""

from __future__ import annotations

from engines.backends import chat, multimodal
from storage import datasets


class PromptStream:
    """DP group ``rank``'s prompts: rows ``rank, rank+world, ...`` of every part file in name order,
    read a wave at a time (``storage.datasets.PromptReader``: only the row groups a wave needs), so
    that a host holds the prompts and images of the wave it works on, never the dataset.

    New part files that sort after the existing ones only extend each stream, so the cursors of a
    resumed run keep pointing at the same prompts and go on to the new ones
    (``Checkpoints.check_prompt_files`` refuses anything else)."""

    def __init__(self, uri: str, rank: int, world: int, max_image_bytes: int | None = None, schema=datasets.PROMPTS,
                 extra: bool = False):
        self.reader = datasets.PromptReader(uri, schema, extra)  # schema: PREFERENCES for data.preferences; extra: every column
        self.rank, self.world, self.max_image_bytes = rank, world, max_image_bytes

    def __len__(self) -> int:
        return len(range(self.rank, len(self.reader), self.world))

    def row(self, position: int) -> int:
        """The dataset row at ``position`` of this stream (positions wrap around: epochs)."""
        return self.rank + (position % len(self)) * self.world

    def wave(self, cursor: int, count: int) -> list[dict]:
        """The ``count`` prompts from stream position ``cursor`` on, each with its dataset row."""
        rows = [self.row(cursor + i) for i in range(count)]
        batch = [r | {"prompt_row": row} for r, row in zip(self.reader.rows(rows), rows)]
        for r in batch:  # a bad image fails as its row is first read: before anything of its wave trains
            for i, blob in enumerate(r["images"] or []):
                multimodal.check_image(blob, f"{self.reader.uri} (prompt_id {r['prompt_id']}): field 'images'[{i}]",
                                       self.max_image_bytes or len(blob), pixels=True)
        return batch

    def sources(self, rows: list[int]) -> list:
        """What the prompts at dataset ``rows`` ask the model (``chat.source``: messages, else text)."""
        distinct = sorted(set(rows))
        found = dict(zip(distinct, (chat.source(r) for r in self.reader.rows(distinct))))
        return [found[row] for row in rows]

    def images(self, rows: list[int]) -> list[list[bytes]]:
        """The images of the prompts at dataset ``rows`` (each distinct row read once)."""
        distinct = sorted(set(rows))
        found = dict(zip(distinct, (r["images"] or [] for r in self.reader.rows(distinct))))
        return [found[row] for row in rows]
