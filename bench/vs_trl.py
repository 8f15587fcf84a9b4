"""yattflow against TRL's GRPOTrainer: seconds per RL step on the same work, each in a subprocess.

    .venv/bin/pip install -e .[bench]              # TRL 1.16.0, pinned (pyproject.toml: the `bench` extra)
    .venv/bin/python -m bench.vs_trl                 # both sizes, 8 steps, 2 repeats (~25 min on 2 cores)
    .venv/bin/python -m bench.vs_trl --sizes demo --steps 3 --repeats 1

For each size it builds a Hugging Face folder (``engines/demo/tiny.py``: the character tokenizer and a
Llama of that shape, **randomly initialised**: a speed figure, not a learning one) and a prompts
Parquet of the demo's addition problems (``engines/demo/arithmetic.py``, "47+85=", 7 tokens with BOS),
then runs, alternating in one process tree (yattflow, TRL, yattflow, TRL for ``--repeats 2``):

* **yattflow**: ``yattflow train`` in a subprocess (its own temporary Prefect server, not timed),
  dp=1, torch engines, ``threads_per_host`` threads; one wave of ``prompts`` prompts per step, no
  filtering, one optimizer step (``train.minibatches=1``), the rule reward only;
* **TRL**: ``GRPOTrainer`` in a subprocess (``--trl-worker``), ``use_cpu``, the same threads, the
  same folder, prompts, G, response cap, learning rate, temperature, clip range, AdamW betas and
  constant learning rate, ``beta=0`` (yattflow's ``train.algorithm.kl_coef=0``), ``num_iterations=1``, one
  optimizer step per generation batch, no gradient checkpointing (yattflow has none).

Both score with the same rule, ``engines.demo.arithmetic:exact_match`` through
``engines.host.rewards.load_rule``. A random policy never answers right, so every advantage is 0 and
the weights never move: both sides do a step's full work (generate, score, forward, backward,
AdamW) on a policy whose response lengths stay put. Sizes:

* ``large``: hidden 512 x 8 layers (8 heads, 4 KV heads), 32 prompts/step, <= 64 new tokens;
* ``demo``: the demo policy's shape (``sft.*`` defaults: hidden 64 x 2 layers, 2 heads, 1 KV
  head), 16 prompts/step, <= 8 new tokens.

s/step is the median over steps 2..N of every repeat (step 1 is warm-up): yattflow's ``step_s``
(the step as the train flow pays for it, from the run's TensorBoard events), TRL's time between
successive ``on_step_end`` callbacks. samples/s = prompts x G / s per step; the speed ratio is
TRL s/step / yattflow s/step (> 1: yattflow faster), printed beside its goal (large >= 1.0,
demo >= 0.5), not asserted. Both generate a step's batch (prompts x G rows) in one ``generate``
call (yattflow: ``placement.stream_chunk`` prompts per call, 32 by default). Work that differs and
is not removed: TRL's backward passes are fixed-size row slices (``--trl-rows``, default: the largest
that keeps rows x (prompt + cap) within yattflow's ``train.micro_batch_tokens``), yattflow's are
cut by padded tokens after sorting by length; yattflow also syncs weights to its rollout engine,
fingerprints them, and checkpoints after the last step (``checkpoint.every`` is set past the run).
Below the table: yattflow's engine seconds per step (the rest is orchestration), each side's
generation seconds per step (yattflow's rollout stage; TRL's ``_generate_single_turn``, timed) and
yattflow's step by stage task (each task's wall time as its DP group's controller waits for it;
"outside them" is the iteration and DP-group sub-flows and the controller's own code).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import cpu_model
from engines.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
G = 8
RULE = "engines.demo.arithmetic:exact_match"
SIZES = {
    "demo": {"hidden": 64, "layers": 2, "heads": 2, "kv_heads": 1, "init_std": 0.1, "prompts": 16, "max_new": 8, "goal": 0.5},
    "large": {"hidden": 512, "layers": 8, "heads": 8, "kv_heads": 4, "init_std": 0.02, "prompts": 32, "max_new": 64, "goal": 1.0},
}
PROMPT_TOKENS = 7  # "47+85=" and BOS, every prompt
STAGES = ("rollout", "genrm_score", "dynamic_filter", "train_step", "sync_weights")  # a step's stage tasks here


def require_trl() -> None:
    try:
        import accelerate  # noqa: F401
        import datasets  # noqa: F401
        import trl  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"bench.vs_trl needs TRL ({e}): .venv/bin/pip install -e .[bench]") from None


def build_model(model_dir: Path, size: str, seed: int) -> None:
    """A random Llama of ``size``'s shape with the demo's character tokenizer, saved to ``model_dir``."""
    from engines.demo.tiny import build_char_tokenizer, build_tiny_llama

    s = SIZES[size]
    tokenizer = build_char_tokenizer()
    model = build_tiny_llama(len(tokenizer), hidden_size=s["hidden"], num_layers=s["layers"], num_heads=s["heads"],
                             num_kv_heads=s["kv_heads"], max_positions=max(64, 1 << (PROMPT_TOKENS + s["max_new"]).bit_length()),
                             seed=seed, init_std=s["init_std"])
    model.save_pretrained(model_dir, safe_serialization=True)
    tokenizer.save_pretrained(model_dir)


def build_inputs(work: Path, size: str, seed: int, count: int = 1000) -> tuple[Path, Path]:
    """A random Llama of ``size``'s shape (``build_model``), and the prompts Parquet."""
    import pyarrow as pa

    from engines.demo import arithmetic
    from storage import datasets

    model_dir, prompts = work / f"model-{size}", work / "prompts.parquet"
    build_model(model_dir, size, seed)
    if not prompts.exists():
        problems = arithmetic.make_problems(count, digits=2, seed=seed)
        table = pa.table({"prompt_id": pa.array(range(count), pa.int64()), "prompt": [p for p, _ in problems],
                          "answer": [a for _, a in problems]})
        datasets.write_table(str(prompts), table, datasets.PROMPTS)
    return model_dir, prompts


