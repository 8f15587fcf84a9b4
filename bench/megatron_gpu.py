"""Train step on one GPU: the Megatron-Core engine beside plain transformers, tokens/s, model
FLOPs utilisation (MFU) and peak memory.

    python -m bench.megatron_gpu                              # 0.44B/seq 1024 and 1.2B/seq 2048, both engines
    python -m bench.megatron_gpu --sizes 1.2b --engines megatron --recompute full
    python -m bench.megatron_gpu --sizes 0.44b --layers 2 --steps 2 --warmup 1   # a quick smoke run

Engines, each through the class a training run uses, on the same randomly initialised
Llama-style model (built locally, saved as a Hugging Face folder; nothing is downloaded):

- ``megatron``: ``MegatronTrainer`` in bf16 (fp32 main copies and Adam state), its core attention
  ``SDPAttention`` (torch's flash / memory-efficient kernels; the local spec's unfused attention
  ran out of memory at 1.2B/seq 2048 on an H100);
- ``transformers``: ``TorchTrainer`` on CUDA — transformers' Llama with SDPA attention, bf16
  autocast over fp32 parameters, fused AdamW: the plain-PyTorch baseline.

Both take the same GRPO ``train_step`` on the same random token batches (one pass per step
unless ``--micro-batch-tokens``). Timing: the median of ``--steps`` steps after ``--warmup``.
MFU counts the standard training FLOPs, 6 x parameters x tokens plus attention (12 x layers x
hidden x sequence per token), against the GPU's dense bf16 peak (``--peak-tflops``; H100 SXM:
989). A run that runs out of memory is reported as such and the next one goes on.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# model shape and step size of each benchmarked size (vocabulary 32000, SwiGLU of 4 x hidden)
SIZES = {
    "0.44b": {"hidden": 1024, "layers": 24, "heads": 16, "kv_heads": 8, "seq": 1024, "batch": 16},
    "1.2b": {"hidden": 2048, "layers": 18, "heads": 16, "kv_heads": 8, "seq": 2048, "batch": 8},
}
ENGINES = ("megatron", "transformers")
SHAPE = ("hidden", "layers", "heads", "kv_heads", "seq", "batch")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated, of {', '.join(SIZES)}")
    p.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated, of {', '.join(ENGINES)}")
    for name in SHAPE:  # override that field of every size
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, dest=name)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--micro-batch-tokens", type=int, default=None, help="train.micro_batch_tokens (None: one pass)")
    p.add_argument("--recompute", choices=("none", "selective", "full"), default="none",
                   help="train.recompute_granularity of the Megatron engine")
    p.add_argument("--sync", action="store_true",
                   help="after the Megatron engine's steps, time a weight sync into a bf16 TorchGenerator and check its fingerprint")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the GPU")
    p.add_argument("--allow-cpu", action="store_true",
                   help="without CUDA, run on the CPU anyway: a smoke test of the benchmark itself (its figures mean "
                   "nothing; the Megatron engine needs tests/megatron_cpu_site on PYTHONPATH)")
    args = p.parse_args(argv)
    args.sizes = args.sizes.split(",")
    args.engines = args.engines.split(",")
    for value, known, what in ((args.sizes, SIZES, "size"), (args.engines, ENGINES, "engine")):
        unknown = set(value) - set(known)
        if unknown:
            p.error(f"unknown {what} {sorted(unknown)}: choose from {list(known)}")
    return args


def _shape(args, size: str) -> dict:
    return {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in SIZES[size].items()}


def _save_model(folder: str, shape: dict, vocab: int) -> int:
    """A random Llama of ``shape`` as a Hugging Face folder (bf16 weights); answers its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from engines.demo.tiny import build_char_tokenizer

    config = LlamaConfig(
        vocab_size=vocab, hidden_size=shape["hidden"], intermediate_size=4 * shape["hidden"],
        num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
        max_position_embeddings=shape["seq"], tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(folder)
    build_char_tokenizer().save_pretrained(folder)
    return params


def _trainer(engine: str, folder: str, args):
    if engine == "megatron":
        from engines.backends.megatron.trainer import MegatronTrainer

        return MegatronTrainer(folder, lr=1e-5, dtype="bfloat16", recompute_granularity=args.recompute)
    from engines.backends.torch.trainer import TorchTrainer

    return TorchTrainer(folder, lr=1e-5, dtype="float32")  # on CUDA: bf16 autocast, SDPA, fused AdamW


def _time_steps(trainer, shape: dict, args) -> float:
    import torch

    from engines.backends.base import TrainBatch

    rng = random.Random(0)
    prompt_len = shape["seq"] // 4

    def batch() -> TrainBatch:
        prompts = [[rng.randrange(3, args.vocab) for _ in range(prompt_len)] for _ in range(shape["batch"])]
        responses = [[rng.randrange(3, args.vocab) for _ in range(shape["seq"] - prompt_len)] for _ in range(shape["batch"])]
        return TrainBatch(prompts, responses, [[-1.0] * len(r) for r in responses], [rng.uniform(-1, 1) for _ in responses])

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    times = []
    for step in range(args.warmup + args.steps):
        b = batch()
        sync()
        start = time.perf_counter()
        trainer.train_step(b, micro_batch_tokens=args.micro_batch_tokens)
        sync()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def sync_into(trainer, generator) -> dict:
    """The weight sync a run does after each step (``Worker.sync_weights``): the trainer's export, by
    Hugging Face name, into the rollout engine ``generator``, timed; then whether the rollout engine
    now holds the trainer's weights bit for bit (``engines.backends.base.fingerprint`` of each side;
    a sleeping trainer's export reads its host copy)."""
    import torch

    from engines.backends.base import fingerprint, load_weights

    sync = torch.cuda.synchronize if trainer.device.type == "cuda" else (lambda: None)
    names = []
    sync()
    start = time.perf_counter()
    tensors = load_weights(generator, ((names.append(n) or n, t) for n, t in trainer.export_weights()))  # checked per bucket
    sync()
    seconds = time.perf_counter() - start
    params = dict(generator.model.named_parameters())
    ours, theirs = fingerprint(trainer.export_weights()), fingerprint((n, params[n]) for n in names)
    return {"sync_s": seconds, "sync_tensors": tensors, "sync_gib": sum(params[n].nbytes for n in names) / 2**30,
            "fingerprint_trainer": ours, "fingerprint_rollout": theirs, "sync_matches": ours == theirs}


def _sync(trainer, folder: str) -> dict:
    """``sync_into`` a bf16 ``TorchGenerator`` of the trainer's folder on the trainer's device."""
    from engines.backends.torch.generator import TorchGenerator

    return sync_into(trainer, TorchGenerator(folder, dtype="bfloat16", device=trainer.device))


def run_one(engine: str, folder: str, shape: dict, params: int, args) -> dict:
    import torch

    row = {"engine": engine, "params": params, **shape}
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    trainer = None
    try:
        trainer = _trainer(engine, folder, args)
        seconds = _time_steps(trainer, shape, args)
        if args.sync and engine == "megatron":
            row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else None  # the trainer's alone
            row.update(_sync(trainer, folder))
    except torch.cuda.OutOfMemoryError as e:
        row["error"], row["error_detail"] = "out of memory", str(e).splitlines()[0]
    finally:
        row.setdefault("peak_gib", torch.cuda.max_memory_allocated() / 2**30 if cuda else None)
        del trainer
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    if "error" not in row:
        tokens = shape["batch"] * shape["seq"]  # every position is computed, forward and backward
        flops_per_token = 6 * params + 12 * shape["layers"] * shape["hidden"] * shape["seq"]
        tflops = flops_per_token * tokens / seconds / 1e12
        row.update(step_s=seconds, tokens_per_s=tokens / seconds, tflops=tflops, mfu=tflops / args.peak_tflops)
    return row


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available() and not args.allow_cpu:
        raise SystemExit("bench.megatron_gpu needs a CUDA device")
    runs = []
    for size in args.sizes:
        shape = _shape(args, size)
        with tempfile.TemporaryDirectory() as folder:
            params = _save_model(folder, shape, args.vocab)
            for engine in args.engines:
                runs.append({"size": size, **run_one(engine, folder, shape, params, args)})
    result = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (smoke run)", "runs": runs}
    print(f"\n### Train step, {result['device']} (bf16; median of {args.steps} steps after {args.warmup}; "
          f"recompute (Megatron): {args.recompute}; micro_batch_tokens: {args.micro_batch_tokens})\n")
    print("| size | engine | params | seq x batch | step s | tokens/s | TFLOP/s | MFU | peak GiB |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in runs:
        shape = f"{r['seq']} x {r['batch']}"
        peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "–"
        if "error" in r:
            print(f"| {r['size']} | {r['engine']} | {r['params']:,} | {shape} | {r['error']} | | | | {peak} |")
        else:
            print(f"| {r['size']} | {r['engine']} | {r['params']:,} | {shape} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | "
                  f"{r['tflops']:.0f} | {100 * r['mfu']:.1f}% | {peak} |")
    return result


if __name__ == "__main__":
    main()
