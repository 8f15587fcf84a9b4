"""The host's side of an algorithm with a critic (``Needs.critic``: PPO): the critic's values on a
step's kept rows, and from them and the rewards the per-token advantages and returns the
experience holds (``storage.datasets.EXPERIENCE``: ``token_advantages``, ``returns``, ``values``).

Run by the dynamic filter, once per step on the rows it keeps, before ``train_step``: the values
are those of the critic the step starts from (the "old" values of the value clip), computed by
each DP group on its own rows (no collective).

An episode (``rollout.env`` / ``rollout.tools``) has values, advantages and returns on the tokens
the policy sampled only (its ``loss_mask``): GAE runs over them as one chain, an assistant turn's
last token followed by the next turn's first, the observation between them a step of the
environment that costs nothing and is never valued or trained (veRL's multi-turn PPO does the same).
"""

from __future__ import annotations

from engines.backends.base import TrainBatch


def folder(cfg) -> str:
    """The critic's Hugging Face folder (URI): ``model.critic``, else the policy's."""
    return cfg.uri(cfg.model.critic or cfg.model.policy)


def with_token_advantages(algorithm, critic, rows: list[dict], max_tokens: int | None) -> list[dict]:
    """``rows`` (scored samples) with their values, per-token advantages and returns; ``advantage``
    is the first token's (what a per-sequence reader of the experience sees). The critic's
    forward passes take consecutive rows of at most ``max_tokens`` padded tokens each
    (``train.micro_batch_tokens``; None: one pass)."""
    values: list[list[float]] = []
    for start, end in _passes([len(r["prompt_ids"]) + len(r["response_ids"]) for r in rows], max_tokens):
        part = rows[start:end]
        values += critic.values(TrainBatch([r["prompt_ids"] for r in part], [r["response_ids"] for r in part],
                                           [r["logprobs"] for r in part], [0.0] * len(part),
                                           loss_mask=[r.get("loss_mask") for r in part]))
    advantages, returns = algorithm.token_advantages([r["reward"] for r in rows], values)
    return [row | {"advantage": a[0] if a else 0.0, "token_advantages": a, "returns": g, "values": v}
            for row, a, g, v in zip(rows, advantages, returns, values)]


def _passes(lengths: list[int], max_tokens: int | None) -> list[tuple[int, int]]:
    """Consecutive [start, end) ranges whose rows x longest row stays within ``max_tokens`` (a
    longer row alone)."""
    if max_tokens is None:
        return [(0, len(lengths))] if lengths else []
    out, start, width = [], 0, 0
    for i, n in enumerate(lengths):
        if i > start and (i - start + 1) * max(width, n) > max_tokens:
            out.append((start, i))
            start, width = i, 0
        width = max(width, n)
    if start < len(lengths):
        out.append((start, len(lengths)))
    return out
