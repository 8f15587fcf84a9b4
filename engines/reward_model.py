"""A scalar reward model: a sequence-classification head with one output (the classic RLHF reward
model), how it reads a sample, and how ``yattflow rm`` trains it from preference pairs.

A sample is the prompt rendered as the policy is prompted (``engines.backends.chat``: the model's
chat template when it has one, else the text as it is) with the response right after it; the
score is the head's output at the last token. Sequences are padded on the right, so every token
keeps the position it has alone and the last real token is the one the head reads (transformers
takes the rightmost non-pad token): a sample's score does not depend on what it is batched with.

Training minimises the Bradley-Terry loss ``-log sigmoid(r_chosen - r_rejected)`` over pairs of
responses to one prompt, and measures held-out pairwise accuracy: the share of pairs whose chosen
response scores higher. Like ``engines/sft.py`` it hands its whole state to ``save`` at every check
and continues exactly from it when given back as ``resume``.
"""

from __future__ import annotations

import copy
import time
from typing import Callable

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

from engines.backends import chat
from engines.sft import Optimiser


class NotARewardModel(ValueError):
    """A folder that is not a sequence classifier with one output."""


def bt_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """Bradley-Terry: the mean of -log sigmoid(r_chosen - r_rejected) (logsigmoid: no overflow for large margins)."""
    return -F.logsigmoid(chosen - rejected).mean()


def reward_head_problem(config) -> str | None:
    """Why a model config is not a scalar reward model (None: it is one): its architectures and num_labels."""
    architectures = list(getattr(config, "architectures", None) or [])
    if not any(a.endswith("ForSequenceClassification") for a in architectures):
        return f"architectures {architectures} (no *ForSequenceClassification)"
    if config.num_labels != 1:
        return f"num_labels {config.num_labels} (a scalar reward model has 1)"
    return None


def sample_text(renderer: chat.Renderer, prompt: chat.Prompt, response: str) -> str:
    """What the reward model reads: the rendered prompt, then the response."""
    return renderer.text(prompt) + response


def encode(tokenizer, renderer: chat.Renderer, texts: list[str]) -> list[list[int]]:
    return [tokenizer(t, **renderer.encode_kwargs)["input_ids"] for t in texts]


