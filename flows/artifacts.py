"""What a person watching a run in the Prefect UI sees besides states and logs.

* ``{name}-progress`` — steps done out of ``steps`` (a progress artifact of the ``train`` run);
* ``{name}-dp-{g}-progress`` — the stages of the current step that group ``g`` has done (a
  progress artifact of each DP-group sub-flow, updated as each stage task finishes);
* ``{name}-curves`` — reward and rollout accuracy per step as Unicode sparklines and bars
  (markdown, a new version after every step), kept in ``runs/{name}/curves.json`` so a
  resumed run draws the whole run;
* ``{name}-iteration`` (table) and ``{name}-summary`` (markdown) are written by the flows.

Artifacts are for people: a failing artifact call is logged as a warning and never fails
the step.
"""

from __future__ import annotations

import asyncio
import math
from uuid import UUID

from prefect import get_run_logger
from prefect.artifacts import acreate_markdown_artifact, acreate_progress_artifact, aupdate_progress_artifact

from storage import objectstore

CURVE_FIELDS = ("step", "reward", "accuracy", "kept_groups", "dropped_groups", "waves", "loss", "seconds")
SPARKS = "▁▂▃▄▅▆▇█"
EIGHTHS = " ▏▎▍▌▋▊▉"


async def _quietly(what: str, call):
    try:
        return await call
    except Exception as e:  # noqa: BLE001 - an artifact is worth a warning, not a failed step
        get_run_logger().warning("could not write the %s artifact: %s: %s", what, type(e).__name__, e)
        return None


class Progress:
    """One progress artifact: ``done`` out of ``total`` units, with a line saying what was done
    last. Updates are sent in order in the background, so a stage never waits on the UI;
    ``flush()`` waits for them."""

    def __init__(self, key: str, total: int, done: int = 0):
        self.key, self.total, self.done = key, max(total, 1), done
        self.id: UUID | None = None
        self._last: asyncio.Future | None = None

    @property
    def percent(self) -> float:
        return min(100.0, 100.0 * self.done / self.total)

    def _then(self, send) -> None:
        previous = self._last

        async def after_previous():
            if previous is not None:
                await previous
            await send()

        self._last = asyncio.ensure_future(after_previous())

    def start(self, description: str) -> "Progress":
        percent = self.percent

        async def create():
            self.id = await _quietly(self.key, acreate_progress_artifact(percent, key=self.key, description=description))

        self._then(create)
        return self

    def advance(self, description: str, units: int = 1, more_total: int = 0) -> None:
        self.done += units
        self.total += more_total
        percent = self.percent

        async def update():
            if self.id is not None:
                await _quietly(self.key, aupdate_progress_artifact(self.id, percent, description=description))

        self._then(update)

    async def flush(self) -> None:
        if self._last is not None:
            await self._last


class StepProgress(Progress):
    """The stages of one DP group's step: 3 per wave (rollout, genrm_score, dynamic_filter),
    then train_step, sync_weights and, on checkpoint steps, checkpoint. A further wave adds 3."""

    def __init__(self, run: str, step: int, group: int, checkpoint: bool):
        super().__init__(f"{run}-dp-{group}-progress", total=3 + 2 + int(checkpoint))
        self.step, self.group = step, group
        self.start(f"dp-{group} step {step}: rollout wave 0 running")

    def finished(self, stage: str, wave: int | None = None) -> None:
        what = f"{stage} wave {wave}" if wave is not None else stage
        self.advance(f"dp-{self.group} step {self.step}: {what} done ({self.done + 1}/{self.total} stages)")

    def another_wave(self, wave: int) -> None:
        self.advance(f"dp-{self.group} step {self.step}: too few groups kept, rollout wave {wave} running", units=0, more_total=3)


# ------------------------------------------------------------------------------- curves


def curves_uri(run_uri: str) -> str:
    return objectstore.join(run_uri, "curves.json")


def load_curve(run_uri: str, before_step: int) -> list[dict]:
    """The points of earlier invocations of this run, for steps a resume does not redo."""
    uri = curves_uri(run_uri)
    if not objectstore.exists(uri):
        return []
    return [p for p in objectstore.read_json(uri).get("points", []) if p["step"] < before_step]


