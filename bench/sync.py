"""Weight-sync benchmark: trainer → rollout engine in real engine hosts, one DP group of one rank, of
two tensor-parallel ranks and of two pipeline stages, into the torch rollout engine and into vLLM
(in the host's process with one rank; over both ranks, ``rollout.tensor_parallel=2``, with two);
each unchecked, checked as before issue 67 (SHA-256 on the host) and checked now (a digest on the
device); and the DP replica check's share of a train step, before and after.

    python -m bench.sync                        # a 720 MB (fp32) Llama, ~25 min on 2 CPU cores
    python -m bench.sync --hidden 512 --layers 4 --repeats 3
    python -m bench.sync --parts replicas       # the replica check only

One DP group of ``train.tensor_parallel x train.pipeline_parallel`` Megatron ranks (engine-host
processes, gloo; on a CPU Megatron-Core runs under the tests' shim), the torch rollout engine on
the group's leader (docs/parallelism.md). After setup, ``SyncWeights`` is sent ``--repeats`` times
through the group's client, as the flow sends it: the ranks gather each parameter in turn (TP
shards all-gathered within a stage, the stage's tensor broadcast to the other stages:
``engines/backends/megatron/pipeline.py``; one full Hugging Face-named tensor at a time), the
leader loads them into its rollout engine a bucket at a time (``rollout.sync_bucket_mb``, each
bucket's fingerprint checked on the engine's side: ``engines.backends.base.load_weights``), the
other ranks drop theirs. vLLM out of the host's process takes each bucket as a file in /dev/shm.
Each layout runs once per ``--checks`` (``YATTFLOW_SYNC_CHECK``, which the hosts and vLLM's
workers inherit: ``off``, ``device`` the default, ``sha256`` the check before issue 67), hosts
started afresh for each.

- **sync s**: the host's time for the command (the slowest rank's), median.
- **peak MB**: each rank's resident memory while the sync runs (sampled every 20 ms) above what
  it held just before: what the sync itself costs in memory, the trainer's side and, in the same
  process, a torch or in-process vLLM rollout engine's; "+ N": the rollout side when vLLM runs in
  processes of its own (its engine and workers, children of the leader). A sync that gathered the
  whole model in one place would show the model's size here; buckets show a few buckets.
- **first sync's lasting MB**: a first sync, not timed, after which the leader holds about the
  model's size more for good: the rollout engine's weights, loaded as a memory map of the
  policy's file, become its own pages as they are written (once per run, not per sync).

**The replica check** (``--parts replicas``): two gloo processes, two DP replicas of the torch
trainer on the same policy, each stepping on its own batch (``--replica-sequences`` sequences of
``--replica-tokens`` tokens); after each step, timed apart, the check a train step does now
(``engines/host/replica_check.py``: each rank digests what it holds, one integer all-gathered)
and the one it did before (``sha256_fingerprint(export_weights())`` on every rank). Median of
``--replica-steps`` after a first step, the slower rank's.

Prints markdown tables and returns the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
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


def _cpu_seconds(pids: list[int]) -> float:
    """CPU time (user + system) the engine hosts and their live child processes (vLLM's) have used:
    a sync's CPU seconds are less at the mercy of other processes on a shared machine than its wall time."""
    import psutil

    total = 0.0
    for pid in pids:
        try:
            process = psutil.Process(pid)
            for p in [process, *process.children(recursive=True)]:
                times = p.cpu_times()
                total += times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return total


# name: (train.tensor_parallel, train.pipeline_parallel, rollout.backend, rollout.tensor_parallel)
LAYOUTS = {"TP=1": (1, 1, "torch", 1), "TP=2": (2, 1, "torch", 1), "PP=2": (1, 2, "torch", 1),
           "TP=1 vLLM": (1, 1, "vllm", 1), "TP=2 vLLM-TP=2": (2, 1, "vllm", 2)}


@contextlib.contextmanager
def _environ(name: str, value: str):
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        os.environ.pop(name) if before is None else os.environ.__setitem__(name, before)


def _hash_seconds(folder: str, repeats: int = 3) -> dict[str, float]:
    """What one side of a sync's check costs: each fingerprint of the whole model, once, in this
    process on one thread (as the benchmark's engine hosts run), median of ``repeats`` (the tensors
    read into memory first)."""
    import torch
    from safetensors.torch import load_file

    from engines.backends.digest import fingerprint, sha256_fingerprint

    tensors = {name: t.clone() for name, t in load_file(os.path.join(folder, "model.safetensors")).items()}
    seconds: dict[str, list[float]] = {"device": [], "sha256": []}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(repeats):
            for name, function in (("device", fingerprint), ("sha256", sha256_fingerprint)):
                start = time.perf_counter()
                function(tensors.items())
                seconds[name].append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return {name: statistics.median(s) for name, s in seconds.items()}


def measure(root: Path, tp: int, pp: int, rollout: str, rollout_tp: int, repeats: int, bucket_mb: float, check: str) -> dict:
    """One layout's syncs with ``check`` (``YATTFLOW_SYNC_CHECK``), in engine hosts started for it."""
    from concurrent.futures import ThreadPoolExecutor

    from engines.backends.digest import SYNC_CHECK

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
    run = f"bench-sync-tp{tp}-pp{pp}-{rollout}{rollout_tp}-{check}"
    config = load_config(None, [f"name={run}", "dp=1", f"storage.root={root}", "model.policy=models/policy",
                                "data.prompts=data/train", "data.heldout=null", "reward.genrm_weight=0",
                                "reward.rule=engines.demo.arithmetic:exact_match", "reward.rule_weight=1", "host_timeout_s=1200",
                                "train.backend=megatron", f"train.tensor_parallel={tp}",
                                f"train.pipeline_parallel={pp}", f"rollout.backend={rollout}",
                                f"rollout.tensor_parallel={rollout_tp}", f"rollout.sync_bucket_mb={bucket_mb}"])
    seconds, cpu_seconds, peaks = [], [], []
    # the hosts (and their vLLM processes) inherit the check
    with _environ(SYNC_CHECK, check), LocalHosts(run, config.layout, 1, config.host_timeout_s) as hosts:
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
            cpu = _cpu_seconds(pids)
            result, _ = group.call(SyncWeights())
            cpu_seconds.append(_cpu_seconds(pids) - cpu)
            done.set()
            sampler.join()
            seconds.append(result.host_s)
            peaks.append([[(p - b) / 2**20 for p, b in zip(ps, bs)] for ps, bs in zip(peak, before)])
    return {"tp": tp, "pp": pp, "rollout": rollout, "rollout_tp": rollout_tp, "check": check, "sync_s": statistics.median(seconds),
            "sync_all_s": seconds, "cpu_s": statistics.median(cpu_seconds), "cpu_all_s": cpu_seconds,
            "tensors": result.tensors, "first_mb": first,
            "peak_mb": [[max(run[i][side] for run in peaks) for side in range(2)] for i in range(len(pids))]}


def _replica_worker(rank: int, port: int, folder: str, out: str, steps: int, sequences: int, tokens: int, tp: int) -> None:
    """One rank of two DP replicas (gloo), each of ``tp`` Megatron TP ranks, or a torch trainer (``tp``
    0): a step on its replica's batch, then each check, timed apart (barriers between, so that every
    rank starts each together)."""
    import torch
    import torch.distributed as dist

    from engines.backends.base import TrainBatch
    from engines.backends.digest import sha256_fingerprint
    from engines.backends.torch.trainer import TorchTrainer
    from engines.config.layout import Layout
    from engines.host import replica_check

    torch.set_num_threads(1)  # a core each at most
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    size = max(tp, 1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2 * size)
    try:
        if tp:
            from engines.backends.megatron.trainer import MegatronTrainer

            trainer = MegatronTrainer(folder, lr=1e-6, tensor_parallel=tp)
        else:
            trainer = TorchTrainer(folder, lr=1e-6)
        g = torch.Generator().manual_seed(rank // size)  # a replica's ranks share its batch
        vocab = len(trainer.tokenizer)
        ids = lambda n: torch.randint(4, vocab, (n,), generator=g).tolist()  # noqa: E731
        prompt = tokens // 4
        batch = TrainBatch([ids(prompt) for _ in range(sequences)], [ids(tokens - prompt) for _ in range(sequences)],
                           [[0.0] * (tokens - prompt)] * sequences, torch.randn(sequences, generator=g).tolist())
        batch.old_logprobs = trainer.logprobs(batch)
        figures: dict[str, list[float]] = {"step_s": [], "check_s": [], "before_s": []}
        for step in range(steps + 1):  # the first: warm-up (Adam's state allocated)
            timed = {}
            dist.barrier()
            start = time.perf_counter()
            trainer.train_step(batch)
            timed["step_s"] = time.perf_counter() - start
            dist.barrier()
            start = time.perf_counter()
            replica_check.check(trainer.local_parameters(), Layout(dp=2, tp=size), rank)  # the train step's check now
            timed["check_s"] = time.perf_counter() - start
            dist.barrier()
            start = time.perf_counter()
            sha256_fingerprint(trainer.export_weights())  # the check before issue 67 (the controller compared them)
            timed["before_s"] = time.perf_counter() - start
            for key, value in timed.items():
                figures[key] += [value] if step else []
        Path(out, f"replicas-{rank}.json").write_text(json.dumps(figures))
    finally:
        if tp:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def replica_figures(folder: str, steps: int, sequences: int, tokens: int, tp: int = 0) -> dict:
    """The replica check against the one before it, two replicas of the policy in ``folder``: torch
    trainers (``tp`` 0), or Megatron trainers of ``tp`` TP ranks each."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="yattflow-bench-replicas-") as out:
        world = 2 * max(tp, 1)
        mp.spawn(_replica_worker, args=(port, folder, out, steps, sequences, tokens, tp), nprocs=world, join=True)
        ranks = [json.loads(Path(out, f"replicas-{r}.json").read_text()) for r in range(world)]
    slowest = {key: [max(values) for values in zip(*(r[key] for r in ranks))] for key in ranks[0]}
    return {key: statistics.median(values) for key, values in slowest.items()} | {"all": slowest}


def _pooled(measured: list[dict]) -> dict:
    """One layout and check's rounds as one: medians over all their syncs, the largest peaks."""
    out = dict(measured[-1])
    for key in ("sync", "cpu"):
        out[f"{key}_all_s"] = [x for m in measured for x in m[f"{key}_all_s"]]
        out[f"{key}_s"] = statistics.median(out[f"{key}_all_s"])
    out["peak_mb"] = [[max(m["peak_mb"][i][side] for m in measured) for side in range(2)] for i in range(len(out["peak_mb"]))]
    return out


def main(argv: list[str] | None = None) -> dict:
    from engines.backends.digest import SYNC_CHECKS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bucket-mb", type=float, default=64, help="rollout.sync_bucket_mb")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"a comma-separated subset of {', '.join(LAYOUTS)}")
    parser.add_argument("--rounds", type=int, default=1, help="each layout's checks this many times over, hosts afresh")
    parser.add_argument("--checks", default="off,device,sha256", help=f"YATTFLOW_SYNC_CHECK values to time: {', '.join(SYNC_CHECKS)}")
    parser.add_argument("--parts", default="sync,replicas", help="sync (the weight sync), replicas (the replica check)")
    parser.add_argument("--replica-steps", type=int, default=3)
    parser.add_argument("--replica-sequences", type=int, default=8, help="sequences per replica and step")
    parser.add_argument("--replica-tokens", type=int, default=64, help="tokens per sequence (a quarter of them prompt)")
    parser.add_argument("--replica-tp", type=int, default=0,
                        help="the replicas as Megatron trainers of this many TP ranks each (0: torch trainers, one rank each)")
    args = parser.parse_args(argv)
    parts, checks = args.parts.split(","), args.checks.split(",")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "tests" / "megatron_cpu_site"), str(ROOT),
                                                              os.environ.get("PYTHONPATH")]))  # Megatron on a CPU: the shim
    figures: dict[str, dict[str, dict]] = {}
    replicas = None
    with tempfile.TemporaryDirectory(prefix="yattflow-bench-sync-") as tmp:
        root = Path(tmp)
        folder, size = _policy(root / "models" / "policy", args.hidden, args.layers)
        hash_s = _hash_seconds(folder)
        if "sync" in parts:
            for name in args.layouts.split(","):
                runs: dict[str, list[dict]] = {check: [] for check in checks}
                for r in range(args.rounds):  # each round the checks in another order, hosts afresh for each
                    for check in checks[r % len(checks):] + checks[: r % len(checks)]:
                        runs[check].append(measure(root, *LAYOUTS[name], repeats=args.repeats, bucket_mb=args.bucket_mb,
                                                   check=check))
                figures[name] = {check: _pooled(measured) for check, measured in runs.items()}
        if "replicas" in parts:
            replicas = replica_figures(folder, args.replica_steps, args.replica_sequences, args.replica_tokens, args.replica_tp)
    print(f"\npolicy {size / 2**20:.0f} MB fp32; one side of a sync's check over the whole model, one thread: "
          f"the device digest {hash_s['device']:.3f} s, SHA-256 {hash_s['sha256']:.3f} s")
    rows = []
    if figures:
        first = next(iter(figures.values()))
        mode = "device" if "device" in first else next(iter(first))
        tensors = first[mode]["tensors"]
        print(f"\nweight sync, one DP group, {tensors} tensors, {args.bucket_mb:g} MB buckets, median of {args.repeats} x "
              f"{args.rounds} round(s); each check on both sides (YATTFLOW_SYNC_CHECK); wall s (CPU s of the group's processes)")
        title = {"off": "unchecked", "device": "device digest (now)", "sha256": "SHA-256 (before)"}
        ratios = [c for c in checks if c != "off"] if "off" in checks else []
        print("| layout | " + " | ".join(f"{title[c]} s" for c in checks) + "".join(f" | {title[c]} / unchecked" for c in ratios)
              + f" | peak MB above before, per rank (+ its vLLM processes), {mode} | first sync's lasting MB, per rank |")
        print("| --- |" + " ---: |" * (len(checks) + len(ratios)) + " --- | --- |")
        for name, by_check in figures.items():
            f = by_check[mode]
            own_processes = f["rollout"] == "vllm" and f["tp"] * f["pp"] * f["rollout_tp"] > 1  # vLLM out of the host
            ranks = ", ".join(f"{host:.0f}" + (f" + {kids:.0f}" if own_processes and i == 0 else "")
                              for i, (host, kids) in enumerate(f["peak_mb"]))
            first_mb = ", ".join(f"{mb:.0f}" for mb in f["first_mb"])
            cells = [f"{by_check[c]['sync_s']:.3f} ({by_check[c]['cpu_s']:.3f})" for c in checks]
            ratio = lambda c, key: (f"{by_check[c][key] / by_check['off'][key]:.2f}x"  # noqa: E731
                                    if by_check["off"][key] else "-")  # CPU time ticks in 10 ms: a tiny model's may be 0
            cells += [f"{ratio(c, 'sync_s')} ({ratio(c, 'cpu_s')})" for c in ratios]
            print(f"| {name} | {' | '.join(cells)} | {ranks} | {first_mb} |")
            rows += [{"figure": f"sync s, {name}: {title[c]} check vs unchecked", "yattflow": by_check[c]["sync_s"],
                      "baseline": by_check["off"]["sync_s"], "ratio": by_check[c]["sync_s"] / by_check["off"]["sync_s"]}
                     for c in ratios]
    if replicas is not None:
        step = replicas["step_s"]
        trainers = (f"Megatron trainers of TP={args.replica_tp}, dp=2 ({2 * args.replica_tp} gloo processes)" if args.replica_tp
                    else "torch trainers, dp=2 (two gloo processes)")
        print(f"\nreplica check after a train step: {trainers}, one thread each, {args.replica_sequences} sequences x "
              f"{args.replica_tokens} tokens per replica, median of {args.replica_steps}, the slowest rank's")
        print("| check | s | share of the step (step + check) |")
        print("| --- | ---: | ---: |")
        print(f"| the train step itself | {step:.3f} | |")
        for key, label in (("check_s", "replica check: each rank's digest, one integer all-gathered (now)"),
                           ("before_s", "SHA-256 of export_weights() on every rank (before)")):
            print(f"| {label} | {replicas[key]:.3f} | {100 * replicas[key] / (step + replicas[key]):.2f}% |")
        rows.append({"figure": "replica check s: device digests vs SHA-256 of the exported model", "yattflow": replicas["check_s"],
                     "baseline": replicas["before_s"], "ratio": replicas["check_s"] / replicas["before_s"]})
    return {"model_mb": size / 2**20, "hash_s": hash_s, "figures": figures, "replicas": replicas, "rows": rows}


if __name__ == "__main__":
    main()
