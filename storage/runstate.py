"""Run state and checkpoint commits.

``{run}/state.json`` is the one committed fact a resume reads: the last checkpoint and
the data cursors that go with it. A checkpoint folder counts only once its
``MANIFEST.json`` exists; the manifest is written after every file it lists, and
``state.json`` after the manifest, so a crash at any point leaves the previous
checkpoint as the one that resumes.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

from storage import objectstore


@dataclass
class RunState:
    step: int = -1  # last step whose checkpoint is committed (-1: none yet)
    cursors: list[int] = field(default_factory=list)  # per DP group: next position in its prompt stream
    checkpoint: str | None = None
    policy_version: int = 0
    heldout_before: float | None = None  # held-out accuracy of the starting policy

    @classmethod
    def load(cls, run_uri: str) -> "RunState | None":
        uri = objectstore.join(run_uri, "state.json")
        return cls(**objectstore.read_json(uri)) if objectstore.exists(uri) else None

    def save(self, run_uri: str) -> None:
        objectstore.write_json(objectstore.join(run_uri, "state.json"), asdict(self))


def checkpoint_uri(run_uri: str, step: int) -> str:
    return objectstore.join(run_uri, "checkpoints", f"{step:06d}")


def commit_checkpoint(run_uri: str, state: RunState, files: list[str], keep_last: int) -> None:
    """Manifest first, then state; then delete checkpoints beyond the newest ``keep_last``."""
    manifest = {"step": state.step, "cursors": state.cursors, "policy_version": state.policy_version,
                "files": sorted(files), "committed_at": time.time()}
    objectstore.write_json(objectstore.join(state.checkpoint, "MANIFEST.json"), manifest)
    state.save(run_uri)
    committed = committed_checkpoints(run_uri)
    for old in committed[:-keep_last]:
        if old != state.checkpoint:
            objectstore.remove(old)


def committed_checkpoints(run_uri: str) -> list[str]:
    """Checkpoint folders with a manifest, oldest first."""
    root = objectstore.join(run_uri, "checkpoints")
    if not objectstore.exists(root):
        return []
    fs, path = objectstore.fs_for(root)
    scheme = root.split("://", 1)[0]
    folders = sorted(p for p in fs.ls(path, detail=False) if fs.isdir(p))
    uris = [f"{scheme}://{p}" for p in folders]
    return [u for u in uris if objectstore.exists(objectstore.join(u, "MANIFEST.json"))]
