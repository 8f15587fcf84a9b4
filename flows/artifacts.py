"""What a person watching a run in the Prefect UI sees besides states and logs.

* ``{name}-progress`` — steps done out of ``steps`` (a progress artifact of the ``train`` run);
* ``{name}-dp-{g}-progress`` — the stages of the current step that group ``g`` has done (a
  progress artifact of each DP-group sub-flow, updated as each stage task finishes);
* ``{name}-curves`` — the learning curve: a picture of reward, rollout accuracy and held-out per
  step, then sparklines and bars (``flows/curves.py`` draws them; markdown of the ``train`` run,
  redrawn in place after every step), its points kept in ``runs/{name}/curves.json`` so that a
  resumed run draws the whole run, its picture in ``runs/{name}/curves.svg``;
* ``{name}-iteration`` (table) and ``{name}-summary`` (markdown, ``summary_markdown``) are written by the flows.

Progress and curves are created once per flow run and then updated in place, in the
background. Artifacts are for people: a failing artifact call is logged as a warning and
never fails the step.
"""

from __future__ import annotations

import asyncio
from uuid import UUID

from prefect import get_run_logger
from prefect.artifacts import acreate_markdown_artifact, acreate_progress_artifact, aupdate_progress_artifact
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import ArtifactUpdate

from flows.curves import curves_markdown, curves_svg, percent
from storage import objectstore

CURVE_FIELDS = ("step", "reward", "accuracy", "kept_groups", "dropped_groups", "waves", "loss", "seconds", "heldout")


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
    """``{run}-curves``: the learning curve, redrawn after every step. The points live in
    ``runs/{run}/curves.json`` so that a resumed run draws its earlier steps too (with the run's steps
    and, once it ends, its held-out figure after the last step: ``yattflow status`` reads them); the
    picture beside them in ``curves.svg``."""

    def __init__(self, run: str, run_uri: str, steps: int, first_step: int, heldout_before: float | None,
                 heldout_metric: str | None = None):
        super().__init__(f"{run}-curves")
        self.run, self.uri, self.steps, self.heldout_before = run, objectstore.join(run_uri, "curves.json"), steps, heldout_before
        self.picture = objectstore.join(run_uri, "curves.svg")
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
        self._keep({"points": self.points, "steps": self.steps})

    def finish(self, heldout_after: float | None) -> None:
        """The run's end: the held-out figure after its last step (kept for ``yattflow status``, until a later step)."""
        after_step = max((p["step"] + 1 for p in self.points), default=0)
        self._keep({"points": self.points, "steps": self.steps, "heldout_after": heldout_after, "after_step": after_step},
                   heldout_after)

    def _keep(self, curves: dict, heldout_after: float | None = None) -> None:
        """The points and the picture to storage, the artifact redrawn."""
        objectstore.write_json(self.uri, curves)
        svg = curves_svg(self.run, self.points, self.steps, self.heldout_before, heldout_after)
        objectstore.write_bytes(self.picture, svg.encode())
        self._draw(heldout_after, svg)

    def _draw(self, heldout_after: float | None = None, svg: str | None = None) -> None:
        self.show(curves_markdown(self.run, self.points, self.steps, self.heldout_before, heldout_after, self.heldout_metric,
                                  svg=svg),
                  f"{self.run}: reward and accuracy per step ({len(self.points)} of {self.steps} steps)")


def summary_markdown(summary: dict) -> str:
    """The ``{name}-summary`` artifact: the held-out figure before and after, and a row per step."""
    lines = [f"# Run `{summary['run']}`", "",
             f"Held-out {summary['heldout_metric'] or 'evaluation: off (data.heldout is not set)'}: "
             f"**{percent(summary['heldout_before'])} → {percent(summary['heldout_after'])}**", "",
             "| step | reward | accuracy | kept | dropped | waves | turns | tool calls (errors) | cut | seconds | held-out |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for m in summary["history"]:
        e = m.get("episodes") or {}  # single-turn samples: no episode columns
        episode = (f"{e['turns']:.2f} | {e['tool_calls']:.2f} ({e['tool_errors']:.2f}) | {e['truncated']:.0%}" if e
                   else "- | - | -")
        lines.append(f"| {m['step']} | {m['reward']:.3f} | {m['accuracy']:.3f} | {m['kept_groups']} | {m['dropped_groups']} | "
                     f"{m['waves']} | {episode} | {m['seconds']:.2f} | {percent(m.get('heldout')) if m.get('heldout') is not None else '-'} |")
    if summary.get("evaluation"):  # every evaluation set: before, every eval.every steps, after (flows/evaluations.py)
        from flows.evaluations import markdown

        lines += ["", markdown(summary["evaluation"])]
    return "\n".join(lines)
