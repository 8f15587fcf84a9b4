"""Where each run under a storage root stands, from storage alone: ``yattflow status`` without a
Prefect server.

A run is a folder ``{root}/runs/{name}`` with a ``state.json`` or a ``lease.json``. Its committed
state (the last checkpoint), the steps trained past it and the held-out figures (``curves.json``,
written after every step), and its lease (``storage/lease.py``: whether a live run holds it, and
the Prefect flow run that took it last) are read; nothing is written.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from storage import lease as leases
from storage import objectstore
from storage.runstate import RunState


@dataclass
class RunStatus:
    name: str
    uri: str
    checkpoint_step: int | None = None  # steps the last committed checkpoint holds (0: none yet; None: no state)
    trained: int | None = None  # steps trained, past the checkpoint too (curves.json)
    steps: int | None = None  # the steps the run was started for, as its last command had it
    heldout_before: float | None = None
    heldout_last: tuple[int, float] | None = None  # (step, figure): the latest held-out figure measured
    heldout_after: float | None = None  # the held-out figure at the run's end
    points: list[dict] = field(default_factory=list)  # curves.json's: a point per step trained
    lease_held: bool = False
    lease: str = "never taken"
    flow_run_id: str | None = None  # the flow run that took the lease last (it trains, or trained, the run)
    problem: str | None = None  # what could not be read


def run_statuses(root: str, name: str | None = None) -> list[RunStatus]:
    """Every run under ``root`` (or only ``name``), by name."""
    runs_uri = objectstore.join(root, "runs")
    if name is not None:
        uris = [objectstore.join(runs_uri, name)]
    else:
        uris = objectstore.list_files(runs_uri) if objectstore.exists(runs_uri) else []
    found = []
    for uri in uris:
        if any(objectstore.exists(objectstore.join(uri, f)) for f in ("state.json", "lease.json")):
            found.append(run_status(uri))
    return found


def run_status(run_uri: str) -> RunStatus:
    status = RunStatus(name=run_uri.rstrip("/").rsplit("/", 1)[-1], uri=run_uri)
    problems = []
    try:
        state = RunState.load(run_uri)
        if state is not None:
            status.checkpoint_step, status.heldout_before = state.step + 1, state.heldout_before
            status.trained = state.step + 1
    except Exception as e:  # noqa: BLE001 - a damaged run is shown with what is wrong
        problems.append(_first_line(e))
    try:
        curves_uri = objectstore.join(run_uri, "curves.json")
        curves = objectstore.read_json(curves_uri) if objectstore.exists(curves_uri) else {}
        status.points = points = curves.get("points", [])
        status.steps, status.heldout_after = curves.get("steps"), curves.get("heldout_after")
        if points:
            status.trained = max(status.trained or 0, max(p["step"] + 1 for p in points))
        measured = [(p["step"] + 1, p["heldout"]) for p in points if p.get("heldout") is not None]
        if curves.get("heldout_after") is not None:
            measured.append((curves["after_step"], curves["heldout_after"]))
        status.heldout_last = max(measured) if measured else None
    except Exception as e:  # noqa: BLE001
        problems.append(_first_line(e))
    try:
        lease = leases.read(run_uri)
        if lease is not None:
            status.lease_held = lease["held"]
            status.flow_run_id = lease["holder"].get("flow_run_id")
            h = lease["holder"]
            status.lease = (f"held by pid {h['pid']} on {h['hostname']} since {lease['since']}" if lease["held"]
                            else "free")
    except Exception as e:  # noqa: BLE001
        problems.append(_first_line(e))
    status.problem = "; ".join(problems) or None
    return status


def _first_line(error: BaseException) -> str:
    return (str(error).splitlines() or [type(error).__name__])[0]
