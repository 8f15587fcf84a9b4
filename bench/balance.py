"""DP load balancing: the slowest DP group's train-step time over the mean, balanced vs
unbalanced, with skewed lengths (one group's responses long, the other's short).

    python -m bench.balance                  # ~1 min on 2 CPU cores
    python -m bench.balance --repeats 20 --hidden 256

Two gloo processes (``torch.multiprocessing``, one torch thread each) are the two DP ranks.
``unbalanced`` gives rank 0 the long sequences and rank 1 the short ones (as their own
experience files would); ``balanced`` gives each rank its rows of the plan the engine hosts
compute (``engines/host/balance.py``: Karmarkar–Karp per global minibatch). Per repeat and mode:

- *at once*: one real data-parallel ``train_step`` on both ranks after a ``dist.barrier``.
  A rank's *busy* time is its step time minus the time it spent inside ``all_reduce`` (every
  collective of the step: token count, gradient sum, loss sum): the work it does itself. A
  rank that finishes early waits in the next all-reduce, so the step's *wall* time is the
  slowest rank's.
- *alone*: the same step without collectives, one rank at a time while the other waits at a
  barrier: each rank's work as if it had its own device. On a 2-core machine shared with
  other work the *at once* figures include the ranks competing for cores; *alone* does not.

``slowest / mean`` is taken per repeat over the ranks, then the median over repeats (modes
alternate within a repeat, after a warm-up).

With ``train.micro_batch_tokens`` unset (None) the trainer pads each minibatch to its longest
sequence, so a rank's cost follows rows x longest row, not tokens: mixing long and short rows
on every rank equalises the ranks but makes none faster. The second table runs the same steps
with ``micro_batch_tokens=--budget``: each minibatch's forward/backward in length-sorted passes
(``engines.backends.torch.trainer.micro_batches``: fewest passes within the budget, least padding among
those) — the same update (global loss weights, gradients accumulate before the one
all-reduce), a cost that follows tokens — to show what balancing gains then. The budget stands
for "where one pass saturates the device"; a minibatch that fits in one pass is not split (here:
8 rows x ~130 tokens, so a budget of 1024 or more leaves the balanced minibatches whole).

``main(argv)`` returns the figures (a dict) and prints markdown tables.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one thread per engine process

MODES = ("balanced", "unbalanced")
VARIANTS = ("padded", "micro")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=16, help="sequences per rank")
    p.add_argument("--long", default="96,128", help="response length range of rank 0 (min,max)")
    p.add_argument("--short", default="4,16", help="response length range of rank 1 (min,max)")
    p.add_argument("--minibatches", type=int, default=2, help="optimizer steps per train step (train.minibatches)")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--budget", type=int, default=512, help="micro_batch_tokens of the micro-batched table (padded tokens per pass)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def build_model(path: str, hidden: int, layers: int, max_positions: int) -> None:
    from engines.demo.tiny import build_char_tokenizer, build_tiny_llama

    tokenizer = build_char_tokenizer()
    heads = max(1, hidden // 32)
    model = build_tiny_llama(len(tokenizer), hidden_size=hidden, num_layers=layers, num_heads=heads,
                             num_kv_heads=max(1, heads // 2), max_positions=max_positions, seed=0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def make_data(args) -> list:
    """Both ranks' experience (the same on every process): rank 0 long responses, rank 1 short."""
    from engines.backends.base import TrainBatch

    rng = random.Random(args.seed)
    batches = []
    for lo, hi in (map(int, args.long.split(",")), map(int, args.short.split(","))):
        prompts = [[1] + [rng.randrange(4, 40) for _ in range(rng.randint(3, 8))] for _ in range(args.rows)]
        responses = [[rng.randrange(4, 40) for _ in range(rng.randint(lo, hi) - 1)] + [2] for _ in range(args.rows)]
        old = [[-3.0 + rng.uniform(-0.3, 0.3) for _ in r] for r in responses]
        batches.append(TrainBatch(prompts, responses, old, [rng.uniform(-1.5, 1.5) for _ in responses]))
    return batches


def rank_batch(batches, rank: int, layout):
    """This rank's batch: its own rows (unbalanced), or its rows of the plan (balanced)."""
    from engines.host import balance
    from engines.backends.base import TrainBatch

    if layout is None:
        return batches[rank]
    fields = ("prompt_ids", "response_ids", "old_logprobs", "advantages")
    return balance.presplit([TrainBatch(*([getattr(batches[s], f)[i] for s, i in mb] for f in fields)) for mb in layout[rank]])


