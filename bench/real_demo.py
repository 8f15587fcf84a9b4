"""The real-model demo's table and curve, from its runs' own records (``make real-demo`` on several seeds).

    yattflow train -c deployments/real-demo.yaml name=real-s1 seed=1      # one run per seed
    python -m bench.real_demo yattflow-data/real real-s0 real-s1 real-s2 --svg docs/real-demo.svg

Reads each run's ``curves.json`` (reward and rollout accuracy per step), ``evaluation.json`` (every set
before and after: engines/evaluation.py) and ``config.json``; prints a Markdown table (seed, engine, held-out
greedy before → after, maj@k and pass@k after) and draws every seed's rollout accuracy per step and held-out
greedy score before and after into one SVG. The minutes and the machine's load are not in the runs' records:
the table leaves them to whoever ran them (docs/your-own-task.md#a-real-model has the measured ones).
"""

from __future__ import annotations

import argparse
import json
from html import escape
from pathlib import Path

COLOURS = ("#2563eb", "#ea580c", "#16a34a", "#9333ea", "#0891b2")


def read_run(root: Path, name: str) -> dict:
    run = root / "runs" / name
    curves = json.loads((run / "curves.json").read_text())
    evaluation = json.loads((run / "evaluation.json").read_text())
    config = json.loads((run / "config.json").read_text())
    return {"name": name, "seed": config["seed"], "engine": config["rollout"]["backend"], "points": curves["points"],
            "steps": curves["steps"], "evaluation": evaluation}


def table(runs: list[dict]) -> str:
    k = runs[0]["evaluation"].get("samples") or 0
    head = "| run | seed | engine | held-out greedy before → after | lift |" + (f" maj@{k} after | pass@{k} after |" if k else "")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in runs:
        before, after = r["evaluation"]["before"]["heldout"], r["evaluation"]["after"]["heldout"]
        row = (f"| {r['name']} | {r['seed']} | {r['engine']} | {100 * before['greedy']:.1f}% → {100 * after['greedy']:.1f}% | "
               f"{100 * (after['greedy'] - before['greedy']):+.1f} |")
        if k:
            row += f" {100 * after[f'maj@{k}']:.1f}% | {100 * after[f'pass@{k}']:.1f}% |"
        lines.append(row)
    return "\n".join(lines)


def svg(runs: list[dict], title: str, width: int = 640, height: int = 300) -> str:
    """Rollout accuracy per step (lines) and the held-out greedy score before and after (dots, dashed), per seed."""
    left, right, top, bottom = 48, 16, 34, 70
    steps = max(r["steps"] for r in runs)
    x = lambda s: left + (width - left - right) * s / steps  # noqa: E731
    y = lambda v: top + (height - top - bottom) * (1 - v)  # noqa: E731
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
           'font-family="sans-serif" font-size="12">', f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{left}" y="20" font-size="14" fill="#111">{escape(title)}</text>']
    for v in (0, 0.25, 0.5, 0.75, 1):
        out += [f'<line x1="{left}" y1="{y(v):.1f}" x2="{width - right}" y2="{y(v):.1f}" stroke="#e5e7eb"/>',
                f'<text x="{left - 6}" y="{y(v) + 4:.1f}" text-anchor="end" fill="#555">{int(100 * v)}%</text>']
    for s in range(steps + 1):
        out.append(f'<text x="{x(s):.1f}" y="{height - bottom + 16}" text-anchor="middle" fill="#555">{s}</text>')
    out.append(f'<text x="{width - right}" y="{height - bottom + 30}" text-anchor="end" fill="#555">RL steps</text>')
    for i, r in enumerate(runs):
        colour = COLOURS[i % len(COLOURS)]
        line = " ".join(f"{x(p['step'] + 1):.1f},{y(p['accuracy']):.1f}" for p in r["points"])
        out.append(f'<polyline points="{line}" fill="none" stroke="{colour}" stroke-width="2"/>')
        before, after = r["evaluation"]["before"]["heldout"]["greedy"], r["evaluation"]["after"]["heldout"]["greedy"]
        out += [f'<line x1="{x(0):.1f}" y1="{y(before):.1f}" x2="{x(steps):.1f}" y2="{y(after):.1f}" stroke="{colour}" '
                'stroke-dasharray="4 3"/>',
                f'<circle cx="{x(0):.1f}" cy="{y(before):.1f}" r="4" fill="{colour}"/>',
                f'<circle cx="{x(steps):.1f}" cy="{y(after):.1f}" r="4" fill="{colour}"/>',
                f'<rect x="{left + 150 * i}" y="{height - 22}" width="12" height="12" fill="{colour}"/>',
                f'<text x="{left + 16 + 150 * i}" y="{height - 12}" fill="#111">seed {r["seed"]} ({r["engine"]})</text>']
    out.append(f'<text x="{left}" y="{height - bottom + 30}" fill="#555">lines: rollout accuracy per step; '
               'dots: held-out greedy score, before and after</text>')
    return "\n".join(out + ["</svg>"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", help="the demo's storage root (./yattflow-data/real)")
    parser.add_argument("runs", nargs="+", help="run names")
    parser.add_argument("--svg", help="write the curve here")
    parser.add_argument("--title", default="SmolLM2-135M-Instruct, GRPO on 'What is A+B? Reply with only the number.'")
    args = parser.parse_args()
    runs = [read_run(Path(args.root), name) for name in args.runs]
    print(table(runs))
    if args.svg:
        Path(args.svg).write_text(svg(runs, args.title))
        print(f"\nwrote {args.svg}")


if __name__ == "__main__":
    main()