def add_point(run_uri: str, points: list[dict], metrics: dict) -> list[dict]:
    points = [p for p in points if p["step"] != metrics["step"]] + [{k: metrics[k] for k in CURVE_FIELDS if k in metrics}]
    objectstore.write_json(curves_uri(run_uri), {"points": points})
    return points


async def publish_curves(run: str, points: list[dict], steps: int, heldout_before: float | None,
                         heldout_after: float | None = None) -> None:
    await _quietly(f"{run}-curves", acreate_markdown_artifact(
        key=f"{run}-curves", markdown=curves_markdown(run, points, steps, heldout_before, heldout_after),
        description=f"{run}: reward and accuracy per step ({len(points)} of {steps} steps)",
    ))


def sparkline(values: list[float | None], width: int = 60) -> str:
    """``▁▃▅█``: one character per step (per bucket of steps past ``width``), scaled min..max."""
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return ""
    if len(values) > width:  # bucket means
        size = len(values) / width
        buckets = [values[int(i * size): int((i + 1) * size)] for i in range(width)]
        values = [(sum(b) / len(b)) if (b := [v for v in bucket if v is not None]) else None for bucket in buckets]
    lo, hi = min(vals), max(vals)
    span = hi - lo
    return "".join(" " if v is None else SPARKS[0 if span == 0 else min(7, int((v - lo) / span * 8))] for v in values)


def bar(value: float | None, lo: float, hi: float, width: int = 20) -> str:
    """A horizontal bar in eighths of a character: ``█████▍``."""
    if value is None or hi <= lo:
        return ""
    eighths = round(max(0.0, min(1.0, (value - lo) / (hi - lo))) * width * 8)
    return "█" * (eighths // 8) + (EIGHTHS[eighths % 8] if eighths % 8 else "")


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def curves_markdown(run: str, points: list[dict], steps: int, heldout_before: float | None,
                    heldout_after: float | None = None, rows: int = 40) -> str:
    done = len(points)
    heldout = (f"**{_pct(heldout_before)} → {_pct(heldout_after)}** (before → after RL)" if heldout_after is not None
               else f"**{_pct(heldout_before)}** before RL (after RL: measured when the run ends)")
    lines = [f"# Run `{run}`: reward and accuracy, {done} of {steps} steps", "", f"Held-out exact match: {heldout}", ""]
    if not points:
        return "\n".join(lines + ["No step has finished yet."])
    first, last = points[0]["step"], points[-1]["step"]
    lines += [f"| per step | first | latest | min | max | step {first} → {last} |", "|---|---:|---:|---:|---:|---|"]
    series = [("reward (mean)", "reward", lambda v: f"{v:.3f}"), ("rollout accuracy", "accuracy", _pct),
              ("groups kept", "kept_groups", lambda v: f"{v:g}"), ("loss", "loss", lambda v: f"{v:.4f}"),
              ("seconds", "seconds", lambda v: f"{v:.2f}")]
    for label, key, fmt in series:
        vals = [p.get(key) for p in points]
        known = [v for v in vals if v is not None]
        if not known:
            continue
        lines.append(f"| {label} | {fmt(known[0])} | {fmt(known[-1])} | {fmt(min(known))} | {fmt(max(known))} | `{sparkline(vals)}` |")
    rewards = [p["reward"] for p in points if p.get("reward") is not None]
    lo, hi = min(0.0, *rewards), max(1.0, *rewards)
    shown = points[-rows:]
    lines += ["", f"Reward (scale {lo:g} … {hi:g}) and rollout accuracy (0 … 100%)"
              + (f", the latest {rows} steps:" if len(points) > rows else ":"), "", "```text",
              f"{'step':>6}  {'reward':>7}  {'':20}  {'accuracy':>8}  {'':20}"]
    for p in shown:
        acc = p.get("accuracy")
        lines.append(f"{p['step']:>6}  {p['reward']:>7.3f}  {bar(p['reward'], lo, hi):<20}  {_pct(acc):>8}  {bar(acc, 0.0, 1.0):<20}")
    lines.append("```")
    return "\n".join(lines)
