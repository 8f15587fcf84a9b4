"""Parallel controllers against a single controller: the parent process's memory and the bytes
that pass through it, at 1x and 10x data, with real pictures through a vision-language policy.

    .venv/bin/python -m bench.controller                    # ~3 min on 2 CPU cores, ~1 more to prepare
    .venv/bin/python -m bench.controller --store DIR        # prepare into DIR once, reuse it afterwards
    .venv/bin/python -m bench.controller --scales 1,10 --steps 4 --image-kb 200

**Data.** Real pictures through a vision-language policy: the test suite's tiny store (``TASK``
of bench/overhead.py, built by the real ``prepare`` flow) made as the vision demo's
(``prepare.task=vision``: a tiny Idefics3 policy SFT'd on pictures of two digits, the exact-match
rule as the reward, no judge), and every training prompt's picture re-encoded as a real PNG of
about ``--image-kb`` (100) KB (the same digits enlarged, with pixel noise so that it does not
compress away). The engine hosts read the pictures of each wave from the prompts dataset, decode
them and run them through the processor (the rollout engine, and the trainer on its own host, from
each row's ``prompt_row``); rollouts → scored → experience carry that row, never the bytes.
*N x data*: ``sampling.prompts_per_wave`` and ``sampling.target_groups`` times N (4 and 2 at 1x),
so every stage moves N times the rows and the hosts read N times the pictures.

**Variants** (same engines: the torch policy (rollout) and torch trainer in one engine host per DP
group; same prompts, seeds, config and stage tasks; ``--dp`` 2 groups; fresh subprocess each):

- **yattflow**: the real ``flows.training:train`` flow (DP-group sub-flows; data moves engine
  host → object storage → engine host; the parent flows carry URIs and small metrics).
- **single-controller**: ``single_controller_train`` below, built from the same ``tasks``: one
  flow per iteration runs each stage for every group at once (a global barrier per stage, as a
  driver does) and, after every stage, the parent *gathers* every group's output from storage
  into its own memory (``datasets.read_table``, then one concatenated Arrow table: the driver's
  batch, held until the next stage's gather), and *scatters* each group's slice back to the URI
  the next stage reads, before the next stage's tasks run. Dynamic-sampling waves follow the
  sub-flow's rule (``flows.sampling.plan_wave``; a group that reached its target sits out the
  remaining waves); the carried-over groups are gathered too. It holds the batch as Arrow, the
  most compact a driver could (veRL keeps Python/NumPy objects), and does not gather the prompts
  it hands out (the hosts read their prompt streams themselves): a conservative baseline. It
  skips the held-out evaluation (off in both), the last step's checkpoint and the final model
  export, which the hosts do without sample data passing the parent.

**Figures** (the parent process is the one that runs the flow; its engine hosts are separate
processes and not counted):

- peak RSS: the parent's own high-water mark (``VmHWM`` of /proc/self/status, read by itself at
  its end; not ``ru_maxrss``, which Linux carries across ``execve`` from the process that forked
  it, here this bench), and the peak of its RSS sampled every 50 ms with psutil from this process;
  its RSS when the first iteration starts (imports, Prefect, hosts up), and what the iterations
  added on top;
- bytes through the parent per iteration: the host channel (commands, answers, host log lines:
  bytes sent and received on the connections, counted in the parent), the sample data gathered
  and scattered (in-memory Arrow bytes, and the Parquet bytes read and written), and every byte
  the parent read or wrote by system call (psutil ``read_chars + write_chars``: storage, sockets,
  the Prefect API);
- iteration wall time, and the parent's seconds in gather/scatter.

Per-iteration figures are means over the steps before the last (the last writes a checkpoint).
``main(argv)`` returns the figures and ``rows`` ({figure, yattflow, baseline, ratio}: ratio =
yattflow / single-controller; the headline figures, for ``python -m bench``) and prints markdown
tables.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("OMP_NUM_THREADS", "1")  # one thread per engine process

from bench.overhead import TASK  # noqa: E402  (the tiny store bench/overhead.py prepares, and its run shape)

VARIANTS = ("yattflow", "single-controller")
MB = 1e6


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.controller", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scales", default="1,4,10", help="data scales, comma-separated (default 1,4,10; growth: first to last)")
    p.add_argument("--dp", type=int, default=2, help="DP groups (default 2)")
    p.add_argument("--steps", type=int, default=3, help="RL steps per run (default 3; the last is left out of per-iteration figures)")
    p.add_argument("--image-kb", type=int, default=100, help="image (or clip) bytes per prompt, KB (default 100)")
    p.add_argument("--video", action="store_true", help="the video task instead (prepare.task=video): a clip of two frames "
                   "per prompt, decoded on the hosts; the single controller gathers the clips and their frames too")
    p.add_argument("--db", choices=("postgresql", "sqlite"), default="postgresql",
                   help="Prefect server database (default postgresql; sqlite where PostgreSQL is not installed)")
    p.add_argument("--store", metavar="DIR", help="storage root to prepare into (or reuse); default: a temporary folder")
    p.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    # internal: one variant's run, in the fresh process this bench starts
    p.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--overrides", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# --------------------------------------------------------------------------- measuring the parent


class Meter:
    """What passes through this (the parent) process: host-channel bytes, gathered/scattered
    sample data, system-call I/O; a snapshot around every iteration."""

    def __init__(self):
        import psutil

        self.proc = psutil.Process()
        self.lock = threading.Lock()
        self.counters = {"channel_sent": 0, "channel_recv": 0, "gather_arrow": 0, "scatter_arrow": 0,
                         "gather_parquet": 0, "scatter_parquet": 0, "driver_s": 0.0}
        self.steps: list[dict] = []
        self.first_iteration_rss: int | None = None

    def add(self, key: str, value) -> None:
        with self.lock:
            self.counters[key] += value

    def snapshot(self) -> dict:
        io = self.proc.io_counters()
        with self.lock:
            return {"t": time.perf_counter(), "rss": self.proc.memory_info().rss,
                    "io": io.read_chars + io.write_chars, **self.counters}

    def begin(self) -> dict:
        snap = self.snapshot()
        if self.first_iteration_rss is None:
            self.first_iteration_rss = snap["rss"]
        return snap

    def end(self, step: int, before: dict, metrics) -> None:
        """``metrics``: the step's (yattflow's ``StepMetrics``, the single controller's dict)."""
        metrics = metrics if isinstance(metrics, dict) else metrics.model_dump()
        after = self.snapshot()
        delta = {k: after[k] - before[k] for k in before if k not in ("rss",)}
        self.steps.append({"step": step, "seconds": delta.pop("t"), "rss_after": after["rss"], **delta,
                           "samples": metrics.get("samples"), "waves": metrics.get("waves"),
                           "kept_groups": metrics.get("kept_groups"), "reward": metrics.get("reward")})

    def count_host_channel(self) -> None:
        """Count the bytes on every connection to an engine host (``engines.wire.channel.HostClient``)."""
        from engines.wire import channel

        meter, call = self, channel.HostClient.call

        class Counting:
            def __init__(self, conn):
                self._conn = conn

            def send_bytes(self, data, *a, **k):
                meter.add("channel_sent", len(data))
                return self._conn.send_bytes(data, *a, **k)

            def recv_bytes(self, *a, **k):
                data = self._conn.recv_bytes(*a, **k)
                meter.add("channel_recv", len(data))
                return data

            def __getattr__(self, name):
                return getattr(self._conn, name)

        def counted_call(client, request):
            if not isinstance(client._conn, Counting):
                client._conn = Counting(client._conn)
            return call(client, request)

        channel.HostClient.call = counted_call


