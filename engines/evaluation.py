"""Evaluation the field's way: named held-out sets, each scored by its own rule, greedily and with k
samples per prompt at an evaluation temperature, all through the run's rollout engine.

Per set the figures are (k = ``eval.samples``; veRL's mean@N / best@N / maj@N, NeMo-RL's pass@k):

* ``greedy``: the mean rule score of the greedy answers (the figure yattflow always had);
* ``mean@k``: the mean score of the k samples (avg@k);
* ``pass@j`` for j = 1, 2, 4, ... up to k: the chance that at least one of j samples drawn from the k is
  correct, by the unbiased estimator ``1 - C(k - c, j) / C(k, j)`` with c of the k correct (Chen et al.,
  2021), averaged over prompts; a sample is correct when its score is at least ``eval.correct_at``;
* ``maj@k``: the score of the majority answer: the k samples grouped by their answer (the set's
  ``answer`` function of the response, else the response's text with its spaces collapsed), the most
  frequent group's first sample scored (ties: the group seen first).

A set's rule is ``module:function`` or ``file.py:function`` like ``reward.rule``; without one, the run's
rule, else the judge's verdict (1 for ``judge.good``). Each DP group scores its share of a set's
prompts and answers sums (``SetSums``); the flow adds them and divides (``SetSums.figures``).
"""

from __future__ import annotations

import collections
import math
from typing import Callable

from pydantic import BaseModel, ConfigDict

HELDOUT = "heldout"  # the set data.heldout names (with reward.rule and data.heldout_limit)


class EvalSet(BaseModel):
    """One evaluation set as a host evaluates it: plain data on the wire."""

    model_config = ConfigDict(extra="forbid")

    name: str
    field: str  # the config field that names its data (data.heldout, eval.sets.<name>.data): errors name it
    uri: str
    limit: int
    rule: str | None  # None: the judge's verdict
    rule_field: str  # the config field that names the rule (reward.rule, eval.sets.<name>.rule)
    answer: str | None = None  # module:function(response) -> the answer maj@k votes on; None: the response text


def sets_of(config) -> list[EvalSet]:
    """The run's evaluation sets, in order: ``data.heldout`` first (as ``heldout``, with ``reward.rule`` and
    ``data.heldout_limit``) when it is set, then ``eval.sets`` as configured. The first is the run's
    headline figure (its greedy score: ``heldout`` in the metrics, the summary line, the guard)."""
    out = []
    if config.data.heldout is not None:
        out.append(EvalSet(name=HELDOUT, field="data.heldout", uri=config.uri(config.data.heldout), limit=config.data.heldout_limit,
                           rule=config.reward.rule or None, rule_field="reward.rule"))
    for name, s in config.eval.sets.items():
        rule, field = (s.rule, f"eval.sets.{name}.rule") if s.rule else (config.reward.rule or None, "reward.rule")
        out.append(EvalSet(name=name, field=f"eval.sets.{name}.data", uri=config.uri(s.data),
                           limit=s.limit or config.data.heldout_limit, rule=rule, rule_field=field, answer=s.answer))
    return out


def set_metric(config, s: EvalSet) -> str:
    """What a set's scores are, in words: ``mean engines.demo.sums:last_number reward`` or ``judge 'correct' rate``."""
    return f"mean {s.rule} reward" if s.rule else f"judge '{config.judge.good}' rate"


def pass_ks(samples: int) -> list[int]:
    """The j of the pass@j figures reported for k samples: 1, 2, 4, ... and k itself."""
    ks, j = [], 1
    while j < samples:
        ks.append(j)
        j *= 2
    return [*ks, samples] if samples else []


