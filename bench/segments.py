"""What streaming's segments cost the rollout engine: the same responses generated whole (one
generate call each) against continued ``rollout.segment_tokens`` at a time, as the streaming lane
does (engines/host/stream.py: each segment a call that re-reads the sample's prompt and response
so far, ``chat.Tokens``).

    .venv/bin/python -m bench.segments                        # the torch engine, ~1 min on 2 cores
    .venv/bin/python -m bench.segments --engines torch,vllm   # + vLLM (prefix caching keeps what a segment re-reads)

The lane's own code runs: a ``StreamLane`` over a tiny Llama built here (engines/demo/tiny.py),
its segments called one by one on this thread until every sample has ended; the figure is the
seconds inside generate calls per generated token. The baseline is the same lane with
``segment_tokens = max_new_tokens`` (each response one call), measured in the same run,
alternated. The samples differ between the two (a segment's seed is its own), so the table
prints the tokens each generated. Not a speed figure for a GPU: on the CPU a call's fixed cost and
the prefill's share differ from a device's.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

from bench import cpu_model
from bench.rollout import arithmetic_prompts, build_model


def lane_seconds(engine, segment_tokens: int, prompts: list[str], args) -> tuple[float, int]:
    """Seconds in generate calls and tokens generated for every prompt's samples, streamed ``segment_tokens`` at a time."""
    from engines.config.sections import RolloutConfig
    from engines.host.offpolicy import RolloutWeights
    from engines.host.stream import StreamLane

    ro = RolloutConfig(mode="stream", max_staleness=1, samples_per_prompt=args.n, max_new_tokens=args.max_new_tokens,
                       segment_tokens=segment_tokens)
    row = lambda i: {"prompt_id": i, "prompt": prompts[i], "answer": "", "prompt_row": i}  # noqa: E731
    lane = StreamLane(engine, RolloutWeights(), row, list, ro, slots=len(prompts) * args.n, room=len(prompts), seed=lambda n: n)
    while active := lane._draw():
        lane._segment(active)
    return lane.figures.busy_s, sum(len(s.response_ids) for g in lane.groups for s in g.samples)


def make_engine(name: str, model_dir: str, threads: int):
    if name == "torch":
        from engines.backends.torch.generator import TorchGenerator

        return TorchGenerator(model_dir)
    from engines.backends.vllm.generator import VLLMGenerator

    return VLLMGenerator(model_dir, threads=threads, kv_cache_memory_bytes=128 * 2**20)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.segments", description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", default="torch", help="comma-separated: torch, vllm (default torch)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--segments", default="8,32", help="segment_tokens to measure (default 8,32)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    prompts = arithmetic_prompts(args.prompts)
    segments = [args.max_new_tokens] + [int(s) for s in args.segments.split(",")]
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        params = build_model(tmp, args.hidden, args.layers)
        for name in args.engines.split(","):
            engine = make_engine(name, tmp, args.threads)
            lane_seconds(engine, args.max_new_tokens, prompts, args)  # warm-up
            runs = {s: [] for s in segments}
            for rep in range(args.repeats):
                for s in (segments if rep % 2 == 0 else segments[::-1]):
                    runs[s].append(lane_seconds(engine, s, prompts, args))
            out[name] = {s: (statistics.median(sec / tok for sec, tok in r), statistics.fmean(tok for _, tok in r))
                         for s, r in runs.items()}
            del engine
    whole = args.max_new_tokens
    lines = [f"{cpu_model()}, {args.threads} threads; a tiny Llama of {params / 1e6:.1f}M parameters, {args.prompts} prompts x "
             f"{args.n} samples, max_new_tokens {whole}, medians of {args.repeats} alternated runs", "",
             "| engine | segment_tokens | ms per generated token | tokens generated | / whole responses |", "|---|---|---|---|---|"]
    for name, fig in out.items():
        for s, (per_token, tokens) in fig.items():
            lines.append(f"| {name} | {s}{' (whole)' if s == whole else ''} | {per_token * 1e3:.2f} | {tokens:.0f} | "
                         f"{per_token / fig[whole][0]:.2f} |")
    print("\n".join(lines))
    return out


if __name__ == "__main__":
    main()