METER: Meter | None = None


# --------------------------------------------------------------------------- the single-controller baseline


class Driver:
    """The single controller's data path: after a stage, read every group's output into this
    process, keep the concatenated batch, write each group's slice back for the next stage."""

    def __init__(self, meter: Meter):
        self.meter = meter
        self.batch = None  # the driver's batch: every group's rows of the last stage
        self.images = None  # a vision batch: its prompts' raw images and its samples' pixel tensors

    def gather_scatter(self, uris: list[str], schema) -> int:
        import pyarrow as pa

        from storage import datasets, objectstore

        if not uris:
            return 0
        start = time.perf_counter()
        self.batch = self.images = None  # the previous stage's batch is released first (conservative: no union)
        tables = []
        for uri in uris:  # gather
            fs, path = objectstore.fs_for(uri)
            self.meter.add("gather_parquet", fs.size(path))
            tables.append(datasets.read_table(uri, schema))
        self.batch = pa.concat_tables(tables)
        self.meter.add("gather_arrow", self.batch.nbytes)
        offset = 0
        for uri, table in zip(uris, tables):  # scatter: each group's slice, back where the next stage reads it
            part = self.batch.slice(offset, table.num_rows)
            offset += table.num_rows
            self.meter.add("scatter_arrow", part.nbytes)
            datasets.write_table(uri, part, schema)
            fs, path = objectstore.fs_for(uri)
            self.meter.add("scatter_parquet", fs.size(path))
        del tables
        self.meter.add("driver_s", time.perf_counter() - start)
        return self.batch.num_rows

    def gather_images(self, config) -> None:
        """What a driver gathers for a vision-language batch (veRL's ``multi_modal_data`` and
        ``multi_modal_inputs``): the raw images (and clips, with their frames) of the batch's
        prompts, and the processor's pixel tensors of every sample, held until the next stage's gather."""
        from engines.backends import multimodal
        from engines.host.prompts import Frames
        from storage import datasets, objectstore

        start = time.perf_counter()
        rows = self.batch.column("prompt_row").to_pylist()
        reader = datasets.PromptReader(config.uri(config.data.prompts))
        processor = multimodal.load_processor(objectstore.local_folder(config.uri(config.model.policy)))
        read = dict(zip(sorted(set(rows)), reader.rows(sorted(set(rows)))))
        frames = Frames.of(config.data, processor)
        images = {row: frames.row(r, reader.uri)["images"] for row, r in read.items()}  # a clip's frames among them
        pixels = multimodal.PixelCache(processor, keep=False).batch([images[row] for row in rows], "cpu")
        self.images = (read, images, pixels)
        self.meter.add("gather_arrow", sum(len(b) for r in read.values() for b in r["videos"] or [])
                       + sum(len(b) for ims in images.values() for b in ims)
                       + sum(t.numel() * t.element_size() for t in pixels.values()))
        self.meter.add("driver_s", time.perf_counter() - start)


