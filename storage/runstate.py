"""Run state and checkpoint commits.

``{run}/state.json`` is the one committed fact a resume reads: the last checkpoint and
the data cursors and dynamic-sampling state (carried-over groups, keep-ratio estimate) that go
with it. A checkpoint folder counts only once its
``MANIFEST.json`` exists; the manifest is written after every file it lists, and
``state.json`` after the manifest, so a crash at any point leaves the previous
checkpoint as the one that resumes.

A resume never deletes the checkpoint ``state.json`` names: when that one has lost its manifest
or files since, the run falls back to the newest intact checkpoint before it
(:func:`resume_point`), and a ``state.json`` that cannot be read stops the run, naming the
checkpoints that are still intact (:class:`RunStateError`).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, fields
from typing import Callable

from storage import objectstore
from storage.objectstore import StorageError


class RunStateError(StorageError):
    """``state.json`` cannot be read or is not a run state; the message names the file, what is
    wrong and the committed checkpoints that are still intact."""


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
        """The committed state; None before the first; ``RunStateError`` when it cannot be read."""
        uri = objectstore.join(run_uri, "state.json")
        if not objectstore.exists(uri):
            return None
        try:
            return cls._checked(objectstore.read_json(uri), uri)
        except StorageError as e:
            raise RunStateError(f"{e}. The run cannot tell which checkpoint to resume from, so it stops and deletes "
                                f"nothing; {_what_stands(run_uri)}") from e

    @classmethod
    def _checked(cls, data, uri: str) -> "RunState":
        """``data`` as a RunState, or StorageError naming the field that is missing or wrong."""
        if not isinstance(data, dict):
            raise StorageError(f"{uri}: not a run state (a JSON {type(data).__name__}, not an object)")

        def whole(value) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        step, cursors, checkpoint = data.get("step"), data.get("cursors"), data.get("checkpoint")
        problems = [f"field '{name}' is missing" for name in ("step", "cursors", "checkpoint") if name not in data]
        if "step" in data and not (whole(step) and step >= -1):
            problems.append(f"field 'step' is {step!r}, not a step number (-1: none committed yet)")
        if "cursors" in data and not (isinstance(cursors, list) and cursors and all(whole(c) and c >= 0 for c in cursors)):
            problems.append(f"field 'cursors' is {cursors!r}, not one prompt position per DP group")
        if not isinstance(checkpoint, (str, type(None))):
            problems.append(f"field 'checkpoint' is {checkpoint!r}, not a checkpoint folder")
        if problems:
            raise StorageError(f"{uri}: not a run state: {'; '.join(problems)}")
        known = {f.name for f in fields(cls)}  # (a field a newer version added is left out)
        return cls(**{k: v for k, v in data.items() if k in known})

    def save(self, run_uri: str) -> None:
        objectstore.write_json(objectstore.join(run_uri, "state.json"), asdict(self))


def config_uri(run_uri: str) -> str:
    """The run's config, as its latest training run trained it (``flows/training.py``)."""
    return objectstore.join(run_uri, "config.json")


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
    ``state.json``: the run redoes those steps). Never the one ``state`` resumes from: call it with
    :func:`resume_point`'s state. Returns the deleted URIs."""
    root = objectstore.join(run_uri, "checkpoints")
    if not objectstore.exists(root):
        return []
    committed = set(committed_checkpoints(run_uri))
    last = state.step if state is not None else -1
    deleted = []
    for uri in _checkpoint_folders(root):
        step = checkpoint_step(uri)
        if step is None or (state is not None and uri == state.checkpoint):
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


def intact_checkpoints(run_uri: str) -> list[tuple[str, dict]]:
    """(folder, manifest) of every checkpoint whose MANIFEST.json reads, holds what a resume needs
    (:func:`commit_checkpoint` writes it) and lists files that are all there; oldest first."""
    intact = []
    for uri in committed_checkpoints(run_uri):
        try:
            manifest = objectstore.read_json(objectstore.join(uri, "MANIFEST.json"))
        except StorageError:
            continue
        if (isinstance(manifest, dict) and {"step", "cursors", "policy_version", "files"} <= manifest.keys()
                and not _missing_files(uri, manifest)):
            intact.append((uri, manifest))
    return intact


