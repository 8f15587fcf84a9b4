"""Held-out evaluation on an engine host: the pieces of the ``evaluate`` stage
(engines/host/worker.py) around its answers. The sets, their figures and how a rank's sums merge:
engines/evaluation.py; who answers (a response, an episode): engines/host/samples.py.
"""

from __future__ import annotations

from engines import evaluation
from engines.backends import chat
from engines.config import dotted
from engines.evaluation import EvalSet, SetSums
from storage import datasets


def rows_of(uri: str, limit: int, group: int, dp: int, frames=None) -> list[dict]:
    """DP group ``group``'s share of the first ``limit`` prompts of the set at ``uri`` (every ``dp``-th,
    images included; ``frames``: a vision policy's, videos as frames), with the text a rule reads."""
    reader = datasets.PromptReader(uri)
    indices = list(range(group, min(limit, len(reader)), dp))
    rows = [(frames.row(r, uri) if frames else r) | {"prompt_row": i} for r, i in zip(reader.rows(indices), indices)]
    return [r | {"prompt": chat.question(r)} for r in rows]


def rule_scores(rule, rows: list[dict], greedy: list[str], sampled: list[list[str]]) -> list[list[float]]:
    """Each row's scores by ``rule``: its greedy answer's, then each sampled answer's."""
    return [[rule(r["prompt"], answer, r["answer"], r["prompt_id"]) for answer in [g, *k]] for r, g, k in zip(rows, greedy, sampled)]


def verdict_scores(verdicts: list[list[str]], good: str) -> list[list[float]]:
    """The judge's verdicts (``Scorers.judge_answers``) as scores: 1 where it said ``good``."""
    return [[float(v.startswith(good)) for v in per] for per in verdicts]


def sums_of(s: EvalSet, scores: list[list[float]], sampled: list[list[str]], correct_at: float) -> SetSums:
    """A set's sums over this rank's prompts: greedy, mean, pass@k, and the majority answer's score
    (``s.answer``: what makes two answers the same vote; default their normalised text)."""
    vote = dotted.load(s.answer, f"eval.sets.{s.name}.answer") if s.answer else None
    total = SetSums()
    for per, answers in zip(scores, sampled):
        majority = per[1 + evaluation.majority(answers, vote)] if answers else None
        total.add_prompt(per[0], per[1:], correct_at, majority)
    return total
