"""A DP group's stream of prompts, read from object storage a wave at a time."""

from __future__ import annotations

from dataclasses import dataclass

from engines.backends import chat, multimodal, video
from storage import datasets


@dataclass(frozen=True)
class Frames:
    """How a vision-language policy is given a prompt's videos (``data.video_fps``, ``data.max_frames``,
    ``data.max_video_seconds``): frames as images, each written in the text as ``frame_text``, where
    the prompt's images are counted by ``image_token`` (``multimodal.image_text``, ``placeholder``)."""

    fps: float
    max_frames: int
    max_seconds: float
    image_token: str
    frame_text: str

    @classmethod
    def of(cls, data, processor) -> "Frames":
        return cls(data.video_fps, data.max_frames, data.max_video_seconds, multimodal.placeholder(processor),
                   multimodal.image_text(processor))

    def row(self, row: dict, uri: str) -> dict:
        """``row`` with its videos' frames among its images and ``<video>`` in its text (or turns)
        replaced by one image per frame; a clip that does not decode or is too long fails naming the
        file, prompt_id and clip. A row without videos as it is."""
        clips = row.get("videos") or []
        if not clips:
            return row
        frames = [video.frames(blob, self.fps, self.max_frames, f"{uri} (prompt_id {row['prompt_id']}): field 'videos'[{i}]",
                               self.max_seconds) for i, blob in enumerate(clips)]
        turns = row.get("messages")
        texts = [m["content"] for m in turns] if turns else [row["prompt"]]
        texts, images = video.expand(texts, row["images"] or [], frames, self.image_token, self.frame_text)
        out = row | {"images": images, "videos": None}
        if turns:
            return out | {"messages": [m | {"content": t} for m, t in zip(turns, texts)]}
        return out | {"prompt": texts[0]}


class PromptStream:
    """DP group ``rank``'s prompts: rows ``rank, rank+world, ...`` of every part file in name order,
    read a wave at a time (``storage.datasets.PromptReader``: only the row groups a wave needs), so
    that a host holds the prompts and images of the wave it works on, never the dataset.

    New part files that sort after the existing ones only extend each stream, so the cursors of a
    resumed run keep pointing at the same prompts and go on to the new ones
    (``Checkpoints.check_prompt_files`` refuses anything else)."""

    def __init__(self, uri: str, rank: int, world: int, max_image_bytes: int | None = None, schema=datasets.PROMPTS,
                 extra: bool = False, frames: Frames | None = None, max_image_pixels: int | None = None):
        self.reader = datasets.PromptReader(uri, schema, extra)  # schema: PREFERENCES for data.preferences; extra: every column
        self.rank, self.world, self.max_image_bytes = rank, world, max_image_bytes
        self.max_image_pixels = max_image_pixels  # data.max_image_pixels: checked from each image's header before it is decoded
        self.frames = frames  # a vision-language policy's: videos become frames (None: a text policy)

    def _rows(self, rows: list[int]) -> list[dict]:
        """The prompts at dataset ``rows``, their videos as frames (``Frames.row``)."""
        read = self.reader.rows(rows)
        return read if self.frames is None else [self.frames.row(r, self.reader.uri) for r in read]

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
                                       self.max_image_bytes or len(blob), pixels=True, max_pixels=self.max_image_pixels)
        return batch if self.frames is None else [self.frames.row(r, self.reader.uri) for r in batch]

    def sources(self, rows: list[int]) -> list:
        """What the prompts at dataset ``rows`` ask the model (``chat.source``: messages, else text)."""
        distinct = sorted(set(rows))
        found = dict(zip(distinct, (chat.source(r) for r in self._rows(distinct))))
        return [found[row] for row in rows]

    def images(self, rows: list[int]) -> list[list[bytes]]:
        """The images of the prompts at dataset ``rows`` (each distinct row read once; a video's
        frames decoded again, the same as at its rollout)."""
        distinct = sorted(set(rows))
        found = dict(zip(distinct, (r["images"] or [] for r in self._rows(distinct))))
        return [found[row] for row in rows]
