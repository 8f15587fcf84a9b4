"""The real-model demo's task: two-digit sums asked in plain English, answered by a pretrained chat model.

A prompt is one user turn, ``"What is 18+46? Reply with only the number."`` (A and B in 10..49), which
the model's own chat template renders (SmolLM2-135M-Instruct's adds its default system turn). The
reward rule reads the last number of the response: SmolLM2-135M-Instruct knows most of these sums
when it writes ``18 + 46 = 64`` and stops, but under greedy decoding it often runs on after the
answer (``... = 52\\n\\nThis is a classic example of how math can be used to``) or writes a
wrong sum, and sampled at a temperature it wanders further (``18 + 46 is 63. 63 is calculated by
adding 18 to 4``). RL on this rule teaches it to answer and stop: a habit, not new arithmetic.

The rule is deliberately not "the response is exactly the number": that reward is never earned by
this model (0 of 320 samples at temperature 0.7), and RL cannot learn from a reward it never sees.
"""

from __future__ import annotations

import random
import re

LOW, HIGH = 10, 49  # each operand; 1,600 problems in all
_NUMBER = re.compile(r"-?\d+")


def question(a: int, b: int) -> str:
    return f"What is {a}+{b}? Reply with only the number."


def make_problems(count: int, seed: int, exclude: set[str] = frozenset()) -> list[tuple[list[dict], str]]:
    """``count`` distinct problems as (chat messages, answer), none of whose question is in ``exclude``."""
    space = (HIGH - LOW + 1) ** 2
    if count + len(exclude) > space:
        raise ValueError(f"only {space} distinct sums of {LOW}..{HIGH} exist; asked for {count} + {len(exclude)} excluded")
    rng, seen, out = random.Random(seed), set(exclude), []
    while len(out) < count:
        a, b = rng.randint(LOW, HIGH), rng.randint(LOW, HIGH)
        q = question(a, b)
        if q not in seen:
            seen.add(q)
            out.append(([{"role": "user", "content": q}], str(a + b)))
    return out


def last_number(prompt: str, response: str, answer: str) -> float:
    """1 when the last integer in ``response`` is ``answer`` (``"18 + 46 = 64"``, ``"64."``), else 0."""
    numbers = _NUMBER.findall(response)
    return float(bool(numbers) and numbers[-1] == answer.strip())


def only_the_number(prompt: str, response: str, answer: str) -> float:
    """1 when the response is the answer and nothing else (a trailing full stop allowed): what the
    prompt asks for, which this model never does on its own (a second evaluation set's rule)."""
    return float(response.strip().rstrip(".").strip() == answer.strip())


def final_number(response: str) -> str | None:
    """The answer maj@k votes on: the last integer of the response (None: it has none)."""
    numbers = _NUMBER.findall(response)
    return numbers[-1] if numbers else None
