"""Megatron-Core train step on one GPU: tokens/s and model FLOPs utilisation (MFU).

    python -m bench.megatron_gpu                      # ~0.44B Llama-style model, bf16
    python -m bench.megatron_gpu --layers 4 --steps 3  # a quick smoke run

Builds a randomly initialised Llama-style model locally (nothing is downloaded), saves it as
a Hugging Face folder, loads it into ``MegatronTrainer`` (the same class a training run uses)
and times ``train_step`` on random token batches after warm-up steps. MFU counts the standard
training FLOPs, 6 x parameters x tokens plus attention (12 x layers x hidden x sequence per
token), against the GPU's dense bf16 peak (``--peak-tflops``; H100 SXM: 989).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=1024, help="tokens per sequence (prompt + response)")
    p.add_argument("--batch", type=int, default=16, help="sequences per train step")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the GPU")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from engines.megatron_engine import MegatronTrainer
    from engines.tiny import build_char_tokenizer
    from engines.torch_engines import TrainBatch

    if not torch.cuda.is_available():
        raise SystemExit("bench.megatron_gpu needs a CUDA device")
    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, max_position_embeddings=args.seq,
        tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    with tempfile.TemporaryDirectory() as folder:
        model = LlamaForCausalLM(config).to(torch.bfloat16)
        params = sum(p.numel() for p in model.parameters())
        model.save_pretrained(folder)
        build_char_tokenizer().save_pretrained(folder)
        del model
        trainer = MegatronTrainer(folder, lr=1e-5, dtype="bfloat16")

    rng = random.Random(0)
    prompt_len = args.seq // 4

    def batch() -> TrainBatch:
        prompts = [[rng.randrange(3, args.vocab) for _ in range(prompt_len)] for _ in range(args.batch)]
        responses = [[rng.randrange(3, args.vocab) for _ in range(args.seq - prompt_len)] for _ in range(args.batch)]
        return TrainBatch(prompts, responses, [[-1.0] * len(r) for r in responses], [rng.uniform(-1, 1) for _ in responses])

    times = []
    for step in range(args.warmup + args.steps):
        b = batch()
        torch.cuda.synchronize()
        start = time.perf_counter()
        trainer.train_step(b)
        torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    tokens = args.batch * args.seq  # every position is computed, forward and backward
    flops_per_token = 6 * params + 12 * args.layers * args.hidden * args.seq
    tflops = flops_per_token * tokens / seconds / 1e12
    result = {"params": params, "tokens_per_s": tokens / seconds, "tflops": tflops, "mfu": tflops / args.peak_tflops,
              "step_s": seconds, "device": torch.cuda.get_device_name()}
    print(f"\n### Megatron-Core train step, {result['device']} (bf16, {params / 1e9:.2f}B params, "
          f"{args.batch} x {args.seq} tokens per step, median of {args.steps})\n")
    print("| params | step s | tokens/s | TFLOP/s | MFU |")
    print("|---:|---:|---:|---:|---:|")
    print(f"| {params:,} | {seconds:.3f} | {result['tokens_per_s']:,.0f} | {tflops:.0f} | {100 * result['mfu']:.1f}% |")
    return result


if __name__ == "__main__":
    main()
