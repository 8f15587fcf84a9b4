"""The reward rule: a user's function ``rule(prompt, response, answer) -> number``.

``reward.rule`` (and ``reward.format_rule``) names it as ``module:function`` (the module must be importable by the engine
hosts: on their ``PYTHONPATH`` or in their working directory) or as ``path/to/file.py:function``
(a path relative to the working directory; the file's folder is put on ``sys.path`` so that it
can import its neighbours). ``load_rule`` imports it and checks how it can be called before any
engine loads; every value it returns is checked as it is used, so that a rule returning a string
fails naming itself, the prompt and the value instead of deep inside the reward sum.

A rule that does not need the reference answer says so with a default (``answer=None``): then
a prompts file without an ``answer`` column is fine.

Each call has a time-out (``reward.rule_timeout_s``, at most half of ``timeouts.stage_s``: ``timeout_of``):
a call still running then raises ``RuleTimeout``, naming the rule, the prompt and the response, so that
a rule that hangs fails the run as the rule's error instead of being taken for a hung engine host and
retried (``engines/deadline.py``: on the main thread the call is interrupted there; on another it is
abandoned).
"""

from __future__ import annotations

import inspect
import math
import numbers
from dataclasses import dataclass
from typing import Callable

from engines import deadline
from engines.config import dotted
from engines.rl.algorithms import overlong_penalty
from engines.wire.commands import GenRMScoreResult


class RewardRuleError(ValueError):
    """The reward rule cannot be imported or called, raised, or returned something other than a number."""


class RuleTimeout(RewardRuleError):
    """A call of the rule ran past its time-out (``reward.rule_timeout_s``)."""


def timeout_of(config) -> float:
    """The time-out of one rule call: ``reward.rule_timeout_s``, at most half of ``timeouts.stage_s``
    (the watchdog that takes a stage without progress for a hung host must not come first)."""
    return min(config.reward.rule_timeout_s, config.timeouts.stage_s / 2)


@dataclass(frozen=True)
class Rule:
    spec: str  # as configured: reward.rule
    function: Callable
    needs_answer: bool  # the function's third parameter has no default
    field: str = "reward.rule"  # the config field that names it (reward.rule or reward.format_rule)
    timeout_s: float | None = None  # one call's time-out (None: none)

    def __call__(self, prompt: str, response: str, answer: str | None, prompt_id: int) -> float:
        try:
            value = deadline.call(self.timeout_s, self.function, prompt, response, answer)
        except deadline.Expired:
            raise RuleTimeout(
                f"{self.field} {self.spec} ran past reward.rule_timeout_s={self.timeout_s:g}s on prompt_id {prompt_id}, "
                f"response {_shown(response)}, answer {_shown(answer)}: it hangs or is too slow; fix it, or raise "
                "reward.rule_timeout_s (and timeouts.stage_s, twice as much)"
            ) from None
        except Exception as e:  # the user's function: its error, with what it was scoring (the original is the cause)
            raise RewardRuleError(
                f"{self.field} {self.spec} raised {type(e).__name__}: {_one_line(e)} on prompt_id {prompt_id}, "
                f"response {_shown(response)}, answer {_shown(answer)}"
            ) from e
        if isinstance(value, numbers.Real) and math.isfinite(value):
            return float(value)
        raise RewardRuleError(
            f"{self.field} {self.spec} returned {value!r} ({type(value).__name__}) for prompt_id {prompt_id}: "
            "a reward rule must return a finite number (int, float or bool)"
        )


def _one_line(error: BaseException) -> str:
    """An error's message on one line: the CLI shows an error's last line."""
    return " ".join(str(error).split()) or "(no message)"


def _shown(text: str | None, limit: int = 200) -> str:
    """``text`` quoted on one line, cut at ``limit`` characters (a response can be a whole generation)."""
    shown = repr(text)
    return shown if len(shown) <= limit else f"{shown[:limit]}… ({len(text)} characters)"


