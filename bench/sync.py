"""Weight-sync benchmark: trainer → rollout engine in real engine hosts, one DP group of one rank, of
two tensor-parallel ranks and of two pipeline stages, into the torch rollout engine and into vLLM
(in the host's process with one rank; over both ranks, ``rollout.tensor_parallel=2``, with two).

    python -m bench.sync                        # a ~560 MB (fp32) Llama, ~2 min on 2 CPU cores
    python -m bench.sync --hidden 512 --layers 4 --repeats 3

One DP group of ``train.tensor_parallel x train.pipeline_parallel`` Megatron ranks (engine-host
processes, gloo; on a CPU Megatron-Core runs under the tests' shim), the torch rollout engine on
the group's leader (docs/parallelism.md). After setup, ``SyncWeights`` is sent ``--repeats`` times
through the group's client, as the flow sends it: the ranks gather each parameter in turn (TP
shards all-gathered within a stage, the stage's tensor broadcast to the other stages:
``engines/backends/megatron/pipeline.py``; one full Hugging Face-named tensor at a time), the
leader loads them into its rollout engine a bucket at a time (``rollout.sync_bucket_mb``, each
bucket's fingerprint checked on the engine's side: ``engines.backends.base.load_weights``), the
other ranks drop theirs. vLLM out of the host's process takes each bucket as a file in /dev/shm.

- **sync s**: the host's time for the command (the slowest rank's), median.
- **peak MB**: each rank's resident memory while the sync runs (sampled every 20 ms) above what
  it held just before: what the sync itself costs in memory, the trainer's side and, in the same
  process, a torch or in-process vLLM rollout engine's; "+ N": the rollout side when vLLM runs in
  processes of its own (its engine and workers, children of the leader). A sync that gathered the
  whole model in one place would show the model's size here; buckets show a few buckets.
- **first sync's lasting MB**: a first sync, not timed, after which the leader holds about the
  model's size more for good: the rollout engine's weights, loaded as a memory map of the
  policy's file, become its own pages as they are written (once per run, not per sync).

The baseline is the group of one rank, measured in the same run. Prints a markdown table and returns the figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _policy(folder: Path, hidden: int, layers: int) -> tuple[str, int]:
    """A random Llama of the given size with the char tokenizer; its folder and bytes (fp32)."""
    from engines.demo.tiny import build_char_tokenizer, build_tiny_llama

    tokenizer = build_char_tokenizer()
    model = build_tiny_llama(len(tokenizer), hidden_size=hidden, num_layers=layers, num_heads=hidden // 64,
                             num_kv_heads=hidden // 128, seed=0)
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return str(folder), sum(p.numel() * p.element_size() for p in model.parameters())


def _rss(pid: int) -> tuple[int, int]:
    """Resident bytes of an engine host and of its child processes (an out-of-process vLLM's)."""
    import psutil

    try:
        process = psutil.Process(pid)
        return process.memory_info().rss, sum(p.memory_info().rss for p in process.children(recursive=True))
    except psutil.NoSuchProcess:
        return 0, 0


# name: (train.tensor_parallel, train.pipeline_parallel, rollout.backend, rollout.tensor_parallel)
LAYOUTS = {"TP=1": (1, 1, "torch", 1), "TP=2": (2, 1, "torch", 1), "PP=2": (1, 2, "torch", 1),
           "TP=1 vLLM": (1, 1, "vllm", 1), "TP=2 vLLM-TP=2": (2, 1, "vllm", 2)}


def _hash_seconds(folder: str) -> float:
    """What the sync's check costs one side: ``fingerprint`` of the whole model, once, in this process."""
    from safetensors.torch import load_file

    from engines.backends.base import fingerprint

    tensors = load_file(os.path.join(folder, "model.safetensors"))
    start = time.perf_counter()
    fingerprint(tensors.items())
    return time.perf_counter() - start


def measure(root: Path, tp: int, pp: int, rollout: str, rollout_tp: int, repeats: int, bucket_mb: float) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    import pyarrow as pa

    from engines.config import load_config
    from engines.wire.channel import client
    from engines.wire.commands import SetupEngines, SyncWeights
    from engines.wire.launch import LocalHosts
    from storage import datasets

    prompts = root / "data" / "train" / "part-00000.parquet"
    if not prompts.exists():
        datasets.write_table(str(prompts), pa.table({"prompt_id": [0, 1], "prompt": ["1+1=", "2+2="], "answer": ["2", "4"]}),
                             datasets.PROMPTS)
    run = f"bench-sync-tp{tp}-pp{pp}-{rollout}{rollout_tp}"
    config = load_config(None, [f"name={run}", "dp=1", f"storage.root={root}", "model.policy=models/policy",
                                "data.prompts=data/train", "data.heldout=null", "reward.genrm_weight=0",
                                "reward.rule=engines.demo.arithmetic:exact_match", "reward.rule_weight=1", "host_timeout_s=1200",
                                "train.backend=megatron", f"train.tensor_parallel={tp}",
                                f"train.pipeline_parallel={pp}", f"rollout.backend={rollout}",
                                f"rollout.tensor_parallel={rollout_tp}", f"rollout.sync_bucket_mb={bucket_mb}"])
    seconds, peaks = [], []
    with LocalHosts(run, config.layout, 1, config.host_timeout_s) as hosts:
        group = client(run, 0)
        with ThreadPoolExecutor(1) as pool:
            pool.submit(group.call, SetupEngines(config=config, master=hosts.master)).result()
        pids = [h.proc.pid for h in hosts.hosts]
        # not measured: the first sync makes the rollout engine's weights resident and private (they
        # were loaded as a memory map of the policy's safetensors file): the model's size, once
        warmup = [sum(_rss(pid)) for pid in pids]
        group.call(SyncWeights())
        first = [(sum(_rss(pid)) - b) / 2**20 for pid, b in zip(pids, warmup)]
        for _ in range(repeats):
            before = [_rss(pid) for pid in pids]
            peak = [list(b) for b in before]  # per rank: the host, its child processes
            done = threading.Event()

            def sample():
                while not done.is_set():
                    for i, pid in enumerate(pids):
                        peak[i] = [max(p, now) for p, now in zip(peak[i], _rss(pid))]
                    time.sleep(0.02)

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            result, _ = group.call(SyncWeights())
            done.set()
            sampler.join()
            seconds.append(result.host_s)
            peaks.append([[(p - b) / 2**20 for p, b in zip(ps, bs)] for ps, bs in zip(peak, before)])
    return {"tp": tp, "pp": pp, "rollout": rollout, "rollout_tp": rollout_tp, "sync_s": statistics.median(seconds),
            "tensors": result.tensors, "first_mb": first,
            "peak_mb": [[max(run[i][side] for run in peaks) for side in range(2)] for i in range(len(pids))]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bucket-mb", type=float, default=64, help="rollout.sync_bucket_mb")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"a comma-separated subset of {', '.join(LAYOUTS)}")
    args = parser.parse_args(argv)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "tests" / "megatron_cpu_site"), str(ROOT),
                                                              os.environ.get("PYTHONPATH")]))  # Megatron on a CPU: the shim
    with tempfile.TemporaryDirectory(prefix="yattflow-bench-sync-") as tmp:
        root = Path(tmp)
        folder, size = _policy(root / "models" / "policy", args.hidden, args.layers)
        hash_s = _hash_seconds(folder)
        figures = {name: measure(root, *LAYOUTS[name], repeats=args.repeats, bucket_mb=args.bucket_mb)
                   for name in args.layouts.split(",")}
    base_name = "TP=1" if "TP=1" in figures else next(iter(figures))
    base = figures[base_name]
    print(f"\nweight sync, one DP group, policy {size / 2**20:.0f} MB fp32 ({base['tensors']} tensors), "
          f"{args.bucket_mb:g} MB buckets, median of {args.repeats}; the check hashes the model in {hash_s:.3f} s "
          "on each side (one core)")
    print(f"| layout | sync s | vs {base_name} | peak MB above before, per rank (+ its vLLM processes) | "
          "first sync's lasting MB, per rank |")
    print("| --- | ---: | ---: | --- | --- |")
    for name, f in figures.items():
        own_processes = f["rollout"] == "vllm" and f["tp"] * f["pp"] * f["rollout_tp"] > 1  # vLLM out of the host
        ranks = ", ".join(f"{host:.0f}" + (f" + {kids:.0f}" if own_processes and i == 0 else "")
                          for i, (host, kids) in enumerate(f["peak_mb"]))
        first = ", ".join(f"{mb:.0f}" for mb in f["first_mb"])
        print(f"| {name} | {f['sync_s']:.3f} | {f['sync_s'] / base['sync_s']:.2f}x | {ranks} | {first} |")
    rows = [{"figure": f"sync s, {name} vs {base_name}", "yattflow": f["sync_s"], "baseline": base["sync_s"],
             "ratio": f["sync_s"] / base["sync_s"]} for name, f in figures.items() if name != base_name]
    return {"model_mb": size / 2**20, "hash_s": hash_s, "figures": figures, "rows": rows}


if __name__ == "__main__":
    main()
