"""What a person watching a run in the Prefect UI sees besides states and logs.

* ``{name}-progress`` — steps done out of ``steps`` (a progress artifact of the ``train`` run);
* ``{name}-dp-{g}-progress`` — the stages of the current step that group ``g`` has done (a
  progress artifact of each DP-group sub-flow, updated as each stage task finishes);
* ``{name}-curves`` — reward and rollout accuracy per step as Unicode sparklines and bars
  (markdown of the ``train`` run, redrawn in place after every step), its points kept in
  ``runs/{name}/curves.json`` so that a resumed run draws the whole run;
* ``{name}-iteration`` (table) and ``{name}-summary`` (markdown) are written by the flows.

Progress and curves are created once per flow run and then updated in place, in the
background. Artifacts are for people: a failing artifact call is logged as a warning and
never fails the step.
"""

from __future__ import annotations

import asyncio
import math
from uuid import UUID

from prefect import get_run_logger
from prefect.artifacts import acreate_markdown_artifact, acreate_progress_artifact, aupdate_progress_artifact
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import ArtifactUpdate

from storage import objectstore

CURVE_FIELDS = ("step", "reward", "accuracy", "kept_groups", "dropped_groups", "waves", "loss", "seconds", "heldout")
SPARKS = "▁▂▃▄▅▆▇█"
EIGHTHS = " ▏▎▍▌▋▊▉"


async def _quietly(what: str, call):
    try:
        return await call
    except Exception as e:  # noqa: BLE001 - an artifact is worth a warning, not a failed step
        get_run_logger().warning("could not write the %s artifact: %s: %s", what, type(e).__name__, e)
        return None


class LiveArtifact:
    """One artifact created once and then updated in place (the UI shows the newest value).

    Values are sent in the background so the flow never waits on the UI, and only the newest
    one is sent when several come while one is on its way; ``flush()`` waits until the
    artifact shows the newest value."""

    def __init__(self, key: str):
        self.key = key
        self.id: UUID | None = None
        self._newest: tuple | None = None
        self._sender: asyncio.Future | None = None
        self._broken = False

    async def _create(self, value, description: str) -> UUID:
        raise NotImplementedError

    async def _update(self, value, description: str) -> None:
        async with get_client() as client:
            await client.update_artifact(self.id, ArtifactUpdate(data=value, description=description))

    def show(self, value, description: str) -> None:
        self._newest = (value, description)
        if self._sender is None or self._sender.done():
            self._sender = asyncio.ensure_future(self._send())

    async def _send(self) -> None:
        while self._newest is not None and not self._broken:
            value, description = self._newest
            self._newest = None
            if self.id is None:
                self.id = await _quietly(self.key, self._create(value, description))
                self._broken = self.id is None
            else:
                await _quietly(self.key, self._update(value, description))

    async def flush(self) -> None:
        while self._sender is not None and not self._sender.done():
            await self._sender


class Progress(LiveArtifact):
    """A progress artifact: ``done`` out of ``total`` units, and a line saying what was done last."""

    def __init__(self, key: str, total: int, done: int = 0):
        super().__init__(key)
        self.total, self.done = max(total, 1), done

    @property
    def percent(self) -> float:
        return min(100.0, 100.0 * self.done / self.total)

    async def _create(self, value, description: str) -> UUID:
        return await acreate_progress_artifact(value, key=self.key, description=description)

    async def _update(self, value, description: str) -> None:
        await aupdate_progress_artifact(self.id, value, description=description)

    def start(self, description: str) -> "Progress":
        self.show(self.percent, description)
        return self

    def advance(self, description: str, units: int = 1, more_total: int = 0) -> None:
        self.done += units
        self.total += more_total
        self.show(self.percent, description)


class StepProgress(Progress):
    """The stages of one DP group's step: ``wave_stages`` per rollout wave (rollout, genrm_score,
    dynamic_filter; partial colocation: rollout_and_score, dynamic_filter), then ``after_stages``
    (train_step, sync_weights, and checkpoint_wait, checkpoint where the step has them). A further
    wave adds ``wave_stages``."""

    def __init__(self, run: str, step: int, group: int, wave_stages: int, after_stages: int):
        super().__init__(f"{run}-dp-{group}-progress", total=wave_stages + after_stages)
        self.step, self.group, self.wave_stages = step, group, wave_stages
        self.start(f"dp-{group} step {step}: rollout wave 0 running")

    def finished(self, stage: str, wave: int | None = None) -> None:
        what = f"{stage} wave {wave}" if wave is not None else stage
        self.advance(f"dp-{self.group} step {self.step}: {what} done ({self.done + 1}/{self.total} stages)")

    def another_wave(self, wave: int) -> None:
        self.advance(f"dp-{self.group} step {self.step}: too few groups kept, rollout wave {wave} running", units=0, more_total=self.wave_stages)


