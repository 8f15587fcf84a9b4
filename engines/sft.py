"""Supervised fine-tuning: the warm start for the policy and the generative reward model."""

from __future__ import annotations

import math
import random
import time
from typing import Callable

import torch


def sft(
    model,
    tokenizer,
    pairs: list[tuple[str, str]],
    steps: int,
    batch_size: int = 64,
    lr: float = 3e-3,
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> dict:
    """Train ``model`` on (prompt, completion) pairs; the loss covers completion tokens
    (and the end-of-sequence token) only. Linear warm-up, then cosine decay to zero."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    warmup = max(steps // 20, 1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warmup, 0.5 * (1 + math.cos(math.pi * s / steps)))
    )
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    encoded = [(tokenizer(p)["input_ids"], tokenizer(c, add_special_tokens=False)["input_ids"] + [eos]) for p, c in pairs]
    start, loss_ema = time.perf_counter(), None
    for step in range(steps):
        chunk = rng.sample(encoded, min(batch_size, len(encoded)))
        width = max(len(p) + len(c) for p, c in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        labels = torch.full((len(chunk), width), -100, dtype=torch.long)
        attn = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, (p, c) in enumerate(chunk):
            ids[i, : len(p) + len(c)] = torch.tensor(p + c)
            labels[i, len(p) : len(p) + len(c)] = torch.tensor(c)
            attn[i, : len(p) + len(c)] = 1
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        loss_ema = loss.item() if loss_ema is None else 0.95 * loss_ema + 0.05 * loss.item()
        if (step + 1) % max(steps // 5, 1) == 0:
            log(f"sft step {step + 1}/{steps} loss {loss_ema:.4f} ({time.perf_counter() - start:.0f}s)")
    model.eval()
    return {"loss": loss_ema, "seconds": time.perf_counter() - start}