def thread_env(threads: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}  # yattflow starts its own server
    return env | {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def run_yattflow(work: Path, size: str, model_dir: Path, prompts: Path, args, name: str, extra: list[str]) -> dict:
    s = SIZES[size]
    command = [sys.executable, "-m", "flows.cli", "train", f"storage.root={work / 'store'}", f"name={name}", "dp=1",
               f"steps={args.steps}", f"seed={args.seed}", f"threads_per_host={args.threads}",
               f"model.policy={model_dir}", f"data.prompts={prompts}", "data.heldout=null", f"data.max_prompt_tokens={PROMPT_TOKENS}",
               f"rollout.samples_per_prompt={G}", f"rollout.max_new_tokens={s['max_new']}", "rollout.temperature=1.0",
               f"sampling.prompts_per_wave={s['prompts']}", f"sampling.target_groups={s['prompts']}",  # no filter: one wave is the batch
               "sampling.filter_equal_rewards=false", "sampling.adaptive=false", "sampling.max_waves=1",
               "train.minibatches=1", f"train.lr={args.lr}", "reward.genrm_weight=0", "reward.rule_weight=1",
               f"reward.rule={RULE}", "checkpoint.every=1000", *extra]
    env = thread_env(args.threads) | {"PREFECT_HOME": str(work / f"prefect-{name}")}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"yattflow train failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(work / "store" / "runs" / name / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()

    def scalar(tag: str) -> list[float]:  # per step, steps counted from 1
        return [e.value for e in sorted(events.Scalars(tag), key=lambda e: e.step)]

    return {"step_s": scalar("seconds/step"), "engine_s": scalar("seconds/engines"), "generate_s": scalar("seconds/rollout"),
            "response_tokens": scalar("rollout/response_tokens"),
            **{f"{stage}_s": scalar(f"seconds/{stage}") for stage in STAGES}}


def trl_rows(size: str, args) -> int:
    """TRL's rows per forward/backward: the largest divisor of the batch whose padded tokens fit
    yattflow's ``train.micro_batch_tokens`` (at least one group)."""
    if args.trl_rows:
        return args.trl_rows
    budget, s = TrainConfig().micro_batch_tokens, SIZES[size]
    batch = s["prompts"] * G
    fits = [d for d in range(1, batch + 1) if batch % d == 0 and d * (PROMPT_TOKENS + s["max_new"]) <= budget]
    return max(fits + [G])


def run_trl(work: Path, size: str, model_dir: Path, prompts: Path, args, name: str) -> dict:
    s = SIZES[size]
    spec = {"model": str(model_dir), "prompts": str(prompts), "out": str(work / f"{name}.json"), "output_dir": str(work / name),
            "prompts_per_step": s["prompts"], "max_new": s["max_new"], "rows": trl_rows(size, args), "steps": args.steps,
            "lr": args.lr, "seed": args.seed, "threads": args.threads}
    (work / f"{name}.spec.json").write_text(json.dumps(spec))
    done = subprocess.run([sys.executable, "-m", "bench.vs_trl", "--trl-worker", str(work / f"{name}.spec.json")],
                          cwd=ROOT, env=thread_env(args.threads), capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"TRL worker failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return json.loads(Path(spec["out"]).read_text())


def trl_worker(spec_file: str) -> None:
    """In the subprocess: TRL's GRPOTrainer on the spec's folder and prompts; writes per-step seconds."""
    spec = json.loads(Path(spec_file).read_text())
    import torch

    torch.set_num_threads(spec["threads"])
    import pyarrow.parquet as pq
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from engines.host.rewards import load_rule

    rule = load_rule(RULE)

    def exact_match(prompts, completions, answer, prompt_id, **_):  # yattflow's rule, called as its engines call it
        return [rule(p, c, a, i) for p, c, a, i in zip(prompts, completions, answer, prompt_id)]

    class Clock(TrainerCallback):
        def __init__(self):
            self.ends, self.lengths, self.generate_s = [], [], []

        def on_train_begin(self, *_, **__):
            self.begin = time.perf_counter()

        def on_step_end(self, *_, **__):
            self.ends.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **_):
            if logs and "completions/mean_length" in logs:
                self.lengths.append(logs["completions/mean_length"])

    defaults, batch = TrainConfig(), spec["prompts_per_step"] * G
    config = GRPOConfig(
        output_dir=spec["output_dir"], use_cpu=True, bf16=False, seed=spec["seed"], max_steps=spec["steps"],
        per_device_train_batch_size=spec["rows"], gradient_accumulation_steps=batch // spec["rows"],
        steps_per_generation=batch // spec["rows"],  # one generation batch (prompts x G) per optimizer step
        num_generations=G, max_completion_length=spec["max_new"], temperature=1.0, top_p=1.0, num_iterations=1, beta=0.0,
        learning_rate=spec["lr"], lr_scheduler_type="constant", warmup_steps=0, adam_beta1=defaults.betas[0],
        adam_beta2=defaults.betas[1], weight_decay=defaults.weight_decay, max_grad_norm=defaults.grad_clip,
        epsilon=defaults.algorithm.clip_low, epsilon_high=defaults.algorithm.clip_high, loss_type="dapo", scale_rewards="group",
        gradient_checkpointing=False, model_init_kwargs={"dtype": "float32", "attn_implementation": "sdpa"},
        report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True, dataloader_num_workers=0,
    )
    table = pq.read_table(spec["prompts"], columns=["prompt_id", "prompt", "answer"]).to_pydict()
    clock = Clock()
    trainer = GRPOTrainer(model=spec["model"], reward_funcs=exact_match, args=config, train_dataset=Dataset.from_dict(table),
                          processing_class=AutoTokenizer.from_pretrained(spec["model"]), callbacks=[clock])
    generate = trainer._generate_single_turn  # timed, as yattflow's rollout stage is

    def timed_generate(*a, **kw):
        start = time.perf_counter()
        try:
            return generate(*a, **kw)
        finally:
            clock.generate_s.append(time.perf_counter() - start)

    trainer._generate_single_turn = timed_generate
    trainer.train()
    step_s = [b - a for a, b in itertools.pairwise([clock.begin, *clock.ends])]
    Path(spec["out"]).write_text(json.dumps({"step_s": step_s, "generate_s": clock.generate_s, "response_tokens": clock.lengths}))


def summarise(runs: list[dict], prompts: int) -> dict:
    steps = [s for run in runs for s in run["step_s"][1:]]  # step 1 of each run is warm-up
    lengths = [t for run in runs for t in run["response_tokens"][1:]]
    if not steps:
        raise SystemExit("bench.vs_trl: no steps after the warm-up one; use --steps 2 or more")
    s_per_step = statistics.median(steps)

    def median(key: str) -> float | None:
        values = [v for run in runs for v in run.get(key, [])[1:]]
        return statistics.median(values) if values else None

    return {"s_per_step": s_per_step, "samples_per_s": prompts * G / s_per_step, "steps": len(steps),
            "engine_s": median("engine_s"), "generate_s": median("generate_s"),
            "stage_s": {stage: seconds for stage in STAGES if (seconds := median(f"{stage}_s")) is not None},
            "response_tokens": statistics.mean(lengths) if lengths else None,
            "per_run_s": [statistics.median(run["step_s"][1:]) for run in runs]}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="demo,large", help=f"comma-separated, of {', '.join(SIZES)}")
    p.add_argument("--steps", type=int, default=8, help="RL steps per run; s/step is the median of steps 2..N (default 8)")
    p.add_argument("--repeats", type=int, default=2, help="yattflow/TRL pairs per size, alternating (default 2)")
    p.add_argument("--lr", type=float, default=TrainConfig().lr, help="learning rate of both (default yattflow's)")
    p.add_argument("--threads", type=int, default=2, help="torch threads of each side (default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trl-rows", type=int, default=None, help="TRL rows per forward/backward (default: see docstring)")
    p.add_argument("--yattflow-set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra yattflow override, e.g. placement.stream_chunk=32 (repeatable)")
    p.add_argument("--keep", action="store_true", help="keep the work folder (models, runs, logs)")
    args = p.parse_args(argv)
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    if unknown := set(sizes) - set(SIZES):
        p.error(f"--sizes: unknown {sorted(unknown)}; choose from {list(SIZES)}")
    require_trl()
    cpu = cpu_model()
    work = Path(tempfile.mkdtemp(prefix="yattflow-bench-vs-trl-", dir=os.environ.get("YATTFLOW_BENCH_DIR")))
    print(f"CPU: {cpu}; {args.steps} steps x {args.repeats} repeats per side, G={G}, {args.threads} threads, lr {args.lr}; "
          f"work folder {work}", flush=True)
    results, rows = {}, []
    for size in sizes:
        s = SIZES[size]
        model_dir, prompts = build_inputs(work, size, args.seed)
        runs = {"yattflow": [], "trl": []}
        for r in range(args.repeats):
            for side in ("yattflow", "trl"):
                start, name = time.perf_counter(), f"vs-trl-{size}-{side}-{r}"
                run = (run_yattflow(work, size, model_dir, prompts, args, name, args.yattflow_set) if side == "yattflow"
                       else run_trl(work, size, model_dir, prompts, args, name))
                runs[side].append(run)
                print(f"  {size} {side} repeat {r + 1}: steps {', '.join(f'{x:.2f}' for x in run['step_s'])} s "
                      f"({time.perf_counter() - start:.0f}s with start-up)", flush=True)
        y, t = summarise(runs["yattflow"], s["prompts"]), summarise(runs["trl"], s["prompts"])
        results[size] = {"yattflow": y, "trl": t, "speed_ratio": t["s_per_step"] / y["s_per_step"], "goal": s["goal"],
                         "trl_rows": trl_rows(size, args)}
        label = f"{size} ({s['hidden']}x{s['layers']}, {s['prompts']} prompts x G={G}, <= {s['max_new']} tokens)"
        rows += [{"figure": f"{label}: s/step, median", "yattflow": y["s_per_step"], "baseline": t["s_per_step"],
                  "ratio": y["s_per_step"] / t["s_per_step"]},
                 {"figure": f"{label}: samples/s (ratio: speed, goal >= {s['goal']})", "yattflow": y["samples_per_s"],
                  "baseline": t["samples_per_s"], "ratio": y["samples_per_s"] / t["samples_per_s"]}]
    print(f"\n### yattflow vs TRL {_trl_version()} GRPOTrainer, s per RL step ({cpu})\n")
    print("| size | yattflow s/step | TRL s/step | yattflow samples/s | TRL samples/s | speed ratio (TRL s / yattflow s) | goal "
          "| mean response tokens (yattflow / TRL) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for size, r in results.items():
        y, t = r["yattflow"], r["trl"]
        tokens = " / ".join("–" if x is None else f"{x:.1f}" for x in (y["response_tokens"], t["response_tokens"]))
        print(f"| {size} | {y['s_per_step']:.2f} | {t['s_per_step']:.2f} | {y['samples_per_s']:.1f} | {t['samples_per_s']:.1f} "
              f"| {r['speed_ratio']:.2f} | >= {r['goal']} ({'met' if r['speed_ratio'] >= r['goal'] else 'missed'}) | {tokens} |")
    print()
    for size, r in results.items():
        y = r["yattflow"]
        print(f"{size}: yattflow's engines {y['engine_s']:.2f} s of its {y['s_per_step']:.2f} s/step (the rest is orchestration: "
              f"Prefect, storage, the controller); generation {y['generate_s']:.2f} s (yattflow) vs "
              f"{r['trl']['generate_s']:.2f} s (TRL) of a step (medians)")
        stages = ", ".join(f"{stage} {seconds:.3f}" for stage, seconds in y["stage_s"].items())
        print(f"{size}: yattflow's step by stage task, median s: {stages}; outside them "
              f"{y['s_per_step'] - sum(y['stage_s'].values()):.3f} (Prefect's flow and task runs, the controller)")
    counted = ", ".join(f"{k}: {v['yattflow']['steps']} steps per side" for k, v in results.items())
    print(f"\nmedians over {counted} (steps 2..{args.steps} of {args.repeats} run(s) each); TRL rows per backward pass: "
          + ", ".join(f"{k} {v['trl_rows']}" for k, v in results.items()))
    if not args.keep:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return {"cpu": cpu, "rows": rows, "sizes": results, "steps": args.steps, "repeats": args.repeats}


def _trl_version() -> str:
    import trl

    return trl.__version__


if __name__ == "__main__":
    if sys.argv[1:2] == ["--trl-worker"]:
        trl_worker(sys.argv[2])
    else:
        main()