class Curves(LiveArtifact):
    """``{run}-curves``: reward and accuracy per step, redrawn after every step. The points live
    in ``runs/{run}/curves.json`` so that a resumed run draws its earlier steps too (with the run's
    steps and, once it ends, its held-out figure after the last step: ``yattflow status`` reads them)."""

    def __init__(self, run: str, run_uri: str, steps: int, first_step: int, heldout_before: float | None,
                 heldout_metric: str | None = None):
        super().__init__(f"{run}-curves")
        self.run, self.uri, self.steps, self.heldout_before = run, objectstore.join(run_uri, "curves.json"), steps, heldout_before
        self.heldout_metric = heldout_metric
        points = objectstore.read_json(self.uri).get("points", []) if objectstore.exists(self.uri) else []
        self.points = [p for p in points if p["step"] < first_step]  # a resume redoes the later ones
        self._draw()

    async def _create(self, value, description: str) -> UUID:
        return await acreate_markdown_artifact(value, key=self.key, description=description)

    def add(self, metrics: dict) -> None:
        flat = metrics | metrics.get("train", {})  # the trainer's figures (loss) beside the step's
        point = {k: flat[k] for k in CURVE_FIELDS if k in flat}
        self.points = [p for p in self.points if p["step"] != point["step"]] + [point]
        objectstore.write_json(self.uri, {"points": self.points, "steps": self.steps})
        self._draw()

    def finish(self, heldout_after: float | None) -> None:
        """The run's end: the held-out figure after its last step (kept for ``yattflow status``, until a later step)."""
        after_step = max((p["step"] + 1 for p in self.points), default=0)
        objectstore.write_json(self.uri, {"points": self.points, "steps": self.steps, "heldout_after": heldout_after,
                                          "after_step": after_step})
        self._draw(heldout_after)

    def _draw(self, heldout_after: float | None = None) -> None:
        self.show(curves_markdown(self.run, self.points, self.steps, self.heldout_before, heldout_after, self.heldout_metric),
                  f"{self.run}: reward and accuracy per step ({len(self.points)} of {self.steps} steps)")


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


def percent(x: float | None) -> str:
    """``31.2%``, or ``n/a`` for a figure not measured."""
    return "n/a" if x is None else f"{100 * x:.1f}%"


def curves_markdown(run: str, points: list[dict], steps: int, heldout_before: float | None,
                    heldout_after: float | None = None, heldout_metric: str | None = None, rows: int = 40) -> str:
    done = len(points)
    heldout = (f"**{percent(heldout_before)} → {percent(heldout_after)}** (before → after RL)" if heldout_after is not None
               else f"**{percent(heldout_before)}** before RL (after RL: measured when the run ends)")
    heldout = f"Held-out {heldout_metric}: {heldout}" if heldout_metric else "No held-out evaluation (data.heldout is not set)"
    lines = [f"# Run `{run}`: reward and accuracy, {done} of {steps} steps", "", heldout, ""]
    if not points:
        return "\n".join(lines + ["No step has finished yet."])
    first, last = points[0]["step"], points[-1]["step"]
    lines += [f"| per step | first | latest | min | max | step {first} → {last} |", "|---|---:|---:|---:|---:|---|"]
    series = [("reward (mean)", "reward", lambda v: f"{v:.3f}"), ("rollout accuracy", "accuracy", percent), ("held-out", "heldout", percent),
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
    latest = f", the latest {rows} steps" if len(points) > rows else ""
    # one chart per metric, bars last on each line: block characters are not always one cell wide
    for title, key, fmt, (a, b) in (("Reward (mean)", "reward", lambda v: f"{v:.3f}", (lo, hi)),
                                    ("Rollout accuracy", "accuracy", percent, (0.0, 1.0))):
        lines += ["", f"{title} per step{latest}, bars from {fmt(a)} to {fmt(b)}:", "", "```text", f"{'step':>6}  {key:>8}"]
        lines += [f"{p['step']:>6}  {fmt(p[key]) if p.get(key) is not None else 'n/a':>8}  {bar(p.get(key), a, b)}" for p in shown]
        lines.append("```")
    return "\n".join(lines)
