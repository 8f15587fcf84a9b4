"""Built-in reward rules for math answers, named like any rule (``reward.rule``, ``reward.format_rule``).

* ``math_answer`` (``reward.rule=engines.rl.math_rules:math_answer``): 1.0 when the response's
  final answer equals the reference answer mathematically, else 0.0. Both are parsed by
  `math-verify <https://github.com/huggingface/Math-Verify>`_ (Hugging Face's verifier, the one
  open-r1 and TRL use): LaTeX (``\\frac{1}{2}``, ``\\sqrt{2}``, intervals, sets), ``\\boxed{}``
  answers (preferred when present), plain numbers and expressions; ``0.5``, ``1/2`` and
  ``\\frac{2}{4}`` are the same answer. The response's answer is, in order: the content of its last
  ``<answer>...</answer>`` tags, else its ``\\boxed{}`` answer, else the last mathematical
  expression it ends on. A reference answer without ``$`` or ``\\boxed`` is read as if boxed, so
  ``\\sqrt{2}`` or ``(1,2)`` in an ``answer`` column parse as LaTeX.
* ``boxed_format``: 1.0 when the response puts a non-empty answer in ``\\boxed{...}``, else 0.0.
* ``answer_tags``: 1.0 when the response ends with a non-empty ``<answer>...</answer>`` (an optional
  ``<think>...</think>`` before it), else 0.0.

Timeouts: math-verify bounds parsing and comparison (a pathological expression can make sympy run
for minutes) with ``signal.alarm``, which works only in a process's main thread; an engine host
scores on its main thread (a rule is then cut off after ``TIMEOUT_S`` and scores 0), but the
partial-placement judge thread and user code in threads would fail with "signal only works in main
thread". There the rules run without the time limit.
"""

from __future__ import annotations

import re
import threading

TIMEOUT_S = 5  # seconds for each of parsing and comparing (math-verify's own default)

_TAGS = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_TAGGED = re.compile(r"^\s*(?:<think>.*?</think>\s*)?<answer>\s*\S.*?</answer>\s*$", re.DOTALL)


def _timeout() -> int | None:
    """math-verify's timeout where its signal-based alarm works (the main thread), else None (no limit)."""
    return TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _as_latex(text: str) -> str:
    """A bare answer (no ``$`` or ``\\boxed``) boxed, so that math-verify reads it as LaTeX."""
    return text if ("$" in text or "\\boxed" in text or "\\(" in text or "\\[" in text) else f"\\boxed{{{text.strip()}}}"


def parse_answer(text: str):
    """math-verify's parse of an answer: ``[sympy value, the string it came from]``, or ``[]``."""
    from math_verify import parse

    return parse(text, parsing_timeout=_timeout())


def math_answer(prompt: str, response: str, answer: str) -> float:
    """1.0 when ``response``'s final answer equals the reference ``answer`` (math-verify), else 0.0."""
    from math_verify import verify

    gold = parse_answer(_as_latex(answer))
    if not gold:  # a reference answer math-verify cannot read: nothing can match it
        return 0.0
    tagged = _TAGS.findall(response)
    predicted = parse_answer(_as_latex(tagged[-1])) if tagged and tagged[-1].strip() else parse_answer(response)
    if not predicted:
        return 0.0
    return float(verify(gold, predicted, timeout_seconds=_timeout()))


def _boxed_contents(text: str) -> list[str]:
    """The contents of every ``\\boxed{...}`` in ``text`` (nested braces matched)."""
    contents, start = [], 0
    while (at := text.find("\\boxed{", start)) >= 0:
        depth, i = 1, at + len("\\boxed{")
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            contents.append(text[at + len("\\boxed{") : i - 1])
        start = at + 1
    return contents


def boxed_format(prompt: str, response: str, answer: str | None = None) -> float:
    """1.0 when the response puts a non-empty answer in ``\\boxed{...}``, else 0.0."""
    return float(any(c.strip() for c in _boxed_contents(response)))


def answer_tags(prompt: str, response: str, answer: str | None = None) -> float:
    """1.0 when the response is ``[<think>...</think>] <answer>...</answer>`` with a non-empty answer, else 0.0."""
    return float(_TAGGED.match(response) is not None)
