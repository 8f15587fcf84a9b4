"""Trainer memory with and without LoRA (``train.lora``) on one model.

    python -m bench.lora_memory                               # ~2 min on 2 CPU cores
    python -m bench.lora_memory --hidden 512 --layers 4       # smaller, quicker

A Qwen3 of ``engines/demo/tiny_hub.py`` (hidden 1024, 12 layers, 16 query / 4 key-value heads,
MLP 3072, tied embeddings of a 512-token vocabulary: 0.14B parameters, fp32) is written to a
temporary folder; then, each mode in a fresh process of its own (so that its peak RSS is its own),
a ``TorchTrainer`` loads it and takes two train steps of ``--sequences`` random sequences of
``--length`` tokens (one pass each, ``minibatches=1``). Modes: full fine-tuning and LoRA (rank 16,
alpha 32, the attention and MLP projections), each without and with a KL reference
(``train.algorithm.kl_coef`` > 0: a second copy of the policy, or with LoRA the policy with its adapter
disabled).

Reported per mode: parameter bytes (all, the reference copy included, and trained), gradient bytes
and AdamW state bytes after the steps (what the trainer keeps between steps), and the process's
peak RSS (``ru_maxrss``: weights, activations, gradients, optimizer state, allocator slack, and
the ~0.35 GB of Python, torch and transformers). The peak comes in the backward pass, when
activations and gradients are both alive (Adam's moments appear after it, once activations are
freed): with many tokens per step, activations dominate it.
Returns the figures from ``main``.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import tempfile
import time

MODES = {"full": (False, False), "full + KL reference": (False, True), "lora": (True, False), "lora + KL reference": (True, True)}


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def one_mode(folder: str, lora: bool, reference: bool, sequences: int, length: int, rank: int) -> dict:
    """In this process: load, two train steps, the figures."""
    import torch

    from engines.backends.base import TrainBatch
    from engines.backends.torch.trainer import TorchTrainer
    from engines.config.train import LoraConfig
    from engines.rl.grpo import GRPOConfig

    torch.set_num_threads(2)
    start = time.perf_counter()
    trainer = TorchTrainer(folder, lr=1e-4, reference=reference,
                           lora=LoraConfig(rank=rank, alpha=2.0 * rank) if lora else None)
    rng = random.Random(0)
    vocab = len(trainer.tokenizer)
    prompts = [[rng.randrange(4, vocab) for _ in range(length // 2)] for _ in range(sequences)]
    responses = [[rng.randrange(4, vocab) for _ in range(length - length // 2)] for _ in range(sequences)]
    batch = TrainBatch(prompts, responses, [[0.0] * len(r) for r in responses], [rng.uniform(-1, 1) for _ in range(sequences)])
    batch = TrainBatch(prompts, responses, trainer.logprobs(batch), batch.advantages)
    for _ in range(2):
        trainer.train_step(batch, GRPOConfig(kl_coef=0.1 if reference else 0.0), minibatches=1, micro_batch_tokens=None)
    params = list(trainer.model.parameters()) + (list(trainer.reference.parameters()) if trainer.reference is not None else [])
    trained = [p for p in trainer.model.parameters() if p.requires_grad]
    state = [t for s in trainer.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return {
        "parameters": sum(p.numel() for p in trainer.model.parameters()), "trained_parameters": sum(p.numel() for p in trained),
        "parameter_mb": tensor_bytes(params) / 2**20, "trained_mb": tensor_bytes(trained) / 2**20,
        "grad_mb": tensor_bytes(p.grad for p in trainer.model.parameters() if p.grad is not None) / 2**20,
        "optimizer_mb": tensor_bytes(state) / 2**20,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "seconds": time.perf_counter() - start,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one mode in this process
    args = parser.parse_args(argv)
    if args.one:
        folder, mode = json.loads(args.one)
        print(json.dumps(one_mode(folder, *MODES[mode], args.sequences, args.length, args.rank)))
        return {}
    from bench import cpu_model
    from engines.demo.tiny_hub import save_tiny_hub_model

    figures = {"cpu": cpu_model(), "hidden": args.hidden, "layers": args.layers, "sequences": args.sequences,
               "length": args.length, "rank": args.rank, "modes": {}}
    with tempfile.TemporaryDirectory() as folder:
        save_tiny_hub_model("qwen3", folder, hidden_size=args.hidden, num_layers=args.layers,
                            num_heads=max(1, args.hidden // 64), num_kv_heads=max(1, args.hidden // 256))
        for mode in MODES:
            out = subprocess.run([sys.executable, "-m", "bench.lora_memory", "--one", json.dumps([folder, mode]),
                                  "--sequences", str(args.sequences), "--length", str(args.length), "--rank", str(args.rank)],
                                 capture_output=True, text=True, check=True)
            figures["modes"][mode] = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"\nTrainer memory, Qwen3 hidden {args.hidden} x {args.layers} layers, {args.sequences} x {args.length} tokens per "
          f"step, fp32, {figures['cpu']}:\n")
    print("| mode | parameters (trained) | weights MB (trained) | gradients MB | AdamW state MB | weights + gradients + AdamW MB "
          "| peak RSS MB |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for mode, f in figures["modes"].items():
        kept = f["parameter_mb"] + f["grad_mb"] + f["optimizer_mb"]
        print(f"| {mode} | {f['parameters'] / 1e6:.1f} M ({f['trained_parameters'] / 1e6:.2f} M) | {f['parameter_mb']:.0f} "
              f"({f['trained_mb']:.1f}) | {f['grad_mb']:.1f} | {f['optimizer_mb']:.1f} | {kept:.0f} | {f['peak_rss_mb']:.0f} |")
    return figures


if __name__ == "__main__":
    main()
