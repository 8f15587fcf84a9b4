"""An environment: one instance per episode, loaded by dotted path (``rollout.env``).

A user writes a class with two methods (docs/agents.md has a whole one)::

    class Retry:
        def reset(self, row):            # the prompts row: every column (prompt, answer, ...)
            self.answer = row["answer"]
            return row["prompt"]         # the first prompt: text, or chat messages
        def step(self, text):            # the model's turn, as text
            if text.strip() == self.answer:
                return Step(None, reward=1.0, done=True)
            return Step("Wrong, try again.", reward=0.0)

``step`` answers a :class:`Step` or a tuple ``(observation, reward, done)``: the observation is
text (the next user turn) or messages (e.g. ``[{"role": "tool", ...}]``), None when done; the
reward is optional (None) and per turn (the episode's sum goes to ``reward.env_weight``).
An environment that raises or answers something else fails the rollout with an error naming it,
the prompt and the turn (not retried: the same seed would raise again). Each turn the episodes'
``step`` calls run at once, on threads: one instance is only ever called by one thread at a
time, but state shared between instances (a module's globals) needs its own lock.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any, Protocol, Union

from engines.config import dotted

Observation = Union[str, list, None]  # text (a user turn), messages, or None (the episode is over)


class EnvError(ValueError):
    """An environment that cannot be loaded, raised, or answered something it should not."""




@dataclass
class Step:
    observation: Observation = None
    reward: float | None = None
    done: bool = False


class Environment(Protocol):
    def reset(self, row: dict) -> Observation: ...

    def step(self, text: str) -> Step | tuple: ...


def load(spec: str, field: str = "rollout.env") -> type:
    """The environment class ``spec`` names, checked: instantiable without arguments, with
    ``reset(row)`` and ``step(text)``."""
    cls = dotted.load(spec, field, EnvError, kind="Class")
    if not inspect.isclass(cls):
        raise EnvError(f"{field}: {spec} is not a class (an environment is a class with reset(row) and step(text))")
    for method, args in (("reset", ("row",)), ("step", ("text",))):
        fn = getattr(cls, method, None)
        if not callable(fn):
            raise EnvError(f"{field}: {spec} has no method {method}({args[0]})")
        try:
            inspect.signature(fn).bind(None, *args)
        except TypeError as e:
            raise EnvError(f"{field}: {spec}.{method} is called as {method}({args[0]}), but it takes "
                           f"{inspect.signature(fn)} ({e})") from None
    try:
        inspect.signature(cls).bind()
    except TypeError as e:
        raise EnvError(f"{field}: {spec} is built with no arguments, one instance per episode, but its __init__ "
                       f"takes {inspect.signature(cls)} ({e})") from None
    return cls


def messages_of(observation: Observation, where: str) -> list[dict]:
    """An observation as chat messages (text: one user turn), checked."""
    if isinstance(observation, str):
        return [{"role": "user", "content": observation}]
    if isinstance(observation, list) and observation and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in observation):
        return [{"role": m["role"], "content": m["content"]} for m in observation]
    raise EnvError(f"{where}: an observation is text or a non-empty list of {{'role': str, 'content': str}} messages, "
                   f"not {_shown(observation)}")


def checked_step(answer: Any, where: str) -> Step:
    """What ``step`` answered, as a :class:`Step` (a tuple ``(observation, reward, done)`` too), checked."""
    if isinstance(answer, tuple) and len(answer) == 3:
        answer = Step(*answer)
    if not isinstance(answer, Step):
        raise EnvError(f"{where}: step() answers a Step or (observation, reward, done), not {_shown(answer)}")
    if answer.reward is not None and (isinstance(answer.reward, bool) or not isinstance(answer.reward, (int, float))
                                      or not math.isfinite(answer.reward)):
        raise EnvError(f"{where}: a step's reward is a finite number or None, not {_shown(answer.reward)}")
    if not isinstance(answer.done, bool):
        raise EnvError(f"{where}: a step's done is True or False, not {_shown(answer.done)}")
    if not answer.done:
        messages_of(answer.observation, where)  # an episode that goes on needs something to go on with
    return answer


def _shown(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:120]}{'…' if len(text) > 120 else ''}"
