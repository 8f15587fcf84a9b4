"""The built-in math rules (``engines/rl/math_rules.py``): math-verify's equivalence of LaTeX,
boxed and plain answers; the format rewards; named and checked like any rule; the time limit off
where math-verify's signal-based alarm cannot work (a thread that is not the main one)."""

from __future__ import annotations

import threading

import pytest
from tests.helpers import ROOT  # noqa: F401  (puts the checkout on sys.path)

from engines.config import ConfigError, load_config
from engines.host import rewards
from engines.rl import math_rules
from engines.rl.math_rules import answer_tags, boxed_format, math_answer


@pytest.mark.parametrize("answer, response, score", [
    ("\\frac{1}{2}", "The answer is \\boxed{0.5}.", 1.0),  # LaTeX reference, decimal answer
    ("0.5", "so it is \\frac{2}{4}", 1.0),  # plain reference, an equivalent fraction at the end
    ("1/2", "\\boxed{\\dfrac{1}{2}}", 1.0),
    ("$\\frac{1}{2}$", "Half: \\boxed{\\frac12}", 1.0),
    ("\\sqrt{2}", "\\boxed{\\sqrt 2}", 1.0),  # a bare LaTeX reference is read as if boxed
    ("x=3", "Solving, \\boxed{3}", 1.0),
    ("(1,2)", "\\boxed{(1,2)}", 1.0),
    ("0.5", "<think>half of one</think><answer>1/2</answer>", 1.0),  # the tags' content is the answer
    ("7", "\\boxed{8}", 0.0),  # wrong
    ("7", "I think 7 or so, no: \\boxed{8}", 0.0),  # the boxed answer wins over earlier numbers
    ("7", "no idea", 0.0),  # no answer at all
    ("\\frac{1}{3}", "\\boxed{0.33}", 0.0),  # close is not equal
])
def test_math_answer(answer, response, score):
    assert math_answer("a math problem", response, answer) == score


def test_format_rewards():
    assert boxed_format("", "so \\boxed{\\frac{1}{2}}.") == 1.0
    assert boxed_format("", "\\boxed{}") == 0.0 and boxed_format("", "1/2") == 0.0 and boxed_format("", "\\boxed{1") == 0.0
    assert answer_tags("", "<think>a</think>\n<answer>1/2</answer>") == 1.0 and answer_tags("", "<answer>7</answer>") == 1.0
    assert answer_tags("", "<answer> </answer>") == 0.0 and answer_tags("", "<answer>7</answer> and more") == 0.0


def test_named_like_any_rule_and_safe_off_the_main_thread():
    rule = rewards.load_rule("engines.rl.math_rules:math_answer")
    assert rule.needs_answer and rule("p", "\\boxed{0.5}", "\\frac12", 1) == 1.0
    form = rewards.load_rule("engines.rl.math_rules:boxed_format", "reward.format_rule")
    assert not form.needs_answer and form.field == "reward.format_rule"
    with pytest.raises(rewards.RewardRuleError, match="reward.format_rule: engines.rl.math_rules has no function 'nope'"):
        rewards.load_rule("engines.rl.math_rules:nope", "reward.format_rule")

    # math-verify's alarm works in the main thread only: elsewhere the rule runs without it and still scores
    assert math_rules._timeout() == math_rules.TIMEOUT_S
    scores: list = []
    thread = threading.Thread(target=lambda: scores.extend([math_answer("", "\\boxed{0.5}", "1/2"), math_rules._timeout()]))
    thread.start()
    thread.join()
    assert scores == [1.0, None]


def test_format_rule_config():
    config = load_config(None, ["reward.rule=engines.rl.math_rules:math_answer", "reward.rule_weight=1", "reward.genrm_weight=0",
                                "reward.format_rule=engines.rl.math_rules:boxed_format", "reward.format_weight=0.1"])
    assert config.reward.format_weight == 0.1
    with pytest.raises(ConfigError, match="format_weight=0.5 but no format_rule"):
        load_config(None, ["reward.format_weight=0.5"])
