"""Run state and checkpoint commits.

``{run}/state.json`` points at the last committed checkpoint and holds the data cursors and
dynamic-sampling state (carried-over groups, keep-ratio estimate) that go with it. A checkpoint
folder counts only once its ``MANIFEST.json`` exists: the manifest is written after every file it
lists and records each file's size and SHA-256 (computed by the writer from the bytes it wrote:
:func:`file_record`), and ``state.json`` is written after the manifest, so a crash at any point
leaves an intact checkpoint to resume from.

A resume (:func:`resume_point`) never deletes a committed checkpoint and never reads a missing
``state.json`` as "nothing committed":

* ``state.json`` missing or unreadable next to committed checkpoints: rebuilt from the newest
  intact manifest (the unreadable one kept as ``state.json.damaged-<time>``); with checkpoint
  folders but none intact, the run stops naming them;
* a manifest newer than ``state.json`` (a stop between the two writes): the run resumes from it;
* the checkpoint it names lost its manifest or files, or a file's size differs from the manifest:
  set aside as ``<folder>.damaged-<time>`` (:func:`set_aside`) and the newest intact one before it
  used. The engine hosts check the content (SHA-256) before they load anything
  (``engines/host/checkpointing.py`` ``verify``), and a mismatch takes the same way.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Callable

from storage import objectstore
from storage.objectstore import StorageError


class RunStateError(StorageError):
    """``state.json`` cannot be read or is not a run state; the message names the file, what is
    wrong and the committed checkpoints that are still intact (``problem``: what is wrong alone)."""

    problem = ""


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
            error = RunStateError(f"{e}; {_what_stands(run_uri)}")
            error.problem = str(e).removeprefix(f"{uri}: ")
            raise error from e

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


def file_record(data: bytes) -> dict:
    """What a manifest records of one file: its size and SHA-256, taken from the bytes as they are written."""
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def file_digest(path: str, chunk: int = 8 << 20) -> str:
    """The SHA-256 of a local file, read once in chunks (a checkpoint shard may not fit in memory twice)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def manifest_files(manifest: dict) -> dict[str, dict | None]:
    """The files a manifest lists, each with its record (None: a manifest from before records existed)."""
    files = manifest.get("files", [])
    return dict(files) if isinstance(files, dict) else {name: None for name in files}


def commit_checkpoint(run_uri: str, state: RunState, files: dict[str, dict], keep_last: int,
                      keep_every: int | None = None) -> None:
    """Manifest first, then state; then retention (:func:`apply_retention`).

    ``files``: every rank's files of the checkpoint, each with its :func:`file_record`. Call it only
    once every file is written: with asynchronous checkpoints the training flow commits a step's
    checkpoint after every engine host has reported its write finished (``checkpoint_wait``), so a
    crash mid-write leaves the folder without a manifest and ``state.json`` at the previous checkpoint."""
    manifest = {"step": state.step, "cursors": state.cursors, "policy_version": state.policy_version,
                "sampling": state.sampling, "heldout_before": state.heldout_before,
                "files": dict(sorted(files.items())), "committed_at": time.time()}
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
    """Before a run (re)starts writing checkpoints: delete the checkpoint folders a write in progress
    left behind — folders without a manifest of steps after ``state.step`` (a crash mid-write), which
    the new run would otherwise write into. Never a folder with a manifest, nor one at or before
    ``state.step`` (a committed checkpoint that lost its manifest since is left as it is). Call it with
    :func:`resume_point`'s state. Returns the deleted URIs."""
    root = objectstore.join(run_uri, "checkpoints")
    if not objectstore.exists(root):
        return []
    committed = set(committed_checkpoints(run_uri))
    last = state.step if state is not None else -1
    deleted = []
    for uri in _checkpoint_folders(root):
        step = checkpoint_step(uri)
        if step is not None and step > last and uri not in committed:
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
    return [f"{scheme}://{p}" for p in folders if checkpoint_step(p) is not None]


def intact_checkpoints(run_uri: str) -> list[tuple[str, dict]]:
    """(folder, manifest) of every checkpoint whose MANIFEST.json reads, holds what a resume needs
    (:func:`commit_checkpoint` writes it) and lists files that are all there at the sizes it
    records; oldest first. (Their content is checked where it is loaded: ``Checkpoints.verify``.)"""
    intact = []
    for uri in committed_checkpoints(run_uri):
        manifest, damage = _inspect(uri)
        if damage is None:
            intact.append((uri, manifest))
    return intact


def _inspect(uri: str) -> tuple[dict | None, str | None]:
    """The checkpoint folder's manifest and what is wrong with the folder (None: intact, as far as
    names and sizes tell)."""
    manifest_uri = objectstore.join(uri, "MANIFEST.json")
    if not objectstore.exists(uri):
        return None, "is gone"
    if not objectstore.exists(manifest_uri):
        return None, "has no MANIFEST.json"
    try:
        manifest = objectstore.read_json(manifest_uri)
    except StorageError as e:
        return None, f"has a MANIFEST.json that cannot be read ({e})"
    if not isinstance(manifest, dict) or not {"step", "cursors", "policy_version", "files"} <= manifest.keys():
        return None, "has a MANIFEST.json that is not a checkpoint's manifest"
    fs, path = objectstore.fs_for(uri)
    prefix = path.rstrip("/") + "/"
    sizes = {p[len(prefix):]: info.get("size") for p, info in fs.find(path, detail=True).items() if p.startswith(prefix)}
    listed = manifest_files(manifest)
    missing = [f for f in listed if f not in sizes]
    if missing:
        return manifest, f"lacks {len(missing)} of the files its MANIFEST.json lists ({', '.join(missing[:3])})"
    for name, record in listed.items():
        if record is not None and sizes[name] != record["size"]:
            return manifest, f"has {name} of {sizes[name]} bytes where its MANIFEST.json recorded {record['size']}"
    return manifest, None


