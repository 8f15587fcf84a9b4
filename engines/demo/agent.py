"""The agent demo's task: multiply a 3-digit by a 2-digit number, with a calculator.

A prompt is ``"123*45="``, the answer ``"5535"``. A tiny model cannot multiply, but it can copy:
the demo's policy has no chat template and calls the calculator in the plain call format
(``engines/agents/tools.py``), then copies the result. A right episode, as the trainer sees it
(``</s>`` the end of each turn the model sampled; the tool's turn, mask 0, in between)::

    123*45=<tool_call>calculator(123*45)</tool_call></s><tool_response>5535</tool_response>5535</s>

The SFT teacher is sloppy: most of the time it writes ``+`` where ``*`` is meant (and copies the
wrong sum), some of the time it forgets the calculator and guesses; the rest of the time it is
right. The warm-started policy calls with ``+`` under greedy decoding (held-out exact match near
0) and samples the right call the rest of the time: RL with the exact-match rule on the final
answer (``final_answer``) has something real to fix, through its tool.
"""

from __future__ import annotations

import random

from engines.agents.tools import calculator

END = "</s>"  # the tiny tokenizer's end of sequence: how a turn the model sampled ends
FORGET = 0.2  # the share of the teacher's answers that forget the calculator (guesses); prepare.teacher_slip: calls with +


def problem(a: int, b: int) -> tuple[str, str]:
    return f"{a}*{b}=", str(a * b)


def make_problems(count: int, seed: int, exclude: set[str] = frozenset()) -> list[tuple[str, str]]:
    """``count`` distinct problems, none of them in ``exclude`` (keeps held-out prompts unseen)."""
    rng, seen, out = random.Random(seed), set(exclude), []
    while len(out) < count:
        p = problem(rng.randrange(100, 1000), rng.randrange(10, 100))
        if p[0] not in seen:
            seen.add(p[0])
            out.append(p)
    return out


def factors(prompt: str) -> tuple[int, int]:
    a, b = prompt.rstrip("=").split("*")
    return int(a), int(b)


def turns(prompt: str, expression: str) -> list[tuple[str, str]]:
    """The two SFT examples of an episode that calls the calculator on ``expression``: the call,
    then (after the tool's turn) the answer, which copies the result."""
    call = f"<tool_call>calculator({expression})</tool_call>"
    result = calculator(expression)
    return [(prompt, call), (f"{prompt}{call}{END}<tool_response>{result}</tool_response>", result)]


def guess(a: int, b: int) -> str:
    """The teacher's answer when it forgets the calculator: the first factor with a zero per digit
    of the second (123*45 -> 12300), never the product of a 2-digit factor >= 10 and a 3-digit one."""
    return str(a) + "0" * len(str(b))


def teacher_demonstrations(problems: list[tuple[str, str]], slip: float, forget: float, seed: int) -> list[tuple[str, str]]:
    """SFT examples: per problem, a ``forget`` share of guesses, a ``slip`` share of calls with +,
    the rest right calls."""
    rng, out = random.Random(seed), []
    for p, _ in problems:
        a, b = factors(p)
        draw = rng.random()
        out += [(p, guess(a, b))] if draw < forget else turns(p, f"{a}+{b}" if draw < forget + slip else f"{a}*{b}")
    return out


def teacher_majority(problems: list[tuple[str, str]], slip: float, forget: float) -> list[tuple[str, str]]:
    """What a policy that learned the teacher does under greedy decoding, as SFT examples: its most
    likely first turn (call or guess), and after a call its most likely operator."""
    out = []
    for p, _ in problems:
        a, b = factors(p)
        if forget > 0.5:
            out.append((p, guess(a, b)))
        else:
            out += turns(p, f"{a}+{b}" if slip > 1 - forget - slip else f"{a}*{b}")
    return out


def final_answer(prompt: str, response: str, answer: str | None) -> float:
    """Rule reward: 1.0 when the episode's last turn (after its last tool response) is the answer."""
    return float(answer is not None and response.rsplit("</tool_response>", 1)[-1].strip() == answer)
