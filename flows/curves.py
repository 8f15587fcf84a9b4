"""A run's learning curve drawn for a person: reward, rollout accuracy and held-out per step.

One set of points (``runs/{name}/curves.json``, written after every step by ``flows/artifacts.py``)
drawn three ways: ``curves_svg``, a picture (on the run's page in the Prefect UI, inside its
``{name}-curves`` artifact, and as ``runs/{name}/curves.svg`` beside the points), ``curves_markdown``,
the artifact's text (sparklines, a table, bars for the latest steps), and ``curves_text``, the
lines ``yattflow status`` prints in a terminal. No Prefect here: ``yattflow status`` runs without a server.
"""

from __future__ import annotations

import base64
import math
from html import escape

SPARKS = "▁▂▃▄▅▆▇█"
EIGHTHS = " ▏▎▍▌▋▊▉"
# the picture's lines: (label, point key, colour)
LINES = (("reward (mean)", "reward", "#2563eb"), ("rollout accuracy", "accuracy", "#ea580c"), ("held-out", "heldout", "#16a34a"))


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


def _scale(points: list[dict]) -> tuple[float, float]:
    """The y range every line shares: 0..1, widened by rewards outside it (an overlong penalty)."""
    rewards = [p["reward"] for p in points if p.get("reward") is not None and math.isfinite(p["reward"])]
    return min(0.0, *rewards), max(1.0, *rewards)


def heldout_points(points: list[dict], heldout_before: float | None, heldout_after: float | None) -> list[tuple[int, float]]:
    """``(steps trained, figure)`` for every held-out measurement: before RL (0), after steps, at the end."""
    measured = [(0, heldout_before)] if heldout_before is not None else []
    measured += [(p["step"] + 1, p["heldout"]) for p in points if p.get("heldout") is not None]
    if heldout_after is not None and points:
        measured.append((points[-1]["step"] + 1, heldout_after))
    return sorted(dict(measured).items())


