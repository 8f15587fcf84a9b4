"""Off-policy overlap benchmark: step time of synchronous steps (``rollout.max_staleness=0``)
against overlapping ones (``max_staleness=1``) and the streaming lane (``rollout.mode=stream``,
k=4), alternated in one invocation.

    .venv/bin/python -m bench.overlap                       # timing stubs, dp=2, ~6 min on 2 cores
    .venv/bin/python -m bench.overlap --long-tail --rollout-spt 0.004 --train-spt 0.009 --steps 10
                                                            # 1 response in 20 8x the median (docs/off-policy.md#streaming)
    .venv/bin/python -m bench.overlap --real --steps 6      # + the real torch engines at dp=2 (tiny demo models)

Each mode's *busy* figures are a lane's seconds at work over the step's: the rollout engine's
generate calls (``rollout_busy_s``; with waves the rollout stage's seconds) and the train step
with its sync; the rest of the step is that lane's idle bubble. The modes draw different samples,
so they train different numbers of tokens a step (with ``--long-tail``, more or fewer of the long
responses): the table prints the trained tokens per step and each ratio per trained token too.

Everything but the engines is real: the ``flows.training:train`` flow in a fresh process against a
``prefect server`` (PostgreSQL when ``postgresql`` is installed, else SQLite), one engine-host
process per DP group, Parquet stage outputs; bench/overhead.py's tiny store, runner and figures.
The timing-stub engines (engines/backends/stub/engines.py) sleep ``stub_seconds_per_token`` per
token; ``--rollout-spt``/``--train-spt`` are set so that a step's rollout + scoring (r) and its
training (t) take about the same seconds, the case where overlap gains most: the step time cannot
fall below max(r, t), so the bound on the ratio overlapped / synchronous is max(r, t) / (r + t)
(0.5 when they are equal; the issue's goal is <= 0.6). The stub generator's samples depend on the
weight version it holds, and with overlap a step generates from an older one, so the two modes draw
different samples and dynamic sampling may need a second wave in different steps; and with
max_staleness=1 a carried-over group is too stale to train (``--carry-age``), so that mode generates
more prompts per step. The table prints each mode's waves and prompts per step; ``--carry-age 0``
compares like with like. r and t are measured in the synchronous runs:
r is the slowest group's seconds in rollout + genrm_score + dynamic_filter, and t is the rest of the
synchronous step (step - r: training, the weight sync and the step's orchestration). The slowest
group's train_step seconds would overstate t: a group that finished its rollout early waits in the
train step's all-reduce for the late one, so that wait is counted once in r and again in t.
A stub sleeps, so its two lanes overlap fully whatever the cores; the real engines
of a host share its ``threads_per_host`` cores with each other (2 cores here for 2 hosts), so
their figure shows what overlap gives when the engines compete for the same CPU — not what it
gives when they have their own devices.

``main(argv)`` prints a markdown table and returns the figures.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from bench.overhead import TASK, train_once
from tests.helpers import STUBS
from tests.postgres import PostgresCluster, PostgresUnavailable, PrefectServer, run_flow_subprocess
MODES = {"sync": ["rollout.max_staleness=0"],
         "max_staleness=1": ["rollout.max_staleness=1", "train.old_policy=decoupled", "train.off_policy_correction=tis"],
         "stream": ["rollout.mode=stream", "rollout.max_staleness=4", "train.old_policy=decoupled", "train.off_policy_correction=tis"]}
# --long-tail: 1 response in 20 is 8x the median (the stub's batched-decode cost model), streamed 8 tokens a segment
LONG_TAIL = ["rollout.stub_lengths=long_tail", "rollout.max_new_tokens=64", "rollout.segment_tokens=8", "placement.stream_chunk=4"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.overlap", description=__doc__.split("\n\n")[0])
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--steps", type=int, default=8, help="RL steps per run (default 8)")
    p.add_argument("--warmup", type=int, default=2, help="first steps left out (default 2: the pipeline fills)")
    p.add_argument("--repeats", type=int, default=2, help="alternated runs per mode (default 2)")
    p.add_argument("--rollout-spt", type=float, default=0.012, help="rollout.stub_seconds_per_token (default 0.012)")
    p.add_argument("--train-spt", type=float, default=0.009, help="train.stub_seconds_per_token (default 0.009)")
    p.add_argument("--carry-age", type=int, metavar="N", help="sampling.max_carry_age in both modes (default: the config's, 1). "
                   "0 makes both modes generate the same prompts per step: with max_staleness=1 a group carried over "
                   "is two versions old by the step that would train it, so it is dropped and generated again")
    p.add_argument("--long-tail", action="store_true", help="the stubs' long-tailed lengths: 1 response in 20 is 8x the "
                   "median, a generate call costs its longest x its sequences (rollout.stub_lengths=long_tail)")
    p.add_argument("--modes", default=",".join(MODES), help=f"which of {', '.join(MODES)} (default: all)")
    p.add_argument("--real", action="store_true", help="also the real torch engines (tiny demo models), dp=--dp")
    p.add_argument("--no-stub", action="store_true", help="leave out the timing stubs (with --real: the real engines only)")
    p.add_argument("--keep", metavar="DIR", help="keep the work folder in DIR")
    p.add_argument("--store", metavar="DIR", help="a store an earlier --keep prepared (DIR/store): no prepare")
    return p.parse_args(argv)


def figures(history: list[dict], warmup: int) -> dict:
    rows = history[warmup:-1]  # the last step commits the run's checkpoint: left out, as bench/overhead.py does
    mean = lambda key: statistics.fmean(m[key] for m in rows)  # noqa: E731
    return {"step_s": mean("step_s"), "r_s": mean("rollout_s") + mean("genrm_score_s") + mean("rollout_and_score_s")
            + mean("dynamic_filter_s"), "train_s": mean("train_step_s") + mean("sync_weights_s"),
            "waves": mean("waves"), "prompts": mean("prompts"), "train_tokens": mean("train_tokens"),  # dynamic sampling's waves per step: the modes draw different samples (module docstring)
            "staleness": {k: sum(m["staleness"].get(k, 0) for m in rows) for k in sorted({k for m in rows for k in m["staleness"]})},
            "is_ratio_mean": statistics.fmean(m["train"].get("is_ratio_mean", 1.0) for m in rows),
            "is_ratio_max": max(m["train"].get("is_ratio_max", 1.0) for m in rows),
            "is_truncated_fraction": statistics.fmean(m["train"].get("is_truncated_fraction", 0.0) for m in rows),
            "rollout_busy": mean("rollout_busy_s") / mean("step_s"),  # the lanes' busy fractions: the bubble is the rest
            "train_busy": (mean("train_step_s") + mean("sync_weights_s")) / mean("step_s"),
            "stale_dropped": mean("stale_dropped"), "mixed": statistics.fmean(m["train"].get("mixed_version_fraction", 0.0) for m in rows)}


def compare(server, root: str, work: Path, args, engines: str, extra: list[str]) -> dict:
    modes = args.modes.split(",")
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    for rep in range(args.repeats):
        for mode in (modes if rep % 2 == 0 else modes[::-1]):  # alternate which goes first
            history, wall, _ = train_once(server, root, work, "bench", args.dp, args.steps, f"{engines}-{mode}-r{rep}".replace("=", "").replace("_", ""),
                                          extra=[*extra, *MODES[mode]], prefix="overlap", timeout=1800)
            fig = figures(history, args.warmup) | {"wall_s": wall}
            runs[mode].append(fig)
            print(f"  {engines:5s} {mode:16s} run {rep}: step {fig['step_s']:.2f}s, busy rollout {fig['rollout_busy']:.2f} "
                  f"train {fig['train_busy']:.2f}, stale-dropped {fig['stale_dropped']:.2f}, "
                  f"mixed-version samples {fig['mixed']:.3f}, {fig['waves']:.2f} waves, {fig['prompts']:.1f} prompts (r {fig['r_s']:.2f}s, "
                  f"slowest train + sync {fig['train_s']:.2f}s), "
                  f"staleness {fig['staleness']}, IS ratio mean {fig['is_ratio_mean']:.3f} max {fig['is_ratio_max']:.3f}, "
                  f"{fig['train_tokens']:.0f} trained tokens, run {wall:.0f}s", flush=True)
    pooled = {mode: {k: statistics.fmean(f[k] for f in figs) for k in ("step_s", "r_s", "waves", "prompts", "is_ratio_mean", "stale_dropped", "mixed",
                                                                 "rollout_busy", "train_busy", "train_tokens")}
              | {"is_ratio_max": max(f["is_ratio_max"] for f in figs), "staleness": figs[-1]["staleness"]}
              for mode, figs in runs.items()}
    r = pooled["sync"]["r_s"]
    t = pooled["sync"]["t_s"] = pooled["sync"]["step_s"] - r  # the rest of the synchronous step (module docstring)
    per_token = {m: pooled[m]["step_s"] / pooled[m]["train_tokens"] for m in modes}  # a mode that trains longer answers later
    return {"runs": runs, "pooled": pooled, "ratios": {m: pooled[m]["step_s"] / pooled["sync"]["step_s"] for m in modes},
            "token_ratios": {m: per_token[m] / per_token["sync"] for m in modes}, "bound": max(r, t) / (r + t)}


def main(argv=None) -> dict:
    args = parse_args(argv)
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="yattflow-overlap-"))
    work.mkdir(parents=True, exist_ok=True)
    cluster, server, out = None, None, {}
    try:
        try:
            cluster = PostgresCluster().start()
            server = PrefectServer(cluster.url, home=work / "prefect").start()
        except PostgresUnavailable:
            cluster, server = None, PrefectServer(home=work / "prefect").start()
        root = args.store or str(work / "store")
        if not args.store:
            start = time.perf_counter()
            run_flow_subprocess(server.url, "flows.prepare:prepare", log_path=work / "prepare.log", overrides=TASK + [f"storage.root={root}"])
            print(f"prepared {root} ({time.perf_counter() - start:.0f}s)", flush=True)
        carry = [] if args.carry_age is None else [f"sampling.max_carry_age={args.carry_age}"]
        if not args.no_stub:
            out["stub"] = compare(server, root, work, args, "stub", [*carry, *STUBS, f"rollout.stub_seconds_per_token={args.rollout_spt}",
                                                                     f"train.stub_seconds_per_token={args.train_spt}",
                                                                     *(LONG_TAIL if args.long_tail else [])])
        if args.real:
            out["real"] = compare(server, root, work, args, "torch", carry)
    finally:
        if server is not None:
            server.stop()
        if cluster is not None:
            cluster.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(report(out, args))
    return out


def report(out: dict, args) -> str:
    carry = "" if args.carry_age is None else f", sampling.max_carry_age={args.carry_age}"
    modes = args.modes.split(",")
    lines = [f"dp={args.dp}{carry}{', long-tailed lengths' if args.long_tail else ''}, {args.steps} steps per run (first "
             f"{args.warmup} and the last left out), {args.repeats} alternated runs per mode", "",
             "| engines | r (s) | t = sync step - r (s) | " + " | ".join(f"{m} step (s)" for m in modes) + " | waves, prompts per step | "
             + " | ".join(f"{m} / sync" for m in modes if m != "sync") + " | bound max(r,t)/(r+t) | stale-dropped per step | busy rollout, train | "
             "trained tokens per step | " + " | ".join(f"{m} / sync per trained token" for m in modes if m != "sync") + " |",
             "|---" * (7 + 3 * len(modes) - 1) + "|"]
    for engines, fig in out.items():
        p = fig["pooled"]
        lines.append(f"| {engines} | {p['sync']['r_s']:.2f} | {p['sync']['t_s']:.2f} | " + " | ".join(f"{p[m]['step_s']:.2f}" for m in modes)
                     + " | " + " / ".join(f"{p[m]['waves']:.2f}, {p[m]['prompts']:.1f}" for m in modes) + " | "
                     + " | ".join(f"{fig['ratios'][m]:.2f}" for m in modes if m != "sync") + f" | {fig['bound']:.2f} | "
                     + " / ".join(f"{p[m]['stale_dropped']:.2f}" for m in modes) + " | "
                     + " / ".join(f"{p[m]['rollout_busy']:.2f}, {p[m]['train_busy']:.2f}" for m in modes) + " | "
                     + " / ".join(f"{p[m]['train_tokens']:.0f}" for m in modes) + " | "
                     + " | ".join(f"{fig['token_ratios'][m]:.2f}" for m in modes if m != "sync") + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
