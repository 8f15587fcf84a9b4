"""A run's evaluations, flow side: every set scored on every DP group's hosts, and the record of them.

``evaluate_sets`` asks each group's host to score its share of every evaluation set
(``engines/evaluation.py``; the host's ``evaluate`` stage) and adds the shares up: ``{set: {figure: value}}``,
e.g. ``{"heldout": {"greedy": 0.325, "mean@4": 0.22, "pass@1": 0.22, "pass@2": 0.35, "pass@4": 0.475, "maj@4": 0.3,
"prompts": 40}}``.

``EvaluationLog`` keeps them in ``runs/<name>/evaluation.json`` (``before``, each evaluated step, ``after``),
rewritten whole at each evaluation: a resumed run keeps its ``before`` and redoes the steps it redoes;
``yattflow status`` reads it, and the run's summary artifact shows it as a table.
"""

from __future__ import annotations

import asyncio

from engines.config import RunConfig
from engines.wire.commands import Evaluate
from engines.evaluation import figure_order, figures_line, merged, set_metric, sets_of
from flows.curves import percent
from storage import objectstore
from tasks import stages

FILE = "evaluation.json"


async def evaluate_sets(config: RunConfig, label: str) -> dict[str, dict[str, float]]:
    """Every evaluation set's figures for the current policy ({} when there is none)."""
    if not sets_of(config):
        return {}
    e = config.eval
    request = Evaluate(sets=sets_of(config), samples=e.samples, temperature=e.temperature or config.rollout.temperature,
                       correct_at=e.correct_at, seed=config.seed)
    parts = await asyncio.gather(*(stages.evaluate(stages.Run.of(config), g, label, request) for g in range(config.dp)))
    return merged([p.sets for p in parts])


def describe(config: RunConfig) -> dict[str, str]:
    """Each set's name -> what its scores are and on what: ``mean engines.demo.sums:last_number reward on file://…``."""
    return {s.name: f"{set_metric(config, s)} on {s.uri} (first {s.limit})" for s in sets_of(config)}


class EvaluationLog:
    """``runs/<name>/evaluation.json``: ``{"sets": {name: what}, "samples": k, "temperature": t, "before": {...},
    "steps": {"3": {...}}, "after": {...}, "after_step": n}``."""

    def __init__(self, config: RunConfig, first_step: int = 0):
        self.uri = objectstore.join(config.run_uri, FILE)
        self.data = objectstore.read_json(self.uri) if objectstore.exists(self.uri) else {}
        self.data["steps"] = {s: e for s, e in self.data.get("steps", {}).items() if int(s) <= first_step}  # a resume redoes the rest
        self.data.pop("after", None) if first_step == 0 else None
        e = config.eval
        self.data |= {"sets": describe(config), "order": [s.name for s in sets_of(config)], "samples": e.samples,
                      "temperature": (e.temperature or config.rollout.temperature) if e.samples else None}

    @property
    def before(self) -> dict | None:
        return self.data.get("before")

    def record(self, when: str | int, evaluation: dict[str, dict[str, float]]) -> None:
        """``when``: "before", "after", or the number of steps done (1-based, as the console counts them)."""
        if not evaluation:
            return
        if when in ("before", "after"):
            self.data[when] = evaluation
        else:
            self.data["steps"][str(when)] = evaluation
        objectstore.write_json(self.uri, self.data)

    def finish(self, steps_done: int, evaluation: dict[str, dict[str, float]]) -> None:
        self.data["after_step"] = steps_done
        self.record("after", evaluation)


def read(run_uri: str) -> dict:
    uri = objectstore.join(run_uri, FILE)
    return objectstore.read_json(uri) if objectstore.exists(uri) else {}


def set_names(record: dict, rows: list[tuple[str, dict]]) -> list[str]:
    """The sets in the run's order (``order``; JSON keeps keys sorted), then any others the rows have."""
    return list(dict.fromkeys([*record.get("order", []), *(n for _, e in rows for n in e)]))


def lines(evaluation: dict[str, dict[str, float]]) -> list[str]:
    """A line per set: ``heldout: greedy 32.5%, mean@4 21.9%, pass@4 47.5%, maj@4 30.0% (40 prompts)``."""
    return [f"{name}: {figures_line(figures)}" for name, figures in evaluation.items()]


def timeline(record: dict) -> list[tuple[str, dict]]:
    """(label, evaluation) in order: before RL, after each evaluated step, after RL (a last step evaluated
    twice is shown once)."""
    out = [("before RL", record["before"])] if record.get("before") else []
    steps = sorted(record.get("steps", {}).items(), key=lambda kv: int(kv[0]))
    out += [(f"after step {s}", e) for s, e in steps]
    if record.get("after") and not (steps and int(steps[-1][0]) == record.get("after_step") and steps[-1][1] == record["after"]):
        out.append((f"after RL ({record.get('after_step', '?')} steps)", record["after"]))
    return out


def markdown(record: dict, rows: list[tuple[str, dict]] | None = None) -> str:
    """The evaluation table of a run's summary artifact: a row per evaluation (``rows``: (label, evaluation);
    default the record's ``timeline``), a column per set and figure."""
    rows = timeline(record) if rows is None else rows
    if not rows:
        return ""
    figures = sorted({fig for _, e in rows for figs in e.values() for fig in figs if fig != "prompts"}, key=figure_order)
    columns = [(name, fig) for name in set_names(record, rows) for fig in figures if any(fig in e.get(name, {}) for _, e in rows)]
    out = ["## Evaluation", ""]
    out += [f"* `{name}`: {record['sets'][name]}" for name in set_names(record, rows) if name in record.get("sets", {})]
    if record.get("samples"):
        out.append(f"* {record['samples']} samples per prompt at temperature {record['temperature']:g}; pass@j by the unbiased "
                   "estimator, maj@k: the majority answer's score")
    out += ["", "| when | " + " | ".join(f"{name} {fig}" for name, fig in columns) + " |",
            "|---|" + "---|" * len(columns)]
    for label, e in rows:
        out.append(f"| {label} | " + " | ".join(percent(e.get(name, {}).get(fig)) for name, fig in columns) + " |")
    return "\n".join(out)


def status_lines(record: dict) -> list[str]:
    """``yattflow status NAME``'s evaluation lines: each set's figures before RL and at the latest evaluation."""
    rows = timeline(record)
    if not rows:
        return []
    first, last = rows[0], rows[-1]
    out = []
    for name in set_names(record, rows):
        a, b = first[1].get(name), last[1].get(name)
        figs = sorted((f for f in (b or a or {}) if f != "prompts"), key=figure_order)
        shown = ", ".join(f"{f} {percent((a or {}).get(f))} → {percent((b or {}).get(f))}" if len(rows) > 1 else
                          f"{f} {percent((a or {}).get(f))}" for f in figs)
        out.append(f"{name}: {shown} ({first[0]}{' → ' + last[0] if len(rows) > 1 else ''})")
    return out
