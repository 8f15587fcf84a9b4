"""Agentic RL: multi-turn episodes with an environment and tools (docs/agents.md).

* ``environment.py``: what a user writes — a class with ``reset(row)`` and ``step(text)`` — and
  how it is loaded (``rollout.env``) and checked.
* ``tools.py``: tools are typed Python functions (``rollout.tools``); their JSON schemas, the
  call format the model writes, and calling them so that a bad call is an observation.
* ``sandbox.py``: model-written Python run in a bubblewrap sandbox (the ``python`` tool).
* ``episodes.py``: many episodes at once, token-in/token-out: the trained sequence is exactly
  what the engine sampled plus the tokenized observations between, with a loss mask.
"""
