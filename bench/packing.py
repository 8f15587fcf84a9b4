"""Packed micro-batches against padded ones: a train step on long-tailed response lengths.

    .venv/bin/python -m bench.packing                      # 512 x 8, 256 rows, 2 timed steps per mode, 2 repeats (~8 min on 2 cores)
    .venv/bin/python -m bench.packing --steps 1 --repeats 1

The model is ``bench/vs_trl.py``'s large shape (a random Llama of hidden 512 x 8 layers, 8 heads, 4 KV
heads, the demo's character tokenizer); the batch is its step: 32 prompts x G=8 rows of 7 prompt
tokens, response lengths long-tailed: 95% uniform in [median / 2, 3 median / 2] and 5% of rows 8x the
median (``--median``, 48 tokens by default). One ``TorchTrainer.train_step`` (GRPO with DAPO's
settings, one minibatch, ``train.micro_batch_tokens`` 4096 by default) per step, in these modes:

* **padded**: ``packed=False``: rows sorted by length and cut into passes of at most the budget of
  padded tokens (rows x longest row), each padded to its longest row (``batching.micro_batches``);
* **packed**: ``packed=True`` (the default): rows laid end to end in lanes as wide as the pass's longest
  row, positions restarting per row and attention kept within each row (``batching.packed_micro_batches``).

After the steps, each mode also times one ``TorchTrainer.logprobs`` over the whole batch: a pass with no
budget (the recomputed old policy, the critic's values), which the padded mode pads to the longest row.

Each mode runs in its own subprocess (its peak resident memory is then its own: ``ru_maxrss``,
model and Adam state included), the modes alternating, ``--repeats`` times; one warm-up step, then
``--steps`` timed steps. tokens/s counts the rows' real tokens (prompt + response), the same in
both modes; the ratio is packed / padded (goal: >= 1.5x tokens/s).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import cpu_model

ROOT = Path(__file__).resolve().parents[1]
MODES = {"padded": False, "packed": True}


def long_tailed_batch(rows: int, median: int, seed: int = 0):
    """``rows`` rows of 7 prompt tokens, responses 95% uniform in [median/2, 3 median/2], 5% 8x the median."""
    from engines.backends.base import TrainBatch

    rng = random.Random(seed)
    long = set(rng.sample(range(rows), max(1, round(rows * 0.05))))
    lengths = [8 * median if i in long else rng.randint(median // 2, 3 * median // 2) for i in range(rows)]
    prompts = [[1] + [rng.randrange(4, 40) for _ in range(6)] for _ in range(rows)]
    responses = [[rng.randrange(4, 40) for _ in range(n)] for n in lengths]
    old = [[-3.0 + rng.uniform(-0.1, 0.1) for _ in r] for r in responses]
    return TrainBatch(prompts, responses, old, [rng.gauss(0.0, 1.0) for _ in range(rows)])


def worker(spec: dict) -> dict:
    """One mode in this process: a warm-up step, then ``steps`` timed ones."""
    import torch

    from engines.backends.torch.trainer import TorchTrainer

    torch.set_num_threads(spec["threads"])
    batch = long_tailed_batch(spec["rows"], spec["median"])
    trainer = TorchTrainer(spec["model"], lr=1e-6, packed=spec["packed"])
    assert (trainer.packing is None) == spec["packed"], trainer.packing
    times = []
    for k in range(spec["steps"] + 1):
        start = time.perf_counter()
        trainer.train_step(batch, minibatches=1, micro_batch_tokens=spec["budget"])
        if k:
            times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # the train steps' (the pass below may raise it)
    start = time.perf_counter()
    trainer.logprobs(batch)  # one pass over the whole batch, no budget (old_policy=recompute, the critic's values)
    return {"seconds": times, "peak_rss_mb": peak, "logprobs_s": time.perf_counter() - start}


def run_mode(mode: str, model: str, args) -> dict:
    spec = {"model": model, "packed": MODES[mode], "rows": args.rows, "median": args.median, "budget": args.budget,
            "steps": args.steps, "threads": args.threads}
    env = os.environ | {"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    out = subprocess.run([sys.executable, "-m", "bench.packing", "--worker", json.dumps(spec)], cwd=ROOT, env=env,
                         capture_output=True, text=True, check=False)
    if out.returncode:
        raise RuntimeError(f"bench.packing {mode} worker failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.packing", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=256, help="rows per step (bench.vs_trl's large size: 32 prompts x G=8)")
    p.add_argument("--median", type=int, default=48, help="median response length; 5%% of rows are 8x it")
    p.add_argument("--budget", type=int, default=4096, help="train.micro_batch_tokens (the config's default)")
    p.add_argument("--steps", type=int, default=2, help="timed steps per mode and repeat (after one warm-up)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return {}
    from bench.vs_trl import SIZES
    from engines.backends.batching import Packed, micro_batches, packed_micro_batches
    from engines.demo.tiny import build_char_tokenizer, build_tiny_llama

    s = SIZES["large"]
    batch = long_tailed_batch(args.rows, args.median)
    lengths = [len(a) + len(b) for a, b in zip(batch.prompt_ids, batch.response_ids)]
    tokens = sum(lengths)
    # the tensors each mode runs: rows x longest row per padded pass, lanes x width per packed pass
    padded_cells = sum(len(m) * max(len(a) + len(b) for a, b in zip(m.prompt_ids, m.response_ids))
                       for m in micro_batches(batch, args.budget))
    packed_passes = packed_micro_batches(batch, args.budget)
    packed_cells = sum(Packed(m, 0).ids.numel() for m in packed_passes)
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as folder:
        tokenizer = build_char_tokenizer()
        build_tiny_llama(len(tokenizer), hidden_size=s["hidden"], num_layers=s["layers"], num_heads=s["heads"],
                         num_kv_heads=s["kv_heads"], max_positions=1024, seed=0,
                         init_std=s["init_std"]).save_pretrained(folder, safe_serialization=True)
        tokenizer.save_pretrained(folder)
        for _ in range(args.repeats):
            for mode in MODES:
                runs[mode].append(run_mode(mode, folder, args))
    figures = {}
    for mode, results in runs.items():
        seconds = statistics.median(t for r in results for t in r["seconds"])
        figures[mode] = {"s_per_step": seconds, "tokens_per_s": tokens / seconds,
                         "peak_rss_mb": max(r["peak_rss_mb"] for r in results),
                         "logprobs_s": statistics.median(r["logprobs_s"] for r in results)}
    pad, pack = figures["padded"], figures["packed"]
    print(f"CPU: {cpu_model()}; torch threads {args.threads}; load average {os.getloadavg()[0]:.2f}; "
          f"hidden {s['hidden']} x {s['layers']} layers; {len(batch)} rows, {tokens} tokens (median row "
          f"{statistics.median(lengths):.0f}, longest {max(lengths)}); micro_batch_tokens {args.budget}; "
          f"{args.steps} timed steps x {args.repeats} repeats per mode\n")
    print("| mode | passes | tokens computed (real + padding) | s/step | tokens/s | peak RSS (MB) |")
    print("|---|---:|---:|---:|---:|---:|")
    print(f"| padded | {len(micro_batches(batch, args.budget))} | {padded_cells} | {pad['s_per_step']:.2f} | "
          f"{pad['tokens_per_s']:.0f} | {pad['peak_rss_mb']:.0f} |")
    print(f"| packed | {len(packed_passes)} | {packed_cells} | {pack['s_per_step']:.2f} | {pack['tokens_per_s']:.0f} | "
          f"{pack['peak_rss_mb']:.0f} |")
    print("\ns per step, each run in its order: " + "; ".join(
        f"{mode} " + ", ".join(f"{t:.1f}" for r in results for t in r["seconds"]) for mode, results in runs.items()))
    ratio = pack["tokens_per_s"] / pad["tokens_per_s"]
    print(f"\npacked / padded: {ratio:.2f}x tokens/s (goal >= 1.5x: {'met' if ratio >= 1.5 else 'missed'}), "
          f"{pack['peak_rss_mb'] / pad['peak_rss_mb']:.2f}x peak memory")
    one_pass = len(batch) * max(lengths)
    print(f"one pass over the whole batch without a budget (``TorchTrainer.logprobs``, no gradient): padded "
          f"{one_pass} tokens computed, {pad['logprobs_s']:.2f} s; packed {Packed(batch, 0).ids.numel()}, "
          f"{pack['logprobs_s']:.2f} s: {pad['logprobs_s'] / pack['logprobs_s']:.2f}x")
    return {"figures": figures, "tokens": tokens, "padded_cells": padded_cells, "packed_cells": packed_cells,
            "rows": [{"figure": "train step tokens/s, long-tailed (packed vs padded)", "yattflow": pack["tokens_per_s"],
                      "baseline": pad["tokens_per_s"], "ratio": ratio}]}


if __name__ == "__main__":
    main()
