"""Run state and checkpoint commits.

``{run}/state.json`` is the one committed fact a resume reads: the last checkpoint and
the data cursors and dynamic-sampling state (carried-over groups, keep-ratio estimate) that go
with it. A checkpoint folder counts only once its
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
    # per DP group, the dynamic-sampling state after ``step`` (flows/sampling.py ``GroupSampling``):
    # the URI of the kept groups that step carried over into the next one (its own
    # ``steps/{step}/carry/...`` object, which no later step rewrites) and the keep-ratio estimate
    sampling: list[dict] = field(default_factory=list)

    @classmethod
    def load(cls, run_uri: str) -> "RunState | None":
        uri = objectstore.join(run_uri, "state.json")
        return cls(**objectstore.read_json(uri)) if objectstore.exists(uri) else None

    def save(self, run_uri: str) -> None:
        objectstore.write_json(objectstore.join(run_uri, "state.json"), asdict(self))


def checkpoint_uri(run_uri: str, step: int) -> str:
    return objectstore.join(run_uri, "checkpoints", f"{step:06d}")


def commit_checkpoint(run_uri: str, state: RunState, files: list[str], keep_last: int, keep_every: int | None = None) -> None:
    """Manifest first, then state; then retention (:func:`apply_retention`).

    Call it only once every file of the checkpoint is written: with asynchronous checkpoints
    the training flow commits a step's checkpoint after every engine host has reported its
    write finished (``checkpoint_wait``), so a crash mid-write leaves the folder without a
    manifest and ``state.json`` at the previous checkpoint."""
    manifest = {"step": state.step, "cursors": state.cursors, "policy_version": state.policy_version,
                "sampling": state.sampling, "files": sorted(files), "committed_at": time.time()}
    objectstore.write_json(objectstore.join(state.checkpoint, "MANIFEST.json"), manifest)
    state.save(run_uri)
    apply_retention(run_uri, keep_last, keep_every, keep=state.checkpoint)


def checkpoint_step(uri: str) -> int | None:
    """The step of a checkpoint folder (its name is the step, ``{step:06d}``); None for another name."""
    name = uri.rstrip("/").rsplit("/", 1)[-1]
    return int(name) if name.isdigit() else None


def retained(steps: list[int], keep_last: int, keep_every: int | None = None) -> set[int]:
    """The committed checkpoint steps that retention keeps: the newest ``keep_last``, and every
    ``keep_every``-th step's forever: those after which ``(step + 1) % keep_every == 0`` steps are
    trained (steps count from 0, so this is the same arithmetic as ``checkpoint.every``)."""
    newest = sorted(steps)[-keep_last:] if keep_last > 0 else []
    every = {s for s in steps if keep_every and (s + 1) % keep_every == 0}
    return set(newest) | every


def apply_retention(run_uri: str, keep_last: int, keep_every: int | None = None, keep: str | None = None) -> list[str]:
    """Delete the committed checkpoints that :func:`retained` does not keep (never ``keep``, the
    one ``state.json`` points at); returns the deleted URIs. Folders without a manifest are
    not counted (see :func:`discard_uncommitted`)."""
    committed = committed_checkpoints(run_uri)
    steps = {uri: checkpoint_step(uri) for uri in committed}
    kept = retained([s for s in steps.values() if s is not None], keep_last, keep_every)
    deleted = []
    for uri, step in steps.items():
        if step is not None and step not in kept and uri != keep:
            objectstore.remove(uri)
            deleted.append(uri)
    return deleted


def discard_uncommitted(run_uri: str, state: "RunState | None") -> list[str]:
    """Before a run (re)starts writing checkpoints: delete checkpoint folders that a resume must
    never read and that the new run would otherwise write into — folders without a manifest (a
    crash mid-write) and folders of steps after ``state.step`` (a crash between the manifest and
    ``state.json``: the run redoes those steps). Returns the deleted URIs."""
    root = objectstore.join(run_uri, "checkpoints")
    if not objectstore.exists(root):
        return []
    committed = set(committed_checkpoints(run_uri))
    last = state.step if state is not None else -1
    deleted = []
    for uri in _checkpoint_folders(root):
        step = checkpoint_step(uri)
        if step is None:
            continue
        if uri not in committed or step > last:
            objectstore.remove(uri)
            deleted.append(uri)
    return deleted


def committed_checkpoints(run_uri: str) -> list[str]:
    """Checkpoint folders with a manifest, oldest first."""
    root = objectstore.join(run_uri, "checkpoints")
    if not objectstore.exists(root):
        return []
    return [u for u in _checkpoint_folders(root) if objectstore.exists(objectstore.join(u, "MANIFEST.json"))]


def _checkpoint_folders(root: str) -> list[str]:
    fs, path = objectstore.fs_for(root)
    scheme = root.split("://", 1)[0]
    folders = sorted(p for p in fs.ls(path, detail=False) if fs.isdir(p))
    return [f"{scheme}://{p}" for p in folders]