def pass_at(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from n samples of which c are correct (k <= n)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def normal_text(response: str) -> str:
    """The default answer of a response for majority voting: its text, stripped, spaces collapsed."""
    return " ".join(response.split())


def majority(responses: list[str], answer: Callable[[str], object] | None = None) -> int:
    """The index of the sample whose answer is the most frequent among ``responses`` (its first sample;
    ties: the answer seen first)."""
    keys = [(answer or normal_text)(r) for r in responses]
    counts = collections.Counter(keys)
    best = max(counts.values())
    return next(i for i, key in enumerate(keys) if counts[key] == best)


class SetSums(BaseModel):
    """One set's sums over some prompts (a DP group's share, or all of them): what the flow adds up."""

    model_config = ConfigDict(extra="forbid")

    prompts: int = 0
    greedy: float = 0.0
    samples: int = 0  # k: samples per prompt (0: greedy only)
    mean: float = 0.0  # sum over prompts of the mean sample score
    passes: dict[int, float] = {}  # j -> sum over prompts of the pass@j estimate
    majority: float = 0.0  # sum over prompts of the majority answer's score

    def add_prompt(self, greedy: float, scores: list[float], correct_at: float, majority_score: float | None) -> None:
        self.prompts += 1
        self.greedy += greedy
        if scores:
            self.samples = len(scores)
            self.mean += sum(scores) / len(scores)
            c = sum(s >= correct_at for s in scores)
            for j in pass_ks(len(scores)):
                self.passes[j] = self.passes.get(j, 0.0) + pass_at(len(scores), c, j)
            self.majority += majority_score or 0.0

    def __add__(self, other: "SetSums") -> "SetSums":
        passes = {j: self.passes.get(j, 0.0) + other.passes.get(j, 0.0) for j in {*self.passes, *other.passes}}
        return SetSums(prompts=self.prompts + other.prompts, greedy=self.greedy + other.greedy,
                       samples=max(self.samples, other.samples), mean=self.mean + other.mean, passes=passes,
                       majority=self.majority + other.majority)

    def figures(self) -> dict[str, float]:
        """``{"greedy": .., "mean@4": .., "pass@1": .., "pass@2": .., "pass@4": .., "maj@4": .., "prompts": n}``."""
        if not self.prompts:
            return {}
        n, k = self.prompts, self.samples
        out = {"greedy": self.greedy / n}
        if k:
            out[f"mean@{k}"] = self.mean / n
            out |= {f"pass@{j}": self.passes[j] / n for j in sorted(self.passes)}
            out[f"maj@{k}"] = self.majority / n
        return out | {"prompts": n}


def merged(parts: list[dict[str, SetSums]]) -> dict[str, dict[str, float]]:
    """Every set's figures from the DP groups' sums (``{set: {figure: value}}``, in the sets' order)."""
    names = [name for part in parts for name in part]
    total: dict[str, SetSums] = {}
    for name in dict.fromkeys(names):
        total[name] = sum((part[name] for part in parts if name in part), SetSums())
    return {name: sums.figures() for name, sums in total.items() if sums.prompts}


def figure_order(name: str) -> tuple:
    """greedy, mean@k, pass@1, pass@2, ..., maj@k, prompts: the order figures are shown in (JSON keeps them sorted)."""
    kind, _, k = name.partition("@")
    return ({"greedy": 0, "mean": 1, "pass": 2, "maj": 3}.get(kind, 4), int(k) if k.isdigit() else 0, name)


def ordered(figures: dict[str, float]) -> dict[str, float]:
    return dict(sorted(figures.items(), key=lambda kv: figure_order(kv[0])))


def figures_line(figures: dict[str, float]) -> str:
    """``greedy 32.5%, mean@4 21.9%, pass@1 21.9%, pass@2 35.0%, pass@4 47.5%, maj@4 30.0% (40 prompts)``."""
    shown = [f"{name} {100 * value:.1f}%" for name, value in ordered(figures).items() if name != "prompts"]
    return ", ".join(shown) + (f" ({figures['prompts']} prompts)" if "prompts" in figures else "")


def headline(evaluation: dict[str, dict[str, float]] | None) -> float | None:
    """The run's one held-out figure: the first set's greedy score."""
    if not evaluation:
        return None
    first = next(iter(evaluation.values()))
    return first.get("greedy")
