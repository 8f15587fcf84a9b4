"""A step's training rows from its kept samples: what the algorithm needs of them.

An advantage algorithm trains on every kept sample with its advantage; a pair algorithm
(``Needs.pairs``: DPO) on the (chosen, rejected) pairs it picks, written as consecutive rows
(chosen first, ``advantage`` +1; rejected, -1: a marker the pair loss does not read), the
layout every batching step keeps together (``Needs.unit``)."""

from __future__ import annotations

from engines.rl.base import AlgorithmConfig


def training_rows(algorithm: AlgorithmConfig, rows: list[dict]) -> list[dict]:
    """``rows`` (scored samples with their ``step``, ``wave``, ``prompt_id``, ``reward``) → experience rows."""
    rewards = [row["reward"] for row in rows]
    groups = [hash((row["step"], row["wave"], row["prompt_id"])) for row in rows]  # one prompt's samples of one wave
    if algorithm.needs.pairs:
        return [rows[i] | {"advantage": mark} for pair in algorithm.pairs(rewards, groups) for i, mark in zip(pair, (1.0, -1.0))]
    return [row | {"advantage": a} for row, a in zip(rows, algorithm.advantages(rewards, groups))]