def _single_controller_flows():
    """The baseline's flows (built on first use, so that importing this module stays light)."""
    from prefect import flow, get_run_logger

    from tasks import stages as tasks
    from flows.sampling import GroupSampling, plan_wave
    from engines.config import load_config
    from flows.hosts import engine_hosts
    from storage import datasets, objectstore

    @flow(name="single-controller-iteration", flow_run_name="sc-iteration-{step:04d}")
    async def sc_iteration(config, step, cursors, sampling):  # no annotations: this flow is local (RunConfig)
        s, dp, run = config.sampling, config.dp, tasks.Run.of(config)
        driver = Driver(METER)
        start = time.perf_counter()
        states = [GroupSampling.from_dict(x) for x in sampling]
        carry_in, have = [st.carry for st in states], [st.carried for st in states]
        cursors, active, last, samples, rewards, waves = list(cursors), list(range(dp)), {}, 0, 0.0, 0
        for wave in range(s.max_waves):
            waves += 1
            counts = {g: plan_wave(s, states[g], have[g]) for g in active}
            rolled = await asyncio.gather(*(tasks.rollout(run, step, g, wave, cursors[g], counts[g]) for g in active))
            for g, r in zip(active, rolled):
                cursors[g] = r.cursor
                samples += r.samples
            driver.gather_scatter([r.uri for r in rolled], datasets.ROLLOUTS)
            driver.gather_images(config)  # and, as a vision driver does, the batch's images and pixel tensors
            scored = await asyncio.gather(*(tasks.genrm_score(run, step, g, wave) for g in active))
            rewards += sum(x.reward_mean * r.samples for x, r in zip(scored, rolled))
            driver.gather_scatter([x.uri for x in scored], datasets.SCORED)
            kept = await asyncio.gather(*(tasks.dynamic_filter(run, step, g, wave, s.target_groups, config.train.algorithm.needs.critic, carry_in[g]) for g in active))
            driver.gather_scatter([k.uri for k in kept], datasets.EXPERIENCE)
            driver.gather_scatter([k.carry for k in kept if k.carry], datasets.CARRY)
            for g, k in zip(active, kept):
                states[g].observe(counts[g], k.new_kept, s.keep_ratio_decay)
                have[g], last[g] = k.kept, k
            active = [g for g in active if not last[g].enough]
            if not active:
                break
        for g in range(dp):
            states[g].carry, states[g].carried = last[g].carry, last[g].carried_out
        trained = await asyncio.gather(*(tasks.train_step(run, step, g) for g in range(dp)))
        await asyncio.gather(*(tasks.sync_weights(run, g, config.rollout.sync_timeout_s) for g in range(dp)))
        shas = {t.params_sha for t in trained}
        if len(shas) != 1:
            raise RuntimeError(f"step {step}: DP replicas diverged ({sorted(shas)})")
        driver.batch = None
        return {"step": step, "samples": samples, "reward": rewards / max(samples, 1), "waves": waves,
                "kept_groups": sum(last[g].kept for g in range(dp)), "cursors": cursors,
                "sampling": [st.to_dict() for st in states], "seconds": time.perf_counter() - start}

    @flow(name="single-controller-train", flow_run_name="sc-train")
    async def single_controller_train(overrides: list[str]) -> dict:
        config = load_config(None, overrides)
        objectstore.check_reachable(config.uri(""))
        history = []
        async with engine_hosts(config) as hosts:
            await tasks.validate_inputs(config)
            await asyncio.gather(*(tasks.setup_engines(config, g, None, hosts.master) for g in range(config.dp)))
            cursors, sampling = [0] * config.dp, [None] * config.dp
            for step in range(config.steps):
                before = METER.begin()
                metrics = await sc_iteration(config, step, cursors, sampling)
                METER.end(step, before, metrics)
                cursors, sampling = metrics["cursors"], metrics["sampling"]
                history.append(metrics)
                get_run_logger().info("step %d: %d samples, reward %.3f, %.1fs", step, metrics["samples"],
                                      metrics["reward"], metrics["seconds"])
        return {"history": history}

    return single_controller_train


