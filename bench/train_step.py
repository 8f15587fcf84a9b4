"""Where one train step's time goes: a profile of ``TorchTrainer.train_step``, region by region.

    .venv/bin/python -m bench.train_step                       # bench.vs_trl's large size: hidden 512 x 8, 32 prompts x G=8, <= 64 new tokens
    .venv/bin/python -m bench.train_step --micro-batch-tokens none,4096,1024

The model is a size of ``bench/vs_trl.py`` (``build_model``; by default the larger: a Llama of
hidden 512, 8 layers, the demo's character tokenizer, random weights); the batch is what its rollout engine generates for 32
arithmetic prompts, 8 samples each, at most 64 new tokens. One warm-up step, then
``torch.profiler`` over one step per ``train.micro_batch_tokens`` setting; the table gives each
region the trainer names (``engines/backends/torch/trainer.py``: pad_batch, forward, loss (with the
statistics since the algorithms' loss step computes both), backward, all_reduce, optimizer) in seconds of wall time, and what no region covers (Python
between them: cutting micro-batches, moving numbers to Python). The torch threads are
``--threads`` (2: this machine's cores).
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch

from bench import cpu_model
from bench.vs_trl import G, SIZES, build_model

REGIONS = ("pad_batch", "forward", "loss", "backward", "all_reduce", "optimizer")


def rollout_batch(folder: str, prompts: int, samples: int, max_new_tokens: int):
    """What the rollout engine makes of ``prompts`` arithmetic prompts, as a ``TrainBatch``."""
    from engines.backends.base import TrainBatch
    from engines.backends.torch.generator import TorchGenerator

    rng = random.Random(0)
    texts = [f"{rng.randint(10, 99)}+{rng.randint(10, 99)}=" for _ in range(prompts)]
    gens = TorchGenerator(folder).generate(texts, n=samples, max_new_tokens=max_new_tokens, seed=0)
    advantages = [rng.gauss(0.0, 1.0) for _ in gens]
    return TrainBatch([g.prompt_ids for g in gens], [g.response_ids for g in gens], [g.logprobs for g in gens], advantages)


def profile_step(trainer, batch, micro_batch_tokens: int | None) -> dict[str, float]:
    """Seconds per region of one ``train_step`` (wall time of the regions' events)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        trainer.train_step(batch, minibatches=1, micro_batch_tokens=micro_batch_tokens)
        wall = time.perf_counter() - start
    seconds = {r: 0.0 for r in REGIONS}
    for event in prof.events():
        if event.name in seconds:
            seconds[event.name] += event.time_range.elapsed_us() / 1e6
    seconds["other"] = wall - sum(seconds.values())
    seconds["step"] = wall
    return seconds


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.train_step", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="large", choices=sorted(SIZES), help="model shape, prompts and cap of bench.vs_trl")
    p.add_argument("--micro-batch-tokens", default="none,4096,1024,512",
                   help="train.micro_batch_tokens settings to profile, comma-separated (none: one pass)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from engines.backends.torch.trainer import TorchTrainer

    settings = [None if s == "none" else int(s) for s in args.micro_batch_tokens.split(",")]
    size = SIZES[args.size]
    with tempfile.TemporaryDirectory() as folder:
        build_model(Path(folder), args.size, seed=0)
        batch = rollout_batch(folder, size["prompts"], G, size["max_new"])
        trainer = TorchTrainer(folder, lr=1e-6)
        trainer.train_step(batch, minibatches=1, micro_batch_tokens=settings[0])  # warm-up
        profiles = {s: profile_step(trainer, batch, s) for s in settings}
    tokens = sum(len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids))
    print(f"CPU: {cpu_model()}; torch threads {args.threads}; hidden {size['hidden']} x {size['layers']} layers; "
          f"{len(batch)} sequences, {tokens} tokens (longest {max(len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids))})")
    header = "| region | " + " | ".join(f"micro_batch_tokens={s or 'none'} (s)" for s in settings) + " |"
    print(header)
    print("|---|" + "---:|" * len(settings))
    for region in (*REGIONS, "other", "step"):
        print(f"| {region} | " + " | ".join(f"{profiles[s][region]:.2f}" for s in settings) + " |")
    return {"profiles": {str(s): v for s, v in profiles.items()}, "tokens": tokens, "sequences": len(batch)}


if __name__ == "__main__":
    main()
