"""The reward rule of docs/your-own-task.md: ``reward.rule=docs/own-task/rules.py:reversed_word``.

A rule is any function ``(prompt, response, answer) -> number``; ``answer`` is the prompt's
reference answer from the prompts file (a rule that needs none declares ``answer=None``).
"""


def reversed_word(prompt: str, response: str, answer: str) -> float:
    """1 for the reversed word, else 0."""
    return float(response.strip() == answer)
