"""Rollout engine benchmark: yattflow's framework tax over raw vLLM, and weight-sync cost.

    python -m bench.rollout                 # ~1-2 min on 2 CPU cores
    python -m bench.rollout --sizes 128,512,1024 --repeats 9

1. Generated tokens/s of ``VLLMGenerator.generate`` (what a rollout calls: prompt
   tokenisation, per-sample seeds, ``Generation`` objects, decoding) against one raw
   ``LLM.generate`` call with the *same* token prompts and ``SamplingParams`` on the same
   engine. Warm-up first, then alternating repeats; medians.
2. ``load_weights(VLLMGenerator, TorchTrainer.export_weights())`` time against parameter count, for a
   few model sizes (4 layers, head_dim 32: vLLM's CPU attention needs head_dim >= 32).

Every model is a tiny Llama built locally (engines/demo/tiny.py). Prints markdown tables and
returns the figures from ``main`` (for a future ``bench/run_all.py``).
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import tempfile
import time


def build_model(path: str, hidden: int, layers: int, seed: int = 0) -> int:
    """Save a tiny Llama + char tokenizer as an HF folder; returns its parameter count."""
    from engines.demo.tiny import build_char_tokenizer, build_tiny_llama

    tokenizer = build_char_tokenizer()
    heads = max(1, hidden // 32)
    model = build_tiny_llama(len(tokenizer), hidden_size=hidden, num_layers=layers, num_heads=heads,
                             num_kv_heads=max(1, heads // 2), max_positions=128, seed=seed)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def arithmetic_prompts(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"{rng.randint(0, 99)}{rng.choice('+-*')}{rng.randint(0, 99)}=" for _ in range(count)]


def bench_throughput(args, model_dir: str) -> dict:
    from engines.backends.vllm.generator import VLLMGenerator

    gen = VLLMGenerator(model_dir, threads=args.threads, kv_cache_memory_bytes=128 * 2**20)
    prompts = arithmetic_prompts(args.prompts)
    kwargs = dict(n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens, seed=args.seed)

    def ours() -> int:
        return sum(len(g.response_ids) for g in gen.generate(prompts, **kwargs))

    token_prompts, params = gen.requests(prompts, **kwargs)  # built once: the raw call's inputs

    def raw() -> int:
        return sum(len(o.outputs[0].token_ids) for o in gen.llm.generate(token_prompts, params, use_tqdm=False))

    for fn in (ours, raw):  # warm-up
        fn()
    times: dict[str, list[float]] = {"raw": [], "ours": []}
    tokens: dict[str, int] = {}
    for i in range(args.repeats):  # alternate (and swap the order), so drift hits both alike
        for name, fn in ((("raw", raw), ("ours", ours)) if i % 2 == 0 else (("ours", ours), ("raw", raw))):
            start = time.perf_counter()
            tokens[name] = fn()
            times[name].append(time.perf_counter() - start)
    result = {name: {"seconds": statistics.median(t), "best_seconds": min(t), "tokens": tokens[name],
                     "tokens_per_s": tokens[name] / statistics.median(t)} for name, t in times.items()}
    result["tax_percent"] = 100 * (result["ours"]["seconds"] / result["raw"]["seconds"] - 1)
    result["best_tax_percent"] = 100 * (result["ours"]["best_seconds"] / result["raw"]["best_seconds"] - 1)
    # yattflow's own work, timed alone (immune to the engine's noise): building the requests,
    # and turning vLLM's outputs into Generations
    own = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        gen.requests(prompts, **kwargs)
        own.append(time.perf_counter() - start)
    outputs = gen.llm.generate(token_prompts, params, use_tqdm=False)
    post = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        gen.to_generations(outputs, args.n)
        post.append(time.perf_counter() - start)
    result["own_ms"] = 1000 * (statistics.median(own) + statistics.median(post))
    result["own_percent"] = 100 * result["own_ms"] / 1000 / result["raw"]["seconds"]
    result["requests"] = len(token_prompts)
    del gen
    gc.collect()
    return result


def bench_task(args, model_dir: str, root: str) -> dict:
    """The same prompts through yattflow's whole rollout path: a Prefect ``rollout`` task sends
    one command to a DP group's engine host (a separate process with its own vLLM engine, as in
    a training run), which generates and writes the rollouts as Parquet to object storage."""
    import asyncio

    import pyarrow as pa
    from prefect import flow

    from engines.wire.launch import LocalHosts
    from engines.config import load_config
    from storage import datasets
    from tasks import stages

    prompts = arithmetic_prompts(args.prompts)
    rows = [{"prompt_id": i, "prompt": p, "answer": None} for i, p in enumerate(prompts)]
    table = pa.Table.from_pylist(rows, schema=datasets.PROMPTS)
    datasets.write_table(f"{root}/data/train/part-00000.parquet", table, datasets.PROMPTS)
    config = load_config(None, [
        "name=bench-rollout", "dp=1", f"threads_per_host={args.threads or 1}", f"storage.root={root}",
        f"model.policy={model_dir}", "data.heldout=null", "rollout.backend=vllm", f"rollout.samples_per_prompt={args.n}",
        f"rollout.max_new_tokens={args.max_new_tokens}", "reward.genrm_weight=0", "reward.rule_weight=1",
    ])

    @flow(name="bench-rollout-task")
    async def run() -> list[dict]:
        results = []
        with LocalHosts(config.name, 1, config.threads_per_host, config.host_timeout_s):
            await stages.setup_engines(config, 0, None)
            for step in range(args.repeats + 1):  # step 0 is the warm-up
                start = time.perf_counter()
                out = await stages.rollout(stages.Run.of(config), step, 0, 0, 0, len(prompts))
                results.append({"seconds": time.perf_counter() - start, "tokens": out.tokens})
        return results[1:]

    results = asyncio.run(run())
    seconds = statistics.median(r["seconds"] for r in results)
    tokens = statistics.median(r["tokens"] for r in results)
    return {"seconds": seconds, "best_seconds": min(r["seconds"] for r in results), "tokens": int(tokens),
            "tokens_per_s": statistics.median(r["tokens"] / r["seconds"] for r in results)}


def bench_weight_sync(args, root: str) -> list[dict]:
    from engines.backends.base import load_weights
    from engines.backends.torch.trainer import TorchTrainer
    from engines.backends.vllm.generator import VLLMGenerator

    rows = []
    for hidden in args.sizes:
        model_dir = f"{root}/sync-{hidden}"
        params = build_model(model_dir, hidden, args.layers)
        # an engine alone in the process may be dropped before the next one is built
        gen = VLLMGenerator(model_dir, threads=args.threads, kv_cache_memory_bytes=32 * 2**20)
        trainer = TorchTrainer(model_dir)
        nbytes = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
        load_weights(gen, trainer.export_weights())  # warm-up
        times = []
        for _ in range(args.sync_repeats):
            start = time.perf_counter()
            count = load_weights(gen, trainer.export_weights())
            times.append(time.perf_counter() - start)
        seconds = statistics.median(times)
        rows.append({"hidden": hidden, "params": params, "tensors": count, "mb": nbytes / 1e6,
                     "ms": 1000 * seconds, "best_ms": 1000 * min(times), "mb_per_s": nbytes / 1e6 / seconds})
        del gen, trainer
        gc.collect()
    return rows


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=128, help="throughput model hidden size")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[64, 128, 256, 512],
                   help="hidden sizes for the weight-sync table")
    p.add_argument("--sync-repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1,
                   help="engine torch threads (1: stable on a shared 2-core machine; 0: inherited)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    with tempfile.TemporaryDirectory() as root:
        build_model(f"{root}/throughput", args.hidden, args.layers)
        tp = bench_throughput(args, f"{root}/throughput")
        tp["task"] = bench_task(args, f"{root}/throughput", f"{root}/task")
        sync = bench_weight_sync(args, root)

    print(f"\n### Rollout throughput (hidden {args.hidden}, {args.layers} layers, fp32; {args.prompts} prompts x "
          f"n={args.n} = {tp['requests']} requests, <= {args.max_new_tokens} new tokens; median of {args.repeats}; "
          f"torch threads {args.threads or torch.get_num_threads()})\n")
    print("| path | generated tokens | median s | best s | tokens/s (median) |")
    print("|---|---:|---:|---:|---:|")
    labels = (("raw", "raw `LLM.generate`"), ("ours", "`VLLMGenerator.generate`"),
              ("task", "Prefect `rollout` task → engine host → Parquet"))
    for name, label in labels:
        r = tp[name]
        print(f"| {label} | {r['tokens']} | {r['seconds']:.3f} | {r['best_seconds']:.3f} | {r['tokens_per_s']:,.0f} |")
    print(f"\nFramework tax (extra time of VLLMGenerator over raw; goal <= 10%): {tp['tax_percent']:+.1f}% on medians, "
          f"{tp['best_tax_percent']:+.1f}% on best runs; tokens/s ratio ours/raw "
          f"{tp['ours']['tokens_per_s'] / tp['raw']['tokens_per_s']:.3f}.\n"
          f"VLLMGenerator's own work per call (requests + Generation building, timed alone): "
          f"{tp['own_ms']:.1f} ms = {tp['own_percent']:.1f}% of the raw call.\n"
          f"The whole rollout task (Prefect task, host channel, engine, Parquet write; samples seeded per step, so "
          f"lengths differ slightly): tokens/s ratio task/raw {tp['task']['tokens_per_s'] / tp['raw']['tokens_per_s']:.3f}.")

    print(f"\n### Weight sync `load_weights(vllm, TorchTrainer.export_weights())` ({args.layers} layers, fp32, "
          f"median of {args.sync_repeats})\n")
    print("| hidden | params | tensors | MB | ms (median) | ms (best) | MB/s (median) |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in sync:
        print(f"| {r['hidden']} | {r['params']:,} | {r['tensors']} | {r['mb']:.1f} | {r['ms']:.1f} | {r['best_ms']:.1f} "
              f"| {r['mb_per_s']:,.0f} |")
    return {"throughput": tp, "weight_sync": sync}


if __name__ == "__main__":
    main()