def passes(batch, minibatches: int, budget: int | None) -> int:
    """Forward/backward passes the trainer runs."""
    from engines.backends.batching import micro_batches

    return sum(len(micro_batches(part, budget)) for part in batch.split(minibatches))


def padded_tokens(batch, minibatches: int, budget: int | None) -> int:
    """Tokens the trainer's forward passes compute, padding included."""
    from engines.backends.batching import micro_batches

    return sum(len(m) * max(len(a) + len(b) for a, b in zip(m.prompt_ids, m.response_ids))
               for part in batch.split(minibatches) for m in micro_batches(part, budget))


def worker(rank: int, world: int, port: int, args, model_dir: str, out: str) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from engines.host import balance
    from engines.backends.torch.trainer import TorchTrainer

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))

    inside = [0.0]  # seconds spent in all_reduce (waiting for the other rank + the reduction)
    all_reduce = dist.all_reduce

    def timed_all_reduce(*a, **kw):
        t0 = time.perf_counter()
        try:
            return all_reduce(*a, **kw)
        finally:
            inside[0] += time.perf_counter() - t0

    dist.all_reduce = timed_all_reduce  # the trainers call dist.all_reduce through the module
    try:
        batches = make_data(args)
        tokens = [[len(p) + len(r) for p, r in zip(b.prompt_ids, b.response_ids)] for b in batches]
        layouts = {"unbalanced": None, "balanced": balance.plan(tokens, args.minibatches)}
        mine = {m: rank_batch(batches, rank, layouts[m]) for m in MODES}
        budgets = {"padded": None, "micro": args.budget}  # train.micro_batch_tokens
        result = {"tokens": {m: sum(len(p) + len(r) for p, r in zip(b.prompt_ids, b.response_ids)) for m, b in mine.items()},
                  "padded_tokens": {}, "passes": {}, "runs": {}, "params_diff": {}}
        solo = type("SoloTorchTrainer", (TorchTrainer,), {"distributed": property(lambda self: False)})
        for variant in VARIANTS:
            step_kwargs = {"minibatches": args.minibatches, "micro_batch_tokens": budgets[variant]}
            trainers = {m: TorchTrainer(model_dir, lr=1e-3) for m in MODES}
            alone = {m: solo(model_dir, lr=1e-3) for m in MODES}  # no collectives: this rank's work as if it had the machine to itself
            result["padded_tokens"][variant] = {m: padded_tokens(mine[m], args.minibatches, budgets[variant]) for m in MODES}
            result["passes"][variant] = {m: passes(mine[m], args.minibatches, budgets[variant]) for m in MODES}
            for rep in range(args.warmup + args.repeats):
                for m in (MODES if rep % 2 else MODES[::-1]):
                    dist.barrier()
                    inside[0] = 0.0
                    t0 = time.perf_counter()
                    trainers[m].train_step(mine[m], **step_kwargs)
                    wall = time.perf_counter() - t0
                    record = {"wall": wall, "busy": wall - inside[0]}
                    for turn in range(world):  # then each rank alone, the other one idle at the barrier
                        dist.barrier()
                        if turn == rank:
                            t0 = time.perf_counter()
                            alone[m].train_step(mine[m], **step_kwargs)
                            record["alone"] = time.perf_counter() - t0
                    if rep >= args.warmup:
                        result["runs"].setdefault(f"{variant}/{m}", []).append(record)
                if rep == 0:  # after one step from the same weights: the same update either way?
                    a, b = (dict(trainers[m].model.named_parameters()) for m in MODES)
                    result["params_diff"][variant] = max((a[k] - b[k]).abs().max().item() for k in a)
        gathered = [None] * world
        dist.all_gather_object(gathered, result)
        if rank == 0:
            Path(out).write_text(json.dumps(gathered))
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def summarise(ranks: list[dict], variant: str, mode: str) -> dict:
    runs = [r["runs"][f"{variant}/{mode}"] for r in ranks]
    repeats = range(len(runs[0]))
    out = {"wall_s": statistics.median(max(run[i]["wall"] for run in runs) for i in repeats),
           "tokens": [r["tokens"][mode] for r in ranks], "padded_tokens": [r["padded_tokens"][variant][mode] for r in ranks],
           "passes": [r["passes"][variant][mode] for r in ranks]}
    for key in ("busy", "alone"):
        per_repeat = [[run[i][key] for run in runs] for i in repeats]
        out[key] = {
            "slowest_over_mean": statistics.median(max(t) / (sum(t) / len(t)) for t in per_repeat),
            "slowest_s": statistics.median(max(t) for t in per_repeat),
            "per_rank_s": [statistics.median(t[r] for t in per_repeat) for r in range(len(ranks))],
        }
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch.multiprocessing as mp

    from engines.host.balance import imbalance

    start = time.perf_counter()
    longest = max(int(x) for x in args.long.split(",") + args.short.split(",")) + 16
    with tempfile.TemporaryDirectory() as tmp:
        build_model(f"{tmp}/model", args.hidden, args.layers, max_positions=longest)
        out = f"{tmp}/result.json"
        mp.spawn(worker, args=(2, free_port(), args, f"{tmp}/model", out), nprocs=2, join=True)
        ranks = json.loads(Path(out).read_text())

    figures = {v: {m: summarise(ranks, v, m) for m in MODES} for v in VARIANTS}
    figures["params_diff"] = ranks[0]["params_diff"]
    titles = {
        "padded": "`TorchTrainer.train_step`, `micro_batch_tokens=None` (one pass per minibatch, padded to its longest sequence)",
        "micro": f"`TorchTrainer.train_step`, `micro_batch_tokens={args.budget}` (length-sorted passes of <= {args.budget} padded tokens)",
    }
    for v in VARIANTS:
        b, u = figures[v]["balanced"], figures[v]["unbalanced"]
        print(f"\n### DP balance, 2 ranks, {titles[v]}\n")
        print(f"{args.rows} sequences per rank, responses {args.long} tokens on rank 0 and {args.short} on rank 1; "
              f"{args.minibatches} minibatches; hidden {args.hidden}, {args.layers} layers, fp32, 1 thread per rank; "
              f"median of {args.repeats} after {args.warmup} warm-up.\n")
        print("| figure | balanced | unbalanced | ratio |")
        print("|---|---:|---:|---:|")
        rows = [
            ("slowest / mean busy time, 2 gloo ranks at once (goal <= 1.05 balanced)", b["busy"]["slowest_over_mean"], u["busy"]["slowest_over_mean"]),
            ("slowest rank's busy time, 2 gloo ranks at once, s", b["busy"]["slowest_s"], u["busy"]["slowest_s"]),
            ("train step wall time, 2 gloo ranks at once, s", b["wall_s"], u["wall_s"]),
            ("slowest / mean time, each rank alone", b["alone"]["slowest_over_mean"], u["alone"]["slowest_over_mean"]),
            ("slowest rank's time, each rank alone, s", b["alone"]["slowest_s"], u["alone"]["slowest_s"]),
            ("token balance max / mean (prompt + response)", imbalance(b["tokens"]), imbalance(u["tokens"])),
            ("computed-token balance max / mean (padding included)", imbalance(b["padded_tokens"]), imbalance(u["padded_tokens"])),
        ]
        for label, x, y in rows:
            print(f"| {label} | {x:.3f} | {y:.3f} | {x / y:.3f} |")
        for label, bx, ux in (("busy time per rank (at once), s", b["busy"]["per_rank_s"], u["busy"]["per_rank_s"]),
                              ("time per rank (alone), s", b["alone"]["per_rank_s"], u["alone"]["per_rank_s"]),
                              ("tokens per rank", b["tokens"], u["tokens"]),
                              ("computed tokens per rank (padding included)", b["padded_tokens"], u["padded_tokens"]),
                              ("forward/backward passes per rank", b["passes"], u["passes"])):
            fmt = "{:.3f}" if isinstance(bx[0], float) else "{}"
            print(f"| {label} | {' / '.join(fmt.format(x) for x in bx)} | {' / '.join(fmt.format(x) for x in ux)} | "
                  f"{sum(bx) / sum(ux):.3f} (sum) |")
        print(f"\nmax |parameter difference| balanced vs unbalanced after one step from the same weights: "
              f"{figures['params_diff'][v]:.1e}")
    figures["total_s"] = time.perf_counter() - start
    print(f"\n(total {figures['total_s']:.0f}s)")
    return figures


if __name__ == "__main__":
    main()