# --------------------------------------------------------------------------- one run (child process)


def child(args) -> None:
    global METER
    overrides = json.loads(args.overrides)
    METER = Meter()
    METER.count_host_channel()
    if args.child == "yattflow":
        from flows import training

        original = training.iteration

        async def iteration(config, step, *a, **k):  # the real iteration sub-flow, with a snapshot around it
            before = METER.begin()
            metrics = await original(config, step, *a, **k)
            METER.end(step, before, metrics)
            return metrics

        training.iteration = iteration
        asyncio.run(training.train(overrides=overrides))
    else:
        asyncio.run(_single_controller_flows()(overrides=overrides))
    Path(args.result).write_text(json.dumps({
        "peak_rss": high_water_mark(),
        "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # KiB; inherited across exec: not used
        "first_iteration_rss": METER.first_iteration_rss, "rss_end": METER.proc.memory_info().rss,
        "steps": METER.steps,
    }))


def high_water_mark() -> int:
    """Peak RSS of this process's own address space (bytes), from /proc/self/status ``VmHWM``."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def run_variant(api_url: str, variant: str, overrides: list[str], work: Path) -> dict:
    """One variant in a fresh process; its RSS is sampled from here every 50 ms (the process alone,
    not its engine hosts)."""
    import psutil

    name = next(o.split("=", 1)[1] for o in overrides if o.startswith("name="))
    result, log = work / f"{name}.json", work / f"{name}.log"
    env = {**os.environ, "PREFECT_API_URL": api_url, "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "bench.controller", "--child", variant, "--overrides", json.dumps(overrides),
           "--result", str(result)]
    start, peak, samples = time.perf_counter(), 0, []
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        watched = psutil.Process(proc.pid)
        while proc.poll() is None:
            try:
                rss = watched.memory_info().rss
            except psutil.Error:
                break
            peak = max(peak, rss)
            samples.append((round(time.perf_counter() - start, 2), rss))
            time.sleep(0.05)
        proc.wait()
    if proc.returncode != 0 or not result.exists():
        raise RuntimeError(f"{variant} run failed ({proc.returncode}):\n{log.read_text(errors='replace')[-6000:]}")
    out = json.loads(result.read_text())
    out.update(psutil_peak=peak, wall_s=time.perf_counter() - start, rss_samples=samples[::10])
    return out


# --------------------------------------------------------------------------- data


# the vision run: the vision demo's task and reward on the tiny store (a 32-wide language model of one head)
VISION = ["prepare.task=vision", "reward.genrm_weight=0", "reward.rule_weight=1", "sft.heads=1"]
VIDEO = ["prepare.task=video", "reward.genrm_weight=0", "reward.rule_weight=1", "sft.heads=1", "data.max_frames=4"]  # --video


def add_pictures(root: str, kb: int, task: list[str] = VISION) -> int:
    """Re-encode every training prompt's picture as a real PNG of about ``kb`` KB: the same digits
    enlarged, with pixel noise that PNG cannot compress away (unless done already); the total bytes.
    ``task`` VIDEO: every clip instead, as an H.264 MP4 of its two frames enlarged, with noise."""
    import io

    import numpy as np
    import pyarrow as pa
    from PIL import Image

    from engines.backends import video
    from engines.config import load_config
    from engines.demo.vision import encode_clip
    from storage import datasets, objectstore

    config = load_config(None, TASK + task + [f"storage.root={root}"])
    column = "videos" if task is VIDEO else "images"
    side = int((kb * 1024 / 1.5 / (2 if task is VIDEO else 1)) ** 0.5)  # noise of +-8 over 3 channels: ~1.5 bytes a pixel
    side -= side % 2  # H.264's 4:2:0
    total = 0
    for part in objectstore.list_files(config.uri(config.data.prompts), suffix=".parquet"):
        table = datasets.read_table(part, datasets.PROMPTS)
        images = table.column(column).to_pylist()
        if all(len(im[0]) > kb * 512 for im in images):
            total += sum(len(im[0]) for im in images)
            continue
        rng, out = np.random.default_rng(0), []

        def noisy(picture: Image.Image) -> Image.Image:
            big = np.asarray(picture.convert("RGB").resize((side, side)), dtype=np.int16)
            return Image.fromarray(np.clip(big + rng.integers(-8, 8, big.shape), 0, 255).astype(np.uint8))

        for (blob,) in images:
            if task is VIDEO:
                out.append([encode_clip([noisy(Image.open(io.BytesIO(f))) for f in video.frames(blob, 1.0, 8)])])
                continue
            buffer = io.BytesIO()
            noisy(Image.open(io.BytesIO(blob))).save(buffer, format="PNG")
            out.append([buffer.getvalue()])
        table = table.set_column(table.schema.get_field_index(column), column, pa.array(out, pa.list_(pa.binary())))
        datasets.write_table(part, table, datasets.PROMPTS)
        total += sum(len(im[0]) for im in out)
    return total


def prepare_store(api_url: str, root: str, work: Path, task: list[str] = VISION) -> float:
    """The tiny store of bench/overhead.py (same ``TASK``, same ``prepare`` flow in a fresh process),
    unless ``root`` has it already; the seconds it took."""
    from engines.config import load_config
    from storage import objectstore
    from tests.postgres import run_flow_subprocess

    config = load_config(None, TASK + task + [f"storage.root={root}"])
    needed = [objectstore.join(config.uri(config.model.policy), "MANIFEST.json"),
              objectstore.join(config.uri(config.data.prompts), "part-00000.parquet")]
    if all(objectstore.exists(u) for u in needed):
        return 0.0
    start = time.perf_counter()
    run_flow_subprocess(api_url, "flows.prepare:prepare", log_path=work / "prepare.log",
                        overrides=TASK + task + [f"storage.root={root}"])
    return time.perf_counter() - start


def stage_bytes(root: str, run: str, step: int) -> int:
    """Parquet bytes the hosts wrote for one step (rollouts, scored, experience, carry)."""
    folder = Path(root) / "runs" / run / "steps" / f"{step:06d}"
    return sum(f.stat().st_size for f in folder.rglob("*.parquet"))


# --------------------------------------------------------------------------- figures and tables


def figures(run: dict, root: str, name: str) -> dict:
    steps = run["steps"][:-1] or run["steps"]  # the last step writes a checkpoint (yattflow)
    mean = lambda key: statistics.fmean(s[key] for s in steps)  # noqa: E731
    return {
        "peak_rss_mb": run["peak_rss"] / MB, "psutil_peak_mb": run["psutil_peak"] / MB,
        "first_iteration_rss_mb": run["first_iteration_rss"] / MB,
        "added_mb": (run["peak_rss"] - run["first_iteration_rss"]) / MB,
        "channel_kb": (mean("channel_sent") + mean("channel_recv")) / 1e3,
        "gather_scatter_arrow_mb": (mean("gather_arrow") + mean("scatter_arrow")) / MB,
        "gather_scatter_parquet_mb": (mean("gather_parquet") + mean("scatter_parquet")) / MB,
        "through_parent_mb": (mean("channel_sent") + mean("channel_recv") + mean("gather_arrow") + mean("scatter_arrow")) / MB,
        "syscall_io_mb": mean("io") / MB,
        "iteration_s": mean("seconds"), "driver_s": mean("driver_s"),
        "samples": mean("samples"), "waves": mean("waves"),
        "stage_parquet_mb": statistics.fmean(stage_bytes(root, name, s["step"]) for s in steps) / MB,
        "measured_steps": len(steps), "wall_s": run["wall_s"],
    }


ROWS = [
    ("**parent peak RSS (MB)**, VmHWM", "peak_rss_mb", "{:.0f}"),
    ("parent peak RSS, psutil every 50 ms (MB)", "psutil_peak_mb", "{:.0f}"),
    ("parent RSS when the first iteration starts (MB)", "first_iteration_rss_mb", "{:.0f}"),
    ("peak RSS added by the iterations (MB)", "added_mb", "{:.1f}"),
    ("**bytes through the parent per iteration (MB)**: host channel + sample data gathered/scattered", "through_parent_mb", "{:.3f}"),
    ("… host channel: commands, answers, host logs (KB)", "channel_kb", "{:.1f}"),
    ("… sample data gathered + scattered, Arrow in memory (MB)", "gather_scatter_arrow_mb", "{:.1f}"),
    ("… the same as Parquet read + written (MB)", "gather_scatter_parquet_mb", "{:.1f}"),
    ("parent read+write system calls per iteration: storage, sockets, Prefect API (MB)", "syscall_io_mb", "{:.2f}"),
    ("stage outputs the hosts wrote per iteration, Parquet (MB)", "stage_parquet_mb", "{:.1f}"),
    ("rollout samples per iteration", "samples", "{:.0f}"),
    ("rollout waves per iteration (max over groups)", "waves", "{:.1f}"),
    ("iteration wall time (s)", "iteration_s", "{:.2f}"),
    ("… of which the parent's gather/scatter (s)", "driver_s", "{:.2f}"),
]


# the figures of ``rows`` (the combined table of ``python -m bench``); this module prints all of ROWS
KEY = ("peak_rss_mb", "added_mb", "through_parent_mb", "syscall_io_mb", "samples", "iteration_s")


def ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def report(results: dict, scales: list[int], args) -> tuple[str, list[dict]]:
    rows: list[dict] = []
    lines = [f"\n### Parallel controllers vs a single controller: the parent process (dp={args.dp}, {args.steps} steps, "
             f"a ~{args.image_kb} KB {'MP4 of two frames' if args.video else 'PNG'} per prompt, G=4; torch engines, a tiny VLM; "
             "per-iteration figures: mean of steps "
             f"0..{args.steps - 2})\n", "| figure | yattflow | single-controller | ratio (yattflow / single-controller) |",
             "|---|---:|---:|---:|"]
    for scale in scales:
        y, b = results[scale]["yattflow"], results[scale]["single-controller"]
        for label, key, fmt in ROWS:
            r = ratio(y[key], b[key])
            figure = f"{scale}× data: {label}"
            if key in KEY:
                rows.append({"figure": figure.replace("**", ""), "yattflow": y[key], "baseline": b[key], "ratio": r})
            lines.append(f"| {figure} | {fmt.format(y[key])} | {fmt.format(b[key])} | {'–' if r is None else f'{r:.3f}'} |")
    if len(scales) > 1:
        lo, hi = scales[0], scales[-1]
        lines += ["", f"#### Growth from {lo}× to {hi}× data (goal: yattflow's peak RSS ≤ +5%; the baseline's grows with the data)\n",
                  "| figure | yattflow | single-controller | ratio (yattflow / single-controller) |", "|---|---:|---:|---:|"]
        for label, key, kind in (("parent peak RSS growth", "peak_rss_mb", "pct"),
                                 ("peak RSS added by the iterations, growth (× the " + f"{lo}× figure)", "added_mb", "x"),
                                 ("bytes through the parent per iteration, growth (×)", "through_parent_mb", "x"),
                                 ("stage outputs the hosts wrote per iteration, growth (×)", "stage_parquet_mb", "x")):
            vals = {}
            for v in VARIANTS:
                a, z = results[lo][v][key], results[hi][v][key]
                vals[v] = (z / a - 1) if kind == "pct" else (z / a if a else float("nan"))
            r = ratio(vals["yattflow"], vals["single-controller"])
            fmt = (lambda x: f"{100 * x:+.1f}%") if kind == "pct" else (lambda x: f"{x:.2f}×")
            rows.append({"figure": f"{lo}×→{hi}× data: {label}", "yattflow": vals["yattflow"],
                         "baseline": vals["single-controller"], "ratio": r})
            lines.append(f"| {label} | {fmt(vals['yattflow'])} | {fmt(vals['single-controller'])} | {'–' if r is None else f'{r:.3f}'} |")
        growth = results[hi]["yattflow"]["peak_rss_mb"] / results[lo]["yattflow"]["peak_rss_mb"] - 1
        lines.append(f"\nyattflow parent peak RSS {lo}× → {hi}×: {100 * growth:+.1f}% "
                     f"(goal ≤ +5%: {'met' if growth <= 0.05 else 'NOT met'}).")
    same = all([(x["samples"], x["waves"], x["kept_groups"], round(x["reward"], 6)) for x in results[s][v]["raw"]["steps"]]
                   == [(x["samples"], x["waves"], x["kept_groups"], round(x["reward"], 6))
                       for x in results[s]["yattflow"]["raw"]["steps"]] for s in scales for v in VARIANTS)
    lines.append(f"Same work in both variants (per step: samples, waves, kept groups, mean reward equal): {'yes' if same else 'NO'}.")
    curve = ", ".join(f"{s}×: " + " / ".join(f"{results[s][v]['peak_rss_mb']:.0f}" for v in VARIANTS) for s in scales)
    lines.append(f"Peak RSS curve, yattflow / single-controller (MB): {curve}.")
    text = "\n".join(lines)
    print(text)
    return text, rows


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.child:
        child(args)
        return {}
    from tests.postgres import PostgresCluster, PostgresUnavailable, PrefectServer

    scales = [int(x) for x in args.scales.split(",") if x.strip()]
    t0 = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="yattflow-bench-controller-", dir=os.environ.get("YATTFLOW_BENCH_DIR")))
    root = args.store or str(work / "store")
    cluster, server, db = None, None, args.db
    results: dict = {}
    try:
        if db == "postgresql":
            try:
                cluster = PostgresCluster().start()
            except PostgresUnavailable as e:
                print(f"PostgreSQL unavailable ({e}); using SQLite", flush=True)
                db, cluster = "sqlite", None
        server = PrefectServer(cluster.url if cluster else None, home=work / "prefect").start()
        print(f"prefect server up on {db} ({time.perf_counter() - t0:.0f}s)", flush=True)
        task = VIDEO if args.video else VISION
        prep = prepare_store(server.url, root, work, task)
        image_bytes = add_pictures(root, args.image_kb, task)
        print(f"store {root} ready ({prep:.0f}s to prepare; {image_bytes / MB:.0f} MB of {'clips' if args.video else 'pictures'} "
              "on the training prompts)", flush=True)
        for i, scale in enumerate(scales):
            results[scale] = {}
            for variant in (VARIANTS if i % 2 == 0 else VARIANTS[::-1]):  # alternate which goes first
                name = f"ctl-{'yatt' if variant == 'yattflow' else 'single'}-x{scale}"
                shutil.rmtree(Path(root) / "runs" / name, ignore_errors=True)  # a fresh run, not a resume
                overrides = TASK + task + [
                    f"storage.root={root}", f"name={name}", f"dp={args.dp}", f"steps={args.steps}", "threads_per_host=1",
                    "data.heldout=null", "checkpoint.every=1000", "rollout.backend=torch", "judge.backend=torch",
                    "train.backend=torch", f"sampling.prompts_per_wave={4 * scale}", f"sampling.target_groups={2 * scale}",
                ]
                run = run_variant(server.url, variant, overrides, work)
                results[scale][variant] = fig = figures(run, root, name) | {"raw": run}
                print(f"  {scale}x {variant:17s}: peak RSS {fig['peak_rss_mb']:.0f} MB (first iteration at "
                      f"{fig['first_iteration_rss_mb']:.0f} MB), {fig['through_parent_mb']:.2f} MB through the parent per "
                      f"iteration, {fig['samples']:.0f} samples, iteration {fig['iteration_s']:.1f}s, run {fig['wall_s']:.0f}s",
                      flush=True)
    finally:
        if server is not None:
            server.stop()
        if cluster is not None:
            cluster.stop()
        shutil.rmtree(work, ignore_errors=True)
    table, rows = report(results, scales, args)
    total = time.perf_counter() - t0
    print(f"\n(total {total:.0f}s)")
    out = {"args": {k: v for k, v in vars(args).items() if k not in ("child", "overrides", "result")}, "database": db,
           "figures": {s: {v: {k: x for k, x in f.items() if k != "raw"} for v, f in r.items()} for s, r in results.items()},
           "raw": {s: {v: f["raw"] for v, f in r.items()} for s, r in results.items()},
           "rows": rows, "table": table, "total_s": total}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    return out


if __name__ == "__main__":
    main()
