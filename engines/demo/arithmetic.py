"""The demo task: addition with a verifiable answer.

A prompt is ``"47+85="``; the answer is written least-significant digit first, padded to
a fixed width (``"231"`` for 132) — the order in which carries flow, which a tiny model
learns in seconds. The exact answer makes the rule reward trivial and held-out accuracy
honest.

The SFT demonstrations come from a sloppy teacher who forgets to carry some of the time
(``teacher_slip``): the warm-started policy copies that mistake, and RL with a reward
that checks the answer has something real to fix.
"""

from __future__ import annotations

import random

VERDICT_GOOD = "correct"
VERDICT_BAD = "wrong"


def problem(a: int, b: int, digits: int) -> tuple[str, str]:
    return f"{a:0{digits}d}+{b:0{digits}d}=", str(a + b).zfill(digits + 1)[::-1]


def forgot_to_carry(prompt: str) -> str:
    """The teacher's slip: every digit summed modulo 10, carries dropped."""
    a, b = prompt.rstrip("=").split("+")
    return ("0" + "".join(str((int(x) + int(y)) % 10) for x, y in zip(a, b)))[::-1]


def make_problems(count: int, digits: int, seed: int, exclude: set[str] = frozenset()) -> list[tuple[str, str]]:
    """``count`` distinct problems, none of them in ``exclude`` (keeps held-out prompts unseen)."""
    space = 10 ** (2 * digits)
    if count + len(exclude) > space:
        raise ValueError(f"only {space} distinct {digits}-digit problems exist; asked for {count} + {len(exclude)} excluded")
    rng = random.Random(seed)
    seen, out = set(exclude), []
    while len(out) < count:
        p = problem(rng.randrange(10**digits), rng.randrange(10**digits), digits)
        if p[0] not in seen:
            seen.add(p[0])
            out.append(p)
    return out


def teacher_demonstrations(problems: list[tuple[str, str]], slip: float, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    return [(p, forgot_to_carry(p) if rng.random() < slip else a) for p, a in problems]


def teacher_majority(problems: list[tuple[str, str]], slip: float) -> list[tuple[str, str]]:
    """(prompt, the teacher's most likely answer): what a policy that has learned the teacher
    answers under greedy decoding. The slip where the teacher slips more often than not."""
    return [(p, forgot_to_carry(p) if slip > 0.5 else a) for p, a in problems]


def near_miss(rng: random.Random, answer: str) -> str:
    """A plausible wrong answer of the same width: one digit changed."""
    digits = list(answer)
    i = rng.randrange(len(digits))
    digits[i] = str((int(digits[i]) + rng.randrange(1, 10)) % 10)
    return "".join(digits)


def close_miss(rng: random.Random, answer: str) -> str:
    """The hardest wrong answer of the same width: one digit off by one (what a misplaced or extra
    carry gives, and what RL against a reward model that cannot tell them apart learns to write)."""
    digits = list(answer)
    i = rng.randrange(len(digits))
    digits[i] = str((int(digits[i]) + rng.choice((1, 9))) % 10)
    return "".join(digits)


def judge_examples(problems: list[tuple[str, str]], template: str, seed: int) -> list[tuple[str, str]]:
    """(judge prompt, verdict) pairs: half correct candidates, half slips or near misses."""
    rng = random.Random(seed)
    out = []
    for p, a in problems:
        if rng.random() < 0.5:
            candidate = a
        else:
            slip = forgot_to_carry(p)
            candidate = slip if slip != a and rng.random() < 0.5 else near_miss(rng, a)
        verdict = VERDICT_GOOD if candidate == a else VERDICT_BAD
        out.append((template.format(prompt=p, response=candidate, answer=a), verdict))
    return out


def preference_pairs(problems: list[tuple[str, str]], seed: int, slip_share: float = 1.0) -> list[tuple[str, str, str, str]]:
    """(prompt, answer, chosen, rejected) per problem: chosen is the right answer; rejected is the
    carry mistake the SFT'd policy learned from the teacher (its greedy answer wherever a carry is
    needed), a ``slip_share`` of the time where there is one, else a near miss (one digit changed).
    Offline DPO's pairs take every slip (1.0); the scalar reward model's demo has its own, harder
    ones (``hard_preference_pairs``)."""
    rng = random.Random(seed)
    out = []
    for p, a in problems:
        slip = forgot_to_carry(p)
        use_slip = slip != a and (slip_share >= 1.0 or rng.random() < slip_share)
        out.append((p, a, a, slip if use_slip else near_miss(rng, a)))
    return out


def hard_preference_pairs(problems: list[tuple[str, str]], seed: int) -> list[tuple[str, str, str, str]]:
    """The scalar reward model's demo pairs, hard negatives included: per problem, chosen the right
    answer against (1) the carry slip where there is one, else a near miss, and (2) a close miss
    (one digit off by one), so that the model learns that an answer is right digit for digit, not
    that it looks like a sum."""
    rng = random.Random(seed)
    out = []
    for p, a in problems:
        slip = forgot_to_carry(p)
        out.append((p, a, a, slip if slip != a else near_miss(rng, a)))
        out.append((p, a, a, close_miss(rng, a)))
    return out


def exact_match(prompt: str, response: str, answer: str | None) -> float:
    """Rule reward: 1.0 when the response is the exact answer, else 0.0."""
    return float(answer is not None and response.strip() == answer)