def _what_stands(run_uri: str) -> str:
    """The run's intact checkpoints, and what the next command does with them."""
    try:
        intact = intact_checkpoints(run_uri)
    except Exception as e:  # noqa: BLE001 - listing is a courtesy here; the error it adds to is the point
        return f"its checkpoints under {run_uri}/checkpoints could not be listed ({type(e).__name__}: {e})"
    if not intact:
        return "no committed checkpoint of the run is intact: use another run name to start over"
    folders = ", ".join(f"{uri} (after step {m['step'] + 1})" for uri, m in intact)
    return (f"committed checkpoints still intact: {folders}. The same training command rebuilds state.json from the "
            "newest one's MANIFEST.json (keeping this one aside)")


def _aside(uri: str) -> str:
    """Move a damaged object or folder out of the way, never deleting it; returns where it is now."""
    aside = f"{uri}.damaged-{time.strftime('%Y%m%dT%H%M%S')}"
    objectstore.move(uri, aside)
    return aside


def _from_manifest(uri: str, manifest: dict, heldout_before: float | None) -> RunState:
    return RunState(step=manifest["step"], cursors=manifest["cursors"], checkpoint=uri,
                    policy_version=manifest["policy_version"], sampling=manifest.get("sampling", []),
                    heldout_before=manifest.get("heldout_before", heldout_before))


def resume_point(run_uri: str, warn: Callable[[str], None]) -> RunState | None:
    """The state a run (re)starts from (None: the beginning), read from ``state.json`` and the
    checkpoints' manifests; every change it makes is said through ``warn``, and nothing is deleted.

    * ``state.json`` missing or unreadable: rebuilt from the newest intact checkpoint's manifest
      (it holds the step, cursors, sampling state and policy version; the unreadable file is kept as
      ``state.json.damaged-<time>``); with checkpoint folders and none intact, the run stops naming them.
    * a checkpoint committed after ``state.json`` was last written (its manifest is complete; the stop
      came before the state's write): the run resumes from it.
    * the checkpoint ``state.json`` names lost its manifest, files or bytes since: :func:`set_aside`."""
    try:
        state, unreadable = RunState.load(run_uri), None
    except RunStateError as e:
        state, unreadable = None, e
    intact = intact_checkpoints(run_uri)
    state_uri = objectstore.join(run_uri, "state.json")
    if state is None:
        folders = _checkpoint_folders(objectstore.join(run_uri, "checkpoints")) \
            if objectstore.exists(objectstore.join(run_uri, "checkpoints")) else []
        if not intact and folders:
            raise RunStateError(f"{state_uri}: {unreadable.problem if unreadable else 'is missing'}, and none of the run's "
                                f"checkpoint folders is intact ({', '.join(folders)}); nothing was deleted. Restore them, "
                                "or use another run name to start over")
        if not intact:
            if unreadable:
                warn(f"{state_uri}: {unreadable.problem}; no checkpoint was committed yet, so the run starts over (the "
                     f"file is kept as {_aside(state_uri)})")
            return None
        uri, manifest = intact[-1]
        why = "is missing" if unreadable is None else f"cannot be read: {unreadable.problem} (it is kept as {_aside(state_uri)})"
        state = _from_manifest(uri, manifest, None)
        state.save(run_uri)
        warn(f"{state_uri} {why}: rebuilt from {uri}/MANIFEST.json, the newest intact checkpoint (after step "
             f"{state.step + 1}); nothing was deleted")
        return state
    newer = [(uri, m) for uri, m in intact if m["step"] > state.step]
    if newer:
        uri, manifest = newer[-1]
        state = _from_manifest(uri, manifest, state.heldout_before)
        state.save(run_uri)
        warn(f"{uri} was committed after {state_uri} was last written (a stop between the two writes): resuming from it "
             f"(after step {state.step + 1})")
        return state
    if state.checkpoint is None:
        return state
    _, damage = _inspect(state.checkpoint)
    return state if damage is None else set_aside(run_uri, state, damage, warn)


def set_aside(run_uri: str, state: RunState, damage: str, warn: Callable[[str], None]) -> RunState:
    """The checkpoint ``state`` resumes from is damaged (``damage`` says how: its manifest or files
    lost since — removed by hand, by a sync tool or a bucket's lifecycle rule — a size, or a content
    that is not what its manifest recorded): it is kept as ``<folder>.damaged-<time>``, never
    deleted; ``state.json`` is rewritten for the newest intact checkpoint before it (its manifest
    holds the cursors and sampling state that go with it) and the run resumes there, saying so
    through ``warn``. With none intact it stops, naming the folder."""
    older = [(uri, m) for uri, m in intact_checkpoints(run_uri) if m["step"] < state.step]
    if not older:
        raise StorageError(
            f"{state.checkpoint}: the checkpoint state.json resumes from (after step {state.step + 1}) {damage}, and no "
            "earlier checkpoint of the run is intact; nothing was deleted. Restore what is missing, or use another run "
            "name to start over")
    aside = _aside(state.checkpoint) if objectstore.exists(state.checkpoint) else None
    uri, manifest = older[-1]
    fallback = _from_manifest(uri, manifest, state.heldout_before)
    fallback.save(run_uri)
    warn(f"{state.checkpoint}, the checkpoint state.json resumed from (after step {state.step + 1}), {damage}"
         f"{f'; it is kept as {aside}' if aside else ''}. Resuming from {uri} (after step {fallback.step + 1}), the newest "
         f"intact checkpoint before it: steps {fallback.step + 2} to {state.step + 1} are trained again")
    return fallback
