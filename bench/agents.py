"""Episodes one at a time against batched across episodes (engines/agents/episodes.py).

    python -m bench.agents                       # 32 episodes on the torch engine, ~2 min on 2 CPU cores
    python -m bench.agents --engine vllm --repeats 3

The tiny tool agent (``engines.demo.tool_agent``: a random Qwen3 taught to call the calculator on
"What is 2+3?", then to answer) plays 32 two-turn episodes: a call, the tool's turn, an answer.
Its tool is the calculator after a sleep as long as one turn of generation of one episode
(measured first, median of 5), so that tools cost about what generating does.

- **one at a time**: the 32 episodes one after the other (``Episodes.run`` on one prompt, one
  sample), as a loop over episodes without batching would run them.
- **batched**: the 32 together (8 prompts x 4 samples): each turn of every live episode in one
  generate call, the tools of all episodes at once on threads.
- **batched, two lanes** (``rollout.overlap_tools``): the 32 in two halves that take turns, one
  half generating while the other's tools run.

The modes alternate, ``--repeats`` times each (median). **generate s** is the time inside the
engine's generate calls; **other s** the rest: tools (waited for), observations, bookkeeping.
Tool time is hidden when *other s* stays near one tool's sleep per turn while the episodes' tool
time adds up to many.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import tempfile
import time
from pathlib import Path

from engines.agents import tools

SLEEP_S = 0.0  # set by the benchmark: one turn of generation


def calculator(expression: str) -> str:
    time.sleep(SLEEP_S)  # the calculator, as slow as a turn of generation; the same schema as the one the agent learnt
    return tools.calculator(expression)


calculator.__doc__ = tools.calculator.__doc__


class Timed:
    """The rollout engine, with the time spent inside ``generate`` added up."""

    def __init__(self, engine):
        self.engine, self.seconds = engine, 0.0

    def generate(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.engine.generate(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("torch", "vllm"), default="torch")
    parser.add_argument("--episodes", type=int, default=32, help="a multiple of 4 (4 samples per prompt)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    global SLEEP_S

    import torch

    from engines.agents.episodes import Episodes
    from engines.backends import chat
    from engines.config.sections import RolloutConfig
    from engines.demo.tool_agent import save_tool_agent

    torch.set_num_threads(2)
    model = save_tool_agent(Path(tempfile.mkdtemp(prefix="bench-agents-")) / "agent")
    if args.engine == "vllm":
        from engines.backends.vllm.generator import VLLMGenerator

        engine = VLLMGenerator(model, kv_cache_memory_bytes=64 * 2**20, prompt_format=chat.PromptFormat("auto"))
    else:
        from engines.backends.torch.generator import TorchGenerator

        engine = TorchGenerator(model, prompt_format=chat.PromptFormat("auto"))
    episodes = Episodes(RolloutConfig(tools=["bench.agents:calculator"], max_new_tokens=80, temperature=0.3), engine.renderer)
    overlapped = Episodes(RolloutConfig(tools=["bench.agents:calculator"], max_new_tokens=80, temperature=0.3,
                                        overlap_tools=True), engine.renderer)
    row = {"prompt_id": 0, "prompt": "What is 2+3?", "answer": "5"}
    prompt = chat.Tokens(tuple(engine.renderer.ids(row["prompt"], episodes.schemas)))
    turns = []
    for k in range(5):  # one turn of one episode's generation: what the tool costs
        start = time.perf_counter()
        engine.generate([prompt], temperature=0.3, max_new_tokens=80, seed=k)
        turns.append(time.perf_counter() - start)
    SLEEP_S = statistics.median(turns)
    importlib.import_module("bench.agents").SLEEP_S = SLEEP_S  # the module rollout.tools names (this one may be __main__)

    rows = [row | {"prompt_id": i} for i in range(args.episodes // 4)]

    def one_at_a_time():
        timed = Timed(engine)
        played = [e for i in range(args.episodes) for e in episodes.run(timed, [rows[i // 4]], 1, 100 + i)]
        return played, timed.seconds

    def batched(runner=episodes):
        timed = Timed(engine)
        return runner.run(timed, rows, 4, 100), timed.seconds

    modes = {"one at a time": one_at_a_time, "batched": batched,
             "batched, two lanes (rollout.overlap_tools)": lambda: batched(overlapped)}
    runs = {name: [] for name in modes}
    for _ in range(args.repeats):
        for name, play in modes.items():
            start = time.perf_counter()
            played, generate_s = play()
            seconds = time.perf_counter() - start
            runs[name].append({"s": seconds, "generate_s": generate_s, "turns": sum(e.turns for e in played),
                               "tool_s": sum(e.tool_s for e in played), "calls": sum(e.tool_calls for e in played)})
    base = statistics.median(r["s"] for r in runs["one at a time"])
    print(f"\n{args.episodes} episodes, {args.engine} engine, a tool call sleeps {SLEEP_S:.3f} s (one turn of generation); "
          f"median of {args.repeats}, alternated\n")
    print("| mode | s | vs one at a time | generate s | other s | turns | tool calls | tools' own s (summed) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    table = {}
    for name, rs in runs.items():
        pick = sorted(rs, key=lambda r: r["s"])[len(rs) // 2]
        table[name] = pick | {"speedup": base / pick["s"]}
        print(f"| {name} | {pick['s']:.2f} | {base / pick['s']:.2f}x | {pick['generate_s']:.2f} | "
              f"{pick['s'] - pick['generate_s']:.2f} | {pick['turns']} | {pick['calls']} | {pick['tool_s']:.2f} |")
    b = table["one at a time"]
    rows = [{"figure": f"{args.episodes} two-turn episodes with a tool, s ({args.engine}): {name} vs one at a time",
             "yattflow": table[name]["s"], "baseline": b["s"], "ratio": table[name]["s"] / b["s"]}
            for name in modes if name != "one at a time"]
    return {"sleep_s": SLEEP_S, "modes": table, "rows": rows}


if __name__ == "__main__":
    main()