def load_rule(spec: str, field: str = "reward.rule", timeout_s: float | None = None) -> Rule:
    """Import ``module:function`` or ``file.py:function`` and check that it takes (prompt, response,
    answer); errors name ``field``, the config field that names the rule. ``timeout_s``: each call's
    time-out (``timeout_of(config)``; None: none)."""
    function = dotted.load(spec, field, RewardRuleError)
    name = spec.rpartition(":")[2]
    if not callable(function):
        raise RewardRuleError(f"{field}: {spec} is not a function")
    try:
        signature = inspect.signature(function)
        signature.bind("prompt", "response", "answer")
    except TypeError as e:
        raise RewardRuleError(
            f"{field} {spec}: a rule is called as {name}(prompt, response, answer), but it takes {signature} ({e})"
        ) from e
    except ValueError:  # a builtin without a signature: take it as it is
        return Rule(spec, function, needs_answer=True, field=field, timeout_s=timeout_s)
    try:
        signature.bind("prompt", "response")
        needs_answer = False
    except TypeError:
        needs_answer = True
    return Rule(spec, function, needs_answer, field, timeout_s)


def model_scores(reward_model, prompts, rows: list[dict]) -> list[float | None]:
    """The scalar reward model's score of each scored row (None each without one): it reads the
    prompt as the policy was given it (``prompts``, the group's ``PromptStream``: a chat row's
    ``messages``, not only its last turn), then the response."""
    if reward_model is None or not rows:
        return [None] * len(rows)
    return reward_model.score(prompts.sources([r["prompt_row"] for r in rows]), [r["response"] for r in rows])


def scored(cfg, row: dict, verdict: str | None, rm: float | None, rule: Rule | None, format_rule: Rule | None) -> dict:
    """A rollout row with its rewards (a new dict): each source's (None where the run has none: the
    judge's verdict, the scalar reward model's score, the rule's, the format rule's) and ``reward``,
    their weighted sum plus DAPO's overlong penalty."""
    r, w = row, cfg.reward
    genrm = None if verdict is None else float(verdict.startswith(cfg.judge.good))
    ruled = rule(r["prompt"], r["response"], r["answer"], r["prompt_id"]) if rule else None
    form = format_rule(r["prompt"], r["response"], r["answer"], r["prompt_id"]) if format_rule else None
    env = r.get("env_reward")  # an episode's environment's rewards (engines/agents)
    reward = sum(weight * value for weight, value in ((w.genrm_weight, genrm), (w.rule_weight, ruled), (w.format_weight, form),
                                                      (w.reward_model_weight, rm), (w.env_weight, env)) if value is not None)
    # the cap that cuts the response: rollout.max_new_tokens, or an episode's rollout.episode_tokens (observations included)
    cap = cfg.rollout.episode_tokens if r.get("loss_mask") is not None else cfg.rollout.max_new_tokens
    reward += overlong_penalty(len(r["response_ids"]), cap, w.overlong_buffer, w.overlong_penalty)
    return r | {"judge_text": verdict, "genrm_reward": genrm, "rule_reward": ruled, "format_reward": form, "rm_reward": rm,
                "reward": reward}


def score_result(judge, uri: str, rows: list[dict], seconds: float, switch: float) -> GenRMScoreResult:
    """What a scoring stage answers about its ``rows`` (``judge``: the config's judge section, whose
    verdict words tell a parsed verdict from one that is not)."""
    unparsed = sum(r["judge_text"] is not None and not r["judge_text"].startswith((judge.good, judge.bad)) for r in rows)
    known = [r for r in rows if r["genrm_reward"] is not None and r["rule_reward"] is not None and r["answer"] is not None]
    rules = [r["rule_reward"] for r in rows if r["rule_reward"] is not None]
    return GenRMScoreResult(
        uri=uri, reward_mean=sum(r["reward"] for r in rows) / max(len(rows), 1),
        accuracy=sum(rules) / len(rules) if rules else None,
        judge_agreement=sum(r["genrm_reward"] == r["rule_reward"] for r in known) / len(known) if known else None,
        unparsed_verdicts=unparsed, seconds=seconds, switch_s=switch)