def _missing_files(uri: str, manifest: dict) -> list[str]:
    fs, path = objectstore.fs_for(uri)
    prefix = path.rstrip("/") + "/"
    present = {p[len(prefix):] for p in fs.find(path) if p.startswith(prefix)}
    return [f for f in manifest.get("files", []) if f not in present]


def _damage(uri: str) -> str | None:
    """What is wrong with the checkpoint folder ``uri`` (None: intact)."""
    manifest_uri = objectstore.join(uri, "MANIFEST.json")
    if not objectstore.exists(uri):
        return "is gone"
    if not objectstore.exists(manifest_uri):
        return "has no MANIFEST.json"
    try:
        manifest = objectstore.read_json(manifest_uri)
    except StorageError as e:
        return f"has a MANIFEST.json that cannot be read ({e})"
    missing = _missing_files(uri, manifest) if isinstance(manifest, dict) else ["(the manifest is not an object)"]
    return f"lacks {len(missing)} of the files its MANIFEST.json lists ({', '.join(missing[:3])})" if missing else None


def _what_stands(run_uri: str) -> str:
    """The run's intact checkpoints, and how to resume from one by hand."""
    try:
        intact = intact_checkpoints(run_uri)
    except Exception as e:  # noqa: BLE001 - listing is a courtesy here; the error it adds to is the point
        return f"its checkpoints under {run_uri}/checkpoints could not be listed ({type(e).__name__}: {e})"
    if not intact:
        return "no committed checkpoint of the run is intact: use another run name to start over"
    folders = ", ".join(f"{uri} (after step {m['step'] + 1})" for uri, m in intact)
    return (f"committed checkpoints still intact: {folders}. Restore state.json from a copy, or rebuild it from the "
            "MANIFEST.json of the checkpoint to resume from (its step, cursors, policy_version and sampling, with "
            "\"checkpoint\": its folder); or use another run name to start over")


def resume_point(run_uri: str, state: RunState | None, warn: Callable[[str], None]) -> RunState | None:
    """The state a run (re)starts from: ``state`` when the checkpoint it names is intact.

    That checkpoint was committed (its manifest is written before ``state.json``), so one that has
    lost its manifest or files since — removed by hand, by a sync tool or a bucket's lifecycle
    rule — is never deleted: it is set aside as ``<folder>.damaged-<time>``, ``state.json`` is
    rewritten for the newest intact checkpoint before it (its manifest holds the cursors and
    sampling state that go with it) and the run resumes there, saying so through ``warn``. With
    none intact it stops, naming the folder."""
    if state is None or state.checkpoint is None:
        return state
    damage = _damage(state.checkpoint)
    if damage is None:
        return state
    older = [(uri, m) for uri, m in intact_checkpoints(run_uri) if m["step"] < state.step]
    if not older:
        raise StorageError(
            f"{state.checkpoint}: the checkpoint state.json resumes from (after step {state.step + 1}) {damage}, and no "
            "earlier checkpoint of the run is intact; nothing was deleted. Restore what is missing, or use another run "
            "name to start over")
    aside = None
    if objectstore.exists(state.checkpoint):
        aside = f"{state.checkpoint}.damaged-{time.strftime('%Y%m%dT%H%M%S')}"
        objectstore.move(state.checkpoint, aside)
    uri, manifest = older[-1]
    fallback = RunState(step=manifest["step"], cursors=manifest["cursors"], checkpoint=uri,
                        policy_version=manifest["policy_version"], heldout_before=state.heldout_before,
                        sampling=manifest.get("sampling", []))
    fallback.save(run_uri)
    warn(f"{state.checkpoint}, the checkpoint state.json resumed from (after step {state.step + 1}), {damage}"
         f"{f'; it is kept as {aside}' if aside else ''}. Resuming from {uri} (after step {fallback.step + 1}), the newest "
         f"intact checkpoint before it: steps {fallback.step + 2} to {state.step + 1} are trained again")
    return fallback