def forward(model, ids: list[list[int]], pad: int) -> torch.Tensor:
    """The model's score of each token sequence, right-padded into one batch."""
    device = next(model.parameters()).device
    width = max(len(i) for i in ids)
    batch = torch.full((len(ids), width), pad, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for row, seq in enumerate(ids):
        batch[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(seq)] = 1
    return model(input_ids=batch.to(device), attention_mask=mask.to(device)).logits[:, 0].float()


@torch.no_grad()
def scores(model, ids: list[list[int]], pad: int, batch_size: int = 256) -> list[float]:
    model.eval()
    return [s for i in range(0, len(ids), batch_size) for s in forward(model, ids[i : i + batch_size], pad).tolist()]


def pairwise_accuracy(model, pairs: list[tuple[list[int], list[int]]], pad: int) -> float:
    """The share of (chosen ids, rejected ids) pairs whose chosen sequence scores higher."""
    chosen = scores(model, [c for c, _ in pairs], pad)
    rejected = scores(model, [r for _, r in pairs], pad)
    return sum(c > r for c, r in zip(chosen, rejected)) / len(pairs)


def start_classifier(base_dir: str | None, texts: list[str], seed: int, **scratch):
    """(model, tokenizer) training starts from: the Hugging Face folder ``base_dir`` (a sequence
    classifier with one output as it is; a causal LM's body under a new one-output head), or (None)
    a tiny Llama drawn with ``seed`` over a character tokenizer of ``texts`` (``engines.sft.start_model``
    with ``scratch``'s shape) under a new head. The model's pad token is the tokenizer's."""
    if base_dir is None:
        from engines.sft import start_model

        lm, tokenizer, _ = start_model(None, texts, seed, **scratch)
        config = copy.deepcopy(lm.config)
        config.num_labels, config.architectures = 1, None
        torch.manual_seed(seed)
        model = AutoModelForSequenceClassification.from_config(config)
        model.base_model.load_state_dict(lm.base_model.state_dict())
    else:
        tokenizer = AutoTokenizer.from_pretrained(base_dir)
        if tokenizer.pad_token is None:  # many causal LMs ship without one; padding is masked out anyway
            tokenizer.pad_token = tokenizer.eos_token
        config = AutoConfig.from_pretrained(base_dir)
        classifier = any(a.endswith("ForSequenceClassification") for a in config.architectures or [])
        if classifier and (problem := reward_head_problem(config)):
            raise NotARewardModel(f"{base_dir}/config.json: {problem}")
        torch.manual_seed(seed)  # the new score head of a causal LM's body
        model = AutoModelForSequenceClassification.from_pretrained(base_dir, dtype=torch.float32,
                                                                   **({} if classifier else {"num_labels": 1}))
    model.config.pad_token_id = tokenizer.pad_token_id
    return model.float(), tokenizer


def train(
    model,
    tokenizer,
    renderer: chat.Renderer,
    pairs: list[tuple[chat.Prompt, str, str]],
    check: list[tuple[chat.Prompt, str, str]],
    target: float | None = None,
    steps: int = 3000,
    check_every: int = 100,
    batch_size: int = 64,
    lr: float = 1e-3,
    seed: int = 0,
    resume: dict | None = None,
    save: Callable[[dict], None] | None = None,
    on_check: Callable[[dict], None] | None = None,
) -> dict:
    """Train ``model`` on (prompt, chosen, rejected) ``pairs`` with the Bradley-Terry loss until its
    pairwise accuracy on the ``check`` pairs reaches ``target``, or ``steps`` pass; the optimisation,
    and what a continued run restores, is SFT's (``engines.sft.Optimiser``)."""
    optimiser = Optimiser(model, lr, seed)
    rng = optimiser.rng
    pad = tokenizer.pad_token_id

    def encoded(rows):
        chosen = encode(tokenizer, renderer, [sample_text(renderer, p, c) for p, c, _ in rows])
        rejected = encode(tokenizer, renderer, [sample_text(renderer, p, r) for p, _, r in rows])
        return list(zip(chosen, rejected))

    train_ids, check_ids = encoded(pairs), encoded(check)
    start, loss_ema, accuracy, step, converged = time.perf_counter(), None, None, 0, False
    if resume is not None:
        optimiser.restore(resume)
        step, loss_ema, accuracy = resume["step"], resume["loss"], resume["accuracy"]
        converged = target is not None and accuracy is not None and accuracy >= target
    while step < steps and not converged:
        model.train()
        chunk = rng.sample(train_ids, min(batch_size, len(train_ids)))
        both = forward(model, [c for c, _ in chunk] + [r for _, r in chunk], pad)  # one batch: chosen, then rejected
        loss = bt_loss(both[: len(chunk)], both[len(chunk) :])
        optimiser.step(loss)
        step += 1
        loss_ema = loss.item() if loss_ema is None else 0.95 * loss_ema + 0.05 * loss.item()
        if step % check_every == 0 or step == steps:
            if check_ids:
                accuracy = pairwise_accuracy(model, check_ids, pad)
                converged = target is not None and accuracy >= target
            if on_check is not None:
                on_check({"step": step, "steps": steps, "loss": loss_ema, "accuracy": accuracy,
                          "seconds": time.perf_counter() - start})
            if save is not None:
                save(optimiser.state(step=step, loss=loss_ema, accuracy=accuracy))
    model.eval()
    return {"steps": step, "converged": converged, "accuracy": accuracy, "loss": loss_ema, "seconds": time.perf_counter() - start}
