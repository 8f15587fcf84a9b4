"""A step's kept samples and its training rows: DAPO's dynamic filter over the groups of the
step's waves, and what the algorithm needs of the kept ones.

An advantage algorithm trains on every kept sample with its advantage; a pair algorithm
(``Needs.pairs``: DPO) on the (chosen, rejected) pairs it picks, written as consecutive rows
(chosen first, ``advantage`` +1; rejected, -1: a marker the pair loss does not read), the
layout every batching step keeps together (``Needs.unit``)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

from engines.config.train import TrainConfig
from engines.host import critic as critic_host, offpolicy
from engines.rl.base import AlgorithmConfig
from engines.wire.commands import DynamicFilter, DynamicFilterResult
from storage import datasets


def training_rows(algorithm: AlgorithmConfig, rows: list[dict]) -> list[dict]:
    """``rows`` (scored samples with their ``step``, ``wave``, ``prompt_id``, ``reward``) → experience rows."""
    rewards = [row["reward"] for row in rows]
    groups = [hash((row["step"], row["wave"], row["prompt_id"])) for row in rows]  # one prompt's samples of one wave
    if algorithm.needs.pairs:
        return [rows[i] | {"advantage": mark} for pair in algorithm.pairs(rewards, groups) for i, mark in zip(pair, (1.0, -1.0))]
    return [row | {"advantage": a} for row, a in zip(rows, algorithm.advantages(rewards, groups))]


def advantaged(train: TrainConfig, critic, rows: list[dict], take: Callable[..., float]) -> list[dict]:
    """The filter's chosen ``rows`` as the update reads them: with per-token advantages from the
    ``critic``'s values (``Needs.critic``; ``take`` wakes it under full colocation; every rank of a
    group computes them, a collective over TP), else ``training_rows``."""
    if train.algorithm.needs.critic:
        take("critic")
        return critic_host.with_token_advantages(train.algorithm, critic, rows, train.micro_batch_tokens)
    return training_rows(train.algorithm, rows)


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


@dataclass
class Choice:
    """The dynamic filter's choice for a step: the groups it trains, the ones it carries to the next
    step, and its counts (``DynamicFilterResult``'s)."""

    train: list[list[dict]]
    carry: list[list[dict]]
    carried_in: int  # groups of earlier steps among ``train``
    equal: int  # this step's groups with equal rewards
    new_kept: int
    surplus: int  # kept beyond the target
    too_old: int  # carried groups dropped for ``sampling.max_carry_age`` or ``rollout.max_staleness``
    stale: int  # groups dropped as too stale (carried in, or kept and not carried out)

    def result(self, r: DynamicFilter) -> DynamicFilterResult:
        enough = len(self.train) >= r.target_groups
        reason = ("target reached" if enough else
                  f"{len(self.train)}/{r.target_groups} groups kept, {self.equal} had equal rewards")
        if self.carried_in:
            reason += f" ({self.carried_in} carried over from earlier steps)"
        return DynamicFilterResult(
            uri=r.out, kept=len(self.train), dropped_equal=self.equal, new_kept=self.new_kept, enough=enough,
            reason=reason, carried_in=self.carried_in, surplus=self.surplus, carried_out=len(self.carry),
            surplus_dropped=self.surplus - len(self.carry) + self.too_old, carry=r.carry_out if self.carry else None,
            stale_dropped=self.stale)


def choose(config, r: DynamicFilter, carried_rows: list[dict], read: Callable[[str], list[dict]]) -> Choice:
    """DAPO dynamic sampling for step ``r.step``: groups carried over from earlier steps
    (``carried_rows``, the previous step's ``carry_out``) first, oldest first, then this step's
    waves' kept groups in order (``r.scored``, read by ``read``); the first ``r.target_groups`` train.
    The kept groups beyond the target are carried if they will be at most ``sampling.max_carry_age``
    steps old (and, with ``rollout.max_staleness``, not too stale) in the next step, and dropped
    otherwise; nothing is carried without ``r.carry_out``."""
    max_age = config.sampling.max_carry_age
    carried: dict[tuple[int, int, int], list[dict]] = defaultdict(list)  # (step, wave, prompt_id): rows
    for row in carried_rows:
        carried[(row["step"], row["wave"], row["prompt_id"])].append(row)
    too_old = [key for key in carried if r.step - key[0] > max_age]  # only if max_carry_age was lowered
    too_old += (stale := [key for key in carried if key not in too_old and offpolicy.too_stale(config, r.step, carried[key])])
    for key in too_old:
        del carried[key]
    kept, equal, new_kept = kept_groups(r.scored, r.step, config.sampling.filter_equal_rewards, read)
    candidates = list(carried.values()) + kept
    train, rest = candidates[: r.target_groups], candidates[r.target_groups :]
    young = [rows for rows in rest if r.step + 1 - rows[0]["step"] <= max_age] if r.carry_out is not None else []
    carry = [rows for rows in young if not offpolicy.too_stale(config, r.step + 1, rows)]  # rollout.max_staleness
    return Choice(train, carry, min(len(carried), r.target_groups), equal, new_kept, len(rest), len(too_old),
                  len(stale) + len(young) - len(carry))
