"""Dynamic sampling benchmark: generated samples per kept group and batch fill rate, fixed waves
against adaptive waves (with carry-over), same workload.

    .venv/bin/python -m bench.sampling                      # ~1 min on 2 CPU cores, preparing included
    .venv/bin/python -m bench.sampling --store DIR          # prepare into DIR once, reuse it afterwards
    .venv/bin/python -m bench.sampling --steps 40 --samples-per-prompt 4

The workload is a real RL loop on the test suite's tiny prepared models (``TASK``: the
``prepare`` flow's arithmetic prompts, a 1-layer hidden-32 policy and GenRM judge after 150 SFT
steps each): one engine host (``engines.host.worker.Worker``, rank 0 of 1, in this process, torch
engines, 1 thread) runs rollout → score (GenRM judge) → filter waves and a train step per step,
exactly the commands a DP group's sub-flow sends, with the wave sizes of the sub-flow's own rule
(``flows.sampling.plan_wave``) and the same keep-ratio bookkeeping. Every mode starts from the
same SFT policy, the same prompt stream and seeds, and trains on what it kept (so the keep ratio
drifts as the policy learns, as in a run). Prefect is left out: it changes when work runs, not
what is sampled (only the ``prepare`` flow runs under Prefect, when the store is not prepared yet).
The ``rule`` workload draws more prompts than the tiny set holds (600), so its stream starts
again from the beginning (another epoch) several times, as a run's would.

Modes (``--target-groups`` 8, ``--prompts-per-wave`` 16, ``--max-waves`` 3, G = ``--samples-per-prompt`` 8):

- **fixed**: every wave draws ``prompts_per_wave``; kept groups beyond the target are dropped
  (``sampling.adaptive=false sampling.max_carry_age=0``: the behaviour before adaptive sampling);
- **adaptive**: the defaults, ``ceil(missing / keep ratio * 1.2)`` prompts per wave (cap 4x
  prompts_per_wave) and surplus kept groups carried into the next step (``max_carry_age=1``);
- **adaptive without carry-over**: adaptive waves, surplus dropped: what the wave sizes alone give.

Figures (sums over all steps of a mode): **samples generated per kept group** = rollout samples /
groups trained; **batch fill rate** = groups trained / (steps x target); waves per step; kept
groups thrown away; the observed keep ratio (groups whose rewards differ / prompts drawn), and
rollout + judge engine seconds per trained group. ``main(argv)`` returns the figures and prints a
markdown table per workload (``rows``: the adaptive/fixed pairs for ``python -m bench``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one thread per engine process

# tests/conftest.py TASK, the part that shapes the prepared data and models
PREPARE = [
    "prepare.train_prompts=600", "prepare.heldout_prompts=40", "sft.hidden_size=32", "sft.layers=1",
    "sft.max_steps=150", "prepare.sft_target=0", "prepare.judge_target=0", "sft.check_every=150",
    "data.max_prompt_tokens=48", "rollout.max_new_tokens=8",
]
WORKLOADS = {
    # the demo's reward: the tiny GenRM judge's verdict (a noisy judge: many groups get mixed rewards)
    "genrm": [],
    # exact match only: the tiny policy rarely gets a sum right, so few groups are kept (a hard task)
    "rule": ["reward.genrm_weight=0", "reward.rule_weight=1"],
}
MODES = {
    "adaptive": ["sampling.adaptive=true", "sampling.max_carry_age=1"],
    "fixed": ["sampling.adaptive=false", "sampling.max_carry_age=0"],
    "adaptive without carry-over": ["sampling.adaptive=true", "sampling.max_carry_age=0"],
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.sampling", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30, help="RL steps per mode and workload (default 30)")
    p.add_argument("--target-groups", type=int, default=8)
    p.add_argument("--prompts-per-wave", type=int, default=16)
    p.add_argument("--max-waves", type=int, default=3)
    p.add_argument("--samples-per-prompt", type=int, default=8, help="group size G")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated, of: " + ", ".join(MODES))
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated, of: " + ", ".join(WORKLOADS))
    p.add_argument("--store", metavar="DIR", help="storage root to prepare into (or reuse); default: a temporary folder")
    return p.parse_args(argv)


def prepared_store(root: str) -> float:
    """Build the tiny datasets and models with the real ``prepare`` flow unless they are there;
    the seconds it took."""
    from engines.config import load_config
    from storage import objectstore

    config = load_config(None, PREPARE + [f"storage.root={root}"])
    needed = [objectstore.join(config.uri(p), "MANIFEST.json") for p in (config.model.policy, config.model.judge)]
    needed.append(objectstore.join(config.uri(config.data.prompts), "part-00000.parquet"))
    if all(objectstore.exists(u) for u in needed):
        return 0.0
    from flows.prepare import prepare

    start = time.perf_counter()
    prepare(overrides=PREPARE + [f"storage.root={root}"])
    return time.perf_counter() - start


def run_mode(root: str, workload: str, mode: str, args) -> list[dict]:
    """One mode's RL loop: the DP-group sub-flow's waves, without Prefect. Per step: its figures."""
    from engines.wire.commands import DynamicFilter, GenRMScore, Rollout, SetupEngines, SyncWeights, TrainStep
    from engines.config import load_config
    from flows.sampling import GroupSampling, plan_wave
    from engines.host.worker import Worker
    from storage import datasets, objectstore

    name = "bench-sampling-" + "".join(c if c.isalnum() else "-" for c in f"{workload}-{mode}").replace("--", "-")
    config = load_config(None, PREPARE + [
        f"storage.root={root}", f"name={name}", "dp=1", "threads_per_host=1", f"seed={args.seed}",
        f"rollout.samples_per_prompt={args.samples_per_prompt}", f"sampling.prompts_per_wave={args.prompts_per_wave}",
        f"sampling.target_groups={args.target_groups}", f"sampling.max_waves={args.max_waves}", *WORKLOADS[workload],
        *MODES[mode]])
    run_uri, s = config.run_uri, config.sampling
    objectstore.remove(run_uri)
    host = Worker(rank=0, world=1, threads=1)
    host.setup_engines(SetupEngines(config=config))  # the SFT policy, fresh for every mode
    state, cursor, steps = GroupSampling(), 0, []
    start = time.perf_counter()
    for step in range(args.steps):
        have, sizes, samples, engine_s, new_kept = state.carried, [], 0, 0.0, 0
        scored, carry_in = [], state.carry
        experience, carry_out = datasets.stage_uri(run_uri, step, "experience", 0), datasets.stage_uri(run_uri, step, "carry", 0)
        for wave in range(s.max_waves):
            count = plan_wave(s, state, have)
            rollouts = datasets.stage_uri(run_uri, step, "rollouts", 0, wave)
            rolled = host.rollout(Rollout(step=step, wave=wave, cursor=cursor, count=count, out=rollouts))
            cursor = rolled.cursor
            scored.append(datasets.stage_uri(run_uri, step, "scored", 0, wave))
            score = host.genrm_score(GenRMScore(rollouts=rollouts, out=scored[-1]))
            kept = host.dynamic_filter(DynamicFilter(step=step, scored=scored, out=experience, target_groups=s.target_groups,
                                                     carry_in=carry_in, carry_out=carry_out))
            state.observe(count, kept.new_kept, s.keep_ratio_decay)
            have = kept.kept
            sizes.append(count)
            samples += rolled.samples
            new_kept += kept.new_kept
            engine_s += rolled.seconds + score.seconds
            if kept.enough:
                break
        state.carry, state.carried = kept.carry, kept.carried_out
        trained = host.train_step(TrainStep(experience=experience))
        host.sync_weights(SyncWeights())
        steps.append({"step": step, "waves": len(sizes), "prompts": sum(sizes), "samples": samples, "kept": kept.kept,
                      "nonequal": new_kept, "carried_in": kept.carried_in, "carried_out": kept.carried_out,
                      "surplus_dropped": kept.surplus_dropped, "rollout_score_s": engine_s, "train_s": trained.seconds,
                      "keep_ratio_estimate": state.keep_ratio, "seconds": time.perf_counter() - start})
        start = time.perf_counter()
    return steps


def summarize(steps: list[dict], args) -> dict:
    total = lambda key: sum(m[key] for m in steps)  # noqa: E731
    kept = total("kept")
    return {
        "samples_per_kept_group": total("samples") / kept if kept else float("inf"),
        "fill_rate": kept / (len(steps) * args.target_groups),
        "full_batches": sum(m["kept"] >= args.target_groups for m in steps) / len(steps),
        "waves_per_step": total("waves") / len(steps),
        "refill_steps": sum(m["waves"] > 1 for m in steps) / len(steps),
        "prompts_per_step": total("prompts") / len(steps),
        "samples_per_step": total("samples") / len(steps),
        "dropped_per_step": total("surplus_dropped") / len(steps),
        "carried_per_step": total("carried_in") / len(steps),
        "keep_ratio": total("nonequal") / total("prompts"),
        "rollout_score_s_per_kept_group": total("rollout_score_s") / kept if kept else float("inf"),
        "rollout_score_s_per_step": total("rollout_score_s") / len(steps),
        "prompts_per_wave_median": statistics.median(m["prompts"] / m["waves"] for m in steps),
    }


ROWS = [
    ("**generated samples per kept (trained) group**", "samples_per_kept_group", "{:.1f}"),
    ("**batch fill rate** (groups trained / target)", "fill_rate", "{:.0%}"),
    ("steps with a full batch", "full_batches", "{:.0%}"),
    ("waves per step", "waves_per_step", "{:.2f}"),
    ("steps that needed a refill wave", "refill_steps", "{:.0%}"),
    ("prompts drawn per step", "prompts_per_step", "{:.1f}"),
    ("samples generated per step", "samples_per_step", "{:.0f}"),
    ("kept groups thrown away per step (beyond the target)", "dropped_per_step", "{:.2f}"),
    ("carried-over groups trained per step", "carried_per_step", "{:.2f}"),
    ("observed keep ratio (groups whose rewards differ / prompts drawn)", "keep_ratio", "{:.2f}"),
    ("rollout + scoring engine seconds per trained group", "rollout_score_s_per_kept_group", "{:.3f}"),
]


def report(results: dict, args, wall: dict) -> str:
    """One markdown table per workload: figure | each mode | adaptive / fixed."""
    lines = []
    for workload, by_mode in results.items():
        modes = list(by_mode)
        main_pair = "adaptive" in by_mode and "fixed" in by_mode
        head = ["figure", *modes] + (["ratio (adaptive / fixed)"] if main_pair else [])
        reward = "GenRM judge verdict" if workload == "genrm" else "exact-match rule"
        lines += [f"\n### Dynamic sampling, fixed vs adaptive waves: `{workload}` workload (reward: {reward}; {args.steps} RL steps "
                  f"per mode, target {args.target_groups} groups, G={args.samples_per_prompt}, prompts_per_wave "
                  f"{args.prompts_per_wave}, max_waves {args.max_waves})\n",
                  "| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]
        for label, key, fmt in ROWS:
            cells = [fmt.format(by_mode[m][key]) for m in modes]
            if main_pair:
                a, f = by_mode["adaptive"][key], by_mode["fixed"][key]
                cells.append(f"{a / f:.2f}" if f else "–")
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        ratio = by_mode[modes[0]]["keep_ratio"]
        lines.append(f"\nWithout any waste, G / keep ratio = {args.samples_per_prompt / ratio:.1f} samples per kept group "
                     f"(at the keep ratio {modes[0]} observed). Loop time (rollout, scoring, filter, train; engines "
                     "loaded before): " + ", ".join(f"{m} {wall[workload][m]:.1f}s" for m in modes) + ".")
    text = "\n".join(lines)
    print(text)
    return text


def main(argv=None) -> dict:
    args = parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = [m for m in modes if m not in MODES] + [w for w in workloads if w not in WORKLOADS]
    if unknown:
        raise SystemExit(f"unknown mode(s) or workload(s) {unknown}; modes: {list(MODES)}, workloads: {list(WORKLOADS)}")
    import logging

    import torch

    torch.set_num_threads(1)
    logging.getLogger("yattflow").setLevel(logging.ERROR)  # the rule workload's "another epoch" warnings
    t0 = time.perf_counter()
    root = args.store or tempfile.mkdtemp(prefix="yattflow-bench-sampling-", dir=os.environ.get("YATTFLOW_BENCH_DIR"))
    raw: dict = {}
    results: dict = {}
    wall: dict = {}
    try:
        prep = prepared_store(root)
        print(f"store {root} ready ({prep:.0f}s to prepare)", flush=True)
        for workload in workloads:
            for mode in modes:
                raw.setdefault(workload, {})[mode] = run_mode(root, workload, mode, args)
                wall.setdefault(workload, {})[mode] = sum(m["seconds"] for m in raw[workload][mode])
                fig = results.setdefault(workload, {})[mode] = summarize(raw[workload][mode], args)
                print(f"{workload}, {mode}: {fig['samples_per_kept_group']:.1f} samples per kept group, fill rate "
                      f"{fig['fill_rate']:.0%}, {fig['waves_per_step']:.2f} waves per step ({wall[workload][mode]:.0f}s)", flush=True)
    finally:
        if not args.store:
            shutil.rmtree(root, ignore_errors=True)
    table = report(results, args, wall)
    print(f"\n(total {time.perf_counter() - t0:.0f}s)")
    return {"figures": results, "rows": rows(results), "steps": raw, "table": table, "wall_s": wall, "prepare_s": prep}


def rows(results: dict) -> list[dict]:
    """The adaptive-vs-fixed pairs as ``python -m bench`` lists them: {figure, yattflow, baseline, ratio}."""
    out = []
    for workload, by_mode in results.items():
        if "adaptive" not in by_mode or "fixed" not in by_mode:
            continue
        for label, key in (("generated samples per kept group", "samples_per_kept_group"), ("batch fill rate", "fill_rate"),
                           ("waves per step", "waves_per_step"),
                           ("rollout + scoring s per trained group", "rollout_score_s_per_kept_group")):
            a, f = by_mode["adaptive"][key], by_mode["fixed"][key]
            out.append({"figure": f"[{workload}] {label}: adaptive vs fixed waves", "yattflow": a, "baseline": f,
                        "ratio": a / f if f else None})
    return out


if __name__ == "__main__":
    main()
