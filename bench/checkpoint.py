"""Checkpoint stall benchmark: how long training waits for a checkpoint, asynchronous vs synchronous.

    python -m bench.checkpoint                      # ~1 min on 2 CPU cores
    python -m bench.checkpoint --hidden 512 --layers 6 --repeats 7

An engine host's worker (``engines.host.worker.Worker``, in this process, rank 0 of 1) with a
``TorchTrainer`` on a tiny Llama built locally, big enough that a synchronous save takes
about a second here, writes checkpoints to a ``file://`` store in a temporary folder on local
disk (every object fsynced, as in a run). The loop is the training loop's:

    train_step → checkpoint(uri) → [async: train_step → checkpoint_wait()]

- **stall**: from calling ``checkpoint`` until it returns, i.e. until training may go on.
  Synchronous: the whole save (trainer state, Hugging Face model folder, RNG, upload).
  Asynchronous: copying the state into host memory (into the previous checkpoint's buffers;
  the run's first checkpoint allocates them and is reported on its own row) and starting the
  writer thread.
- **write**: synchronous: the save; asynchronous: the writer thread's time, start to finish.
- **wait**: ``checkpoint_wait`` called after one more train step: what is left of the write
  by then (in a run it is called at the end of the next step, after rollout and scoring too).
- **train step while writing**: the step that overlaps the background write, against a step
  alone (on 2 cores the writer takes CPU time from training).

Modes alternate, medians over ``--repeats``. The controller's side (a Prefect task per command,
45-65 ms, measured with 2 groups x 2 tasks on a PostgreSQL server) is not included: it is the same for both modes. Prints a markdown table and
returns the figures from ``main``.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path


def build_model(path: str, hidden: int, layers: int) -> int:
    """A tiny Llama + char tokenizer as a Hugging Face folder; returns its parameter count."""
    from engines.demo.tiny import build_char_tokenizer, build_tiny_llama

    tokenizer = build_char_tokenizer()
    heads = max(1, hidden // 64)
    model = build_tiny_llama(len(tokenizer), hidden_size=hidden, num_layers=layers, num_heads=heads,
                             num_kv_heads=heads, max_positions=128, seed=0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def make_batch(trainer, sequences: int, length: int, seed: int):
    """Random sequences with old log-probs near the trainer's own (the step does real work)."""
    from engines.backends.base import TrainBatch

    rng = random.Random(seed)
    vocab = len(trainer.tokenizer)
    prompts = [[1] + [rng.randrange(4, vocab) for _ in range(length // 2)] for _ in range(sequences)]
    responses = [[rng.randrange(4, vocab) for _ in range(length // 2 - 1)] + [2] for _ in range(sequences)]
    batch = TrainBatch(prompts, responses, [[0.0] * len(r) for r in responses], [rng.uniform(-1, 1) for _ in range(sequences)])
    return TrainBatch(prompts, responses, trainer.logprobs(batch), batch.advantages)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=512, help="model hidden size (the save time grows with its square)")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--repeats", type=int, default=5, help="checkpoints per mode")
    p.add_argument("--sequences", type=int, default=8, help="sequences per train step")
    p.add_argument("--length", type=int, default=32, help="tokens per sequence")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: stable on a shared 2-core machine)")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    from engines.host.checkpointing import Checkpoints
    from engines.wire.commands import Checkpoint, CheckpointWait
    from engines.config import RunConfig
    from engines.backends.torch.trainer import TorchTrainer
    from engines.host.worker import Worker
    from storage import objectstore

    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="yattflow-bench-checkpoint-", dir=os.environ.get("YATTFLOW_BENCH_DIR")))
    try:
        params = build_model(str(work / "model"), args.hidden, args.layers)
        host = Worker(rank=0, world=1, threads=args.threads)
        host.trainer = trainer = TorchTrainer(str(work / "model"), lr=1e-4)
        host.checkpoints = Checkpoints(0, "torch", [["part-00000.parquet", 1000]])
        modes = {mode: RunConfig.model_validate({"dp": 1, "checkpoint": {"asynchronous": mode == "async"}})
                 for mode in ("sync", "async")}
        batch = make_batch(trainer, args.sequences, args.length, seed=0)
        step = lambda: trainer.train_step(batch, minibatches=1)  # noqa: E731
        step()  # Adam moments exist from here on
        alone = []
        for _ in range(3):
            t = time.perf_counter()
            step()
            alone.append(time.perf_counter() - t)

        figures = {m: {"stall": [], "write": [], "wait": [], "step_during": []} for m in modes}
        first = {}
        bytes_written = 0
        n = 0
        for _ in range(args.repeats + 1):  # the first round of each mode is its "first checkpoint"
            for mode in ("async", "sync"):
                host.config = modes[mode]
                uri = objectstore.normalize(str(work / "store" / f"{n:06d}"))
                n += 1
                step()
                t = time.perf_counter()
                reply = host.checkpoint(Checkpoint(uri=uri))
                stall = time.perf_counter() - t
                if mode == "async":
                    t = time.perf_counter()
                    step()  # the next step, while the checkpoint is written
                    during = time.perf_counter() - t
                    done = host.checkpoint_wait(CheckpointWait())
                    write, wait, files = done.write_s, done.wait_s, done.files
                else:
                    write, wait, during, files = stall, 0.0, None, reply.files
                local = Path(objectstore.fs_for(uri)[1])
                size = sum((local / f).stat().st_size for f in files)
                if mode not in first:
                    first[mode] = stall
                    bytes_written = size
                else:
                    f = figures[mode]
                    f["stall"].append(stall), f["write"].append(write), f["wait"].append(wait)
                    if during is not None:
                        f["step_during"].append(during)
                shutil.rmtree(local)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    med = {m: {k: statistics.median(v) if v else None for k, v in f.items()} for m, f in figures.items()}
    result = {
        "params": params, "checkpoint_mb": bytes_written / 1e6, "repeats": args.repeats,
        "stall_s": {m: med[m]["stall"] for m in modes}, "first_stall_s": first,
        "write_s": {m: med[m]["write"] for m in modes}, "wait_s": med["async"]["wait"],
        "train_step_s": {"alone": statistics.median(alone), "during_write": med["async"]["step_during"]},
        "stall_vs_sync_save": med["async"]["stall"] / med["sync"]["write"],
        "raw": figures,
    }
    print_table(result, args)
    return result


def print_table(r: dict, args) -> None:
    def ratio(a, b):
        return f"{a / b:.3f}" if a is not None and b else "—"

    def sec(x):
        return "—" if x is None else f"{x:.3f}"

    print(f"\n### Checkpoint stall, asynchronous vs synchronous ({r['params'] / 1e6:.1f}M parameters fp32, hidden {args.hidden}, "
          f"{args.layers} layers; {r['checkpoint_mb']:.0f} MB per checkpoint: trainer state with Adam moments + HF model folder; "
          f"local disk, fsync; {args.threads} torch thread(s); medians of {r['repeats']})\n")
    print("| figure | async | sync | ratio (async / sync) |")
    print("|---|---:|---:|---:|")
    rows = [
        ("train-loop stall per checkpoint, s (checkpoint → training goes on)", r["stall_s"]["async"], r["stall_s"]["sync"]),
        ("stall of the first checkpoint, s (async: allocates the host-memory copy)", r["first_stall_s"]["async"], r["first_stall_s"]["sync"]),
        ("checkpoint written after, s (async: the writer thread, start to finish)", r["write_s"]["async"], r["write_s"]["sync"]),
        ("`checkpoint_wait` after one more train step, s", r["wait_s"], None),
        ("train step, s (async: overlapping the write; sync: alone)", r["train_step_s"]["during_write"], r["train_step_s"]["alone"]),
    ]
    for label, a, s in rows:
        print(f"| {label} | {sec(a)} | {sec(s)} | {ratio(a, s)} |")
    verdict = "met" if r["stall_vs_sync_save"] <= 0.10 else "NOT met"
    print(f"\nAsync stall / synchronous save time: {100 * r['stall_vs_sync_save']:.1f}% (goal ≤ 10%: {verdict}).")


if __name__ == "__main__":
    main()