def curves_svg(run: str, points: list[dict], steps: int, heldout_before: float | None = None,
               heldout_after: float | None = None, width: int = 640, height: int = 280) -> str:
    """The learning curve as an SVG picture: reward and rollout accuracy after each step, held-out
    measurements as dots (at the number of steps trained when measured), on one 0..1 scale."""
    left, right, top, bottom = 48, 16, 34, 52
    lo, hi = _scale(points)
    last = max(steps, max((p["step"] + 1 for p in points), default=0), 1)

    def x(step: float) -> str:
        return f"{left + (width - left - right) * step / last:.1f}"

    def y(v: float) -> str:
        return f"{top + (height - top - bottom) * (hi - v) / (hi - lo):.1f}"

    out = [(f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
            'font-family="sans-serif" font-size="12">'), f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{left}" y="20" font-size="14" fill="#111">{escape(run)}: {len(points)} of {steps} steps</text>']
    for v in sorted({lo, 0.0, 0.5, 1.0, hi}):
        out += [f'<line x1="{left}" y1="{y(v)}" x2="{width - right}" y2="{y(v)}" stroke="#e5e7eb"/>',
                f'<text x="{left - 6}" y="{float(y(v)) + 4:.1f}" text-anchor="end" fill="#555">{v:g}</text>']
    axis = height - bottom + 16
    out += [f'<text x="{left}" y="{axis}" fill="#555">0 steps</text>',
            f'<text x="{width - right}" y="{axis}" text-anchor="end" fill="#555">{last}</text>']
    heldout = heldout_points(points, heldout_before, heldout_after)
    for i, (label, key, colour) in enumerate(LINES):
        if key == "heldout":  # dots: measured now and then
            dots = heldout
        else:  # a point after each step, at the steps trained so far
            dots = _thin([(p["step"] + 1, p[key]) for p in points if p.get(key) is not None and math.isfinite(p[key])])
            if len(dots) > 1:
                out.append(f'<polyline points="{" ".join(f"{x(s)},{y(v)}" for s, v in dots)}" fill="none" '
                           f'stroke="{colour}" stroke-width="2"/>')
                dots = []
        out += [f'<circle cx="{x(s)}" cy="{y(v)}" r="{4 if key == "heldout" else 3}" fill="{colour}"/>' for s, v in dots]
        if key != "heldout" or heldout:  # the legend, under the axis
            out += [f'<rect x="{left + 150 * i}" y="{height - 20}" width="12" height="12" fill="{colour}"/>',
                    f'<text x="{left + 150 * i + 16}" y="{height - 10}" fill="#111">{label}</text>']
    out.append("</svg>")
    return "\n".join(out)


def _thin(xy: list[tuple[float, float]], most: int = 200) -> list[tuple[float, float]]:
    """At most ``most`` points: bucket means past that (the picture stays a few kB on long runs)."""
    if len(xy) <= most:
        return xy
    size = len(xy) / most
    buckets = [xy[int(i * size): int((i + 1) * size)] for i in range(most)]
    return [(sum(s for s, _ in b) / len(b), sum(v for _, v in b) / len(b)) for b in buckets]


def svg_image(svg: str, alt: str) -> str:
    """Markdown showing ``svg`` as an image (a data URI: the Prefect UI drops inline SVG, shows images)."""
    return f"![{alt}](data:image/svg+xml;base64,{base64.b64encode(svg.encode()).decode()})"


SERIES = (("reward (mean)", "reward", lambda v: f"{v:.3f}"), ("rollout accuracy", "accuracy", percent),
          ("held-out", "heldout", percent), ("groups kept", "kept_groups", lambda v: f"{v:g}"),
          ("loss", "loss", lambda v: f"{v:.4f}"), ("seconds", "seconds", lambda v: f"{v:.2f}"))


def curves_markdown(run: str, points: list[dict], steps: int, heldout_before: float | None,
                    heldout_after: float | None = None, heldout_metric: str | None = None, rows: int = 40,
                    svg: str | None = None) -> str:
    """The artifact's text: the held-out figures, the picture (``svg``: already drawn by ``curves_svg``), a
    table per figure and a chart per step."""
    done = len(points)
    heldout = (f"**{percent(heldout_before)} → {percent(heldout_after)}** (before → after RL)" if heldout_after is not None
               else f"**{percent(heldout_before)}** before RL (after RL: measured when the run ends)")
    heldout = f"Held-out {heldout_metric}: {heldout}" if heldout_metric else "No held-out evaluation (data.heldout is not set)"
    lines = [f"# Run `{run}`: reward and accuracy, {done} of {steps} steps", "", heldout, ""]
    if not points:
        return "\n".join(lines + ["No step has finished yet."])
    svg = svg or curves_svg(run, points, steps, heldout_before, heldout_after)
    lines += [svg_image(svg, f"{run}: learning curve"), ""]
    first, last = points[0]["step"], points[-1]["step"]
    lines += [f"| per step | first | latest | min | max | step {first} → {last} |", "|---|---:|---:|---:|---:|---|"]
    for label, key, fmt in SERIES:
        vals = [p.get(key) for p in points]
        known = [v for v in vals if v is not None]
        if not known:
            continue
        lines.append(f"| {label} | {fmt(known[0])} | {fmt(known[-1])} | {fmt(min(known))} | {fmt(max(known))} | `{sparkline(vals)}` |")
    lo, hi = _scale(points)
    shown = points[-rows:]
    latest = f", the latest {rows} steps" if len(points) > rows else ""
    # one chart per metric, bars last on each line: block characters are not always one cell wide
    for title, key, fmt, (a, b) in (("Reward (mean)", "reward", lambda v: f"{v:.3f}", (lo, hi)),
                                    ("Rollout accuracy", "accuracy", percent, (0.0, 1.0))):
        lines += ["", f"{title} per step{latest}, bars from {fmt(a)} to {fmt(b)}:", "", "```text", f"{'step':>6}  {key:>8}"]
        lines += [f"{p['step']:>6}  {fmt(p[key]) if p.get(key) is not None else 'n/a':>8}  {bar(p.get(key), a, b)}" for p in shown]
        lines.append("```")
    return "\n".join(lines)


def curves_text(points: list[dict], heldout_before: float | None = None, heldout_after: float | None = None,
                width: int = 40) -> list[str]:
    """The curve in a terminal: per figure, its first and latest value and a sparkline of every step."""
    lines = []
    for label, key, fmt in SERIES[:2]:
        known = [p[key] for p in points if p.get(key) is not None]
        if known:
            lines.append(f"{label:<17} {fmt(known[0]):>7} → {fmt(known[-1]):<7} {sparkline([p.get(key) for p in points], width)}")
    heldout = [f"{percent(v)} " + ("before RL" if s == 0 else f"after {s} steps")
               for s, v in heldout_points(points, heldout_before, heldout_after)]
    if heldout:
        lines.append(f"{'held-out':<17} " + ", ".join(heldout if len(heldout) <= 4 else [heldout[0], "…", *heldout[-2:]]))
    return lines
