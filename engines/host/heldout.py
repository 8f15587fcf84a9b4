"""Held-out evaluation on an engine host: the pieces of the ``evaluate`` stage
(engines/host/worker.py) around its answers. The sets, their figures and how a rank's sums merge:
engines/evaluation.py; who answers (a response, an episode): engines/host/samples.py.
"""

from __future__ import annotations

from typing import Callable

from engines import evaluation
from engines.backends import chat
from engines.config import dotted
from engines.evaluation import EvalSet, SetSums
from engines.wire.commands import Evaluate, EvaluateResult
from storage import datasets


def evaluate(request: Evaluate, group: int, dp: int, kind, scorers, take: Callable[..., float], weights,
             seed: Callable[[str], int], good: str) -> EvaluateResult:
    """Each evaluation set: DP group ``group``'s share of its first ``limit`` prompts answered greedily
    (an episode's kind: greedy episodes, the rule reading the whole episode) and, with
    ``request.samples``, k times at ``request.temperature`` (``kind``: the host's sample kind,
    ``seed(uri)``: a set's seed), scored by the set's rule, or by the judge's verdict (``good``: its
    good verdict) when it has none. Sets on the same prompts share their answers. ``take``: the host's
    placement; ``weights``: the rollout engine's lock (an overlapping host's rollout lane waits)."""
    by_data: dict[tuple[str, int], list] = {}
    for s in request.sets:
        by_data.setdefault((s.uri, s.limit), []).append(s)
    sums: dict[str, SetSums] = {}
    for (uri, limit), sets in by_data.items():
        rows = rows_of(uri, limit, group, dp, scorers.prompts.frames)  # this rank's share
        if not rows:
            sums |= {s.name: SetSums() for s in sets}
            continue
        take("policy")
        with weights:  # overlapping: the rollout lane's engines wait (the judge too: one generate at a time)
            greedy, sampled = kind.answers(rows, request.samples, request.temperature, seed(uri))
            if any(s.rule is None for s in sets):
                take("judge")
                verdicts = scorers.judge_answers(rows, greedy, sampled)
        for s in sets:
            scores = (verdict_scores(verdicts, good) if s.rule is None else
                      rule_scores(scorers.rule_for(s.rule, s.rule_field), rows, greedy, sampled))
            sums[s.name] = sums_of(s, scores, sampled, request.correct_at)
    first = sums.get(request.sets[0].name) if request.sets else None
    return EvaluateResult(score_sum=first.greedy if first else 0.0, total=first.prompts if first else 0, sets=sums)


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
