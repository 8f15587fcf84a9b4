"""A step's kept samples and its training rows: DAPO's dynamic filter over the groups of the
step's waves, and what the algorithm needs of the kept ones.

An advantage algorithm trains on every kept sample with its advantage; a pair algorithm
(``Needs.pairs``: DPO) on the (chosen, rejected) pairs it picks, written as consecutive rows
(chosen first, ``advantage`` +1; rejected, -1: a marker the pair loss does not read), the
layout every batching step keeps together (``Needs.unit``)."""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

from engines.rl.base import AlgorithmConfig
from storage import datasets


def training_rows(algorithm: AlgorithmConfig, rows: list[dict]) -> list[dict]:
    """``rows`` (scored samples with their ``step``, ``wave``, ``prompt_id``, ``reward``) → experience rows."""
    rewards = [row["reward"] for row in rows]
    groups = [hash((row["step"], row["wave"], row["prompt_id"])) for row in rows]  # one prompt's samples of one wave
    if algorithm.needs.pairs:
        return [rows[i] | {"advantage": mark} for pair in algorithm.pairs(rewards, groups) for i, mark in zip(pair, (1.0, -1.0))]
    return [row | {"advantage": a} for row, a in zip(rows, algorithm.advantages(rewards, groups))]


def kept_groups(scored: list[str], step: int, filter_equal_rewards: bool,
                read: Callable[[str], list[dict]] | None = None) -> tuple[list[list[dict]], int, int]:
    """DAPO's dynamic filter over this step's scored waves (``scored``: their URIs, in order; ``read``:
    a URI's rows, from storage unless given): the prompt groups (one prompt's samples of one wave, rows
    tagged with ``step``) whose rewards differ, in order; how many had equal rewards; how many kept
    ones the last wave added."""
    read = read or (lambda uri: datasets.read_table(uri, datasets.SCORED).to_pylist())
    kept, equal, new_kept = [], 0, 0
    for i, uri in enumerate(scored):
        groups: dict[tuple[int, int], list[dict]] = defaultdict(list)
        for row in read(uri):
            groups[(row["wave"], row["prompt_id"])].append(row | {"step": step})
        for rows in groups.values():
            if filter_equal_rewards and len({row["reward"] for row in rows}) == 1:
                equal += 1
            else:
                kept.append(rows)
                new_kept += i == len(scored) - 1
    return kept, equal, new_kept
